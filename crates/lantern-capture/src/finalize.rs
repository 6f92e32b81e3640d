//! Finalization: attention probabilities from the buffered query rows and the keys read
//! back from the paged KV cache.
//!
//! When a capturing request finishes, the engine reads the keys (and, for verification,
//! the values) of the captured layers out of the cache through the cache's layout
//! ([`snapshot_layer`]) before its blocks are released, so no later request can
//! overwrite them. The probabilities themselves are computed by
//! [`PendingCapture::finalize`], which needs nothing from the engine and runs on any
//! thread: the scores use the layer's own description — scale, causal/window/chunk
//! masks, soft-cap, sinks, GQA head mapping — accumulated in f32.

use std::ops::Range;

use lantern_attn::{AttentionLayerSpec, PagedKvCache};

use crate::buffer::QueryRowBuffer;
use crate::error::CaptureError;
use crate::result::{
    AbsentRow, CaptureMeta, CaptureResult, LayerAttentionInfo, LayerMap, TokenInfo, CAPTURE_FORMAT,
};
use crate::spec::HeadReduce;

/// Why the last token of a finished request has no row.
pub const LAST_TOKEN_ABSENT: &str =
    "the last generated token was never run through the model, so it has no query and no key";

/// One layer's keys (and values) of one request, copied out of the paged cache.
#[derive(Debug, Clone)]
pub struct KeySnapshot {
    /// Keys before this position were not read (no captured row can see them).
    pub first_key: usize,
    /// One past the last key position.
    pub num_keys: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// `[num_keys - first_key, num_kv_heads, head_dim]`.
    pub keys: Vec<f32>,
    /// Same shape, when values were asked for.
    pub values: Option<Vec<f32>>,
}

impl KeySnapshot {
    fn row(
        plane: &[f32],
        first: usize,
        heads: usize,
        dim: usize,
        pos: usize,
        head: usize,
    ) -> &[f32] {
        let start = ((pos - first) * heads + head) * dim;
        &plane[start..start + dim]
    }

    /// The key of position `pos` (`first_key <= pos < num_keys`) for kv head `head`.
    pub fn key(&self, pos: usize, head: usize) -> &[f32] {
        Self::row(
            &self.keys,
            self.first_key,
            self.num_kv_heads,
            self.head_dim,
            pos,
            head,
        )
    }

    /// The value of position `pos` for kv head `head`, when values were read.
    pub fn value(&self, pos: usize, head: usize) -> Option<&[f32]> {
        let v = self.values.as_deref()?;
        Some(Self::row(
            v,
            self.first_key,
            self.num_kv_heads,
            self.head_dim,
            pos,
            head,
        ))
    }
}

/// Reads keys `keys` of a request from one layer's cache, through the cache's layout.
/// `block_table` is the request's block table in the layer's KV cache group.
pub fn snapshot_layer(
    cache: &PagedKvCache,
    block_table: &[u32],
    keys: Range<usize>,
    with_values: bool,
) -> Result<KeySnapshot, CaptureError> {
    let geom = *cache.geometry();
    let (heads, dim, bs) = (geom.num_kv_heads, geom.head_dim, geom.block_size);
    let n = keys.len() * heads * dim;
    let mut k = vec![0f32; n];
    let mut v = if with_values {
        vec![0f32; n]
    } else {
        Vec::new()
    };
    for (i, pos) in keys.clone().enumerate() {
        let block = *block_table.get(pos / bs).ok_or_else(|| {
            CaptureError::Incomplete(format!("position {pos} has no block in the block table"))
        })? as usize;
        let slot = block * bs + pos % bs;
        for h in 0..heads {
            let at = (i * heads + h) * dim;
            cache.read_key(slot, h, &mut k[at..at + dim])?;
            if with_values {
                cache.read_value(slot, h, &mut v[at..at + dim])?;
            }
        }
    }
    Ok(KeySnapshot {
        first_key: keys.start,
        num_keys: keys.end,
        num_kv_heads: heads,
        head_dim: dim,
        keys: k,
        values: with_values.then_some(v),
    })
}

/// The keys a capture of rows `rows` on `layer` needs, of the `num_keys` computed: from
/// the first key the first row can see to the last key the last row can see. Keys past
/// the last row are never visible to it, so they are neither read nor delivered.
pub fn keys_needed(
    layer: &AttentionLayerSpec,
    rows: Range<usize>,
    num_keys: usize,
) -> Range<usize> {
    if rows.is_empty() {
        return 0..0;
    }
    let end = layer.visible_key_range(rows.end - 1).end.min(num_keys);
    layer.visible_key_range(rows.start).start.min(end)..end
}

