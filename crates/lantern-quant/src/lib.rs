//! lantern-quant: fast CPU matrix products for GGUF quantized weights (`Q4_0`, `Q4_1`,
//! `Q5_0`, `Q5_1`, `Q8_0`, `Q3_K`, `Q4_K`, `Q5_K`, `Q6_K`) and dense ones (`F16`, `BF16`, `F32`:
//! see `dense` for their layout; they take the activations unquantized, and everything
//! below about activation quantization concerns the quantized types only).
//!
//! Weights are read once from the raw GGUF bytes and *repacked* into panels of 16 rows
//! made for SIMD integer dot products; the repacked bytes replace the file's bytes (same
//! size, give or take 3% for the K-quants' unpacked sub-block scales). [`PackedMatrix::matmul`]
//! computes `dst[m, n] = x[m, k] · Wᵀ` in f32 at a *kernel level* chosen at run time
//! ([`Kernel`], [`active_kernel`]): Intel AMX tiles for batches of 32 tokens and more
//! (`x86::amx`), AVX-512 VNNI, AVX2 + FMA + F16C, or portable scalar
//! code. The level is the best the CPU reports unless
//! `LANTERN_KERNELS=scalar|avx2|avx-vnni|avx512|amx` asks for a lower one (capped at what the
//! CPU has) or [`force_kernel`] forces one. Every level does the same integer arithmetic
//! and the same f32 operations in the same order, so all levels produce bit-identical
//! results; the exceptions, never the default, are `avx512-bf16` and `amx-bf16`
//! ([`Kernel::Avx512Bf16`], [`Kernel::AmxBf16`]), which round the activations of BF16
//! products to bf16.
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
//! to ±127); `s_a = d_a · Σ q_a` and the integer sums `Σ q_a` (whole block and first 16
//! values) are kept alongside.
//!
//! Every weight type is seen, per 32-value block of a row, as unsigned quants `q_w`
//! (4, 5, 6 or 8 bits), an offset `o` and f32 scales: `w = d_w · (q_w − o) + m_w`.
//!
//! | type | `q_w` | `o` | `d_w` | `m_w` |
//! |---|---|---|---|---|
//! | `Q4_0` | 4 bits | 8 | `d` | — |
//! | `Q4_1` | 4 bits | 0 | `d` | `m` |
//! | `Q5_0` | 5 bits | 16 | `d` | — |
//! | `Q5_1` | 5 bits | 0 | `d` | `m` |
//! | `Q8_0` | `q + 128` | 128 | `d` | — |
//! | `Q4_K`, `Q5_K` | 4 / 5 bits | 0 | `d · sc_j` | `−dmin · m_j` |
//! | `Q6_K` | 6 bits | 32 | `d · sc_j`, one per 16 values | — |
//! | `Q3_K` | 3 bits | 4 | `d · (sc_j − 32)`, one per 16 values | — |
//!
//! (`d · sc_j` and `dmin · m_j` are exact in f32: an f16 times an integer below 2^8.)
//! The integer dot `Σ (q_w − o)·q_a = Σ q_w·q_a − o·Σ q_a` is exact (|Σ| < 2^21): the
//! unsigned-by-signed products are what `vpdpbusd` and `vpmaddubsw` multiply, and the
//! correction `−o·Σ q_a` is an exact integer from the activation quantization, used as
//! the accumulator's initial value. `Q6_K` and `Q3_K` keep two integer dots per block
//! (values 0..16 and 16..32), one per scale. The f32 part is, per (output row, token), for blocks
//! `b = 0, 1, ...` in order (`scalar::update`):
//! `acc = fma(d_w·d_a, dot as f32, acc)`; for `Q6_K` then
//! `acc = fma(d_w'·d_a, dot' as f32, acc)` with the second half's scale and dot; for the
//! types with `m_w`, then `acc = fma(m_w, s_a, acc)`.
//! Nothing depends on how rows or tokens are tiled or split between threads, so a
//! token's output is bit-identical whether it is computed alone or inside a batch
//! (batch invariance: greedy outputs must not depend on batch composition), and at every
//! level.
//!
//! The only approximation is the int8 quantization of the activations (relative error of
//! an output row around 0.5%, as in llama.cpp, which does the same; for the K-quants
//! llama.cpp quantizes activations per 256 values, lantern per 32, which is closer).
//!
//! # Repacked layout
//!
//! Rows are grouped in *panels* of 16 (the last panel is padded with zero rows, which
//! are computed but never stored). For panel `p` and block `b` (32 k-values), the
//! quantized values form one *block-panel* record, panel-major so that each panel's
//! blocks are one contiguous, sequentially prefetched stream, at `(p · nb + b) · R`
//! bytes. Its 64-byte chunks hold, in i32 lane `r` (row `16p + r`), 4 consecutive k
//! values of that row:
//!
//! - 3-, 4-, 5- and 6-bit types: 4 nibble chunks (256 bytes); lane `r` of chunk `c` holds in
//!   byte `j` the low 4 bits of value `4c + j` (low nibble) and of value `16 + 4c + j`
//!   (high nibble). 5-bit types add one chunk whose byte `j` holds bit 4 of value `4c+j`
//!   in bit `c` and of value `16+4c+j` in bit `4+c` (R = 320); `Q6_K` adds two chunks
//!   holding bits 4..6 of values `4c+j` (first) and `16+4c+j` (second) in bits `2c..2c+2`
//!   (R = 384). A kernel unpacks chunk `c` with `and`, 16-bit shifts and `or`, and
//!   multiplies it with the activation dwords `c` and `4 + c`.
//! - `Q8_0`: 8 chunks of biased bytes `q + 128` (R = 512), chunk `c` multiplied with
//!   activation dword `c`.
//!
//! Scales sit in a separate array, one record per block-panel (`Q4_0`, `Q5_0`, `Q8_0`: 16
//! `d` as f16; `Q4_1`, `Q5_1`: then 16 `m`) or per super-block-panel of 8 blocks for the
//! K-quants (`Q4_K`, `Q5_K`: 16 `d`, 16 `dmin` as f16, then `sc[8][16]` and `m[8][16]` as
//! u8; `Q6_K`, `Q3_K`: 16 `d`, then `sc[16][16]` as i8, `Q3_K`'s less 32). f16 is widened with `vcvtph2ps` (exact).
//!
//! With this layout one AVX-512 `vpdpbusd` multiplies 4 k-values of 16 rows by the same
//! 4 activation bytes (a broadcast dword), with no horizontal reductions and no shuffles;
//! the per-block scaling is 16-wide f32 FMAs against the 16 rows' scales. AVX2 reads each
//! chunk as two 8-row halves and replaces `vpdpbusd` with `vpmaddubsw` + `vpmaddwd`
//! (see `x86::avx2` for how saturation is avoided; `Q8_0` uses ggml's sign trick there).
//! For prefill a register tile of `P` panels x `T` tokens reuses every unpacked weight
//! register `T` times and every broadcast activation dword `P` times. The quants are
//! 64-byte aligned, so no load splits a cache line.
//!
//! # Threads
//!
//! A product runs on the calling thread and the helper threads of [`share`] (one fewer
//! than the compute pool's size), which claim its tasks from one counter: (panel range x
//! token range) rectangles for batches, chunks of panels for a single token. The caller
//! computes too instead of parking, and the helpers stay awake between the products of a
//! step, so entering a product costs about a microsecond where a rayon fork-join from
//! outside its pool cost tens. Each output element is produced by exactly one task with
//! the full k loop, so the thread count and the split do not change any result. Products
//! below ~2M multiply-adds (and single-token ones below ~128K) run on the calling thread.
//!
//! [`PackedMatrix::matmul_parts`] computes a stacked matrix (q/k/v, gate/up) into one
//! buffer per part, each task writing its rows straight into their part.

