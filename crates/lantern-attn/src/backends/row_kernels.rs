//! Kernels over several query rows at once, for the flash backend's items of many rows
//! (prefill tiles). Each does, row by row and key by key, exactly the operations of its
//! one-row counterpart in [`super::kernels`], so it gives the same bits; what changes is
//! how much work one load of a key or value feeds, and whether the lanes of a dot
//! product are summed across a vector (shuffles, per key) or down vectors (plain
//! additions, 16 keys at once).
//!
//! [`dots`](super::kernels::dots) keeps, per key, 16 lane sums (lane `i` adds dimensions
//! `i, i + 16, ...` with fused multiply-adds, in order) and then adds the lanes pairwise
//! by halves. Here a group's keys are first transposed into blocks of 16 keys
//! ([`transpose_keys`]: per dimension, the 16 keys' values side by side), so lane `i` of
//! 16 keys is one vector chain, and the halving additions are additions of whole vectors.
//!
//! The kernels are written for AVX-512 and AVX2 ([`pays`]); their plain versions say the
//! same arithmetic for other CPUs and the tests.

#![allow(clippy::needless_range_loop)]

use lantern_quant::simd::fma as fmadd;

/// Lanes of a dot product's partial sums (as in `kernels::dots`).
pub(crate) const LANES: usize = 16;

/// Keys side by side in a transposed block.
pub(crate) const KEYS: usize = 16;

/// Whether the kernels run vectorized here: at the AVX2 and AVX-512 levels, for head dims
/// of whole 16-lane chunks. Elsewhere the flash kernel takes rows one at a time (these
/// kernels' plain versions, compiled, ran at half the speed of the one-row kernels).
pub(crate) fn pays(d: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && d > 0
        && d.is_multiple_of(LANES)
        && lantern_quant::active_kernel() >= lantern_quant::Kernel::Avx2
}

/// Whether the AVX-512 versions run (else the AVX2 ones, where [`pays`]).
#[cfg(target_arch = "x86_64")]
fn wide() -> bool {
    lantern_quant::active_kernel() >= lantern_quant::Kernel::Avx512
}

/// Floats [`transpose_keys`] writes for `n` keys of `d` dimensions.
pub(crate) fn transposed_len(n: usize, d: usize) -> usize {
    n.div_ceil(KEYS) * KEYS * d
}

/// `keys` (`[n, d]` row-major, `n = keys.len() / d`) into `kt` in blocks of 16 keys:
/// block `b`'s dimension `e` is the 16 floats at `(b · d + e) · 16`, key `b · 16 + j` at
/// `j`; keys past `n` are zeros. `kt` holds [`transposed_len`] floats.
pub(crate) fn transpose_keys(keys: &[f32], d: usize, kt: &mut [f32]) {
    assert!(kt.len() >= transposed_len(keys.len() / d.max(1), d));
    #[cfg(target_arch = "x86_64")]
    if pays(d) {
        // SAFETY: the CPU runs the level's instructions; `kt` is long enough (checked
        // above).
        return unsafe {
            match wide() {
                true => x86::transpose_keys(keys, d, kt),
                false => x86::transpose_keys_avx2(keys, d, kt),
            }
        };
    }
    transpose_keys_portable(keys, d, kt)
}

/// [`transpose_keys`] in plain code.
fn transpose_keys_portable(keys: &[f32], d: usize, kt: &mut [f32]) {
    let n = keys.len() / d.max(1);
    for (b, block) in kt
        .chunks_exact_mut(d * KEYS)
        .enumerate()
        .take(n.div_ceil(KEYS))
    {
        let first = b * KEYS;
        let count = (n - first).min(KEYS);
        for (e, lanes) in block.chunks_exact_mut(KEYS).enumerate() {
            for (j, v) in lanes.iter_mut().enumerate() {
                *v = if j < count {
                    keys[(first + j) * d + e]
                } else {
                    0.0
                };
            }
        }
    }
}

