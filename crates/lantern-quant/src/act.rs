//! Activation quantization (per 32-value block, to int8, like ggml's `Q8_1`).

use crate::share::{self, SharedMut};
use crate::{AlignedBuf, Kernel, BLOCK};

/// Quantized activations of `m` tokens, per (token, block): 32 int8 values at
/// `index · 32` in `q`, and the block's scalars at `index` in `d`, `s` and `isum`, where
/// [`Layout::index`] places the blocks. The vectors may be longer (a thread's buffers
/// are reused): what follows the `m` tokens is left from an earlier product and never
/// read.
pub(crate) struct QuantAct {
    pub layout: Layout,
    /// int8 values, 32 per block, in natural k order.
    pub q: AlignedBuf,
    /// Block scale `d_a = amax / 127`.
    pub d: Vec<f32>,
    /// `d_a · Σ q_a` (for the `m_w` term of the types with a minimum).
    pub s: Vec<f32>,
    /// `[Σ q_a, Σ q_a over the first 16 values]`: the offsets' corrections are exact
    /// integer multiples of these.
    pub isum: Vec<[i32; 2]>,
}

/// How the blocks of the tokens lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Layout {
    /// Token after token: token `t`'s block `b` at `t · nb + b` (the vector kernels).
    Tokens,
    /// Groups of [`TILE_TOKENS`] tokens, block after block, the group's 16 tokens
    /// together: token `t`'s block `b` at `((t / 16) · nb + b) · 16 + t % 16`, so that
    /// one block of a group is one 512-byte activation tile and its 16 scales are
    /// contiguous (the `amx` level). The tokens that fill up the last group are zeros.
    Tiles,
}

/// Tokens of a group of the [`Layout::Tiles`] layout.
pub(crate) const TILE_TOKENS: usize = 16;

impl Layout {
    /// Where token `t`'s block `b` lies, for rows of `nb` blocks.
    #[inline(always)]
    pub(crate) fn index(self, t: usize, b: usize, nb: usize) -> usize {
        match self {
            Layout::Tokens => t * nb + b,
            Layout::Tiles => ((t / TILE_TOKENS) * nb + b) * TILE_TOKENS + t % TILE_TOKENS,
        }
    }

    /// Tokens the layout holds for `m`: whole groups for [`Layout::Tiles`].
    fn tokens(self, m: usize) -> usize {
        match self {
            Layout::Tokens => m,
            Layout::Tiles => m.next_multiple_of(TILE_TOKENS),
        }
    }
}

/// Values per chunk of a parallel quantization: about 4 us of work, small enough that a
/// decode batch's few tokens (32 x 576 values) still make several chunks.
const CHUNK_VALUES: usize = 1 << 12;

