// A mixture of experts on the device: its routing (top-k of the router logits), the rows
// routed to one expert gathered into a block of their own and the expert's output added
// back to each row with its routing weight (grid: rows of the list; block: 256 threads
// over the columns), and the grouped form of a step's decode rows. Row lists, weights and
// expert addresses come through the backend's metadata rings.
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

// The grouped form of a mixture's decode rows (Backend::experts): after the grouped GEMVs
// (kernels/matmul_*.cu) each (expert, row) pair p has its own output row.

// Pair p's output row += its expert's bias (grid: pairs; block: 256 over the columns). The
// bias is at bias[p], f32 (dtype 0), f16 (1) or bf16 (2), widened exactly, then added as
// add_bias_f32 adds.
extern "C" __global__ void add_bias_grouped_f32(float* __restrict__ out, const unsigned long long* __restrict__ bias,
                                                int dtype, int cols) {
    const u8* b = (const u8*)bias[blockIdx.x];
    float* o = out + (size_t)blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float v = dtype == 0 ? ((const float*)b)[c]
                        : dtype == 1 ? f16_to_f32(load_u16(b + 2 * c))
                                     : bf16_to_f32(load_u16(b + 2 * c));
        o[c] += v;
    }
}

// Each step row of the chunk gets its pairs' outputs, weighted, in pair order (ascending
// experts): block r takes row row_ids[r] and pairs pair_ids[starts[r]..starts[r + 1]],
// dst = dst + weights[p] * y[p] as scatter_add_rows_f32 computes it (a rounded product,
// then a rounded sum), so the sum is the same bits as one scatter per expert. Grid:
// distinct rows; block: 256 over the columns.
extern "C" __global__ void combine_rows_f32(const float* __restrict__ y, const u32* __restrict__ row_ids,
                                            const u32* __restrict__ starts, const u32* __restrict__ pair_ids,
                                            const float* __restrict__ weights, float* __restrict__ dst, int cols) {
    float* d = dst + (size_t)row_ids[blockIdx.x] * cols;
    const u32 first = starts[blockIdx.x], last = starts[blockIdx.x + 1];
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = d[c];
        for (u32 i = first; i < last; i++) {
            const u32 p = pair_ids[i];
            v = __fadd_rn(v, __fmul_rn(weights[p], y[(size_t)p * cols + c]));
        }
        d[c] = v;
    }
}

// (value, index) a beats b in the host's top-k order (daemon/src/model/moe.rs): a larger
// value, ties to the lower index, NaN below every number; an empty b (index < 0) loses.
__device__ __forceinline__ bool topk_beats(float av, int ai, float bv, int bi) {
    if (bi < 0) return ai >= 0;
    if (ai < 0) return false;
    const bool an = av != av, bn = bv != bv;
    if (an || bn) return an && bn ? ai < bi : bn;
    return av > bv || (av == bv && ai < bi);
}

// A mixture's routing on the device, as the host routes (daemon/src/model/moe.rs): per
// row of n router logits, gating 0 takes the softmax over all n (f32, exp(x - max) over
// their sum) and the k most probable, renormalized to sum 1 when `norm`; gating 1 takes
// the k largest logits and a softmax over those. Out: k experts (u32) and weights (f32) a
// row, in descending order. One warp per row (grid: rows; block: 32); dynamic shared
// memory n floats and n bytes.
extern "C" __global__ void router_topk_f32(const float* __restrict__ logits, u32* __restrict__ experts,
                                           float* __restrict__ weights, int n, int k, int gating, int norm) {
    DYNAMIC_SHARED(float, topk_smem);
    float* p = topk_smem;
    u8* taken = (u8*)(topk_smem + n);
    const int lane = threadIdx.x;
    const float* row = logits + (size_t)blockIdx.x * n;
    u32* ex = experts + (size_t)blockIdx.x * k;
    float* wt = weights + (size_t)blockIdx.x * k;
    if (gating == 0) {
        float m = __int_as_float(0xff800000);
        for (int e = lane; e < n; e += 32) m = fmaxf(m, row[e]);
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float s = 0.0f;
        for (int e = lane; e < n; e += 32) {
            const float v = expf(row[e] - m);
            p[e] = v;
            s += v;
        }
        s = warp_sum(s);
        for (int e = lane; e < n; e += 32) p[e] = p[e] / s;
    } else {
        for (int e = lane; e < n; e += 32) p[e] = row[e];
    }
    for (int e = lane; e < n; e += 32) taken[e] = 0;
    __syncwarp();
    for (int t = 0; t < k; t++) {
        float bv = 0.0f;
        int bi = -1;
        for (int e = lane; e < n; e += 32)
            if (!taken[e] && topk_beats(p[e], e, bv, bi)) { bv = p[e]; bi = e; }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (topk_beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) {
            ex[t] = (u32)bi;
            wt[t] = bv;
            taken[bi] = 1;
        }
        __syncwarp();
    }
    if (lane == 0 && (gating == 1 || norm)) {
        // In the order taken, one at a time, as the host sums them.
        float s = 0.0f;
        if (gating == 1) {
            const float m = wt[0];
            for (int t = 0; t < k; t++) {
                wt[t] = expf(wt[t] - m);
                s += wt[t];
            }
        } else {
            for (int t = 0; t < k; t++) s += wt[t];
        }
        for (int t = 0; t < k; t++) wt[t] = wt[t] / s;
    }
}
