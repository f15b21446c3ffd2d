// Shared helpers for the sluice kernels. Compiled by NVRTC at start (no toolkit headers:
// types and conversions are defined here).
#pragma once

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;

#ifndef SLUICE_EMULATE  // tests/emulator/cuda_emu.cpp runs these kernels on the CPU
// A kernel's dynamic shared memory (sized at launch).
#define DYNAMIC_SHARED(type, name) extern __shared__ type name[]

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
#endif

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

// ---- Decode-row GEMV: out[r][j] = dot(W[j], x[r]) for the step's decode rows ----
// One warp per weight row j, four to a block; each block takes up to GEMV_R activation
// rows, so a step with B decode rows reads every weight ceil(B / GEMV_R) times, not B.
// Grid: (ceil(m / 4), ceil(rows / GEMV_R)); block: 128 threads.
//
// A row of weights is cut into chunks of 8 weights; lane l takes chunks l, l + 32, ...
// (a warp reads 32 consecutive chunks: coalesced), dequantizes each chunk once into
// registers and applies it to every activation row of the block. A format `F` supplies:
//   chunks(k)              chunks in a row of k weights (whole chunks only),
//   load(row, c, ch)       chunk c of a row: 8 weights w (unscaled), their scale d and
//                          min mn (value = d * w + mn: mn only where HAS_MIN), and where
//                          its 8 activations are: x0..x0+3 and x1..x1+3,
//   elem(row, i)           weight i, for the dense formats' tail past the last whole chunk.
// Every row's sum is one fixed sequence of fmaf: per chunk t = sum_i w[i] * x[i] in order,
// acc = fmaf(d, t, acc) (then fmaf(mn, sum of the 8 x, acc)), chunks in lane order, then
// the tail, then the warp's fixed butterfly. It does not depend on how many rows share the
// block or where the row sits in it, so a sequence's results do not depend on the batch.
#define GEMV_R 8

struct Chunk {
    float w[8];
    float d, mn;
    int x0, x1;
};

// Two aligned 16-bit loads as one little-endian u32 (the 18- and 34-byte GGML blocks are
// only 2-byte aligned), through the read-only path.
__device__ __forceinline__ u32 ld_u16x2(const u8* p) {
    const u16* q = (const u16*)p;
    return (u32)__ldg(q) | ((u32)__ldg(q + 1) << 16);
}
__device__ __forceinline__ u16 ld_u16(const u8* p) { return __ldg((const u16*)p); }
// 4 and 8 little-endian bytes from a 2-byte-aligned address: one 32- or 64-bit load where
// the address allows it, else 16-bit loads of the same bytes.
__device__ __forceinline__ u32 ld_u32(const u8* p) {
    return (((size_t)p) & 3) == 0 ? __ldg((const u32*)p) : ld_u16x2(p);
}
__device__ __forceinline__ void ld_u32x2(const u8* p, u32& a, u32& b) {
    if ((((size_t)p) & 7) == 0) {
        const uint2 v = __ldg((const uint2*)p);
        a = v.x;
        b = v.y;
    } else {
        a = ld_u32(p);
        b = ld_u32(p + 4);
    }
}
// Byte i (0..7) of the 8 bytes a, b.
__device__ __forceinline__ u32 byte8(u32 a, u32 b, int i) { return ((i < 4 ? a : b) >> (8 * (i & 3))) & 0xffu; }

// The 8 activations of a chunk; `vec`: the row is 16-byte aligned and x0, x1 are multiples
// of 4, so two float4 loads; otherwise eight scalar loads of the same values.
__device__ __forceinline__ void load_x8(const float* __restrict__ xr, int x0, int x1, bool vec, float* xa) {
    if (vec) {
        const float4 a = __ldg((const float4*)(xr + x0)), b = __ldg((const float4*)(xr + x1));
        xa[0] = a.x; xa[1] = a.y; xa[2] = a.z; xa[3] = a.w;
        xa[4] = b.x; xa[5] = b.y; xa[6] = b.z; xa[7] = b.w;
    } else {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            xa[i] = __ldg(xr + x0 + i);
            xa[4 + i] = __ldg(xr + x1 + i);
        }
    }
}

