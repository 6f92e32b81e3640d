//! Small f32 vector kernels written so the compiler vectorizes them: fixed chunks of 16
//! lanes (one AVX-512 register, two AVX2 ones) with independent accumulators, no
//! bounds checks inside the loops, fused multiply-adds. Each public kernel is compiled
//! per kernel level and dispatched at run time ([`lantern_quant::per_level`]); the
//! explicit lane order makes every level's result bit-identical.

use lantern_quant::per_level;
pub(crate) use lantern_quant::simd::exp as exp_f32;
use lantern_quant::simd::fma as fmadd;

const LANES: usize = 16;

/// `out[j] = q . keys[j]` for the `out.len()` rows of `keys` (`[n, d]` row-major), at
/// the kernel level in effect.
///
/// Four keys at a time share each load of `q` and give four independent FMA chains;
/// each key's 16 lanes are then summed pairwise by halves ([`tree_reduce`]), the four
/// keys' reductions side by side in vector registers (written per level: compiled from
/// plain code they became a shuffle network per key, most of the kernel's time at head
/// dim 64). Every level sums the same pairs, so the results are the same bits.
///
/// The last `n % 4` keys go through the same four-key body (the missing keys stand in
/// as copies of the last one, their sums dropped), so a key's score is the same bits
/// wherever a tile of keys starts or ends: the flash kernel's tiles and a capture's
/// whole row give every key the same score.
/// Not inlined: compiled on its own, the loop shape is what the vectorizer sees (inlined
/// into a bigger loop nest it may pick a worse strategy), and one call per tile is cheap.
///
/// At the opt-in `amx-bf16` level the scores come from the bf16 tiles instead, as the
/// flash kernel's do there ([`dots_on_tiles`]).
pub(crate) fn dots(q: &[f32], keys: &[f32], d: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        use lantern_quant::Kernel;
        // One read of the level on the exact levels' path (a decode calls this per row).
        let level = lantern_quant::active_kernel();
        if level == Kernel::AmxBf16 && d > 0 && q.len() >= d {
            if let Some(tiles) = lantern_quant::bf16_tiles::Bf16Tiles::in_effect() {
                return dots_on_tiles(tiles, &q[..d], keys, out);
            }
        }
        match level.vectors() {
            // SAFETY: `active_kernel` never exceeds what the CPU reports.
            Kernel::Avx512 => return unsafe { x86::dots_avx512(q, keys, d, out) },
            Kernel::Avx2 | Kernel::AvxVnni => return unsafe { x86::dots_avx2(q, keys, d, out) },
            _ => {} // scalar
        }
    }
    dots_with(q, keys, d, out, |sets| {
        sets.map(|lanes| tree_reduce(lanes, |x, y| x + y))
    })
}

/// `out[j] = q . keys[j]` on the bf16 tiles: `q` and the keys rounded to bf16, each
/// score one tile element, so the same bits as the flash kernel's scores at the
/// `amx-bf16` level (`cpu_flash::tiles`), whatever else it computed beside.
#[cfg(target_arch = "x86_64")]
fn dots_on_tiles(
    tiles: lantern_quant::bf16_tiles::Bf16Tiles,
    q: &[f32],
    keys: &[f32],
    out: &mut [f32],
) {
    use lantern_quant::bf16_tiles::{TileColumns, TileRows};
    use std::cell::RefCell;
    thread_local! {
        static OPERANDS: RefCell<(TileRows, TileColumns, Vec<f32>)> = RefCell::default();
    }
    let (d, n) = (q.len(), out.len());
    OPERANDS.with_borrow_mut(|(row, columns, scores)| {
        row.reshape(1, d);
        row.set_whole_row(0, 0, q);
        columns.set_from_rows(&keys[..n * d], d);
        let ldo = columns.stored_columns();
        if scores.len() < ldo {
            scores.resize(ldo, 0.0);
        }
        tiles
            .session(1)
            .product(row, columns, &mut scores[..ldo], ldo);
        out.copy_from_slice(&scores[..n]);
    });
}

/// The body of [`dots`], with the reduction of four keys' lanes (`sum4`, each as
/// [`tree_reduce`] with `+`) given by the level.
#[inline(always)]
fn dots_with(
    q: &[f32],
    keys: &[f32],
    d: usize,
    out: &mut [f32],
    sum4: impl Fn([[f32; LANES]; 4]) -> [f32; 4],
) {
    if d == 0 {
        out.fill(0.0);
        return;
    }
    let q = &q[..d.min(q.len())];
    let d = q.len();
    let full = d / LANES * LANES;
    let mut rows = keys.chunks_exact(d);
    let mut outs = out.chunks_exact_mut(4);
    for o in &mut outs {
        let (Some(k0), Some(k1), Some(k2), Some(k3)) =
            (rows.next(), rows.next(), rows.next(), rows.next())
        else {
            o.fill(0.0);
            return;
        };
        o.copy_from_slice(&dots4(q, full, [k0, k1, k2, k3], &sum4));
    }
    let rest = outs.into_remainder();
    let mut left: [&[f32]; 3] = [&[]; 3];
    let mut n = 0;
    for (slot, k) in left.iter_mut().zip(rows.take(rest.len())) {
        *slot = k;
        n += 1;
    }
    if n > 0 {
        let key = |i: usize| left[i.min(n - 1)];
        let sums = dots4(q, full, [key(0), key(1), key(2), key(3)], &sum4);
        rest[..n].copy_from_slice(&sums[..n]);
    }
    rest[n..].fill(0.0);
}

