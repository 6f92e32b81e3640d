//! The attention backend interface, device-agnostic.
//!
//! A backend declares the layout of the cache it wants and allocates its caches itself,
//! builds its per-step metadata once per KV cache group, and runs one layer's attention:
//! write this step's K/V into the cache by slot mapping, then attend over each request's
//! keys read back from the paged cache. Queries, keys, values and the output cross the
//! trait as tensors on the backend's device ([`crate::device`]); caches cross it as
//! [`LayerKvCache`] trait objects only the allocating backend looks into; capture reads
//! keys back through [`AttentionBackend::read_slots`]. CPU specifics live in `backends/`.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, OnceLock};

use lantern_kv::KvDtype;

use crate::backends::cpu_flash::CpuFlashBackend;
use crate::backends::cpu_reference::CpuReferenceBackend;
use crate::device::{expect_f32_dims, Device, LayerKvCache, Tensor};
use crate::error::AttnError;
use crate::layer::AttentionLayerSpec;
use crate::layout::{CacheGeometry, KvCacheLayout};
use crate::local::{make_local_attention_virtual_batches, LocalVirtualBatch};
use crate::metadata::{split_decodes_and_prefills, CommonAttentionMetadata, DecodePrefillSplit};

/// Name of the plain, obviously correct f32 backend (the oracle for the others).
pub const CPU_REFERENCE: &str = "cpu-reference";
/// Name of the default CPU backend (tiled online softmax, multi-threaded).
pub const CPU_FLASH: &str = "cpu-flash";
/// Every name [`backend_by_name`] accepts.
pub const BACKEND_NAMES: &[&str] = &[CPU_REFERENCE, CPU_FLASH];

/// Query length up to which a request counts as a decode in [`AttentionMetadata::split`].
pub const DECODE_THRESHOLD: usize = 1;

/// A backend's metadata for one step of one KV cache group, shared by all its layers.
///
/// For chunked-local layers it also holds the group's [`LocalVirtualBatch`]: built
/// eagerly by [`Self::with_chunked_local`] (or [`AttentionBackend::build_metadata_for`]),
/// or lazily by the first chunked-local layer that runs on it
/// ([`Self::local_virtual_batch`]), and then shared by every later layer of the step.
#[derive(Debug, Clone)]
pub struct AttentionMetadata {
    pub common: Arc<CommonAttentionMetadata>,
    /// Decode/prefill boundary (meaningful when the batch was reordered decodes first).
    pub split: DecodePrefillSplit,
    /// The virtual batch of `common` for one chunk size, once built.
    local: OnceLock<LocalEntry>,
    /// What the backend derived from `common` for its device (e.g. block tables uploaded
    /// to device memory), attached by its `build_metadata`; the CPU backends need none.
    backend_data: Option<BackendData>,
}

/// A backend's own per-step metadata, typed by the backend that attached it.
#[derive(Clone)]
struct BackendData(Arc<dyn Any + Send + Sync>);

impl fmt::Debug for BackendData {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("BackendData(..)")
    }
}

/// A cached virtual batch and what it was built from.
#[derive(Debug, Clone)]
struct LocalEntry {
    /// The `common` it was cut from: `common` is a public field, so a replaced one must
    /// not be served a stale virtual batch.
    source: Arc<CommonAttentionMetadata>,
    batch: Arc<LocalVirtualBatch>,
}

/// Equal when `common` and `split` are; the cached virtual batch and the backend's data
/// are derived from them.
impl PartialEq for AttentionMetadata {
    fn eq(&self, other: &Self) -> bool {
        self.common == other.common && self.split == other.split
    }
}

impl Eq for AttentionMetadata {}

impl AttentionMetadata {
    /// Metadata with the split computed for `decode_threshold`.
    pub fn new(common: Arc<CommonAttentionMetadata>, decode_threshold: usize) -> Self {
        let split = split_decodes_and_prefills(&common, decode_threshold);
        Self {
            common,
            split,
            local: OnceLock::new(),
            backend_data: None,
        }
    }

    /// The same metadata carrying `data`, the backend's own per-step metadata.
    pub fn with_backend_data<T: Any + Send + Sync>(mut self, data: T) -> Self {
        self.backend_data = Some(BackendData(Arc::new(data)));
        self
    }

