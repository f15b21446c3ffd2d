// Causal grouped-query attention over the KV cache, for prefill rows and decode rows alike:
// query row r (position pos[r]) of head h attends to positions lo..pos[r] of its sequence
// (lo = 0, or pos[r] + 1 - window for a sliding-window layer), whose slot of `cap`
// positions starts at element base[r]; position j is at j % cap (a ring when cap is less
// than the context); kv head = h / (heads / kv_heads).
// The cache is f32 or f16 (attention_f16: rows widened to f32 as they are read; scores and
// sums in f32). `sinks` (null, or one f32 logit per query head: gpt-oss) joins each softmax
// as a logit whose weight is then dropped.
//
// Grid: (rows, kv_heads); block: ATT_WARPS warps (256 threads); no dynamic shared memory,
// so the context is not bounded by it. One block takes one row and one KV head with all
// the query heads that share it (up to ATT_G at a time), so each K and V row is read once
// for the group.
// Warp w takes positions w, w + ATT_WARPS, ...: per position its lanes load the K and V
// rows (lane l holds dims l, l + 32, ...), and for each query head the score (a warp sum)
// updates that warp's running max, sum and weighted V (online softmax). At the end the
// warps' partials are rescaled to the block's max and summed in shared memory in warp
// order, a fixed order: a row's result does not depend on the other rows of the step.
#include "common.cuh"

#define ATT_WARPS 8
#define ATT_G 8
#define ATT_HD 256

// The block's shared memory (about 16.6 KiB): declared once per kernel, not per
// instantiation of `attend`.
struct AttShared {
    float qs[ATT_G][ATT_HD];
    float red[ATT_G][ATT_HD];
    float wmax[ATT_WARPS][ATT_G], wsum[ATT_WARPS][ATT_G];
    float gmax[ATT_G], ginv[ATT_G];
};

template <typename KV, int DPL>
__device__ __forceinline__ void attend(AttShared& sh, const float* __restrict__ q, const KV* __restrict__ cache_k,
                                       const KV* __restrict__ cache_v, float* __restrict__ out,
                                       const u32* __restrict__ pos, const unsigned long long* __restrict__ base,
                                       int heads, int kv_heads, int head_dim, float scale, int cap, int window,
                                       const float* __restrict__ sinks) {
    auto& qs = sh.qs;
    auto& red = sh.red;
    auto& wmax = sh.wmax;
    auto& wsum = sh.wsum;
    auto& gmax = sh.gmax;
    auto& ginv = sh.ginv;
    const int r = blockIdx.x, kvh = blockIdx.y;
    const int group = heads / kv_heads;
    const int width_kv = kv_heads * head_dim;
    const int p = (int)pos[r];
    const int lo = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
    const int n = p + 1 - lo;
    const KV* kb = cache_k + base[r] + (size_t)kvh * head_dim;
    const KV* vb = cache_v + base[r] + (size_t)kvh * head_dim;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = min((int)(blockDim.x >> 5), ATT_WARPS);
    // Warps past ATT_WARPS (a larger block than the host launches) only keep the barriers.
    const int first = warp < warps ? warp : 0x7fffffff;
    for (int g0 = 0; g0 < group; g0 += ATT_G) {
        const int ng = min(ATT_G, group - g0);
        const int h0 = kvh * group + g0;
        for (int i = threadIdx.x; i < ATT_G * ATT_HD; i += blockDim.x) {
            const int g = i / ATT_HD, d = i % ATT_HD;
            qs[g][d] = (g < ng && d < head_dim) ? q[((size_t)r * heads + h0 + g) * head_dim + d] : 0.0f;
            red[g][d] = 0.0f;
        }
        __syncthreads();
        float m[ATT_G], l[ATT_G], acc[ATT_G][DPL];
#pragma unroll
        for (int g = 0; g < ATT_G; g++) {
            m[g] = -3.402823466e38f;
            l[g] = 0.0f;
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[g][i] = 0.0f;
        }
        for (int j = first; j < n; j += warps) {
            const size_t at = (size_t)((lo + j) % cap) * width_kv;
            float kr[DPL], vr[DPL];
#pragma unroll
            for (int i = 0; i < DPL; i++) {
                const int d = lane + 32 * i;
                kr[i] = d < head_dim ? kv_load(kb + at, d) : 0.0f;
                vr[i] = d < head_dim ? kv_load(vb + at, d) : 0.0f;
            }
#pragma unroll
            for (int g = 0; g < ATT_G; g++) {
                if (g < ng) {
                    float s = 0.0f;
#pragma unroll
                    for (int i = 0; i < DPL; i++) s = fmaf(qs[g][lane + 32 * i], kr[i], s);
                    s = warp_sum(s) * scale;
                    const float mn = fmaxf(m[g], s);
                    const float c = __expf(m[g] - mn), e = __expf(s - mn);
                    l[g] = fmaf(l[g], c, e);
#pragma unroll
                    for (int i = 0; i < DPL; i++) acc[g][i] = fmaf(e, vr[i], acc[g][i] * c);
                    m[g] = mn;
                }
            }
        }
        if (lane == 0 && warp < warps) {
#pragma unroll
            for (int g = 0; g < ATT_G; g++) {
                wmax[warp][g] = m[g];
                wsum[warp][g] = l[g];
            }
        }
        __syncthreads();
        // The block's max and sum of each head (the sink joins both).
        if (threadIdx.x < (unsigned)ng) {
            const int g = threadIdx.x;
            float mx = wmax[0][g];
            for (int w = 1; w < warps; w++) mx = fmaxf(mx, wmax[w][g]);
            if (sinks != nullptr) mx = fmaxf(mx, sinks[h0 + g]);
            float sum = 0.0f;
            for (int w = 0; w < warps; w++) sum = fmaf(wsum[w][g], __expf(wmax[w][g] - mx), sum);
            if (sinks != nullptr) sum += __expf(sinks[h0 + g] - mx);
            gmax[g] = mx;
            ginv[g] = 1.0f / sum;
        }
        __syncthreads();
        // The warps' weighted V sums, rescaled to the block's max, added in warp order.
        for (int w = 0; w < warps; w++) {
            if (warp == w) {
#pragma unroll
                for (int g = 0; g < ATT_G; g++) {
                    if (g < ng) {
                        const float f = __expf(m[g] - gmax[g]);
#pragma unroll
                        for (int i = 0; i < DPL; i++) {
                            const int d = lane + 32 * i;
                            if (d < head_dim) red[g][d] = fmaf(acc[g][i], f, red[g][d]);
                        }
                    }
                }
            }
            __syncthreads();
        }
        for (int i = threadIdx.x; i < ng * head_dim; i += blockDim.x) {
            const int g = i / head_dim, d = i % head_dim;
            out[((size_t)r * heads + h0 + g) * head_dim + d] = red[g][d] * ginv[g];
        }
        __syncthreads();
    }
}

