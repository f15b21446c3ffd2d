// The block formats of K-quant and newer GGUFs: Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
// IQ4_NL, IQ4_XS, MXFP4 (layouts: ggml-common.h, described in daemon/src/dtype/ggml.rs).
// For each: a decode-row GEMV that dequantizes in registers (gemv_*, grid (ceil(m /
// GEMV_W), ceil(rows / GEMV_R)), block 128 splitting GEMV_W weight rows, each thread eight
// weights of a block at a time, decoded once for up to GEMV_R activation rows: the Fmt*
// chunk formats), its one-row form (gemv1_*), its grouped form for a mixture's decode rows
// (gemv_grouped_*), the
// dequantization into f32 tiles for the cuBLAS path (dequant_*, one thread per element,
// grid ceil(n / 256), block 256), and the embedding gather (embedding_*, grid rows).
//
// deq_*(block, i) is element i of one block with the same f32 operations in the same
// order as the reference decoder (and gguf-py's dequantize): products and sums are
// written with __fmul_rn / __fadd_rn so the compiler cannot contract them into FMAs, and
// the tiles are bit-identical to the CPU's.
#include "common.cuh"

#define QK_K 256

__device__ __forceinline__ float f16_at(const u8* b, int at) { return f16_to_f32(load_u16(b + at)); }
__device__ __forceinline__ u32 load_u32(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}
// The low nibble of byte i for elements 0..15 of a 32-weight block, the high one after.
__device__ __forceinline__ int nibble32(const u8* qs, int i) { return i < 16 ? (qs[i] & 15) : (qs[i - 16] >> 4); }

