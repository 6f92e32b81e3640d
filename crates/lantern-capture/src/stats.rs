//! Key statistics: what each key received from the captured rows, per layer — the sum
//! over rows of its probability (H2O's accumulated attention score), its maximum, and
//! the sum per KV cache block — computed from the same probabilities as the maps, one
//! row at a time (O(keys) per row and group), so a request can have them without the
//! `rows × keys` maps.

use lantern_attn::AttentionLayerSpec;

use crate::error::CaptureError;
use crate::spans::SpanOwners;

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
/// One row's value of one group per key, into `out`: the mean of the group's heads
/// (`members`, indices into `heads`, whose entries are rows of `values`,
/// `[heads, out.len()]`), summed in order from zero then scaled, as [`group_row`]
/// computes it: every operation is the one [`group_row`] makes, so the same bits. Head by
/// head over the whole row, so each pass is a plain element-wise loop (written key chunk
/// by key chunk, it was vectorized across the heads into gathers).
fn group_values(values: &[f32], heads: &[usize], members: &[usize], out: &mut [f32]) {
    let n = out.len();
    out.fill(0.0);
    for &m in members {
        let row = &values[heads[m] * n..][..n];
        for (o, v) in out.iter_mut().zip(row) {
            *o += *v;
        }
    }
    if members.len() > 1 {
        let inv = 1.0 / members.len() as f32;
        for o in out.iter_mut() {
            *o *= inv;
        }
    }
}

/// `mass[k] += row[k]` and `max[k] = max[k].max(row[k])`, as
/// [`KeyStatsAccumulator::add_row`] makes them.
fn add_to_sums(row: &[f32], mass: &mut [f32], max: Option<&mut [f32]>) {
    for (m, &v) in mass.iter_mut().zip(row) {
        *m += v;
    }
    if let Some(max) = max {
        for (m, &v) in max.iter_mut().zip(row) {
            *m = m.max(v);
        }
    }
}
}

/// Key statistics and span masses summed as a request's rows run, one row at a time in
/// position order, from the probabilities the attention kernel computed for them
/// ([`lantern_attn::RowProbabilities`]): the same values and the same additions, in the
/// same order, as [`KeyStatsAccumulator`] and [`crate::spans::SpanMassAccumulator`] make when
/// finalizing, so the same bits, and finalizing has no rows left to compute for them.
///
/// Rows must come in order from the first row the capture selects, each once, on every
/// captured layer; anything else (a row the backend did not give, a row run again after
/// a preemption) stops the live sums, and finalizing computes the figures itself.
#[derive(Debug, Clone)]
pub(crate) struct LiveSums {
    /// Per captured layer slot.
    layers: Vec<LiveLayer>,
    /// The first row summed.
    first_row: usize,
    /// With span masses: which span each prompt key belongs to.
    spans: Option<SpanOwners>,
    stopped: bool,
}

#[derive(Debug, Clone)]
struct LiveLayer {
    /// As [`StatHeads::groups`]: indices into the captured heads.
    groups: Vec<Vec<usize>>,
    /// The next row expected.
    next: usize,
    /// Key statistics, if asked: per group, per key seen so far.
    mass: Option<Vec<Vec<f32>>>,
    max: Option<Vec<Vec<f32>>>,
    /// With span masses: per row summed, per group, each span's mass and the rest's.
    span_mass: Vec<f32>,
    /// The last row summed: per group, its value of each key in `row_keys` (what a
    /// streamed response sends with the row's token, [`LiveSums::last_row`]).
    row: Vec<f32>,
    row_keys: std::ops::Range<usize>,
}

/// What [`LiveSums`] sums.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LiveFigures {
    pub key_mass: bool,
    pub key_max: bool,
}

impl LiveSums {
    /// Sums for the layers' `groups` (per captured layer slot), from row `first_row` on:
    /// key statistics as `figures` says, span masses when `spans` is given.
    pub(crate) fn new(
        groups: Vec<Vec<Vec<usize>>>,
        first_row: usize,
        figures: LiveFigures,
        spans: Option<SpanOwners>,
    ) -> Self {
        Self {
            layers: groups
                .into_iter()
                .map(|groups| LiveLayer {
                    mass: figures.key_mass.then(|| vec![Vec::new(); groups.len()]),
                    max: figures.key_max.then(|| vec![Vec::new(); groups.len()]),
                    groups,
                    next: first_row,
                    span_mass: Vec::new(),
                    row: Vec::new(),
                    row_keys: 0..0,
                })
                .collect(),
            first_row,
            spans,
            stopped: false,
        }
    }

    pub(crate) fn is_stopped(&self) -> bool {
        self.stopped
    }

