// f32 activations -> bf16, so cuBLAS can multiply them with bf16 weights by GemmEx (bf16
// inputs, f32 accumulation). Round to nearest even; NaN stays NaN; bf16 has f32's range,
// so nothing saturates. (f16 weights go through f32 tiles instead: f16 activations would
// saturate at 65504.) Grid: ceil(n / 256); block: 256.
#include "common.cuh"

__device__ __forceinline__ u16 f32_to_bf16_bits(float f) {
    u32 b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (u16)((b >> 16) | 0x40);
    b += 0x7fffu + ((b >> 16) & 1u);
    return (u16)(b >> 16);
}

extern "C" __global__ void f32_to_bf16(const float* x, u16* out, unsigned long long n) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16_bits(x[i]);
}