__constant__ signed char KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
__constant__ signed char KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// Q5_0: d, qh (u32, bit i = fifth bit of element i), qs[16]; d * (q - 16). 22 bytes.
__device__ __forceinline__ float deq_q5_0(const u8* b, int i) {
    const int q = nibble32(b + 6, i) | (((load_u32(b + 2) >> i) & 1) << 4);
    return __fmul_rn(f16_at(b, 0), (float)(q - 16));
}
// Q5_1: d, m, qh, qs; d * q + m. 24 bytes.
__device__ __forceinline__ float deq_q5_1(const u8* b, int i) {
    const int q = nibble32(b + 8, i) | (((load_u32(b + 4) >> i) & 1) << 4);
    return __fadd_rn(__fmul_rn(f16_at(b, 0), (float)q), f16_at(b, 2));
}
// Q2_K: scales[16] (low nibble scale, high nibble min per 16), qs[64], d, dmin. 84 bytes.
__device__ __forceinline__ float deq_q2_k(const u8* b, int i) {
    const int h = i / 128, j = (i / 32) % 4, l = i % 32;
    const int q = (b[16 + 32 * h + l] >> (2 * j)) & 3;
    const u8 sc = b[i / 16];
    const float dl = __fmul_rn(f16_at(b, 80), (float)(sc & 15));
    const float ml = __fmul_rn(f16_at(b, 82), (float)(sc >> 4));
    return __fsub_rn(__fmul_rn(dl, (float)q), ml);
}
// Q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales, offset 32), d. 110 bytes.
__device__ __forceinline__ float deq_q3_k(const u8* b, int i) {
    const u8* s = b + 96;
    const int sub = i / 16;
    const int lo = (s[sub % 8] >> (4 * (sub / 8))) & 15;
    const int hi = (s[8 + sub % 4] >> (2 * (sub / 4))) & 3;
    const float dl = __fmul_rn(f16_at(b, 108), (float)((lo | (hi << 4)) - 32));
    const int h = i / 128, j = (i / 32) % 4, l = i % 32;
    const int ql = (b[32 + 32 * h + l] >> (2 * j)) & 3;
    const int hbit = (b[i % 32] >> (i / 32)) & 1;
    return __fmul_rn(dl, (float)(ql - ((hbit ^ 1) << 2)));
}
// The 6-bit scale and min of sub-block j of a Q4_K/Q5_K block's 12 scale bytes.
__device__ __forceinline__ void scale_min_k4(const u8* s, int j, float* sc, float* m) {
    if (j < 4) {
        *sc = (float)(s[j] & 63);
        *m = (float)(s[j + 4] & 63);
    } else {
        *sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        *m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}
// Q4_K: d, dmin, scales[12], qs[128]; Q5_K adds qh[32] before qs. dl * q - dm.
__device__ __forceinline__ float deq_q45_k(const u8* b, int i, bool q5) {
    const int sub = i / 32, l = i % 32;
    float sc, m;
    scale_min_k4(b + 4, sub, &sc, &m);
    const float dl = __fmul_rn(f16_at(b, 0), sc), dm = __fmul_rn(f16_at(b, 2), m);
    const u8* qs = b + (q5 ? 48 : 16);
    int q = (qs[32 * (sub / 2) + l] >> (4 * (sub % 2))) & 15;
    if (q5) q |= ((b[16 + l] >> sub) & 1) << 4;
    return __fsub_rn(__fmul_rn(dl, (float)q), dm);
}
__device__ __forceinline__ float deq_q4_k(const u8* b, int i) { return deq_q45_k(b, i, false); }
__device__ __forceinline__ float deq_q5_k(const u8* b, int i) { return deq_q45_k(b, i, true); }
// Q6_K: ql[128], qh[64], scales[16] (i8), d; dl * (q - 32). 210 bytes.
__device__ __forceinline__ float deq_q6_k(const u8* b, int i) {
    const int h = i / 128, t4 = (i / 32) % 4, l = i % 32;
    const int lo = (b[64 * h + 32 * (t4 % 2) + l] >> (4 * (t4 / 2))) & 15;
    const int hi = (b[128 + 32 * h + l] >> (2 * t4)) & 3;
    const float dl = __fmul_rn(f16_at(b, 208), (float)(i8)b[192 + i / 16]);
    return __fmul_rn(dl, (float)((lo | (hi << 4)) - 32));
}
// IQ4_NL: d, qs[16] indexing the 16 non-linear levels. 18 bytes.
__device__ __forceinline__ float deq_iq4_nl(const u8* b, int i) {
    return __fmul_rn(f16_at(b, 0), (float)KVALUES_IQ4NL[nibble32(b + 2, i)]);
}
// IQ4_XS: d, scales_h (u16), scales_l[4] (8 six-bit scales, offset 32), qs[128]. 136 bytes.
__device__ __forceinline__ float deq_iq4_xs(const u8* b, int i) {
    const int ib = i / 32, j = i % 32;
    const int lo = (b[4 + ib / 2] >> (4 * (ib % 2))) & 15;
    const int hi = (load_u16(b + 2) >> (2 * ib)) & 3;
    const float dl = __fmul_rn(f16_at(b, 0), (float)((lo | (hi << 4)) - 32));
    const u8 byte = b[8 + 16 * ib + j % 16];
    return __fmul_rn(dl, (float)KVALUES_IQ4NL[j < 16 ? (byte & 15) : (byte >> 4)]);
}
// MXFP4: an E8M0 exponent (as 2^(e - 128): the levels are doubled), qs[16] of E2M1. 17 bytes.
__device__ __forceinline__ float deq_mxfp4(const u8* b, int i) {
    const u32 e = b[0];
    const float d = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
    return __fmul_rn(d, (float)KVALUES_MXFP4[nibble32(b + 1, i)]);
}

// The chunk formats of `gemv` (common.cuh) for these blocks: chunk c is 8 weights of one
// block (in the 32-weight formats four lanes share a block, as q4_0 does in matmul_q.cu:
// part j = c % 4 takes quant bytes 4j..4j+3, elements 4j.. and 16 + 4j..; in the 256-weight
// K-quants chunk c is weights 8c..8c+7, inside one sub-block, so one scale). Each loads
// its quant bytes with the widest loads the address allows (4 or 8 at a time; byte loads
// only for MXFP4's 17-byte blocks), decodes the integer levels into w, and the
// sub-block's scale (and min) into d (and mn): value = d * w (+ mn), as the decoders above
// compute it.
struct Fmt32 {
    static constexpr bool HAS_MIN = false;
    static constexpr int W = GEMV_W;
    __device__ int chunks(int k) const { return k / 8; }
    __device__ float elem(const u8*, int) const { return 0.0f; }
};
__device__ __forceinline__ void part32(int c, int& b, int& j, Chunk& ch) {
    b = c >> 2;
    j = c & 3;
    ch.x0 = b * QK + 4 * j;
    ch.x1 = ch.x0 + 16;
}
// q5_0 (MIN = false: d, qh, qs; d * (q - 16)) and q5_1 (MIN = true: d, m, qh, qs; d * q + m).
template <bool MIN>
struct FmtQ5 : Fmt32 {
    static constexpr bool HAS_MIN = MIN;
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        int b, j;
        part32(c, b, j, ch);
        const u8* blk = row + (size_t)b * (MIN ? 24 : 22);
        ch.d = f16_at(blk, 0);
        ch.mn = MIN ? f16_at(blk, 2) : 0.0f;
        const u32 qh = ld_u32(blk + (MIN ? 4 : 2));
        const u32 q = ld_u32(blk + (MIN ? 8 : 6) + 4 * j);
        const int zero = MIN ? 0 : 16;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int lo = (int)((q >> (8 * i)) & 15) | (int)(((qh >> (4 * j + i)) & 1) << 4);
            const int hi = (int)((q >> (8 * i + 4)) & 15) | (int)(((qh >> (16 + 4 * j + i)) & 1) << 4);
            ch.w[i] = (float)(lo - zero);
            ch.w[4 + i] = (float)(hi - zero);
        }
    }
};
struct FmtIq4Nl : Fmt32 {
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        int b, j;
        part32(c, b, j, ch);
        const u8* blk = row + (size_t)b * 18;
        ch.d = f16_at(blk, 0);
        ch.mn = 0.0f;
        const u32 q = ld_u32(blk + 2 + 4 * j);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            ch.w[i] = (float)KVALUES_IQ4NL[(q >> (8 * i)) & 15];
            ch.w[4 + i] = (float)KVALUES_IQ4NL[(q >> (8 * i + 4)) & 15];
        }
    }
};
struct FmtMxfp4 : Fmt32 {
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        int b, j;
        part32(c, b, j, ch);
        const u8* blk = row + (size_t)b * 17;
        const u32 e = __ldg(blk);
        ch.d = __uint_as_float(e < 2 ? (0x00200000u << e) : ((e - 1) << 23));
        ch.mn = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const u32 q = __ldg(blk + 1 + 4 * j + i);
            ch.w[i] = (float)KVALUES_MXFP4[q & 15];
            ch.w[4 + i] = (float)KVALUES_MXFP4[q >> 4];
        }
    }
};