mod act;
pub mod blockwise;
pub mod convert;
mod dense;
mod format;
mod level;
mod scalar;
pub mod share;
pub mod simd;
pub mod spare;
pub mod threads;
pub mod topology;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use blockwise::Blockwise;
pub use format::QuantType;
pub use level::{active_kernel, force_kernel, kernel_level, Kernel, KERNELS_ENV};
#[cfg(target_arch = "x86_64")]
pub use x86::bf16_tiles;

use act::QuantAct;
use rayon::prelude::*;

/// Values per quantization block of the activations and of the repacked weights.
pub const BLOCK: usize = 32;
/// Rows per panel in the repacked layout.
pub const PANEL: usize = 16;

/// Errors of this crate (bad shapes and lengths; nothing here panics on bad input).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    #[error("k = {k} is not a positive multiple of {block} (the {ty} block size)")]
    BadCols {
        k: usize,
        block: usize,
        ty: QuantType,
    },
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
    #[error("output widths {widths:?} do not split the matrix's {rows} rows")]
    Widths { widths: Vec<usize>, rows: usize },
    #[error("row {row} out of range for {rows} rows")]
    RowOutOfRange { row: usize, rows: usize },
    #[error("{ty} is not a quantized type")]
    NotQuantized { ty: QuantType },
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

    /// Sets the length to `len` bytes for a caller that overwrites all of them: the
    /// lines are never given back (a buffer reused for products of every width zeroes
    /// only what it grows by, once), and the padding after `len` in its last line is
    /// zeroed, as in a fresh buffer.
    pub(crate) fn set_len_to_overwrite(&mut self, len: usize) {
        let lines = len.div_ceil(64);
        if self.lines.len() < lines {
            self.lines.resize(lines, Line([0; 64]));
        }
        if lines > 0 {
            self.lines[lines - 1].0[(len - 1) % 64 + 1..].fill(0);
        }
        self.len = len;
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
    /// Panels of the register tile: the smallest panel chunk worth a task.
    granule: usize,
}

/// Tokens per task of an `m`-token product over `np` panels on `threads` threads: up to
/// `TOKEN_CHUNK`, and when one range of tokens would leave too few panel tasks for the
/// threads (a small matrix on a big machine: SmolLM2's 36 panels at decode make 18
/// tasks, for 16-64 threads), ranges of at least `MIN_TOKEN_RANGE` tokens so that there
/// are about two tasks a thread. Each (row, token) output is still computed whole by one
/// tile, so the cut changes no result.
fn tokens_per_task(m: usize, np: usize, granule: usize, threads: usize) -> usize {
    if m > TOKEN_CHUNK {
        return TOKEN_CHUNK;
    }
    let panel_tasks = (np / granule.max(1)).max(1);
    if panel_tasks >= 2 * threads {
        return m;
    }
    let ranges = (2 * threads)
        .div_ceil(panel_tasks)
        .min(m / MIN_TOKEN_RANGE)
        .max(1);
    m.div_ceil(ranges)
}