/// `q . k` for four keys: four FMA chains of 16 lanes over `q[..full]` (whole chunks),
/// a scalar tail over the rest, the lanes summed by `sum4`. Each key's result depends
/// on its own values only.
#[inline(always)]
fn dots4(
    q: &[f32],
    full: usize,
    [k0, k1, k2, k3]: [&[f32]; 4],
    sum4: &impl Fn([[f32; LANES]; 4]) -> [f32; 4],
) -> [f32; 4] {
    let (mut a0, mut a1, mut a2, mut a3) =
        ([0f32; LANES], [0f32; LANES], [0f32; LANES], [0f32; LANES]);
    let chunks = q[..full]
        .chunks_exact(LANES)
        .zip(k0.chunks_exact(LANES))
        .zip(k1.chunks_exact(LANES))
        .zip(k2.chunks_exact(LANES))
        .zip(k3.chunks_exact(LANES));
    for ((((x, c0), c1), c2), c3) in chunks {
        for i in 0..LANES {
            a0[i] = fmadd(x[i], c0[i], a0[i]);
            a1[i] = fmadd(x[i], c1[i], a1[i]);
            a2[i] = fmadd(x[i], c2[i], a2[i]);
            a3[i] = fmadd(x[i], c3[i], a3[i]);
        }
    }
    let mut tail = [0f32; 4];
    for (i, x) in q.iter().enumerate().skip(full) {
        tail[0] = fmadd(*x, k0[i], tail[0]);
        tail[1] = fmadd(*x, k1[i], tail[1]);
        tail[2] = fmadd(*x, k2[i], tail[2]);
        tail[3] = fmadd(*x, k3[i], tail[3]);
    }
    let sums = sum4([a0, a1, a2, a3]);
    [0, 1, 2, 3].map(|i| sums[i] + tail[i])
}

/// [`dots`] per SIMD level: the same body, with the four keys' lane sums side by side.
/// For each key X, [`tree_reduce`]'s steps are `X1[i] = X[i] + X[i+8]` (i < 8),
/// `X2[i] = X1[i] + X1[i+4]` (i < 4), `X3[i] = X2[i] + X2[i+2]` (i < 2), `X3[0] + X3[1]`;
/// the shuffles below only place the same operands side by side.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::LANES;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn dots_avx512(q: &[f32], keys: &[f32], d: usize, out: &mut [f32]) {
        super::dots_with(q, keys, d, out, |sets| unsafe { sum4_512(sets) })
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dots_avx2(q: &[f32], keys: &[f32], d: usize, out: &mut [f32]) {
        super::dots_with(q, keys, d, out, |sets| unsafe { sum4_256(sets) })
    }

    /// Four keys' lanes, one zmm each (q0..q3: its 128-bit quarters).
    #[inline(always)]
    unsafe fn sum4_512(sets: [[f32; LANES]; 4]) -> [f32; 4] {
        // (No `map` with a closure here or below: it is not inlined into the level's
        // code, and neither then are the intrinsics it calls.)
        let a = _mm512_loadu_ps(sets[0].as_ptr());
        let b = _mm512_loadu_ps(sets[1].as_ptr());
        let c = _mm512_loadu_ps(sets[2].as_ptr());
        let d = _mm512_loadu_ps(sets[3].as_ptr());
        // [A.q0 A.q1 B.q0 B.q1] + [A.q2 A.q3 B.q2 B.q3] = [A1 | B1].
        let ab = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        );
        let cd = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(c, d),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(c, d),
        );
        // [A1 0..4, B1 0..4, C1 0..4, D1 0..4] + the same of 4..8: quarter s is key s's X2.
        let v = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(ab, cd),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(ab, cd),
        );
        // Within each quarter: lanes (0, 1) + lanes (2, 3), then lane 0 + lane 1.
        let t = _mm512_add_ps(v, _mm512_permute_ps::<0b01_00_11_10>(v));
        let f = _mm512_add_ps(t, _mm512_permute_ps::<0b10_11_00_01>(t));
        let first = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        let mut out = [0f32; 4];
        _mm_storeu_ps(
            out.as_mut_ptr(),
            _mm512_castps512_ps128(_mm512_permutexvar_ps(first, f)),
        );
        out
    }

    /// `X1`: lanes 0..8 plus lanes 8..16.
    #[inline(always)]
    unsafe fn halves_added(lanes: &[f32; LANES]) -> __m256 {
        let p = lanes.as_ptr();
        _mm256_add_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
    }

    /// Four keys' lanes, two ymm each (lanes 0..8 and 8..16).
    #[inline(always)]
    unsafe fn sum4_256(sets: [[f32; LANES]; 4]) -> [f32; 4] {
        let a = halves_added(&sets[0]);
        let b = halves_added(&sets[1]);
        let c = halves_added(&sets[2]);
        let d = halves_added(&sets[3]);
        // [A1 0..4 | B1 0..4] + [A1 4..8 | B1 4..8] = [A2 | B2].
        let ab = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        );
        let cd = _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(c, d),
            _mm256_permute2f128_ps::<0x31>(c, d),
        );
        // [A2 0, A2 1, C2 0, C2 1 | B2 0, B2 1, D2 0, D2 1] + the same of lanes 2, 3.
        let t = _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(ab, cd),
            _mm256_shuffle_ps::<0b11_10_11_10>(ab, cd),
        );
        // Lane 0 + lane 1 of each key: [A C A C | B D B D].
        let f = _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(t, t),
            _mm256_shuffle_ps::<0b11_01_11_01>(t, t),
        );
        let (lo, hi) = (_mm256_castps256_ps128(f), _mm256_extractf128_ps::<1>(f));
        let mut out = [0f32; 4];
        // [A B C D] from [A C A C] and [B D B D].
        _mm_storeu_ps(out.as_mut_ptr(), _mm_unpacklo_ps(lo, hi));
        out
    }
}

