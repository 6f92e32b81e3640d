//! Activation quantization (per 32-value block, to int8, like ggml's `Q8_1`).

use crate::share::{self, SharedMut};
use crate::{AlignedBuf, Kernel, BLOCK};

/// Quantized activations of `m` tokens: token `t`, block `b` lives at index `t · nb + b`.
/// The vectors may be longer (a thread's buffers are reused): what follows the `m` tokens
/// is left from an earlier product and never read.
pub(crate) struct QuantAct {
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

/// One token's input and outputs: ((x, q), d), (s, isum).
type TokenSlices<'a> = (
    ((&'a [f32], &'a mut [u8]), &'a mut [f32]),
    (&'a mut [f32], &'a mut [[i32; 2]]),
);

/// Values per chunk of a parallel quantization: about 4 us of work, small enough that a
/// decode batch's few tokens (32 x 576 values) still make several chunks.
const CHUNK_VALUES: usize = 1 << 12;

impl QuantAct {
    pub(crate) fn quantize(kernel: Kernel, x: &[f32], m: usize, k: usize, parallel: bool) -> Self {
        let nb = k / BLOCK;
        let mut act = SPARE.with(|spare| spare.take()).unwrap_or_default();
        let QuantAct { q, d, s, isum } = &mut act;
        // Every value of the first `m` tokens is overwritten below, and the kernels read
        // no further: the buffers only ever grow (zeroing what they grow by, once), so a
        // thread's products of every width reuse them as they are.
        q.set_len_to_overwrite(m * k);
        for v in [&mut *d, &mut *s] {
            if v.len() < m * nb {
                v.resize(m * nb, 0.0);
            }
        }
        if isum.len() < m * nb {
            isum.resize(m * nb, [0; 2]);
        }
        let (d, s, isum) = (&mut d[..m * nb], &mut s[..m * nb], &mut isum[..m * nb]);
        let one_token = |(((xr, qr), dr), (sr, cr)): TokenSlices<'_>| {
            for b in 0..nb {
                let xb: &[f32; BLOCK] = xr[b * BLOCK..(b + 1) * BLOCK].try_into().unwrap();
                let qb: &mut [u8; BLOCK] =
                    (&mut qr[b * BLOCK..(b + 1) * BLOCK]).try_into().unwrap();
                let (db, sum) = quantize_block(kernel, xb, qb);
                dr[b] = db;
                sr[b] = db * sum as f32;
                let lo: i32 = qb[..16].iter().map(|&v| v as i8 as i32).sum();
                cr[b] = [sum, lo];
            }
        };
        let qs = q.as_mut_slice();
        let per = CHUNK_VALUES.div_ceil(k);
        if parallel && m > per {
            // Chunks of whole tokens on the product's threads.
            let (qs, d, s, isum) = (
                SharedMut::new(qs),
                SharedMut::new(d),
                SharedMut::new(s),
                SharedMut::new(isum),
            );
            share::run(m.div_ceil(per), &|c| {
                for t in c * per..(c * per + per).min(m) {
                    // SAFETY: chunks hold disjoint tokens.
                    let slices = unsafe {
                        (
                            (
                                (&x[t * k..(t + 1) * k], qs.range(t * k, k)),
                                d.range(t * nb, nb),
                            ),
                            (s.range(t * nb, nb), isum.range(t * nb, nb)),
                        )
                    };
                    one_token(slices);
                }
            });
        } else {
            x.chunks(k)
                .zip(qs.chunks_mut(k))
                .zip(d.chunks_mut(nb))
                .zip(s.chunks_mut(nb).zip(isum.chunks_mut(nb)))
                .for_each(one_token);
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
    match kernel {
        // SAFETY: the SIMD levels are only used once the CPU features were detected.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 | Kernel::Avx512Bf16 => unsafe { crate::x86::avx512::quantize_block(x, q) },
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
