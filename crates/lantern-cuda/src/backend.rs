//! The CUDA attention backend: paged KV caches in device memory (either layout), the
//! step's metadata uploaded once per KV cache group, and the paged attention kernel over
//! them. The model's attention calls [`CudaBackend::attend`] on device buffers; the
//! [`AttentionBackend`] trait's host-tensor `forward` is served too (copying q/k/v in and
//! the output out), so anything written against the trait runs here unchanged.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaView};
use lantern_attn::{
    host_f32, tensor3, validate_step, AttentionBackend, AttentionLayerSpec, AttentionMetadata,
    AttnError, CacheGeometry, CommonAttentionMetadata, Device, GraphKey, KeptRows, KernelTime,
    KvCacheLayout, KvCacheShape, LayerKvCache, ProbabilityMap, ProbabilityMapJob, RowProbabilities,
    StepGraphs, Tensor, DECODE_THRESHOLD,
};
use lantern_kv::KvDtype;

use crate::cache::{attn_error, CacheData, CudaKvCache};
use crate::capture::ProbabilityRow;
use crate::gpu::Gpu;
use crate::graph::GRAPH_BATCH_SIZES;
use crate::kept::CudaKeptRows;
use crate::kernels::{AttnParams, CacheElem, KvStrides, PagedMeta, RopeStep};
use crate::pool::Pooled;

/// FlashAttention's layout, `[2, num_blocks, block_size, kv_heads, head_dim]`.
pub const CUDA: &str = "cuda";
/// FlashInfer's layout, `[num_blocks, 2, block_size, kv_heads, head_dim]`.
pub const CUDA_FLASHINFER: &str = "cuda-flashinfer";
pub const CUDA_BACKEND_NAMES: &[&str] = &[CUDA, CUDA_FLASHINFER];

pub struct CudaBackend {
    gpu: Arc<Gpu>,
    name: &'static str,
    layout: KvCacheLayout,
    /// Whether decode steps are replayed from CUDA graphs.
    graphs: bool,
    /// Whether capturing requests keep their query rows on the device
    /// ([`AttentionBackend::keep_rows`]); `LANTERN_CUDA_KEEP_QUERIES=off` keeps them on
    /// the host (for comparing the two).
    keeps_rows: bool,
}

/// One step's metadata of one KV cache group, on the device.
pub struct DeviceMetadata {
    query_start_loc: Pooled<u32>,
    seq_lens: Pooled<u32>,
    block_table: Pooled<u32>,
    table_stride: usize,
    slot_mapping: Pooled<i64>,
}

/// What `build_metadata` attached: the device copy, or why it could not be made (the
/// trait's `build_metadata` cannot fail; the layer's forward reports it).
type Uploaded = Result<DeviceMetadata, String>;

fn u32s(what: &str, values: &[usize]) -> Result<Vec<u32>, String> {
    values
        .iter()
        .map(|&v| u32::try_from(v).map_err(|_| format!("{what} value {v} exceeds 32 bits")))
        .collect()
}

impl CudaBackend {
    /// The backend `name` (one of [`CUDA_BACKEND_NAMES`]) on `gpu`.
    pub fn new(gpu: Arc<Gpu>, name: &str) -> Result<Self, AttnError> {
        let (name, shape) = match name {
            CUDA => (CUDA, KvCacheShape::KvFirst),
            CUDA_FLASHINFER => (CUDA_FLASHINFER, KvCacheShape::BlocksFirst),
            _ => {
                return Err(AttnError::UnknownBackend {
                    name: name.to_string(),
                    known: CUDA_BACKEND_NAMES.join(", "),
                })
            }
        };
        Ok(Self {
            gpu,
            name,
            layout: KvCacheLayout::contiguous(shape),
            graphs: true,
            keeps_rows: std::env::var("LANTERN_CUDA_KEEP_QUERIES")
                .map_or(true, |v| !matches!(v.trim(), "off" | "0" | "false")),
        })
    }