// The 256-weight K-quants: chunk c is weights i0 = 8c.. of block i0 / 256, at e0 = i0 % 256.
struct FmtK {
    static constexpr bool HAS_MIN = false;
    static constexpr int W = GEMV_W;
    __device__ int chunks(int k) const { return k / 8; }
    __device__ float elem(const u8*, int) const { return 0.0f; }
};
__device__ __forceinline__ const u8* chunk_k(const u8* row, int c, int bytes, int& e0, Chunk& ch) {
    const int i0 = c * 8;
    e0 = i0 % QK_K;
    ch.x0 = i0;
    ch.x1 = i0 + 4;
    return row + (size_t)(i0 / QK_K) * bytes;
}
// Q2_K: dl * q - ml, two bits a weight.
struct FmtQ2K : FmtK {
    static constexpr bool HAS_MIN = true;
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        int e0;
        const u8* b = chunk_k(row, c, 84, e0, ch);
        const int h = e0 / 128, j = (e0 / 32) % 4, l0 = e0 % 32;
        const u32 sc = __ldg(b + e0 / 16);
        ch.d = __fmul_rn(f16_at(b, 80), (float)(sc & 15));
        ch.mn = -__fmul_rn(f16_at(b, 82), (float)(sc >> 4));
        u32 qa, qb;
        ld_u32x2(b + 16 + 32 * h + l0, qa, qb);
#pragma unroll
        for (int i = 0; i < 8; i++) ch.w[i] = (float)((byte8(qa, qb, i) >> (2 * j)) & 3);
    }
};
// Q3_K: dl * (q - 4 * (1 - high bit)), the scale six bits offset by 32.
struct FmtQ3K : FmtK {
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        int e0;
        const u8* b = chunk_k(row, c, 110, e0, ch);
        const int h = e0 / 128, j = (e0 / 32) % 4, l0 = e0 % 32, sub = e0 / 16;
        const int lo = (__ldg(b + 96 + sub % 8) >> (4 * (sub / 8))) & 15;
        const int hi = (__ldg(b + 104 + sub % 4) >> (2 * (sub / 4))) & 3;
        ch.d = __fmul_rn(f16_at(b, 108), (float)((lo | (hi << 4)) - 32));
        ch.mn = 0.0f;
        u32 qa, qb, ma, mb;
        ld_u32x2(b + 32 + 32 * h + l0, qa, qb);
        ld_u32x2(b + l0, ma, mb);
        const int bit = e0 / 32;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int ql = (int)((byte8(qa, qb, i) >> (2 * j)) & 3);
            const int hb = (int)((byte8(ma, mb, i) >> bit) & 1);
            ch.w[i] = (float)(ql - ((hb ^ 1) << 2));
        }
    }
};
// Q4_K (Q5 = false) and Q5_K (Q5 = true): dl * q - dm.
template <bool Q5>
struct FmtQ45K : FmtK {
    static constexpr bool HAS_MIN = true;
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        int e0;
        const u8* b = chunk_k(row, c, Q5 ? 176 : 144, e0, ch);
        const int sub = e0 / 32, l0 = e0 % 32;
        float sc, m;
        scale_min_k4(b + 4, sub, &sc, &m);
        ch.d = __fmul_rn(f16_at(b, 0), sc);
        ch.mn = -__fmul_rn(f16_at(b, 2), m);
        u32 qa, qb;
        ld_u32x2(b + (Q5 ? 48 : 16) + 32 * (sub / 2) + l0, qa, qb);
        const int shift = 4 * (sub % 2);
        u32 ha = 0, hb = 0;
        if (Q5) ld_u32x2(b + 16 + l0, ha, hb);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int q = (int)((byte8(qa, qb, i) >> shift) & 15);
            if (Q5) q |= (int)(((byte8(ha, hb, i) >> sub) & 1) << 4);
            ch.w[i] = (float)q;
        }
    }
};
// Q6_K: dl * (q - 32), q from four low bits in ql and two high bits in qh.
struct FmtQ6K : FmtK {
    // Two weight rows a multi-row block (GEMV_W elsewhere): on an H200, Q6_K's 8- and 64-row
    // GEMVs ran 14-22 % faster so at 14336 x 4096 and at 4096 x 4096 64 rows, 2 % at 4096 x
    // 4096 8 rows; the other formats ran slower or mixed (scripts/gpu-ab.sh, 2026-12-04).
    static constexpr int W = 2;
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        int e0;
        const u8* b = chunk_k(row, c, 210, e0, ch);
        const int h = e0 / 128, t4 = (e0 / 32) % 4, l0 = e0 % 32;
        ch.d = __fmul_rn(f16_at(b, 208), (float)(i8)__ldg(b + 192 + e0 / 16));
        ch.mn = 0.0f;
        u32 la, lb, ha, hb;
        ld_u32x2(b + 64 * h + 32 * (t4 % 2) + l0, la, lb);
        ld_u32x2(b + 128 + 32 * h + l0, ha, hb);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int lo = (int)((byte8(la, lb, i) >> (4 * (t4 / 2))) & 15);
            const int hi = (int)((byte8(ha, hb, i) >> (2 * t4)) & 3);
            ch.w[i] = (float)((lo | (hi << 4)) - 32);
        }
    }
};
// IQ4_XS: dl * level, dl from a six-bit scale offset by 32 per 32-weight sub-block.
struct FmtIq4Xs : FmtK {
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        int e0;
        const u8* b = chunk_k(row, c, 136, e0, ch);
        const int ib = e0 / 32, jj = e0 % 32;
        const int lo = (__ldg(b + 4 + ib / 2) >> (4 * (ib % 2))) & 15;
        const int hi = (ld_u16(b + 2) >> (2 * ib)) & 3;
        ch.d = __fmul_rn(f16_at(b, 0), (float)((lo | (hi << 4)) - 32));
        ch.mn = 0.0f;
        u32 qa, qb;
        ld_u32x2(b + 8 + 16 * ib + jj % 16, qa, qb);
        const int shift = jj < 16 ? 0 : 4;
#pragma unroll
        for (int i = 0; i < 8; i++) ch.w[i] = (float)KVALUES_IQ4NL[(byte8(qa, qb, i) >> shift) & 15];
    }
};

