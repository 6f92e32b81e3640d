//! Passes over one row of logits (up to a 262k vocabulary per sampled token), compiled
//! per kernel level and dispatched at run time (see [`lantern_quant::per_level`]).

use lantern_quant::per_level;
use lantern_quant::simd::exp;

const LANES: usize = 16;

per_level! {
    /// The largest value (NaNs ignored; `-inf` for an empty or all-NaN row).
    pub fn max(row: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; LANES];
        let mut chunks = row.chunks_exact(LANES);
        for c in &mut chunks {
            for i in 0..LANES {
                acc[i] = acc[i].max(c[i]);
            }
        }
        let tail = chunks.remainder().iter().copied().fold(f32::NEG_INFINITY, f32::max);
        acc.iter().copied().fold(tail, f32::max)
    }

    /// The index of the first value equal to `target` (`None` if there is none).
    pub fn position_of(row: &[f32], target: f32) -> Option<usize> {
        let mut chunks = row.chunks_exact(LANES);
        for (n, c) in (&mut chunks).enumerate() {
            let mut hit = false;
            for v in c {
                hit |= *v == target;
            }
            if hit {
                return c.iter().position(|v| *v == target).map(|i| n * LANES + i);
            }
        }
        let done = row.len() - chunks.remainder().len();
        chunks.remainder().iter().position(|v| *v == target).map(|i| done + i)
    }

    /// `out[i] = e^((row[i] - shift) * scale)`; returns their sum (in 16 lanes, a
    /// fixed order).
    pub fn exp_scaled(row: &[f32], shift: f32, scale: f32, out: &mut [f32]) -> f32 {
        let mut acc = [0f32; LANES];
        let n = row.len().min(out.len());
        let (row, out) = (&row[..n], &mut out[..n]);
        let mut rows = row.chunks_exact(LANES);
        let mut outs = out.chunks_exact_mut(LANES);
        for (r, o) in (&mut rows).zip(&mut outs) {
            for i in 0..LANES {
                o[i] = exp((r[i] - shift) * scale);
                acc[i] += o[i];
            }
        }
        let mut sum = acc.iter().sum::<f32>();
        for (r, o) in rows.remainder().iter().zip(outs.into_remainder()) {
            *o = exp((r - shift) * scale);
            sum += *o;
        }
        sum
    }

    /// Each lane's largest value above `-inf` and the first index it is at (`u32::MAX`
    /// where none is): one pass for [`argmax`].
    fn lane_maxima(row: &[f32]) -> ([f32; LANES], [u32; LANES]) {
        let mut top = [f32::NEG_INFINITY; LANES];
        let mut at = [u32::MAX; LANES];
        for (n, c) in row.chunks_exact(LANES).enumerate() {
            let base = (n * LANES) as u32;
            for i in 0..LANES {
                // NaN is never larger; the first of equal values stays.
                let larger = c[i] > top[i];
                top[i] = if larger { c[i] } else { top[i] };
                at[i] = if larger { base + i as u32 } else { at[i] };
            }
        }
        (top, at)
    }

    /// The largest value (NaN ignored) of each `chunk` values (a multiple of 16; the last
    /// chunk may be shorter).
    pub fn chunk_maxima(row: &[f32], chunk: usize) -> Vec<f32> {
        row.chunks(chunk)
            .map(|c| {
                let mut top = [f32::NEG_INFINITY; LANES];
                let mut lanes = c.chunks_exact(LANES);
                for l in &mut lanes {
                    for i in 0..LANES {
                        top[i] = if l[i] > top[i] { l[i] } else { top[i] };
                    }
                }
                let rest = lanes.remainder().iter().copied();
                rest.chain(top).fold(f32::NEG_INFINITY, |m, v| if v > m { v } else { m })
            })
            .collect()
    }

    /// Every value `v` of `row` with `lo <= v < hi` (NaN never), in order.
    pub fn values_in(row: &[f32], lo: f32, hi: f32) -> Vec<f32> {
        let mut found = Vec::new();
        let mut chunks = row.chunks_exact(LANES);
        for c in &mut chunks {
            let mut any = false;
            for v in c {
                any |= *v >= lo && *v < hi;
            }
            if any {
                found.extend(c.iter().filter(|v| **v >= lo && **v < hi));
            }
        }
        found.extend(chunks.remainder().iter().filter(|v| **v >= lo && **v < hi));
        found
    }

    /// The sum (in 16 f32 lanes) of the values at least `t` (NaN never).
    pub fn sum_at_least(row: &[f32], t: f32) -> f32 {
        let mut acc = [0f32; LANES];
        let mut chunks = row.chunks_exact(LANES);
        for c in &mut chunks {
            for i in 0..LANES {
                acc[i] += if c[i] >= t { c[i] } else { 0.0 };
            }
        }
        let tail: f32 = chunks.remainder().iter().filter(|v| **v >= t).sum();
        acc.iter().sum::<f32>() + tail
    }

    /// The sum [`exp_scaled`] returns for a `scale` of 1, in the same order, without
    /// writing the values: a log-sum-exp needs only the sum.
    pub fn exp_sum(row: &[f32], shift: f32) -> f32 {
        let mut acc = [0f32; LANES];
        let mut rows = row.chunks_exact(LANES);
        for r in &mut rows {
            for i in 0..LANES {
                acc[i] += exp(r[i] - shift);
            }
        }
        let mut sum = acc.iter().sum::<f32>();
        for r in rows.remainder() {
            sum += exp(r - shift);
        }
        sum
    }

    /// How many values are larger than `t` (a NaN never is).
    pub fn count_above(row: &[f32], t: f32) -> usize {
        // Counted in f32 lanes (which vectorize where integer lanes of bools do not),
        // exact while a lane counts below 2^24: blocks of 2^20 chunks.
        let mut count = 0;
        for block in row.chunks(LANES << 20) {
            let mut acc = [0f32; LANES];
            let mut chunks = block.chunks_exact(LANES);
            for c in &mut chunks {
                for i in 0..LANES {
                    acc[i] += if c[i] > t { 1.0 } else { 0.0 };
                }
            }
            count += chunks.remainder().iter().filter(|&&v| v > t).count();
            count += acc.iter().map(|&a| a as usize).sum::<usize>();
        }
        count
    }
}

