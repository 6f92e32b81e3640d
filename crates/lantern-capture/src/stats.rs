//! Key statistics: what each key received from the captured rows, per layer — the sum
//! over rows of its probability (H2O's accumulated attention score), its maximum, and
//! the sum per KV cache block — computed from the same probabilities as the maps, one
//! row at a time (O(keys) per row and group), so a request can have them without the
//! `rows × keys` maps.

use lantern_attn::AttentionLayerSpec;

use crate::error::CaptureError;

/// One statistic over the keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KeyStat {
    /// Sum over the captured rows of each key's probability.
    KeyMass,
    /// Largest probability each key received from one captured row.
    KeyMax,
    /// `KeyMass` summed over the keys of each KV cache block.
    BlockMass,
}

impl KeyStat {
    pub const ALL: [KeyStat; 3] = [Self::KeyMass, Self::KeyMax, Self::BlockMass];

    pub fn parse(s: &str) -> Result<Self, CaptureError> {
        Self::ALL
            .into_iter()
            .find(|stat| stat.as_str() == s.trim())
            .ok_or_else(|| CaptureError::InvalidField {
                field: "attn_capture_stats",
                message: format!("{s:?} is not \"key_mass\", \"key_max\" or \"block_mass\""),
            })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::KeyMass => "key_mass",
            Self::KeyMax => "key_max",
            Self::BlockMass => "block_mass",
        }
    }
}

/// Over which heads a statistic is kept: one series per group of query heads, the
/// mean of the group's probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StatHeads {
    /// One per KV head: the mean over its captured query heads (what a per-head KV
    /// cache eviction policy scores).
    #[default]
    Kv,
    /// One per captured query head.
    Query,
    /// One for all captured heads: their mean.
    Mean,
}

impl StatHeads {
    pub fn parse(s: &str) -> Result<Self, CaptureError> {
        match s.trim() {
            "kv" => Ok(Self::Kv),
            "query" => Ok(Self::Query),
            "mean" => Ok(Self::Mean),
            other => Err(CaptureError::InvalidField {
                field: "attn_capture_stats_heads",
                message: format!("{other:?} is not \"kv\", \"query\" or \"mean\""),
            }),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kv => "kv",
            Self::Query => "query",
            Self::Mean => "mean",
        }
    }

    /// The groups of `heads` (captured query heads, ascending) on `layer`: each the
    /// indices into `heads` whose probabilities it averages.
    pub fn groups(self, heads: &[usize], layer: &AttentionLayerSpec) -> Vec<Vec<usize>> {
        match self {
            Self::Query => (0..heads.len()).map(|i| vec![i]).collect(),
            Self::Mean => vec![(0..heads.len()).collect()],
            Self::Kv => {
                let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
                for (i, &h) in heads.iter().enumerate() {
                    let kv = layer.kv_head_for(h);
                    match groups.iter_mut().find(|(g, _)| *g == kv) {
                        Some((_, members)) => members.push(i),
                        None => groups.push((kv, vec![i])),
                    }
                }
                groups.sort_by_key(|(kv, _)| *kv);
                groups.into_iter().map(|(_, members)| members).collect()
            }
        }
    }

    /// At most this many groups for `heads` captured heads (for size estimates).
    pub fn max_groups(self, heads: usize) -> usize {
        match self {
            Self::Query | Self::Kv => heads,
            Self::Mean => heads.min(1),
        }
    }
}

/// One statistic of one layer: `[groups, keys]` (`[groups, blocks]` for block mass),
/// row-major, in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerStat {
    pub layer_idx: usize,
    pub stat: KeyStat,
    pub shape: [usize; 2],
    pub values: Vec<f32>,
}

