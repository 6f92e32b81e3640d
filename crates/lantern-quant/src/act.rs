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
            // Consecutive blocks of a token lie `stride` apart.
            let stride = layout.index(0, 1, nb) - layout.index(0, 0, nb);
            for t in t0..t1 {
                let i = layout.index(t, 0, nb) - first;
                let blocks = if nb == 0 { 0 } else { (nb - 1) * stride + 1 };
                let mut out = TokenBlocks {
                    q: &mut q[i * BLOCK..(i + blocks) * BLOCK],
                    d: &mut d[i..i + blocks],
                    s: &mut s[i..i + blocks],
                    isum: &mut isum[i..i + blocks],
                    stride,
                };
                if t >= m {
                    // Filling up the last group: nothing, scaled by nothing.
                    for b in 0..nb {
                        out.q(b).fill(0);
                        out.set_scalars(b, 0.0, [0; 2]);
                    }
                    continue;
                }
                quantize_token(kernel, &x[t * k..(t + 1) * k], &mut out);
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

/// Where one token's quantized blocks go: block `b`'s 32 values at `b · stride · 32` in
/// `q`, its scalars at `b · stride` in `d`, `s` and `isum` (see [`QuantAct`]).
pub(crate) struct TokenBlocks<'a> {
    q: &'a mut [u8],
    d: &'a mut [f32],
    s: &'a mut [f32],
    isum: &'a mut [[i32; 2]],
    stride: usize,
}

impl TokenBlocks<'_> {
    /// Block `b`'s values.
    #[inline(always)]
    pub(crate) fn q(&mut self, b: usize) -> &mut [u8] {
        &mut self.q[b * self.stride * BLOCK..][..BLOCK]
    }

    /// Block `b`'s scale `d` and `[Σ q, Σ q over its first 16 values]`; `s = d · Σ q`.
    #[inline(always)]
    pub(crate) fn set_scalars(&mut self, b: usize, d: f32, isum: [i32; 2]) {
        let i = b * self.stride;
        (self.d[i], self.s[i], self.isum[i]) = (d, d * isum[0] as f32, isum);
    }
}

/// Quantizes one token (`x`: whole blocks) into `out` at `kernel`'s vector level.
fn quantize_token(kernel: Kernel, x: &[f32], out: &mut TokenBlocks<'_>) {
    match kernel.vectors() {
        // SAFETY: the SIMD levels are only used once the CPU features were detected.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { crate::x86::avx512::quantize_token(x, out) },
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 | Kernel::AvxVnni => unsafe { crate::x86::avx2::quantize_token(x, out) },
        _ => {
            for (b, xb) in x.chunks_exact(BLOCK).enumerate() {
                let q: &mut [u8; BLOCK] = out.q(b).try_into().unwrap();
                let (d, sum) = quantize_block_scalar(xb.try_into().unwrap(), q);
                let first_half = q[..16].iter().map(|&v| v as i8 as i32).sum();
                out.set_scalars(b, d, [sum, first_half]);
            }
        }
    }
}

/// The block scale and its inverse: `d = amax / 127`, `id = 1 / d` (0 for an all-zero
/// block).
#[inline]
fn block_scale(amax: f32) -> (f32, f32) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every level quantizes every block to the bytes and scalars of the scalar
    /// definition, in its layout, and the sums are those of the bytes: fresh random
    /// tokens with blocks of zeros, of one value, of ties at half a step, and of widely
    /// different magnitudes; token counts on and off the tile groups, rows of blocks on
    /// and off the vector kernels' groups of 8 and 16 blocks.
    #[test]
    fn every_level_quantizes_as_the_scalar_definition() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for (m, nb) in [(1, 1), (3, 7), (17, 18), (5, 33), (16, 48)] {
            let k = nb * BLOCK;
            let x: Vec<f32> = (0..m * nb)
                .flat_map(|_| {
                    let kind = rng.gen_range(0..6);
                    let scale = 10f32.powi(rng.gen_range(-6..4));
                    let v = rng.gen_range(-1.0f32..1.0);
                    (0..BLOCK)
                        .map(|j| match kind {
                            0 => 0.0,
                            1 => v * scale,
                            // Multiples of half a step of a block whose largest is 127.
                            2 if j == 0 => 127.0,
                            2 => rng.gen_range(-254i32..=254) as f32 * 0.5,
                            _ => rng.gen_range(-1.0f32..1.0) * scale,
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            let levels = Kernel::ALL
                .into_iter()
                .filter(|l| l.available() && l.is_exact());
            for level in levels {
                let act = QuantAct::quantize(level, &x, m, k, false);
                for t in 0..m {
                    for b in 0..nb {
                        let xb: &[f32; BLOCK] = x[t * k + b * BLOCK..][..BLOCK].try_into().unwrap();
                        let mut want = [0u8; BLOCK];
                        let (d, sum) = quantize_block_scalar(xb, &mut want);
                        let i = act.layout.index(t, b, nb);
                        let got = &act.q.as_slice()[i * BLOCK..][..BLOCK];
                        let at = format!("{level} seed {seed} m {m} nb {nb} token {t} block {b}");
                        assert_eq!(got, want, "{at}");
                        assert_eq!(act.d[i].to_bits(), d.to_bits(), "{at}");
                        assert_eq!(act.s[i].to_bits(), (d * sum as f32).to_bits(), "{at}");
                        let byte_sum = |q: &[u8]| q.iter().map(|&v| v as i8 as i32).sum::<i32>();
                        assert_eq!(
                            act.isum[i],
                            [byte_sum(&want), byte_sum(&want[..16])],
                            "{at}"
                        );
                    }
                }
                act.recycle();
            }
        }
    }
}