/// A finished request's capture, with everything finalization needs; the request's
/// blocks are already free.
#[derive(Debug, Clone)]
pub struct PendingCapture {
    pub buffer: QueryRowBuffer,
    /// Per captured layer (in `buffer.spec().layers` order): its attention and keys.
    pub layers: Vec<(AttentionLayerSpec, KeySnapshot)>,
    pub prompt_len: usize,
    /// Every position of the sequence, prompt then generated.
    pub tokens: Vec<TokenInfo>,
    /// Positions whose K/V were computed (the keys), `<= tokens.len()`.
    pub num_computed: usize,
}

impl PendingCapture {
    /// Rows that will be delivered and requested rows that are absent.
    pub fn row_plan(&self) -> (Range<usize>, Vec<AbsentRow>) {
        let total = self.tokens.len();
        let requested = self.buffer.spec().rows.positions(self.prompt_len, total);
        let present = self
            .buffer
            .rows_present(self.prompt_len, total, self.num_computed);
        let absent = (present.end..requested.end)
            .map(|position| AbsentRow {
                position,
                reason: if position + 1 == total && position >= self.num_computed {
                    LAST_TOKEN_ABSENT.to_string()
                } else {
                    "no query was recorded for this position".to_string()
                },
            })
            .collect();
        (present, absent)
    }

    /// Bytes this capture holds while waiting to be finalized.
    pub fn size_bytes(&self) -> usize {
        self.buffer.size_bytes()
            + self
                .layers
                .iter()
                .map(|(_, s)| (s.keys.len() + s.values.as_ref().map_or(0, Vec::len)) * 4)
                .sum::<usize>()
    }

    /// Columns of every map: keys `0..num_keys()`, up to the last key any captured
    /// row sees.
    pub fn num_keys(&self) -> usize {
        self.layers
            .iter()
            .map(|(_, s)| s.num_keys)
            .max()
            .unwrap_or(0)
    }

    /// Dense probabilities of captured layer slot `slot`: `[rows, heads, num_keys()]`
    /// with every requested head, before reduction and top-k.
    pub fn probabilities(&self, slot: usize, rows: Range<usize>) -> Result<Vec<f32>, CaptureError> {
        let (layer, keys) = self
            .layers
            .get(slot)
            .ok_or_else(|| CaptureError::Incomplete(format!("no keys for layer slot {slot}")))?;
        let heads = &self.buffer.spec().heads;
        let num_keys = self.num_keys();
        let mut out = vec![0f32; rows.len() * heads.len() * num_keys];
        let mut logits = Vec::with_capacity(num_keys);
        for (ri, pos) in rows.clone().enumerate() {
            let visible = layer.visible_key_range(pos);
            let visible = visible.start.max(keys.first_key)..visible.end.min(keys.num_keys);
            for (hi, &h) in heads.iter().enumerate() {
                let q = self.buffer.query(slot, pos, hi).ok_or_else(|| {
                    CaptureError::Incomplete(format!("no query row for position {pos}"))
                })?;
                let kv_head = layer.kv_head_for(h);
                logits.clear();
                logits.extend(
                    visible
                        .clone()
                        .map(|j| layer.transform_score(dot(q, keys.key(j, kv_head)))),
                );
                layer.softmax_in_place(h, &mut logits);
                let base = (ri * heads.len() + hi) * num_keys;
                out[base + visible.start..base + visible.end].copy_from_slice(&logits);
            }
        }
        Ok(out)
    }

    /// Computes the maps: probabilities, then the head reduction, then top-k.
    pub fn finalize(&self) -> Result<CaptureResult, CaptureError> {
        self.finalize_with(|| {})
    }

