// f32 activations -> the 16-bit type of a dense weight, so cuBLAS can multiply them with
// GemmEx (bf16/f16 inputs, f32 accumulation). Round to nearest even; NaN stays NaN; f16
// saturates to infinity beyond 65504 as cvt.rn does. Grid: ceil(n / 256); block: 256.
#include "common.cuh"

__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (u16)(b >> 16);
}

extern "C" __global__ void f32_to_f16(const float* x, u16* out, unsigned long long n) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_f16_bits(x[i]);
}

extern "C" __global__ void f32_to_bf16(const float* x, u16* out, unsigned long long n) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16_bits(x[i]);
}