/// Tokens per task of an `m`-token product on the `amx` level's tiles: whole groups of
/// 16, and for prefills as long a range as keeps about two tasks a thread (up to
/// `TILE_TOKEN_CHUNK`), since every task unpacks its panels' weights for the tiles
/// anew. `tokens` is what [`tokens_per_task`] chose.
fn tile_tokens_per_task(
    m: usize,
    np: usize,
    granule: usize,
    threads: usize,
    tokens: usize,
) -> usize {
    let tokens = tokens.next_multiple_of(act::TILE_TOKENS);
    let panel_tasks = (np / granule.max(1)).max(1);
    let mut longer = tokens;
    while longer < TILE_TOKEN_CHUNK
        && longer < m
        && panel_tasks * m.div_ceil(2 * longer) >= 2 * threads
    {
        longer *= 2;
    }
    longer.max(tokens)
}

/// A chunk of a product's panels: `(part index, (first panel, end panel))`.
type PanelChunk = (usize, (usize, usize));

/// Cuts the parts' panel ranges into chunks of `per` panels (the last of a part shorter):
/// `(part index, (first panel, end panel))` in order.
fn even_chunks(parts: &[Part], per: usize) -> Vec<PanelChunk> {
    let per = per.max(1);
    let even = parts.iter().enumerate().flat_map(|(i, part)| {
        let (first, end) = part.panels;
        (first..end)
            .step_by(per)
            .map(move |p0| (i, (p0, (p0 + per).min(end))))
    });
    even.collect()
}

/// Cuts the parts' panel ranges (`(first, end)` each) into one contiguous share of
/// panels a thread (about the same number each, whole granules; `share::run_split`'s
/// shares), and each share into chunks claimed in order, of decreasing size: each chunk
/// holds about a quarter of its share's panels still unassigned, between `granule` and
/// `most` panels (rounded up to whole granules, cut at the end of its part). A thread
/// works through its own share's large chunks first; the last ones are a register tile
/// wide, so a thread that finishes early and takes chunks from another's share, or the
/// thread that finishes last, waits for at most one small chunk. Returns the chunks as
/// `(part index, (first panel, end panel))` in claim order, and the index of each
/// share's first chunk.
fn guided_chunks(
    parts: &[(usize, usize)],
    granule: usize,
    most: usize,
    threads: usize,
) -> (Vec<PanelChunk>, Vec<usize>) {
    let (granule, threads) = (granule.max(1), threads.max(1));
    let most = most.max(granule);
    let total: usize = parts.iter().map(|&(a, b)| b - a).sum();
    let granules = total.div_ceil(granule);
    let mut panels = parts
        .iter()
        .enumerate()
        .filter(|(_, &(a, b))| a < b)
        .map(|(i, &(a, b))| (i, a, b))
        .peekable();
    let mut chunks = Vec::new();
    let mut starts = Vec::with_capacity(threads);
    for share in 0..threads {
        starts.push(chunks.len());
        let share_granules = (share + 1) * granules / threads - share * granules / threads;
        let mut left = share_granules * granule;
        while left > 0 {
            let Some((i, p, end)) = panels.peek_mut() else {
                break;
            };
            let want = left.div_ceil(4).div_ceil(granule) * granule;
            // Whole granules from the part's start, as the tiles need, though the share
            // may end up to a granule long.
            let size = want.clamp(granule, most).min(*end - *p);
            chunks.push((*i, (*p, *p + size)));
            *p += size;
            left = left.saturating_sub(size);
            if p == end {
                panels.next();
            }
        }
    }
    (chunks, starts)
}

/// Panels in each chunk of a single-token product of `np` panels on `threads` threads:
/// about four chunks a thread (at least 16), so that many threads all get some, each of
/// whole register tiles (`granule` panels). A single token's quantized tiles are one
/// panel wide, so SmolLM2's 576 x 576 matrix makes 18 chunks of 2 panels for 2 threads
/// and 36 of 1 for 16 (9 of 4 at any count while the chunks were whole 4-panel tiles:
/// 7 of 16 threads idle).
fn single_token_chunk_panels(np: usize, granule: usize, threads: usize) -> usize {
    let granule = granule.max(1);
    let chunks = (4 * threads).max(16);
    (np / chunks).clamp(granule, 64).next_multiple_of(granule)
}

/// Below this many multiply-adds a batched `matmul` runs on the calling thread. Measured
/// with rayon's fork-join on a loaded 2-core machine: threshold 2^18 -> 6.5 ms per SmolLM2
/// decode pass of matmuls, 3M -> 4.4 ms. With the helpers' cheaper entry, 2^17 measured
/// no faster at batch 4 and 32 (2-core Zen 4), so the threshold stayed.
const SERIAL_MACS: usize = 1 << 21;
/// From this many multiply-adds a single-token product is shared with the helper threads
/// (`share`): the caller keeps computing instead of parking, so only a helper's chunk
/// claims are at stake. Smaller ones (SmolLM2's 192 x 576 key and value matrices, about
/// a microsecond) stay on the calling thread.
const SHARE_MACS: usize = 1 << 17;
/// Tokens per task for large batches (whole groups of the `amx` level's tiles).
const TOKEN_CHUNK: usize = 64;
/// Most tokens per task at the `amx` level (`tile_tokens_per_task`). Products of
/// SmolLM2's shapes at 512 tokens, against 64: 1.00-1.06x on one thread, 1.02-1.16x on two
/// (2-core Xeon with AMX, the tile kernel's unpacking shared by four times the tokens).
const TILE_TOKEN_CHUNK: usize = 256;
/// Fewest tokens of a product at the `amx` level: smaller batches run at `avx512`. Each
/// task unpacks its panels' weights for the tiles once; at 16 tokens that left `Q4_1`
/// products 10-20% slower than `avx512`, at 32 1.0-1.4x faster (SmolLM2's shapes, one
/// thread, 2-core Xeon with AMX).
const AMX_MIN_TOKENS: usize = 32;
/// Fewest tokens per task when a batch's tokens are cut for threads that its panels
/// alone cannot keep busy.
const MIN_TOKEN_RANGE: usize = 4;
/// Target repacked weight bytes per task (stays in L2 while the task's tokens stream).
const TASK_WEIGHT_BYTES: usize = 256 * 1024;

