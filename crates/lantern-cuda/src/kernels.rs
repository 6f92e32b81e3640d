//! lantern's CUDA kernels (CUDA C in `kernels/*.cu`, compiled by NVRTC when a [`Gpu`] opens)
//! and their typed launchers. Activations are f32, row-major; every launcher checks the
//! buffer lengths and answers [`CudaError::Shape`] instead of launching on a mismatch.

use cudarc::driver::{
    CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};

use crate::error::{ensure, CudaError, Result};
use crate::gpu::Gpu;
use crate::launch::Launch;

mod attention;
pub use attention::{auto_attention_splits, MAX_ATTN_SPLITS};

/// One CUDA C source file and the kernels it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    /// File name, used in error messages.
    pub name: &'static str,
    /// The CUDA C text (compiled after [`PRELUDE`]).
    pub source: &'static str,
    /// The `extern "C"` kernels it defines.
    pub functions: &'static [&'static str],
}

/// Type definitions and conversions shared by every source.
pub const PRELUDE: &str = include_str!("kernels/prelude.cu");

/// Every kernel source.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "elementwise.cu",
        source: include_str!("kernels/elementwise.cu"),
        functions: &[
            "cast_f32_bf16",
            "add_in_place",
            "add_bias",
            "act_mul",
            "activate",
            "scale_f32",
            "clamp_f32",
            "soft_cap_f32",
            "embed_bf16",
            "embed_f16",
            "embed_f32",
            "gather_rows",
            "scatter_rows",
        ],
    },
    KernelSource {
        name: "rows.cu",
        source: include_str!("kernels/rows.cu"),
        functions: &[
            "rms_norm",
            "layer_norm",
            "reduce_rows",
            "edit_logits",
            "rope",
        ],
    },
    KernelSource {
        name: "fused.cu",
        source: include_str!("kernels/fused.cu"),
        functions: &[
            "rms_norm_fused",
            "act_mul_split",
            "split_columns",
            "rope_qk",
        ],
    },
    KernelSource {
        name: "gemv.cu",
        source: include_str!("kernels/gemv.cu"),
        functions: &[
            "gemv_bf16",
            "gemv_gated_bf16",
            "gemv_blocks",
            "gemv_gated_blocks",
            "dequantize_blocks_bf16",
            "embed_blocks",
        ],
    },
    KernelSource {
        name: "kv.cu",
        source: include_str!("kernels/kv.cu"),
        functions: &[
            "kv_write_bf16",
            "kv_write_f16",
            "kv_write_f32",
            "rope_kv_write_bf16",
            "rope_kv_write_f16",
            "rope_kv_write_f32",
        ],
    },
    KernelSource {
        name: "capture.cu",
        source: include_str!("kernels/capture.cu"),
        functions: &[
            "row_probabilities_bf16",
            "row_probabilities_f16",
            "row_probabilities_f32",
            "map_probabilities_bf16",
            "map_probabilities_f16",
            "map_probabilities_f32",
            "combine_heads",
            "top_k_rows",
        ],
    },
    KernelSource {
        name: "attention.cu",
        source: include_str!("kernels/attention.cu"),
        functions: &[
            "paged_attention_bf16",
            "paged_attention_f16",
            "paged_attention_f32",
            "paged_attention_split_bf16",
            "paged_attention_split_f16",
            "paged_attention_split_f32",
            "paged_attention_merge",
        ],
    },
];

/// An element type of the KV cache or of an embedding table: bf16, f16 or f32.
pub trait CacheElem: DeviceRepr + ValidAsZeroBits + Copy + Send + Sync + 'static {
    /// Kernel name suffix ("bf16", "f16", "f32").
    const SUFFIX: &'static str;
    /// The value as f32 (exact).
    fn to_f32(self) -> f32;
    /// The nearest value (round to nearest even), as the kernels store it.
    fn from_f32(v: f32) -> Self;
}

impl CacheElem for half::bf16 {
    const SUFFIX: &'static str = "bf16";
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        half::bf16::from_f32(v)
    }
}

impl CacheElem for half::f16 {
    const SUFFIX: &'static str = "f16";
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
    fn from_f32(v: f32) -> Self {
        half::f16::from_f32(v)
    }
}