    /// The backend with decode steps always run eagerly (`--enforce-eager`).
    pub fn eager(mut self) -> Self {
        self.graphs = false;
        self
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    fn upload(&self, common: &CommonAttentionMetadata) -> Uploaded {
        let e = |e: crate::CudaError| e.to_string();
        let table = common.block_table.as_padded();
        let stride = common.block_table.max_blocks_per_row();
        // An empty table still needs a buffer to point at.
        let table = if table.is_empty() { &[0][..] } else { table };
        Ok(DeviceMetadata {
            query_start_loc: self
                .gpu
                .step_upload(&u32s("query_start_loc", &common.query_start_loc)?)
                .map_err(e)?,
            seq_lens: self
                .gpu
                .step_upload(&u32s("seq_lens", &common.seq_lens)?)
                .map_err(e)?,
            block_table: self.gpu.step_upload(table).map_err(e)?,
            table_stride: stride,
            slot_mapping: self.gpu.step_upload(&common.slot_mapping).map_err(e)?,
        })
    }

    /// Attention of one layer on device buffers: writes this step's `k`/`v` into `cache`
    /// by the slot mapping, then attends `q` over the paged cache. All `[tokens, heads,
    /// head_dim]` f32. With `rope`, the keys are turned by it as they are written and `q`
    /// in place before (one launch for both: [`Gpu::rope_kv_write`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attend(
        &self,
        spec: &AttentionLayerSpec,
        meta: &AttentionMetadata,
        q: &mut CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        rope: Option<&RopeStep<'_>>,
        cache: &mut dyn LayerKvCache,
    ) -> Result<Pooled<f32>, AttnError> {
        let common = &meta.common;
        validate_step(&self.layout, spec, common, &*cache)?;
        let t = common.num_actual_tokens;
        for (what, buf, heads) in [
            ("q", &*q, spec.num_heads),
            ("k", k, spec.num_kv_heads),
            ("v", v, spec.num_kv_heads),
        ] {
            let expected = t * heads * spec.head_dim;
            if buf.len() != expected {
                return Err(AttnError::LengthMismatch {
                    what,
                    expected,
                    got: buf.len(),
                });
            }
        }
        let device = match meta.backend_data::<Uploaded>() {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(AttnError::InvalidMetadata(e.clone())),
            None => {
                return Err(AttnError::InvalidMetadata(
                    "metadata was not built by the cuda backend".into(),
                ))
            }
        };
        let cache: &mut CudaKvCache = cache
            .as_any_mut()
            .downcast_mut()
            .ok_or(AttnError::ForeignCache { backend: self.name })?;
        let sinks = match &spec.sinks {
            Some(s) => Some(self.gpu.step_upload(s).map_err(attn_error)?),
            None => None,
        };
        let mut out = self.gpu.step_output::<f32>(q.len()).map_err(attn_error)?;
        // A graph step plans its key splits for the longest sequence its table can hold:
        // the plan is recorded, and must hold for every step replayed.
        let planning_len = if self.gpu.in_graph_step() {
            device.table_stride * common.block_size
        } else {
            common.max_seq_len
        };
        let paged = PagedMeta {
            query_start_loc: device.query_start_loc.as_view(),
            seq_lens: device.seq_lens.as_view(),
            block_table: device.block_table.as_view(),
            table_stride: device.table_stride,
            num_reqs: common.num_reqs,
            num_tokens: t,
            max_query_len: common.max_query_len,
            max_seq_len: planning_len,
        };
        let params = attn_params(spec, sinks.as_ref().map(|s| s.as_view()));
        let strides = *cache.strides();
        let slots = &*device.slot_mapping;
        let step = Step {
            gpu: &self.gpu,
            strides: &strides,
            paged: &paged,
            params: &params,
            rope,
        };
        match &mut cache.data {
            CacheData::F32(c) => step.run(c, (&mut *q, k, v), slots, &mut out),
            CacheData::F16(c) => step.run(c, (&mut *q, k, v), slots, &mut out),
            CacheData::Bf16(c) => step.run(c, (&mut *q, k, v), slots, &mut out),
        }
        .map_err(attn_error)?;
        Ok(out)
    }
}

