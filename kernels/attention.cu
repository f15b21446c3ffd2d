// Causal grouped-query attention over the KV cache, for prefill rows and decode rows alike:
// query row r (position pos[r]) of head h attends to positions lo..pos[r] of its sequence
// (lo = 0, or pos[r] + 1 - window for a sliding-window layer), whose slot of `cap`
// positions starts at element base[r]; position j is at j % cap (a ring when cap is less
// than the context); kv head = h / (heads / kv_heads). A token tree's row (anc[r] != 0: its
// ancestors in its span, itself included, bit i the span's row i) is at position
// root + depth, root = pos[r] + 1 - popcount(anc[r]): its key j >= root is the ancestor at
// depth j - root, stored at root + (that ancestor's row), so it reads, in order, the keys
// a lone decode row of the same text reads (`RowKeys` in backend/mod.rs).
// The cache is f32 or f16 (attention_part_f16: rows widened to f32 as they are read;
// scores and sums in f32). `sinks` (null, or one f32 logit per query head: gpt-oss) joins
// each softmax as a logit whose weight is then dropped.
//
// Two kernels, flash-decoding style, so a long context is spread over many blocks even
// for one decode row:
//   attention_part_*: grid (rows, kv_heads, splits); block: ATT_WARPS warps (256 threads).
//     Block (r, g, s) takes row r's positions s * split .. (s + 1) * split - 1 (of the
//     n = pos[r] + 1 - lo it sees) and the query heads that share KV head g (up to ATT_G
//     at a time), so each K and V row is read once for the group. Warp w takes positions
//     w, w + ATT_WARPS, ...: per position its lanes load the K and V rows (lane l holds
//     dims l, l + 32, ...), and for each query head the score (a warp sum) updates that
//     warp's running max, sum and weighted V (online softmax). The warps' partials are
//     rescaled to the block's max and summed in shared memory in warp order; the block
//     writes per head its max M, sum L and weighted V sum (head_dim floats) to
//     part[((r * s_max + s) * heads + h) * (head_dim + 2)]. Blocks past a row's splits
//     return at once.
//   attention_combine_f32: grid (rows, heads); block: 128 threads over the dims. Row r's
//     ceil(n / split) partials of head h, in split order, with the sink: out = sum_s V_s *
//     exp(M_s - M) / (sum_s L_s * exp(M_s - M) + exp(sink - M)), M the largest.
// No shared memory per position, so the context is not bounded by it. A row's splits
// depend only on its own position, and every sum runs in a fixed order: its result does
// not depend on the other rows of the step or how the host groups rows into launches.
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
    float gmax[ATT_G], gsum[ATT_G];
};

// The positions row r sees: lo .. lo + n - 1.
__device__ __forceinline__ void visible(int p, int window, int& lo, int& n) {
    lo = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
    n = p + 1 - lo;
}

// Where key position j of a row is stored: j itself for a causal row (tree == 0) and below
// a tree's root; past the root, the row of the (j - root)-th ancestor (its set bit).
__device__ __forceinline__ int tree_key(int j, int root, unsigned long long tree) {
    if (tree == 0ull || j < root) return j;
    for (int i = 0; i < j - root; i++) tree &= tree - 1ull;
    return root + __ffsll((long long)tree) - 1;
}

