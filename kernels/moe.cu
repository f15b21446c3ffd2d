// A mixture of experts' rows on the device: the rows routed to one expert gathered into a
// block of their own, and the expert's output added back to each row with its routing
// weight. Row lists and weights come through the backend's expert metadata ring.
// Grid: (rows of the list); block: 256 threads over the columns.
#include "common.cuh"

// dst row i = src row rows[i], `cols` f32 each.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ src, const u32* __restrict__ rows,
                                           float* __restrict__ dst, int cols) {
    const float* s = src + (size_t)rows[blockIdx.x] * cols;
    float* d = dst + (size_t)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) d[c] = s[c];
}

// dst row rows[i] += weights[i] * src row i: a rounded product, then a rounded sum (no fused
// multiply-add), as the CPU backend computes it. The rows of one list are distinct.
extern "C" __global__ void scatter_add_rows_f32(const float* __restrict__ src, const u32* __restrict__ rows,
                                                const float* __restrict__ weights, float* __restrict__ dst,
                                                int cols) {
    const float w = weights[blockIdx.x];
    const float* s = src + (size_t)blockIdx.x * cols;
    float* d = dst + (size_t)rows[blockIdx.x] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) d[c] = __fadd_rn(d[c], __fmul_rn(w, s[c]));
}