/// One row's probability per group and key into `out` (`[groups, keys]`) from `dense`
/// (`[heads, keys]`): the mean of each group's heads, summed in head order then scaled,
/// as `mean_heads` maps are.
pub(crate) fn group_row(groups: &[Vec<usize>], dense: &[f32], keys: usize, out: &mut [f32]) {
    for (g, members) in groups.iter().enumerate() {
        let out = &mut out[g * keys..(g + 1) * keys];
        out.fill(0.0);
        for &h in members {
            for (o, &p) in out.iter_mut().zip(&dense[h * keys..(h + 1) * keys]) {
                *o += p;
            }
        }
        if members.len() > 1 {
            let inv = 1.0 / members.len() as f32;
            out.iter_mut().for_each(|o| *o *= inv);
        }
    }
}

/// Accumulates one layer's statistics as its rows are computed.
pub(crate) struct KeyStatsAccumulator {
    groups: Vec<Vec<usize>>,
    num_keys: usize,
    mass: Vec<f32>,
    max: Option<Vec<f32>>,
    /// One row's value per group and key.
    row: Vec<f32>,
}

impl KeyStatsAccumulator {
    pub(crate) fn new(groups: Vec<Vec<usize>>, num_keys: usize, keep_max: bool) -> Self {
        let len = groups.len() * num_keys;
        Self {
            groups,
            num_keys,
            mass: vec![0.0; len],
            max: keep_max.then(|| vec![0.0; len]),
            row: vec![0.0; len],
        }
    }

    /// Adds one row: `dense` is `[heads, keys]`, the probabilities of every captured
    /// head (zero where a key is not visible). A group's value is the mean of its
    /// heads' probabilities, summed in head order then scaled, as `mean_heads` maps are.
    pub(crate) fn add_row(&mut self, dense: &[f32]) {
        group_row(&self.groups, dense, self.num_keys, &mut self.row);
        for (m, &v) in self.mass.iter_mut().zip(&self.row) {
            *m += v;
        }
        if let Some(max) = &mut self.max {
            for (m, &v) in max.iter_mut().zip(&self.row) {
                *m = m.max(v);
            }
        }
    }

    /// The statistics asked for (in `stats`' order), blocks of `block_size` keys.
    pub(crate) fn finish(
        self,
        layer_idx: usize,
        stats: &[KeyStat],
        block_size: usize,
    ) -> Vec<LayerStat> {
        let (groups, keys) = (self.groups.len(), self.num_keys);
        let block_size = block_size.max(1);
        let blocks = keys.div_ceil(block_size);
        stats
            .iter()
            .map(|&stat| {
                let (shape, values) = match stat {
                    KeyStat::KeyMass => ([groups, keys], self.mass.clone()),
                    KeyStat::KeyMax => ([groups, keys], self.max.clone().unwrap_or_default()),
                    KeyStat::BlockMass => {
                        let values = if keys == 0 {
                            Vec::new()
                        } else {
                            self.mass
                                .chunks_exact(keys)
                                .flat_map(|group| {
                                    group.chunks(block_size).map(|b| b.iter().sum::<f32>())
                                })
                                .collect()
                        };
                        ([groups, blocks], values)
                    }
                };
                LayerStat {
                    layer_idx,
                    stat,
                    shape,
                    values,
                }
            })
            .collect()
    }
}

impl KeyStatsAccumulator {
    /// An accumulator holding statistics already summed (`mass`, `max`: per group, its
    /// keys so far), widened with zeros to `num_keys` keys.
    fn from_parts(
        groups: Vec<Vec<usize>>,
        num_keys: usize,
        mass: &[Vec<f32>],
        max: Option<&[Vec<f32>]>,
    ) -> Self {
        let flat = |series: &[Vec<f32>]| {
            let mut out = vec![0f32; groups.len() * num_keys];
            for (dst, src) in out.chunks_exact_mut(num_keys.max(1)).zip(series) {
                let n = src.len().min(num_keys);
                dst[..n].copy_from_slice(&src[..n]);
            }
            out
        };
        let len = groups.len() * num_keys;
        Self {
            mass: flat(mass),
            max: max.map(flat),
            row: vec![0.0; len],
            groups,
            num_keys,
        }
    }
}