/// Probabilities of a capture's rows computed on the device and not yet copied to the
/// host ([`CudaBackend::launch_row_probabilities`]).
pub struct PendingProbabilities {
    values: Pooled<f32>,
    len: usize,
}

impl PendingProbabilities {
    /// Device bytes it holds.
    pub fn size_bytes(&self) -> usize {
        self.values.len() * size_of::<f32>()
    }

    /// Copies the values into `probabilities` (laid out for them by
    /// [`CudaBackend::launch_row_probabilities`]); left unfilled where a row met an
    /// invalid block.
    pub fn fill(self, gpu: &Gpu, probabilities: &mut RowProbabilities) -> Result<(), AttnError> {
        let len = self.len;
        // A graph step's buffer holds more than the rows (see `launch_row_probabilities`).
        let computed = len.min(self.values.len());
        let values = gpu
            .download(&self.values.slice(..computed))
            .map_err(attn_error)?;
        let room = probabilities.parts_mut().0.len();
        if values.len() < len || room < len {
            return Err(AttnError::Unsupported(format!(
                "{len} probabilities filled into rows of {room} from {} computed",
                values.len()
            )));
        }
        if values[..len].iter().any(|v| v.is_nan()) {
            probabilities.clear_filled();
            return Ok(());
        }
        probabilities.parts_mut().0[..len].copy_from_slice(&values[..len]);
        Ok(())
    }
}

impl CudaBackend {
    /// Lays out `probabilities` (the batch rows a capture asks for) and launches their
    /// computation after the layer's [`CudaBackend::attend`]: each row's probabilities
    /// for every query head over the keys it sees, from `q` and the paged cache with the
    /// layer's scale, masks, soft-cap and sinks. The values stay on the device until
    /// [`PendingProbabilities::fill`] copies them over (`None`: nothing to compute, left
    /// unfilled; a row that meets an invalid block leaves them unfilled too, and the
    /// capture then computes its figures from the keys when the request finishes).
    pub fn launch_row_probabilities(
        &self,
        spec: &AttentionLayerSpec,
        meta: &AttentionMetadata,
        q: &CudaSlice<f32>,
        cache: &dyn LayerKvCache,
        probabilities: &mut RowProbabilities,
    ) -> Result<Option<PendingProbabilities>, AttnError> {
        probabilities.clear_filled();
        let common = &meta.common;
        let device = match meta.backend_data::<Uploaded>() {
            Some(Ok(d)) => d,
            _ => return Ok(None),
        };
        let cache: &CudaKvCache = cache
            .as_any()
            .downcast_ref()
            .ok_or(AttnError::ForeignCache { backend: self.name })?;
        // Each batch row's request and position, as the kernel's metadata has them.
        let tokens = common.num_actual_tokens;
        let mut request = vec![usize::MAX; tokens];
        for r in 0..common.num_reqs {
            let (a, b) = (common.query_start_loc[r], common.query_start_loc[r + 1]);
            request[a.min(tokens)..b.min(tokens)].fill(r);
        }
        if probabilities
            .rows()
            .iter()
            .any(|&t| request.get(t).is_none_or(|&r| r == usize::MAX))
        {
            return Err(AttnError::Unsupported(format!(
                "probabilities asked for a row outside the step's {tokens} query tokens"
            )));
        }
        let position = |t: usize| {
            let r = request[t];
            let start = common.query_start_loc[r];
            let query_len = common.query_start_loc[r + 1] - start;
            common.seq_lens[r] - query_len + (t - start)
        };
        probabilities.prepare(spec.num_heads, |t| spec.visible_key_range(position(t)));
        let asked = probabilities.rows().to_vec();
        let rows: Vec<ProbabilityRow> = {
            let (_, keys, offsets) = probabilities.parts_mut();
            (asked.iter().zip(keys.iter().zip(offsets)))
                .map(|(&t, (keys, &offset))| ProbabilityRow {
                    token: t,
                    request: request[t],
                    keys: keys.clone(),
                    offset,
                })
                .collect()
        };
        let len = rows
            .iter()
            .map(|r| r.offset + r.keys.len() * spec.num_heads)
            .max()
            .unwrap_or(0);
        let sinks = match &spec.sinks {
            Some(s) => Some(self.gpu.step_upload(s).map_err(attn_error)?),
            None => None,
        };
        let params = attn_params(spec, sinks.as_ref().map(|s| s.as_view()));
        // A graph step's buffer has room for every key its table can hold in every row,
        // so that it has the same size in every step replayed (the rows' offsets are
        // uploaded with the step).
        let room = if self.gpu.in_graph_step() {
            rows.len() * device.table_stride * common.block_size * spec.num_heads
        } else {
            len
        };
        let mut out = self
            .gpu
            .step_output::<f32>(room.max(len).max(1))
            .map_err(attn_error)?;
        let table = (&*device.block_table, device.table_stride);
        let strides = cache.strides();
        let (gpu, o) = (&self.gpu, &mut *out);
        match &cache.data {
            CacheData::F32(c) => gpu.row_probabilities(q, c, strides, table, &rows, &params, o),
            CacheData::F16(c) => gpu.row_probabilities(q, c, strides, table, &rows, &params, o),
            CacheData::Bf16(c) => gpu.row_probabilities(q, c, strides, table, &rows, &params, o),
        }
        .map_err(attn_error)?;
        Ok(Some(PendingProbabilities { values: out, len }))
    }
}