impl QuantAct {
    /// Quantizes `m` tokens of `k` values (`x`, token after token) at `kernel`'s vector
    /// level, in the layout its matrix kernels read.
    pub(crate) fn quantize(kernel: Kernel, x: &[f32], m: usize, k: usize, parallel: bool) -> Self {
        let nb = k / BLOCK;
        let layout = if kernel == Kernel::Amx {
            Layout::Tiles
        } else {
            Layout::Tokens
        };
        let held = layout.tokens(m);
        let mut act = SPARE.with(|spare| spare.take()).unwrap_or_default();
        act.layout = layout;
        let QuantAct { q, d, s, isum, .. } = &mut act;
        // Every value of the held tokens is overwritten below, and the kernels read no
        // further: the buffers only ever grow (zeroing what they grow by, once), so a
        // thread's products of every width reuse them as they are.
        q.set_len_to_overwrite(held * k);
        for v in [&mut *d, &mut *s] {
            if v.len() < held * nb {
                v.resize(held * nb, 0.0);
            }
        }
        if isum.len() < held * nb {
            isum.resize(held * nb, [0; 2]);
        }
        let (q, d, s, isum) = (
            SharedMut::new(q.as_mut_slice()),
            SharedMut::new(&mut d[..held * nb]),
            SharedMut::new(&mut s[..held * nb]),
            SharedMut::new(&mut isum[..held * nb]),
        );
        // Tokens t0..t1 (whole groups of the layout) hold the blocks t0·nb..t1·nb.
        let tokens = |t0: usize, t1: usize| {
            let (first, len) = (t0 * nb, (t1 - t0) * nb);
            // SAFETY: callers pass disjoint token ranges, so disjoint block ranges.
            let (q, d, s, isum) = unsafe {
                (
                    q.range(first * BLOCK, len * BLOCK),
                    d.range(first, len),
                    s.range(first, len),
                    isum.range(first, len),
                )
            };
            for t in t0..t1 {
                for b in 0..nb {
                    let i = layout.index(t, b, nb) - first;
                    let qb: &mut [u8; BLOCK] =
                        (&mut q[i * BLOCK..(i + 1) * BLOCK]).try_into().unwrap();
                    if t >= m {
                        // Filling up the last group: nothing, scaled by nothing.
                        qb.fill(0);
                        (d[i], s[i], isum[i]) = (0.0, 0.0, [0; 2]);
                        continue;
                    }
                    let xb: &[f32; BLOCK] = x[t * k + b * BLOCK..][..BLOCK].try_into().unwrap();
                    let (db, sum) = quantize_block(kernel, xb, qb);
                    d[i] = db;
                    s[i] = db * sum as f32;
                    let lo: i32 = qb[..16].iter().map(|&v| v as i8 as i32).sum();
                    isum[i] = [sum, lo];
                }
            }
        };
        let per = layout.tokens(CHUNK_VALUES.div_ceil(k));
        if parallel && held > per {
            // Chunks of whole tokens (whole groups) on the product's threads.
            share::run(held.div_ceil(per), &|c| {
                tokens(c * per, (c * per + per).min(held))
            });
        } else {
            tokens(0, held);
        }
        act
    }
}

thread_local! {
    /// The buffers of this thread's last quantized activations, reused by its next
    /// product: no allocation and no zeroing per product (the engine thread quantizes
    /// ~120 activations per decode step while the helpers wait).
    static SPARE: std::cell::Cell<Option<QuantAct>> = const { std::cell::Cell::new(None) };
}

impl Default for QuantAct {
    fn default() -> Self {
        QuantAct {
            layout: Layout::Tokens,
            q: AlignedBuf::zeroed(0),
            d: Vec::new(),
            s: Vec::new(),
            isum: Vec::new(),
        }
    }
}

impl QuantAct {
    /// Keeps the buffers for this thread's next [`quantize`](Self::quantize) (one spare
    /// a thread: buffers that find it taken are freed).
    pub(crate) fn recycle(self) {
        // `try_with`: nothing to keep once the thread's locals are gone.
        let _ = SPARE.try_with(|spare| match spare.take() {
            None => spare.set(Some(self)),
            kept => spare.set(kept),
        });
    }
}

/// Quantizes one block into `q` (int8 stored as bytes); returns `(d, Σ q)`.
#[inline]
fn quantize_block(kernel: Kernel, x: &[f32; BLOCK], q: &mut [u8; BLOCK]) -> (f32, i32) {
    match kernel.vectors() {
        // SAFETY: the SIMD levels are only used once the CPU features were detected.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { crate::x86::avx512::quantize_block(x, q) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 | Kernel::AvxVnni => unsafe { crate::x86::avx2::quantize_block(x, q) },
        _ => quantize_block_scalar(x, q),
    }
}

/// The block scale and its inverse: `d = amax / 127`, `id = 1 / d` (0 for an all-zero
/// block).
#[inline]
pub(crate) fn block_scale(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    (d, id)
}

/// Portable activation quantization; the SIMD version performs the same operations.
pub(crate) fn quantize_block_scalar(x: &[f32; BLOCK], q: &mut [u8; BLOCK]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let (d, id) = block_scale(amax);
    let mut isum = 0i32;
    for (qj, &xj) in q.iter_mut().zip(x) {
        let v = (xj * id).round_ties_even().clamp(-127.0, 127.0) as i32;
        isum += v;
        *qj = v as i8 as u8;
    }
    (d, isum)
}
