//! A captured layer's probability map as a backend may compute it where its cache lives
//! ([`AttentionBackend::probability_map`](crate::AttentionBackend::probability_map)):
//! what is asked ([`ProbabilityMapJob`]), what comes back ([`ProbabilityMap`]), and the
//! one definition of how rows of probabilities become a map — heads combined
//! ([`combine_heads`]), then the largest keys kept ([`top_k`]) — which the host's
//! finalize and every backend follow.

use std::borrow::Cow;
use std::ops::Range;

use crate::kept::MapQueries;
use crate::AttentionLayerSpec;

/// How a map's query heads are combined before delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadCombine {
    /// Every head kept.
    Each,
    /// Their mean: summed in head order from zero, then times `1 / heads`.
    Mean,
    /// Their maximum, from zero.
    Max,
}

/// One request's query rows on one layer, whose probabilities over its keys a backend
/// is asked for.
#[derive(Debug, Clone)]
pub struct ProbabilityMapJob<'a> {
    pub layer: &'a AttentionLayerSpec,
    /// The query rows as the layer's attention saw them (after RoPE and norms):
    /// `[positions.len(), heads.len(), head_dim]` f32, on the host or kept on the
    /// backend's device.
    pub queries: MapQueries<'a>,
    /// The rows' positions in the sequence (the first row's, then one each).
    pub positions: Range<usize>,
    /// The layer's query heads of `queries`, in order.
    pub heads: &'a [usize],
    /// Columns of the map: keys `0..num_keys`, zero where a row does not see a key.
    pub num_keys: usize,
    pub combine: HeadCombine,
    /// Keep the `k` largest keys of each row (values and positions).
    pub top_k: Option<usize>,
}

impl<'a> ProbabilityMapJob<'a> {
    /// Heads of each row of the map.
    pub fn output_heads(&self) -> usize {
        match self.combine {
            HeadCombine::Each => self.heads.len(),
            HeadCombine::Mean | HeadCombine::Max => 1,
        }
    }

    /// Values of each head's row of the map: `num_keys`, or `top_k` of them.
    pub fn width(&self) -> usize {
        self.top_k.map_or(self.num_keys, |k| k.min(self.num_keys))
    }

    /// Values in the whole map: `[rows, output heads, width]`.
    pub fn map_len(&self) -> usize {
        self.positions.len() * self.output_heads() * self.width()
    }

    /// The keys row `pos` sees among the map's columns.
    pub fn visible(&self, pos: usize) -> Range<usize> {
        let v = self.layer.visible_key_range(pos);
        v.start.min(self.num_keys)..v.end.min(self.num_keys)
    }

    /// Checks the job's shape against itself and its layer.
    pub fn check(&self) -> Result<(), crate::AttnError> {
        let layer = self.layer;
        self.queries
            .check(self.positions.len(), self.heads.len() * layer.head_dim)?;
        if let Some(&h) = self.heads.iter().find(|&&h| h >= layer.num_heads) {
            return Err(crate::AttnError::Unsupported(format!(
                "probability map of head {h} on a layer of {} heads",
                layer.num_heads
            )));
        }
        if self.top_k == Some(0) {
            return Err(crate::AttnError::Unsupported(
                "probability map with top_k = 0".into(),
            ));
        }
        Ok(())
    }

    /// The query rows on the host: lent where they are there, copied from the device
    /// where they were kept.
    pub fn host_queries(&self) -> Result<Cow<'a, [f32]>, crate::AttnError> {
        match self.queries {
            MapQueries::Host(q) => Ok(Cow::Borrowed(q)),
            MapQueries::Kept { rows, first } => {
                Ok(Cow::Owned(rows.read(first..first + self.positions.len())?))
            }
        }
    }
}

/// A layer's map: `values` `[rows, output heads, width]`, and with `top_k` the key
/// position of each value in `indices` (each row's values descending, ties by position).
#[derive(Debug, Clone, PartialEq)]
pub struct ProbabilityMap {
    pub values: Vec<f32>,
    pub indices: Option<Vec<u32>>,
}

impl ProbabilityMap {
    pub fn size_bytes(&self) -> usize {
        (self.values.len() + self.indices.as_ref().map_or(0, Vec::len)) * 4
    }
}

/// Appends `dense` (`[rows, heads, keys]`) to `out`, its heads combined by `combine`.
pub fn combine_heads(
    dense: &[f32],
    heads: usize,
    keys: usize,
    combine: HeadCombine,
    out: &mut Vec<f32>,
) {
    if combine == HeadCombine::Each || heads == 0 || keys == 0 {
        out.extend_from_slice(dense);
        return;
    }
    for row in dense.chunks_exact(heads * keys) {
        let start = out.len();
        out.resize(start + keys, 0.0);
        let dst = &mut out[start..];
        for src in row.chunks_exact(keys) {
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = match combine {
                    HeadCombine::Max => d.max(s),
                    _ => *d + s,
                };
            }
        }
        if combine == HeadCombine::Mean {
            let inv = 1.0 / heads as f32;
            dst.iter_mut().for_each(|d| *d *= inv);
        }
    }
}

