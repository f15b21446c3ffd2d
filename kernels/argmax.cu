// Sampling helpers on the device: greedy argmax per row (the first maximum, as the CPU
// sampler), so greedy decoding needs to copy back one id instead of a vocabulary of logits.
#include "common.cuh"

extern "C" __global__ void argmax_f32(const float* logits, int vocab, u32* out) {
    const float* l = logits + (size_t)blockIdx.x * vocab;
    __shared__ float best_v[256];
    __shared__ int best_i[256];
    float bv = -3.402823466e38f;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        if (l[i] > bv) { bv = l[i]; bi = i; }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < (unsigned)s) {
            const float ov = best_v[threadIdx.x + s];
            const int oi = best_i[threadIdx.x + s];
            if (ov > best_v[threadIdx.x] || (ov == best_v[threadIdx.x] && oi < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = (u32)best_i[0];
}
