//! Live figures of one row, for streamed responses: the row's span masses and top-k
//! keys on every captured layer, computed as the row is run and sent with the token it
//! samples, so a client can show them while the answer streams. Where the attention
//! kernel gave the row's probabilities (the live sums, [`row_capture_from_sums`]) they
//! are read from what the sums kept of the row; otherwise from the row's query and the
//! keys read back from the cache ([`row_capture`]). The same probabilities, groups and
//! arithmetic as the finished capture's either way, so each equals that row of the
//! final figures.

use serde::Serialize;

use lantern_attn::{top_k, AttentionLayerSpec};

use crate::buffer::QueryRowBuffer;
use crate::error::CaptureError;
use crate::finalize::{row_probabilities, KeySnapshot};
use crate::spans::SpanMassAccumulator;
use crate::stats::group_row;

/// One row's live figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RowCapture {
    /// The row's position (the token it samples is at `position + 1`).
    pub position: usize,
    /// One entry per captured layer, in the capture's layer order.
    pub layers: Vec<RowLayer>,
}

/// One layer's figures for one row, per group of heads (`stats_heads`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RowLayer {
    pub layer_idx: usize,
    /// With spans: per group, the mass on each span and, last, outside every span.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub span_mass: Option<Vec<Vec<f32>>>,
    /// With top-k: per group, the `k` keys the group's probability is largest on
    /// (descending; ties by lower position).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<Vec<TopKeys>>,
}

/// The largest probabilities of one row and group, with their key positions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TopKeys {
    pub positions: Vec<u32>,
    pub values: Vec<f32>,
}

/// The live figures of the row at `pos` from the live sums ([`QueryRowBuffer::with_live_sums`]),
/// when the row was the last one they summed on every captured layer; `None` otherwise
/// ([`row_capture`] then computes them from the keys).
pub fn row_capture_from_sums(buffer: &QueryRowBuffer, pos: usize) -> Option<RowCapture> {
    let spec = buffer.spec();
    let num_keys = pos + 1;
    let mut layers = Vec::with_capacity(spec.layers.len());
    for (slot, &layer_idx) in spec.layers.iter().enumerate() {
        let row = buffer.live_last_row(slot, pos)?;
        if spec.spans.is_empty() != row.span_mass.is_none() || row.keys.end > num_keys {
            return None;
        }
        let n = row.keys.len();
        let span_mass = row.span_mass.map(|masses| {
            masses
                .chunks(masses.len() / row.groups.max(1))
                .map(<[f32]>::to_vec)
                .collect()
        });
        let top = spec.top_k.map(|k| {
            // The group's row over every key, zero where the row sees none, as
            // `row_capture` has it.
            let mut full = vec![0f32; num_keys];
            (0..row.groups)
                .map(|g| {
                    full.fill(0.0);
                    full[row.keys.clone()].copy_from_slice(&row.values[g * n..(g + 1) * n]);
                    let (mut values, mut positions) = (Vec::new(), Vec::new());
                    top_k(
                        &full,
                        num_keys,
                        k.min(num_keys),
                        &mut values,
                        &mut positions,
                    );
                    TopKeys { positions, values }
                })
                .collect()
        });
        layers.push(RowLayer {
            layer_idx,
            span_mass,
            top_k: top,
        });
    }
    Some(RowCapture {
        position: pos,
        layers,
    })
}

/// The live figures of the row at `pos`, from `buffer`'s queries and `layers` (per
/// captured layer, in order: its attention and the keys `0..=pos` it sees).
pub fn row_capture(
    buffer: &QueryRowBuffer,
    pos: usize,
    layers: &[(AttentionLayerSpec, KeySnapshot)],
) -> Result<RowCapture, CaptureError> {
    let spec = buffer.spec();
    let num_keys = pos + 1;
    let heads = spec.heads.len();
    let spans = spec
        .spans
        .iter()
        .map(|s| s.tokens.clone())
        .collect::<Option<Vec<_>>>()
        .ok_or_else(|| CaptureError::Incomplete("a span was never resolved to tokens".into()))?;
    let mut dense = vec![0f32; heads * num_keys];
    let mut out = Vec::with_capacity(layers.len());
    for (slot, (&layer_idx, layer)) in spec.layers.iter().zip(layers).enumerate() {
        row_probabilities(buffer, slot, layer, pos, &mut dense)?;
        let groups = spec.stats_heads.groups(&spec.heads, &layer.0);
        let span_mass = (!spans.is_empty()).then(|| {
            let mut accumulator = SpanMassAccumulator::new(groups.clone(), num_keys, &spans, 1);
            accumulator.add_row(&dense);
            let width = spans.len() + 1;
            accumulator
                .finish(layer_idx)
                .values
                .chunks(width)
                .map(<[f32]>::to_vec)
                .collect()
        });
        let top = spec.top_k.map(|k| {
            let mut grouped = vec![0f32; groups.len() * num_keys];
            group_row(&groups, &dense, num_keys, &mut grouped);
            grouped
                .chunks(num_keys)
                .map(|row| {
                    let (mut values, mut positions) = (Vec::new(), Vec::new());
                    top_k(row, num_keys, k.min(num_keys), &mut values, &mut positions);
                    TopKeys { positions, values }
                })
                .collect()
        });
        out.push(RowLayer {
            layer_idx,
            span_mass,
            top_k: top,
        });
    }
    Ok(RowCapture {
        position: pos,
        layers: out,
    })
}
