// Kernels that do in one pass what would take several launches: a step of a small batch
// spends most of its time starting kernels, so each launch saved counts.

// One block per row of `width`: x += delta (when delta is given), then
// out = x / sqrt(mean(x^2) + eps) * weight, and out_bf16 = bf16(out) when given (the next
// product's input). out must not alias x.
extern "C" __global__ void rms_norm_fused(float* __restrict__ x, const float* __restrict__ delta,
                                          const float* __restrict__ weight, float* __restrict__ out,
                                          lt_bf16* __restrict__ out_bf16, u32 width, float eps) {
    lt_grid_dependency();
    const u64 base = (u64)blockIdx.x * width;
    float ss = 0.0f;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) {
        float v = x[base + i];
        if (delta) {
            v += delta[base + i];
            x[base + i] = v;
        }
        ss += v * v;
    }
    ss = block_sum(ss);
    const float inv = 1.0f / sqrtf(ss / (float)width + eps);
    // Each thread reads back only the values it wrote above.
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) {
        const float y = x[base + i] * inv * weight[i];
        out[base + i] = y;
        if (out_bf16) out_bf16[base + i] = from_f32<lt_bf16>(y);
    }
}

// gu [rows, 2 * width] holds gate then up per row: out[r, i] = act(gate) * up, and its
// bf16 copy (lt_activation's act).
extern "C" __global__ void act_mul_split(const float* __restrict__ gu, float* __restrict__ out,
                                         lt_bf16* __restrict__ out_bf16, u64 rows, u32 width, u32 act) {
    lt_grid_dependency();
    const u64 n = rows * width;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / width, c = i % width;
        const float y = lt_activation(gu[r * 2 * width + c], act) * gu[r * 2 * width + width + c];
        out[i] = y;
        out_bf16[i] = from_f32<lt_bf16>(y);
    }
}

// x [rows, w0 + w1 + w2 + w3] split by columns into o0 [rows, w0], ..., o3 (widths of 0 and
// their null outputs are skipped).
extern "C" __global__ void split_columns(const float* __restrict__ x, u64 rows, float* __restrict__ o0, u32 w0,
                                         float* __restrict__ o1, u32 w1, float* __restrict__ o2, u32 w2,
                                         float* __restrict__ o3, u32 w3) {
    lt_grid_dependency();
    const u32 total = w0 + w1 + w2 + w3;
    const u64 n = rows * total;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / total;
        u32 c = (u32)(i % total);
        const float v = x[i];
        if (c < w0) { o0[r * w0 + c] = v; continue; }
        c -= w0;
        if (c < w1) { o1[r * w1 + c] = v; continue; }
        c -= w1;
        if (c < w2) { o2[r * w2 + c] = v; continue; }
        c -= w2;
        o3[r * w3 + c] = v;
    }
}

// Rotary embedding of a step's queries q [tokens, q_heads, head_dim] and keys k [tokens,
// k_heads, head_dim] in place, one block per token (as `rope` in rows.cu, both at once).
extern "C" __global__ void rope_qk(float* __restrict__ q, u32 q_heads, float* __restrict__ k, u32 k_heads,
                                   const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                   u32 head_dim, u32 half, u32 adjacent) {
    lt_grid_dependency();
    const u32 t = blockIdx.x;
    const float* c = cos_t + (u64)t * half;
    const float* s = sin_t + (u64)t * half;
    for (u32 j = threadIdx.x; j < (q_heads + k_heads) * half; j += blockDim.x) {
        u32 h = j / half;
        const u32 i = j % half;
        float* base;
        if (h < q_heads) {
            base = q + ((u64)t * q_heads + h) * head_dim;
        } else {
            h -= q_heads;
            base = k + ((u64)t * k_heads + h) * head_dim;
        }
        lt_rope_pair(base, i, half, adjacent, c[i], s[i]);
    }
}
