//! The CPU attention backends and the pieces they share.
//!
//! Both backends read keys the same way: a key position of request `r` is looked up in
//! the cache through the block table, except for this step's tokens whose slot is
//! padding, which were never written and are taken from the step's own K/V (rounded to
//! the cache's element type so the result matches what the cache would have held).
//!
//! Neither kernel knows chunked-local attention: `KernelView` hands them, for a
//! chunked-local layer, the step's virtual batch (see [`crate::local`]) and the layer
//! without its chunk, and plain causal attention over that is the chunked-local result.

pub mod cpu_flash;
pub mod cpu_reference;
pub(crate) mod kernels;
pub(crate) mod row_kernels;
pub mod row_scorer;

use std::ops::Range;
use std::sync::Arc;

use lantern_kv::{BlockId, KvDtype};

use crate::backend::{
    validate_forward_inputs, AttentionBackend, AttentionMetadata, DECODE_THRESHOLD,
};
use crate::cache::{round_to_dtype, PagedKvCache};
use crate::device::{host_f32, tensor3, Device, LayerKvCache, Tensor};
use crate::error::AttnError;
use crate::layer::AttentionLayerSpec;
use crate::layout::{CacheGeometry, KvCacheLayout};
use crate::local::LocalVirtualBatch;
use crate::metadata::CommonAttentionMetadata;

/// The metadata and layer a kernel runs on for one layer of one step.
///
/// - A layer without `chunk_size`: the step's metadata and the layer as they are.
/// - A chunked-local layer: the group's [`LocalVirtualBatch`] (built once per step per
///   group and cached in the [`AttentionMetadata`]) and a copy of the layer with
///   `chunk_size: None`. Every virtual request lies inside one chunk and counts positions
///   from the chunk's start, so causal attention (with the layer's window, scale,
///   soft-cap and sinks, all unchanged by the shift) over it sees exactly the keys
///   [`AttentionLayerSpec::key_visible`] allows. The batch rows and the slot mapping are
///   the original ones, so `q`, `k`, `v` and `out` are used as they are.
pub(crate) enum KernelView<'a> {
    Plain {
        common: &'a CommonAttentionMetadata,
        layer: &'a AttentionLayerSpec,
    },
    ChunkedLocal {
        batch: Arc<LocalVirtualBatch>,
        layer: AttentionLayerSpec,
    },
}

impl<'a> KernelView<'a> {
    /// The view for `layer` over `meta`, which must have passed `validate_forward_inputs`
    /// with this layer. Errors (before anything is written) when the layer's chunk size
    /// is not a multiple of the block size.
    pub fn new(
        meta: &'a AttentionMetadata,
        layer: &'a AttentionLayerSpec,
    ) -> Result<Self, AttnError> {
        Ok(match layer.chunk_size {
            None => Self::Plain {
                common: &meta.common,
                layer,
            },
            Some(c) => Self::ChunkedLocal {
                batch: meta.local_virtual_batch(c)?,
                layer: AttentionLayerSpec {
                    chunk_size: None,
                    ..layer.clone()
                },
            },
        })
    }

    pub fn common(&self) -> &CommonAttentionMetadata {
        match self {
            Self::Plain { common, .. } => common,
            Self::ChunkedLocal { batch, .. } => &batch.common,
        }
    }

    pub fn layer(&self) -> &AttentionLayerSpec {
        match self {
            Self::Plain { layer, .. } => layer,
            Self::ChunkedLocal { layer, .. } => layer,
        }
    }
}

/// One request's slice of validated metadata.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RequestView<'a> {
    /// Batch rows of this request's step tokens.
    pub tokens: (usize, usize),
    pub num_computed: usize,
    pub table: &'a [BlockId],
    /// Slot mapping entries of this request's step tokens.
    pub slots: &'a [i64],
}

impl<'a> RequestView<'a> {
    /// Request `r` of `common`, which must have passed `validate` (so every index here
    /// is in range).
    pub fn new(common: &'a CommonAttentionMetadata, r: usize) -> Self {
        let (a, b) = (common.query_start_loc[r], common.query_start_loc[r + 1]);
        Self {
            tokens: (a, b),
            num_computed: common.num_computed_tokens[r],
            table: common.block_table.row(r),
            slots: &common.slot_mapping[a..b],
        }
    }

    /// Absolute position of batch row `row` (one of this request's tokens).
    #[inline]
    pub fn position(&self, row: usize) -> usize {
        self.num_computed + (row - self.tokens.0)
    }

    /// If key position `pos` is a step token whose slot is padding, its batch row.
    #[inline]
    pub fn padded_step_row(&self, pos: usize) -> Option<usize> {
        let i = pos.checked_sub(self.num_computed)?;
        match self.slots.get(i) {
            Some(&s) if s < 0 => Some(self.tokens.0 + i),
            _ => None,
        }
    }

    /// Whether any position in `positions` is a padded step token.
    pub fn any_padded(&self, positions: Range<usize>) -> bool {
        let lo = positions.start.max(self.num_computed) - self.num_computed;
        let hi = positions.end.max(self.num_computed) - self.num_computed;
        self.slots
            .get(lo..hi.min(self.slots.len()))
            .is_some_and(|s| s.iter().any(|&x| x < 0))
    }
}

