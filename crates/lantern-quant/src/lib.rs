//! lantern-quant: fast CPU matrix products for GGUF `Q4_1` and `Q8_0` weights.
//!
//! Weights are read once from the raw GGUF bytes and *repacked* into a layout made for
//! AVX-512 VNNI (`vpdpbusd`: 64 u8 x i8 products summed in groups of four into 16 i32
//! lanes). [`PackedMatrix::matmul`] computes `dst[m, n] = x[m, k] · Wᵀ` in f32, using
//! the VNNI kernels where the CPU has them ([`kernel_level`]) and a portable scalar
//! path otherwise. Both paths do the same integer arithmetic and the same f32
//! operations in the same order, so they produce bit-identical results.
//!
//! ```
//! use lantern_quant::{PackedMatrix, QuantType};
//! // A 2 x 32 Q8_0 matrix: per row one block `d: f16, qs: [i8; 32]`.
//! let mut bytes = Vec::new();
//! for row in 0..2u8 {
//!     bytes.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
//!     bytes.extend(std::iter::repeat(row + 1).take(32));
//! }
//! let w = PackedMatrix::from_gguf_bytes(QuantType::Q8_0, &bytes, 2, 32).unwrap();
//! let x = vec![1.0f32; 32];
//! let mut y = vec![0f32; 2];
//! w.matmul(&x, 1, &mut y).unwrap();
//! assert_eq!(y, [16.0, 32.0]);
//! ```
//!
//! # Arithmetic
//!
//! Activations are quantized per 32-value block to int8, like ggml's `Q8_1`: for a
//! block `x[0..32]`, `d_a = amax / 127`, `q_a[j] = round_ties_even(x[j] / d_a)` (clamped
//! to ±127), and the block sum `s_a = d_a · Σ q_a` is kept alongside (all scales f32).
//! Per weight block and activation block:
//!
//! - `Q4_1` (`w = d_w · q_w + m_w`, `q_w ∈ 0..16`):
//!   `dot = d_w·d_a·Σ q_w·q_a + m_w·s_a`. `q_w` is unsigned and `q_a` signed, exactly
//!   the operand signedness of `vpdpbusd`.
//! - `Q8_0` (`w = d_w · q_w`, `q_w ∈ -128..128`): the weights are stored biased,
//!   `u_w = q_w + 128 ∈ 0..256` (unsigned operand), and
//!   `Σ q_w·q_a = Σ u_w·q_a − 128·Σ q_a`; the correction `−128·Σ q_a` is an exact
//!   per-(token, block) integer computed with the activation quantization, used as the
//!   initial value of the i32 accumulator. So `dot = d_w·d_a·Σ q_w·q_a`.
//!
//! The integer block sums are exact (|Σ| < 2^21) and exactly representable in f32. The
//! f32 part is, per (output row, token), for blocks `b = 0, 1, ...` in order:
//! `acc = fma(d_w·d_a, dot_i32 as f32, acc)` and for `Q4_1` then `acc = fma(m_w, s_a, acc)`.
//! Nothing depends on how rows or tokens are tiled or split between threads, so a
//! token's output is bit-identical whether it is computed alone or inside a batch
//! (batch invariance: greedy outputs must not depend on batch composition), and the
//! scalar fallback matches the VNNI kernels bit for bit.
//!
//! The only approximation is the int8 quantization of the activations (relative error of
//! an output row around 0.5%, as in llama.cpp, which does the same).
//!
//! # Repacked layout
//!
//! Rows are grouped in *panels* of 16 (the last panel is padded with zero rows, which
//! are computed but never stored). For panel `p` and block `b` (32 k-values), the
//! quantized values form one *block-panel* record, panel-major so that each panel's
//! blocks are one contiguous, sequentially prefetched stream:
//!
//! - quants, at `(p · nb + b) · R` bytes (`R` = 256 for `Q4_1`, 512 for `Q8_0`), as 64-byte
//!   chunks (one zmm register each). Chunk `c` holds, in its i32 lane `r` (row
//!   `16p + r`), 4 consecutive bytes of that row's block:
//!   - `Q4_1`: 4 chunks; lane `r` of chunk `c` = GGUF `qs[4c..4c+4]` of row `r` unchanged,
//!     i.e. low nibbles = values `4c..4c+4` and high nibbles = values `16+4c..16+4c+4`.
//!     The kernel unpacks with one `and` (low) and one `shift+and` (high) per chunk and
//!     multiplies them with activation dwords `c` and `4+c` respectively.
//!   - `Q8_0`: 8 chunks; lane `r` of chunk `c` = `qs[4c..4c+4] ^ 0x80` (biased to u8),
//!     multiplied with activation dword `c`.
//! - scales, in a separate array at `(p · nb + b) · S` bytes: 16 `d_w` as f16, then (for
//!   `Q4_1`, `S` = 64) 16 `m_w` as f16 (`Q8_0`: `S` = 32). They are widened with
//!   `vcvtph2ps` (exact); f16 keeps the repacked size equal to the GGUF size.
//!
//! With this layout one `vpdpbusd` multiplies 4 k-values of 16 rows by the same 4
//! activation bytes (a broadcast dword): a block-panel is 8 `vpdpbusd` into one
//! register holding the 16 rows' integer dot products, with no horizontal reductions
//! and no shuffles. The per-block scaling is then 16-wide f32 FMAs against the 16 rows'
//! scales. For prefill a register tile of `P` panels x `T` tokens reuses every unpacked
//! weight register `T` times and every broadcast activation dword `P` times.
//! Both buffers are 64-byte aligned, so no load splits a cache line.
//!
//! # Threads
//!
//! `matmul` splits the work over rayon tasks of (panel range x token range); each output
//! element is produced by exactly one task with the full k loop, so the thread count and
//! the split do not change any result. Products below ~2M multiply-adds (decode-sized
//! products of the layer matrices) run on the calling thread: a rayon fork-join costs
//! about as much as the whole product there.

