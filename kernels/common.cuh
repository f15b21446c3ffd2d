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
// A block of 128 threads (4 warps) takes W weight rows (the format's: GEMV_W, 2 for Q6_K)
// and up to GEMV_R activation rows, so a step with B decode rows reads every weight
// ceil(B / GEMV_R) times, not B, and each activation chunk a thread loads serves W weight
// rows. The block's threads split each weight row: thread t takes chunks t, t + 128, ...
// (a warp reads 32 consecutive chunks: coalesced) and loads its next chunks before it uses
// the current ones. Measured on an H200 against one warp per weight row (stride 32):
// 1.5-3x faster at 8 rows, 1.1-2.2x at 64. The kernels take 111-128 registers a thread
// (64-90 before; Q6_K's 72 at W = 2), so an SM holds half the blocks; a step of one decode
// row runs `gemv1` below instead.
// Grid: (ceil(m / W), ceil(rows / GEMV_R)); block: GEMV_THREADS (128).
//
// A format `F` supplies:
//   W                      weight rows a block of the multi-row kernels (<= GEMV_W),
//   chunks(k)              chunks in a row of k weights (whole chunks only),
//   load(row, c, ch)       chunk c of a row: 8 weights w (unscaled), their scale d and
//                          min mn (value = d * w + mn: mn only where HAS_MIN), and where
//                          its 8 activations are: x0..x0+3 and x1..x1+3 (the same for
//                          every row of a format),
//   elem(row, i)           weight i, for the dense formats' tail past the last whole chunk.
// Every row's sum is one fixed sequence: per chunk t = sum_i w[i] * x[i] in order (fmaf),
// acc = fmaf(d, t, acc) (then fmaf(mn, sum of the 8 x, acc)), a thread's chunks in order,
// then its tail elements, then each warp's fixed butterfly, then the four warps' sums in
// warp order. It does not depend on how many rows share the block, where the row sits in
// it, or which weight rows share the block, so a sequence's results do not depend on the
// batch.
#define GEMV_R 8
#define GEMV_W 4
#define GEMV_THREADS 128

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

// One chunk position of `nw` (<= W) weight rows applied to `nr` (<= R) activation rows:
// acc[w * R + r] for weight row w, activation row r.
template <int R, int W, typename F, typename XRow>
__device__ __forceinline__ void gemv_apply(const Chunk* ch, int nw, XRow xrow, int nr, bool xvec, float* acc) {
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (r < nr) {
            float xa[8];
            load_x8(xrow(r), ch[0].x0, ch[0].x1, xvec, xa);
            float s = 0.0f;
            if (F::HAS_MIN) {
                s = xa[0];
#pragma unroll
                for (int i = 1; i < 8; i++) s = __fadd_rn(s, xa[i]);
            }
#pragma unroll
            for (int w = 0; w < W; w++) {
                if (w < nw) {
                    float t = 0.0f;
#pragma unroll
                    for (int i = 0; i < 8; i++) t = fmaf(ch[w].w[i], xa[i], t);
                    float a = fmaf(ch[w].d, t, acc[w * R + r]);
                    if (F::HAS_MIN) a = fmaf(ch[w].mn, s, a);
                    acc[w * R + r] = a;
                }
            }
        }
    }
}

// `nw` weight rows (row w at rows[w]) against `nr` activation rows (row r at xrow(r)):
// thread `tid`'s partial sums in acc[w * R + r]. U chunk positions are loaded ahead.
template <int R, int W, int U, typename F, typename XRow>
__device__ __forceinline__ void gemv_acc(const F& f, const u8* const* rows, int nw, XRow xrow, int nr, int k, int tid,
                                         bool xvec, float* acc) {
    constexpr int T = GEMV_THREADS;
#pragma unroll
    for (int i = 0; i < R * W; i++) acc[i] = 0.0f;
    const int n = f.chunks(k);
    int c = tid;
    for (; c + T * (U - 1) < n; c += T * U) {
        Chunk ch[U][W];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int w = 0; w < W; w++)
                if (w < nw) f.load(rows[w], c + T * u, ch[u][w]);
#pragma unroll
        for (int u = 0; u < U; u++) gemv_apply<R, W, F>(ch[u], nw, xrow, nr, xvec, acc);
    }
    for (; c < n; c += T) {
        Chunk ch[W];
#pragma unroll
        for (int w = 0; w < W; w++)
            if (w < nw) f.load(rows[w], c, ch[w]);
        gemv_apply<R, W, F>(ch, nw, xrow, nr, xvec, acc);
    }
    for (int i = n * 8 + tid; i < k; i += T) {
#pragma unroll
        for (int w = 0; w < W; w++) {
            if (w < nw) {
                const float wi = f.elem(rows[w], i);
#pragma unroll
                for (int r = 0; r < R; r++)
                    if (r < nr) acc[w * R + r] = fmaf(wi, __ldg(xrow(r) + i), acc[w * R + r]);
            }
        }
    }
}

