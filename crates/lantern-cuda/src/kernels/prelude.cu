// Shared by every lantern kernel source (prepended before compilation; NVRTC needs no
// headers). 16-bit storage types are plain structs; conversions are exact bit operations
// or PTX cvt instructions, so no CUDA header is needed at run time. (Without NVRTC, the
// CUDA emulator's host compiler converts f16 with _Float16: see emulator/device.h.)

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned char u8;

// Programmatic dependent launch (launch.rs): a kernel may be placed on the GPU while the
// one before it on the stream still runs. Every kernel calls this first: it waits until
// the kernel before has completed and its writes are visible, then lets the next kernel
// start launching (it too will wait here). Both are no-ops for a kernel launched the
// plain way; before sm_90 there is nothing to do.
__device__ __forceinline__ void lt_grid_dependency() {
#if defined(LT_CUDA_EMULATOR)
    lt_emu::grid_dependency();
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

#define LT_INF __int_as_float(0x7f800000)
#define LT_NEG_INF __int_as_float(0xff800000)
#define LT_NAN __int_as_float(0x7fc00000)

struct __align__(2) lt_bf16 { unsigned short bits; };
struct __align__(2) lt_f16 { unsigned short bits; };

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(lt_bf16 v) {
    return __uint_as_float(((u32)v.bits) << 16);
}
__device__ __forceinline__ float to_f32(lt_f16 v) {
#ifdef __CUDACC_RTC__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
#else  // the CUDA emulator's host compiler
    _Float16 h;
    __builtin_memcpy(&h, &v.bits, 2);
    return (float)h;
#endif
}

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
// Round to nearest, ties to even; NaN stays NaN (quiet).
template <> __device__ __forceinline__ lt_bf16 from_f32<lt_bf16>(float v) {
    u32 u = __float_as_uint(v);
    lt_bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        r.bits = (unsigned short)((u >> 16) | 0x40u);
    } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        r.bits = (unsigned short)(u >> 16);
    }
    return r;
}
template <> __device__ __forceinline__ lt_f16 from_f32<lt_f16>(float v) {
    lt_f16 r;
#ifdef __CUDACC_RTC__
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(v));
#else  // the CUDA emulator's host compiler
    const _Float16 h = (_Float16)v;
    __builtin_memcpy(&r.bits, &h, 2);
#endif
    return r;
}

// An MLP's activation of `g`. act 0: SiLU, 1: GELU (tanh approximation, as
// PyTorch's approximate="tanh"), 2: GELU with the error function (PyTorch's default),
// 3: ReLU (NaN kept).
__device__ __forceinline__ float lt_activation(float g, u32 act) {
    if (act == 0) return g / (1.0f + expf(-g));
    if (act == 2) return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
    if (act == 3) return g < 0.0f ? 0.0f : g;
    const float k = 0.7978845608028654f;  // sqrt(2/pi)
    return 0.5f * g * (1.0f + tanhf(k * (g + 0.044715f * g * g * g)));
}

// A pair (x0, x1) turned by angle (c, s), rounded as the host computes it (no fused
// multiply-add), so that every kernel turning it gives the same bits.
__device__ __forceinline__ float lt_rope_first(float x0, float x1, float c, float s) {
    return __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
}
__device__ __forceinline__ float lt_rope_second(float x0, float x1, float c, float s) {
    return __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// Turns pair i of one head (`base`, head_dim values) by angle (c, s): the pair is
// (2i, 2i+1) when `adjacent`, else (i, i + half).
__device__ __forceinline__ void lt_rope_pair(float* base, u32 i, u32 half, u32 adjacent, float c, float s) {
    const u32 a = adjacent ? 2 * i : i;
    const u32 b = adjacent ? 2 * i + 1 : i + half;
    const float x0 = base[a], x1 = base[b];
    base[a] = lt_rope_first(x0, x1, c, s);
    base[b] = lt_rope_second(x0, x1, c, s);
}

// Value d of one head (`base`) after lt_rope_pair turned its pairs by the angles
// (cos_t[i], sin_t[i]); values past the pairs (d >= 2 * half) are left as they are.
__device__ __forceinline__ float lt_rope_value(const float* base, u32 d, u32 half, u32 adjacent,
                                               const float* cos_t, const float* sin_t) {
    if (d >= 2 * half) return base[d];
    const u32 i = adjacent ? d / 2 : (d < half ? d : d - half);
    const bool first = adjacent ? d % 2 == 0 : d < half;
    const float x0 = base[adjacent ? 2 * i : i], x1 = base[adjacent ? 2 * i + 1 : i + half];
    return first ? lt_rope_first(x0, x1, cos_t[i], sin_t[i]) : lt_rope_second(x0, x1, cos_t[i], sin_t[i]);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets it.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? partial[lane] : 0.0f;
        s = warp_sum(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    return total;
}

// Whether (v, j) comes before (bv, bj) in top-k order: larger values first, ties by lower
// position; bj == LT_TOP_K_NONE is after everything.
#define LT_TOP_K_NONE 0xffffffffu
__device__ __forceinline__ bool lt_top_k_before(float v, u32 j, float bv, u32 bj) {
    return bj == LT_TOP_K_NONE || v > bv || (v == bv && j < bj);
}

// The k largest values of row[0..n) (NaN never) with their positions, in order (values
// descending, ties by lower position): vals[i * stride] and idx[i * stride] for i < k,
// written by thread 0 (-inf and LT_TOP_K_NONE past a row's last number). Round by round,
// each the first position after the previous pick in that order; the whole block calls
// it (blockDim.x a multiple of 32). Rounds, not a sort: k is small (a map's top-k or a
// request's top logprobs), the row read k times from cache.
__device__ void lt_block_top_k(const float* __restrict__ row, u32 n, u32 k, float* vals, u32* idx, u32 stride) {
    __shared__ float warp_v[32];
    __shared__ u32 warp_j[32];
    __shared__ float prev_v;
    __shared__ u32 prev_j;
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (threadIdx.x == 0) {
        prev_v = LT_INF;
        prev_j = LT_TOP_K_NONE;
    }
    __syncthreads();
    for (u32 round = 0; round < k; ++round) {
        const float pv = prev_v;
        const u32 pj = prev_j;
        float bv = LT_NEG_INF;
        u32 bj = LT_TOP_K_NONE;
        // After a round that found nothing, every later one finds nothing too.
        const bool exhausted = round > 0 && pj == LT_TOP_K_NONE;
        for (u32 j = threadIdx.x; j < n && !exhausted; j += blockDim.x) {
            const float v = row[j];
            const bool after = pj == LT_TOP_K_NONE || v < pv || (v == pv && j > pj);
            if (after && v == v && lt_top_k_before(v, j, bv, bj)) {
                bv = v;
                bj = j;
            }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const u32 oj = __shfl_xor_sync(0xffffffffu, bj, o);
            if (oj != LT_TOP_K_NONE && lt_top_k_before(ov, oj, bv, bj)) {
                bv = ov;
                bj = oj;
            }
        }
        if (lane == 0) {
            warp_v[warp] = bv;
            warp_j[warp] = bj;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (u32 w = 1; w < warps; ++w) {
                if (warp_j[w] != LT_TOP_K_NONE && lt_top_k_before(warp_v[w], warp_j[w], warp_v[0], warp_j[0])) {
                    warp_v[0] = warp_v[w];
                    warp_j[0] = warp_j[w];
                }
            }
            vals[round * stride] = warp_v[0];
            idx[round * stride] = warp_j[0];
            prev_v = warp_v[0];
            prev_j = warp_j[0];
        }
        __syncthreads();
    }
}