per_level! {
/// `acc += sum_j p[j] * values[j]` for the `p.len()` rows of `values` (`[n, d]`).
///
/// Walks `acc` in blocks of four registers (64 lanes) held across all keys: four
/// independent FMA chains, and `acc` is loaded and stored once per block instead of
/// once per key. Not inlined, for the same reason as [`dots`].
pub(crate) fn weighted_sum(acc: &mut [f32], p: &[f32], values: &[f32], d: usize) {
    const W: usize = 4 * LANES;
    if d == 0 || acc.len() != d {
        return;
    }
    let n = p.len().min(values.len() / d);
    let (p, values) = (&p[..n], &values[..n * d]);
    let mut start = 0;
    while start + W <= d {
        let block = &mut acc[start..start + W];
        let mut r = [0f32; W];
        r.copy_from_slice(block);
        for (pj, row) in p.iter().zip(values.chunks_exact(d)) {
            let x = &row[start..start + W];
            for i in 0..W {
                r[i] = fmadd(x[i], *pj, r[i]);
            }
        }
        block.copy_from_slice(&r);
        start += W;
    }
    while start + LANES <= d {
        let block = &mut acc[start..start + LANES];
        let mut r = [0f32; LANES];
        r.copy_from_slice(block);
        for (pj, row) in p.iter().zip(values.chunks_exact(d)) {
            let x = &row[start..start + LANES];
            for i in 0..LANES {
                r[i] = fmadd(x[i], *pj, r[i]);
            }
        }
        block.copy_from_slice(&r);
        start += LANES;
    }
    for (i, a) in acc.iter_mut().enumerate().skip(start) {
        for (pj, row) in p.iter().zip(values.chunks_exact(d)) {
            *a = fmadd(row[i], *pj, *a);
        }
    }
}
}

per_level! {
/// One tile's online-softmax bookkeeping before its exponentials: turns raw `q . k` dot
/// products into logits in place (times `scale`, then soft-capped when `cap` is given:
/// [`AttentionLayerSpec::transform_score`](crate::AttentionLayerSpec::transform_score)
/// element by element) and returns the new running maximum and `e^(old - new)`, the
/// factor that rescales what was accumulated under the old one.
pub(crate) fn logits_and_rescale(
    logits: &mut [f32],
    scale: f32,
    cap: Option<f32>,
    running_max: f32,
) -> (f32, f32) {
    match cap {
        Some(cap) => {
            for s in logits.iter_mut() {
                *s = cap * (*s * scale / cap).tanh();
            }
        }
        None => {
            // A plain loop: written in 16-lane chunks, it was vectorized across the chunks
            // into gathers and scatters (most of this function's time).
            for x in logits.iter_mut() {
                *x *= scale;
            }
        }
    }
    let new_max = running_max.max(lanes_max(logits));
    // Past the first tiles the maximum rarely moves: skip the exponential's latency then
    // (`exp_f32(0.0)` is exactly 1).
    let alpha = if new_max == running_max {
        1.0
    } else {
        exp_f32(running_max - new_max)
    };
    (new_max, alpha)
}
}