/// The kernels' view of a layer's attention, its sinks (if any) on the device.
pub(crate) fn attn_params<'a>(
    spec: &AttentionLayerSpec,
    sinks: Option<CudaView<'a, f32>>,
) -> AttnParams<'a> {
    AttnParams {
        num_heads: spec.num_heads,
        num_kv_heads: spec.num_kv_heads,
        head_dim: spec.head_dim,
        scale: spec.scale,
        sliding_window: spec.sliding_window,
        chunk_size: spec.chunk_size,
        soft_cap: spec.logits_soft_cap,
        sinks,
    }
}

/// The two launches of one layer's step, generic over the cache's element type.
struct Step<'a> {
    gpu: &'a Gpu,
    strides: &'a KvStrides,
    paged: &'a PagedMeta<'a>,
    params: &'a AttnParams<'a>,
    rope: Option<&'a RopeStep<'a>>,
}

impl Step<'_> {
    fn run<T: CacheElem>(
        &self,
        cache: &mut CudaSlice<T>,
        (q, k, v): (&mut CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        slots: &CudaSlice<i64>,
        out: &mut CudaSlice<f32>,
    ) -> crate::Result<()> {
        match self.rope {
            Some(rope) => {
                let q_heads = self.params.num_heads;
                self.gpu.rope_kv_write(
                    (&mut *q, q_heads),
                    k,
                    v,
                    rope,
                    slots,
                    cache,
                    self.strides,
                )?
            }
            None => self.gpu.kv_write(k, v, slots, cache, self.strides)?,
        }
        let q: &CudaSlice<f32> = q;
        self.gpu
            .paged_attention(q, out, cache, self.strides, self.paged, self.params)
    }
}

