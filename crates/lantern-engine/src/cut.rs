//! Where top-k, top-p and min-p cut a row of sampling weights, found without sorting the
//! vocabulary (a sampled row of Gemma 3 holds 262,144 weights).

use crate::sampling::SamplingParams;
use crate::vocab_row;

/// The smallest weight (`exp((logit - max) / temperature)`, the largest 1; `total`: their
/// sum) a token keeps under top-k, top-p and min-p, cut by value as
/// `lantern_model::pick::cut_weight` defines it (ties at a cut all kept).
pub(crate) fn cut_weight(weights: &[f32], total: f32, params: &SamplingParams) -> f32 {
    let mut floor = 0.0f32;
    // The weights top-k keeps, when it cuts, and their sum.
    let mut kept = None;
    let k = params.top_k;
    if k > 0 && k < vocab_row::count_above(weights, f32::NEG_INFINITY) {
        let mut values = top_candidates(weights, k);
        values.select_nth_unstable_by(k - 1, descending);
        floor = values[k - 1];
        values.retain(|&w| w >= floor);
        let sum = values.iter().map(|&w| f64::from(w)).sum::<f64>();
        kept = Some((values, sum));
    }
    if params.top_p < 1.0 {
        let nucleus_floor = match kept {
            Some((values, sum)) => nucleus_floor(values, f64::from(params.top_p) * sum),
            None => nucleus_floor_of_row(weights, f64::from(params.top_p) * f64::from(total)),
        };
        if let Some(y) = nucleus_floor {
            floor = floor.max(y);
        }
    }
    floor.max(params.min_p)
}

/// Largest first (NaN is never among the values sorted here).
fn descending(a: &f32, b: &f32) -> std::cmp::Ordering {
    b.total_cmp(a)
}

/// Every non-NaN weight of `weights` that can be among its `want` largest, and some more
/// ([`candidates_bound`]; all of them where it gives no bound).
fn top_candidates(weights: &[f32], want: usize) -> Vec<f32> {
    match candidates_bound(weights, want) {
        None => every_weight(weights),
        Some(bound) => vocab_row::values_in(weights, bound, f32::INFINITY),
    }
}

/// A value every one of the `want` largest weights reaches, close below the `want`-th
/// largest: the `want`-th largest of the chunks' maxima (they are `want` weights that
/// reach it), so a pass over the row and a selection among its chunks' maxima leave a
/// few thousand weights of a 262,144-token row. `None` when the row has too few chunks
/// to tell (every weight is a candidate then).
fn candidates_bound(weights: &[f32], want: usize) -> Option<f32> {
    // Chunks of 16 to 256 values, at least four times `want` of them.
    let chunk = (weights.len() / want.max(1) / 4).clamp(16, 256);
    let chunk = 1 << chunk.ilog2();
    let mut maxima = vocab_row::chunk_maxima(weights, chunk);
    if maxima.len() <= want {
        return None;
    }
    maxima.select_nth_unstable_by(want - 1, descending);
    Some(maxima[want - 1])
}

/// Every non-NaN weight.
fn every_weight(weights: &[f32]) -> Vec<f32> {
    vocab_row::values_in(weights, f32::NEG_INFINITY, f32::INFINITY)
}

/// How many of the largest weights the nucleus is first looked for among: most rows'
/// nuclei hold a few to a few hundred tokens.
const FIRST_PASS: usize = 1024;

