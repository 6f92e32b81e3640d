// Paged attention over the KV cache, online softmax (running max and sum, f32).
//
// Grid: (token, kv head, head group). A block serves up to `group_block` query heads that
// share one kv head, so each K/V tile is loaded once for all of them. Keys are visited in
// tiles of TILE over the visible range only:
//   request r owns tokens query_start_loc[r] .. query_start_loc[r+1]; its query i sits at
//   position p = seq_lens[r] - query_len + i and sees keys k <= p, with p - k < window
//   (window > 0) and k / chunk == p / chunk (chunk > 0); key k lives in slot
//   block_table[r * table_stride + k / block_size] * block_size + k % block_size.
// logit = dot(q, k) * scale, then cap * tanh(logit / cap) when cap > 0. A sink (one logit
// per query head) joins the softmax denominator without a value.
//
// Shared memory (dynamic): kbase[TILE] (i64), K and V tiles [TILE][D+1] (f32, padded
// against bank conflicts), q [GB][D], p [GB][TILE], running max, sum, rescale [GB] each.
// The accumulator is GB*D values over NT threads, ACC per thread: GB*D <= NT*ACC.
//
// Split-K ("flash decoding"): with num_splits S >= 1 (paged_attention_split_*), grid z is
// (head group, split) = blockIdx.z / S, blockIdx.z % S, and split s of a query whose visible
// keys are key_lo..=key_hi (n of them) takes keys key_lo + s*kps .. + kps - 1 (clipped), where
// kps = max(round_up(ceil(n / S), TILE), SPLIT_MIN_KEYS): short ranges use the first splits
// only, the others are empty. Instead of out, each split writes per (token, query head, split)
// its running max m, sum l (of exp(logit - m)) and unnormalized accumulator acc[D] to `part`:
//   acc at ((t * H + h) * S + s) * D, m at T*H*S*D + (t * H + h) * S + s, l at T*H*S more
// (T = tokens = gridDim.x, H = heads). An empty split (or an idle token) writes m = -inf,
// l = 0 and no acc; a split that met an invalid block writes l = NaN. paged_attention_merge
// then combines the splits of each (token, head), the sink (if any) joining the denominator.

#define TILE 16
#define NT 128
#define ACC 16
#define LANES 8  // threads per dot product
#define SPLIT_MIN_KEYS 64  // fewest keys a split takes (when the range has that many)

