// Probabilities of chosen query rows over the keys each sees, from the paged cache: what
// a capturing request's key statistics, span masses and streamed rows are summed from
// (the CPU's flash kernel keeps them as it runs; here one kernel after the layer's
// attention, while q and the cache are on the device).
//
// Grid: (asked row i, query head h); blockDim.x a multiple of 32. Row i is
// rows[4i .. 4i+4] = (batch token t, request r, first key lo, key count n); its values
// start at offsets[i] and are [num_heads, n]: head h's at offsets[i] + h * n. Key k
// (lo <= k < lo + n) lives in slot block_table[r * table_stride + k / block_size] *
// block_size + k % block_size, as in paged_attention.
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
    const float sink = sinks != 0 ? sinks[h] : LT_NEG_INF;
    m = fmaxf(m, sink);

    // The row's own writes above are visible to the whole block after block_max's barrier.
    float sum = 0.0f;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) {
        const float e = expf(o[j] - m);
        o[j] = e;
        sum += e;
    }
    sum = block_sum(sum);
    if (sinks != 0) sum += expf(sink - m);
    const float inv = bad > 0.0f || !(sum > 0.0f) ? LT_NAN : 1.0f / sum;
    for (u32 j = threadIdx.x; j < n; j += blockDim.x) o[j] *= inv;
}

#define ROW_PROBABILITIES(NAME, T)                                                                              \
    extern "C" __global__ void NAME(const float* q, const T* cache, u64 cache_len, u64 s_block, u64 s_in_block, \
                                    u64 s_head, u64 s_dim, u32 block_size, u32 num_heads, u32 num_kv_heads,      \
                                    u32 head_dim, const u32* rows, const u64* offsets, const u32* block_table,   \
                                    u32 table_stride, float scale, float soft_cap, const float* sinks,           \
                                    float* out) {                                                               \
        row_probabilities_impl(q, cache, cache_len, s_block, s_in_block, s_head, s_dim, block_size, num_heads,   \
                               num_kv_heads, head_dim, rows, offsets, block_table, table_stride, scale,         \
                               soft_cap, sinks, out);                                                            \
    }
ROW_PROBABILITIES(row_probabilities_bf16, lt_bf16)
ROW_PROBABILITIES(row_probabilities_f16, lt_f16)
ROW_PROBABILITIES(row_probabilities_f32, float)