/// `out[r][j] = q[r] . key j` for two query rows over the keys [`transpose_keys`] put in
/// `kt` (`out[r].len()` of them), the same bits as [`super::kernels::dots`] row by row.
/// The head dimension `d` is a multiple of 16 (`dots`' scalar tail is not reproduced).
pub(crate) fn dots_pair(q: [&[f32]; 2], kt: &[f32], d: usize, out: [&mut [f32]; 2]) {
    assert!(
        d.is_multiple_of(LANES) && q.iter().all(|q| q.len() >= d) && out[0].len() == out[1].len()
    );
    assert!(kt.len() >= transposed_len(out[0].len(), d));
    #[cfg(target_arch = "x86_64")]
    if pays(d) {
        // SAFETY: the CPU runs the level's instructions; the lengths are checked above.
        return unsafe {
            match wide() {
                true => x86::dots_pair(q, kt, d, out),
                false => x86::dots_pair_avx2(q, kt, d, out),
            }
        };
    }
    dots_pair_portable(q, kt, d, out)
}

/// [`dots_pair`] in plain code: the arithmetic the AVX-512 kernel does, for other CPUs.
fn dots_pair_portable(q: [&[f32]; 2], kt: &[f32], d: usize, out: [&mut [f32]; 2]) {
    debug_assert!(d.is_multiple_of(LANES) && d > 0);
    let chunks = d / LANES;
    let [out0, out1] = out;
    let n = out0.len();
    for (b, block) in kt.chunks_exact(d * KEYS).enumerate().take(n.div_ceil(KEYS)) {
        // `dots`' halving: X1[i] = X[i] + X[i + 8], X2[i] = X1[i] + X1[i + 4],
        // X3[i] = X2[i] + X2[i + 2], then X3[0] + X3[1]; here X3[h] for h = 0, 1 from the
        // lanes i = h and h + 2, each X2[i] from the four lanes i, i + 4, i + 8, i + 12.
        let mut x3 = [[[0f32; KEYS]; 2]; 2];
        for h in 0..2 {
            let mut x2 = [[[0f32; KEYS]; 2]; 2];
            for (w, i) in [h, h + 2].into_iter().enumerate() {
                // a[r][s]: lane i + 4s of 16 keys for row r.
                let mut a = [[[0f32; KEYS]; 4]; 2];
                for c in 0..chunks {
                    for s in 0..4 {
                        let e = c * LANES + i + 4 * s;
                        let kv = &block[e * KEYS..(e + 1) * KEYS];
                        let (q0, q1) = (q[0][e], q[1][e]);
                        for j in 0..KEYS {
                            a[0][s][j] = fmadd(q0, kv[j], a[0][s][j]);
                            a[1][s][j] = fmadd(q1, kv[j], a[1][s][j]);
                        }
                    }
                }
                for r in 0..2 {
                    for j in 0..KEYS {
                        x2[r][w][j] = (a[r][0][j] + a[r][2][j]) + (a[r][1][j] + a[r][3][j]);
                    }
                }
            }
            for r in 0..2 {
                for j in 0..KEYS {
                    x3[r][h][j] = x2[r][0][j] + x2[r][1][j];
                }
            }
        }
        let first = b * KEYS;
        let count = (n - first).min(KEYS);
        // `dots` adds its (here empty) scalar tail last: `+ 0.0` turns a -0 into +0.
        for j in 0..count {
            out0[first + j] = (x3[0][0][j] + x3[0][1][j]) + 0.0;
            out1[first + j] = (x3[1][0][j] + x3[1][1][j]) + 0.0;
        }
    }
}

