// Copies the new K and V rows into the cache: row r goes to element offset dst[r] of the
// cache (slot, position and layer folded in on the host). Grid: rows; block: any.
#include "common.cuh"

extern "C" __global__ void kv_store_f32(const float* k, const float* v, float* cache_k, float* cache_v, const unsigned long long* dst, int width) {
    const size_t r = blockIdx.x;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        cache_k[dst[r] + i] = k[r * width + i];
        cache_v[dst[r] + i] = v[r * width + i];
    }
}