impl CacheElem for f32 {
    const SUFFIX: &'static str = "f32";
    fn to_f32(self) -> f32 {
        self
    }
    fn from_f32(v: f32) -> Self {
        v
    }
}

/// The activation of a gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// silu(gate) * up.
    Silu,
    /// gelu(gate) * up, PyTorch's tanh approximation.
    GeluTanh,
    /// gelu(gate) * up with the error function (PyTorch's default gelu).
    GeluErf,
    /// max(gate, 0) * up (OPT's un-gated MLP takes it alone).
    Relu,
}

impl Activation {
    /// The kernels' `act` argument (prelude.cu's lt_activation).
    pub(crate) fn code(self) -> u32 {
        match self {
            Self::Silu => 0,
            Self::GeluTanh => 1,
            Self::GeluErf => 2,
            Self::Relu => 3,
        }
    }
}

/// Element strides of a paged KV cache. The key of token slot `s`, kv head `h`, dim `i` is
/// at `(s / block_size) * block + (s % block_size) * in_block + h * head + i * dim`; its
/// value at the same plus `kv`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvStrides {
    pub kv: usize,
    pub block: usize,
    pub in_block: usize,
    pub head: usize,
    pub dim: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvStrides {
    /// Layout `[2, num_blocks, block_size, num_kv_heads, head_dim]` (all keys, then all values).
    pub fn kv_first(
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        let head = head_dim;
        let in_block = num_kv_heads * head;
        let block = block_size * in_block;
        KvStrides {
            kv: num_blocks * block,
            block,
            in_block,
            head,
            dim: 1,
            block_size,
            num_kv_heads,
            head_dim,
        }
    }

    /// Layout `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (keys then values per block).
    pub fn block_first(block_size: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        let head = head_dim;
        let in_block = num_kv_heads * head;
        let kv = block_size * in_block;
        KvStrides {
            kv,
            block: 2 * kv,
            in_block,
            head,
            dim: 1,
            block_size,
            num_kv_heads,
            head_dim,
        }
    }

    /// Elements of a cache of `num_blocks` blocks in either layout above.
    pub fn cache_len(&self, num_blocks: usize) -> usize {
        2 * num_blocks * self.block_size * self.num_kv_heads * self.head_dim
    }

    /// Element offset of the key of `slot`, kv head `head`, dim `i` (the value is `+ kv`).
    pub fn key_offset(&self, slot: usize, head: usize, i: usize) -> usize {
        (slot / self.block_size) * self.block
            + (slot % self.block_size) * self.in_block
            + head * self.head
            + i * self.dim
    }
}

/// Per-step metadata of paged attention, on the device.
#[derive(Debug)]
pub struct PagedMeta<'a> {
    /// `[num_reqs + 1]`: request r owns query tokens `query_start_loc[r]..query_start_loc[r+1]`.
    pub query_start_loc: CudaView<'a, u32>,
    /// `[num_reqs]`: tokens in context of each request, this step's included.
    pub seq_lens: CudaView<'a, u32>,
    /// `[num_reqs * table_stride]`: physical block ids per request (0xFFFFFFFF: none).
    pub block_table: CudaView<'a, u32>,
    /// Row length of `block_table`.
    pub table_stride: usize,
    /// Requests in the step.
    pub num_reqs: usize,
    /// Query tokens in the step (rows of q); tokens past `query_start_loc[num_reqs]` get zeros.
    pub num_tokens: usize,
    /// Longest query of the step (for a split variant; may be 0 when unknown).
    pub max_query_len: usize,
    /// Longest context of the step (for a split variant; may be 0 when unknown).
    pub max_seq_len: usize,
}

/// What a layer's attention computes.
#[derive(Debug)]
pub struct AttnParams<'a> {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k.
    pub scale: f32,
    /// A query at p sees keys k with p - k < window.
    pub sliding_window: Option<usize>,
    /// A query at p sees keys k with k / chunk == p / chunk.
    pub chunk_size: Option<usize>,
    /// logit -> cap * tanh(logit / cap).
    pub soft_cap: Option<f32>,
    /// One logit per query head joining the softmax denominator.
    pub sinks: Option<CudaView<'a, f32>>,
}

