// Copies the new K and V rows into the cache: row r goes to element offset dst[r] of the
// cache (slot, position and layer folded in on the host), as f32 or rounded to f16.
// Grid: rows; block: any.
#include "common.cuh"

template <typename KV>
__device__ __forceinline__ void kv_store(const float* k, const float* v, KV* cache_k, KV* cache_v, const unsigned long long* dst, int width) {
    const size_t r = blockIdx.x;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        kv_put(cache_k, dst[r] + i, k[r * width + i]);
        kv_put(cache_v, dst[r] + i, v[r * width + i]);
    }
}

extern "C" __global__ void kv_store_f32(const float* k, const float* v, float* cache_k, float* cache_v, const unsigned long long* dst, int width) {
    kv_store(k, v, cache_k, cache_v, dst, width);
}

extern "C" __global__ void kv_store_f16(const float* k, const float* v, u16* cache_k, u16* cache_v, const unsigned long long* dst, int width) {
    kv_store(k, v, cache_k, cache_v, dst, width);
}
