// Row-wise kernels: one block per row.

// out = x / sqrt(mean(x^2) + eps) * weight; out may be x itself.
extern "C" __global__ void rms_norm(const float* x, const float* __restrict__ weight, float* out, u32 width, float eps) {
    lt_grid_dependency();
    const float* src = x + (u64)blockIdx.x * width;
    float* dst = out + (u64)blockIdx.x * width;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) {
        const float v = src[i];
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)width + eps);
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i] * inv * weight[i];
}

// LayerNorm of one row per block: (x - mean) / sqrt(var + eps) * weight + bias, the
// variance biased (PyTorch's layer_norm); two passes over the row for the mean, then the
// variance of the centred values.
extern "C" __global__ void layer_norm(const float* x, const float* __restrict__ weight,
                                      const float* __restrict__ bias, float* out, u32 width, float eps) {
    lt_grid_dependency();
    const float* src = x + (u64)blockIdx.x * width;
    float* dst = out + (u64)blockIdx.x * width;
    float s = 0.0f;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) s += src[i];
    const float mean = block_sum(s) / (float)width;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) {
        const float d = src[i] - mean;
        ss += d * d;
    }
    const float inv = 1.0f / sqrtf(block_sum(ss) / (float)width + eps);
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) dst[i] = (src[i] - mean) * inv * weight[i] + bias[i];
}

// The first maximum of src[0..n) (NaN never wins), in every thread of the block: its
// value (-inf for a row without a number) and index (0 then).
__device__ void lt_row_argmax(const float* __restrict__ src, u32 n, float* value, u32* index) {
    float best = LT_NEG_INF;
    u32 best_i = 0xffffffffu;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = src[i];
        if (v > best || (best_i == 0xffffffffu && v == best)) { best = v; best_i = i; }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const u32 oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (oi != 0xffffffffu && (best_i == 0xffffffffu || ov > best || (ov == best && oi < best_i))) { best = ov; best_i = oi; }
    }
    __shared__ float sv[32];
    __shared__ u32 si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = best_i; }
    __syncthreads();
    if (warp == 0) {
        const int warps = blockDim.x >> 5;
        best = lane < warps ? sv[lane] : LT_NEG_INF;
        best_i = lane < warps ? si[lane] : 0xffffffffu;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const u32 oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            if (oi != 0xffffffffu && (best_i == 0xffffffffu || ov > best || (ov == best && oi < best_i))) { best = ov; best_i = oi; }
        }
        if (lane == 0) { sv[0] = best; si[0] = best_i == 0xffffffffu ? 0u : best_i; }
    }
    __syncthreads();
    *value = sv[0];
    *index = si[0];
}

// A logit's weight in the softmax at 1 / inv_t, against the row's maximum (0 for NaN).
__device__ __forceinline__ float lt_sample_weight(float v, float max, float inv_t) {
    const float w = expf((v - max) * inv_t);
    return w == w ? w : 0.0f;
}

// How many of src[0..n)'s weights at 1 / inv_t are at least `floor` (or, `by_mass`, their
// sum), in every thread (block_sum's fixed order: the same sums every run).
__device__ float lt_weights_from(const float* __restrict__ src, u32 n, float max, float inv_t, float floor,
                                 bool by_mass) {
    float s = 0.0f;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        const float w = lt_sample_weight(src[i], max, inv_t);
        if (w >= floor) s += by_mass ? w : 1.0f;
    }
    return block_sum(s);
}