template <typename T>
__device__ void paged_attention_impl(
    const float* __restrict__ q, float* __restrict__ out, const T* __restrict__ cache, u64 cache_len,
    u64 s_kv, u64 s_block, u64 s_in_block, u64 s_head, u64 s_dim, u32 block_size, u32 num_heads,
    u32 num_kv_heads, u32 head_dim, u32 group_block, const u32* __restrict__ query_start_loc,
    const u32* __restrict__ seq_lens, const u32* __restrict__ block_table, u32 table_stride, u32 num_reqs,
    float scale, u32 window, u32 chunk, float soft_cap, const float* __restrict__ sinks, u32 num_splits,
    float* __restrict__ part) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const u32 D = head_dim, G = num_heads / num_kv_heads, GB = group_block;
    const u32 t = blockIdx.x, g = blockIdx.y;
    const u32 gpart = blockIdx.z / num_splits, split = blockIdx.z % num_splits;
    const u32 h0 = g * G + gpart * GB;
    const u32 nh = min(GB, G - gpart * GB);
    // Split mode: where this block's partial results go (see the top of the file).
    const u64 rows = (u64)gridDim.x * num_heads * num_splits;
    float* part_acc = part;
    float* part_m = part != 0 ? part + rows * D : 0;
    float* part_l = part != 0 ? part_m + rows : 0;
    const u64 prow0 = ((u64)t * num_heads + h0) * num_splits + split;  // + h * num_splits
    const u32 KS = D + 1;
    const u32 tid = threadIdx.x;

    i64* kbase = (i64*)smem_raw;
    float* k_s = (float*)(kbase + TILE);
    float* v_s = k_s + TILE * KS;
    float* q_s = v_s + TILE * KS;
    float* p_s = q_s + GB * D;
    float* m_s = p_s + GB * TILE;
    float* l_s = m_s + GB;
    float* a_s = l_s + GB;
    __shared__ int bad;

    // The request of this token (last r with query_start_loc[r] <= t).
    bool idle = t >= query_start_loc[num_reqs];
    u32 r = 0;
    if (!idle) {
        u32 lo = 0, hi = num_reqs;
        while (hi - lo > 1) {
            const u32 mid = (lo + hi) / 2;
            if (query_start_loc[mid] <= t) lo = mid; else hi = mid;
        }
        r = lo;
    }
    const i64 qlen = idle ? 0 : (i64)query_start_loc[r + 1] - (i64)query_start_loc[r];
    const i64 pos = idle ? -1 : (i64)seq_lens[r] - qlen + ((i64)t - (i64)query_start_loc[r]);
    i64 key_lo = 0, key_hi = pos;  // inclusive
    if (!idle && pos >= 0) {
        if (window > 0) key_lo = max(key_lo, pos - (i64)window + 1);
        if (chunk > 0) key_lo = max(key_lo, (pos / (i64)chunk) * (i64)chunk);
        if (part != 0) {
            const i64 n = key_hi - key_lo + 1;
            i64 kps = (n + num_splits - 1) / num_splits;
            kps = max((kps + TILE - 1) / TILE * TILE, (i64)SPLIT_MIN_KEYS);
            key_lo += (i64)split * kps;
            key_hi = min(key_hi, key_lo + kps - 1);
        }
    }
    if (idle || pos < 0 || key_lo > key_hi) {
        if (part != 0) {
            if (tid < nh) {
                part_m[prow0 + (u64)tid * num_splits] = LT_NEG_INF;
                part_l[prow0 + (u64)tid * num_splits] = 0.0f;
            }
        } else {
            for (u32 e = tid; e < nh * D; e += NT) out[((u64)t * num_heads + h0 + e / D) * D + e % D] = 0.0f;
        }
        return;
    }
    const u32* table = block_table + (u64)r * table_stride;

    for (u32 e = tid; e < nh * D; e += NT) q_s[e] = q[((u64)t * num_heads + h0 + e / D) * D + e % D];
    if (tid < nh) { m_s[tid] = LT_NEG_INF; l_s[tid] = 0.0f; }
    if (tid == 0) bad = 0;
    float acc[ACC];