// `nr` (<= R) activation rows, row r at xrow(r): each lane's partial sums in acc.
template <int R, typename F, typename XRow>
__device__ __forceinline__ void gemv_acc(const F& f, const u8* __restrict__ row, XRow xrow, int nr, int k, int lane,
                                         bool xvec, float* acc) {
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    const int n = f.chunks(k);
    for (int c = lane; c < n; c += 32) {
        Chunk ch;
        f.load(row, c, ch);
#pragma unroll
        for (int r = 0; r < R; r++) {
            if (r < nr) {
                float xa[8];
                load_x8(xrow(r), ch.x0, ch.x1, xvec, xa);
                float t = 0.0f;
#pragma unroll
                for (int i = 0; i < 8; i++) t = fmaf(ch.w[i], xa[i], t);
                float a = fmaf(ch.d, t, acc[r]);
                if (F::HAS_MIN) {
                    float s = xa[0];
#pragma unroll
                    for (int i = 1; i < 8; i++) s = __fadd_rn(s, xa[i]);
                    a = fmaf(ch.mn, s, a);
                }
                acc[r] = a;
            }
        }
    }
    for (int i = n * 8 + lane; i < k; i += 32) {
        const float wi = f.elem(row, i);
#pragma unroll
        for (int r = 0; r < R; r++)
            if (r < nr) acc[r] = fmaf(wi, __ldg(xrow(r) + i), acc[r]);
    }
}

// Activation rows in float4s when every row and chunk offset is 16-byte aligned.
__device__ __forceinline__ bool x_vec(const float* x, int k) { return (k & 3) == 0 && (((size_t)x) & 15) == 0; }

// One weight row against `nr` activation rows: row r's dot product to o[r * m] (lane 0),
// through the one-row form when nr is 1 (fewer registers), with the same arithmetic.
template <typename F, typename XRow>
__device__ __forceinline__ void gemv_out(const F& f, const u8* __restrict__ row, XRow xrow, int nr, int k, int lane,
                                         bool xvec, float* __restrict__ o, int m) {
    if (nr == 1) {
        float acc[1];
        gemv_acc<1>(f, row, xrow, 1, k, lane, xvec, acc);
        const float s = warp_sum(acc[0]);
        if (lane == 0) o[0] = s;
    } else {
        float acc[GEMV_R];
        gemv_acc<GEMV_R>(f, row, xrow, nr, k, lane, xvec, acc);
#pragma unroll
        for (int r = 0; r < GEMV_R; r++) {
            if (r < nr) {
                const float s = warp_sum(acc[r]);
                if (lane == 0) o[(size_t)r * m] = s;
            }
        }
    }
}

template <typename F>
__device__ void gemv(const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, int m, int k,
                     int rows, size_t row_bytes, F f) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.x * 4 + warp;
    const int r0 = blockIdx.y * GEMV_R;
    if (j >= m || r0 >= rows) return;
    const int nr = min(GEMV_R, rows - r0);
    const u8* row = w + (size_t)j * row_bytes;
    const float* xr = x + (size_t)r0 * k;
    const auto xrow = [=](int r) { return xr + (size_t)r * k; };
    gemv_out(f, row, xrow, nr, k, lane, x_vec(x, k), out + (size_t)r0 * m + j, m);
}
// The grouped GEMV of a mixture's decode rows: pair p is one (expert, row) of the step,
// with its expert's weight matrix at ws[p] and its activation row x_rows[p] of x (row p
// when x_rows is null): out[p][j] = dot(W_p[j], x[x_rows[p]]). Pairs come expert-major,
// so block y takes pairs 8y..8y+7 and each run of them that shares an expert's weights
// reads those weights once for the run. Grid (ceil(m / 4), ceil(pairs / GEMV_R)), block
// 128. The same arithmetic as `gemv`, so a pair's result is its row's bits either way.
template <typename F>
__device__ void gemv_grouped(const unsigned long long* __restrict__ ws, const u32* __restrict__ x_rows,
                             const float* __restrict__ x, float* __restrict__ out, int m, int k, int pairs,
                             size_t row_bytes, F f) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int j = blockIdx.x * 4 + warp;
    const int p0 = blockIdx.y * GEMV_R;
    if (j >= m || p0 >= pairs) return;
    const int np = min(GEMV_R, pairs - p0);
    const bool xvec = x_vec(x, k);
    for (int a = 0; a < np;) {
        const unsigned long long wa = ws[p0 + a];
        int b = a + 1;
        while (b < np && ws[p0 + b] == wa) b++;
        const u8* row = (const u8*)wa + (size_t)j * row_bytes;
        const int q0 = p0 + a;
        const auto xrow = [=](int r) {
            const size_t xr = x_rows ? (size_t)x_rows[q0 + r] : (size_t)(q0 + r);
            return x + xr * k;
        };
        gemv_out(f, row, xrow, b - a, k, lane, xvec, out + (size_t)q0 * m + j, m);
        a = b;
    }
}