#define BLOCK_FORMAT(name, be, bb, fmt)                                                                    \
    extern "C" __global__ void gemv_##name(const u8* __restrict__ w, const float* __restrict__ x,         \
                                           float* __restrict__ out, int m, int k, int rows) {             \
        gemv(w, x, out, m, k, rows, (size_t)(k / be) * bb, fmt());                                        \
    }                                                                                                      \
    extern "C" __global__ void gemv1_##name(const u8* __restrict__ w, const float* __restrict__ x,        \
                                            float* __restrict__ out, int m, int k) {                      \
        gemv1(w, x, out, m, k, (size_t)(k / be) * bb, fmt());                                             \
    }                                                                                                      \
    extern "C" __global__ void gemv_grouped_##name(const unsigned long long* __restrict__ w,              \
                                                   const u32* __restrict__ x_rows, const float* __restrict__ x, \
                                                   float* __restrict__ out, int m, int k, int pairs) {    \
        gemv_grouped(w, x_rows, x, out, m, k, pairs, (size_t)(k / be) * bb, fmt());                              \
    }                                                                                                      \
    extern "C" __global__ void gemv1_grouped_##name(const unsigned long long* __restrict__ w,             \
                                                    const u32* __restrict__ x_rows, const float* __restrict__ x, \
                                                    float* __restrict__ out, int m, int k, int pairs) {   \
        gemv1_grouped(w, x_rows, x, out, m, k, pairs, (size_t)(k / be) * bb, fmt());                      \
    }                                                                                                      \
    extern "C" __global__ void dequant_##name(const u8* w, float* out, unsigned long long n) {            \
        const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;           \
        if (i < n) out[i] = deq_##name(w + (i / be) * bb, (int)(i % be));                                \
    }                                                                                                      \
    extern "C" __global__ void embedding_##name(const u8* t, const u32* ids, float* out, int cols) {     \
        const u8* row = t + (size_t)ids[blockIdx.x] * (cols / be) * bb;                                   \
        for (int i = threadIdx.x; i < cols; i += blockDim.x)                                               \
            out[(size_t)blockIdx.x * cols + i] = deq_##name(row + (i / be) * bb, i % be);                 \
    }

BLOCK_FORMAT(q5_0, 32, 22, FmtQ5<false>)
BLOCK_FORMAT(q5_1, 32, 24, FmtQ5<true>)
BLOCK_FORMAT(q2_k, QK_K, 84, FmtQ2K)
BLOCK_FORMAT(q3_k, QK_K, 110, FmtQ3K)
BLOCK_FORMAT(q4_k, QK_K, 144, FmtQ45K<false>)
BLOCK_FORMAT(q5_k, QK_K, 176, FmtQ45K<true>)
BLOCK_FORMAT(q6_k, QK_K, 210, FmtQ6K)
BLOCK_FORMAT(iq4_nl, 32, 18, FmtIq4Nl)
BLOCK_FORMAT(iq4_xs, QK_K, 136, FmtIq4Xs)
BLOCK_FORMAT(mxfp4, 32, 17, FmtMxfp4)