impl AttentionBackend for CudaBackend {
    fn name(&self) -> &'static str {
        self.name
    }

    /// The host: tensors crossing this trait are host tensors; the model's own path
    /// keeps everything on the GPU through [`CudaBackend::attend`].
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn accelerator(&self) -> Option<String> {
        let g = &self.gpu;
        let (major, minor) = g.compute_capability();
        let memory = g
            .memory_info()
            .map(|(_, total)| format!(", {:.0} GiB", total as f64 / (1u64 << 30) as f64))
            .unwrap_or_default();
        let launches = if g.launches_overlap() {
            ", overlapped launches"
        } else {
            ""
        };
        Some(format!(
            "{} (cuda:{}, compute capability {major}.{minor}, {} SMs{memory}{launches})",
            g.name(),
            g.ordinal(),
            g.sm_count()
        ))
    }

    fn kernel_times(&self) -> Option<Vec<KernelTime>> {
        match self.gpu.kernel_times() {
            Ok(times) => times,
            Err(e) => {
                tracing::warn!("kernel times could not be read: {e}");
                None
            }
        }
    }

    fn kv_cache_layout(&self) -> KvCacheLayout {
        self.layout
    }

    fn allocate_cache(
        &self,
        geometry: CacheGeometry,
        dtype: KvDtype,
    ) -> Result<Box<dyn LayerKvCache>, AttnError> {
        Ok(Box::new(CudaKvCache::new(
            Arc::clone(&self.gpu),
            geometry,
            self.layout,
            dtype,
        )?))
    }

    fn build_metadata(&self, common: Arc<CommonAttentionMetadata>) -> AttentionMetadata {
        let uploaded = self.upload(&common);
        AttentionMetadata::new(common, DECODE_THRESHOLD).with_backend_data(uploaded)
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
        let up = |t: &Tensor| -> Result<CudaSlice<f32>, AttnError> {
            self.gpu.upload(&host_f32(t)?).map_err(attn_error)
        };
        let out = self.attend(layer, meta, &mut up(q)?, &up(k)?, &up(v)?, None, cache)?;
        let host = self.gpu.download(&*out).map_err(attn_error)?;
        let dims = [
            meta.common.num_actual_tokens,
            layer.num_heads,
            layer.head_dim,
        ];
        tensor3(host, dims, &Device::Cpu)
    }

    fn read_slots(
        &self,
        cache: &dyn LayerKvCache,
        slots: &[usize],
        keys: &mut [f32],
        values: Option<&mut [f32]>,
    ) -> Result<(), AttnError> {
        let cache: &CudaKvCache = cache
            .as_any()
            .downcast_ref()
            .ok_or(AttnError::ForeignCache { backend: self.name })?;
        cache.read_slots(slots, keys, values)
    }

    /// Computed on the device: only the map is copied to the host (`maps.rs`).
    fn probability_map(
        &self,
        cache: &dyn LayerKvCache,
        block_table: &[u32],
        job: &ProbabilityMapJob<'_>,
    ) -> Option<Result<ProbabilityMap, AttnError>> {
        Some(self.map_on_device(cache, block_table, job))
    }

    /// On the device, where it has room (see [`CudaKeptRows::new`]).
    fn keep_rows(
        &self,
        rows: usize,
        row_len: usize,
    ) -> Option<Result<Box<dyn KeptRows>, AttnError>> {
        if !self.keeps_rows {
            return None;
        }
        let kept = CudaKeptRows::new(Arc::clone(&self.gpu), rows, row_len);
        Some(
            kept.map(|k| Box::new(k) as Box<dyn KeptRows>)
                .map_err(attn_error),
        )
    }

    fn as_any(&self) -> Option<&dyn std::any::Any> {
        Some(self)
    }

    fn step_graphs(&self) -> Option<&dyn StepGraphs> {
        self.graphs.then_some(self as &dyn StepGraphs)
    }
}

/// Decode steps replayed from CUDA graphs (see `graph.rs`): the paged attention kernels
/// read their metadata from device buffers and take a fixed grid for a fixed batch and
/// block-table width, so a whole decode step is one graph (vLLM's FULL_DECODE_ONLY).
impl StepGraphs for CudaBackend {
    fn batch_sizes(&self) -> &[usize] {
        GRAPH_BATCH_SIZES
    }

    fn begin_step(&self, key: GraphKey) -> Result<bool, AttnError> {
        self.gpu.begin_graph_step(key).map_err(attn_error)
    }

    fn end_step(&self, ok: bool) -> Result<(), AttnError> {
        self.gpu.end_graph_step(ok).map_err(attn_error)
    }

    fn stats(&self) -> lantern_attn::GraphStats {
        self.gpu.graph_stats()
    }
}