lantern_quant::per_level! {
/// Adds one row of one group to its sums: the row's value of key `k` is the mean of the
/// group's heads (`members`, indices into `heads`, whose entries are rows of `values`,
/// `[heads, mass.len()]`), summed in order from zero then scaled, as [`group_row`]
/// computes it; `mass[k] += value`, `max[k] = max[k].max(value)`. In 16-lane chunks, so
/// it vectorizes; every operation is the one [`group_row`] and
/// [`KeyStatsAccumulator::add_row`] make, so the same bits.
fn add_group(
    values: &[f32],
    heads: &[usize],
    members: &[usize],
    mass: &mut [f32],
    max: Option<&mut [f32]>,
) {
    const L: usize = 16;
    let n = mass.len();
    let inv = (members.len() > 1).then(|| 1.0 / members.len() as f32);
    let mut max = max;
    let full = n / L * L;
    let mut k = 0;
    while k < full {
        let mut v = [0f32; L];
        for &m in members {
            let p = &values[heads[m] * n + k..][..L];
            for i in 0..L {
                v[i] += p[i];
            }
        }
        if let Some(inv) = inv {
            for x in v.iter_mut() {
                *x *= inv;
            }
        }
        let sums = &mut mass[k..k + L];
        for i in 0..L {
            sums[i] += v[i];
        }
        if let Some(max) = max.as_deref_mut() {
            let max = &mut max[k..k + L];
            for i in 0..L {
                max[i] = max[i].max(v[i]);
            }
        }
        k += L;
    }
    for k in full..n {
        let mut v = 0f32;
        for &m in members {
            v += values[heads[m] * n + k];
        }
        if let Some(inv) = inv {
            v *= inv;
        }
        mass[k] += v;
        if let Some(max) = max.as_deref_mut() {
            max[k] = max[k].max(v);
        }
    }
}
}

/// Key statistics summed as a request's rows run, one row at a time in position order,
/// from the probabilities the attention kernel computed for them
/// ([`lantern_attn::RowProbabilities`]): the same values and the same additions, in the
/// same order, as [`KeyStatsAccumulator`] makes when finalizing, so the same bits, and
/// finalizing has no rows left to compute for them.
///
/// Rows must come in order from the first row the capture selects, each once, on every
/// captured layer; anything else (a row the backend did not give, a row run again after
/// a preemption) stops the live sums, and finalizing computes the statistics itself.
#[derive(Debug, Clone)]
pub(crate) struct LiveKeyStats {
    /// Per captured layer slot.
    layers: Vec<LiveLayer>,
    /// The first row summed.
    first_row: usize,
    stopped: bool,
}

#[derive(Debug, Clone)]
struct LiveLayer {
    /// As [`StatHeads::groups`]: indices into the captured heads.
    groups: Vec<Vec<usize>>,
    /// The next row expected.
    next: usize,
    /// Per group, per key seen so far.
    mass: Vec<Vec<f32>>,
    max: Option<Vec<Vec<f32>>>,
}

impl LiveKeyStats {
    /// Sums for the layers' `groups` (per captured layer slot), from row `first_row` on.
    pub(crate) fn new(groups: Vec<Vec<Vec<usize>>>, first_row: usize, keep_max: bool) -> Self {
        Self {
            layers: groups
                .into_iter()
                .map(|groups| LiveLayer {
                    mass: vec![Vec::new(); groups.len()],
                    max: keep_max.then(|| vec![Vec::new(); groups.len()]),
                    groups,
                    next: first_row,
                })
                .collect(),
            first_row,
            stopped: false,
        }
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped
    }

    pub(crate) fn stop(&mut self) {
        self.stopped = true;
        self.layers.iter_mut().for_each(|l| {
            l.mass = Vec::new();
            l.max = None;
        });
    }

