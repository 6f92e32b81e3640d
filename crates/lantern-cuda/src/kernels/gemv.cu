// Products of a few rows (a decode step's batch) with bf16 or blockwise-quantized weights:
// y = x · Wᵀ for x [m, k] f32 (m <= GEMV_MAX_M), W [n, k] row-major (Bf16Weights,
// BlockWeights: the same kernels, read 8 values of a row at a time). Each output column, for every row of x,
// is computed by `splits` warps (1, 2 or 4; a block holds GEMV_COLUMNS columns), reading
// its row of W once between them (8 values a load, W::UNROLL in flight per lane) against
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

// W as bf16 rows: 8 values in one 16-byte load, 4 loads in flight per lane.
struct Bf16Weights {
    static constexpr u32 UNROLL = 4;
    const lt_bf16* __restrict__ w;
    u32 k;
    typedef uint4 Raw;
    __device__ __forceinline__ Raw load(u32 row, u32 c) const {
        return *reinterpret_cast<const uint4*>(w + (u64)row * k + c);
    }
    __device__ __forceinline__ void decode(const Raw& p, float* v) const {
        v[0] = __uint_as_float(p.x << 16); v[1] = __uint_as_float(p.x & 0xffff0000u);
        v[2] = __uint_as_float(p.y << 16); v[3] = __uint_as_float(p.y & 0xffff0000u);
        v[4] = __uint_as_float(p.z << 16); v[5] = __uint_as_float(p.z & 0xffff0000u);
        v[6] = __uint_as_float(p.w << 16); v[7] = __uint_as_float(p.w & 0xffff0000u);
    }
};

// A blockwise weight: scale * q (+ min), rounded as the CPU's dequantization rounds it.
__device__ __forceinline__ float lt_block_value(float scale, float q, float min, bool has_min) {
    const float w = __fmul_rn(scale, q);
    return has_min ? __fadd_rn(w, min) : w;
}

// The quant u (0..255) less `offset`, as an exact float without an int-to-float
// conversion (which runs at a fraction of the float units' rate, and would bound a decode
// step's products over 4- and 8-bit weights):
// 2^23 + u has u in its low mantissa bits, and subtracting 2^23 + offset leaves u - offset
// exactly. `base` is 2^23 + offset.
__device__ __forceinline__ float lt_quant_less(u32 u, float base) {
    return __uint_as_float(0x4B000000u | u) - base;
}

// W in lantern-quant's blockwise form (GGUF weights as stored): quants of `bits` (4: two a
// byte, the even column low; 8: one a byte), w = scale[i >> scale_shift] * (q - offset)
// (+ min[i / 32] where mins are given; a scale per 16 values for Q6_K, per 32 otherwise),
// each step rounded as written, so that a value has the bits the CPU dequantizes it to. 8
// values: one 4- or 8-byte load, their scale and min; twice the bf16 rows' loads in flight
// per lane, for as many bytes of quants in flight at 8 bits.
struct BlockWeights {
    static constexpr u32 UNROLL = 8;
    const u8* __restrict__ q;
    const float* __restrict__ scales;
    const float* __restrict__ mins;
    u32 k;
    int offset;
    u32 bits;
    u32 scale_shift;
    struct Raw {
        uint2 q;
        float scale, min;
    };
    __device__ __forceinline__ Raw load(u32 row, u32 c) const {
        const u64 i = (u64)row * k + c;
        Raw r;
        if (bits == 4) {
            r.q.x = *reinterpret_cast<const u32*>(q + i / 2);
            r.q.y = 0;
        } else {
            r.q = *reinterpret_cast<const uint2*>(q + i);
        }
        r.scale = scales[i >> scale_shift];
        r.min = mins != 0 ? mins[i / 32] : 0.0f;
        return r;
    }
    __device__ __forceinline__ void decode(const Raw& r, float* v) const {
        const float base = 8388608.0f + (float)offset;
#pragma unroll
        for (u32 j = 0; j < 8; ++j) {
            const u32 u = bits == 4 ? r.q.x >> (4 * j) & 15u
                                    : (j < 4 ? r.q.x : r.q.y) >> (8 * (j % 4)) & 255u;
            v[j] = lt_block_value(r.scale, lt_quant_less(u, base), r.min, mins != 0);
        }
    }
};