/// The largest of `x` (minus infinity when empty), in four independent 16-lane maxima
/// (one was a chain of dependent `maxps`); the maximum is exact in any order.
#[inline(always)]
fn lanes_max(x: &[f32]) -> f32 {
    // One flat run of 64 lanes (four registers at AVX-512): written as four rows of 16,
    // it was vectorized across the rows into gathers.
    let mut acc = [f32::NEG_INFINITY; 4 * LANES];
    let mut quads = x.chunks_exact(4 * LANES);
    for c in &mut quads {
        for i in 0..4 * LANES {
            acc[i] = max_lane(acc[i], c[i]);
        }
    }
    let mut chunks = quads.remainder().chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            acc[i] = max_lane(acc[i], c[i]);
        }
    }
    let lanes: [f32; LANES] = std::array::from_fn(|i| {
        let (a, b) = (acc[i], acc[LANES + i]);
        let (c, d) = (acc[2 * LANES + i], acc[3 * LANES + i]);
        max_lane(max_lane(a, b), max_lane(c, d))
    });
    chunks
        .remainder()
        .iter()
        .fold(tree_reduce(lanes, max_lane), |m, x| max_lane(m, *x))
}

/// The lanes combined with `op` pairwise by halves: vector shuffles where a
/// left-to-right fold is a serial chain of 16 scalar operations, and a fixed order, so
/// the same result at every level.
/// The larger of two numbers as one `maxps`: `f32::max`'s NaN handling compiled to a
/// compare and blend per lane (9% of a prefill at avx512). Logits are not NaN unless the
/// inputs were, and then the exponentials make the row NaN whatever the maximum; zeros of
/// either sign shift the exponentials the same.
#[inline(always)]
fn max_lane(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

#[inline(always)]
fn tree_reduce(mut lanes: [f32; LANES], op: impl Fn(f32, f32) -> f32) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] = op(lanes[i], lanes[i + width]);
        }
    }
    lanes[0]
}

per_level! {
/// `x[i] = e^(x[i] - shift)` for every element; returns their sum (in lanes, then
/// pairwise: a left-to-right sum was a serial chain of additions).
pub(crate) fn exp_shifted_sum(x: &mut [f32], shift: f32) -> f32 {
    // Whole 16-lane chunks: a plain loop over a 16-key tile was vectorized for 32
    // elements at a time and ran entirely in its scalar remainder.
    let mut lanes = [0f32; LANES];
    let mut chunks = x.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            c[i] = exp_f32(c[i] - shift);
            lanes[i] += c[i];
        }
    }
    let mut sum = tree_reduce(lanes, |a, b| a + b);
    for v in chunks.into_remainder() {
        *v = exp_f32(*v - shift);
        sum += *v;
    }
    sum
}
}

/// Rows [`softmax_rows`] takes at once.
pub(crate) const SOFTMAX_ROWS: usize = 4;

per_level! {
/// [`logits_and_rescale`] then [`exp_shifted_sum`] for up to [`SOFTMAX_ROWS`] rows at
/// once (`rows`, of any lengths; empty ones change nothing): row `r`'s logits become its
/// unnormalized probabilities, `max[r]` and `sum[r]` move on as one online-softmax step
/// moves them, and the factor that rescales what was accumulated under the old maximum is
/// returned. Each row gets the same operations as from the two kernels (the maximum of
/// its logits is taken in other lanes: the same in any order, unless a logit is NaN, and
/// then the row is NaN either way), so the same bits; what changes is that one call does the rows' fixed work (two dispatches,
/// constants, two reductions across lanes a row) side by side, which at groups of 32 to
/// 128 keys was half of a row's step.
pub(crate) fn softmax_rows(
    rows: &mut [&mut [f32]; SOFTMAX_ROWS],
    scale: f32,
    cap: Option<f32>,
    max: &mut [f32; SOFTMAX_ROWS],
    sum: &mut [f32; SOFTMAX_ROWS],
) -> [f32; SOFTMAX_ROWS] {
    let maxima = match cap {
        Some(cap) => rows_max(rows, move |s| cap * (s * scale / cap).tanh()),
        None => rows_max(rows, move |s| s * scale),
    };
    let mut alpha = [1f32; SOFTMAX_ROWS];
    for r in 0..SOFTMAX_ROWS {
        let new_max = max[r].max(maxima[r]);
        if new_max != max[r] {
            alpha[r] = exp_f32(max[r] - new_max);
        }
        max[r] = new_max;
    }
    let sums = rows_exp_sum(rows, max);
    for r in 0..SOFTMAX_ROWS {
        sum[r] = sum[r] * alpha[r] + sums[r];
    }
    alpha
}
}

