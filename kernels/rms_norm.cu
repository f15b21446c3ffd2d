// out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w, one block per row; w in f32, f16 or bf16.
#include "common.cuh"

template <typename W>
__device__ void rms_norm(const float* x, const u8* w, float* out, int cols, float eps, W load) {
    const float* xr = x + (size_t)blockIdx.x * cols;
    float* o = out + (size_t)blockIdx.x * cols;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    // IEEE division and sqrtf (this file compiles without fast math), as the CPU backend
    // computes it; rsqrtf would be the hardware's approximation (2 ulp).
    const float inv = 1.0f / sqrtf(ss / (float)cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = load(w, i) * (xr[i] * inv);
}

struct LoadF32 { __device__ float operator()(const u8* w, int i) const { return ((const float*)w)[i]; } };
struct LoadF16 { __device__ float operator()(const u8* w, int i) const { return f16_to_f32(load_u16(w + 2 * i)); } };
struct LoadBF16 { __device__ float operator()(const u8* w, int i) const { return bf16_to_f32(load_u16(w + 2 * i)); } };

extern "C" __global__ void rms_norm_f32(const float* x, const u8* w, float* out, int cols, float eps) { rms_norm(x, w, out, cols, eps, LoadF32()); }
extern "C" __global__ void rms_norm_f16(const float* x, const u8* w, float* out, int cols, float eps) { rms_norm(x, w, out, cols, eps, LoadF16()); }
extern "C" __global__ void rms_norm_bf16(const float* x, const u8* w, float* out, int cols, float eps) { rms_norm(x, w, out, cols, eps, LoadBF16()); }
