// gate = silu(gate) * up, elementwise.
#include "common.cuh"

extern "C" __global__ void silu_mul_f32(float* gate, const float* up, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        gate[i] = g / (1.0f + __expf(-g)) * up[i];
    }
}
