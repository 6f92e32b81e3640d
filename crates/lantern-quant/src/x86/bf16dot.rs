//! BF16 weights at the opt-in AVX-512 BF16 level: `vdpbf16ps` multiplies a BF16 pair
//! record (16 rows x 2 columns, see `crate::dense`) by a broadcast pair of activations
//! rounded to bf16 and adds both products to each row's f32 accumulator, twice the
//! multiply-adds per instruction of the exact kernels' widen-and-fma.
//!
//! Per (row, token) the pairs are summed in column order, so tiling, threads and batch
//! composition still change nothing; what differs from the exact levels is the bf16
//! rounding of the activations (`round_pairs`, nearest even, as `half` and PyTorch
//! round) and the instruction's own handling of the two products (Intel specifies two
//! rounded additions and denormals as zero; other makers' rounding may differ).

#![allow(clippy::needless_range_loop)]

use super::dense::{store512, Args};
use half::bf16;
use std::arch::x86_64::*;

/// The activations `x` (`m` tokens of `k`) rounded to bf16, each token padded with a zero
/// to a whole number of pairs: token `t`'s pair `j` is the dword at `(t · ⌈k/2⌉ + j) · 4`
/// bytes.
pub(crate) fn round_pairs(x: &[f32], m: usize, k: usize) -> Vec<bf16> {
    round_padded(x, m, k, k.next_multiple_of(2), m)
}

/// The activations `x` (`m` tokens of `k`) rounded to bf16 (nearest even, as `half` and
/// PyTorch round) into `tokens` rows of `stride` values, zeros around them.
pub(crate) fn round_padded(
    x: &[f32],
    m: usize,
    k: usize,
    stride: usize,
    tokens: usize,
) -> Vec<bf16> {
    debug_assert!(stride >= k && tokens >= m && x.len() == m * k);
    let mut out = vec![bf16::ZERO; tokens * stride];
    for (token, rounded) in x.chunks_exact(k).zip(out.chunks_exact_mut(stride)) {
        crate::convert::f32_to_bf16(token, &mut rounded[..k]);
    }
    out
}

/// Panels per tile and the most tokens per tile: 4 panels at any batch size (16
/// independent chains in a batch; 4 x 6 and 2 x 8 measured no faster, Zen 5).
pub(super) const SHAPE: (usize, usize) = (4, 4);

#[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
unsafe fn tile<const P: usize, const T: usize>(a: Args) {
    let mut acc = [[_mm512_setzero_ps(); T]; P];
    for j in 0..a.k.div_ceil(2) {
        a.prefetch::<P, T>(j * 64);
        let mut w = [_mm512_setzero_si512(); P];
        for p in 0..P {
            w[p] = _mm512_load_si512(a.w.add(p * a.q_panel + j * 64).cast());
        }
        for t in 0..T {
            let pair = a.x.add(t * a.ldx + 4 * j).cast::<i32>().read_unaligned();
            let x: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
            for p in 0..P {
                let wp: __m512bh = std::mem::transmute(w[p]);
                acc[p][t] = _mm512_dpbf16_ps(acc[p][t], wp, x);
            }
        }
    }
    store512(&a, &acc);
}

/// Runs the `pc` x `tc` tile.
///
/// # Safety
/// The CPU supports AVX-512 BF16; `a` describes a tile of a BF16 matrix whose activations
/// are `round_pairs` output.
pub(super) unsafe fn dispatch(pc: usize, tc: usize, a: Args) {
    match (pc, tc) {
        (4, 1) => tile::<4, 1>(a),
        (4, 2) => tile::<4, 2>(a),
        (4, 3) => tile::<4, 3>(a),
        (4, _) => tile::<4, 4>(a),
        (2, 1) => tile::<2, 1>(a),
        (2, 2) => tile::<2, 2>(a),
        (2, 3) => tile::<2, 3>(a),
        (2, _) => tile::<2, 4>(a),
        (_, 1) => tile::<1, 1>(a),
        (_, 2) => tile::<1, 2>(a),
        (_, 3) => tile::<1, 3>(a),
        (_, _) => tile::<1, 4>(a),
    }
}