    pub(crate) fn stop(&mut self) {
        self.stopped = true;
        self.layers.iter_mut().for_each(|l| {
            l.mass = None;
            l.max = None;
            l.span_mass = Vec::new();
            l.row = Vec::new();
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
        let n = keys.len();
        layer.row.resize(layer.groups.len() * n, 0.0);
        layer.row_keys = keys.clone();
        for (g, members) in layer.groups.iter().enumerate() {
            let row = &mut layer.row[g * n..(g + 1) * n];
            group_values(values, heads, members, row);
            let row = &layer.row[g * n..(g + 1) * n];
            if let Some(mass) = &mut layer.mass {
                let mass = widened(&mut mass[g], keys.end);
                let max = layer.max.as_mut().map(|max| widened(&mut max[g], keys.end));
                add_to_sums(
                    row,
                    &mut mass[keys.clone()],
                    max.map(|m| &mut m[keys.clone()]),
                );
            }
            if let Some(spans) = &self.spans {
                let start = layer.span_mass.len();
                layer.span_mass.resize(start + spans.width(), 0.0);
                spans.add(keys.clone(), row, &mut layer.span_mass[start..]);
            }
        }
    }

    /// The row at `pos` on captured layer slot `slot` when it is the last row summed
    /// there: its value per group and key (`[groups, keys]`, only the keys it sees) and,
    /// with span masses, its masses (`[groups, spans + 1]`).
    pub(crate) fn last_row(&self, slot: usize, pos: usize) -> Option<LastRow<'_>> {
        let layer = self
            .layers
            .get(slot)
            .filter(|l| !self.stopped && l.next == pos + 1)?;
        let groups = layer.groups.len();
        let span_mass = self.spans.as_ref().map(|spans| {
            let len = groups * spans.width();
            &layer.span_mass[layer.span_mass.len() - len..]
        });
        Some(LastRow {
            groups,
            keys: layer.row_keys.clone(),
            values: &layer.row,
            span_mass,
        })
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

    /// The key statistics of every captured layer slot as accumulators, `num_keys`
    /// wide, when exactly `rows` were summed on every layer; `None` otherwise
    /// (finalizing then computes them) or without key statistics.
    pub(crate) fn accumulators(
        &self,
        rows: &std::ops::Range<usize>,
        num_keys: usize,
    ) -> Option<Vec<KeyStatsAccumulator>> {
        self.covers(rows, num_keys).then(|| {
            self.layers
                .iter()
                .map(|l| {
                    l.mass.as_ref().map(|mass| {
                        KeyStatsAccumulator::from_parts(
                            l.groups.clone(),
                            num_keys,
                            mass,
                            l.max.as_deref(),
                        )
                    })
                })
                .collect()
        })?
    }

    /// The span masses of every captured layer slot (`[rows, groups, spans + 1]`), when
    /// exactly `rows` were summed on every layer; `None` otherwise or without spans.
    pub(crate) fn span_masses(
        &self,
        rows: &std::ops::Range<usize>,
        num_keys: usize,
    ) -> Option<Vec<&[f32]>> {
        self.spans.as_ref()?;
        self.covers(rows, num_keys)
            .then(|| self.layers.iter().map(|l| &l.span_mass[..]).collect())
    }

    /// Whether exactly `rows` were summed on every layer, within `num_keys` keys.
    pub(crate) fn covers(&self, rows: &std::ops::Range<usize>, num_keys: usize) -> bool {
        !self.stopped
            && !rows.is_empty()
            && rows.start == self.first_row
            && self
                .layers
                .iter()
                .all(|l| l.next == rows.end && l.mass.iter().flatten().all(|m| m.len() <= num_keys))
    }

    /// Bytes held by the sums.
    pub(crate) fn size_bytes(&self) -> usize {
        let series = |s: &Vec<Vec<f32>>| s.iter().map(Vec::capacity).sum::<usize>();
        4 * self
            .layers
            .iter()
            .map(|l| {
                l.mass.as_ref().map_or(0, series)
                    + l.max.as_ref().map_or(0, series)
                    + l.span_mass.capacity()
                    + l.row.capacity()
            })
            .sum::<usize>()
            + self.spans.as_ref().map_or(0, SpanOwners::size_bytes)
    }
}

/// One row's figures on one layer, as [`LiveSums`] summed them.
pub(crate) struct LastRow<'a> {
    pub groups: usize,
    /// The keys the row sees.
    pub keys: std::ops::Range<usize>,
    /// `[groups, keys.len()]`.
    pub values: &'a [f32],
    /// With span masses: `[groups, spans + 1]`.
    pub span_mass: Option<&'a [f32]>,
}

/// `series` at least `len` long (zeros added).
fn widened(series: &mut Vec<f32>, len: usize) -> &mut Vec<f32> {
    if series.len() < len {
        series.resize(len, 0.0);
    }
    series
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
    /// finalizing's accumulators (key statistics and span masses) over the same rows'
    /// dense probabilities (per KV head groups of a subset of heads, rows whose visible
    /// keys start past zero, keys that grow row by row, spans before, inside and past
    /// the windows); a row out of order stops the sums. Fresh random inputs.
    #[test]
    fn live_sums_equal_the_finalizing_accumulators() {
        use crate::spans::SpanMassAccumulator;
        use lantern_attn::RowProbabilities;
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let layer = AttentionLayerSpec::new(9, 3, 8);
        let heads = [0, 1, 2, 4, 5, 8];
        let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for by in [StatHeads::Kv, StatHeads::Query, StatHeads::Mean] {
            let groups = by.groups(&heads, &layer);
            let (first, rows) = (rng.gen_range(0..20), rng.gen_range(1..30));
            let num_keys = first + rows;
            // Disjoint spans with gaps, ending before some windows start or past every
            // key.
            let mut spans = Vec::new();
            let mut at = rng.gen_range(0..3);
            let limit = rng.gen_range(1..num_keys + 3);
            while at < limit {
                let end = at + rng.gen_range(1..6);
                spans.push(at..end);
                at = end + rng.gen_range(0..4);
            }
            let mut finalizing = KeyStatsAccumulator::new(groups.clone(), num_keys, true);
            let mut span_finalizing =
                SpanMassAccumulator::new(groups.clone(), num_keys, &spans, rows);
            let figures = LiveFigures {
                key_mass: true,
                key_max: true,
            };
            let owners = Some(SpanOwners::new(&spans));
            let mut live = LiveSums::new(vec![groups.clone()], first, figures, owners);
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
                span_finalizing.add_row(&dense);
                live.add_row(0, pos, &heads, &probs, 0);
            }
            let range = first..first + rows;
            let got = live
                .accumulators(&range, num_keys)
                .expect("every row summed");
            let stats = |acc: KeyStatsAccumulator| acc.finish(3, &KeyStat::ALL, 4);
            let (want, got) = (stats(finalizing), stats(got.into_iter().next().unwrap()));
            for (w, g) in want.iter().zip(&got) {
                assert_eq!(w.shape, g.shape, "seed {seed} {by:?}");
                assert_eq!(
                    bits(&w.values),
                    bits(&g.values),
                    "seed {seed} {by:?} {:?}",
                    w.stat
                );
            }
            let want = span_finalizing.finish(3);
            let got = live
                .span_masses(&range, num_keys)
                .expect("every row summed");
            assert_eq!(
                bits(&want.values),
                bits(got[0]),
                "seed {seed} {by:?} {spans:?}"
            );
            assert!(live
                .accumulators(&(first..first + rows + 1), num_keys + 1)
                .is_none());
            // A row again (a recomputation) or a gap stops the sums.
            live.add_row(0, first + rows - 1, &heads, &probs, 0);
            assert!(live.is_stopped());
            assert!(live.accumulators(&range, num_keys).is_none());
            assert!(live.span_masses(&range, num_keys).is_none());
        }
        let figures = LiveFigures {
            key_mass: true,
            key_max: false,
        };
        let mut live = LiveSums::new(vec![vec![vec![0]]], 5, figures, None);
        live.expect_rows(0, 5);
        assert!(!live.is_stopped(), "no row is due before the first");
        live.expect_rows(0, 6);
        assert!(live.is_stopped(), "row 5 never came");
    }