/// `x = logit(x)` for every element of the rows, and each row's largest, the rows' chunks
/// of 16 side by side (as far as the shortest row goes, then each row's own).
#[inline(always)]
fn rows_max(
    rows: &mut [&mut [f32]; SOFTMAX_ROWS],
    logit: impl Fn(f32) -> f32 + Copy,
) -> [f32; SOFTMAX_ROWS] {
    #[inline(always)]
    fn chunk(lanes: &mut [f32; LANES], x: &mut [f32], logit: impl Fn(f32) -> f32) {
        // Through a local copy: written in place, the compiler split the chunk into
        // pieces (it could not rule out that the stores change what `logit` reads).
        let mut v: [f32; LANES] = (&*x).try_into().unwrap();
        for i in 0..LANES {
            v[i] = logit(v[i]);
            lanes[i] = max_lane(lanes[i], v[i]);
        }
        x.copy_from_slice(&v);
    }
    let chunks: [usize; SOFTMAX_ROWS] = std::array::from_fn(|r| rows[r].len() / LANES);
    let common = chunks.into_iter().min().unwrap_or(0);
    let mut lanes = [[f32::NEG_INFINITY; LANES]; SOFTMAX_ROWS];
    for c in 0..common {
        for r in 0..SOFTMAX_ROWS {
            chunk(&mut lanes[r], &mut rows[r][c * LANES..][..LANES], logit);
        }
    }
    let mut maxima = [0.0; SOFTMAX_ROWS];
    for r in 0..SOFTMAX_ROWS {
        for c in common..chunks[r] {
            chunk(&mut lanes[r], &mut rows[r][c * LANES..][..LANES], logit);
        }
        let mut max = tree_reduce(lanes[r], max_lane);
        for x in rows[r][chunks[r] * LANES..].iter_mut() {
            *x = logit(*x);
            max = max_lane(max, *x);
        }
        maxima[r] = max;
    }
    maxima
}

/// [`exp_shifted_sum`] of each row with its shift, the rows' chunks side by side.
#[inline(always)]
fn rows_exp_sum(
    rows: &mut [&mut [f32]; SOFTMAX_ROWS],
    shift: &[f32; SOFTMAX_ROWS],
) -> [f32; SOFTMAX_ROWS] {
    #[inline(always)]
    fn chunk(lanes: &mut [f32; LANES], x: &mut [f32], shift: f32) {
        let mut v: [f32; LANES] = (&*x).try_into().unwrap();
        for i in 0..LANES {
            v[i] = exp_f32(v[i] - shift);
            lanes[i] += v[i];
        }
        x.copy_from_slice(&v);
    }
    let chunks: [usize; SOFTMAX_ROWS] = std::array::from_fn(|r| rows[r].len() / LANES);
    let common = chunks.into_iter().min().unwrap_or(0);
    let mut lanes = [[0f32; LANES]; SOFTMAX_ROWS];
    for c in 0..common {
        for r in 0..SOFTMAX_ROWS {
            chunk(&mut lanes[r], &mut rows[r][c * LANES..][..LANES], shift[r]);
        }
    }
    let mut sums = [0.0; SOFTMAX_ROWS];
    for r in 0..SOFTMAX_ROWS {
        for c in common..chunks[r] {
            chunk(&mut lanes[r], &mut rows[r][c * LANES..][..LANES], shift[r]);
        }
        let mut sum = tree_reduce(lanes[r], |a, b| a + b);
        for x in rows[r][chunks[r] * LANES..].iter_mut() {
            *x = exp_f32(*x - shift[r]);
            sum += *x;
        }
        sums[r] = sum;
    }
    sums
}

/// The probabilities one query row of query head `query_head` gives `keys` (`[n, d]`
/// row-major: the keys it sees, in position order) on `layer`, into `out` (`n` long):
/// scores from the flash kernel's code (its dot products, then scale and soft-cap as
/// [`AttentionLayerSpec::transform_score`](crate::AttentionLayerSpec::transform_score)),
/// then [`probabilities_from_logits`]. The same bits at every kernel level, and the same
/// bits as the flash kernel's [`RowProbabilities`](crate::RowProbabilities) of that row;
/// all zeros when every score is minus infinity.
pub fn row_probabilities(
    layer: &crate::AttentionLayerSpec,
    query_head: usize,
    q: &[f32],
    keys: &[f32],
    out: &mut [f32],
) {
    if out.is_empty() {
        return;
    }
    dots(q, keys, layer.head_dim, out);
    probabilities_from_scores(layer, query_head, out);
}

/// The rest of [`row_probabilities`] after its dot products: one row's raw `q . k`
/// scores over every key it sees (in position order) into its probabilities in place.
pub(crate) fn probabilities_from_scores(
    layer: &crate::AttentionLayerSpec,
    query_head: usize,
    scores: &mut [f32],
) {
    let sink = layer.sink_logit(query_head);
    let floor = sink.unwrap_or(f32::NEG_INFINITY);
    // The maximum of the logits and the sink, as `row_max` takes it.
    let (max, _) = logits_and_rescale(scores, layer.scale, layer.logits_soft_cap, floor);
    normalize(scores, max, sink);
}