/// The weight of the last token of the nucleus: the shortest largest-first run of the
/// weights whose sum (in f64) reaches `target`, ties at its end all in it; `None` when
/// the whole row falls short. A peaked row's nucleus is found among its largest 1,024
/// weights; a flat row's (thousands of tokens, up to most of the vocabulary) from the
/// row's mass by value ([`floor_by_mass`]), never sorting more than one bin of it.
fn nucleus_floor_of_row(weights: &[f32], target: f64) -> Option<f32> {
    let first = match candidates_bound(weights, FIRST_PASS) {
        None => return nucleus_floor(every_weight(weights), target),
        // All the candidates together falling short (a flat row), the largest 1,024
        // are not listed: the mass by value finds the floor. (A sum in f32 lanes only
        // chooses the way; each way finds the same floor.)
        Some(bound) if f64::from(vocab_row::sum_at_least(weights, bound)) < target => None,
        Some(bound) => {
            let mut values = vocab_row::values_in(weights, bound, f32::INFINITY);
            floor_in_largest(&mut values, FIRST_PASS, target)
        }
    };
    first.or_else(|| {
        floor_by_mass(weights.iter().copied(), target, |lo, hi| {
            vocab_row::values_in(weights, lo, hi)
        })
    })
}

/// [`nucleus_floor_of_row`] of a list of weights (those top-k kept).
fn nucleus_floor(mut values: Vec<f32>, target: f64) -> Option<f32> {
    if values.len() <= FIRST_PASS {
        values.sort_unstable_by(descending);
        return reaches(&values, 0.0, target);
    }
    floor_in_largest(&mut values, FIRST_PASS, target).or_else(|| {
        floor_by_mass(values.iter().copied(), target, |lo, hi| {
            values
                .iter()
                .copied()
                .filter(|&w| lo <= w && w < hi)
                .collect()
        })
    })
}

/// The nucleus's floor when it lies within the `first` largest of `values` (every weight
/// of the row that can be among them; a row of NaNs may leave fewer).
fn floor_in_largest(values: &mut [f32], first: usize, target: f64) -> Option<f32> {
    let first = first.min(values.len());
    if first == 0 {
        return None;
    }
    values.select_nth_unstable_by(first - 1, descending);
    let largest = &mut values[..first];
    largest.sort_unstable_by(descending);
    reaches(largest, 0.0, target)
}

/// The first of `sorted` at which the running sum, from `sum`, reaches `target`.
fn reaches(sorted: &[f32], mut sum: f64, target: f64) -> Option<f32> {
    sorted.iter().copied().find(|&w| {
        sum += f64::from(w);
        sum >= target
    })
}

/// Each bin holds the weights whose f32 bits shifted right by this are its index: a
/// 32nd of a binade (the bits of non-negative floats order as their values).
const BIN_SHIFT: u32 = 18;
/// The bins of every finite non-negative f32 (+inf, NaN and negative values have none).
const BINS: usize = (0x7F80_0000u32 >> BIN_SHIFT) as usize;

