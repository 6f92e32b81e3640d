// Products of a few rows (a decode step's batch) with bf16 weights: y = x · Wᵀ for x [m, k]
// f32 (m <= GEMV_MAX_M), W [n, k] bf16 row-major. Each output column, for every row of x,
// is computed by `splits` warps (1, 2 or 4; a block holds GEMV_COLUMNS columns), reading
// its row of W once between them (16-byte loads, GEMV_UNROLL in flight per lane) against
// x staged in shared memory, `tile` columns at a time (rows `tile` apart; the launcher
// makes the tile as long as 47 KiB allow, all of k for most products); sums run per lane,
// then across the warp, then across the splits, in a fixed order. Memory-bound at these
// sizes: the splits put more loads in flight where a product has few columns for the
// device's multiprocessors. One launch where cuBLAS's GEMM takes a cast first.
//
// Two things a decode layer would otherwise launch kernels for can ride along: with
// norm_w, each row of x is RMS-normalized as it is staged (x / sqrt(mean(x^2) + eps) *
// norm_w, as rms_norm_fused computes it, the mean over the row from this block's sum), and
// with `accumulate` the product is added to the output instead of written (a residual).

#define GEMV_MAX_M 4
#define GEMV_COLUMNS 8  // output columns a block computes
#define GEMV_UNROLL 4

// Each row's 1 / sqrt(mean(x^2) + eps) into inv (shared; read after the next barrier),
// where norm_w is given.
__device__ __forceinline__ void gemv_row_scales(const float* __restrict__ x, u32 m, u32 k,
                                                const float* __restrict__ norm_w, float eps, float* inv) {
    if (norm_w == 0) return;
#pragma unroll
    for (u32 r = 0; r < GEMV_MAX_M; ++r) {
        if (r >= m) break;
        float ss = 0.0f;
        for (u32 i = threadIdx.x; i < k; i += blockDim.x) {
            const float v = x[(u64)r * k + i];
            ss += v * v;
        }
        ss = block_sum(ss);
        if (threadIdx.x == 0) inv[r] = 1.0f / sqrtf(ss / (float)k + eps);
    }
}

// x rows [0, m) of columns [k0, k0 + kt) into xs (rows `tile` apart), normalized when
// norm_w is given (inv from gemv_row_scales).
__device__ __forceinline__ void gemv_stage_x(const float* __restrict__ x, float* xs, u32 m, u32 k, u32 k0, u32 kt,
                                             u32 tile, const float* __restrict__ norm_w, const float* inv) {
    __syncthreads();
    for (u32 i = threadIdx.x; i < m * kt; i += blockDim.x) {
        const u32 r = i / kt, c = i % kt;
        const float v = x[(u64)r * k + k0 + c];
        xs[r * tile + c] = norm_w != 0 ? v * inv[r] * norm_w[k0 + c] : v;
    }
    __syncthreads();
}

__device__ __forceinline__ void gemv_fma8(uint4 p, const float* xs, u32 m, u32 tile, u32 c, float* acc) {
    const float w[8] = {
        __uint_as_float(p.x << 16), __uint_as_float(p.x & 0xffff0000u),
        __uint_as_float(p.y << 16), __uint_as_float(p.y & 0xffff0000u),
        __uint_as_float(p.z << 16), __uint_as_float(p.z & 0xffff0000u),
        __uint_as_float(p.w << 16), __uint_as_float(p.w & 0xffff0000u),
    };
#pragma unroll
    for (u32 r = 0; r < GEMV_MAX_M; ++r) {
        if (r < m) {
            const float4 a = *reinterpret_cast<const float4*>(xs + r * tile + c);
            const float4 b = *reinterpret_cast<const float4*>(xs + r * tile + c + 4);
            acc[r] += w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w
                    + w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w;
        }
    }
}

// acc[r] += this lane's share of W row `wrow` (columns [0, kt) of the tile) · xs row r,
// for split `s` of `splits` warps sharing the row (split s takes the 256-column chunks
// s, s + splits, ...): GEMV_UNROLL loads issued before their products, so that enough
// bytes are in flight.
__device__ __forceinline__ void gemv_dot_tile(const lt_bf16* __restrict__ wrow, const float* xs, u32 m, u32 kt,
                                              u32 tile, float* acc, u32 s, u32 splits) {
    const u32 lane = threadIdx.x & 31;
    const u32 step = 256 * splits;
    for (u32 c0 = s * 256 + lane * 8; c0 < kt; c0 += step * GEMV_UNROLL) {
        uint4 p[GEMV_UNROLL];
#pragma unroll
        for (u32 u = 0; u < GEMV_UNROLL; ++u) {
            const u32 c = c0 + u * step;
            if (c < kt) p[u] = *reinterpret_cast<const uint4*>(wrow + c);
        }
#pragma unroll
        for (u32 u = 0; u < GEMV_UNROLL; ++u) {
            const u32 c = c0 + u * step;
            if (c < kt) gemv_fma8(p[u], xs, m, tile, c, acc);
        }
    }
}

