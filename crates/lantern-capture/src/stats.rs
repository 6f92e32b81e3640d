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