/// The index of the largest value; the lowest index wins a tie (0 for an all-NaN row).
pub fn argmax(row: &[f32]) -> usize {
    let whole = row.len() - row.len() % LANES;
    if u32::try_from(whole).is_ok() {
        let (top, at) = lane_maxima(&row[..whole]);
        // The lanes' and the tail's candidates: the largest value, then the lowest index.
        let tail = (whole..row.len()).map(|i| (row[i], i));
        let lanes = top.into_iter().zip(at).filter(|&(_, a)| a != u32::MAX);
        let best = lanes
            .map(|(v, a)| (v, a as usize))
            .chain(tail.filter(|(v, _)| *v > f32::NEG_INFINITY))
            .reduce(|b, c| {
                if c.0 > b.0 || c.0 == b.0 && c.1 < b.1 {
                    c
                } else {
                    b
                }
            });
        if let Some((_, i)) = best {
            return i;
        }
    }
    // Nothing above -inf (or a row past u32 indices): the first -inf, else 0.
    position_of(row, max(row)).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lantern_quant::{force_kernel, Kernel};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed ^ 0x9e37_79b9_7f4a_7c15;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 30.0 + 1e-3
            })
            .collect()
    }

    #[test]
    fn every_level_matches_plain_loops() {
        for n in [1usize, 15, 16, 17, 100, 4099] {
            let row = random(n, n as u64);
            let expect_max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut expect_arg = 0;
            for (i, &v) in row.iter().enumerate() {
                if v > row[expect_arg] {
                    expect_arg = i;
                }
            }
            let mut sums = Vec::new();
            for level in Kernel::ALL
                .into_iter()
                .filter(|k| k.available() && k.is_exact())
            {
                force_kernel(Some(level));
                assert_eq!(max(&row), expect_max, "{level} n={n}");
                assert_eq!(argmax(&row), expect_arg, "{level} n={n}");
                let mut out = vec![0f32; n];
                let sum = exp_scaled(&row, expect_max, 0.7, &mut out);
                let mut unscaled = vec![0f32; n];
                let unscaled_sum = exp_scaled(&row, expect_max, 1.0, &mut unscaled);
                assert_eq!(exp_sum(&row, expect_max).to_bits(), unscaled_sum.to_bits());
                let t = row[n / 2];
                let above = row.iter().filter(|&&v| v > t).count();
                assert_eq!(count_above(&row, t), above, "{level} n={n}");
                force_kernel(None);
                let mut expect_sum = 0f64;
                for (o, &v) in out.iter().zip(&row) {
                    let e = (((v - expect_max) * 0.7) as f64).exp();
                    expect_sum += e;
                    assert!((*o as f64 - e).abs() <= 1e-6 * e.max(1e-30), "{level}");
                }
                assert!(
                    (sum as f64 - expect_sum).abs() < 1e-5 * expect_sum,
                    "{level}"
                );
                sums.push((sum, out));
            }
            assert!(
                sums.windows(2).all(|w| w[0] == w[1]),
                "levels differ at n={n}"
            );
        }
    }

    #[test]
    fn ties_go_to_the_lowest_index() {
        let mut row = vec![0.0f32; 40];
        row[5] = 2.0;
        row[33] = 2.0;
        assert_eq!(argmax(&row), 5);
        assert_eq!(argmax(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(position_of(&[], 1.0), None);
        assert_eq!(count_above(&[f32::NAN, 1.0, 2.0, 0.5], 0.5), 2);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY, f32::NEG_INFINITY]), 1);
        assert_eq!(argmax(&[]), 0);
    }

    /// The chunks' maxima and the values in a range are the plain loops', with NaN and
    /// ties, at every level.
    #[test]
    fn chunk_maxima_and_values_in_a_range() {
        for n in [0usize, 5, 16, 33, 4099] {
            let mut row = random(n, n as u64 + 99);
            row.iter_mut().step_by(7).for_each(|v| *v = f32::NAN);
            let mut bounds = row.iter().copied().filter(|v| !v.is_nan());
            let (lo, hi) = (
                bounds.nth(n / 3).unwrap_or(0.0),
                bounds.next().unwrap_or(1.0),
            );
            let (lo, hi) = (lo.min(hi), lo.max(hi));
            for level in Kernel::ALL.into_iter().filter(|k| k.available()) {
                force_kernel(Some(level));
                let maxima = chunk_maxima(&row, 32);
                let found = values_in(&row, lo, hi);
                let above = values_in(&row, lo, f32::INFINITY);
                let sum = sum_at_least(&row, lo);
                force_kernel(None);
                let want_sum: f64 = row
                    .iter()
                    .filter(|&&v| v >= lo)
                    .map(|&v| f64::from(v))
                    .sum();
                let scale: f64 = row
                    .iter()
                    .filter(|v| !v.is_nan())
                    .map(|&v| f64::from(v.abs()))
                    .sum();
                assert!(
                    (f64::from(sum) - want_sum).abs() <= 1e-5 * scale.max(1.0),
                    "{level} n={n}"
                );
                let want: Vec<f32> = row
                    .chunks(32)
                    .map(|c| c.iter().copied().fold(f32::NEG_INFINITY, f32::max))
                    .collect();
                assert_eq!(maxima, want, "{level} n={n}");
                let want: Vec<f32> = row.iter().copied().filter(|&v| lo <= v && v < hi).collect();
                assert_eq!(found, want, "{level} n={n}");
                let want: Vec<f32> = row.iter().copied().filter(|&v| v >= lo).collect();
                assert_eq!(above, want, "{level} n={n}");
            }
        }
    }

    /// The one-pass argmax gives the index the two passes (the largest value, then its
    /// first index) give, on fresh rows with ties, NaNs and -inf at every level.
    #[test]
    fn argmax_is_the_first_index_of_the_max() {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(7, |d| d.as_nanos() as u64);
        for len in (0..80).chain([4099, 40_000]) {
            let mut row = random(len, seed ^ len as u64);
            for (i, v) in row.iter_mut().enumerate() {
                // A coarse grid makes ties; some NaN and -inf.
                *v = match i % 11 {
                    3 => f32::NAN,
                    7 => f32::NEG_INFINITY,
                    _ => (*v / 8.0).round(),
                };
            }
            if len % 5 == 0 {
                row.iter_mut()
                    .step_by(2)
                    .for_each(|v| *v = f32::NEG_INFINITY);
            }
            let want = position_of(&row, max(&row)).unwrap_or(0);
            for level in Kernel::ALL.into_iter().filter(|k| k.available()) {
                force_kernel(Some(level));
                let got = argmax(&row);
                force_kernel(None);
                assert_eq!(got, want, "{level}, length {len}, seed {seed}");
            }
        }
    }
}