    /// [`Self::finalize`], calling `after_layer` once each layer's map is done (the
    /// capture worker paces itself there).
    pub fn finalize_with(
        &self,
        mut after_layer: impl FnMut(),
    ) -> Result<CaptureResult, CaptureError> {
        let spec = self.buffer.spec();
        let (rows, absent_rows) = self.row_plan();
        let num_keys = self.num_keys();
        let mut maps = Vec::with_capacity(self.layers.len());
        for (slot, &layer_idx) in spec.layers.iter().enumerate() {
            let dense = self.probabilities(slot, rows.clone())?;
            let (values, heads) =
                reduce_heads(dense, rows.len(), spec.heads.len(), num_keys, spec.reduce);
            let map = match spec.top_k {
                None => LayerMap {
                    layer_idx,
                    shape: [rows.len(), heads, num_keys],
                    values,
                    indices: None,
                },
                Some(k) => {
                    let k = k.min(num_keys);
                    let (values, indices) = top_k(&values, num_keys, k);
                    LayerMap {
                        layer_idx,
                        shape: [rows.len(), heads, k],
                        values,
                        indices: Some(indices),
                    }
                }
            };
            maps.push(map);
            after_layer();
        }
        let meta = CaptureMeta {
            format: CAPTURE_FORMAT.to_string(),
            prompt_len: self.prompt_len,
            total_len: self.tokens.len(),
            tokens: self.tokens.clone(),
            layers: spec.layers.clone(),
            heads: spec.heads.clone(),
            reduce: spec.reduce.as_str().to_string(),
            top_k: spec.top_k,
            dtype: spec.dtype.as_str().to_string(),
            row_positions: rows.collect(),
            key_positions: (0..num_keys).collect(),
            absent_rows,
            layer_attention: spec
                .layers
                .iter()
                .zip(&self.layers)
                .map(|(&layer_idx, (l, _))| LayerAttentionInfo {
                    layer_idx,
                    scale: l.scale,
                    sliding_window: l.sliding_window,
                    chunk_size: l.chunk_size,
                    logits_soft_cap: l.logits_soft_cap,
                    has_sinks: l.sinks.is_some(),
                    num_heads: l.num_heads,
                    num_kv_heads: l.num_kv_heads,
                })
                .collect(),
        };
        Ok(CaptureResult { meta, layers: maps })
    }
}

/// `a · b` in f32 over eight partial sums, which the compiler turns into SIMD lanes.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `[rows, heads, keys]` → `[rows, 1, keys]` by mean or max over heads (or unchanged).
fn reduce_heads(
    dense: Vec<f32>,
    rows: usize,
    heads: usize,
    keys: usize,
    reduce: HeadReduce,
) -> (Vec<f32>, usize) {
    if reduce == HeadReduce::None || heads == 0 {
        return (dense, heads);
    }
    let mut out = vec![0f32; rows * keys];
    for r in 0..rows {
        let dst = &mut out[r * keys..(r + 1) * keys];
        for h in 0..heads {
            let src = &dense[(r * heads + h) * keys..(r * heads + h + 1) * keys];
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = match reduce {
                    HeadReduce::MaxHeads => d.max(s),
                    _ => *d + s,
                };
            }
        }
        if reduce == HeadReduce::MeanHeads {
            let inv = 1.0 / heads as f32;
            dst.iter_mut().for_each(|d| *d *= inv);
        }
    }
    (out, 1)
}

/// The `k` largest values of each row of `keys` (descending; ties by lower position)
/// and their key positions.
fn top_k(values: &[f32], keys: usize, k: usize) -> (Vec<f32>, Vec<u32>) {
    let rows = values.len().checked_div(keys).unwrap_or(0);
    let mut vals = Vec::with_capacity(rows * k);
    let mut idx = Vec::with_capacity(rows * k);
    let mut order: Vec<usize> = Vec::with_capacity(keys);
    for r in 0..rows {
        let row = &values[r * keys..(r + 1) * keys];
        order.clear();
        order.extend(0..keys);
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        for &j in &order[..k] {
            vals.push(row[j]);
            idx.push(j as u32);
        }
    }
    (vals, idx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_a_plain_sum() {
        for n in [1, 7, 8, 9, 64, 67] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let plain: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum();
            let fast = f64::from(dot(&a, &b));
            assert!(
                (fast - plain).abs() <= 1e-5 * plain.abs().max(1.0),
                "{n}: {fast} vs {plain}"
            );
        }
    }

    #[test]
    fn reductions() {
        // 1 row, 2 heads, 3 keys
        let dense = vec![0.2, 0.8, 0.0, 0.6, 0.4, 0.0];
        let (m, h) = reduce_heads(dense.clone(), 1, 2, 3, HeadReduce::MeanHeads);
        assert_eq!(h, 1);
        assert!((m[0] - 0.4).abs() < 1e-7 && (m[1] - 0.6).abs() < 1e-7 && m[2] == 0.0);
        let (m, _) = reduce_heads(dense, 1, 2, 3, HeadReduce::MaxHeads);
        assert_eq!(m, vec![0.6, 0.8, 0.0]);
    }

    #[test]
    fn top_k_orders_and_breaks_ties_by_position() {
        let (v, i) = top_k(&[0.1, 0.5, 0.1, 0.3, 0.0, 1.0], 3, 2);
        assert_eq!(v, vec![0.5, 0.1, 1.0, 0.3]);
        assert_eq!(i, vec![1, 0, 2, 0]);
    }
}