mod act;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

use act::QuantAct;
use half::f16;
use rayon::prelude::*;

/// Values per quantization block (both `Q4_1` and `Q8_0`).
pub const BLOCK: usize = 32;
/// Rows per panel in the repacked layout.
pub const PANEL: usize = 16;

/// The GGUF quantization types this crate handles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// 32 values in 20 bytes: `d: f16, m: f16, qs: [u8; 16]` (two nibbles per byte).
    Q4_1,
    /// 32 values in 34 bytes: `d: f16, qs: [i8; 32]`.
    Q8_0,
}

impl QuantType {
    /// Bytes of one 32-value block in the GGUF file.
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantType::Q4_1 => 20,
            QuantType::Q8_0 => 34,
        }
    }

    /// Quant bytes of one repacked block-panel (16 rows x 32 values).
    pub(crate) const fn packed_quant_bytes(self) -> usize {
        match self {
            QuantType::Q4_1 => 256,
            QuantType::Q8_0 => 512,
        }
    }

    /// Scale bytes of one repacked block-panel.
    pub(crate) const fn packed_scale_bytes(self) -> usize {
        match self {
            QuantType::Q4_1 => 64,
            QuantType::Q8_0 => 32,
        }
    }
}

/// Errors of this crate (bad shapes and lengths; nothing here panics on bad input).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("k = {k} is not a positive multiple of {BLOCK}")]
    BadCols { k: usize },
    #[error("n = 0 rows")]
    NoRows,
    #[error("shape {n} x {k} overflows usize")]
    Overflow { n: usize, k: usize },
    #[error("{what}: expected {expected} elements, got {got}")]
    Length {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("row {row} out of range for {rows} rows")]
    RowOutOfRange { row: usize, rows: usize },
}

/// The kernels a [`PackedMatrix::matmul`] call can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Portable scalar code (bit-identical results to the VNNI kernels).
    Scalar,
    /// AVX-512 F/BW + VNNI kernels (x86-64 only).
    Avx512Vnni,
}

impl Kernel {
    /// The best kernel for this machine.
    pub fn detect() -> Kernel {
        if avx512_vnni_available() {
            Kernel::Avx512Vnni
        } else {
            Kernel::Scalar
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx512Vnni => "avx512-vnni",
        }
    }
}

fn avx512_vnni_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        x86::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// What [`PackedMatrix::matmul`] runs at on this machine: `"avx512-vnni"` or `"scalar"`.
pub fn kernel_level() -> &'static str {
    Kernel::detect().name()
}

/// A 64-byte aligned byte buffer.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

