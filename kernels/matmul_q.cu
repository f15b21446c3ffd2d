// Matrix-vector products for decode rows, weights dequantized in registers:
//   out[r][j] = sum_k x[r][k] * W[j][k],   W rows of `k` elements in the stored dtype.
// Grid: (ceil(m / 4), n_rows); block: 128 threads = 4 warps, one weight row per warp.
// The grouped GEMVs of a mixture's decode rows take each pair's weights by address.
// And dequantization into f32 tiles for the cuBLAS path (prefill rows):
//   dequant_*: out[i] = W element i, for n elements. Grid: ceil(n / 256); block: 256.
#include "common.cuh"

// Each lane takes every 32nd block (quantized) or element (dense).
struct DotQ8_0 { __device__ float operator()(const u8* w, const float* x, int k, int lane) const {
    float s = 0.0f;
    for (int b = lane; b < k / QK; b += 32) {
        const u8* blk = w + (size_t)b * Q8_0_BYTES;
        const float d = f16_to_f32(load_u16(blk));
        float t = 0.0f;
        for (int i = 0; i < QK; i++) t += (float)(i8)blk[2 + i] * x[b * QK + i];
        s += d * t;
    }
    return s;
} };
struct DotQ4_0 { __device__ float operator()(const u8* w, const float* x, int k, int lane) const {
    float s = 0.0f;
    for (int b = lane; b < k / QK; b += 32) {
        const u8* blk = w + (size_t)b * Q4_0_BYTES;
        const float d = f16_to_f32(load_u16(blk));
        float t = 0.0f;
        for (int i = 0; i < 16; i++) {
            const u8 q = blk[2 + i];
            t += (float)((int)(q & 15) - 8) * x[b * QK + i] + (float)((int)(q >> 4) - 8) * x[b * QK + i + 16];
        }
        s += d * t;
    }
    return s;
} };
struct DotQ4_1 { __device__ float operator()(const u8* w, const float* x, int k, int lane) const {
    float s = 0.0f;
    for (int b = lane; b < k / QK; b += 32) {
        const u8* blk = w + (size_t)b * Q4_1_BYTES;
        const float d = f16_to_f32(load_u16(blk)), mn = f16_to_f32(load_u16(blk + 2));
        float t = 0.0f, xs = 0.0f;
        for (int i = 0; i < 16; i++) {
            const u8 q = blk[4 + i];
            const float x0 = x[b * QK + i], x1 = x[b * QK + i + 16];
            t += (float)(q & 15) * x0 + (float)(q >> 4) * x1;
            xs += x0 + x1;
        }
        s += d * t + mn * xs;
    }
    return s;
} };
struct DotF32 { __device__ float operator()(const u8* w, const float* x, int k, int lane) const {
    const float* wf = (const float*)w;
    float s = 0.0f;
    for (int i = lane; i < k; i += 32) s += wf[i] * x[i];
    return s;
} };
struct DotF16 { __device__ float operator()(const u8* w, const float* x, int k, int lane) const {
    float s = 0.0f;
    for (int i = lane; i < k; i += 32) s += f16_to_f32(load_u16(w + 2 * i)) * x[i];
    return s;
} };
struct DotBF16 { __device__ float operator()(const u8* w, const float* x, int k, int lane) const {
    float s = 0.0f;
    for (int i = lane; i < k; i += 32) s += bf16_to_f32(load_u16(w + 2 * i)) * x[i];
    return s;
} };

extern "C" __global__ void gemv_q8_0(const u8* w, const float* x, float* out, int m, int k) { gemv(w, x, out, m, k, (size_t)(k / QK) * Q8_0_BYTES, DotQ8_0()); }
extern "C" __global__ void gemv_q4_0(const u8* w, const float* x, float* out, int m, int k) { gemv(w, x, out, m, k, (size_t)(k / QK) * Q4_0_BYTES, DotQ4_0()); }
extern "C" __global__ void gemv_q4_1(const u8* w, const float* x, float* out, int m, int k) { gemv(w, x, out, m, k, (size_t)(k / QK) * Q4_1_BYTES, DotQ4_1()); }
extern "C" __global__ void gemv_f32(const u8* w, const float* x, float* out, int m, int k) { gemv(w, x, out, m, k, (size_t)k * 4, DotF32()); }
extern "C" __global__ void gemv_f16(const u8* w, const float* x, float* out, int m, int k) { gemv(w, x, out, m, k, (size_t)k * 2, DotF16()); }
extern "C" __global__ void gemv_bf16(const u8* w, const float* x, float* out, int m, int k) { gemv(w, x, out, m, k, (size_t)k * 2, DotBF16()); }

// Grouped (a mixture's decode rows, `gemv_grouped`): grid (ceil(m / 4), pairs), block 128.
#define GEMV_GROUPED(name, row_bytes, dot)                                                                 \
    extern "C" __global__ void gemv_grouped_##name(const unsigned long long* w, const u32* x_rows,        \
                                                   const float* x, float* out, int m, int k) {             \
        gemv_grouped(w, x_rows, x, out, m, k, row_bytes, dot);                                             \
    }
GEMV_GROUPED(q8_0, (size_t)(k / QK) * Q8_0_BYTES, DotQ8_0())
GEMV_GROUPED(q4_0, (size_t)(k / QK) * Q4_0_BYTES, DotQ4_0())
GEMV_GROUPED(q4_1, (size_t)(k / QK) * Q4_1_BYTES, DotQ4_1())
GEMV_GROUPED(f32, (size_t)k * 4, DotF32())
GEMV_GROUPED(f16, (size_t)k * 2, DotF16())
GEMV_GROUPED(bf16, (size_t)k * 2, DotBF16())

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
