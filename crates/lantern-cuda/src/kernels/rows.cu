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

// Index of the first maximum of each row (NaN never wins).
extern "C" __global__ void argmax_rows(const float* __restrict__ x, u32* __restrict__ out, u32 n) {
    const float* src = x + (u64)blockIdx.x * n;
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
        if (lane == 0) out[blockIdx.x] = best_i == 0xffffffffu ? 0u : best_i;
    }
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