// The smallest weight a token keeps under top-k, top-p and min-p (lantern-model's
// `cut_weight`: cuts by value, ties kept), in every thread. Each cut is a bisection over
// the bits of non-negative floats (ordered as the floats are), one pass over the row a
// step: the largest x keeping at least top_k weights, then the largest keeping top_p of
// what top-k kept. Weights are at most 1 (the maximum's).
__device__ float lt_cut_weight(const float* __restrict__ src, u32 n, float max, float inv_t, u32 top_k, float top_p,
                               float min_p) {
    const u32 above_one = __float_as_uint(1.0f) + 1u;
    u32 floor = 0;
    if (top_k > 0 && top_k < n) {
        u32 hi = above_one;
        while (hi - floor > 1) {
            const u32 mid = floor + (hi - floor) / 2;
            if (lt_weights_from(src, n, max, inv_t, __uint_as_float(mid), false) >= (float)top_k) floor = mid;
            else hi = mid;
        }
    }
    if (top_p < 1.0f) {
        const float target = top_p * lt_weights_from(src, n, max, inv_t, __uint_as_float(floor), true);
        u32 hi = above_one;
        while (hi - floor > 1) {
            const u32 mid = floor + (hi - floor) / 2;
            if (lt_weights_from(src, n, max, inv_t, __uint_as_float(mid), true) >= target) floor = mid;
            else hi = mid;
        }
    }
    return fmaxf(__uint_as_float(floor), min_p);
}

// The token a uniform draw u in [0, 1) picks from the weights of src[0..n) at 1 / inv_t that
// are at least `floor`, in every thread: the token where their running sum, in id order,
// first passes u times their total (lantern-model's `sample_row`, summed here per thread's
// contiguous chunk, then across chunks). Where rounding leaves no token past the threshold,
// the argmax best_i (max: its value), as the host's sampler.
__device__ u32 lt_sample_token(const float* __restrict__ src, u32 n, float max, u32 best_i, float inv_t, float floor,
                               float draw) {
    const u32 per = (n + blockDim.x - 1) / blockDim.x;
    const u32 lo = min(threadIdx.x * per, n), hi = min(lo + per, n);
    float mass = 0.0f;
    for (u32 i = lo; i < hi; ++i) {
        const float w = lt_sample_weight(src[i], max, inv_t);
        mass += w >= floor ? w : 0.0f;
    }
    // Inclusive running sums of the chunks' masses (Hillis-Steele).
    __shared__ float sums[1024];
    __shared__ u32 chosen;
    sums[threadIdx.x] = mass;
    if (threadIdx.x == 0) chosen = 0xffffffffu;
    __syncthreads();
    for (u32 o = 1; o < blockDim.x; o <<= 1) {
        const float add = threadIdx.x >= o ? sums[threadIdx.x - o] : 0.0f;
        __syncthreads();
        sums[threadIdx.x] += add;
        __syncthreads();
    }
    const float threshold = draw * sums[blockDim.x - 1];
    const float before = threadIdx.x == 0 ? 0.0f : sums[threadIdx.x - 1];
    // Rounding may let two neighbouring chunks both claim the threshold: the lower id wins.
    if (mass > 0.0f && before <= threshold && threshold < sums[threadIdx.x]) {
        float left = threshold - before;
        u32 pick = 0xffffffffu;
        for (u32 i = lo; i < hi; ++i) {
            float p = lt_sample_weight(src[i], max, inv_t);
            p = p >= floor ? p : 0.0f;
            if (p > 0.0f) pick = i;
            if (left < p) break;
            left -= p;
        }
        atomicMin(&chosen, pick);
    }
    __syncthreads();
    return chosen == 0xffffffffu ? best_i : chosen;
}

