// Writing keys and values into the paged cache through element strides, with or without
// the step's RoPE.
//
// The key of token slot s, kv head h, dim i lives at
//   (s / block_size) * s_block + (s % block_size) * s_in_block + h * s_head + i * s_dim
// and its value at the same + s_kv. A negative slot is skipped; an element whose offset
// falls outside the cache is not written.

// The keys and values of a step into the cache, with the step's RoPE in the same launch:
// each key turned as it is written (k itself is left as it was), and the queries of the kv
// head's group turned in place, as rope_qk would (lt_rope_pair). Grid (token, kv head); q
// [t, q_heads, head_dim] with q_heads a multiple of num_kv_heads, cos_t and sin_t [t, half].
// With half = 0 nothing is turned (no q, cos_t or sin_t read): the plain kv_write.
template <typename T>
__device__ void rope_kv_write_impl(float* __restrict__ q, u32 q_heads, const float* __restrict__ k,
                                   const float* __restrict__ v, const float* __restrict__ cos_t,
                                   const float* __restrict__ sin_t, u32 half, u32 adjacent,
                                   const i64* __restrict__ slots, T* __restrict__ cache, u64 cache_len, u64 s_kv,
                                   u64 s_block, u64 s_in_block, u64 s_head, u64 s_dim, u32 block_size,
                                   u32 num_kv_heads, u32 head_dim) {
    const u32 t = blockIdx.x, h = blockIdx.y, group = q_heads / num_kv_heads;
    const float* c = cos_t + (u64)t * half;
    const float* s = sin_t + (u64)t * half;
    for (u32 j = threadIdx.x; j < group * half; j += blockDim.x) {
        const u32 qh = h * group + j / half, i = j % half;
        lt_rope_pair(q + ((u64)t * q_heads + qh) * head_dim, i, half, adjacent, c[i], s[i]);
    }
    const i64 slot = slots[t];
    if (slot < 0) return;
    const u64 sl = (u64)slot;
    const u64 base = (sl / block_size) * s_block + (sl % block_size) * s_in_block + (u64)h * s_head;
    const u64 src = ((u64)t * num_kv_heads + h) * head_dim;
    for (u32 d = threadIdx.x; d < head_dim; d += blockDim.x) {
        const u64 off = base + (u64)d * s_dim;
        if (off + s_kv < cache_len) {
            cache[off] = from_f32<T>(lt_rope_value(k + src, d, half, adjacent, c, s));
            cache[off + s_kv] = from_f32<T>(v[src + d]);
        }
    }
}

#define KV_WRITE(NAME, T)                                                                                        \
    extern "C" __global__ void NAME(const float* k, const float* v, const i64* slots, T* cache, u64 cache_len,  \
                                    u64 s_kv, u64 s_block, u64 s_in_block, u64 s_head, u64 s_dim, u32 block_size, \
                                    u32 num_kv_heads, u32 head_dim) {                                            \
        lt_grid_dependency();                                                                                    \
        rope_kv_write_impl(0, num_kv_heads, k, v, 0, 0, 0u, 0u, slots, cache, cache_len, s_kv, s_block,         \
                           s_in_block, s_head, s_dim, block_size, num_kv_heads, head_dim);                       \
    }
KV_WRITE(kv_write_bf16, lt_bf16)
KV_WRITE(kv_write_f16, lt_f16)
KV_WRITE(kv_write_f32, float)

#define ROPE_KV_WRITE(NAME, T)                                                                                  \
    extern "C" __global__ void NAME(float* q, u32 q_heads, const float* k, const float* v, const float* cos_t,  \
                                    const float* sin_t, u32 half, u32 adjacent, const i64* slots, T* cache,     \
                                    u64 cache_len, u64 s_kv, u64 s_block, u64 s_in_block, u64 s_head,          \
                                    u64 s_dim, u32 block_size, u32 num_kv_heads, u32 head_dim) {               \
        lt_grid_dependency();                                                                                   \
        rope_kv_write_impl(q, q_heads, k, v, cos_t, sin_t, half, adjacent, slots, cache, cache_len, s_kv,      \
                           s_block, s_in_block, s_head, s_dim, block_size, num_kv_heads, head_dim);            \
    }
ROPE_KV_WRITE(rope_kv_write_bf16, lt_bf16)
ROPE_KV_WRITE(rope_kv_write_f16, lt_f16)
ROPE_KV_WRITE(rope_kv_write_f32, float)
