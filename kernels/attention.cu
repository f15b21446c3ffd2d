// Causal grouped-query attention over the KV cache, for prefill rows and decode rows alike:
// query row r (position pos[r]) of head h attends to positions lo..pos[r] of its sequence
// (lo = 0, or pos[r] + 1 - window for a sliding-window layer), whose slot of `cap`
// positions starts at element base[r]; position j is at j % cap (a ring when cap is less
// than the context); kv head = h / (heads / kv_heads).
// The cache is f32 or f16 (attention_f16: rows widened to f32 as they are read; scores and
// sums in f32). `sinks` (null, or one f32 logit per query head: gpt-oss) joins each softmax
// as a logit whose weight is then dropped.
// Grid: (rows, heads); block: 128 threads; dynamic shared memory: one float per position seen.
#include "common.cuh"

template <typename KV>
__device__ __forceinline__ void attention(const float* q, const KV* cache_k, const KV* cache_v, float* out,
                                          const u32* pos, const unsigned long long* base,
                                          int heads, int kv_heads, int head_dim, float scale, int cap, int window,
                                          const float* sinks) {
    extern __shared__ float scores[];
    const int r = blockIdx.x, h = blockIdx.y;
    const int g = h / (heads / kv_heads);
    const int width_kv = kv_heads * head_dim;
    const int p = (int)pos[r];
    const int lo = (window > 0 && p + 1 > window) ? p + 1 - window : 0;
    const int n = p + 1 - lo;
    const float* qr = q + ((size_t)r * heads + h) * head_dim;
    const KV* kb = cache_k + base[r] + (size_t)g * head_dim;
    const KV* vb = cache_v + base[r] + (size_t)g * head_dim;
    // Scores: one warp per position, lanes over the head dimension.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int j = warp; j < n; j += warps) {
        const KV* kr = kb + (size_t)((lo + j) % cap) * width_kv;
        float d = 0.0f;
        for (int i = lane; i < head_dim; i += 32) d += qr[i] * kv_load(kr, i);
        d = warp_sum(d);
        if (lane == 0) scores[j] = d * scale;
    }
    __syncthreads();
    float m = -3.402823466e38f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, scores[j]);
    m = block_max(m);
    if (sinks != nullptr) m = fmaxf(m, sinks[h]);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = __expf(scores[j] - m);
        scores[j] = e;
        sum += e;
    }
    sum = block_sum(sum);
    if (sinks != nullptr) sum += __expf(sinks[h] - m);
    const float inv = 1.0f / sum;
    float* o = out + ((size_t)r * heads + h) * head_dim;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n; j++) acc += scores[j] * kv_load(vb, (size_t)((lo + j) % cap) * width_kv + i);
        o[i] = acc * inv;
    }
}

extern "C" __global__ void attention_f32(const float* q, const float* cache_k, const float* cache_v, float* out,
                                         const u32* pos, const unsigned long long* base,
                                         int heads, int kv_heads, int head_dim, float scale, int cap, int window,
                                         const float* sinks) {
    attention(q, cache_k, cache_v, out, pos, base, heads, kv_heads, head_dim, scale, cap, window, sinks);
}

extern "C" __global__ void attention_f16(const float* q, const u16* cache_k, const u16* cache_v, float* out,
                                         const u32* pos, const unsigned long long* base,
                                         int heads, int kv_heads, int head_dim, float scale, int cap, int window,
                                         const float* sinks) {
    attention(q, cache_k, cache_v, out, pos, base, heads, kv_heads, head_dim, scale, cap, window, sinks);
}