template <typename KV, int DPL>
__device__ __forceinline__ void attend(AttShared& sh, const float* __restrict__ q, const KV* __restrict__ cache_k,
                                       const KV* __restrict__ cache_v, float* __restrict__ part,
                                       const u32* __restrict__ pos, const unsigned long long* __restrict__ base,
                                       const unsigned long long* __restrict__ anc, int heads, int kv_heads,
                                       int head_dim, float scale, int cap, int window, int split, int s_max) {
    auto& qs = sh.qs;
    auto& red = sh.red;
    auto& wmax = sh.wmax;
    auto& wsum = sh.wsum;
    auto& gmax = sh.gmax;
    auto& gsum = sh.gsum;
    const int r = blockIdx.x, kvh = blockIdx.y, sp = blockIdx.z;
    const int group = heads / kv_heads;
    const int width_kv = kv_heads * head_dim;
    int lo, n;
    visible((int)pos[r], window, lo, n);
    const unsigned long long tree = anc[r];
    const int root = (int)pos[r] + 1 - __popcll(tree);
    // This block's positions: begin .. end - 1 of the n (the whole block leaves together).
    const int begin = sp * split;
    if (begin >= n) return;
    const int end = min(n, begin + split);
    const KV* kb = cache_k + base[r] + (size_t)kvh * head_dim;
    const KV* vb = cache_v + base[r] + (size_t)kvh * head_dim;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = min((int)(blockDim.x >> 5), ATT_WARPS);
    // Warps past ATT_WARPS (a larger block than the host launches) only keep the barriers.
    const int first = warp < warps ? begin + warp : 0x7fffffff;
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
        for (int j = first; j < end; j += warps) {
            const size_t at = (size_t)(tree_key(lo + j, root, tree) % cap) * width_kv;
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
        // The block's max and sum of each head.
        if (threadIdx.x < (unsigned)ng) {
            const int g = threadIdx.x;
            float mx = wmax[0][g];
            for (int w = 1; w < warps; w++) mx = fmaxf(mx, wmax[w][g]);
            float sum = 0.0f;
            for (int w = 0; w < warps; w++) sum = fmaf(wsum[w][g], __expf(wmax[w][g] - mx), sum);
            gmax[g] = mx;
            gsum[g] = sum;
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
        // This split's partial per head: max, sum, then the weighted V sum.
        for (int i = threadIdx.x; i < ng * (head_dim + 2); i += blockDim.x) {
            const int g = i / (head_dim + 2), d = i % (head_dim + 2);
            float* rec = part + (((size_t)r * s_max + sp) * heads + h0 + g) * (head_dim + 2);
            rec[d] = d == 0 ? gmax[g] : d == 1 ? gsum[g] : red[g][d - 2];
        }
        __syncthreads();
    }
}

// head_dim <= ATT_HD (the backend refuses larger heads): DPL dims per lane.
template <typename KV>
__device__ __forceinline__ void attention_part(const float* q, const KV* cache_k, const KV* cache_v, float* part,
                                               const u32* pos, const unsigned long long* base,
                                               const unsigned long long* anc, int heads, int kv_heads, int head_dim,
                                               float scale, int cap, int window, int split, int s_max) {
    __shared__ AttShared sh;
    if (head_dim <= 32)
        attend<KV, 1>(sh, q, cache_k, cache_v, part, pos, base, anc, heads, kv_heads, head_dim, scale, cap, window,
                      split, s_max);
    else if (head_dim <= 64)
        attend<KV, 2>(sh, q, cache_k, cache_v, part, pos, base, anc, heads, kv_heads, head_dim, scale, cap, window,
                      split, s_max);
    else if (head_dim <= 128)
        attend<KV, 4>(sh, q, cache_k, cache_v, part, pos, base, anc, heads, kv_heads, head_dim, scale, cap, window,
                      split, s_max);
    else
        attend<KV, 8>(sh, q, cache_k, cache_v, part, pos, base, anc, heads, kv_heads, head_dim, scale, cap, window,
                      split, s_max);
}

// The cache's element type is the kernel's (f32 or f16 as u16); the launcher passes both
// through one parameter list.
#define ATTENTION_PART(name, KV)                                                                             \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                    \
        name(const float* __restrict__ q, const void* __restrict__ cache_k, const void* __restrict__ cache_v, \
             float* __restrict__ part, const u32* __restrict__ pos, const unsigned long long* __restrict__ base, \
             const unsigned long long* __restrict__ anc, int heads, int kv_heads, int head_dim, float scale,       \
             int cap, int window, int split, int s_max) {                                                        \
        attention_part(q, (const KV*)cache_k, (const KV*)cache_v, part, pos, base, anc, heads, kv_heads,        \
                       head_dim, scale, cap, window, split, s_max);                                             \
    }
ATTENTION_PART(attention_part_f32, float)
ATTENTION_PART(attention_part_f16, u16)

extern "C" __global__ void attention_combine_f32(const float* __restrict__ part, float* __restrict__ out,
                                                 const u32* __restrict__ pos, int heads, int head_dim, int window,
                                                 int split, int s_max, const float* __restrict__ sinks) {
    const int r = blockIdx.x, h = blockIdx.y;
    int lo, n;
    visible((int)pos[r], window, lo, n);
    const int splits = (n + split - 1) / split;
    const size_t stride = (size_t)heads * (head_dim + 2);
    const float* rec = part + ((size_t)r * s_max * heads + h) * (head_dim + 2);
    float mx = rec[0];
    for (int s = 1; s < splits; s++) mx = fmaxf(mx, rec[s * stride]);
    if (sinks != nullptr) mx = fmaxf(mx, sinks[h]);
    float sum = 0.0f;
    for (int s = 0; s < splits; s++) sum = fmaf(rec[s * stride + 1], __expf(rec[s * stride] - mx), sum);
    if (sinks != nullptr) sum += __expf(sinks[h] - mx);
    const float inv = 1.0f / sum;
    float* o = out + ((size_t)r * heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < splits; s++) acc = fmaf(rec[s * stride + 2 + d], __expf(rec[s * stride] - mx), acc);
        o[d] = acc * inv;
    }
}