__device__ __forceinline__ void gemv_fma8(const float* w, const float* xs, u32 m, u32 tile, u32 c, float* acc) {
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

// acc[r] += this lane's share of W's row `row` (columns [k0, k0 + kt), the staged tile) ·
// xs row r, for split `s` of `splits` warps sharing the row (split s takes the 256-column
// chunks s, s + splits, ...): W::UNROLL loads issued before their products, so that
// enough bytes are in flight.
template <typename W>
__device__ __forceinline__ void gemv_dot_tile(const W& w, u32 row, u32 k0, const float* xs, u32 m, u32 kt,
                                              u32 tile, float* acc, u32 s, u32 splits) {
    const u32 lane = threadIdx.x & 31;
    const u32 step = 256 * splits;
    for (u32 c0 = s * 256 + lane * 8; c0 < kt; c0 += step * W::UNROLL) {
        typename W::Raw p[W::UNROLL];
#pragma unroll
        for (u32 u = 0; u < W::UNROLL; ++u) {
            const u32 c = c0 + u * step;
            if (c < kt) p[u] = w.load(row, k0 + c);
        }
#pragma unroll
        for (u32 u = 0; u < W::UNROLL; ++u) {
            const u32 c = c0 + u * step;
            if (c < kt) {
                float v[8];
                w.decode(p[u], v);
                gemv_fma8(v, xs, m, tile, c, acc);
            }
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
template <typename W>
__device__ __forceinline__ void gemv(const float* __restrict__ x, const W& w, u32 m, u32 n, u32 k, u32 tile,
                                     float* __restrict__ o0, u32 w0, float* __restrict__ o1, u32 w1,
                                     float* __restrict__ o2, u32 w2, const float* __restrict__ norm_w, float eps,
                                     u32 accumulate, u32 splits) {
    extern __shared__ float xs[];
    const u32 warp = threadIdx.x >> 5, split = warp % splits;
    const u32 j = blockIdx.x * GEMV_COLUMNS + warp / splits;
    float acc[GEMV_MAX_M] = {0, 0, 0, 0};
    __shared__ float inv[GEMV_MAX_M];
    gemv_row_scales(x, m, k, norm_w, eps, inv);
    for (u32 k0 = 0; k0 < k; k0 += tile) {
        const u32 kt = min(tile, k - k0);
        gemv_stage_x(x, xs, m, k, k0, kt, tile, norm_w, inv);
        if (j < n) gemv_dot_tile(w, j, k0, xs, m, kt, tile, acc, split, splits);
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
template <typename W>
__device__ __forceinline__ void gemv_gated(const float* __restrict__ x, const W& w, u32 m, u32 f, u32 k,
                                           u32 tile, float* __restrict__ out, u32 act,
                                           const float* __restrict__ norm_w, float eps, u32 splits) {
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
            gemv_dot_tile(w, j, k0, xs, m, kt, tile, gate, split, splits);
            gemv_dot_tile(w, f + j, k0, xs, m, kt, tile, up, split, splits);
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

extern "C" __global__ void gemv_bf16(const float* __restrict__ x, const lt_bf16* __restrict__ w, u32 m, u32 n,
                                     u32 k, u32 tile, float* __restrict__ o0, u32 w0, float* __restrict__ o1,
                                     u32 w1, float* __restrict__ o2, u32 w2, const float* __restrict__ norm_w,
                                     float eps, u32 accumulate, u32 splits) {
    lt_grid_dependency();
    const Bf16Weights weights = {w, k};
    gemv(x, weights, m, n, k, tile, o0, w0, o1, w1, o2, w2, norm_w, eps, accumulate, splits);
}

extern "C" __global__ void gemv_blocks(const float* __restrict__ x, const u8* __restrict__ q,
                                       const float* __restrict__ scales, const float* __restrict__ mins,
                                       int offset, u32 bits, u32 scale_shift, u32 m, u32 n, u32 k, u32 tile,
                                       float* __restrict__ o0, u32 w0, float* __restrict__ o1, u32 w1,
                                       float* __restrict__ o2, u32 w2, const float* __restrict__ norm_w,
                                       float eps, u32 accumulate, u32 splits) {
    lt_grid_dependency();
    const BlockWeights weights = {q, scales, mins, k, offset, bits, scale_shift};
    gemv(x, weights, m, n, k, tile, o0, w0, o1, w1, o2, w2, norm_w, eps, accumulate, splits);
}

extern "C" __global__ void gemv_gated_bf16(const float* __restrict__ x, const lt_bf16* __restrict__ w, u32 m,
                                           u32 f, u32 k, u32 tile, float* __restrict__ out, u32 act,
                                           const float* __restrict__ norm_w, float eps, u32 splits) {
    lt_grid_dependency();
    const Bf16Weights weights = {w, k};
    gemv_gated(x, weights, m, f, k, tile, out, act, norm_w, eps, splits);
}

extern "C" __global__ void gemv_gated_blocks(const float* __restrict__ x, const u8* __restrict__ q,
                                             const float* __restrict__ scales, const float* __restrict__ mins,
                                             int offset, u32 bits, u32 scale_shift, u32 m, u32 f, u32 k,
                                             u32 tile,
                                             float* __restrict__ out, u32 act, const float* __restrict__ norm_w,
                                             float eps, u32 splits) {
    lt_grid_dependency();
    const BlockWeights weights = {q, scales, mins, k, offset, bits, scale_shift};
    gemv_gated(x, weights, m, f, k, tile, out, act, norm_w, eps, splits);
}

// Rows [row0, row0 + rows) of a blockwise W [n, k] as bf16 (out [rows, k]), for products
// of more rows than the small-product kernels take (cuBLAS's bf16 GEMM reads them): one
// grid-stride thread per 8 values.
extern "C" __global__ void dequantize_blocks_bf16(const u8* __restrict__ q, const float* __restrict__ scales,
                                                  const float* __restrict__ mins, int offset, u32 bits,
                                                  u32 scale_shift, u32 k, u32 row0, u32 rows,
                                                  lt_bf16* __restrict__ out) {
    lt_grid_dependency();
    const BlockWeights weights = {q, scales, mins, k, offset, bits, scale_shift};
    for (u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < (u64)rows * k;
         i += (u64)gridDim.x * blockDim.x * 8) {
        const u32 row = (u32)(i / k), c = (u32)(i % k);
        float v[8];
        weights.decode(weights.load(row0 + row, c), v);
#pragma unroll
        for (u32 j = 0; j < 8; ++j) out[i + j] = from_f32<lt_bf16>(v[j]);
    }
}

// Token embeddings from a blockwise table [vocab, hidden]: out[t] = W[ids[t]] * scale (a
// row of NaN for an id at or past `vocab`, as embed_impl), a grid-stride thread per 8
// values.
extern "C" __global__ void embed_blocks(const u8* __restrict__ q, const float* __restrict__ scales,
                                        const float* __restrict__ mins, int offset, u32 bits, u32 scale_shift,
                                        u32 hidden, u32 vocab, const u32* __restrict__ ids, u32 tokens,
                                        float scale, float* __restrict__ out) {
    lt_grid_dependency();
    const BlockWeights weights = {q, scales, mins, hidden, offset, bits, scale_shift};
    for (u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * 8; i < (u64)tokens * hidden;
         i += (u64)gridDim.x * blockDim.x * 8) {
        const u32 t = (u32)(i / hidden), c = (u32)(i % hidden);
        float v[8];
        if (ids[t] < vocab) {
            weights.decode(weights.load(ids[t], c), v);
        } else {
#pragma unroll
            for (u32 j = 0; j < 8; ++j) v[j] = LT_NAN;
        }
#pragma unroll
        for (u32 j = 0; j < 8; ++j) out[i + j] = v[j] * scale;
    }
}