/// Appends the `k` largest values of each row of `keys` in `values` to `vals`
/// (descending; ties by lower position), and their key positions to `idx`.
pub fn top_k(values: &[f32], keys: usize, k: usize, vals: &mut Vec<f32>, idx: &mut Vec<u32>) {
    if keys == 0 || k == 0 {
        return;
    }
    let mut order: Vec<usize> = Vec::with_capacity(keys);
    for row in values.chunks_exact(keys) {
        let by_value = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
        order.clear();
        order.extend(0..keys);
        // The k largest first (a partial selection), then only those sorted.
        order.select_nth_unstable_by(k - 1, by_value);
        order[..k].sort_by(by_value);
        for &j in &order[..k] {
            vals.push(row[j]);
            idx.push(j as u32);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows "kept on a device": a vector.
    #[derive(Debug)]
    struct Rows(Vec<f32>, usize);

    impl crate::KeptRows for Rows {
        fn row_len(&self) -> usize {
            self.1
        }
        fn capacity(&self) -> usize {
            self.0.len() / self.1
        }
        fn write(
            &mut self,
            _: &dyn std::any::Any,
            _: Range<usize>,
            _: crate::KeptHeads<'_>,
            _: usize,
        ) -> Result<(), crate::AttnError> {
            unreachable!("only read here")
        }
        fn read(&self, rows: Range<usize>) -> Result<Vec<f32>, crate::AttnError> {
            Ok(self.0[rows.start * self.1..rows.end * self.1].to_vec())
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }

    /// A job's kept rows are checked against its shape like host rows, and read from
    /// the job's first row on.
    #[test]
    fn kept_queries_are_checked_and_read_from_their_first_row() {
        let layer = AttentionLayerSpec::new(4, 2, 2);
        let heads = [1, 3];
        // 5 rows of 2 heads x 2 dims.
        let rows = Rows((0..20).map(|v| v as f32).collect(), 4);
        let job = |queries| ProbabilityMapJob {
            layer: &layer,
            queries,
            positions: 7..10,
            heads: &heads,
            num_keys: 10,
            combine: HeadCombine::Each,
            top_k: None,
        };
        let kept = job(MapQueries::Kept {
            rows: &rows,
            first: 2,
        });
        kept.check().unwrap();
        let q = kept.host_queries().unwrap();
        assert_eq!(&q[..], &rows.0[8..20]);
        let past = job(MapQueries::Kept {
            rows: &rows,
            first: 3,
        });
        assert!(past.check().is_err(), "rows 3..6 of 5");
        let narrow = Rows(vec![0.0; 10], 2);
        let misshapen = job(MapQueries::Kept {
            rows: &narrow,
            first: 0,
        });
        assert!(
            misshapen.check().is_err(),
            "rows of 2 values for 2 heads of 2"
        );
        let host = vec![1.0; 12];
        assert!(job(MapQueries::Host(&host)).check().is_ok());
        assert!(job(MapQueries::Host(&host[1..])).check().is_err());
    }

    #[test]
    fn heads_combine() {
        // 1 row, 2 heads, 3 keys
        let dense = vec![0.2, 0.8, 0.0, 0.6, 0.4, 0.0];
        let combined = |combine| {
            let mut out = vec![9.0];
            combine_heads(&dense, 2, 3, combine, &mut out);
            out
        };
        let m = combined(HeadCombine::Mean);
        assert_eq!(m.len(), 4, "appends one row of 3 keys: {m:?}");
        assert!((m[1] - 0.4).abs() < 1e-7 && (m[2] - 0.6).abs() < 1e-7 && m[3] == 0.0);
        assert_eq!(combined(HeadCombine::Max), vec![9.0, 0.6, 0.8, 0.0]);
        let mut unchanged = vec![9.0];
        unchanged.extend_from_slice(&dense);
        assert_eq!(combined(HeadCombine::Each), unchanged);
    }

    #[test]
    fn top_k_orders_and_breaks_ties_by_position() {
        let (mut v, mut i) = (Vec::new(), Vec::new());
        top_k(&[0.1, 0.5, 0.1, 0.3, 0.0, 1.0], 3, 2, &mut v, &mut i);
        assert_eq!(v, vec![0.5, 0.1, 1.0, 0.3]);
        assert_eq!(i, vec![1, 0, 2, 0]);
        // Many ties: the lowest positions win, in order.
        let (mut v, mut i) = (Vec::new(), Vec::new());
        top_k(&[0.0, 0.2, 0.2, 0.2, 0.1, 0.2], 6, 3, &mut v, &mut i);
        assert_eq!((v, i), (vec![0.2, 0.2, 0.2], vec![1, 2, 3]));
    }
}