    /// Span masses alone (no key statistics) are summed, and key statistics are not.
    #[test]
    fn live_span_masses_without_statistics() {
        use lantern_attn::RowProbabilities;
        let figures = LiveFigures {
            key_mass: false,
            key_max: false,
        };
        let owners = SpanOwners::new(&[1..2, 3..4]);
        let mut live = LiveSums::new(vec![vec![vec![0, 1]]], 0, figures, Some(owners));
        let mut probs = RowProbabilities::default();
        for pos in 0..5 {
            probs.ask([0]);
            probs.prepare(2, |_| 0..pos + 1);
            let (values, _, _) = probs.parts_mut();
            // Head 0 puts everything on the last key, head 1 on the first.
            values.fill(0.0);
            values[pos] = 1.0;
            values[pos + 1] += 1.0;
            live.add_row(0, pos, &[0, 1], &probs, 0);
        }
        assert!(live.accumulators(&(0..5), 5).is_none());
        let got = live.span_masses(&(0..5), 5).expect("summed");
        // Per row: [span 1..2, span 3..4, other]; the group mean halves each head's 1.
        let want = [
            [0.0, 0.0, 1.0],
            [0.5, 0.0, 0.5],
            [0.0, 0.0, 1.0],
            [0.0, 0.5, 0.5],
            [0.0, 0.0, 1.0],
        ];
        assert_eq!(got[0], want.concat());
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