    /// The backend's own per-step metadata, if it attached one of type `T`.
    pub fn backend_data<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.backend_data.as_ref()?.0.downcast_ref()
    }

    /// The same metadata with the chunked-local virtual batch for `chunk_size` built
    /// now (once per step per group), so no layer builds it on the step's path.
    ///
    /// Errors as [`make_local_attention_virtual_batches`] does (e.g. `chunk_size` not a
    /// multiple of the block size).
    pub fn with_chunked_local(self, chunk_size: usize) -> Result<Self, AttnError> {
        self.local_virtual_batch(chunk_size)?;
        Ok(self)
    }

    /// The chunked-local virtual batch of `common` for `chunk_size`.
    ///
    /// The first call builds it (`O(num_tokens + num_virtual * chunk_size /
    /// block_size)`) and caches it; later calls with the same chunk size return the
    /// cached one. A group's layers share one KV cache spec and so one chunk size; a
    /// call with another chunk size than the cached one builds a fresh batch every time
    /// without caching it.
    pub fn local_virtual_batch(
        &self,
        chunk_size: usize,
    ) -> Result<Arc<LocalVirtualBatch>, AttnError> {
        if let Some(e) = self.local.get() {
            if e.batch.chunk_size == chunk_size && Arc::ptr_eq(&e.source, &self.common) {
                return Ok(Arc::clone(&e.batch));
            }
        }
        let batch = Arc::new(make_local_attention_virtual_batches(
            chunk_size,
            &self.common,
        )?);
        // Lost races and a cache already holding another chunk size leave it as it is.
        let _ = self.local.set(LocalEntry {
            source: Arc::clone(&self.common),
            batch: Arc::clone(&batch),
        });
        Ok(batch)
    }
}

/// One kernel's launches and summed device time ([`AttentionBackend::kernel_times`]).
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub launches: u64,
    pub seconds: f64,
}

/// One way of computing attention over the paged KV cache.
pub trait AttentionBackend: Send + Sync {
    /// The name [`backend_by_name`] knows it by.
    fn name(&self) -> &'static str;

    /// The device its tensors and caches live on: `forward` takes q, k, v there and
    /// returns the output there.
    fn device(&self) -> Device;

    /// The accelerator its caches live on, described for people (name, compute
    /// capability, memory); `None` for the host's CPU.
    fn accelerator(&self) -> Option<String> {
        None
    }

    /// Device time per kernel so far, the longest total first, where the backend was
    /// asked to time its kernels (the CUDA backend: `LANTERN_CUDA_PROFILE=on`); `None`
    /// otherwise.
    fn kernel_times(&self) -> Option<Vec<KernelTime>> {
        None
    }

    /// The layout of the caches it allocates.
    fn kv_cache_layout(&self) -> KvCacheLayout;

    /// A zeroed cache for one layer, of its own type, on its device.
    fn allocate_cache(
        &self,
        geometry: CacheGeometry,
        dtype: KvDtype,
    ) -> Result<Box<dyn LayerKvCache>, AttnError>;

    /// Built once per step per KV cache group, shared by all layers of the group.
    fn build_metadata(&self, common: Arc<CommonAttentionMetadata>) -> AttentionMetadata;

    /// [`Self::build_metadata`] for a group whose layers are chunked-local with
    /// `chunk_size` (`None`: not chunked-local): the virtual batch is built here, once
    /// per step per group, instead of by the group's first layer.
    fn build_metadata_for(
        &self,
        common: Arc<CommonAttentionMetadata>,
        chunk_size: Option<usize>,
    ) -> Result<AttentionMetadata, AttnError> {
        let meta = self.build_metadata(common);
        match chunk_size {
            Some(c) => meta.with_chunked_local(c),
            None => Ok(meta),
        }
    }

    /// q: `[num_tokens, num_heads, head_dim]`; k, v: `[num_tokens, num_kv_heads,
    /// head_dim]` for this step's tokens, f32 tensors on [`Self::device`]. Writes k, v
    /// into `cache` (which this backend allocated) by the slot mapping, then computes
    /// attention for every query token over the request's keys (from the cache, through
    /// the layout) with the layer's mask/scale/soft-cap/sinks. Returns the output,
    /// `[num_tokens, num_heads, head_dim]` on the same device.
    ///
    /// Tokens of this step whose slot is padding (see `ScheduledSeq::slot_window`) are
    /// not in the cache; their K/V are taken from `k`/`v`, rounded to the cache's type.
    fn forward(
        &self,
        layer: &AttentionLayerSpec,
        meta: &AttentionMetadata,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut dyn LayerKvCache,
    ) -> Result<Tensor, AttnError>;

    /// Copies the keys at `slots` of `cache` (which this backend allocated) into `keys`,
    /// and the values into `values` when given, as host f32 `[slots.len(), num_kv_heads,
    /// head_dim]`. Attention capture calls it once per captured layer when a request
    /// finishes; a device backend copies from device memory here.
    fn read_slots(
        &self,
        cache: &dyn LayerKvCache,
        slots: &[usize],
        keys: &mut [f32],
        values: Option<&mut [f32]>,
    ) -> Result<(), AttnError>;

    /// The map `job` asks for (one request's query rows on one layer, over its keys in
    /// `cache` at `block_table`, the request's blocks in the layer's group), computed
    /// where the cache lives with the layer's own scale, masks, soft-cap and sinks, heads
    /// combined and top-k kept as [`crate::maps`] defines them: only the map crosses to
    /// the host. Attention capture asks when a request finishes, before its blocks are
    /// freed. `None` (the default): the backend leaves maps to the capture's own
    /// finalize from keys copied by [`Self::read_slots`] — the CPU backends, whose
    /// finalize runs off the step loop on the cores the engine leaves idle.
    fn probability_map(
        &self,
        cache: &dyn LayerKvCache,
        block_table: &[u32],
        job: &crate::ProbabilityMapJob<'_>,
    ) -> Option<Result<crate::ProbabilityMap, AttnError>> {
        let _ = (cache, block_table, job);
        None
    }