/// The nucleus's floor from the mass of the weights by value: one pass sums the weights
/// into bins (in f64); walking the bins from the largest, the bin where the sum reaches
/// `target` is the only one whose weights (`in_bin(lo, hi)`: those in `[lo, hi)`) are
/// sorted. Every weight of the bins above is larger than all of it, so the running sum
/// at each of its weights is the one a sort of the whole row gives (up to the order of
/// the f64 sums).
fn floor_by_mass(
    weights: impl Iterator<Item = f32>,
    target: f64,
    in_bin: impl Fn(f32, f32) -> Vec<f32>,
) -> Option<f32> {
    let mut mass = vec![0f64; BINS];
    for w in weights {
        if let Some(m) = mass.get_mut((w.to_bits() >> BIN_SHIFT) as usize) {
            *m += f64::from(w);
        }
    }
    let mut above = 0f64;
    for (bin, &m) in mass.iter().enumerate().rev() {
        // Bins of zeros add nothing, so they never end the nucleus.
        if m == 0.0 {
            continue;
        }
        if above + m < target {
            above += m;
            continue;
        }
        let bin = bin as u32;
        let lo = f32::from_bits(bin << BIN_SHIFT);
        let hi = f32::from_bits((bin + 1) << BIN_SHIFT);
        let mut values = in_bin(lo, hi);
        values.sort_unstable_by(descending);
        match reaches(&values, above, target) {
            Some(y) => return Some(y),
            // Summed in another order, the bin fell short after all: on to the next.
            None => above += values.iter().map(|&w| f64::from(w)).sum::<f64>(),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The tokens top-k, top-p and min-p keep.
    fn kept(logits: &[f32], params: &SamplingParams) -> Vec<u32> {
        let max = vocab_row::max(logits);
        let mut weights = vec![0f32; logits.len()];
        let total = vocab_row::exp_scaled(logits, max, 1.0 / params.temperature, &mut weights);
        let floor = cut_weight(&weights, total, params);
        (0..logits.len() as u32)
            .filter(|&i| weights[i as usize] >= floor)
            .collect()
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        let logits = [10.0, 9.0, -10.0, -10.0];
        let p = SamplingParams {
            top_p: 0.9,
            ..SamplingParams::default()
        };
        assert_eq!(kept(&logits, &p), vec![0, 1]);
        // Ties at the cut are all kept.
        let p = SamplingParams {
            top_k: 2,
            ..SamplingParams::default()
        };
        assert_eq!(kept(&[1.0, 3.0, 2.0, 2.0], &p), vec![1, 2, 3]);
    }

    /// The host's cut is the reference's (lantern-model's `cut_weight`, a sort of the
    /// whole row), on flat and peaked rows of a large vocabulary whose cut lies inside
    /// and beyond the first pass; a token or two may move at the boundary with the order
    /// of the sums (the total is summed in lanes here, in sorted order there).
    #[test]
    fn cuts_match_the_reference_on_a_large_vocabulary() {
        let mut rng = StdRng::seed_from_u64(11);
        for round in 0..6 {
            let spread = if round % 2 == 0 { 2.0 } else { 12.0 };
            let logits: Vec<f32> = (0..20_000).map(|_| rng.gen::<f32>() * spread).collect();
            for (top_k, top_p, min_p) in [
                (0, 0.5, 0.0),
                (0, 0.95, 0.0),
                (50, 0.9, 0.0),
                (0, 1.0, 0.05),
                (0, 0.8, 0.01),
                (3000, 1.0, 0.0),
                (5000, 0.9, 0.0),
            ] {
                let params = SamplingParams {
                    temperature: 0.8,
                    top_k,
                    top_p,
                    min_p,
                    ..SamplingParams::default()
                };
                let got: std::collections::HashSet<u32> =
                    kept(&logits, &params).into_iter().collect();
                let weights: Vec<f32> = logits
                    .iter()
                    .map(|&l| ((l - vocab_row::max(&logits)) / 0.8).exp())
                    .collect();
                let d = lantern_model::SampleDraw {
                    top_k,
                    top_p,
                    min_p,
                    ..lantern_model::SampleDraw::whole(0.0, 1.0 / 0.8)
                };
                let floor = lantern_model::pick::cut_weight(&weights, &d);
                let want: std::collections::HashSet<u32> = (0..logits.len() as u32)
                    .filter(|&i| weights[i as usize] >= floor)
                    .collect();
                let differ = got.symmetric_difference(&want).count();
                assert!(differ <= 2, "{top_k} {top_p} {min_p}: {differ} differ");
                assert!(!got.is_empty());
                if top_k > 0 && top_p == 1.0 {
                    assert_eq!(got.len(), top_k, "no ties among random logits");
                }
            }
        }
    }

    /// The nucleus's floor, from the largest 1,024 weights or from the mass by value, of
    /// a row or of a list, is the one a sort of all the weights and a running f64 sum
    /// find, whether the nucleus holds a few tokens or most of the vocabulary; on rows with
    /// ties, zeros and NaN, at every vector level.
    #[test]
    fn the_nucleus_floor_is_the_whole_sorts() {
        use lantern_quant::{force_kernel, Kernel};
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(5, |d| d.as_nanos() as u64);
        let mut rng = StdRng::seed_from_u64(seed);
        let mut sizes = std::collections::BTreeSet::new();
        for (spread, vocab) in [
            (0.5f32, 49_152u32),
            (3.0, 49_152),
            (8.0, 262_144),
            (20.0, 49_152),
            (60.0, 3000),
        ] {
            let weights: Vec<f32> = (0..vocab)
                .map(|i| match i % 997 {
                    5 => f32::NAN,
                    9 => 0.0,
                    // Values on a grid of 1/64: ties at every size of nucleus.
                    _ => ((rng.gen::<f32>() * 64.0).round() / 64.0 * spread - spread).exp(),
                })
                .collect();
            let mut sorted: Vec<f32> = weights.iter().copied().filter(|w| !w.is_nan()).collect();
            sorted.sort_unstable_by(descending);
            let total: f64 = sorted.iter().map(|&w| f64::from(w)).sum();
            for top_p in [0.01f64, 0.3, 0.9, 0.99, 0.9999, 1.5] {
                let target = top_p * total;
                let want = reaches(&sorted, 0.0, target);
                for level in Kernel::ALL.into_iter().filter(|k| k.available()) {
                    force_kernel(Some(level));
                    let of_row = nucleus_floor_of_row(&weights, target);
                    force_kernel(None);
                    assert_eq!(
                        of_row, want,
                        "spread {spread}, top-p {top_p}, {level}, seed {seed}"
                    );
                }
                let of_list = nucleus_floor(sorted.clone(), target);
                assert_eq!(
                    of_list, want,
                    "spread {spread}, top-p {top_p}: list, seed {seed}"
                );
                if let Some(y) = want {
                    sizes.insert(match sorted.iter().filter(|&&w| w >= y).count() {
                        0..=1024 => "first pass",
                        _ => "by mass",
                    });
                }
            }
        }
        assert_eq!(sizes.len(), 2, "nuclei found both ways: {sizes:?}");
    }

    /// A row of NaNs but for a few weights (a model gone wrong) still gets a cut, at
    /// every size of vocabulary, and never a panic.
    #[test]
    fn a_row_of_nans_gets_a_cut() {
        for n in [40usize, 5000, 262_144] {
            let mut weights = vec![f32::NAN; n];
            for (i, w) in [1.0f32, 0.5, 0.25, 0.125].into_iter().enumerate() {
                weights[i * n / 4] = w;
            }
            let total = 1.875;
            for (top_k, top_p, want) in [
                (0, 0.5, 1.0),
                (0, 0.9, 0.25),
                (2, 0.99, 0.5),
                (0, 0.99, 0.125),
            ] {
                let params = SamplingParams {
                    top_k,
                    top_p,
                    ..SamplingParams::default()
                };
                assert_eq!(
                    cut_weight(&weights, total, &params),
                    want,
                    "n {n}, top-k {top_k}, top-p {top_p}"
                );
            }
        }
    }

    /// The candidates for the largest `want` hold them all (ties at the last one too),
    /// and are every weight when they say so, on rows with ties and NaN.
    #[test]
    fn top_candidates_hold_the_largest() {
        let mut rng = StdRng::from_entropy();
        for n in [10usize, 3000, 49_152, 262_144] {
            let weights: Vec<f32> = (0..n)
                .map(|i| match i % 101 {
                    13 => f32::NAN,
                    _ => (rng.gen::<f32>() * 32.0).round() / 32.0,
                })
                .collect();
            let mut sorted: Vec<f32> = weights.iter().copied().filter(|w| !w.is_nan()).collect();
            sorted.sort_unstable_by(descending);
            for want in [1usize, 5, 64, 1024, 16_384] {
                let got = top_candidates(&weights, want);
                if candidates_bound(&weights, want).is_none() {
                    assert_eq!(got.len(), sorted.len(), "n {n}, want {want}");
                }
                let last = sorted[want.min(sorted.len()) - 1];
                let reaching = sorted.iter().take_while(|&&w| w >= last).count();
                let got_reaching = got.iter().filter(|&&w| w >= last).count();
                assert_eq!(got_reaching, reaching, "n {n}, want {want}");
            }
        }
    }
}
