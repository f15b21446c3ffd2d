// Residual and bias adds, and scaling.
#include "common.cuh"

// x += y, elementwise.
extern "C" __global__ void add_f32(float* x, const float* y, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

// out[r][c] += bias[c] for rows x cols, bias in f32.
extern "C" __global__ void add_bias_f32(float* out, const float* bias, int rows, int cols) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < rows * cols) out[i] += bias[i % cols];
}

// x *= s, elementwise (Gemma's embedding scale).
extern "C" __global__ void scale_f32(float* x, float s, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