#pragma unroll
    for (int a = 0; a < ACC; a++) acc[a] = 0.0f;
    __syncthreads();

    const u32 lane8 = tid % LANES, worker = tid / LANES;
    const u32 workers = NT / LANES;
    const u32 tasks = nh * TILE;

    for (i64 kt = key_lo; kt <= key_hi; kt += TILE) {
        const u32 nk = (u32)min((i64)TILE, key_hi - kt + 1);
        if (tid < nk) {
            const i64 k = kt + tid;
            const u64 blk = table[k / block_size];
            const u64 off = blk * s_block + (u64)(k % block_size) * s_in_block + (u64)g * s_head;
            if (blk == 0xffffffffull || off + s_kv + (u64)(D - 1) * s_dim >= cache_len) {
                kbase[tid] = -1;
                bad = 1;
            } else {
                kbase[tid] = (i64)off;
            }
        }
        __syncthreads();
        for (u32 e = tid; e < TILE * D; e += NT) {
            const u32 j = e / D, d = e % D;
            float kv = 0.0f, vv = 0.0f;
            if (j < nk && kbase[j] >= 0) {
                const u64 off = (u64)kbase[j] + (u64)d * s_dim;
                kv = to_f32(cache[off]);
                vv = to_f32(cache[off + s_kv]);
            }
            k_s[j * KS + d] = kv;
            v_s[j * KS + d] = vv;
        }
        __syncthreads();
        for (u32 base = 0; base < tasks; base += workers) {
            const u32 task = base + worker;
            const u32 h = task / TILE, j = task % TILE;
            float part = 0.0f;
            if (task < tasks) {
                const float* qh = q_s + h * D;
                const float* kj = k_s + j * KS;
                for (u32 d = lane8; d < D; d += LANES) part += qh[d] * kj[d];
            }
            for (int o = LANES / 2; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            if (lane8 == 0 && task < tasks) {
                float s = part * scale;
                if (soft_cap > 0.0f) s = soft_cap * tanhf(s / soft_cap);
                p_s[h * TILE + j] = j < nk ? s : LT_NEG_INF;
            }
        }
        __syncthreads();
        if (tid < nh) {
            float* ph = p_s + tid * TILE;
            const float m_old = m_s[tid];
            float mx = m_old;
            for (u32 j = 0; j < nk; j++) mx = fmaxf(mx, ph[j]);
            const float alpha = mx == LT_NEG_INF ? 1.0f : expf(m_old - mx);
            float sum = 0.0f;
            for (u32 j = 0; j < TILE; j++) {
                const float pj = (j < nk && mx != LT_NEG_INF) ? expf(ph[j] - mx) : 0.0f;
                ph[j] = pj;
                sum += pj;
            }
            l_s[tid] = l_s[tid] * alpha + sum;
            m_s[tid] = mx;
            a_s[tid] = alpha;
        }
        __syncthreads();
#pragma unroll
        for (int a = 0; a < ACC; a++) {
            const u32 e = tid + a * NT;
            if (e < nh * D) {
                const u32 h = e / D, d = e % D;
                const float* ph = p_s + h * TILE;
                float v = acc[a] * a_s[h];
                for (u32 j = 0; j < nk; j++) v += ph[j] * v_s[j * KS + d];
                acc[a] = v;
            }
        }
        __syncthreads();
    }

    if (part != 0) {
#pragma unroll
        for (int a = 0; a < ACC; a++) {
            const u32 e = tid + a * NT;
            if (e < nh * D) part_acc[(prow0 + (u64)(e / D) * num_splits) * D + e % D] = acc[a];
        }
        if (tid < nh) {
            part_m[prow0 + (u64)tid * num_splits] = m_s[tid];
            part_l[prow0 + (u64)tid * num_splits] = bad ? LT_NAN : l_s[tid];
        }
        return;
    }
#pragma unroll
    for (int a = 0; a < ACC; a++) {
        const u32 e = tid + a * NT;
        if (e < nh * D) {
            const u32 h = e / D, d = e % D;
            float m = m_s[h], l = l_s[h], f = 1.0f;
            if (sinks != 0) {
                const float sk = sinks[h0 + h];
                const float mx = fmaxf(m, sk);
                f = m == LT_NEG_INF ? 0.0f : expf(m - mx);
                l = l * f + expf(sk - mx);
            }
            float o = l > 0.0f ? acc[a] * f / l : 0.0f;
            if (bad) o = LT_NAN;
            out[((u64)t * num_heads + h0 + h) * D + d] = o;
        }
    }
}

#define PAGED_ATTENTION(NAME, T)                                                                                  \
    extern "C" __global__ void __launch_bounds__(NT) NAME(                                                        \
        const float* q, float* out, const T* cache, u64 cache_len, u64 s_kv, u64 s_block, u64 s_in_block,        \
        u64 s_head, u64 s_dim, u32 block_size, u32 num_heads, u32 num_kv_heads, u32 head_dim, u32 group_block,    \
        const u32* query_start_loc, const u32* seq_lens, const u32* block_table, u32 table_stride, u32 num_reqs,  \
        float scale, u32 window, u32 chunk, float soft_cap, const float* sinks) {                                 \
        lt_grid_dependency();                                                                                     \
        paged_attention_impl(q, out, cache, cache_len, s_kv, s_block, s_in_block, s_head, s_dim, block_size,      \
                             num_heads, num_kv_heads, head_dim, group_block, query_start_loc, seq_lens,           \
                             block_table, table_stride, num_reqs, scale, window, chunk, soft_cap, sinks, 1u,      \
                             (float*)0);                                                                          \
    }
