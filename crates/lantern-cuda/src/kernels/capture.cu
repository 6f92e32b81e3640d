// Probabilities of query rows over the keys each sees, from the paged cache, with the
// layer's scale, soft-cap and sinks: what a capturing request's key statistics, span
// masses and streamed rows are summed from (row_probabilities: chosen rows of a step,
// one kernel after the layer's attention, while q and the cache are on the device; the
// CPU's flash kernel keeps them as it runs), and a finished capture's maps
// (map_probabilities, then combine_heads and top_k_rows: only the map leaves the device).
//
// Key k of a request lives in slot table[k / block_size] * block_size + k % block_size
// (table: the request's row of the block table), as in paged_attention.
// logit = dot(q, k) * scale, then cap * tanh(logit / cap) when cap > 0; p = exp(logit - M)
// / (sum over the row of exp(logit - M) + exp(sink - M)), M the largest logit (and sink).
// A key in an invalid block (or out of the cache) makes the row's values NaN: the host
// then drops the row's figures instead of using them.

// Largest value over the block (blockDim.x a multiple of 32, at most 1024); every thread
// gets it.
__device__ __forceinline__ float block_max(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float m = lane < (int)(blockDim.x >> 5) ? partial[lane] : LT_NEG_INF;
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) total = m;
    }
    __syncthreads();
    return total;
}

// Probabilities of the query row qh (head_dim D) of one request (its block table row
// `table`) over its n keys from key lo, kv head kvh, into o[0 .. n), by the whole block.
// Returns false, every thread alike, when a key lies in an invalid block or past the
// cache; the values are then NaN.
template <typename T>
__device__ bool probabilities_over_keys(
    const float* __restrict__ qh, const T* __restrict__ cache, u64 cache_len, u64 s_block, u64 s_in_block,
    u64 s_head, u64 s_dim, u32 block_size, u32 D, const u32* __restrict__ table, u32 lo, u32 n, u32 kvh,
    float scale, float soft_cap, bool has_sink, float sink, float* __restrict__ o) {
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;

    // The logits, one warp per key.
    float mx = LT_NEG_INF;
    for (u32 j = warp; j < n; j += warps) {
        const u64 k = (u64)lo + j;
        const u64 blk = table[k / block_size];
        const u64 off = blk * s_block + (k % block_size) * s_in_block + (u64)kvh * s_head;
        float logit;
        if (blk == 0xffffffffull || off + (u64)(D - 1) * s_dim >= cache_len) {
            logit = LT_NAN;
        } else {
            float s = 0.0f;
            for (u32 d = lane; d < D; d += 32) s += qh[d] * to_f32(cache[off + (u64)d * s_dim]);
            s = warp_sum(s) * scale;
            logit = soft_cap > 0.0f ? soft_cap * tanhf(s / soft_cap) : s;
        }
        if (lane == 0) o[j] = logit;
        mx = isnan(logit) || isnan(mx) ? LT_NAN : fmaxf(mx, logit);
    }
    // NaN wins the maximum (fmaxf would drop it), so a bad key spoils the whole row.
    const float bad = block_sum(isnan(mx) ? 1.0f : 0.0f);
    float m = block_max(isnan(mx) ? LT_NEG_INF : mx);
    if (has_sink) m = fmaxf(m, sink);

    // The row's own writes above are visible to the whole block after block_max's barrier.
    float sum = 0.0f;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = expf(o[j] - m);
        o[j] = e;
        sum += e;
    }
    sum = block_sum(sum);
    if (has_sink) sum += expf(sink - m);
    const float inv = bad > 0.0f || !(sum > 0.0f) ? LT_NAN : 1.0f / sum;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) o[j] *= inv;
    return !(bad > 0.0f);
}

// Grid: (asked row i, query head h); blockDim.x a multiple of 32. Row i is
// rows[4i .. 4i+4] = (batch token t, request r, first key lo, key count n); its values
// start at offsets[i] and are [num_heads, n]: head h's at offsets[i] + h * n.
template <typename T>
__device__ void row_probabilities_impl(
    const float* __restrict__ q, const T* __restrict__ cache, u64 cache_len, u64 s_block, u64 s_in_block,
    u64 s_head, u64 s_dim, u32 block_size, u32 num_heads, u32 num_kv_heads, u32 head_dim,
    const u32* __restrict__ rows, const u64* __restrict__ offsets, const u32* __restrict__ block_table,
    u32 table_stride, float scale, float soft_cap, const float* __restrict__ sinks, float* __restrict__ out) {
    const u32 i = blockIdx.x, h = blockIdx.y, D = head_dim;
    const u32 t = rows[4 * i], r = rows[4 * i + 1], lo = rows[4 * i + 2], n = rows[4 * i + 3];
    const u32 kvh = h / (num_heads / num_kv_heads);
    const float* qh = q + ((u64)t * num_heads + h) * D;
    const u32* table = block_table + (u64)r * table_stride;
    float* o = out + offsets[i] + (u64)h * n;
    const float sink = sinks != 0 ? sinks[h] : LT_NEG_INF;
    probabilities_over_keys(qh, cache, cache_len, s_block, s_in_block, s_head, s_dim, block_size, D, table, lo, n,
                            kvh, scale, soft_cap, sinks != 0, sink, o);
}