    /// Adds the row at `pos` on captured layer slot `slot`: the `i`-th row of
    /// `probabilities`, whose head `heads[h]` is captured head `h`.
    pub(crate) fn add_row(
        &mut self,
        slot: usize,
        pos: usize,
        heads: &[usize],
        probabilities: &lantern_attn::RowProbabilities,
        i: usize,
    ) {
        if self.stopped {
            return;
        }
        let Some(layer) = self.layers.get_mut(slot) else {
            return self.stop();
        };
        let keys = probabilities.keys(i);
        if pos != layer.next || heads.iter().any(|&h| h >= probabilities.num_heads()) {
            return self.stop();
        }
        layer.next += 1;
        let values = probabilities.row(i);
        for (g, members) in layer.groups.iter().enumerate() {
            let mass = &mut layer.mass[g];
            if mass.len() < keys.end {
                mass.resize(keys.end, 0.0);
            }
            let max = layer.max.as_mut().map(|max| {
                let max = &mut max[g];
                if max.len() < keys.end {
                    max.resize(keys.end, 0.0);
                }
                &mut max[keys.clone()]
            });
            add_group(values, heads, members, &mut mass[keys.clone()], max);
        }
    }

    /// Stops unless captured layer slot `slot` has every row before `end` (from the
    /// first) summed.
    pub(crate) fn expect_rows(&mut self, slot: usize, end: usize) {
        if self
            .layers
            .get(slot)
            .is_none_or(|l| l.next < end.max(self.first_row))
        {
            self.stop();
        }
    }

    /// The accumulators of every captured layer slot, `num_keys` wide, when exactly
    /// `rows` were summed on every layer; `None` otherwise (finalizing then computes them).
    pub(crate) fn accumulators(
        &self,
        rows: &std::ops::Range<usize>,
        num_keys: usize,
    ) -> Option<Vec<KeyStatsAccumulator>> {
        self.covers(rows, num_keys).then(|| {
            self.layers
                .iter()
                .map(|l| {
                    KeyStatsAccumulator::from_parts(
                        l.groups.clone(),
                        num_keys,
                        &l.mass,
                        l.max.as_deref(),
                    )
                })
                .collect()
        })
    }

    /// Whether exactly `rows` were summed on every layer, within `num_keys` keys.
    pub(crate) fn covers(&self, rows: &std::ops::Range<usize>, num_keys: usize) -> bool {
        !self.stopped
            && !rows.is_empty()
            && rows.start == self.first_row
            && self
                .layers
                .iter()
                .all(|l| l.next == rows.end && l.mass.iter().all(|m| m.len() <= num_keys))
    }

