// Row-wise kernels: one block per row.

// out = x / sqrt(mean(x^2) + eps) * weight; out may be x itself.
extern "C" __global__ void rms_norm(const float* x, const float* __restrict__ weight, float* out, u32 width, float eps) {
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

// One token per row of n logits. params[2r] = 1 / temperature (0: the argmax), params[2r+1]
// = a uniform draw u in [0, 1): the token where the running sum of the weights, in id
// order, first passes u times their total (lantern-model's `sample_row`, summed here per
// thread's contiguous chunk, then across chunks). Where rounding leaves no token past
// the threshold, the argmax, as the host's sampler.
extern "C" __global__ void pick_rows(const float* __restrict__ x, const float* __restrict__ params,
                                     u32* __restrict__ out, u32 n) {
    const float* src = x + (u64)blockIdx.x * n;
    float best;
    u32 best_i;
    lt_row_argmax(src, n, &best, &best_i);
    const float inv_t = params[2 * (u64)blockIdx.x], draw = params[2 * (u64)blockIdx.x + 1];
    if (!(inv_t > 0.0f) || best == LT_NEG_INF) {
        if (threadIdx.x == 0) out[blockIdx.x] = best_i;
        return;
    }
    const u32 per = (n + blockDim.x - 1) / blockDim.x;
    const u32 lo = min(threadIdx.x * per, n), hi = min(lo + per, n);
    float mass = 0.0f;
    for (u32 i = lo; i < hi; ++i) mass += lt_sample_weight(src[i], best, inv_t);
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
            const float p = lt_sample_weight(src[i], best, inv_t);
            if (p > 0.0f) pick = i;
            if (left < p) break;
            left -= p;
        }
        atomicMin(&chosen, pick);
    }
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = chosen == 0xffffffffu ? best_i : chosen;
}

// Rotary embedding in place on x [tokens, heads, head_dim]; one block per token. Pair i of
// a head is (2i, 2i+1) when `adjacent`, else (i, i + half); only the first 2*half dims turn.
extern "C" __global__ void rope(float* __restrict__ x, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                u32 heads, u32 head_dim, u32 half, u32 adjacent) {
    const u32 t = blockIdx.x;
    float* row = x + (u64)t * heads * head_dim;
    const float* c = cos_t + (u64)t * half;
    const float* s = sin_t + (u64)t * half;
    for (u32 j = threadIdx.x; j < heads * half; j += blockDim.x) {
        const u32 h = j / half, i = j % half;
        lt_rope_pair(row + (u64)h * head_dim, i, half, adjacent, c[i], s[i]);
    }
}