// Activation rows in float4s when every row and chunk offset is 16-byte aligned.
__device__ __forceinline__ bool x_vec(const float* x, int k) { return (k & 3) == 0 && (((size_t)x) & 15) == 0; }

// The block's sums: each warp's butterfly, then the four warps' in order; weight row w and
// activation row r to o[r * m + w] (thread 0). Every thread of the block calls it.
template <int R, int W>
__device__ __forceinline__ void gemv_reduce(const float* acc, int nw, int nr, float* __restrict__ o, int m) {
    __shared__ float part[GEMV_THREADS / 32][GEMV_W * GEMV_R];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < R * W; i++) {
        const float s = warp_sum(acc[i]);
        if (lane == 0) part[warp][i] = s;
    }
    __syncthreads();
    const int i = threadIdx.x;
    if (i < R * W) {
        const int w = i / R, r = i % R;
        if (w < nw && r < nr) {
            float s = part[0][i];
#pragma unroll
            for (int q = 1; q < GEMV_THREADS / 32; q++) s += part[q][i];
            o[(size_t)r * m + w] = s;
        }
    }
    __syncthreads();
}

// `nw` weight rows from `row` (row_bytes apart) against `nr` activation rows, into
// o[r * m + w]: the one-row form (fewer registers; two chunks ahead with GEMV_W weight
// rows, one with fewer, as measured for Q6_K) when nr is 1, with the same arithmetic. W:
// the format's weight rows a block (F::W, GEMV_W but for Q6_K).
template <typename F, typename XRow>
__device__ __forceinline__ void gemv_out(const F& f, const u8* __restrict__ row, size_t row_bytes, int nw,
                                         XRow xrow, int nr, int k, bool xvec, float* __restrict__ o, int m) {
    constexpr int W = F::W;
    static_assert(W >= 1 && W <= GEMV_W, "gemv_reduce's shared sums hold GEMV_W * GEMV_R");
    const int tid = threadIdx.x;
    const u8* rows[W];
#pragma unroll
    for (int w = 0; w < W; w++) rows[w] = row + (size_t)min(w, nw - 1) * row_bytes;
    if (nr == 1) {
        float acc[W];
        gemv_acc<1, W, W == GEMV_W ? 2 : 1>(f, rows, nw, xrow, 1, k, tid, xvec, acc);
        gemv_reduce<1, W>(acc, nw, 1, o, m);
    } else {
        float acc[W * GEMV_R];
        gemv_acc<GEMV_R, W, 1>(f, rows, nw, xrow, nr, k, tid, xvec, acc);
        gemv_reduce<GEMV_R, W>(acc, nw, nr, o, m);
    }
}

// One decode row, the batch-1 decode step's case, in a kernel of its own: a kernel's
// register count is its largest path's, and the multi-row path's 8 x GEMV_W sums would set
// it for the one-row launch too (fewer resident warps to hide each load's latency). Blocks
// of GEMV_THREADS take GEMV1_W weight rows, GEMV1_U chunk positions loaded ahead. The
// arithmetic is `gemv`'s (chunk order, butterflies, warp order), so a row's bits are the
// same whichever kernel ran it. Grid: ceil(m / GEMV1_W); block: GEMV_THREADS.
// Chosen on an H200 (scripts/gpu-ab.sh, each twice, alternating) among W = 1, 2, 4 and U =
// 1, 2, 4: W = 2, U = 1 (40-48 registers) was 1.2-2.1x as fast as the multi-row kernel's
// one-row path (q8_0 14336 x 4096: 79.7 -> 37.4 us, 0.40 of a device copy's rate; bf16
// 0.73), the fastest at 14336 x 4096 in every format and within 13 % of the fastest at
// 4096 x 4096 (W = 4, U = 1 won q8_0/q4_0/q4_1 there); W = 1 was 2-30 % slower than W = 2.
#define GEMV1_W 2
#define GEMV1_U 1
static_assert(GEMV1_W <= GEMV_W * GEMV_R, "gemv_reduce's shared sums hold GEMV_W * GEMV_R");

