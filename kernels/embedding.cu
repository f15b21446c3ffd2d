// out[r] = table[ids[r]] dequantized to f32. Grid: rows; block: any.
#include "common.cuh"

extern "C" __global__ void embedding_f32(const u8* t, const u32* ids, float* out, int cols) {
    const float* row = (const float*)t + (size_t)ids[blockIdx.x] * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(size_t)blockIdx.x * cols + i] = row[i];
}
extern "C" __global__ void embedding_f16(const u8* t, const u32* ids, float* out, int cols) {
    const u8* row = t + (size_t)ids[blockIdx.x] * cols * 2;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(size_t)blockIdx.x * cols + i] = f16_to_f32(load_u16(row + 2 * i));
}
extern "C" __global__ void embedding_bf16(const u8* t, const u32* ids, float* out, int cols) {
    const u8* row = t + (size_t)ids[blockIdx.x] * cols * 2;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) out[(size_t)blockIdx.x * cols + i] = bf16_to_f32(load_u16(row + 2 * i));
}
#define EMBED_Q(name, bytes, deq)                                                              \
    extern "C" __global__ void name(const u8* t, const u32* ids, float* out, int cols) {      \
        const u8* row = t + (size_t)ids[blockIdx.x] * (cols / QK) * bytes;                   \
        for (int i = threadIdx.x; i < cols; i += blockDim.x)                                   \
            out[(size_t)blockIdx.x * cols + i] = deq(row + (i / QK) * bytes, i % QK);          \
    }
EMBED_Q(embedding_q8_0, Q8_0_BYTES, deq_q8_0)
EMBED_Q(embedding_q4_0, Q4_0_BYTES, deq_q4_0)
EMBED_Q(embedding_q4_1, Q4_1_BYTES, deq_q4_1)