/// Copies head `head` of step token `row` from `src` (`[tokens, kv_heads, head_dim]`)
/// into `out`, rounded to `dtype`.
pub(crate) fn load_step_row(
    src: &[f32],
    row: usize,
    head: usize,
    num_kv_heads: usize,
    dtype: KvDtype,
    out: &mut [f32],
) {
    let d = out.len();
    let start = (row * num_kv_heads + head) * d;
    out.copy_from_slice(&src[start..start + d]);
    round_to_dtype(out, dtype);
}

/// A CPU backend: attention over a [`PagedKvCache`] in host memory, on host slices.
/// [`AttentionBackend`] comes with it (below): the device is the CPU, caches are
/// `PagedKvCache`s in the backend's layout, tensors are lent as host slices, and key
/// reads go straight to the cache.
pub(crate) trait HostAttention: Send + Sync {
    /// The name [`crate::backend_by_name`] knows it by.
    fn host_name(&self) -> &'static str;

    /// The layout of its caches.
    fn host_layout(&self) -> KvCacheLayout;

    /// Writes the step's `k`, `v` into `cache` by the slot mapping and computes `out`
    /// from `q` and the cache, for inputs `validate_forward_inputs` passed.
    #[allow(clippy::too_many_arguments)]
    fn forward_host(
        &self,
        layer: &AttentionLayerSpec,
        meta: &AttentionMetadata,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        cache: &mut PagedKvCache,
        out: &mut [f32],
    ) -> Result<(), AttnError>;
}

/// A host backend's forward: checks the inputs, lends them as host slices with the
/// backend's own cache, and returns what `run` writes into the output.
pub(crate) fn host_forward<B: HostAttention + ?Sized>(
    backend: &B,
    layer: &AttentionLayerSpec,
    meta: &AttentionMetadata,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    cache: &mut dyn LayerKvCache,
    run: impl FnOnce(&[f32], &[f32], &[f32], &mut PagedKvCache, &mut [f32]) -> Result<(), AttnError>,
) -> Result<Tensor, AttnError> {
    validate_forward_inputs(
        &backend.host_layout(),
        layer,
        &meta.common,
        (q, k, v),
        &*cache,
    )?;
    for (what, t) in [("q", q), ("k", k), ("v", v)] {
        if !t.device().is_cpu() {
            return Err(AttnError::UnsupportedTensor {
                what,
                problem: format!(
                    "on {:?}; the {} backend runs on the CPU",
                    t.device(),
                    backend.host_name()
                ),
            });
        }
    }
    let cache: &mut PagedKvCache =
        cache
            .as_any_mut()
            .downcast_mut()
            .ok_or(AttnError::ForeignCache {
                backend: backend.host_name(),
            })?;
    let (q, k, v) = (host_f32(q)?, host_f32(k)?, host_f32(v)?);
    // Zeroed on the step's threads: a prefill's output is a megabyte or more a layer.
    let mut out = lantern_quant::share::zeroed(q.len());
    run(&q, &k, &v, cache, &mut out)?;
    let t = meta.common.num_actual_tokens;
    tensor3(out, [t, layer.num_heads, layer.head_dim], &Device::Cpu)
}

impl<B: HostAttention + 'static> AttentionBackend for B {
    /// The backend itself: model code on the CPU reaches the flash backend's
    /// [`CpuFlashBackend::forward_with_probabilities`](crate::CpuFlashBackend::forward_with_probabilities) through it.
    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn name(&self) -> &'static str {
        self.host_name()
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn kv_cache_layout(&self) -> KvCacheLayout {
        self.host_layout()
    }

    fn build_metadata(&self, common: Arc<CommonAttentionMetadata>) -> AttentionMetadata {
        AttentionMetadata::new(common, DECODE_THRESHOLD)
    }

    fn allocate_cache(
        &self,
        geometry: CacheGeometry,
        dtype: KvDtype,
    ) -> Result<Box<dyn LayerKvCache>, AttnError> {
        Ok(Box::new(PagedKvCache::new(
            geometry,
            self.host_layout(),
            dtype,
        )?))
    }

    fn forward(
        &self,
        layer: &AttentionLayerSpec,
        meta: &AttentionMetadata,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut dyn LayerKvCache,
    ) -> Result<Tensor, AttnError> {
        host_forward(
            self,
            layer,
            meta,
            (q, k, v),
            cache,
            |q, k, v, cache, out| self.forward_host(layer, meta, q, k, v, cache, out),
        )
    }

    fn read_slots(
        &self,
        cache: &dyn LayerKvCache,
        slots: &[usize],
        keys: &mut [f32],
        values: Option<&mut [f32]>,
    ) -> Result<(), AttnError> {
        let cache: &PagedKvCache =
            cache
                .as_any()
                .downcast_ref()
                .ok_or(AttnError::ForeignCache {
                    backend: self.host_name(),
                })?;
        cache.read_slots(slots, keys, values)
    }
}
