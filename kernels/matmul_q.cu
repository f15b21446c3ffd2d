// Matrix-vector products for decode rows, weights dequantized in registers:
//   out[r][j] = sum_k x[r][k] * W[j][k],   W rows of `k` elements in the stored dtype.
// Grid: (ceil(m / GEMV_W), ceil(rows / GEMV_R)); block: 128 threads splitting GEMV_W
// weight rows, each weight chunk applied to up to GEMV_R activation rows (common.cuh:
// `gemv`); gemv1_*: the same for one row, grid ceil(m / GEMV1_W) (`gemv1`).
// The grouped GEMVs of a mixture's decode rows take each pair's weights by address.
// And dequantization into f32 tiles for the cuBLAS path (prefill rows):
//   dequant_*: out[i] = W element i, for n elements. Grid: ceil(n / 256); block: 256.
#include "common.cuh"

// The chunk formats of `gemv` (common.cuh): 8 weights a thread at a time. In the 32-weight
// GGML blocks four threads share a block: part j = c % 4 takes quant bytes 8j..8j+7
// (q8_0) or nibble bytes 4j..4j+3 (q4_0, q4_1: elements 4j.. in the low nibbles and
// 16 + 4j.. in the high ones), with the widest loads their address allows (the blocks are
// only 2-byte aligned); the dense
// formats load 16 bytes (f16, bf16) or two float4 (f32) when the row is 16-byte aligned.
// (q4_1's quants are 4-byte aligned, so they come in one 32-bit load.)
struct FmtQ8_0 {
    static constexpr bool HAS_MIN = false;
    static constexpr int W = GEMV_W;
    __device__ int chunks(int k) const { return k / 8; }
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        const int b = c >> 2, j = c & 3;
        const u8* blk = row + (size_t)b * Q8_0_BYTES;
        ch.d = f16_to_f32(ld_u16(blk));
        ch.mn = 0.0f;
        u32 q0, q1;
        ld_u32x2(blk + 2 + 8 * j, q0, q1);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            ch.w[i] = (float)(i8)(q0 >> (8 * i));
            ch.w[4 + i] = (float)(i8)(q1 >> (8 * i));
        }
        ch.x0 = b * QK + 8 * j;
        ch.x1 = ch.x0 + 4;
    }
    __device__ float elem(const u8*, int) const { return 0.0f; }
};
// q4_0 (MIN = false: d, qs; d * (q - 8)) and q4_1 (MIN = true: d, m, qs; d * q + m).
template <bool MIN>
struct FmtQ4 {
    static constexpr bool HAS_MIN = MIN;
    static constexpr int W = GEMV_W;
    __device__ int chunks(int k) const { return k / 8; }
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        const int b = c >> 2, j = c & 3;
        const u8* blk = row + (size_t)b * (MIN ? Q4_1_BYTES : Q4_0_BYTES);
        const int zero = MIN ? 0 : 8;
        ch.d = f16_to_f32(ld_u16(blk));
        ch.mn = MIN ? f16_to_f32(ld_u16(blk + 2)) : 0.0f;
        const u32 q = ld_u32(blk + (MIN ? 4 : 2) + 4 * j);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            ch.w[i] = (float)((int)((q >> (8 * i)) & 15) - zero);
            ch.w[4 + i] = (float)((int)((q >> (8 * i + 4)) & 15) - zero);
        }
        ch.x0 = b * QK + 4 * j;
        ch.x1 = ch.x0 + 16;
    }
    __device__ float elem(const u8*, int) const { return 0.0f; }
};
struct FmtF32 {
    static constexpr bool HAS_MIN = false;
    static constexpr int W = GEMV_W;
    __device__ int chunks(int k) const { return k / 8; }
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        const float* r = (const float*)row + 8 * c;
        if ((((size_t)row) & 15) == 0) {
            const float4 a = __ldg((const float4*)r), b = __ldg((const float4*)r + 1);
            ch.w[0] = a.x; ch.w[1] = a.y; ch.w[2] = a.z; ch.w[3] = a.w;
            ch.w[4] = b.x; ch.w[5] = b.y; ch.w[6] = b.z; ch.w[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) ch.w[i] = __ldg(r + i);
        }
        ch.d = 1.0f;
        ch.mn = 0.0f;
        ch.x0 = 8 * c;
        ch.x1 = ch.x0 + 4;
    }
    __device__ float elem(const u8* row, int i) const { return __ldg((const float*)row + i); }
};
// f16 (BF = false) or bf16 (BF = true) weights.
template <bool BF>
struct FmtHalf {
    static constexpr bool HAS_MIN = false;
    static constexpr int W = GEMV_W;
    __device__ static float widen(u32 h) { return BF ? bf16_to_f32((u16)h) : f16_to_f32((u16)h); }
    __device__ int chunks(int k) const { return k / 8; }
    __device__ void load(const u8* row, int c, Chunk& ch) const {
        const u8* r = row + 16 * (size_t)c;
        if ((((size_t)row) & 15) == 0) {
            const uint4 v = __ldg((const uint4*)r);
            const u32 h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                ch.w[2 * i] = widen(h[i] & 0xffffu);
                ch.w[2 * i + 1] = widen(h[i] >> 16);
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) ch.w[i] = widen(ld_u16(r + 2 * i));
        }
        ch.d = 1.0f;
        ch.mn = 0.0f;
        ch.x0 = 8 * c;
        ch.x1 = ch.x0 + 4;
    }
    __device__ float elem(const u8* row, int i) const { return widen(ld_u16(row + 2 * (size_t)i)); }
};