/// Turns one row's logits over every key it sees (scaled and soft-capped, in position
/// order) into its probabilities in place: exponentials shifted by the row's maximum
/// and summed in fixed lanes, query head `query_head`'s sink in the denominator (with
/// one the row sums to less than 1). All zeros when every logit is minus infinity.
pub fn probabilities_from_logits(
    layer: &crate::AttentionLayerSpec,
    query_head: usize,
    logits: &mut [f32],
) {
    let sink = layer.sink_logit(query_head);
    let max = row_max(logits, sink.unwrap_or(f32::NEG_INFINITY));
    normalize(logits, max, sink);
}

/// Logits into probabilities, given their maximum with the sink's (`max`).
fn normalize(logits: &mut [f32], max: f32, sink: Option<f32>) {
    if max == f32::NEG_INFINITY {
        logits.fill(0.0);
        return;
    }
    let sum = exp_shifted_sum(logits, max) + sink.map_or(0.0, |s| exp_f32(s - max));
    scale(logits, 1.0 / sum);
}

per_level! {
/// The largest of `x` and `floor` (exact in any order: lanes only let it vectorize).
fn row_max(x: &[f32], floor: f32) -> f32 {
    floor.max(lanes_max(x))
}
}

per_level! {
/// `acc += alpha * x` over the shorter of the two (a plain element-wise loop: no
/// reduction, so the compiler vectorizes it as is).
pub(crate) fn axpy(acc: &mut [f32], alpha: f32, x: &[f32]) {
    for (a, x) in acc.iter_mut().zip(x) {
        *a = fmadd(*x, alpha, *a);
    }
}
}

