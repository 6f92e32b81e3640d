//! `cpu-reference`: plain f32 attention over the paged cache, written to be obviously
//! correct rather than fast. It is the oracle the other backends are tested against.
//!
//! For every query token and head: gather the visible keys (one at a time, through the
//! cache's per-token read helpers), turn dot products into logits with the layer's
//! transform, softmax with the layer's sink, and sum the values with those weights.
//! Chunked-local layers run over the step's virtual batch ([`crate::local`]), so the
//! visible keys are always a causal (and windowed) prefix of the request's keys.

use crate::backend::{AttentionMetadata, CPU_REFERENCE};
use crate::backends::{load_step_row, HostAttention, KernelView, RequestView};
use crate::cache::PagedKvCache;
use crate::error::AttnError;
use crate::layer::AttentionLayerSpec;
use crate::layout::{KvCacheLayout, KvCacheShape};
use crate::metadata::slot_for_position;

/// The reference backend. Its default layout is `KvFirst` with the identity order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuReferenceBackend {
    layout: KvCacheLayout,
}

impl Default for CpuReferenceBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuReferenceBackend {
    /// The backend with its default layout.
    pub fn new() -> Self {
        Self {
            layout: KvCacheLayout::contiguous(KvCacheShape::KvFirst),
        }
    }

    /// The backend declaring `layout` instead (any valid layout works: every read goes
    /// through it). Used to test that results do not depend on the layout.
    pub fn with_layout(layout: KvCacheLayout) -> Result<Self, AttnError> {
        layout.validate()?;
        Ok(Self { layout })
    }
}

impl HostAttention for CpuReferenceBackend {
    fn host_name(&self) -> &'static str {
        CPU_REFERENCE
    }

    fn host_layout(&self) -> KvCacheLayout {
        self.layout
    }

    fn forward_host(
        &self,
        layer: &AttentionLayerSpec,
        meta: &AttentionMetadata,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        cache: &mut PagedKvCache,
        out: &mut [f32],
    ) -> Result<(), AttnError> {
        // Chunked-local layers run as causal attention over the virtual batch.
        let view = KernelView::new(meta, layer)?;
        cache.write(k, v, &meta.common.slot_mapping)?;
        let (common, layer) = (view.common(), view.layer());
        let cache = &*cache;
        let d = layer.head_dim;
        let (mut keys, mut values, mut logits) = (Vec::new(), Vec::new(), Vec::new());
        for r in 0..common.num_reqs {
            let req = RequestView::new(common, r);
            for row in req.tokens.0..req.tokens.1 {
                let visible = layer.visible_key_range(req.position(row));
                for kv_head in 0..layer.num_kv_heads {
                    gather(
                        cache,
                        &req,
                        layer,
                        kv_head,
                        visible.clone(),
                        (k, v),
                        (&mut keys, &mut values),
                    )?;
                    for h in kv_head * layer.group_size()..(kv_head + 1) * layer.group_size() {
                        let q_row = &q[(row * layer.num_heads + h) * d..][..d];
                        logits.clear();
                        logits.extend(keys.chunks_exact(d).map(|key| {
                            let raw: f32 = q_row.iter().zip(key).map(|(a, b)| a * b).sum();
                            layer.transform_score(raw)
                        }));
                        layer.softmax_in_place(h, &mut logits);
                        let out_row = &mut out[(row * layer.num_heads + h) * d..][..d];
                        out_row.fill(0.0);
                        for (p, value) in logits.iter().zip(values.chunks_exact(d)) {
                            for (o, x) in out_row.iter_mut().zip(value) {
                                *o += p * x;
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Collects the keys and values at `positions` for `kv_head`, one position at a time:
/// from the cache by slot, or from this step's inputs for padded step tokens.
fn gather(
    cache: &PagedKvCache,
    req: &RequestView<'_>,
    layer: &AttentionLayerSpec,
    kv_head: usize,
    positions: std::ops::Range<usize>,
    (k, v): (&[f32], &[f32]),
    (keys, values): (&mut Vec<f32>, &mut Vec<f32>),
) -> Result<(), AttnError> {
    let d = layer.head_dim;
    let n = positions.len();
    keys.resize(n * d, 0.0);
    values.resize(n * d, 0.0);
    let block_size = cache.geometry().block_size;
    for (i, pos) in positions.enumerate() {
        let (key, value) = (&mut keys[i * d..][..d], &mut values[i * d..][..d]);
        if let Some(row) = req.padded_step_row(pos) {
            load_step_row(k, row, kv_head, layer.num_kv_heads, cache.dtype(), key);
            load_step_row(v, row, kv_head, layer.num_kv_heads, cache.dtype(), value);
        } else {
            let slot = slot_for_position(req.table, block_size, pos).ok_or_else(|| {
                AttnError::InvalidMetadata(format!("no block for position {pos}"))
            })?;
            let slot = usize::try_from(slot).map_err(|_| AttnError::SlotOutOfRange {
                slot,
                num_slots: cache.num_slots(),
            })?;
            cache.read_key(slot, kv_head, key)?;
            cache.read_value(slot, kv_head, value)?;
        }
    }
    Ok(())
}