/// Threads of an element-wise launch over `n` values (grid-stride).
pub(crate) fn elementwise_cfg(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 65_536) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row, threads a multiple of 32 fitted to `width`.
pub(crate) fn row_cfg(rows: usize, width: usize) -> LaunchConfig {
    let threads = width.next_multiple_of(32).clamp(32, 1024) as u32;
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(crate) fn u32_of(what: &str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| CudaError::Shape(format!("{what} = {v} does not fit in 32 bits")))
}

/// Grid dimension limit of y and z.
pub(crate) const GRID_YZ: usize = 65_535;
/// Largest head_dim paged attention serves.
pub const MAX_HEAD_DIM: usize = 256;

impl Gpu {
    /// out[i] = bf16(x[i]), round to nearest even.
    pub fn cast_f32_to_bf16(
        &self,
        x: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<half::bf16>,
    ) -> Result<()> {
        let n = x.len();
        ensure(out.len() == n, || {
            format!("cast: x has {n} values, out {}", out.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("cast_f32_bf16")?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let n64 = n as u64;
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp).arg(&op).arg(&n64);
        // SAFETY: argument types and lengths match the kernel's signature.
        unsafe { b.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// out[r] = table[ids[r]] * scale for a table `[vocab, hidden]` (an id past the table gives NaN).
    pub fn embed<T: CacheElem>(
        &self,
        table: &impl DevicePtr<T>,
        ids: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<f32>,
        hidden: usize,
        scale: f32,
    ) -> Result<()> {
        let n = ids.len();
        ensure(hidden > 0 && table.len().is_multiple_of(hidden), || {
            format!(
                "embed: table of {} values is not rows of {hidden}",
                table.len()
            )
        })?;
        ensure(out.len() == n * hidden, || {
            format!("embed: out has {} values, want {n} x {hidden}", out.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let vocab = u32_of("vocab", table.len() / hidden)?;
        let hidden32 = u32_of("hidden", hidden)?;
        let rows = u32_of("tokens", n)?;
        let f = self.function(&format!("embed_{}", T::SUFFIX))?;
        let (tp, _gt) = table.device_ptr(&self.stream);
        let (ip, _gi) = ids.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&tp)
            .arg(&ip)
            .arg(&op)
            .arg(&hidden32)
            .arg(&vocab)
            .arg(&scale);
        // SAFETY: as above.
        unsafe { b.launch(row_cfg(rows as usize, hidden.min(1024))) }?;
        Ok(())
    }

    /// out = x / sqrt(mean(x²) + eps) * weight over rows of `weight.len()` values.
    pub fn rms_norm(
        &self,
        x: &impl DevicePtr<f32>,
        weight: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        eps: f32,
    ) -> Result<()> {
        ensure(out.len() == x.len(), || {
            format!("rms_norm: x has {} values, out {}", x.len(), out.len())
        })?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        self.rms_norm_raw(xp, x.len(), weight, op, eps)
    }

    /// out = (x − mean) / sqrt(var + eps) * weight + bias over rows of `weight.len()` values.
    pub fn layer_norm(
        &self,
        x: &impl DevicePtr<f32>,
        (weight, bias): (&impl DevicePtr<f32>, &impl DevicePtr<f32>),
        out: &mut impl DevicePtrMut<f32>,
        eps: f32,
    ) -> Result<()> {
        let (n, width) = (x.len(), weight.len());
        ensure(out.len() == n && bias.len() == width, || {
            format!(
                "layer_norm: x has {n} values, out {}, weight {width}, bias {}",
                out.len(),
                bias.len()
            )
        })?;
        ensure(width > 0 && n.is_multiple_of(width), || {
            format!("layer_norm: {n} values are not rows of {width}")
        })?;
        let rows = n / width;
        if rows == 0 {
            return Ok(());
        }
        u32_of("rows", rows)?;
        let width32 = u32_of("width", width)?;
        let f = self.function("layer_norm")?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = weight.device_ptr(&self.stream);
        let (bp, _gb) = bias.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp)
            .arg(&wp)
            .arg(&bp)
            .arg(&op)
            .arg(&width32)
            .arg(&eps);
        // SAFETY: x and out hold rows * width values, weight and bias width: checked above.
        unsafe { b.launch(row_cfg(rows, width)) }?;
        Ok(())
    }

    /// x = act(x), element-wise.
    pub fn activate(&self, x: &mut impl DevicePtrMut<f32>, act: Activation) -> Result<()> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let f = self.function("activate")?;
        let (xp, _gx) = x.device_ptr_mut(&self.stream);
        let n64 = n as u64;
        let code: u32 = act.code();
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp).arg(&n64).arg(&code);
        // SAFETY: x holds n values; the kernel touches those only.
        unsafe { b.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// x = x / sqrt(mean(x²) + eps) * weight in place, over rows of `weight.len()` values.
    pub fn rms_norm_in_place(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        weight: &impl DevicePtr<f32>,
        eps: f32,
    ) -> Result<()> {
        let n = x.len();
        let (xp, _gx) = x.device_ptr_mut(&self.stream);
        self.rms_norm_raw(xp, n, weight, xp, eps)
    }

    fn rms_norm_raw(
        &self,
        xp: u64,
        n: usize,
        weight: &impl DevicePtr<f32>,
        op: u64,
        eps: f32,
    ) -> Result<()> {
        let width = weight.len();
        ensure(width > 0 && n.is_multiple_of(width), || {
            format!("rms_norm: {n} values are not rows of {width}")
        })?;
        let rows = n / width;
        if rows == 0 {
            return Ok(());
        }
        u32_of("rows", rows)?;
        let width32 = u32_of("width", width)?;
        let f = self.function("rms_norm")?;
        let (wp, _gw) = weight.device_ptr(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp).arg(&wp).arg(&op).arg(&width32).arg(&eps);
        // SAFETY: as above; the kernel allows out == x.
        unsafe { b.launch(row_cfg(rows, width)) }?;
        Ok(())
    }

    /// x += y.
    pub fn add_in_place(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        y: &impl DevicePtr<f32>,
    ) -> Result<()> {
        let n = x.len();
        ensure(y.len() == n, || {
            format!("add: x has {n} values, y {}", y.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("add_in_place")?;
        let (xp, _gx) = x.device_ptr_mut(&self.stream);
        let (yp, _gy) = y.device_ptr(&self.stream);
        let n64 = n as u64;
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp).arg(&yp).arg(&n64);
        // SAFETY: as above.
        unsafe { b.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// x[r, i] += bias[i] for rows of `bias.len()` values.
    pub fn add_bias(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        bias: &impl DevicePtr<f32>,
    ) -> Result<()> {
        let n = x.len();
        let w = bias.len();
        ensure(w > 0 && n.is_multiple_of(w), || {
            format!("add_bias: {n} values are not rows of {w}")
        })?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("add_bias")?;
        let (xp, _gx) = x.device_ptr_mut(&self.stream);
        let (bp, _gb) = bias.device_ptr(&self.stream);
        let n64 = n as u64;
        let w32 = u32_of("width", w)?;
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp).arg(&bp).arg(&n64).arg(&w32);
        // SAFETY: as above.
        unsafe { b.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// gate = act(gate) * up.
    pub fn act_mul(
        &self,
        gate: &mut impl DevicePtrMut<f32>,
        up: &impl DevicePtr<f32>,
        act: Activation,
    ) -> Result<()> {
        let n = gate.len();
        ensure(up.len() == n, || {
            format!("act_mul: gate has {n} values, up {}", up.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("act_mul")?;
        let (gp, _gg) = gate.device_ptr_mut(&self.stream);
        let (up_, _gu) = up.device_ptr(&self.stream);
        let n64 = n as u64;
        let code: u32 = act.code();
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&gp).arg(&up_).arg(&n64).arg(&code);
        // SAFETY: as above.
        unsafe { b.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// x *= s.
    pub fn scale(&self, x: &mut impl DevicePtrMut<f32>, s: f32) -> Result<()> {
        self.unary("scale_f32", x, s)
    }

    /// x = min(max(x, -limit), limit); `limit` must be positive.
    pub fn clamp(&self, x: &mut impl DevicePtrMut<f32>, limit: f32) -> Result<()> {
        ensure(limit > 0.0, || {
            format!("clamp: limit {limit} is not positive")
        })?;
        self.unary("clamp_f32", x, limit)
    }

    /// x = cap * tanh(x / cap); `cap` must be positive.
    pub fn soft_cap(&self, x: &mut impl DevicePtrMut<f32>, cap: f32) -> Result<()> {
        ensure(cap > 0.0, || format!("soft_cap: cap {cap} is not positive"))?;
        self.unary("soft_cap_f32", x, cap)
    }

    fn unary(&self, name: &str, x: &mut impl DevicePtrMut<f32>, s: f32) -> Result<()> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let f = self.function(name)?;
        let (xp, _gx) = x.device_ptr_mut(&self.stream);
        let n64 = n as u64;
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp).arg(&n64).arg(&s);
        // SAFETY: as above.
        unsafe { b.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// Rotary embedding in place on x `[tokens, heads, head_dim]` with cos, sin `[tokens, half]`;
    /// pairs (2i, 2i+1) when `adjacent`, else (i, i + half); dims past 2*half are left alone.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        cos: &impl DevicePtr<f32>,
        sin: &impl DevicePtr<f32>,
        heads: usize,
        head_dim: usize,
        half: usize,
        adjacent: bool,
    ) -> Result<()> {
        ensure(2 * half <= head_dim, || {
            format!("rope: half {half} does not fit head_dim {head_dim}")
        })?;
        if half == 0 {
            // No rotary dimensions (GPT-2's learned positions): nothing to turn.
            return Ok(());
        }
        let row = heads * head_dim;
        ensure(row > 0 && x.len().is_multiple_of(row), || {
            format!(
                "rope: {} values are not rows of {heads} x {head_dim}",
                x.len()
            )
        })?;
        let tokens = x.len() / row;
        ensure(
            cos.len() == tokens * half && sin.len() == tokens * half,
            || {
                format!(
                    "rope: cos {} and sin {} values, want {tokens} x {half}",
                    cos.len(),
                    sin.len()
                )
            },
        )?;
        if tokens == 0 {
            return Ok(());
        }
        let f = self.function("rope")?;
        let (xp, _gx) = x.device_ptr_mut(&self.stream);
        let (cp, _gc) = cos.device_ptr(&self.stream);
        let (sp, _gs) = sin.device_ptr(&self.stream);
        let (h32, d32, half32) = (
            u32_of("heads", heads)?,
            u32_of("head_dim", head_dim)?,
            u32_of("half", half)?,
        );
        let adj = adjacent as u32;
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp)
            .arg(&cp)
            .arg(&sp)
            .arg(&h32)
            .arg(&d32)
            .arg(&half32)
            .arg(&adj);
        // SAFETY: as above.
        unsafe {
            b.launch(row_cfg(
                u32_of("tokens", tokens)? as usize,
                (heads * half).min(1024),
            ))
        }?;
        Ok(())
    }

    /// out[r] = x[idx[r]] for rows of `width` values (an index past x gives NaN).
    pub fn gather_rows(
        &self,
        x: &impl DevicePtr<f32>,
        idx: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<f32>,
        width: usize,
    ) -> Result<()> {
        let n = idx.len();
        ensure(width > 0 && x.len().is_multiple_of(width), || {
            format!("gather_rows: {} values are not rows of {width}", x.len())
        })?;
        ensure(out.len() == n * width, || {
            format!(
                "gather_rows: out has {} values, want {n} x {width}",
                out.len()
            )
        })?;
        if n == 0 {
            return Ok(());
        }
        let rows = u32_of("rows", x.len() / width)?;
        let w32 = u32_of("width", width)?;
        let f = self.function("gather_rows")?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (ip, _gi) = idx.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp).arg(&ip).arg(&op).arg(&w32).arg(&rows);
        // SAFETY: as above.
        unsafe {
            b.launch(row_cfg(
                u32_of("gathered rows", n)? as usize,
                width.min(1024),
            ))
        }?;
        Ok(())
    }

    /// Copies rows of `width` values of x to device addresses: entry `i` of `table`
    /// (`[n, 2]`: destination address, source row) copies x's row `table[i][1]` to
    /// `table[i][0]`; a destination of 0 copies nothing.
    ///
    /// # Safety
    /// Every non-zero destination in `table` must address `width` f32 of live device
    /// memory that nothing else reads or writes until the stream has run the copy.
    pub unsafe fn scatter_rows(
        &self,
        x: &impl DevicePtr<f32>,
        table: &impl DevicePtr<u64>,
        width: usize,
    ) -> Result<()> {
        ensure(width > 0 && x.len().is_multiple_of(width), || {
            format!("scatter_rows: {} values are not rows of {width}", x.len())
        })?;
        ensure(table.len().is_multiple_of(2), || {
            format!(
                "scatter_rows: a table of {} values is not pairs",
                table.len()
            )
        })?;
        let n = table.len() / 2;
        if n == 0 {
            return Ok(());
        }
        let rows = u32_of("rows", x.len() / width)?;
        let w32 = u32_of("width", width)?;
        let f = self.function("scatter_rows")?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (tp, _gt) = table.device_ptr(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp).arg(&tp).arg(&w32).arg(&rows);
        // SAFETY: x holds `rows` rows of `width`; the table's `n` pairs are read; the
        // destinations are the caller's (see # Safety).
        unsafe {
            b.launch(row_cfg(
                u32_of("scattered rows", n)? as usize,
                width.min(1024),
            ))
        }?;
        Ok(())
    }

    /// Each row of x `[rows, n]` reduced as `params` `[rows, 8]` says, into `out`
    /// `[rows, 3 + 2 * top_cap]` (the `reduce_rows` kernel says how; [`crate::reduce`]
    /// writes a row's parameters and reads its words back).
    pub fn reduce_rows(
        &self,
        x: &impl DevicePtr<f32>,
        params: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<u32>,
        top_cap: usize,
    ) -> Result<()> {
        let per_row = crate::reduce::REDUCE_PARAMS;
        let rows = params.len() / per_row;
        ensure(
            rows > 0
                && params.len() == per_row * rows
                && x.len().is_multiple_of(rows)
                && x.len() > 0,
            || {
                format!(
                    "reduce_rows: {} values and {} parameters are not {rows} non-empty rows",
                    x.len(),
                    params.len()
                )
            },
        )?;
        ensure(
            out.len() == rows * crate::reduce::reduce_stride(top_cap),
            || {
                format!(
                    "reduce_rows: {} outputs for {rows} rows of top {top_cap}",
                    out.len()
                )
            },
        )?;
        let n = x.len() / rows;
        let n32 = u32_of("row length", n)?;
        let cap32 = u32_of("top logprobs", top_cap)?;
        let f = self.function("reduce_rows")?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (pp, _gp) = params.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp).arg(&pp).arg(&op).arg(&n32).arg(&cap32);
        // SAFETY: x holds `rows` rows of n, params 8 per row, out a stride per row.
        unsafe { b.launch(row_cfg(u32_of("rows", rows)? as usize, n)) }?;
        Ok(())
    }

    /// Applies `edits` (`[count, 6]` words, [`crate::reduce::edit_words`]) to the rows of
    /// `n` in x.
    pub fn edit_logits(
        &self,
        x: &mut impl DevicePtrMut<f32>,
        n: usize,
        edits: &impl DevicePtr<u32>,
    ) -> Result<()> {
        ensure(n > 0 && x.len().is_multiple_of(n), || {
            format!("edit_logits: {} values are not rows of {n}", x.len())
        })?;
        ensure(edits.len().is_multiple_of(6), || {
            format!("edit_logits: {} words are not edits of 6", edits.len())
        })?;
        let count = edits.len() / 6;
        if count == 0 {
            return Ok(());
        }
        let n32 = u32_of("row length", n)?;
        let rows32 = u32_of("rows", x.len() / n)?;
        let count32 = u32_of("edits", count)?;
        let f = self.function("edit_logits")?;
        let (xp, _gx) = x.device_ptr_mut(&self.stream);
        let (ep, _ge) = edits.device_ptr(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp).arg(&n32).arg(&rows32).arg(&ep).arg(&count32);
        // SAFETY: the kernel checks every edit's row and token against x's shape.
        unsafe { b.launch(LaunchConfig::for_num_elems(count32)) }?;
        Ok(())
    }

    /// Writes k, v `[t, kv_heads, head_dim]` into the cache at `slots[t]` (negative: skipped).
    pub fn kv_write<T: CacheElem>(
        &self,
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        slots: &impl DevicePtr<i64>,
        cache: &mut impl DevicePtrMut<T>,
        strides: &KvStrides,
    ) -> Result<()> {
        let t = slots.len();
        let row = strides.num_kv_heads * strides.head_dim;
        ensure(k.len() == t * row && v.len() == t * row, || {
            format!(
                "kv_write: k {} and v {} values, want {t} x {} x {}",
                k.len(),
                v.len(),
                strides.num_kv_heads,
                strides.head_dim
            )
        })?;
        ensure(strides.block_size > 0, || {
            "kv_write: block_size is 0".into()
        })?;
        if t == 0 || row == 0 {
            return Ok(());
        }
        ensure(strides.num_kv_heads <= GRID_YZ, || {
            format!("kv_write: {} kv heads", strides.num_kv_heads)
        })?;
        let f = self.function(&format!("kv_write_{}", T::SUFFIX))?;
        let cache_len = cache.len() as u64;
        let (kp, _gk) = k.device_ptr(&self.stream);
        let (vp, _gv) = v.device_ptr(&self.stream);
        let (sp, _gs) = slots.device_ptr(&self.stream);
        let (cp, _gc) = cache.device_ptr_mut(&self.stream);
        let s = StrideArgs::new(strides)?;
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&kp).arg(&vp).arg(&sp).arg(&cp).arg(&cache_len);
        s.push_write_args(&mut b);
        let cfg = LaunchConfig {
            grid_dim: (u32_of("tokens", t)?, strides.num_kv_heads as u32, 1),
            block_dim: (strides.head_dim.next_multiple_of(32).min(256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; the kernel bounds every write by the cache length.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// [`Gpu::kv_write`] with the step's RoPE in the same launch: the keys are turned as
    /// they are written (k itself is left as it is) and `q` `[t, q_heads, head_dim]`
    /// (`q_heads` a multiple of the cache's kv heads) is turned in place, the same bits as
    /// [`Gpu::rope_qk`] before [`Gpu::kv_write`].
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv_write<T: CacheElem>(
        &self,
        (q, q_heads): (&mut impl DevicePtrMut<f32>, usize),
        k: &impl DevicePtr<f32>,
        v: &impl DevicePtr<f32>,
        rope: &RopeStep<'_>,
        slots: &impl DevicePtr<i64>,
        cache: &mut impl DevicePtrMut<T>,
        strides: &KvStrides,
    ) -> Result<()> {
        let t = slots.len();
        let (kvh, d, half) = (strides.num_kv_heads, strides.head_dim, rope.half);
        ensure(kvh > 0 && q_heads.is_multiple_of(kvh), || {
            format!("rope_kv_write: {q_heads} query heads for {kvh} kv heads")
        })?;
        // half = 0 (no rotary dimensions: GPT-2) writes K and V as they are.
        ensure(2 * half <= d, || {
            format!("rope_kv_write: half {half} does not fit head_dim {d}")
        })?;
        ensure(
            q.len() == t * q_heads * d
                && k.len() == t * kvh * d
                && v.len() == t * kvh * d
                && rope.cos.len() == t * half
                && rope.sin.len() == t * half,
            || {
                format!(
                    "rope_kv_write: q {}, k {}, v {}, cos {}, sin {} values for {t} tokens of \
                     {q_heads}/{kvh} heads of {d} (half {half})",
                    q.len(),
                    k.len(),
                    v.len(),
                    rope.cos.len(),
                    rope.sin.len()
                )
            },
        )?;
        ensure(strides.block_size > 0, || {
            "rope_kv_write: block_size is 0".into()
        })?;
        if t == 0 || d == 0 {
            return Ok(());
        }
        ensure(kvh <= GRID_YZ, || format!("rope_kv_write: {kvh} kv heads"))?;
        let f = self.function(&format!("rope_kv_write_{}", T::SUFFIX))?;
        let cache_len = cache.len() as u64;
        let (qp, _gq) = q.device_ptr_mut(&self.stream);
        let (kp, _gk) = k.device_ptr(&self.stream);
        let (vp, _gv) = v.device_ptr(&self.stream);
        let (cosp, _gcos) = rope.cos.device_ptr(&self.stream);
        let (sinp, _gsin) = rope.sin.device_ptr(&self.stream);
        let (sp, _gs) = slots.device_ptr(&self.stream);
        let (cp, _gc) = cache.device_ptr_mut(&self.stream);
        let s = StrideArgs::new(strides)?;
        let qh32 = u32_of("q_heads", q_heads)?;
        let half32 = u32_of("half", half)?;
        let adjacent = rope.adjacent as u32;
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&qp).arg(&qh32).arg(&kp).arg(&vp);
        b.arg(&cosp).arg(&sinp).arg(&half32).arg(&adjacent);
        b.arg(&sp).arg(&cp).arg(&cache_len);
        s.push_write_args(&mut b);
        let threads = d.max(q_heads / kvh * half);
        let cfg = LaunchConfig {
            grid_dim: (u32_of("tokens", t)?, kvh as u32, 1),
            block_dim: (threads.next_multiple_of(32).min(256) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above; the kernel bounds every cache write by the cache length.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

/// A step's RoPE on the device: cos and sin `[tokens, half]` of each token's angles; pair
/// `i` of a head is `(2i, 2i + 1)` when `adjacent`, else `(i, i + half)`.
#[derive(Clone, Copy, Debug)]
pub struct RopeStep<'a> {
    pub cos: &'a CudaSlice<f32>,
    pub sin: &'a CudaSlice<f32>,
    pub half: usize,
    pub adjacent: bool,
}

/// The stride arguments as the kernels take them.
pub(crate) struct StrideArgs {
    pub(crate) kv: u64,
    pub(crate) block: u64,
    pub(crate) in_block: u64,
    pub(crate) head: u64,
    pub(crate) dim: u64,
    pub(crate) block_size: u32,
    pub(crate) num_kv_heads: u32,
    pub(crate) head_dim: u32,
}

impl StrideArgs {
    pub(crate) fn new(s: &KvStrides) -> Result<StrideArgs> {
        Ok(StrideArgs {
            kv: s.kv as u64,
            block: s.block as u64,
            in_block: s.in_block as u64,
            head: s.head as u64,
            dim: s.dim as u64,
            block_size: u32_of("block_size", s.block_size)?,
            num_kv_heads: u32_of("num_kv_heads", s.num_kv_heads)?,
            head_dim: u32_of("head_dim", s.head_dim)?,
        })
    }

    /// The strides and sizes as the cache-write kernels (kv.cu) take them, in order.
    fn push_write_args<'a>(&'a self, b: &mut Launch<'a>) {
        b.arg(&self.kv)
            .arg(&self.block)
            .arg(&self.in_block)
            .arg(&self.head)
            .arg(&self.dim);
        b.arg(&self.block_size)
            .arg(&self.num_kv_heads)
            .arg(&self.head_dim);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_layouts_place_keys_and_values_apart() {
        let (blocks, bs, h, d) = (5, 16, 2, 8);
        for s in [
            KvStrides::kv_first(blocks, bs, h, d),
            KvStrides::block_first(bs, h, d),
        ] {
            let len = s.cache_len(blocks);
            let mut seen = vec![false; len];
            for slot in 0..blocks * bs {
                for head in 0..h {
                    for i in 0..d {
                        for off in [
                            s.key_offset(slot, head, i),
                            s.key_offset(slot, head, i) + s.kv,
                        ] {
                            assert!(!seen[off], "{s:?} slot {slot}");
                            seen[off] = true;
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&b| b));
        }
    }
}