    /// Bytes held by the sums.
    pub(crate) fn size_bytes(&self) -> usize {
        let series = |s: &Vec<Vec<f32>>| s.iter().map(Vec::capacity).sum::<usize>();
        4 * self
            .layers
            .iter()
            .map(|l| series(&l.mass) + l.max.as_ref().map_or(0, series))
            .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_ones_name_the_field() {
        for stat in KeyStat::ALL {
            assert_eq!(KeyStat::parse(stat.as_str()).unwrap(), stat);
        }
        let e = KeyStat::parse("mass").unwrap_err().to_string();
        assert!(e.contains("attn_capture_stats"), "{e}");
        for by in [StatHeads::Kv, StatHeads::Query, StatHeads::Mean] {
            assert_eq!(StatHeads::parse(by.as_str()).unwrap(), by);
        }
        let e = StatHeads::parse("all").unwrap_err().to_string();
        assert!(e.contains("attn_capture_stats_heads"), "{e}");
    }

    #[test]
    fn groups_follow_the_kv_heads_of_the_captured_heads() {
        // 9 query heads over 3 kv heads: heads 0-2 share kv head 0, and so on.
        let layer = AttentionLayerSpec::new(9, 3, 8);
        let heads = [1, 2, 4, 8];
        assert_eq!(
            StatHeads::Kv.groups(&heads, &layer),
            vec![vec![0, 1], vec![2], vec![3]]
        );
        assert_eq!(StatHeads::Query.groups(&heads, &layer).len(), 4);
        assert_eq!(
            StatHeads::Mean.groups(&heads, &layer),
            vec![vec![0, 1, 2, 3]]
        );
    }

    /// Rows summed live from the kernel's probabilities give the same bits as
    /// finalizing's accumulator over the same rows' dense probabilities (per KV head
    /// groups of a subset of heads, rows whose visible keys start past zero, keys that
    /// grow row by row); a row out of order stops the sums. Fresh random inputs.
    #[test]
    fn live_sums_equal_the_finalizing_accumulator() {
        use lantern_attn::RowProbabilities;
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let layer = AttentionLayerSpec::new(9, 3, 8);
        let heads = [0, 1, 2, 4, 5, 8];
        for by in [StatHeads::Kv, StatHeads::Query, StatHeads::Mean] {
            let groups = by.groups(&heads, &layer);
            let (first, rows) = (rng.gen_range(0..20), rng.gen_range(1..30));
            let num_keys = first + rows;
            let mut finalizing = KeyStatsAccumulator::new(groups.clone(), num_keys, true);
            let mut live = LiveKeyStats::new(vec![groups.clone()], first, true);
            let mut probs = RowProbabilities::default();
            for pos in first..first + rows {
                // A window: the row sees keys `start..=pos`.
                let start = pos.saturating_sub(rng.gen_range(0..12));
                let keys = start..pos + 1;
                probs.ask([0]);
                probs.prepare(9, |_| keys.clone());
                let (values, _, _) = probs.parts_mut();
                for v in values.iter_mut() {
                    *v = rng.gen_range(0.0..1.0f32).powi(3);
                }
                let mut dense = vec![0f32; heads.len() * num_keys];
                for (hi, &h) in heads.iter().enumerate() {
                    dense[hi * num_keys..][keys.clone()].copy_from_slice(probs.head(0, h));
                }
                finalizing.add_row(&dense);
                live.add_row(0, pos, &heads, &probs, 0);
            }
            let range = first..first + rows;
            let got = live
                .accumulators(&range, num_keys)
                .expect("every row summed");
            let stats = |acc: KeyStatsAccumulator| acc.finish(3, &KeyStat::ALL, 4);
            let (want, got) = (stats(finalizing), stats(got.into_iter().next().unwrap()));
            for (w, g) in want.iter().zip(&got) {
                let bits = |s: &LayerStat| s.values.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(w.shape, g.shape, "seed {seed} {by:?}");
                assert_eq!(bits(w), bits(g), "seed {seed} {by:?} {:?}", w.stat);
            }
            assert!(live
                .accumulators(&(first..first + rows + 1), num_keys + 1)
                .is_none());
            // A row again (a recomputation) or a gap stops the sums.
            live.add_row(0, first + rows - 1, &heads, &probs, 0);
            assert!(live.is_stopped());
            assert!(live.accumulators(&range, num_keys).is_none());
        }
        let mut live = LiveKeyStats::new(vec![vec![vec![0]]], 5, false);
        live.expect_rows(0, 5);
        assert!(!live.is_stopped(), "no row is due before the first");
        live.expect_rows(0, 6);
        assert!(live.is_stopped(), "row 5 never came");
    }

    #[test]
    fn sums_maxima_and_blocks_of_rows() {
        // Two heads in one group, three keys, two rows.
        let mut acc = KeyStatsAccumulator::new(vec![vec![0, 1]], 3, true);
        acc.add_row(&[1.0, 0.0, 0.0, 0.5, 0.5, 0.0]);
        acc.add_row(&[0.2, 0.2, 0.6, 0.0, 0.0, 1.0]);
        let stats = acc.finish(7, &KeyStat::ALL, 2);
        let values = |i: usize| stats[i].values.clone();
        assert_eq!(stats[0].shape, [1, 3]);
        // Row means: [0.75, 0.25, 0] and [0.1, 0.1, 0.8].
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6);
        assert!(close(&values(0), &[0.85, 0.35, 0.8]), "{:?}", values(0));
        assert!(close(&values(1), &[0.75, 0.25, 0.8]), "{:?}", values(1));
        assert_eq!(stats[2].shape, [1, 2]);
        assert!(close(&values(2), &[1.2, 0.8]), "{:?}", values(2));
        // Each row sums to 1, so the masses sum to the number of rows.
        assert!((values(0).iter().sum::<f32>() - 2.0).abs() < 1e-6);
        assert!(stats.iter().all(|s| s.layer_idx == 7));
    }
}