// The sums of a column's `splits` warps, in split order, for its split-0 warp (whose
// lanes all get them; the others' are left as they are). Every thread of the block calls
// it. With one split, each warp's own sum: the same bits as without splits.
__device__ __forceinline__ void gemv_join_splits(float* acc, u32 splits) {
    __shared__ float part[32][GEMV_MAX_M];
    const u32 warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
    for (u32 r = 0; r < GEMV_MAX_M; ++r) acc[r] = warp_sum(acc[r]);
    if (splits == 1) return;
    if (lane == 0) {
#pragma unroll
        for (u32 r = 0; r < GEMV_MAX_M; ++r) part[warp][r] = acc[r];
    }
    __syncthreads();
    if (warp % splits == 0) {
#pragma unroll
        for (u32 r = 0; r < GEMV_MAX_M; ++r) {
            float t = part[warp][r];
            for (u32 s = 1; s < splits; ++s) t += part[warp + s][r];
            acc[r] = t;
        }
    }
    __syncthreads();
}

// One output column j (row j of W) for every row of x, per `splits` warps (GEMV_COLUMNS
// columns a block); its output split into up to three parts by column (o0 holds columns
// [0, w0), o1 the next w1, o2 the next w2).
extern "C" __global__ void gemv_bf16(const float* __restrict__ x, const lt_bf16* __restrict__ w, u32 m, u32 n,
                                     u32 k, u32 tile, float* __restrict__ o0, u32 w0, float* __restrict__ o1,
                                     u32 w1, float* __restrict__ o2, u32 w2, const float* __restrict__ norm_w,
                                     float eps, u32 accumulate, u32 splits) {
    lt_grid_dependency();
    extern __shared__ float xs[];
    const u32 warp = threadIdx.x >> 5, split = warp % splits;
    const u32 j = blockIdx.x * GEMV_COLUMNS + warp / splits;
    float acc[GEMV_MAX_M] = {0, 0, 0, 0};
    __shared__ float inv[GEMV_MAX_M];
    gemv_row_scales(x, m, k, norm_w, eps, inv);
    for (u32 k0 = 0; k0 < k; k0 += tile) {
        const u32 kt = min(tile, k - k0);
        gemv_stage_x(x, xs, m, k, k0, kt, tile, norm_w, inv);
        if (j < n) gemv_dot_tile(w + (u64)j * k + k0, xs, m, kt, tile, acc, split, splits);
    }
    gemv_join_splits(acc, splits);
    if (j >= n || split != 0) return;
    float* out;
    u32 col, width;
    if (j < w0) { out = o0; col = j; width = w0; }
    else if (j < w0 + w1) { out = o1; col = j - w0; width = w1; }
    else { out = o2; col = j - w0 - w1; width = w2; }
#pragma unroll
    for (u32 r = 0; r < GEMV_MAX_M; ++r) {
        if (r < m && (threadIdx.x & 31) == 0) {
            float* o = out + (u64)r * width + col;
            *o = accumulate ? *o + acc[r] : acc[r];
        }
    }
}

// A gated MLP's gate and up from one stacked W ([2 * f, k]: gate rows, then up rows):
// out[r, j] = act(W[j] · x[r]) * (W[f + j] · x[r]) (lt_activation's act), one j per
// `splits` warps.
extern "C" __global__ void gemv_gated_bf16(const float* __restrict__ x, const lt_bf16* __restrict__ w, u32 m,
                                           u32 f, u32 k, u32 tile, float* __restrict__ out, u32 act,
                                           const float* __restrict__ norm_w, float eps, u32 splits) {
    lt_grid_dependency();
    extern __shared__ float xs[];
    const u32 warp = threadIdx.x >> 5, split = warp % splits;
    const u32 j = blockIdx.x * GEMV_COLUMNS + warp / splits;
    float gate[GEMV_MAX_M] = {0, 0, 0, 0};
    float up[GEMV_MAX_M] = {0, 0, 0, 0};
    __shared__ float inv[GEMV_MAX_M];
    gemv_row_scales(x, m, k, norm_w, eps, inv);
    for (u32 k0 = 0; k0 < k; k0 += tile) {
        const u32 kt = min(tile, k - k0);
        gemv_stage_x(x, xs, m, k, k0, kt, tile, norm_w, inv);
        if (j < f) {
            gemv_dot_tile(w + (u64)j * k + k0, xs, m, kt, tile, gate, split, splits);
            gemv_dot_tile(w + (u64)(f + j) * k + k0, xs, m, kt, tile, up, split, splits);
        }
    }
    gemv_join_splits(gate, splits);
    gemv_join_splits(up, splits);
    if (j >= f || split != 0) return;
#pragma unroll
    for (u32 r = 0; r < GEMV_MAX_M; ++r) {
        if (r < m && (threadIdx.x & 31) == 0) out[(u64)r * f + j] = lt_activation(gate[r], act) * up[r];
    }
}