#[derive(Clone)]
pub(crate) struct AlignedBuf {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedBuf {
    pub(crate) fn zeroed(len: usize) -> Self {
        AlignedBuf {
            lines: vec![Line([0; 64]); len.div_ceil(64)],
            len,
        }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `lines` holds at least `len` initialised bytes.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.len) }
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` gives unique access.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), self.len) }
    }

    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.lines.as_ptr().cast::<u8>()
    }
}

/// A `Q4_1` or `Q8_0` weight matrix `[n rows (out features), k cols (in features)]`,
/// repacked for the kernels (see the crate docs for the layout).
#[derive(Clone)]
pub struct PackedMatrix {
    ty: QuantType,
    n: usize,
    k: usize,
    /// Blocks per row, `k / 32`.
    nb: usize,
    /// Panels, `ceil(n / 16)`.
    np: usize,
    quants: AlignedBuf,
    scales: AlignedBuf,
}

impl std::fmt::Debug for PackedMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedMatrix")
            .field("ty", &self.ty)
            .field("n", &self.n)
            .field("k", &self.k)
            .finish()
    }
}

/// Rows x token work split for one `matmul` call.
#[derive(Clone, Copy, Debug)]
struct Split {
    /// Panels per task (a multiple of the register tile's panel count where possible).
    panels_per_task: usize,
    /// Tokens per task.
    tokens_per_task: usize,
}

/// Below this many multiply-adds a `matmul` runs on the calling thread. A rayon
/// fork-join costs several microseconds (more on a loaded machine, where the other
/// worker may not be running), about the time of a whole 1536 x 576 product at m = 1
/// (~4.5 us on one Zen 5 core), so decode-sized products of this model's layer matrices
/// stay serial and only the vocabulary matrix and batches are split. Measured on a
/// loaded 2-core machine: threshold 2^18 -> 6.5 ms per SmolLM2 decode pass of matmuls,
/// 3M -> 4.4 ms.
const SERIAL_MACS: usize = 1 << 21;
/// Tokens per task for large batches.
const TOKEN_CHUNK: usize = 64;
/// Target repacked weight bytes per task (stays in L2 while the task's tokens stream).
const TASK_WEIGHT_BYTES: usize = 256 * 1024;

impl PackedMatrix {
    /// Repacks a weight matrix from its raw GGUF bytes (`n` rows of `k / 32` blocks).
    ///
    /// Errors when `k` is not a positive multiple of 32, `n == 0`, or `bytes` does not
    /// hold exactly `n · k / 32` blocks.
    pub fn from_gguf_bytes(
        ty: QuantType,
        bytes: &[u8],
        n: usize,
        k: usize,
    ) -> Result<Self, QuantError> {
        if k == 0 || !k.is_multiple_of(BLOCK) {
            return Err(QuantError::BadCols { k });
        }
        if n == 0 {
            return Err(QuantError::NoRows);
        }
        let nb = k / BLOCK;
        let bb = ty.block_bytes();
        let expected = n
            .checked_mul(nb)
            .and_then(|v| v.checked_mul(bb))
            .ok_or(QuantError::Overflow { n, k })?;
        if bytes.len() != expected {
            return Err(QuantError::Length {
                what: "GGUF bytes",
                expected,
                got: bytes.len(),
            });
        }
        let np = n.div_ceil(PANEL);
        let qbp = ty.packed_quant_bytes();
        let sbp = ty.packed_scale_bytes();
        let mut quants = AlignedBuf::zeroed(np * nb * qbp);
        let mut scales = AlignedBuf::zeroed(np * nb * sbp);
        {
            let qs_out = quants.as_mut_slice();
            let sc_out = scales.as_mut_slice();
            let pack_panel = |(p, (qp, sp)): (usize, (&mut [u8], &mut [u8]))| {
                for r in 0..PANEL {
                    let row = p * PANEL + r;
                    if row >= n {
                        break; // padding rows keep zero scales: they compute 0 and are never stored
                    }
                    for b in 0..nb {
                        let src = &bytes[(row * nb + b) * bb..(row * nb + b + 1) * bb];
                        let q = &mut qp[b * qbp..(b + 1) * qbp];
                        let s = &mut sp[b * sbp..(b + 1) * sbp];
                        match ty {
                            QuantType::Q4_1 => {
                                s[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                                s[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&src[2..4]);
                                for c in 0..4 {
                                    q[c * 64 + 4 * r..c * 64 + 4 * r + 4]
                                        .copy_from_slice(&src[4 + 4 * c..8 + 4 * c]);
                                }
                            }
                            QuantType::Q8_0 => {
                                s[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
                                for c in 0..8 {
                                    for j in 0..4 {
                                        q[c * 64 + 4 * r + j] = src[2 + 4 * c + j] ^ 0x80;
                                    }
                                }
                            }
                        }
                    }
                }
            };
            if expected >= 1 << 20 {
                qs_out
                    .par_chunks_mut(nb * qbp)
                    .zip(sc_out.par_chunks_mut(nb * sbp))
                    .enumerate()
                    .for_each(pack_panel);
            } else {
                qs_out
                    .chunks_mut(nb * qbp)
                    .zip(sc_out.chunks_mut(nb * sbp))
                    .enumerate()
                    .for_each(pack_panel);
            }
        }
        Ok(PackedMatrix {
            ty,
            n,
            k,
            nb,
            np,
            quants,
            scales,
        })
    }

    /// Output features (rows of W).
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Input features (columns of W).
    pub fn cols(&self) -> usize {
        self.k
    }

    pub fn quant_type(&self) -> QuantType {
        self.ty
    }

    /// Bytes of repacked weights and scales held.
    pub fn packed_bytes(&self) -> usize {
        self.quants.len + self.scales.len
    }

    /// `dst[m, n] = x[m, k] · Wᵀ` (row-major f32), multi-threaded with rayon, using the
    /// best kernel for this machine ([`kernel_level`]).
    pub fn matmul(&self, x: &[f32], m: usize, dst: &mut [f32]) -> Result<(), QuantError> {
        self.matmul_with(Kernel::detect(), x, m, dst)
    }

    /// [`matmul`](Self::matmul) with an explicit kernel. Asking for
    /// [`Kernel::Avx512Vnni`] on a machine without it runs the scalar kernel (same
    /// results, bit for bit).
    pub fn matmul_with(
        &self,
        kernel: Kernel,
        x: &[f32],
        m: usize,
        dst: &mut [f32],
    ) -> Result<(), QuantError> {
        let kernel = if kernel == Kernel::Avx512Vnni && !avx512_vnni_available() {
            Kernel::Scalar
        } else {
            kernel
        };
        let xlen = m
            .checked_mul(self.k)
            .ok_or(QuantError::Overflow { n: m, k: self.k })?;
        if x.len() != xlen {
            return Err(QuantError::Length {
                what: "x",
                expected: xlen,
                got: x.len(),
            });
        }
        let dlen = m
            .checked_mul(self.n)
            .ok_or(QuantError::Overflow { n: m, k: self.n })?;
        if dst.len() != dlen {
            return Err(QuantError::Length {
                what: "dst",
                expected: dlen,
                got: dst.len(),
            });
        }
        if m == 0 {
            return Ok(());
        }
        let macs = m * self.n * self.k;
        let parallel = macs >= SERIAL_MACS && rayon::current_num_threads() > 1;
        let act = QuantAct::quantize(kernel, x, m, self.k, parallel);
        let dst_ptr = SendPtr(dst.as_mut_ptr());
        if !parallel {
            // SAFETY: the whole of dst is ours; tile bounds are in range.
            unsafe { self.run_tile(kernel, &act, 0, self.np, 0, m, dst_ptr.0) };
            return Ok(());
        }
        let split = self.split(m);
        let pt = self.np.div_ceil(split.panels_per_task);
        let tt = m.div_ceil(split.tokens_per_task);
        // Panel chunk outer, token chunk inner: neighbouring tasks share weights.
        (0..pt * tt).into_par_iter().for_each(|task| {
            let (pi, ti) = (task / tt, task % tt);
            let p0 = pi * split.panels_per_task;
            let p1 = (p0 + split.panels_per_task).min(self.np);
            let t0 = ti * split.tokens_per_task;
            let t1 = (t0 + split.tokens_per_task).min(m);
            let ptr = dst_ptr;
            // SAFETY: tasks write disjoint (token, row) rectangles of dst.
            unsafe { self.run_tile(kernel, &act, p0, p1, t0, t1, ptr.0) };
        });
        Ok(())
    }

    /// The portable scalar path (same results as [`matmul`](Self::matmul), bit for bit).
    pub fn matmul_scalar(&self, x: &[f32], m: usize, dst: &mut [f32]) -> Result<(), QuantError> {
        self.matmul_with(Kernel::Scalar, x, m, dst)
    }

    fn split(&self, m: usize) -> Split {
        let threads = rayon::current_num_threads().max(1);
        let granule = if m <= 2 { 4 } else { 2 };
        let tokens_per_task = if m <= TOKEN_CHUNK { m } else { TOKEN_CHUNK };
        let token_tasks = m.div_ceil(tokens_per_task);
        // Enough tasks for load balancing on a shared machine...
        let want_tasks = 4 * threads;
        let panel_tasks = want_tasks.div_ceil(token_tasks).max(1);
        let mut ppt = self.np.div_ceil(panel_tasks);
        // ...and a weight slice per task that stays in L2.
        let bp_bytes = self.nb * (self.ty.packed_quant_bytes() + self.ty.packed_scale_bytes());
        let cap = (TASK_WEIGHT_BYTES / bp_bytes).max(granule);
        ppt = ppt.min(cap).max(1);
        ppt = ppt.div_ceil(granule) * granule;
        Split {
            panels_per_task: ppt,
            tokens_per_task,
        }
    }

    /// Computes dst for panels `p0..p1` and tokens `t0..t1`.
    ///
    /// # Safety
    /// `dst` points to an `m x n` f32 buffer; no other thread writes this rectangle.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run_tile(
        &self,
        kernel: Kernel,
        act: &QuantAct,
        p0: usize,
        p1: usize,
        t0: usize,
        t1: usize,
        dst: *mut f32,
    ) {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => x86::run_tile(self, act, p0, p1, t0, t1, dst),
            _ => scalar::run_tile(self, act, p0, p1, t0, t1, dst),
        }
    }

    /// Dequantized row `r` into `out` (`k` values), exact.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), QuantError> {
        if r >= self.n {
            return Err(QuantError::RowOutOfRange {
                row: r,
                rows: self.n,
            });
        }
        if out.len() != self.k {
            return Err(QuantError::Length {
                what: "out",
                expected: self.k,
                got: out.len(),
            });
        }
        let (p, lane) = (r / PANEL, r % PANEL);
        let qbp = self.ty.packed_quant_bytes();
        let sbp = self.ty.packed_scale_bytes();
        let qs = self.quants.as_slice();
        let sc = self.scales.as_slice();
        for b in 0..self.nb {
            let q = &qs[(p * self.nb + b) * qbp..][..qbp];
            let s = &sc[(p * self.nb + b) * sbp..][..sbp];
            let d = f16::from_le_bytes([s[2 * lane], s[2 * lane + 1]]).to_f32();
            let o = &mut out[b * BLOCK..(b + 1) * BLOCK];
            match self.ty {
                QuantType::Q4_1 => {
                    let mm = f16::from_le_bytes([s[32 + 2 * lane], s[33 + 2 * lane]]).to_f32();
                    for c in 0..4 {
                        for j in 0..4 {
                            let byte = q[c * 64 + 4 * lane + j];
                            o[4 * c + j] = d * (byte & 0x0F) as f32 + mm;
                            o[16 + 4 * c + j] = d * (byte >> 4) as f32 + mm;
                        }
                    }
                }
                QuantType::Q8_0 => {
                    for c in 0..8 {
                        for j in 0..4 {
                            let v = (q[c * 64 + 4 * lane + j] ^ 0x80) as i8;
                            o[4 * c + j] = d * v as f32;
                        }
                    }
                }
            }
        }
        Ok(())
    }

    pub(crate) fn quant_ptr(&self, p: usize) -> *const u8 {
        // SAFETY (callers): p <= np, so the offset is at most one past the end.
        unsafe {
            self.quants
                .as_ptr()
                .add(p * self.nb * self.ty.packed_quant_bytes())
        }
    }

    pub(crate) fn scale_ptr(&self, p: usize) -> *const u8 {
        unsafe {
            self.scales
                .as_ptr()
                .add(p * self.nb * self.ty.packed_scale_bytes())
        }
    }

    /// Rows of panel `p` that exist (the rest are padding).
    pub(crate) fn valid_rows(&self, p: usize) -> usize {
        (self.n - p * PANEL).min(PANEL)
    }
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: only used to hand disjoint output rectangles to rayon tasks.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
