// Shared helpers for the sluice kernels. Compiled by NVRTC at start (no toolkit headers:
// types and conversions are defined here).
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

// f16 -> f32 without cuda_fp16.h.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}

// f32 -> f16, round to nearest even (cvt.rn saturates to infinity beyond 65504).
__device__ __forceinline__ u16 f32_to_f16_bits(float f) {
    u16 h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(f));
    return h;
}

// A KV cache element as f32 and back: the cache is f32 or f16 (u16 bits).
__device__ __forceinline__ float kv_load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float kv_load(const u16* p, size_t i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ void kv_put(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void kv_put(u16* p, size_t i, float v) { p[i] = f32_to_f16_bits(v); }

__device__ __forceinline__ float bf16_to_f32(u16 h) {
    return __int_as_float(((u32)h) << 16);
}

__device__ __forceinline__ u16 load_u16(const u8* p) {
    return (u16)p[0] | ((u16)p[1] << 8);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

struct SumOp { __device__ float operator()(float a, float b) const { return a + b; } static constexpr float identity = 0.0f; };
struct MaxOp { __device__ float operator()(float a, float b) const { return fmaxf(a, b); } static constexpr float identity = -3.402823466e38f; };

// Block-wide reduction for blocks of up to 1024 threads; every thread gets the result.
template <typename Op>
__device__ __forceinline__ float block_reduce(float v, Op op) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) >> 5;
    v = (threadIdx.x < (unsigned)warps) ? partial[threadIdx.x] : Op::identity;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (threadIdx.x == 0) partial[0] = v;
    __syncthreads();
    v = partial[0];
    __syncthreads();
    return v;
}

__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, SumOp()); }
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, MaxOp()); }

// GGML block layouts (ggml-common.h), 32 weights per block.
//   q8_0: f16 d, 32 x i8                 value = d * q
//   q4_0: f16 d, 16 bytes of nibbles      value = d * (q - 8)
//   q4_1: f16 d, f16 m, 16 bytes          value = d * q + m
// In the 4-bit formats byte j holds element j (low nibble) and element j + 16 (high).
#define QK 32
#define Q8_0_BYTES 34
#define Q4_0_BYTES 18
#define Q4_1_BYTES 20

// Element i (0..31) of a block, dequantized.
__device__ __forceinline__ float deq_q8_0(const u8* b, int i) { return f16_to_f32(load_u16(b)) * (float)(i8)b[2 + i]; }
__device__ __forceinline__ float deq_q4_0(const u8* b, int i) {
    const u8 q = b[2 + (i & 15)];
    const int v = i < 16 ? (q & 15) : (q >> 4);
    return f16_to_f32(load_u16(b)) * (float)(v - 8);
}
__device__ __forceinline__ float deq_q4_1(const u8* b, int i) {
    const u8 q = b[4 + (i & 15)];
    const int v = i < 16 ? (q & 15) : (q >> 4);
    return f16_to_f32(load_u16(b)) * (float)v + f16_to_f32(load_u16(b + 2));
}

// One warp per weight row of a decode-row GEMV: out[r][j] = dot(W[j], x[r]), the dot
// split across the warp's lanes by `dot` and summed. Grid: (ceil(m / 4), n_rows); block:
// 128 threads = 4 warps.
template <typename Dot>
__device__ __forceinline__ void gemv_row(const u8* w, const float* xr, float* out_r, int m, int k, size_t row_bytes, Dot dot) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.x * 4 + warp;
    if (j >= m) return;
    const float s = warp_sum(dot(w + (size_t)j * row_bytes, xr, k, lane));
    if (lane == 0) out_r[j] = s;
}
template <typename Dot>
__device__ void gemv(const u8* w, const float* x, float* out, int m, int k, size_t row_bytes, Dot dot) {
    const int r = blockIdx.y;
    gemv_row(w, x + (size_t)r * k, out + (size_t)r * m, m, k, row_bytes, dot);
}
// The grouped GEMV of a mixture's decode rows: pair p (blockIdx.y) is one (expert, row) of
// the step, with its expert's weight matrix at ws[p] and its activation row x_rows[p] of
// x (row p when x_rows is null): out[p][j] = dot(W_p[j], x[x_rows[p]]). The same warp
// arithmetic as `gemv`, so a row's result is the same bits either way.
template <typename Dot>
__device__ void gemv_grouped(const unsigned long long* ws, const u32* x_rows, const float* x, float* out, int m, int k,
                             size_t row_bytes, Dot dot) {
    const int p = blockIdx.y;
    const size_t r = x_rows ? (size_t)x_rows[p] : (size_t)p;
    gemv_row((const u8*)ws[p], x + r * k, out + (size_t)p * m, m, k, row_bytes, dot);
}