// Weight rows from blockIdx.x * GEMV1_W of the matrix at `w` against one activation row
// `x`, into out[j..]. The caller has returned where blockIdx.x * GEMV1_W >= m.
template <typename F>
__device__ __forceinline__ void gemv1_block(const u8* __restrict__ w, const float* __restrict__ x, bool xvec,
                                            float* __restrict__ out, int m, int k, size_t row_bytes, const F& f) {
    const int j = blockIdx.x * GEMV1_W;
    const int nw = min(GEMV1_W, m - j);
    const u8* rows[GEMV1_W];
#pragma unroll
    for (int q = 0; q < GEMV1_W; q++) rows[q] = w + (size_t)(j + min(q, nw - 1)) * row_bytes;
    const auto xrow = [=](int) { return x; };
    float acc[GEMV1_W];
    gemv_acc<1, GEMV1_W, GEMV1_U>(f, rows, nw, xrow, 1, k, threadIdx.x, xvec, acc);
    gemv_reduce<1, GEMV1_W>(acc, nw, 1, out + j, m);
}

template <typename F>
__device__ void gemv1(const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, int m, int k,
                      size_t row_bytes, F f) {
    if (blockIdx.x * GEMV1_W >= m) return;  // the whole block
    gemv1_block(w, x, x_vec(x, k), out, m, k, row_bytes, f);
}

// `gemv_grouped` where no two neighbouring pairs share an expert (a batch-1 step's top-k
// pairs, and most pairs of a small batch over many experts): block (x, p) takes pair p
// alone, as `gemv1` takes its row, at `gemv1`'s registers rather than the run-sharing
// kernel's (230-251; Q6_K's 94). Grid: (ceil(m / GEMV1_W), pairs); block: GEMV_THREADS.
template <typename F>
__device__ void gemv1_grouped(const unsigned long long* __restrict__ ws, const u32* __restrict__ x_rows,
                              const float* __restrict__ x, float* __restrict__ out, int m, int k, int pairs,
                              size_t row_bytes, F f) {
    const int p = blockIdx.y;
    if (blockIdx.x * GEMV1_W >= m || p >= pairs) return;  // the whole block
    const size_t xr = x_rows ? (size_t)x_rows[p] : (size_t)p;
    gemv1_block((const u8*)ws[p], x + xr * k, x_vec(x, k), out + (size_t)p * m, m, k, row_bytes, f);
}

template <typename F>
__device__ void gemv(const u8* __restrict__ w, const float* __restrict__ x, float* __restrict__ out, int m, int k,
                     int rows, size_t row_bytes, F f) {
    const int j = blockIdx.x * F::W;
    const int r0 = blockIdx.y * GEMV_R;
    if (j >= m || r0 >= rows) return;  // the whole block
    const int nr = min(GEMV_R, rows - r0), nw = min(F::W, m - j);
    const u8* row = w + (size_t)j * row_bytes;
    const float* xr = x + (size_t)r0 * k;
    const auto xrow = [=](int r) { return xr + (size_t)r * k; };
    gemv_out(f, row, row_bytes, nw, xrow, nr, k, x_vec(x, k), out + (size_t)r0 * m + j, m);
}
// The grouped GEMV of a mixture's decode rows: pair p is one (expert, row) of the step,
// with its expert's weight matrix at ws[p] and its activation row x_rows[p] of x (row p
// when x_rows is null): out[p][j] = dot(W_p[j], x[x_rows[p]]). Pairs come expert-major,
// so block y takes pairs 8y..8y+7 and each run of them that shares an expert's weights
// reads those weights once for the run. Grid and block as `gemv`'s with pairs for rows.
// The same arithmetic as `gemv`, so a pair's result is its row's bits either way.
template <typename F>
__device__ void gemv_grouped(const unsigned long long* __restrict__ ws, const u32* __restrict__ x_rows,
                             const float* __restrict__ x, float* __restrict__ out, int m, int k, int pairs,
                             size_t row_bytes, F f) {
    const int j = blockIdx.x * F::W;
    const int p0 = blockIdx.y * GEMV_R;
    if (j >= m || p0 >= pairs) return;  // the whole block
    const int np = min(GEMV_R, pairs - p0), nw = min(F::W, m - j);
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
        gemv_out(f, row, row_bytes, nw, xrow, b - a, k, xvec, out + (size_t)q0 * m + j, m);
        a = b;
    }
}