PAGED_ATTENTION(paged_attention_bf16, lt_bf16)
PAGED_ATTENTION(paged_attention_f16, lt_f16)
PAGED_ATTENTION(paged_attention_f32, float)

// The split pass: as above with `part` [T * H * S * (D + 2)] in place of out.
#define PAGED_ATTENTION_SPLIT(NAME, T)                                                                            \
    extern "C" __global__ void __launch_bounds__(NT) NAME(                                                        \
        const float* q, float* part, const T* cache, u64 cache_len, u64 s_kv, u64 s_block, u64 s_in_block,       \
        u64 s_head, u64 s_dim, u32 block_size, u32 num_heads, u32 num_kv_heads, u32 head_dim, u32 group_block,    \
        const u32* query_start_loc, const u32* seq_lens, const u32* block_table, u32 table_stride, u32 num_reqs,  \
        float scale, u32 window, u32 chunk, float soft_cap, u32 num_splits) {                                     \
        lt_grid_dependency();                                                                                     \
        paged_attention_impl(q, (float*)0, cache, cache_len, s_kv, s_block, s_in_block, s_head, s_dim,           \
                             block_size, num_heads, num_kv_heads, head_dim, group_block, query_start_loc,         \
                             seq_lens, block_table, table_stride, num_reqs, scale, window, chunk, soft_cap,       \
                             (const float*)0, num_splits, part);                                                  \
    }
PAGED_ATTENTION_SPLIT(paged_attention_split_bf16, lt_bf16)
PAGED_ATTENTION_SPLIT(paged_attention_split_f16, lt_f16)
PAGED_ATTENTION_SPLIT(paged_attention_split_f32, float)

// Combines the S splits of each (token, head) (grid: tokens x heads; threads over D):
// M = max(m_i, sink), out = sum exp(m_i - M) acc_i / (sum exp(m_i - M) l_i + exp(sink - M)).
// Splits with m = -inf weigh nothing (their acc is never read); l = NaN anywhere gives NaN.
extern "C" __global__ void paged_attention_merge(const float* __restrict__ part, float* __restrict__ out,
                                                 u32 num_heads, u32 head_dim, u32 num_splits,
                                                 const float* __restrict__ sinks) {
    lt_grid_dependency();
    const u32 t = blockIdx.x, h = blockIdx.y, D = head_dim, S = num_splits;
    const u64 rows = (u64)gridDim.x * num_heads * S;
    const u64 row0 = ((u64)t * num_heads + h) * S;
    const float* pm = part + rows * D + row0;
    const float* pl = part + rows * D + rows + row0;
    float mx = LT_NEG_INF;
    bool bad = false;
    for (u32 s = 0; s < S; s++) {
        mx = fmaxf(mx, pm[s]);
        bad |= isnan(pl[s]);
    }
    float sk = 0.0f;
    if (sinks != 0) {
        sk = sinks[h];
        mx = fmaxf(mx, sk);
    }
    for (u32 d = threadIdx.x; d < D; d += blockDim.x) {
        float num = 0.0f, den = 0.0f;
        for (u32 s = 0; s < S; s++) {
            const float m = pm[s];
            if (m == LT_NEG_INF) continue;
            const float w = expf(m - mx);
            num += w * part[(row0 + s) * D + d];
            den += w * pl[s];
        }
        if (sinks != 0) den += expf(sk - mx);
        float o = den > 0.0f ? num / den : 0.0f;
        if (bad) o = LT_NAN;
        out[((u64)t * num_heads + h) * D + d] = o;
    }
}
