// Gated activations of the MLP, elementwise: gate = act(gate) * up.
#include "common.cuh"

extern "C" __global__ void silu_mul_f32(float* gate, const float* up, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        gate[i] = g / (1.0f + __expf(-g)) * up[i];
    }
}

// gate = gelu_tanh(gate) * up, elementwise (GeGLU; transformers' gelu_pytorch_tanh).
extern "C" __global__ void gelu_mul_f32(float* gate, const float* up, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        gate[i] = 0.5f * g * (1.0f + tanhf(0.7978846f * (g + 0.044715f * g * g * g))) * up[i];
    }
}

// gpt-oss's clamped SwiGLU, elementwise: g = min(gate, limit), u = clamp(up, -limit, limit),
// gate = (u + 1) * g * sigmoid(alpha * g).
extern "C" __global__ void swiglu_clamp_mul_f32(float* gate, const float* up, int n, float alpha, float limit) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        const float g = fminf(gate[i], limit);
        const float u = fminf(fmaxf(up[i], -limit), limit);
        gate[i] = (u + 1.0f) * (g / (1.0f + __expf(-alpha * g)));
    }
}