impl PackedMatrix {
    /// Repacks a weight matrix from its raw GGUF bytes (`n` rows of
    /// `k / ty.block_values()` blocks).
    ///
    /// Errors when `k` is not a positive multiple of the type's block size, `n == 0`, or
    /// `bytes` does not hold exactly `n · k / ty.block_values()` blocks.
    pub fn from_gguf_bytes(
        ty: QuantType,
        bytes: &[u8],
        n: usize,
        k: usize,
    ) -> Result<Self, QuantError> {
        let bv = ty.block_values();
        if k == 0 || !k.is_multiple_of(bv) {
            return Err(QuantError::BadCols { k, block: bv, ty });
        }
        if n == 0 {
            return Err(QuantError::NoRows);
        }
        let nb = k / BLOCK;
        let ng = k / bv;
        let bb = ty.block_bytes();
        let expected = n
            .checked_mul(ng)
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
        if ty.is_dense() {
            return Self::pack_dense(ty, bytes, n, k);
        }
        let unit = ty.scale_unit();
        let qbp = ty.packed_quant_bytes();
        let sbp = ty.packed_scale_bytes();
        let overflow = QuantError::Overflow { n, k };
        let q_len = (np * nb).checked_mul(qbp).ok_or(overflow.clone())?;
        let s_len = (np * ng).checked_mul(sbp).ok_or(overflow)?;
        let mut quants = AlignedBuf::zeroed(q_len);
        let mut scales = AlignedBuf::zeroed(s_len);
        {
            let pack_panel = |(p, (qp, sp)): (usize, (&mut [u8], &mut [u8]))| {
                for r in 0..PANEL {
                    let row = p * PANEL + r;
                    if row >= n {
                        break; // padding rows keep zero scales: they compute 0 and are never stored
                    }
                    for g in 0..ng {
                        let src = &bytes[(row * ng + g) * bb..(row * ng + g + 1) * bb];
                        let q = &mut qp[g * unit * qbp..(g + 1) * unit * qbp];
                        let s = &mut sp[g * sbp..(g + 1) * sbp];
                        format::pack_gguf_block(ty, src, q, s, r);
                    }
                }
            };
            let qs_out = quants.as_mut_slice();
            let sc_out = scales.as_mut_slice();
            if expected >= 1 << 20 {
                qs_out
                    .par_chunks_mut(nb * qbp)
                    .zip(sc_out.par_chunks_mut(ng * sbp))
                    .enumerate()
                    .for_each(pack_panel);
            } else {
                qs_out
                    .chunks_mut(nb * qbp)
                    .zip(sc_out.chunks_mut(ng * sbp))
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

    /// The dense layout (see `dense`): panels of 16 rows, k-major (BF16: column pairs).
    fn pack_dense(ty: QuantType, bytes: &[u8], n: usize, k: usize) -> Result<Self, QuantError> {
        let np = n.div_ceil(PANEL);
        let row_bytes = k * dense::elem_bytes(ty);
        let panel_bytes = dense::panel_bytes(ty, k);
        let len = np
            .checked_mul(panel_bytes)
            .ok_or(QuantError::Overflow { n, k })?;
        let mut quants = AlignedBuf::zeroed(len);
        let pack_panel = |(p, panel): (usize, &mut [u8])| {
            for r in 0..PANEL.min(n - p * PANEL) {
                let row = p * PANEL + r;
                dense::pack_row(ty, &bytes[row * row_bytes..][..row_bytes], panel, r, k);
            }
        };
        if len >= 1 << 20 {
            quants
                .as_mut_slice()
                .par_chunks_mut(panel_bytes)
                .enumerate()
                .for_each(pack_panel);
        } else {
            quants
                .as_mut_slice()
                .chunks_mut(panel_bytes)
                .enumerate()
                .for_each(pack_panel);
        }
        Ok(PackedMatrix {
            ty,
            n,
            k,
            nb: 0,
            np,
            quants,
            scales: AlignedBuf::zeroed(0),
        })
    }

    /// Quant bytes of one panel.
    fn panel_quant_bytes(&self) -> usize {
        if self.ty.is_dense() {
            dense::panel_bytes(self.ty, self.k)
        } else {
            self.nb * self.ty.packed_quant_bytes()
        }
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

    /// `dst[m, n] = x[m, k] · Wᵀ` (row-major f32), multi-threaded, at the level in effect
    /// ([`active_kernel`]).
    pub fn matmul(&self, x: &[f32], m: usize, dst: &mut [f32]) -> Result<(), QuantError> {
        self.matmul_with(active_kernel(), x, m, dst)
    }

    /// [`matmul`](Self::matmul) at an explicit level, capped at what the CPU has (every
    /// level gives the same results, bit for bit).
    pub fn matmul_with(
        &self,
        kernel: Kernel,
        x: &[f32],
        m: usize,
        dst: &mut [f32],
    ) -> Result<(), QuantError> {
        self.check_input(x, m)?;
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
        let whole = Part {
            dst: Dst {
                ptr: dst.as_mut_ptr(),
                ldo: self.n,
                row0: 0,
            },
            panels: (0, self.np),
        };
        // SAFETY: `dst` holds m x n values.
        unsafe { self.product(kernel, x, m, &[whole]) };
        Ok(())
    }

    /// The product split by output rows: `widths` (summing to the rows) give one
    /// `[m, width]` buffer each, as [`matmul`](Self::matmul)'s columns would, bit for bit.
    /// A stacked q/k/v or gate/up matrix fills its outputs directly when the widths are
    /// whole panels (16 rows), with no copy and no zeroing of the outputs first.
    pub fn matmul_parts(
        &self,
        x: &[f32],
        m: usize,
        widths: &[usize],
    ) -> Result<Vec<Vec<f32>>, QuantError> {
        self.check_input(x, m)?;
        let total = widths.iter().try_fold(0usize, |a, &w| a.checked_add(w));
        if total != Some(self.n) || widths.contains(&0) {
            return Err(QuantError::Widths {
                widths: widths.to_vec(),
                rows: self.n,
            });
        }
        let overflow = QuantError::Overflow { n: m, k: self.n };
        m.checked_mul(self.n).ok_or(overflow)?;
        let aligned = widths[..widths.len() - 1]
            .iter()
            .all(|w| w.is_multiple_of(PANEL));
        if !aligned {
            let mut whole = vec![0f32; m * self.n];
            self.matmul(x, m, &mut whole)?;
            return Ok(split_columns(&whole, widths));
        }
        // A large output (a scoring step's logits) in the buffer the last one gave back.
        let mut outputs: Vec<Vec<f32>> = widths.iter().map(|w| spare::take(m * w)).collect();
        let mut parts = Vec::with_capacity(widths.len());
        let mut row0 = 0;
        for (out, &w) in outputs.iter_mut().zip(widths) {
            parts.push(Part {
                dst: Dst {
                    ptr: out.as_mut_ptr(),
                    ldo: w,
                    row0,
                },
                panels: (row0 / PANEL, (row0 + w).div_ceil(PANEL)),
            });
            row0 += w;
        }
        // SAFETY: each output has room for m x width values; the parts' panels cover
        // every panel once (the widths are whole panels but the last).
        unsafe { self.product(active_kernel(), x, m, &parts) };
        for (out, &w) in outputs.iter_mut().zip(widths) {
            // SAFETY: the product wrote every (token, row) of every part: each panel's
            // existing rows are stored for every token (the padding of the last panel
            // lies past the last part's rows and is never stored).
            unsafe { out.set_len(m * w) };
        }
        Ok(outputs)
    }

    fn check_input(&self, x: &[f32], m: usize) -> Result<(), QuantError> {
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
        Ok(())
    }

    /// Computes the parts' panels for every token: single-token products on the shared
    /// helpers, larger ones as (panel range x token range) tasks on them, small ones on
    /// the calling thread.
    ///
    /// # Safety
    /// Each part's `dst` has room for every token's rows of its panels; parts' panel
    /// ranges do not overlap; the panel ranges lie within the matrix.
    unsafe fn product(&self, kernel: Kernel, x: &[f32], m: usize, parts: &[Part]) {
        let kernel = match kernel.capped().for_type(self.ty) {
            // Few tokens would leave most of a tile's rows empty: vectors do them.
            Kernel::Amx if m < AMX_MIN_TOKENS => Kernel::Avx512,
            level => level,
        };
        if m == 0 {
            return;
        }
        let macs = m * self.n * self.k;
        let threads = share::threads();
        let shared = m == 1 && macs >= SHARE_MACS && threads > 1;
        let parallel = !shared && macs >= SERIAL_MACS && threads > 1;
        let input = match kernel {
            // `for_type` above: only BF16 matrices run at these levels.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 => Input::Bf16Pairs(x86::bf16dot::round_pairs(x, m, self.k)),
            #[cfg(target_arch = "x86_64")]
            Kernel::AmxBf16 => Input::Bf16Pairs(x86::amx_bf16::round_tiles(x, m, self.k)),
            _ if self.ty.is_dense() => Input::Dense(x),
            _ => Input::Quantized(QuantAct::quantize(kernel, x, m, self.k, parallel)),
        };
        let act = &input;
        if !shared && !parallel {
            for part in parts {
                // SAFETY: the caller's contract; this thread is the only writer.
                unsafe { self.run_tile(kernel, act, part.panels, (0, m), part.dst) };
            }
            input.recycle();
            return;
        }
        // Where each thread's share of the tasks starts, when not at even counts.
        let mut share_starts = Vec::new();
        let (chunks, tokens_per_task) = if shared {
            let granule = self.single_token_tile_panels(kernel);
            let per = single_token_chunk_panels(self.np, granule, threads);
            (even_chunks(parts, per), 1)
        } else {
            let split = self.split(kernel, m);
            let chunks = if split.tokens_per_task >= m {
                // One token range (decode batches): the chunks' sizes are all there is
                // to balance the threads' last tasks.
                let panels: Vec<(usize, usize)> = parts.iter().map(|p| p.panels).collect();
                let (chunks, starts) =
                    guided_chunks(&panels, split.granule, split.panels_per_task, threads);
                share_starts = starts;
                chunks
            } else {
                // Many token ranges (prefills): each chunk is many tasks already.
                even_chunks(parts, split.panels_per_task)
            };
            (chunks, split.tokens_per_task)
        };
        // Panel chunk outer, token chunk inner: neighbouring tasks share weights.
        let token_tasks = m.div_ceil(tokens_per_task);
        let mut tasks = Vec::with_capacity(chunks.len() * token_tasks);
        for (i, panels) in chunks {
            tasks.extend((0..token_tasks).map(|ti| {
                let t0 = ti * tokens_per_task;
                (i, panels, (t0, (t0 + tokens_per_task).min(m)))
            }));
        }
        // One token range when the shares were cut: a task is a chunk.
        share::run_split(tasks.len(), &share_starts, &|task| {
            let (part, panels, tokens) = tasks[task];
            // SAFETY: tasks write disjoint (token, row) rectangles of the parts.
            unsafe { self.run_tile(kernel, act, panels, tokens, parts[part].dst) };
        });
        input.recycle();
    }

    /// Panels of this matrix's register tile for a single token at `kernel`.
    fn single_token_tile_panels(&self, kernel: Kernel) -> usize {
        match kernel {
            Kernel::Scalar => 1,
            // Its tiles take two panels at a time.
            #[cfg(target_arch = "x86_64")]
            Kernel::AmxBf16 => 2,
            #[cfg(target_arch = "x86_64")]
            level => x86::single_token_tile_panels(level, self),
            #[cfg(not(target_arch = "x86_64"))]
            _ => 1,
        }
    }

    /// The portable scalar path (same results as [`matmul`](Self::matmul), bit for bit).
    pub fn matmul_scalar(&self, x: &[f32], m: usize, dst: &mut [f32]) -> Result<(), QuantError> {
        self.matmul_with(Kernel::Scalar, x, m, dst)
    }

    fn split(&self, kernel: Kernel, m: usize) -> Split {
        let threads = share::threads();
        let granule = if m <= 2 { 4 } else { 2 };
        let mut tokens_per_task = tokens_per_task(m, self.np, granule, threads);
        match kernel {
            Kernel::Amx => {
                tokens_per_task =
                    tile_tokens_per_task(m, self.np, granule, threads, tokens_per_task)
            }
            // Token ranges start at the activation tiles' groups.
            Kernel::AmxBf16 => tokens_per_task = tokens_per_task.next_multiple_of(act::TILE_TOKENS),
            _ => {}
        }
        let token_tasks = m.div_ceil(tokens_per_task);
        // Enough tasks for load balancing on a shared machine...
        let want_tasks = 4 * threads;
        let panel_tasks = want_tasks.div_ceil(token_tasks).max(1);
        let mut ppt = self.np.div_ceil(panel_tasks);
        // ...and a weight slice per task that stays in L2.
        let bp_bytes = self.panel_quant_bytes()
            + self.nb / self.ty.scale_unit() * self.ty.packed_scale_bytes();
        let cap = (TASK_WEIGHT_BYTES / bp_bytes).max(granule);
        ppt = ppt.min(cap).max(1);
        ppt = ppt.div_ceil(granule) * granule;
        Split {
            panels_per_task: ppt,
            tokens_per_task,
            granule,
        }
    }

    /// Computes the outputs of panels `p0..p1` for tokens `t0..t1` into `dst`.
    ///
    /// # Safety
    /// `dst` holds rows `p0·16..` of every token in `t0..t1`; no other thread writes this
    /// rectangle.
    unsafe fn run_tile(
        &self,
        kernel: Kernel,
        input: &Input,
        (p0, p1): (usize, usize),
        (t0, t1): (usize, usize),
        dst: Dst,
    ) {
        match (kernel, input) {
            (Kernel::Scalar, Input::Quantized(act)) => {
                scalar::run_tile(self, act, p0, p1, t0, t1, dst)
            }
            (Kernel::Scalar, Input::Dense(x)) => {
                dense::run_tile_scalar(self, x, p0, p1, t0, t1, dst)
            }
            #[cfg(target_arch = "x86_64")]
            (Kernel::Amx, Input::Quantized(act)) => {
                x86::amx::run_tile(self, act, p0, p1, t0, t1, dst)
            }
            #[cfg(target_arch = "x86_64")]
            (_, Input::Quantized(act)) => x86::run_tile(kernel, self, act, p0, p1, t0, t1, dst),
            #[cfg(target_arch = "x86_64")]
            (_, Input::Dense(x)) => {
                let ldx = self.k * 4;
                x86::dense::run_tile(kernel, self, x.as_ptr().cast(), ldx, p0, p1, t0, t1, dst)
            }
            #[cfg(target_arch = "x86_64")]
            (Kernel::AmxBf16, Input::Bf16Pairs(x)) => {
                x86::amx_bf16::run_tile(self, x.as_ptr().cast(), p0, p1, t0, t1, dst)
            }
            #[cfg(target_arch = "x86_64")]
            (_, Input::Bf16Pairs(x)) => {
                let ldx = self.k.next_multiple_of(2) * 2;
                x86::dense::run_tile(kernel, self, x.as_ptr().cast(), ldx, p0, p1, t0, t1, dst)
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!("{kernel} is an x86-64 level"),
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
        let ty = self.ty;
        if ty.is_dense() {
            let panel = &self.quants.as_slice()[p * self.panel_quant_bytes()..];
            for (i, o) in out.iter_mut().enumerate() {
                *o = dense::value_at(ty, panel, dense::offset(ty, lane, i));
            }
            return Ok(());
        }
        let (qbp, sbp, unit) = (
            ty.packed_quant_bytes(),
            ty.packed_scale_bytes(),
            ty.scale_unit(),
        );
        let qs = self.quants.as_slice();
        let sc = self.scales.as_slice();
        let srecs = self.nb / unit;
        for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
            let q = &qs[(p * self.nb + b) * qbp..][..qbp];
            let s = &sc[(p * srecs + b / unit) * sbp..][..sbp];
            let u = format::decode_quants(ty, q, lane);
            let scales = format::decode_scales(ty, s, lane, b % unit);
            format::dequantize_block(ty, &u, scales, o);
        }
        Ok(())
    }

    pub(crate) fn quant_ptr(&self, p: usize) -> *const u8 {
        // SAFETY (callers): p <= np, so the offset is at most one past the end.
        unsafe { self.quants.as_ptr().add(p * self.panel_quant_bytes()) }
    }

    pub(crate) fn scale_ptr(&self, p: usize) -> *const u8 {
        unsafe {
            self.scales
                .as_ptr()
                .add(p * self.nb / self.ty.scale_unit() * self.ty.packed_scale_bytes())
        }
    }

    /// Rows of panel `p` that exist (the rest are padding).
    pub(crate) fn valid_rows(&self, p: usize) -> usize {
        (self.n - p * PANEL).min(PANEL)
    }
}

/// The activations as the kernels take them: quantized, f32 for the dense types, or
/// rounded to bf16 pairs for BF16 weights at the BF16 levels.
enum Input<'a> {
    Quantized(QuantAct),
    Dense(&'a [f32]),
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Bf16Pairs(Vec<half::bf16>),
}

impl Input<'_> {
    /// Keeps quantized activations' buffers for this thread's next product.
    fn recycle(self) {
        if let Input::Quantized(act) = self {
            act.recycle();
        }
    }
}

/// Where a product's outputs go: the value of token `t` and output row `r` at
/// `ptr + t·ldo + (r − row0)`, for the rows of one part (a whole matrix, or one of the
/// matrices a stacked product holds).
#[derive(Clone, Copy)]
pub(crate) struct Dst {
    pub ptr: *mut f32,
    pub ldo: usize,
    pub row0: usize,
}

impl Dst {
    /// Where token `t`'s output row `row` goes.
    ///
    /// # Safety
    /// `row` is one of this part's rows and `t` one of the product's tokens.
    #[inline(always)]
    pub(crate) unsafe fn at(self, t: usize, row: usize) -> *mut f32 {
        unsafe { self.ptr.add(t * self.ldo + row - self.row0) }
    }
}

// SAFETY: only used to hand disjoint output rectangles to the product's threads.
unsafe impl Send for Dst {}
unsafe impl Sync for Dst {}

/// One output buffer of a product and the panels whose rows it holds.
#[derive(Clone, Copy)]
struct Part {
    dst: Dst,
    panels: (usize, usize),
}

/// `[m, Σ widths]` row-major → one `[m, width]` buffer per width, in order.
pub fn split_columns(whole: &[f32], widths: &[usize]) -> Vec<Vec<f32>> {
    let total: usize = widths.iter().sum();
    let rows = whole.len() / total.max(1);
    let mut parts: Vec<Vec<f32>> = widths
        .iter()
        .map(|w| Vec::with_capacity(rows * w))
        .collect();
    for row in whole.chunks_exact(total) {
        let mut at = 0;
        for (part, &w) in parts.iter_mut().zip(widths) {
            part.extend_from_slice(&row[at..at + w]);
            at += w;
        }
    }
    parts
}

#[cfg(test)]
mod tests {
    use super::{
        guided_chunks, single_token_chunk_panels, tile_tokens_per_task, tokens_per_task,
        MIN_TOKEN_RANGE, TILE_TOKEN_CHUNK, TOKEN_CHUNK,
    };

    /// A single-token product gives every thread a chunk wherever its whole tiles allow,
    /// and each chunk is whole tiles of at most 64 panels.
    #[test]
    fn single_token_chunks_reach_every_thread_the_tiles_allow() {
        // SmolLM2's 576 x 576 matrix (36 panels) on quantized one-panel tiles.
        assert_eq!(single_token_chunk_panels(36, 1, 2), 2);
        assert_eq!(single_token_chunk_panels(36, 1, 16), 1);
        // A BF16 matrix's four-panel tiles (AVX-512) keep chunks of whole tiles.
        assert_eq!(single_token_chunk_panels(36, 4, 16), 4);
        for granule in [1, 2, 4] {
            for threads in [1, 2, 3, 8, 16, 32, 64] {
                for np in [1, 12, 32, 36, 96, 128, 512, 3072] {
                    let per = single_token_chunk_panels(np, granule, threads);
                    let case = format!("{np} panels, tiles of {granule}, {threads} threads");
                    assert!(
                        per.is_multiple_of(granule) && per <= 64.max(granule),
                        "{case}"
                    );
                    let (chunks, tiles) = (np.div_ceil(per), np.div_ceil(granule));
                    assert!(chunks >= threads.min(tiles), "{chunks} chunks: {case}");
                }
            }
        }
    }

    /// A decode batch's tokens are cut only where its panels make fewer than two tasks a
    /// thread, and never into ranges below `MIN_TOKEN_RANGE`.
    #[test]
    fn tokens_are_cut_only_when_the_panels_cannot_keep_the_threads_busy() {
        // SmolLM2's 576-row matrix (36 panels) at a decode batch of 32 tokens.
        assert_eq!(tokens_per_task(32, 36, 2, 2), 32);
        assert_eq!(tokens_per_task(32, 36, 2, 8), 32);
        assert_eq!(tokens_per_task(32, 36, 2, 16), 16);
        assert_eq!(tokens_per_task(32, 36, 2, 64), 4);
        // A 1B model's 2048-row matrix (128 panels) keeps one token range on 16 threads
        // and is cut in two on 64.
        assert_eq!(tokens_per_task(32, 128, 2, 16), 32);
        assert_eq!(tokens_per_task(32, 128, 2, 64), 16);
        // Never below MIN_TOKEN_RANGE, never above TOKEN_CHUNK.
        assert_eq!(tokens_per_task(6, 2, 2, 64), 6);
        assert_eq!(tokens_per_task(9, 2, 2, 3), 5);
        assert_eq!(tokens_per_task(512, 36, 2, 64), TOKEN_CHUNK);
        for threads in [1, 2, 3, 16, 64] {
            for m in 1..=TOKEN_CHUNK {
                let t = tokens_per_task(m, 36, 2, threads);
                assert!(t >= 1 && t <= m, "{m} tokens, {threads} threads");
                assert!(
                    t == m || t >= MIN_TOKEN_RANGE,
                    "{m} tokens, {threads} threads"
                );
            }
        }
    }

    /// At the `amx` level a prefill's tasks take longer token ranges while the panels
    /// still make about two tasks a thread; ranges stay whole groups of 16 tokens.
    #[test]
    fn tile_tasks_take_long_token_ranges_while_the_threads_stay_busy() {
        let at = |m, np, threads| {
            let tokens = tokens_per_task(m, np, 2, threads);
            tile_tokens_per_task(m, np, 2, threads, tokens)
        };
        // SmolLM2's 1536- and 576-row matrices, a 512-token prefill on 2 threads.
        assert_eq!(at(512, 96, 2), TILE_TOKEN_CHUNK);
        assert_eq!(at(512, 36, 2), TILE_TOKEN_CHUNK);
        // On 64 threads its 36 panels need the short ranges to keep them busy.
        assert_eq!(at(512, 36, 64), TOKEN_CHUNK);
        assert_eq!(at(512, 64, 64), 2 * TOKEN_CHUNK);
        assert_eq!(at(512, 128, 64), TILE_TOKEN_CHUNK);
        // A 100-token chunk of a prompt is one range.
        assert_eq!(at(100, 96, 2), 128);
        for threads in [1, 2, 3, 16, 64] {
            for m in (32..=2048).step_by(7) {
                for np in [1, 2, 36, 96, 512] {
                    let t = at(m, np, threads);
                    let floor = tokens_per_task(m, np, 2, threads).next_multiple_of(16);
                    assert!(
                        t % 16 == 0 && t >= floor,
                        "{m} tokens, {np} panels, {threads}"
                    );
                    assert!(t <= TILE_TOKEN_CHUNK.max(floor), "{m} tokens, {np} panels");
                }
            }
        }
    }

    /// Every panel of every part lands in exactly one chunk of its part, in order; chunks
    /// are whole granules (but at a part's end), at most `most` panels, never growing,
    /// and the last chunk is one granule.
    #[test]
    fn guided_chunks_cover_every_panel_once_and_shrink_in_each_share() {
        type Case = (&'static [(usize, usize)], usize, usize);
        let cases: [Case; 6] = [
            (&[(0, 36), (36, 48), (48, 60)], 2, 48),
            (&[(0, 36)], 2, 6),
            (&[(0, 3072)], 2, 26),
            (&[(0, 96), (96, 192)], 4, 48),
            (&[(0, 1)], 2, 8),
            (&[(0, 7), (7, 8), (8, 21)], 2, 64),
        ];
        for (parts, granule, most) in cases {
            for threads in [1, 2, 3, 16, 64] {
                let (chunks, starts) = guided_chunks(parts, granule, most, threads);
                assert_eq!(starts.len(), threads);
                assert!(starts.windows(2).all(|w| w[0] <= w[1]) && starts[0] == 0);
                // Each share's panels: an even split of the granules.
                let total: usize = parts.iter().map(|&(a, b)| b - a).sum();
                let bounds: Vec<usize> = starts.iter().copied().chain([chunks.len()]).collect();
                let share_panels: Vec<usize> = bounds
                    .windows(2)
                    .map(|w| chunks[w[0]..w[1]].iter().map(|&(_, (a, b))| b - a).sum())
                    .collect();
                assert_eq!(share_panels.iter().sum::<usize>(), total);
                let most_panels = total.div_ceil(granule).div_ceil(threads) * granule;
                let near = most_panels + granule;
                assert!(share_panels.iter().all(|&n| n <= near), "{share_panels:?}");
                for &(i, (a, _)) in &chunks {
                    assert_eq!((a - parts[i].0) % granule, 0, "{parts:?} {threads}");
                }
                let mut expect = parts
                    .iter()
                    .enumerate()
                    .flat_map(|(i, &(a, b))| (a..b).map(move |p| (i, p)));
                for &(i, (a, b)) in &chunks {
                    assert!(a < b && b - a <= most.max(granule), "{parts:?} {threads}");
                    let at_end = b == parts[i].1;
                    assert!(at_end || (b - a) % granule == 0, "{parts:?} {threads}");
                    for p in a..b {
                        assert_eq!(expect.next(), Some((i, p)), "{parts:?} {threads}");
                    }
                }
                assert_eq!(expect.next(), None, "{parts:?} {threads}");
                for w in bounds.windows(2).filter(|w| w[0] < w[1]) {
                    let share = &chunks[w[0]..w[1]];
                    let whole: Vec<usize> = share
                        .iter()
                        .filter(|&&(i, (_, b))| b != parts[i].1)
                        .map(|&(_, (a, b))| b - a)
                        .collect();
                    assert!(
                        whole.windows(2).all(|w| w[0] >= w[1]),
                        "{parts:?} {threads}"
                    );
                    let last = share.last().unwrap().1;
                    assert!(last.1 - last.0 <= granule, "{parts:?} {threads}");
                }
            }
        }
    }
}
