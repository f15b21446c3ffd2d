// Rotate-half RoPE in place: for row r at position pos[r], pair (i, i + d/2) of every head
// is rotated by the angle whose cos/sin are table[pos][i][0..2] (made on the host).
// Grid: (rows, heads); block: d/2 threads.
#include "common.cuh"

extern "C" __global__ void rope_f32(float* x, const float* table, const u32* pos, int heads, int head_dim) {
    const int r = blockIdx.x, h = blockIdx.y, i = threadIdx.x, half = head_dim / 2;
    if (i >= half) return;
    float* v = x + ((size_t)r * heads + h) * head_dim;
    const float* cs = table + ((size_t)pos[r] * half + i) * 2;
    const float c = cs[0], s = cs[1];
    const float x1 = v[i], x2 = v[i + half];
    v[i] = x1 * c - x2 * s;
    v[i + half] = x2 * c + x1 * s;
}