// Each row of n logits reduced to a token and, if asked, its logprobs (lantern-model's
// `reduce_row`). params [rows, 8]: 1 / temperature as f32 bits (0: the argmax), a uniform
// draw u as f32 bits (see lt_sample_token), a given token (LT_NO_TOKEN: the chosen one;
// it must be < n), how many alternatives to score (LT_NO_SCORE: the token alone; at most
// top_cap), top-k (0: none), top-p and min-p as f32 bits (1 and 0: none), one unused.
// out [rows, 3 + 2 * top_cap]: the token, then when scored its rank (1 + how many logits
// are larger), its logprob as f32 bits, and the top tokens (larger logits first, ties to
// the lower id) as (id, logprob bits) pairs (LT_NO_TOKEN where a row has fewer numbers).
// Logprobs are logit - log-sum-exp of the row (no temperature, nothing cut).
#define LT_NO_TOKEN 0xffffffffu
#define LT_NO_SCORE 0xffffffffu
extern "C" __global__ void reduce_rows(const float* __restrict__ x, const u32* __restrict__ params,
                                       u32* __restrict__ out, u32 n, u32 top_cap) {
    lt_grid_dependency();
    const u64 r = blockIdx.x;
    const float* src = x + r * n;
    const u32* p = params + 8 * r;
    u32* o = out + r * (3 + 2 * (u64)top_cap);
    float best;
    u32 best_i;
    lt_row_argmax(src, n, &best, &best_i);
    const float inv_t = __uint_as_float(p[0]), draw = __uint_as_float(p[1]);
    const float top_p = __uint_as_float(p[5]), min_p = __uint_as_float(p[6]);
    u32 token = best_i;
    if (p[2] != LT_NO_TOKEN) {
        token = p[2];
    } else if (inv_t > 0.0f && best != LT_NEG_INF) {
        const bool cuts = p[4] > 0 || top_p < 1.0f || min_p > 0.0f;
        const float floor = cuts ? lt_cut_weight(src, n, best, inv_t, p[4], top_p, min_p) : 0.0f;
        token = lt_sample_token(src, n, best, best_i, inv_t, floor, draw);
    }
    if (threadIdx.x == 0) o[0] = token;
    const u32 k = p[3];
    if (k == LT_NO_SCORE) return;
    // log-sum-exp against the maximum; the rank counted in f32 (exact below 2^24 ids).
    const float t = src[token];
    float mass = 0.0f, larger = 0.0f;
    for (u32 i = threadIdx.x; i < n; i += blockDim.x) {
        const float v = src[i];
        const float w = expf(v - best);
        mass += w == w ? w : 0.0f;
        larger += v > t ? 1.0f : 0.0f;
    }
    mass = block_sum(mass);
    larger = block_sum(larger);
    const float log_sum = best + logf(mass);
    if (threadIdx.x == 0) {
        o[1] = 1u + (u32)larger;
        o[2] = __float_as_uint(t - log_sum);
    }
    const u32 kk = min(k, top_cap);
    lt_block_top_k(src, n, kk, (float*)(o + 4), o + 3, 2);
    if (threadIdx.x < kk && o[3 + 2 * threadIdx.x] != LT_NO_TOKEN) {
        float* lp = (float*)(o + 4 + 2 * threadIdx.x);
        *lp -= log_sum;
    }
}

// Edits to logits of x [rows, n] before they are reduced (lantern-model's `LogitEdit`,
// in its order): edits [count, 6] of (row, token, repetition, subtract, add as f32 bits,
// suppress); row 0xffffffff: none (a graph step's padding). One thread an edit; no two
// edits name the same logit.
extern "C" __global__ void edit_logits(float* __restrict__ x, u32 n, u32 rows, const u32* __restrict__ edits,
                                       u32 count) {
    lt_grid_dependency();
    const u32 e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= count) return;
    const u32* d = edits + 6 * (u64)e;
    if (d[0] >= rows || d[1] >= n) return;
    float* logit = x + (u64)d[0] * n + d[1];
    float v = *logit;
    const float repetition = __uint_as_float(d[2]), subtract = __uint_as_float(d[3]), add = __uint_as_float(d[4]);
    if (repetition != 1.0f) v = v > 0.0f ? v / repetition : v * repetition;
    if (subtract != 0.0f) v -= subtract;
    if (add != 0.0f) v += add;
    if (d[5]) v = LT_NEG_INF;
    *logit = v;
}

// Rotary embedding in place on x [tokens, heads, head_dim]; one block per token. Pair i of
// a head is (2i, 2i+1) when `adjacent`, else (i, i + half); only the first 2*half dims turn.
extern "C" __global__ void rope(float* __restrict__ x, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                u32 heads, u32 head_dim, u32 half, u32 adjacent) {
    lt_grid_dependency();
    const u32 t = blockIdx.x;
    float* row = x + (u64)t * heads * head_dim;
    const float* c = cos_t + (u64)t * half;
    const float* s = sin_t + (u64)t * half;
    for (u32 j = threadIdx.x; j < heads * half; j += blockDim.x) {
        const u32 h = j / half, i = j % half;
        lt_rope_pair(row + (u64)h * head_dim, i, half, adjacent, c[i], s[i]);
    }
}