#define ROW_PROBABILITIES(NAME, T)                                                                              \
    extern "C" __global__ void NAME(const float* q, const T* cache, u64 cache_len, u64 s_block, u64 s_in_block, \
                                    u64 s_head, u64 s_dim, u32 block_size, u32 num_heads, u32 num_kv_heads,      \
                                    u32 head_dim, const u32* rows, const u64* offsets, const u32* block_table,   \
                                    u32 table_stride, float scale, float soft_cap, const float* sinks,           \
                                    float* out) {                                                               \
        lt_grid_dependency();                                                                                   \
        row_probabilities_impl(q, cache, cache_len, s_block, s_in_block, s_head, s_dim, block_size, num_heads,   \
                               num_kv_heads, head_dim, rows, offsets, block_table, table_stride, scale,         \
                               soft_cap, sinks, out);                                                            \
    }
ROW_PROBABILITIES(row_probabilities_bf16, lt_bf16)
ROW_PROBABILITIES(row_probabilities_f16, lt_f16)
ROW_PROBABILITIES(row_probabilities_f32, float)

// A finished capture's rows of one request on one layer. Grid: (row i, asked head hi);
// blockDim.x a multiple of 32. q is [rows, num_asked, head_dim] (the asked heads' query
// rows, in order); head_ids[hi] is the layer's head hi stands for. Row i sees keys
// rows[2i] .. rows[2i] + rows[2i+1] of the request (block table `table`); its values go
// to out[(i * num_asked + hi) * num_keys + key], the rest of the row left as it is (the
// caller zeroed it). A row meeting an invalid block sets *bad.
template <typename T>
__device__ void map_probabilities_impl(
    const float* __restrict__ q, const T* __restrict__ cache, u64 cache_len, u64 s_block, u64 s_in_block,
    u64 s_head, u64 s_dim, u32 block_size, u32 group, u32 head_dim, const u32* __restrict__ head_ids,
    u32 num_asked, const u32* __restrict__ rows, const u32* __restrict__ table, u32 num_keys, float scale,
    float soft_cap, const float* __restrict__ sinks, float* __restrict__ out, u32* __restrict__ bad) {
    const u32 i = blockIdx.x, hi = blockIdx.y, D = head_dim;
    const u32 lo = rows[2 * i], n = rows[2 * i + 1];
    if (n == 0) return;
    const u32 h = head_ids[hi];
    const u64 row = (u64)i * num_asked + hi;
    const float* qh = q + row * D;
    float* o = out + row * num_keys + lo;
    const float sink = sinks != 0 ? sinks[h] : LT_NEG_INF;
    const bool ok = probabilities_over_keys(qh, cache, cache_len, s_block, s_in_block, s_head, s_dim, block_size, D,
                                            table, lo, n, h / group, scale, soft_cap, sinks != 0, sink, o);
    if (!ok && threadIdx.x == 0) atomicOr(bad, 1u);
}

#define MAP_PROBABILITIES(NAME, T)                                                                             \
    extern "C" __global__ void NAME(const float* q, const T* cache, u64 cache_len, u64 s_block, u64 s_in_block, \
                                    u64 s_head, u64 s_dim, u32 block_size, u32 group, u32 head_dim,              \
                                    const u32* head_ids, u32 num_asked, const u32* rows, const u32* table,       \
                                    u32 num_keys, float scale, float soft_cap, const float* sinks, float* out,  \
                                    u32* bad) {                                                                 \
        lt_grid_dependency();                                                                                   \
        map_probabilities_impl(q, cache, cache_len, s_block, s_in_block, s_head, s_dim, block_size, group,       \
                               head_dim, head_ids, num_asked, rows, table, num_keys, scale, soft_cap, sinks,    \
                               out, bad);                                                                        \
    }
MAP_PROBABILITIES(map_probabilities_bf16, lt_bf16)
MAP_PROBABILITIES(map_probabilities_f16, lt_f16)
MAP_PROBABILITIES(map_probabilities_f32, float)

// Each row's heads combined, as lantern_attn::combine_heads does on the host: the sum
// (mode 1: then times inv, which is 1 / heads) or the maximum (mode 2), from zero, in
// head order. Grid: (key blocks, rows); one thread a key. in [rows, heads, num_keys],
// out [rows, num_keys].
extern "C" __global__ void combine_heads(const float* __restrict__ in, u32 heads, u32 num_keys, u32 mode, float inv,
                                         float* __restrict__ out) {
    lt_grid_dependency();
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x, r = blockIdx.y;
    if (j >= num_keys) return;
    const float* row = in + (u64)r * heads * num_keys + j;
    float acc = 0.0f;
    for (u32 h = 0; h < heads; ++h) {
        const float v = row[(u64)h * num_keys];
        acc = mode == 2 ? fmaxf(acc, v) : __fadd_rn(acc, v);
    }
    if (mode == 1) acc = __fmul_rn(acc, inv);
    out[(u64)r * num_keys + j] = acc;
}

// The k largest values of each row of in ([rows, num_keys], no NaN) with their positions,
// in order (values descending, ties by lower position), as lantern_attn::top_k gives
// them: vals and idx [rows, k], k <= num_keys. Grid: (row); blockDim.x a multiple of 32.
extern "C" __global__ void top_k_rows(const float* __restrict__ in, u32 num_keys, u32 k, float* __restrict__ vals,
                                      u32* __restrict__ idx) {
    lt_grid_dependency();
    const u64 r = blockIdx.x;
    lt_block_top_k(in + r * num_keys, num_keys, k, vals + r * k, idx + r * k, 1);
}