    /// Room on the backend's device for `rows` query rows of `row_len` values that a
    /// capturing request keeps there between steps ([`crate::KeptRows`]), so its steps
    /// copy no query rows to the host. `None` (the default, and a device backend without
    /// room to spare): the capture keeps them on the host, as the host backends'
    /// tensors already are.
    fn keep_rows(
        &self,
        rows: usize,
        row_len: usize,
    ) -> Option<Result<Box<dyn crate::KeptRows>, AttnError>> {
        let _ = (rows, row_len);
        None
    }

    /// The backend itself, for a device's model code that calls its native (non-host)
    /// entry points; `None` for backends that have none.
    fn as_any(&self) -> Option<&dyn Any> {
        None
    }

    /// Its recorded decode steps (CUDA graphs), when it replays them; `None`: every
    /// step runs eagerly.
    fn step_graphs(&self) -> Option<&dyn crate::StepGraphs> {
        None
    }
}

/// The backend called `name` with its default layout.
pub fn backend_by_name(name: &str) -> Result<Box<dyn AttentionBackend>, AttnError> {
    match name {
        CPU_REFERENCE => Ok(Box::new(CpuReferenceBackend::new())),
        CPU_FLASH => Ok(Box::new(CpuFlashBackend::new())),
        _ => Err(AttnError::UnknownBackend {
            name: name.to_string(),
            known: BACKEND_NAMES.join(", "),
        }),
    }
}

/// Checks everything a backend relies on before it touches a buffer: the layer spec,
/// the cache's layout and geometry against the backend and the layer, the metadata's
/// consistency, block ids inside the cache, and the element type and shapes of `q`, `k`,
/// `v`. After this returns `Ok`, indexing by the metadata cannot go out of bounds.
pub fn validate_forward_inputs(
    backend_layout: &KvCacheLayout,
    layer: &AttentionLayerSpec,
    common: &CommonAttentionMetadata,
    (q, k, v): (&Tensor, &Tensor, &Tensor),
    cache: &dyn LayerKvCache,
) -> Result<(), AttnError> {
    validate_step(backend_layout, layer, common, cache)?;
    let t = common.num_actual_tokens;
    expect_f32_dims("q", q, &[t, layer.num_heads, layer.head_dim])?;
    expect_f32_dims("k", k, &[t, layer.num_kv_heads, layer.head_dim])?;
    expect_f32_dims("v", v, &[t, layer.num_kv_heads, layer.head_dim])?;
    Ok(())
}

/// [`validate_forward_inputs`] without the tensors, for a backend whose q/k/v are not
/// host tensors: the layer spec, the cache's layout and geometry, the metadata, block
/// ids inside the cache.
pub fn validate_step(
    backend_layout: &KvCacheLayout,
    layer: &AttentionLayerSpec,
    common: &CommonAttentionMetadata,
    cache: &dyn LayerKvCache,
) -> Result<(), AttnError> {
    layer.validate()?;
    if cache.layout() != backend_layout {
        return Err(AttnError::LayoutMismatch {
            expected: *backend_layout,
            got: *cache.layout(),
        });
    }
    let geom = cache.geometry();
    if geom.num_kv_heads != layer.num_kv_heads || geom.head_dim != layer.head_dim {
        return Err(AttnError::Mismatch(format!(
            "layer has {} kv heads of dim {}, cache has {} of dim {}",
            layer.num_kv_heads, layer.head_dim, geom.num_kv_heads, geom.head_dim
        )));
    }
    if geom.block_size != common.block_size {
        return Err(AttnError::Mismatch(format!(
            "metadata block_size {} != cache block_size {}",
            common.block_size, geom.block_size
        )));
    }
    if !common.causal {
        return Err(AttnError::Unsupported("non-causal attention".into()));
    }
    common.validate()?;
    for r in 0..common.num_reqs {
        let used = common.seq_lens[r].div_ceil(common.block_size);
        // Released blocks (NULL_BLOCK) may only precede every key this step can see.
        let first_visible = layer.visible_key_range(common.num_computed_tokens[r]).start;
        let released_ok = first_visible / common.block_size;
        if let Some((_, &b)) = common
            .block_table
            .row(r)
            .iter()
            .take(used)
            .enumerate()
            .find(|&(i, &b)| {
                b as usize >= geom.num_blocks && !(b == lantern_kv::NULL_BLOCK && i < released_ok)
            })
        {
            return Err(AttnError::BlockOutOfRange {
                block: u64::from(b),
                num_blocks: geom.num_blocks,
            });
        }
    }
    Ok(())
}