#define GEMV_FORMAT(name, row_bytes, fmt)                                                                   \
    extern "C" __global__ void gemv_##name(const u8* __restrict__ w, const float* __restrict__ x,           \
                                           float* __restrict__ out, int m, int k, int rows) {               \
        gemv(w, x, out, m, k, rows, row_bytes, fmt());                                                      \
    }                                                                                                        \
    extern "C" __global__ void gemv1_##name(const u8* __restrict__ w, const float* __restrict__ x,          \
                                            float* __restrict__ out, int m, int k) {                        \
        gemv1(w, x, out, m, k, row_bytes, fmt());                                                           \
    }                                                                                                        \
    extern "C" __global__ void gemv_grouped_##name(const unsigned long long* __restrict__ w,                \
                                                   const u32* __restrict__ x_rows, const float* __restrict__ x, \
                                                   float* __restrict__ out, int m, int k, int pairs) {      \
        gemv_grouped(w, x_rows, x, out, m, k, pairs, row_bytes, fmt());                                            \
    }                                                                                                        \
    extern "C" __global__ void gemv1_grouped_##name(const unsigned long long* __restrict__ w,               \
                                                    const u32* __restrict__ x_rows, const float* __restrict__ x, \
                                                    float* __restrict__ out, int m, int k, int pairs) {     \
        gemv1_grouped(w, x_rows, x, out, m, k, pairs, row_bytes, fmt());                                    \
    }
GEMV_FORMAT(q8_0, (size_t)(k / QK) * Q8_0_BYTES, FmtQ8_0)
GEMV_FORMAT(q4_0, (size_t)(k / QK) * Q4_0_BYTES, FmtQ4<false>)
GEMV_FORMAT(q4_1, (size_t)(k / QK) * Q4_1_BYTES, FmtQ4<true>)
GEMV_FORMAT(f32, (size_t)k * 4, FmtF32)
GEMV_FORMAT(f16, (size_t)k * 2, FmtHalf<false>)
GEMV_FORMAT(bf16, (size_t)k * 2, FmtHalf<true>)

#define DEQUANT_Q(name, bytes, deq)                                                  \
    extern "C" __global__ void name(const u8* w, float* out, unsigned long long n) { \
        const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
        if (i < n) out[i] = deq(w + (i / QK) * bytes, (int)(i % QK));               \
    }
DEQUANT_Q(dequant_q8_0, Q8_0_BYTES, deq_q8_0)
DEQUANT_Q(dequant_q4_0, Q4_0_BYTES, deq_q4_0)
DEQUANT_Q(dequant_q4_1, Q4_1_BYTES, deq_q4_1)
extern "C" __global__ void dequant_f16(const u8* w, float* out, unsigned long long n) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f16_to_f32(load_u16(w + 2 * i));
}
extern "C" __global__ void dequant_bf16(const u8* w, float* out, unsigned long long n) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = bf16_to_f32(load_u16(w + 2 * i));
}