per_level! {
/// `x *= alpha`.
pub(crate) fn scale(x: &mut [f32], alpha: f32) {
    for v in x.iter_mut() {
        *v *= alpha;
    }
}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let e = (x as f64).exp();
            worst = worst.max(((exp_f32(x) as f64) - e).abs() / e);
            x += 0.0137;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NEG_INFINITY) < 1e-37);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(f32::INFINITY).is_finite());
        let mut v = [0.0f32, -1.0, 1.0];
        let s = exp_shifted_sum(&mut v, 1.0);
        assert!((s as f64 - (1.0 + (-1f64).exp() + (-2f64).exp())).abs() < 1e-6);
    }

    #[test]
    fn tile_kernels_match_scalar() {
        for d in [1, 3, 16, 20, 32, 64, 80, 128, 130] {
            for n in [0, 1, 3, 4, 5, 8, 16, 17] {
                let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.3).sin()).collect();
                let rows: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.17).cos()).collect();
                let mut scores = vec![f32::NAN; n];
                dots(&q, &rows, d, &mut scores);
                let p: Vec<f32> = (0..n).map(|j| 0.1 + j as f32 * 0.05).collect();
                let mut acc: Vec<f32> = (0..d).map(|i| i as f32 * 0.01).collect();
                let acc0 = acc.clone();
                weighted_sum(&mut acc, &p, &rows, d);
                for j in 0..n {
                    let e: f64 = (0..d).map(|i| q[i] as f64 * rows[j * d + i] as f64).sum();
                    assert!((scores[j] as f64 - e).abs() < 1e-4, "d={d} n={n} j={j}");
                }
                for i in 0..d {
                    let e: f64 = acc0[i] as f64
                        + (0..n)
                            .map(|j| p[j] as f64 * rows[j * d + i] as f64)
                            .sum::<f64>();
                    assert!((acc[i] as f64 - e).abs() < 1e-4, "d={d} n={n} i={i}");
                }
            }
        }
    }

    /// A row's probabilities: an f64 softmax of the layer's scores to 1e-5 (plain,
    /// soft-capped, with a sink), the same bits at every level, zeros for a row that
    /// sees nothing but minus infinity.
    #[test]
    fn row_probabilities_match_an_f64_softmax_at_every_level() {
        use crate::AttentionLayerSpec;
        use lantern_quant::{force_kernel, Kernel};
        let (d, n) = (64, 37);
        let q: Vec<f32> = (0..d)
            .map(|i| (i as f32 * 0.37).sin() * 2.0 + 0.1)
            .collect();
        let keys: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.113).cos() * 1.5).collect();
        let plain = AttentionLayerSpec::new(4, 2, d);
        let mut capped = plain.clone();
        capped.logits_soft_cap = Some(5.0);
        let mut sink = plain.clone();
        sink.sinks = Some(vec![0.5, -1.0, 2.0, 0.0]);
        for (name, layer) in [("plain", &plain), ("capped", &capped), ("sink", &sink)] {
            let h = 2;
            let scores: Vec<f64> = (0..n)
                .map(|j| {
                    let dot: f64 = (0..d).map(|i| q[i] as f64 * keys[j * d + i] as f64).sum();
                    let s = dot * layer.scale as f64;
                    match layer.logits_soft_cap {
                        Some(cap) => cap as f64 * (s / cap as f64).tanh(),
                        None => s,
                    }
                })
                .collect();
            let sink_logit = layer.sink_logit(h).map(f64::from);
            let max = scores
                .iter()
                .copied()
                .chain(sink_logit)
                .fold(f64::MIN, f64::max);
            let total: f64 = scores
                .iter()
                .chain(sink_logit.iter())
                .map(|s| (s - max).exp())
                .sum();
            let mut results = Vec::new();
            for level in Kernel::ALL
                .into_iter()
                .filter(|k| k.available() && k.is_exact())
            {
                force_kernel(Some(level));
                let mut p = vec![f32::NAN; n];
                row_probabilities(layer, h, &q, &keys, &mut p);
                force_kernel(None);
                for (j, &pj) in p.iter().enumerate() {
                    let e = (scores[j] - max).exp() / total;
                    assert!(
                        (pj as f64 - e).abs() <= 1e-5 * e + 1e-9,
                        "{name} {level} key {j}"
                    );
                }
                results.push((level, p));
            }
            for pair in results.windows(2) {
                assert_eq!(
                    pair[0].1, pair[1].1,
                    "{name}: {} vs {}",
                    pair[0].0, pair[1].0
                );
            }
        }
        let q_inf = vec![f32::NEG_INFINITY; d];
        let mut p = vec![f32::NAN; 3];
        row_probabilities(&plain, 0, &q_inf, &vec![1.0; 3 * d], &mut p);
        assert_eq!(p, [0.0; 3]);
    }

    /// `dots` (whose four-key lane sums are written per level) gives the same bits at
    /// every level this CPU runs, on values of mixed magnitudes where any other pairing
    /// of the sums would round differently.
    #[test]
    fn dots_agree_bit_for_bit_at_every_level() {
        use lantern_quant::{force_kernel, Kernel};
        let value = |i: usize, salt: usize| {
            let v = ((i * 7919 + salt * 104_729) as f32 * 0.000_731).sin();
            v * 10f32.powi((i % 9) as i32 - 4)
        };
        for d in [1, 3, 16, 20, 32, 64, 80, 128, 256] {
            for n in [0, 1, 4, 5, 8, 17, 64] {
                let q: Vec<f32> = (0..d).map(|i| value(i, 1)).collect();
                let keys: Vec<f32> = (0..n * d).map(|i| value(i, 2)).collect();
                let mut by_level = Vec::new();
                for level in Kernel::ALL
                    .into_iter()
                    .filter(|k| k.available() && k.is_exact())
                {
                    force_kernel(Some(level));
                    let mut out = vec![f32::NAN; n];
                    dots(&q, &keys, d, &mut out);
                    force_kernel(None);
                    by_level.push((level, out));
                }
                let (_, scalar) = &by_level[0];
                for (level, out) in &by_level {
                    let same = out
                        .iter()
                        .zip(scalar)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "d={d} n={n}: {level} {out:?} vs scalar {scalar:?}");
                }
                for (j, got) in scalar.iter().enumerate() {
                    let e: f64 = (0..d).map(|i| q[i] as f64 * keys[j * d + i] as f64).sum();
                    let size: f64 = (0..d).map(|i| (q[i] * keys[j * d + i]).abs() as f64).sum();
                    assert!((*got as f64 - e).abs() <= 1e-6 * size, "d={d} n={n} j={j}");
                }
            }
        }
    }

    /// Four rows' softmax steps in one call are, row by row, the bits of
    /// `logits_and_rescale` then `exp_shifted_sum` (and the same running sum), at every
    /// level this CPU runs, for rows of different lengths (empty ones, partial chunks),
    /// with and without a soft cap and a running maximum. Fresh random inputs each run.
    #[test]
    fn softmax_rows_equal_the_one_row_kernels_at_every_level() {
        use lantern_quant::{force_kernel, Kernel};
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let rng = rand::rngs::StdRng::seed_from_u64(seed);
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let mut by_level = Vec::new();
        for level in Kernel::ALL
            .into_iter()
            .filter(|k| k.available() && k.is_exact())
        {
            force_kernel(Some(level));
            let mut rng = rng.clone();
            let mut outputs = Vec::new();
            for case in 0..200 {
                let cap = (case % 3 == 0).then(|| rng.gen_range(5.0f32..50.0));
                let scale = rng.gen_range(0.05f32..0.3);
                let lens: [usize; SOFTMAX_ROWS] =
                    std::array::from_fn(|_| match rng.gen_range(0..4) {
                        0 => rng.gen_range(0..4),
                        _ => rng.gen_range(0..140),
                    });
                let raw: Vec<Vec<f32>> = lens
                    .iter()
                    .map(|&n| (0..n).map(|_| rng.gen_range(-40.0f32..40.0)).collect())
                    .collect();
                let mut max: [f32; SOFTMAX_ROWS] =
                    std::array::from_fn(|_| match rng.gen_range(0..2) {
                        0 => f32::NEG_INFINITY,
                        _ => rng.gen_range(-5.0f32..5.0),
                    });
                let mut sum: [f32; SOFTMAX_ROWS] = std::array::from_fn(|r| {
                    if max[r].is_finite() {
                        rng.gen_range(0.5..9.0)
                    } else {
                        0.0
                    }
                });
                // One row at a time, as the one-row step does.
                let mut want = raw.clone();
                let mut want_state = Vec::new();
                for (r, row) in want.iter_mut().enumerate() {
                    let (new_max, alpha) = logits_and_rescale(row, scale, cap, max[r]);
                    let s = sum[r] * alpha + exp_shifted_sum(row, new_max);
                    want_state.push((new_max.to_bits(), s.to_bits(), alpha.to_bits()));
                }
                let mut got = raw.clone();
                let mut rows: [&mut [f32]; SOFTMAX_ROWS] = Default::default();
                for (slot, row) in rows.iter_mut().zip(got.iter_mut()) {
                    *slot = row;
                }
                let alpha = softmax_rows(&mut rows, scale, cap, &mut max, &mut sum);
                for r in 0..SOFTMAX_ROWS {
                    let state = (max[r].to_bits(), sum[r].to_bits(), alpha[r].to_bits());
                    assert_eq!(
                        state, want_state[r],
                        "{level} seed {seed} case {case} row {r}"
                    );
                    assert_eq!(
                        bits(&got[r]),
                        bits(&want[r]),
                        "{level} seed {seed} case {case} row {r}"
                    );
                }
                outputs.push(got);
            }
            force_kernel(None);
            by_level.push((level, outputs));
        }
        let (_, first) = &by_level[0];
        for (level, outputs) in &by_level {
            for (a, b) in outputs.iter().flatten().zip(first.iter().flatten()) {
                assert_eq!(bits(a), bits(b), "{level} seed {seed}");
            }
        }
    }

    /// A key's score is the same bits whatever tile of keys it is computed in (where the
    /// tile starts, where it ends, how many keys it has past a multiple of four), at
    /// every level: what lets the flash kernel's tiles give capture the scores of a
    /// whole row. Fresh random inputs on every run.
    #[test]
    fn a_keys_score_does_not_depend_on_its_tile() {
        use lantern_quant::{force_kernel, Kernel};
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for d in [1, 5, 16, 20, 64, 80, 128] {
            let n = rng.gen_range(1..40);
            let q: Vec<f32> = (0..d).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let keys: Vec<f32> = (0..n * d)
                .map(|_| rng.gen_range(-3.0f32..3.0) * 10f32.powi(rng.gen_range(-3..3)))
                .collect();
            for level in Kernel::ALL
                .into_iter()
                .filter(|k| k.available() && k.is_exact())
            {
                force_kernel(Some(level));
                let mut whole = vec![f32::NAN; n];
                dots(&q, &keys, d, &mut whole);
                for a in 0..n {
                    for b in a + 1..=n {
                        let mut tile = vec![f32::NAN; b - a];
                        dots(&q, &keys[a * d..b * d], d, &mut tile);
                        for (j, s) in tile.iter().enumerate() {
                            assert_eq!(
                                s.to_bits(),
                                whole[a + j].to_bits(),
                                "seed {seed} d {d} {level} tile {a}..{b} key {}",
                                a + j
                            );
                        }
                    }
                }
                force_kernel(None);
            }
        }
    }

    #[test]
    fn logits_and_rescale_match_the_layers_transform() {
        let mut layer = crate::AttentionLayerSpec::new(4, 2, 64);
        for cap in [None, Some(50.0)] {
            layer.logits_soft_cap = cap;
            for n in [0, 1, 15, 16, 17, 40] {
                let raw: Vec<f32> = (0..n).map(|i| (i as f32 * 1.7).sin() * 90.0).collect();
                let mut logits = raw.clone();
                let (new_max, alpha) = logits_and_rescale(&mut logits, layer.scale, cap, 0.5);
                let want: Vec<f32> = raw.iter().map(|r| layer.transform_score(*r)).collect();
                assert_eq!(logits, want, "cap {cap:?} n {n}");
                let want_max = want.iter().fold(0.5f32, |m, x| m.max(*x));
                assert_eq!(new_max, want_max);
                assert_eq!(alpha, exp_f32(0.5 - want_max));
            }
        }
    }

    #[test]
    fn dot_and_axpy_match_scalar() {
        for n in [0, 1, 7, 16, 17, 31, 32, 33, 48, 64, 100, 128] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let expected: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let mut one = [f32::NAN];
            dots(&a, &b, n, &mut one);
            assert!((one[0] as f64 - expected).abs() < 1e-5, "n={n}");
            let mut acc = b.clone();
            axpy(&mut acc, 0.5, &a);
            for i in 0..n {
                assert!((acc[i] - (b[i] + 0.5 * a[i])).abs() < 1e-6);
            }
        }
    }
}