/// `acc[r] += sum_j p[r][j] · values[j]` for four rows over the same `p[0].len()` keys
/// (`values` is `[n, d]`), the same bits as [`super::kernels::weighted_sum`] row by row:
/// each element's chain of fused multiply-adds runs over the keys in order; each value
/// vector loaded feeds the four rows (16 independent chains).
pub(crate) fn weighted_sum_quad(acc: [&mut [f32]; 4], p: [&[f32]; 4], values: &[f32], d: usize) {
    let n = p[0].len();
    assert!(p.iter().all(|p| p.len() == n) && acc.iter().all(|a| a.len() == d));
    assert!(values.len() >= n * d);
    #[cfg(target_arch = "x86_64")]
    if wide() {
        // SAFETY: the CPU runs AVX-512; the lengths are checked above.
        return unsafe { x86::weighted_sum_quad(acc, p, values, d) };
    }
    // At AVX2 a row's own four-vector chains (`weighted_sum`) already fill the registers.
    for (acc, p) in acc.into_iter().zip(p) {
        super::kernels::weighted_sum(acc, p, values, d);
    }
}

/// The AVX-512 and AVX2 kernels: the plain versions' operations, in the same order, with
/// every accumulator held in a register (compiled from plain code they were stored to the
/// stack at every key).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{KEYS, LANES};
    use std::arch::x86_64::*;

    /// 16 x 16 blocks transposed in registers: pairs of rows interleaved by floats,
    /// then by pairs of floats, then 128-bit lanes exchanged twice.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose_keys(keys: &[f32], d: usize, kt: &mut [f32]) {
        let n = keys.len() / d;
        for b in 0..n.div_ceil(KEYS) {
            let first = b * KEYS;
            let count = (n - first).min(KEYS);
            for c in 0..d / LANES {
                let mut r = [_mm512_setzero_ps(); 16];
                for (j, row) in r.iter_mut().enumerate().take(count) {
                    *row = _mm512_loadu_ps(keys.as_ptr().add((first + j) * d + c * LANES));
                }
                let cols = transpose16(r);
                let dst = kt.as_mut_ptr().add((b * d + c * LANES) * KEYS);
                for (e, col) in cols.iter().enumerate() {
                    _mm512_storeu_ps(dst.add(e * KEYS), *col);
                }
            }
        }
    }

    /// The 16 columns of the 16 rows `r`.
    #[inline(always)]
    unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
        let (pd, ps) = (_mm512_castps_pd, _mm512_castpd_ps);
        // t[2k], t[2k + 1]: rows 2k and 2k + 1 interleaved (columns 0-1 and 2-3 of
        // each 128-bit lane).
        let mut t = [_mm512_setzero_ps(); 16];
        for k in 0..8 {
            t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
            t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
        }
        // u[4g + m]: rows 4g..4g + 4 of column 4L + m in 128-bit lane L.
        let mut u = [_mm512_setzero_ps(); 16];
        for g in 0..4 {
            let (a, b, c, e) = (t[4 * g], t[4 * g + 2], t[4 * g + 1], t[4 * g + 3]);
            u[4 * g] = ps(_mm512_unpacklo_pd(pd(a), pd(b)));
            u[4 * g + 1] = ps(_mm512_unpackhi_pd(pd(a), pd(b)));
            u[4 * g + 2] = ps(_mm512_unpacklo_pd(pd(c), pd(e)));
            u[4 * g + 3] = ps(_mm512_unpackhi_pd(pd(c), pd(e)));
        }
        // Column 4L + m: lane L of u[m], u[4 + m], u[8 + m], u[12 + m].
        let mut cols = [_mm512_setzero_ps(); 16];
        for m in 0..4 {
            let lo01 = _mm512_shuffle_f32x4::<0x44>(u[m], u[4 + m]);
            let lo23 = _mm512_shuffle_f32x4::<0xEE>(u[m], u[4 + m]);
            let hi01 = _mm512_shuffle_f32x4::<0x44>(u[8 + m], u[12 + m]);
            let hi23 = _mm512_shuffle_f32x4::<0xEE>(u[8 + m], u[12 + m]);
            cols[m] = _mm512_shuffle_f32x4::<0x88>(lo01, hi01);
            cols[4 + m] = _mm512_shuffle_f32x4::<0xDD>(lo01, hi01);
            cols[8 + m] = _mm512_shuffle_f32x4::<0x88>(lo23, hi23);
            cols[12 + m] = _mm512_shuffle_f32x4::<0xDD>(lo23, hi23);
        }
        cols
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dots_pair(q: [&[f32]; 2], kt: &[f32], d: usize, out: [&mut [f32]; 2]) {
        let n = out[0].len();
        let q = [q[0].as_ptr(), q[1].as_ptr()];
        let out = [out[0].as_mut_ptr(), out[1].as_mut_ptr()];
        let block = |b: usize| kt.as_ptr().add(b * d * KEYS);
        let store = |b: usize, r: usize, v: __m512| {
            let first = b * KEYS;
            let mask: __mmask16 = if n - first >= KEYS {
                0xffff
            } else {
                (1u16 << (n - first)) - 1
            };
            _mm512_mask_storeu_ps(out[r].add(first), mask, v);
        };
        let blocks = n.div_ceil(KEYS);
        let mut b = 0;
        // Two blocks at a time: each loaded key vector feeds both rows and each
        // broadcast query value both blocks (one load per multiply-add).
        while b + 2 <= blocks {
            let sums = block_dots::<2>(q, [block(b), block(b + 1)], d);
            for r in 0..2 {
                store(b, r, sums[r][0]);
                store(b + 1, r, sums[r][1]);
            }
            b += 2;
        }
        if b < blocks {
            let sums = block_dots::<1>(q, [block(b)], d);
            for r in 0..2 {
                store(b, r, sums[r][0]);
            }
        }
    }

    /// Two rows' dots with the `B` transposed blocks of 16 keys at `blocks`.
    #[inline(always)]
    unsafe fn block_dots<const B: usize>(
        q: [*const f32; 2],
        blocks: [*const f32; B],
        d: usize,
    ) -> [[__m512; B]; 2] {
        // X3[h] = X2[h] + X2[h + 2] (`dots`' halving, see the module docs), each X2[i]
        // from the four lane chains i, i + 4, i + 8, i + 12. Each X3 is finished before
        // the next begins, so that only two X2s are held (all four spilled registers).
        let mut x3 = [[[_mm512_setzero_ps(); B]; 2]; 2];
        for h in 0..2 {
            let mut x2 = [[[_mm512_setzero_ps(); B]; 2]; 2];
            for (w, i) in [h, h + 2].into_iter().enumerate() {
                let mut a = [[[_mm512_setzero_ps(); 4]; B]; 2];
                for c in 0..d / LANES {
                    for s in 0..4 {
                        let e = c * LANES + i + 4 * s;
                        let kv = blocks.map(|block| _mm512_loadu_ps(block.add(e * KEYS)));
                        for r in 0..2 {
                            let qe = _mm512_set1_ps(*q[r].add(e));
                            for k in 0..B {
                                a[r][k][s] = _mm512_fmadd_ps(qe, kv[k], a[r][k][s]);
                            }
                        }
                    }
                }
                for r in 0..2 {
                    for k in 0..B {
                        let a = a[r][k];
                        x2[w][r][k] =
                            _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
                    }
                }
            }
            for r in 0..2 {
                for k in 0..B {
                    x3[h][r][k] = _mm512_add_ps(x2[0][r][k], x2[1][r][k]);
                }
            }
        }
        // X3[0] + X3[1]; then `dots`' empty scalar tail (+0).
        let mut sums = [[_mm512_setzero_ps(); B]; 2];
        for r in 0..2 {
            for k in 0..B {
                let sum = _mm512_add_ps(x3[0][r][k], x3[1][r][k]);
                sums[r][k] = _mm512_add_ps(sum, _mm512_setzero_ps());
            }
        }
        sums
    }

    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn weighted_sum_quad(
        acc: [&mut [f32]; 4],
        p: [&[f32]; 4],
        values: &[f32],
        d: usize,
    ) {
        let n = p[0].len();
        let acc = acc.map(|a| a.as_mut_ptr());
        let p = p.map(|p| p.as_ptr());
        let v = values.as_ptr();
        let mut start = 0;
        // Four vectors (64 lanes) of each row at a time, then single vectors, then a
        // masked one for the last `d % 16` lanes.
        while start + 4 * LANES <= d {
            let mut r = [[_mm512_setzero_ps(); 4]; 4];
            for t in 0..4 {
                for c in 0..4 {
                    r[t][c] = _mm512_loadu_ps(acc[t].add(start + c * LANES));
                }
            }
            for j in 0..n {
                let row = v.add(j * d + start);
                let x = [0, 1, 2, 3].map(|c| _mm512_loadu_ps(row.add(c * LANES)));
                for t in 0..4 {
                    let pj = _mm512_set1_ps(*p[t].add(j));
                    for c in 0..4 {
                        r[t][c] = _mm512_fmadd_ps(x[c], pj, r[t][c]);
                    }
                }
            }
            for t in 0..4 {
                for c in 0..4 {
                    _mm512_storeu_ps(acc[t].add(start + c * LANES), r[t][c]);
                }
            }
            start += 4 * LANES;
        }
        while start < d {
            let mask: __mmask16 = if d - start >= LANES {
                0xffff
            } else {
                (1u16 << (d - start)) - 1
            };
            let mut r = [_mm512_setzero_ps(); 4];
            for t in 0..4 {
                r[t] = _mm512_maskz_loadu_ps(mask, acc[t].add(start));
            }
            for j in 0..n {
                let x = _mm512_maskz_loadu_ps(mask, v.add(j * d + start));
                for t in 0..4 {
                    r[t] = _mm512_fmadd_ps(x, _mm512_set1_ps(*p[t].add(j)), r[t]);
                }
            }
            for t in 0..4 {
                _mm512_mask_storeu_ps(acc[t].add(start), mask, r[t]);
            }
            start += LANES;
        }
    }

    /// [`transpose_keys`](super::transpose_keys) at AVX2: 8 x 8 blocks (half a block of
    /// 16 keys by 8 dimensions) transposed in registers.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn transpose_keys_avx2(keys: &[f32], d: usize, kt: &mut [f32]) {
        let n = keys.len() / d;
        for b in 0..n.div_ceil(KEYS) {
            for half in 0..2 {
                let first = b * KEYS + half * 8;
                let count = n.saturating_sub(first).min(8);
                for c in 0..d / 8 {
                    let mut r = [_mm256_setzero_ps(); 8];
                    for (j, row) in r.iter_mut().enumerate().take(count) {
                        *row = _mm256_loadu_ps(keys.as_ptr().add((first + j) * d + c * 8));
                    }
                    let cols = transpose8(r);
                    let dst = kt.as_mut_ptr().add((b * d + c * 8) * KEYS + half * 8);
                    for (e, col) in cols.iter().enumerate() {
                        _mm256_storeu_ps(dst.add(e * KEYS), *col);
                    }
                }
            }
        }
    }

    /// The 8 columns of the 8 rows `r`.
    #[inline(always)]
    unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let mut t = [_mm256_setzero_ps(); 8];
        for k in 0..4 {
            t[2 * k] = _mm256_unpacklo_ps(r[2 * k], r[2 * k + 1]);
            t[2 * k + 1] = _mm256_unpackhi_ps(r[2 * k], r[2 * k + 1]);
        }
        // u[4g + m]: rows 4g..4g + 4 of column m (low 128 bits) and m + 4 (high).
        let mut u = [_mm256_setzero_ps(); 8];
        for g in 0..2 {
            let (a, b, c, e) = (t[4 * g], t[4 * g + 2], t[4 * g + 1], t[4 * g + 3]);
            u[4 * g] = _mm256_shuffle_ps::<0x44>(a, b);
            u[4 * g + 1] = _mm256_shuffle_ps::<0xEE>(a, b);
            u[4 * g + 2] = _mm256_shuffle_ps::<0x44>(c, e);
            u[4 * g + 3] = _mm256_shuffle_ps::<0xEE>(c, e);
        }
        let mut cols = [_mm256_setzero_ps(); 8];
        for m in 0..4 {
            cols[m] = _mm256_permute2f128_ps::<0x20>(u[m], u[4 + m]);
            cols[4 + m] = _mm256_permute2f128_ps::<0x31>(u[m], u[4 + m]);
        }
        cols
    }

    /// [`dots_pair`](super::dots_pair) at AVX2: each block of 16 keys as two halves of 8,
    /// the two rows sharing each loaded key vector.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots_pair_avx2(
        q: [&[f32]; 2],
        kt: &[f32],
        d: usize,
        out: [&mut [f32]; 2],
    ) {
        let n = out[0].len();
        let q = [q[0].as_ptr(), q[1].as_ptr()];
        let [out0, out1] = out;
        for b in 0..n.div_ceil(KEYS) {
            for half in 0..2 {
                let first = b * KEYS + half * 8;
                if first >= n {
                    break;
                }
                let block = kt.as_ptr().add(b * d * KEYS + half * 8);
                // x3[h][r]: X3[h] = X2[h] + X2[h + 2] of row r (`dots`' halving, see the
                // module docs), each finished before the next begins (registers).
                let mut x3 = [[_mm256_setzero_ps(); 2]; 2];
                for h in 0..2 {
                    let mut x2 = [[_mm256_setzero_ps(); 2]; 2];
                    for (w, i) in [h, h + 2].into_iter().enumerate() {
                        let mut a = [[_mm256_setzero_ps(); 4]; 2];
                        for c in 0..d / LANES {
                            for s in 0..4 {
                                let e = c * LANES + i + 4 * s;
                                let kv = _mm256_loadu_ps(block.add(e * KEYS));
                                for r in 0..2 {
                                    let qe = _mm256_set1_ps(*q[r].add(e));
                                    a[r][s] = _mm256_fmadd_ps(qe, kv, a[r][s]);
                                }
                            }
                        }
                        for r in 0..2 {
                            let a = a[r];
                            x2[w][r] =
                                _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
                        }
                    }
                    for r in 0..2 {
                        x3[h][r] = _mm256_add_ps(x2[0][r], x2[1][r]);
                    }
                }
                let count = (n - first).min(8);
                for (r, dst) in [&mut *out0, &mut *out1].into_iter().enumerate() {
                    // X3[0] + X3[1], then `dots`' empty scalar tail (+0), as at AVX-512.
                    let sum = _mm256_add_ps(_mm256_add_ps(x3[0][r], x3[1][r]), _mm256_setzero_ps());
                    let mut lanes = [0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
                    dst[first..first + count].copy_from_slice(&lanes[..count]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backends::kernels::{dots, weighted_sum};
    use lantern_quant::{force_kernel, Kernel};
    use rand::{Rng, SeedableRng};

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// Values of mixed magnitudes and signs (zeros and negative zeros among them), where
    /// any other pairing of the sums would round differently.
    fn values(rng: &mut impl Rng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| match rng.gen_range(0..20) {
                0 => 0.0,
                1 => -0.0,
                _ => rng.gen_range(-3.0f32..3.0) * 10f32.powi(rng.gen_range(-4..4)),
            })
            .collect()
    }

    /// Two rows' dots from transposed keys are `dots`' bits, at every level this CPU runs
    /// (fresh random inputs, key counts on and off the 16-key blocks).
    #[test]
    fn dots_pair_equals_dots_row_by_row() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for d in [16, 32, 64, 128, 256] {
            for n in [1, 5, 16, 17, 40, 64] {
                let q = [values(&mut rng, d), values(&mut rng, d)];
                let keys = values(&mut rng, n * d);
                for level in Kernel::ALL
                    .into_iter()
                    .filter(|k| k.available() && k.is_exact())
                {
                    force_kernel(Some(level));
                    let mut want = [vec![f32::NAN; n], vec![f32::NAN; n]];
                    for (w, q) in want.iter_mut().zip(&q) {
                        dots(q, &keys, d, w);
                    }
                    let mut kt = vec![f32::NAN; transposed_len(n, d)];
                    transpose_keys(&keys, d, &mut kt);
                    let (mut g0, mut g1) = (vec![f32::NAN; n], vec![f32::NAN; n]);
                    dots_pair([&q[0], &q[1]], &kt, d, [&mut g0, &mut g1]);
                    force_kernel(None);
                    assert!(
                        same_bits(&g0, &want[0]) && same_bits(&g1, &want[1]),
                        "seed {seed} d {d} n {n} {level}"
                    );
                }
            }
        }
    }

    /// Transposed blocks hold each key's values, zeros past the last key, at every level.
    #[test]
    fn transposed_keys_are_the_keys() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        for d in [1, 16, 20, 64, 128] {
            for n in [1, 7, 16, 33] {
                let keys = values(&mut rng, n * d);
                for level in Kernel::ALL
                    .into_iter()
                    .filter(|k| k.available() && k.is_exact())
                {
                    force_kernel(Some(level));
                    let mut kt = vec![f32::NAN; transposed_len(n, d)];
                    transpose_keys(&keys, d, &mut kt);
                    force_kernel(None);
                    for (at, v) in kt.iter().enumerate() {
                        let (b, e, j) = (at / (d * KEYS), at / KEYS % d, at % KEYS);
                        let key = b * KEYS + j;
                        let want = if key < n { keys[key * d + e] } else { 0.0 };
                        assert_eq!(v.to_bits(), want.to_bits(), "d {d} n {n} {level} at {at}");
                    }
                }
            }
        }
    }

    /// All-zero products whose lanes end at -0: `dots` gives +0, and so must the pair.
    #[test]
    fn dots_pair_gives_dots_sign_of_zero() {
        let d = 16;
        let q = vec![-1.0f32; d];
        let keys = vec![0.0f32; d];
        let (mut want, mut g0, mut g1) = ([f32::NAN], [f32::NAN], [f32::NAN]);
        dots(&q, &keys, d, &mut want);
        let mut kt = vec![f32::NAN; transposed_len(1, d)];
        transpose_keys(&keys, d, &mut kt);
        dots_pair([&q, &q], &kt, d, [&mut g0, &mut g1]);
        assert_eq!(want[0].to_bits(), g0[0].to_bits());
        assert_eq!(want[0].to_bits(), g1[0].to_bits());
    }

    /// Four rows' weighted sums are `weighted_sum`'s bits, at every level.
    #[test]
    fn weighted_sum_quad_equals_weighted_sum_row_by_row() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for d in [16, 48, 64, 80, 128, 256] {
            for n in [0, 1, 7, 16, 64] {
                let v = values(&mut rng, n * d);
                let p: Vec<Vec<f32>> = (0..4).map(|_| values(&mut rng, n)).collect();
                let acc0: Vec<Vec<f32>> = (0..4).map(|_| values(&mut rng, d)).collect();
                for level in Kernel::ALL
                    .into_iter()
                    .filter(|k| k.available() && k.is_exact())
                {
                    force_kernel(Some(level));
                    let mut want = acc0.clone();
                    for (a, p) in want.iter_mut().zip(&p) {
                        weighted_sum(a, p, &v, d);
                    }
                    let mut got = acc0.clone();
                    let [g0, g1, g2, g3] = &mut got[..] else {
                        unreachable!()
                    };
                    weighted_sum_quad([g0, g1, g2, g3], [&p[0], &p[1], &p[2], &p[3]], &v, d);
                    force_kernel(None);
                    for (g, w) in got.iter().zip(&want) {
                        assert!(same_bits(g, w), "seed {seed} d {d} n {n} {level}");
                    }
                }
            }
        }
    }
}