// head_dim <= ATT_HD (the backend refuses larger heads): DPL dims per lane.
template <typename KV>
__device__ __forceinline__ void attention(const float* q, const KV* cache_k, const KV* cache_v, float* out,
                                          const u32* pos, const unsigned long long* base, int heads, int kv_heads,
                                          int head_dim, float scale, int cap, int window, const float* sinks) {
    __shared__ AttShared sh;
    if (head_dim <= 32)
        attend<KV, 1>(sh, q, cache_k, cache_v, out, pos, base, heads, kv_heads, head_dim, scale, cap, window, sinks);
    else if (head_dim <= 64)
        attend<KV, 2>(sh, q, cache_k, cache_v, out, pos, base, heads, kv_heads, head_dim, scale, cap, window, sinks);
    else if (head_dim <= 128)
        attend<KV, 4>(sh, q, cache_k, cache_v, out, pos, base, heads, kv_heads, head_dim, scale, cap, window, sinks);
    else
        attend<KV, 8>(sh, q, cache_k, cache_v, out, pos, base, heads, kv_heads, head_dim, scale, cap, window, sinks);
}

extern "C" __global__ void attention_f32(const float* __restrict__ q, const float* __restrict__ cache_k,
                                         const float* __restrict__ cache_v, float* __restrict__ out,
                                         const u32* __restrict__ pos, const unsigned long long* __restrict__ base,
                                         int heads, int kv_heads, int head_dim, float scale, int cap, int window,
                                         const float* __restrict__ sinks) {
    attention(q, cache_k, cache_v, out, pos, base, heads, kv_heads, head_dim, scale, cap, window, sinks);
}

extern "C" __global__ void attention_f16(const float* __restrict__ q, const u16* __restrict__ cache_k,
                                         const u16* __restrict__ cache_v, float* __restrict__ out,
                                         const u32* __restrict__ pos, const unsigned long long* __restrict__ base,
                                         int heads, int kv_heads, int head_dim, float scale, int cap, int window,
                                         const float* __restrict__ sinks) {
    attention(q, cache_k, cache_v, out, pos, base, heads, kv_heads, head_dim, scale, cap, window, sinks);
}
