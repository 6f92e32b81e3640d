// Element-wise and row-copy kernels over f32 activations (grid-stride loops).

extern "C" __global__ void cast_f32_bf16(const float* __restrict__ x, lt_bf16* __restrict__ out, u64 n) {
    lt_grid_dependency();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = from_f32<lt_bf16>(x[i]);
}

extern "C" __global__ void add_in_place(float* __restrict__ x, const float* __restrict__ y, u64 n) {
    lt_grid_dependency();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] += y[i];
}

extern "C" __global__ void add_bias(float* __restrict__ x, const float* __restrict__ bias, u64 n, u32 width) {
    lt_grid_dependency();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] += bias[i % width];
}

// gate = act(gate) * up (lt_activation's act).
extern "C" __global__ void act_mul(float* __restrict__ gate, const float* __restrict__ up, u64 n, u32 act) {
    lt_grid_dependency();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        gate[i] = lt_activation(gate[i], act) * up[i];
}

// x = act(x) (an un-gated MLP's activation).
extern "C" __global__ void activate(float* __restrict__ x, u64 n, u32 act) {
    lt_grid_dependency();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = lt_activation(x[i], act);
}

extern "C" __global__ void scale_f32(float* __restrict__ x, u64 n, float s) {
    lt_grid_dependency();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] *= s;
}

// As Rust's f32::clamp: NaN stays NaN.
extern "C" __global__ void clamp_f32(float* __restrict__ x, u64 n, float limit) {
    lt_grid_dependency();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        const float v = x[i];
        x[i] = v < -limit ? -limit : (v > limit ? limit : v);
    }
}

extern "C" __global__ void soft_cap_f32(float* __restrict__ x, u64 n, float cap) {
    lt_grid_dependency();
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        x[i] = cap * tanhf(x[i] / cap);
}

// One block per output row; an id at or past `vocab` gives a row of NaN.
template <typename T>
__device__ void embed_impl(const T* __restrict__ table, const u32* __restrict__ ids, float* __restrict__ out,
                           u32 hidden, u32 vocab, float scale) {
    const u32 row = blockIdx.x;
    const u32 id = ids[row];
    float* dst = out + (u64)row * hidden;
    if (id >= vocab) {
        for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = LT_NAN;
        return;
    }
    const T* src = table + (u64)id * hidden;
    for (u32 i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = to_f32(src[i]) * scale;
}
extern "C" __global__ void embed_bf16(const lt_bf16* t, const u32* ids, float* out, u32 hidden, u32 vocab, float scale) {
    lt_grid_dependency();
    embed_impl(t, ids, out, hidden, vocab, scale);
}
extern "C" __global__ void embed_f16(const lt_f16* t, const u32* ids, float* out, u32 hidden, u32 vocab, float scale) {
    lt_grid_dependency();
    embed_impl(t, ids, out, hidden, vocab, scale);
}
extern "C" __global__ void embed_f32(const float* t, const u32* ids, float* out, u32 hidden, u32 vocab, float scale) {
    lt_grid_dependency();
    embed_impl(t, ids, out, hidden, vocab, scale);
}

// One block per output row; an index at or past `rows` gives a row of NaN.
extern "C" __global__ void gather_rows(const float* __restrict__ x, const u32* __restrict__ idx, float* __restrict__ out,
                                       u32 width, u32 rows) {
    lt_grid_dependency();
    const u32 row = blockIdx.x;
    const u32 src_row = idx[row];
    float* dst = out + (u64)row * width;
    if (src_row >= rows) {
        for (u32 i = threadIdx.x; i < width; i += blockDim.x) dst[i] = LT_NAN;
        return;
    }
    const float* src = x + (u64)src_row * width;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}

// One block per table entry i: x's row table[2i + 1] copied to the address table[2i]
// (rows of `width` f32); a destination of 0 copies nothing, a source row at or past
// `rows` writes NaN. The destinations change every step while the launch does not, so
// a graph replays it with the step's own table.
extern "C" __global__ void scatter_rows(const float* __restrict__ x, const u64* __restrict__ table, u32 width,
                                        u32 rows) {
    lt_grid_dependency();
    float* dst = (float*)table[2 * (u64)blockIdx.x];
    if (dst == nullptr) return;
    const u64 src_row = table[2 * (u64)blockIdx.x + 1];
    if (src_row >= rows) {
        for (u32 i = threadIdx.x; i < width; i += blockDim.x) dst[i] = LT_NAN;
        return;
    }
    const float* src = x + src_row * width;
    for (u32 i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}
