//! Probabilities of many query rows over one kv head's keys, for work that scores rows
//! after the fact (a capture's maps when its request finishes): the keys are transposed
//! once, as the flash kernel's prefill items do, and two rows are scored per pass over
//! them ([`row_kernels::dots_pair`]). The same bits as [`row_probabilities`] row by row;
//! where the two-row kernels do not run (other CPUs, head dims off 16, the bf16 tiles of
//! the opt-in `amx-bf16` level) it is [`row_probabilities`] itself.

use std::ops::Range;

use super::kernels::{probabilities_from_scores, row_probabilities};
use super::row_kernels::{self, KEYS};
use crate::AttentionLayerSpec;

/// One kv head's keys made ready for scoring query rows against them.
pub struct RowScorer<'a> {
    /// `[n, d]`, position order: what the one-row path reads.
    keys: &'a [f32],
    d: usize,
    /// The keys in blocks of 16 ([`row_kernels::transpose_keys`]); empty where the
    /// two-row kernels do not run.
    transposed: Vec<f32>,
    /// Two rows' scores over the keys both see.
    scores: [Vec<f32>; 2],
}

impl<'a> RowScorer<'a> {
    /// `keys`: `[n, d]` row-major, the keys rows are scored against (index 0 the first).
    pub fn new(keys: &'a [f32], d: usize) -> Self {
        let mut transposed = Vec::new();
        if d > 0 && two_rows_run(d) {
            transposed = vec![0f32; row_kernels::transposed_len(keys.len() / d, d)];
            row_kernels::transpose_keys(keys, d, &mut transposed);
        }
        Self {
            keys,
            d,
            transposed,
            scores: Default::default(),
        }
    }

    /// Bytes it holds beside the keys it was given, for `n` keys of `d` dimensions (at
    /// most; saturating): none where the two-row kernels cannot run for `d`.
    pub fn held_bytes(n: usize, d: usize) -> u64 {
        if d == 0 || !d.is_multiple_of(row_kernels::LANES) {
            return 0;
        }
        // The transposed keys (rounded up to a block) and two rows of scores.
        let transposed = (n.div_ceil(KEYS) as u64).saturating_mul((KEYS * d) as u64);
        let scores = (n as u64).saturating_add(KEYS as u64).saturating_mul(2);
        transposed.saturating_add(scores).saturating_mul(4)
    }

    /// The probabilities query rows `q[r]` of query head `query_head` give keys
    /// `visible[r]` on `layer`, into `out[r]` (`visible[r].len()` long each): the bits of
    /// [`row_probabilities`] over those keys. A row of no keys is left alone.
    pub fn probabilities(
        &mut self,
        layer: &AttentionLayerSpec,
        query_head: usize,
        q: [&[f32]; 2],
        visible: [Range<usize>; 2],
        out: [&mut [f32]; 2],
    ) {
        let d = self.d;
        if self.transposed.is_empty() || visible.iter().any(|v| v.is_empty()) {
            for ((q, visible), out) in q.into_iter().zip(visible).zip(out) {
                if !visible.is_empty() {
                    let keys = &self.keys[visible.start * d..visible.end * d];
                    row_probabilities(layer, query_head, q, keys, out);
                }
            }
            return;
        }
        // Both rows over the keys either sees, from the start of a transposed block:
        // a key's score does not depend on the others scored beside it.
        let first = visible[0].start.min(visible[1].start) / KEYS * KEYS;
        let end = visible[0].end.max(visible[1].end);
        let [s0, s1] = &mut self.scores;
        for s in [&mut *s0, &mut *s1] {
            s.resize(end - first, 0.0);
        }
        row_kernels::dots_pair(
            q,
            &self.transposed[first * d..],
            d,
            [s0.as_mut_slice(), s1.as_mut_slice()],
        );
        for ((scores, visible), out) in [&*s0, &*s1].into_iter().zip(visible).zip(out) {
            out.copy_from_slice(&scores[visible.start - first..visible.end - first]);
            probabilities_from_scores(layer, query_head, out);
        }
    }
}

/// Whether the two-row kernels give [`row_probabilities`]' scores here: they run for this
/// head dim, and the scores do not come from the bf16 tiles.
fn two_rows_run(d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if lantern_quant::active_kernel() == lantern_quant::Kernel::AmxBf16
        && lantern_quant::bf16_tiles::Bf16Tiles::in_effect().is_some()
    {
        return false;
    }
    row_kernels::pays(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lantern_quant::{force_kernel, Kernel};
    use rand::{Rng, SeedableRng};

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    fn layer(head_dim: usize, cap: Option<f32>) -> AttentionLayerSpec {
        let mut layer = AttentionLayerSpec::new(4, 2, head_dim);
        layer.logits_soft_cap = cap;
        layer.sinks = Some(vec![0.5, -1.0, 2.0, 0.0]);
        layer
    }

    /// Pairs of rows over windows on and off the 16-key blocks, of different lengths and
    /// one empty, equal `row_probabilities` row by row, at every level this CPU runs.
    #[test]
    fn pairs_of_rows_equal_row_probabilities() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for d in [16, 64, 72] {
            for (trial, cap) in [None, Some(20.0)].into_iter().cycle().take(16).enumerate() {
                let n = rng.gen_range(1..90);
                let keys: Vec<f32> = (0..n * d).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let q: Vec<Vec<f32>> = (0..2)
                    .map(|_| (0..d).map(|_| rng.gen_range(-2.0..2.0)).collect())
                    .collect();
                let layer = layer(d, cap);
                let visible: [Range<usize>; 2] = std::array::from_fn(|_| {
                    let a = rng.gen_range(0..=n);
                    let b = rng.gen_range(0..=n);
                    a.min(b)..a.max(b)
                });
                // Every exact level this CPU runs (tests beside this one run at whatever
                // level is forced; `amx-bf16` is tested in `tests/bf16_tiles.rs`).
                for level in Kernel::ALL
                    .into_iter()
                    .filter(|k| k.available() && k.is_exact())
                {
                    force_kernel(Some(level));
                    let mut scorer = RowScorer::new(&keys, d);
                    let mut got = visible.clone().map(|v| vec![7f32; v.len()]);
                    let [g0, g1] = &mut got;
                    scorer.probabilities(&layer, 2, [&q[0], &q[1]], visible.clone(), [g0, g1]);
                    for r in 0..2 {
                        let v = visible[r].clone();
                        let mut want = vec![7f32; v.len()];
                        if !v.is_empty() {
                            row_probabilities(
                                &layer,
                                2,
                                &q[r],
                                &keys[v.start * d..v.end * d],
                                &mut want,
                            );
                        }
                        assert!(
                            same_bits(&got[r], &want),
                            "seed {seed} trial {trial} d {d} n {n} {visible:?} row {r} at {level}"
                        );
                    }
                }
                force_kernel(None);
            }
        }
    }
}
