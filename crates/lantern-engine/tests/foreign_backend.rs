//! The attention backend boundary, checked from outside `lantern-attn`: a backend written
//! here, with its own cache type, its own per-step metadata and its own kernel, runs the
//! engine, the model and attention capture unchanged, and gives what `cpu-reference`
//! gives. It stands in for a device backend: it allocates its caches, takes and returns
//! tensors, hands capture its keys through `read_slots`, and may keep capturing requests'
//! query rows on its "device" (`keep_rows`).

mod common;

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::quantized::GgmlDType;
use lantern_attn::{
    backend_by_name, combine_heads, host_f32, slot_for_position, tensor3, top_k,
    validate_forward_inputs, AttentionBackend, AttentionLayerSpec, AttentionMetadata, AttnError,
    CacheGeometry, CommonAttentionMetadata, Device, GraphKey, GraphStats, KeptHeads, KeptRows,
    KvCacheLayout, KvCacheShape, LayerKvCache, MapQueries, ProbabilityMap, ProbabilityMapJob,
    StepGraphs, Tensor, CPU_REFERENCE,
};
use lantern_capture::{CaptureResult, CaptureSpec, HeadReduce, KeyStat, RowSelection};
use lantern_engine::{Completion, Engine, SamplingParams};
use lantern_kv::KvDtype;

const LAYERS: usize = 7;

/// Keys and values by slot, `[slots, kv_heads, head_dim]` each, in f32.
#[derive(Debug)]
struct SlotCache {
    geometry: CacheGeometry,
    layout: KvCacheLayout,
    keys: Vec<f32>,
    values: Vec<f32>,
}

impl LayerKvCache for SlotCache {
    fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }
    fn layout(&self) -> &KvCacheLayout {
        &self.layout
    }
    fn dtype(&self) -> KvDtype {
        KvDtype::F32
    }
    fn size_bytes(&self) -> usize {
        (self.keys.len() + self.values.len()) * 4
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// What this backend "uploads" once per step and group: every key position's slot, per
/// request (a device backend would put its block tables and slot mapping here).
struct StagedSlots {
    /// `key_slots[r][p]`: the slot of key position `p` of request `r`.
    key_slots: Vec<Vec<Option<usize>>>,
}

/// What the backend does when capture asks it for a layer's map.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Maps {
    /// Declines: the capture copies the keys and finalize computes the map.
    Declined,
    /// Computes it from its own cache, as a device backend does where its cache lives.
    Computed,
    /// Fails (as a device out of memory would): the capture falls back to the keys.
    Failing,
    /// Returns a map one value short: refused, and the capture falls back to the keys.
    Misshapen,
}

/// Where the backend keeps capturing requests' query rows.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kept {
    /// Leaves them to the capture, on the host (as the host backends do).
    Host,
    /// Keeps them itself ([`SlotKeptRows`]), as a device backend keeps them on its device.
    Device,
    /// Has no room for them (as a full device): the capture keeps them on the host.
    NoRoom,
}

/// What happened to the rows the backend kept.
#[derive(Debug, Default)]
struct RowTraffic {
    /// Rows copied in from a step's q.
    written: AtomicUsize,
    /// Rows copied out to the host.
    read: AtomicUsize,
    /// Layers' rows allocated and not yet dropped.
    alive: AtomicUsize,
}

/// One captured layer's query rows, kept by the backend: `[capacity, row_len]`.
#[derive(Debug)]
struct SlotKeptRows {
    values: Vec<f32>,
    row_len: usize,
    traffic: Arc<RowTraffic>,
}

impl Drop for SlotKeptRows {
    fn drop(&mut self) {
        self.traffic.alive.fetch_sub(1, Ordering::SeqCst);
    }
}

impl KeptRows for SlotKeptRows {
    fn row_len(&self) -> usize {
        self.row_len
    }

    fn capacity(&self) -> usize {
        self.values.len() / self.row_len
    }

    fn write(
        &mut self,
        q: &dyn std::any::Any,
        tokens: Range<usize>,
        heads: KeptHeads<'_>,
        first_row: usize,
    ) -> Result<(), AttnError> {
        let q: &Tensor = q
            .downcast_ref()
            .ok_or_else(|| AttnError::Unsupported("not this backend's tensor".into()))?;
        let q = host_f32(q)?;
        let d = heads.head_dim;
        for (i, t) in tokens.enumerate() {
            for (j, &h) in heads.kept.iter().enumerate() {
                let src = &q[(t * heads.num_heads + h) * d..][..d];
                self.values[(first_row + i) * self.row_len + j * d..][..d].copy_from_slice(src);
                self.traffic.written.fetch_add(1, Ordering::SeqCst);
            }
        }
        Ok(())
    }

    fn read(&self, rows: Range<usize>) -> Result<Vec<f32>, AttnError> {
        self.traffic.read.fetch_add(rows.len(), Ordering::SeqCst);
        Ok(self.values[rows.start * self.row_len..rows.end * self.row_len].to_vec())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Graph steps that record nothing: a step of a key runs as it would eagerly. What they
/// check is the runner's side of graphs (steps padded to a graph's batch size, the keys,
/// a capture's tap handed to a graph step), on a machine without a GPU.
#[derive(Debug, Default)]
struct PassThroughGraphs {
    /// The key of every step run as a graph step.
    steps: Mutex<Vec<GraphKey>>,
}

impl StepGraphs for PassThroughGraphs {
    fn batch_sizes(&self) -> &[usize] {
        &[1, 2, 4, 8]
    }

    fn begin_step(&self, key: GraphKey) -> Result<bool, AttnError> {
        self.steps.lock().unwrap().push(key);
        Ok(true)
    }

    fn end_step(&self, ok: bool) -> Result<(), AttnError> {
        assert!(ok, "a graph step failed");
        Ok(())
    }

    fn stats(&self) -> GraphStats {
        GraphStats {
            replayed: self.steps.lock().unwrap().len(),
            ..GraphStats::default()
        }
    }
}

struct SlotBackend {
    layout: KvCacheLayout,
    maps: Maps,
    kept: Kept,
    traffic: Arc<RowTraffic>,
    graphs: Option<Arc<PassThroughGraphs>>,
}

impl SlotBackend {
    fn new() -> Self {
        Self::with_maps(Maps::Declined)
    }

    fn with_maps(maps: Maps) -> Self {
        Self {
            layout: KvCacheLayout::contiguous(KvCacheShape::BlocksFirst),
            maps,
            kept: Kept::Host,
            traffic: Arc::default(),
            graphs: None,
        }
    }

    fn graphing(mut self, graphs: Arc<PassThroughGraphs>) -> Self {
        self.graphs = Some(graphs);
        self
    }

    fn keeping(mut self, kept: Kept) -> Self {
        self.kept = kept;
        self
    }

    /// The map `job` asks for, from the keys at the request's slots, row by row through
    /// the same per-row probabilities the host's finalize uses, then heads combined and
    /// top-k kept as `lantern_attn::maps` defines them.
    fn map(
        cache: &SlotCache,
        block_table: &[u32],
        job: &ProbabilityMapJob<'_>,
    ) -> Result<ProbabilityMap, AttnError> {
        job.check()?;
        // Rows it kept itself are read where they are; others come from the host.
        let queries = match job.queries {
            MapQueries::Kept { rows, first } => {
                match rows.as_any().downcast_ref::<SlotKeptRows>() {
                    Some(kept) => {
                        let row_len = kept.row_len;
                        let n = job.positions.len();
                        std::borrow::Cow::Borrowed(&kept.values[first * row_len..][..n * row_len])
                    }
                    None => job.host_queries()?,
                }
            }
            MapQueries::Host(_) => job.host_queries()?,
        };
        let (layer, d) = (job.layer, job.layer.head_dim);
        let (row_len, bs) = (cache.geometry.token_row_len(), cache.geometry.block_size);
        let (heads, n) = (job.heads.len(), job.num_keys);
        let mut dense = vec![0f32; heads * n];
        let (mut combined, mut values) = (Vec::new(), Vec::new());
        let mut indices = job.top_k.map(|_| Vec::new());
        for (i, pos) in job.positions.clone().enumerate() {
            dense.fill(0.0);
            let visible = job.visible(pos);
            for (hi, &h) in job.heads.iter().enumerate() {
                let kv = layer.kv_head_for(h) * d;
                let mut keys = Vec::with_capacity(visible.len() * d);
                for p in visible.clone() {
                    let slot = slot_for_position(block_table, bs, p)
                        .and_then(|s| usize::try_from(s).ok())
                        .ok_or_else(|| AttnError::InvalidMetadata(format!("no slot for {p}")))?;
                    keys.extend_from_slice(&cache.keys[slot * row_len + kv..][..d]);
                }
                let q = &queries[(i * heads + hi) * d..][..d];
                let row = &mut dense[hi * n..][visible.clone()];
                lantern_attn::row_probabilities(layer, h, q, &keys, row);
            }
            match &mut indices {
                None => combine_heads(&dense, heads, n, job.combine, &mut values),
                Some(indices) => {
                    combined.clear();
                    combine_heads(&dense, heads, n, job.combine, &mut combined);
                    top_k(&combined, n, job.width(), &mut values, indices);
                }
            }
        }
        Ok(ProbabilityMap { values, indices })
    }

    fn own(cache: &dyn LayerKvCache) -> Result<&SlotCache, AttnError> {
        cache
            .as_any()
            .downcast_ref()
            .ok_or(AttnError::ForeignCache { backend: "slots" })
    }
}

impl AttentionBackend for SlotBackend {
    fn name(&self) -> &'static str {
        "slots"
    }

    fn device(&self) -> Device {
        Device::Cpu
    }

    fn kv_cache_layout(&self) -> KvCacheLayout {
        self.layout
    }

    fn allocate_cache(
        &self,
        geometry: CacheGeometry,
        dtype: KvDtype,
    ) -> Result<Box<dyn LayerKvCache>, AttnError> {
        if dtype != KvDtype::F32 {
            return Err(AttnError::Unsupported(format!("{dtype:?} cache")));
        }
        let len = geometry.num_slots()? * geometry.token_row_len();
        Ok(Box::new(SlotCache {
            geometry,
            layout: self.layout,
            keys: vec![0.0; len],
            values: vec![0.0; len],
        }))
    }

    fn build_metadata(&self, common: Arc<CommonAttentionMetadata>) -> AttentionMetadata {
        let key_slots = (0..common.num_reqs)
            .map(|r| {
                let table = common.block_table.row(r);
                (0..common.seq_lens[r])
                    .map(|p| {
                        slot_for_position(table, common.block_size, p)
                            .and_then(|s| usize::try_from(s).ok())
                    })
                    .collect()
            })
            .collect();
        AttentionMetadata::new(common, 1).with_backend_data(StagedSlots { key_slots })
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
        validate_forward_inputs(&self.layout, layer, &meta.common, (q, k, v), &*cache)?;
        let staged: &StagedSlots = meta
            .backend_data()
            .ok_or_else(|| AttnError::InvalidMetadata("not built by this backend".into()))?;
        let cache: &mut SlotCache = cache
            .as_any_mut()
            .downcast_mut()
            .ok_or(AttnError::ForeignCache { backend: "slots" })?;
        let (q, k, v) = (host_f32(q)?, host_f32(k)?, host_f32(v)?);
        let common = &meta.common;
        let (d, row) = (layer.head_dim, layer.num_kv_heads * layer.head_dim);
        for (t, &slot) in common.slot_mapping.iter().enumerate() {
            if let Ok(slot) = usize::try_from(slot) {
                cache.keys[slot * row..][..row].copy_from_slice(&k[t * row..][..row]);
                cache.values[slot * row..][..row].copy_from_slice(&v[t * row..][..row]);
            }
        }
        let mut out = vec![0f32; q.len()];
        for r in 0..common.num_reqs {
            let (first, computed) = (common.query_start_loc[r], common.num_computed_tokens[r]);
            // A key of this step is read from the step's own K/V (its slot may be padding).
            let key_row = |p: usize| -> Result<(&[f32], &[f32]), AttnError> {
                if p >= computed {
                    let t = first + p - computed;
                    return Ok((&k[t * row..][..row], &v[t * row..][..row]));
                }
                let slot = staged.key_slots[r][p]
                    .ok_or_else(|| AttnError::InvalidMetadata(format!("no slot for {p}")))?;
                Ok((
                    &cache.keys[slot * row..][..row],
                    &cache.values[slot * row..][..row],
                ))
            };
            for t in first..common.query_start_loc[r + 1] {
                let pos = computed + t - first;
                for h in 0..layer.num_heads {
                    let kv = layer.kv_head_for(h) * d;
                    let q_row = &q[(t * layer.num_heads + h) * d..][..d];
                    let visible = layer.visible_key_range(pos);
                    let mut weights = Vec::with_capacity(visible.len());
                    for p in visible.clone() {
                        let (key, _) = key_row(p)?;
                        let dot: f32 = q_row.iter().zip(&key[kv..kv + d]).map(|(a, b)| a * b).sum();
                        weights.push(layer.transform_score(dot));
                    }
                    layer.softmax_in_place(h, &mut weights);
                    let o = &mut out[(t * layer.num_heads + h) * d..][..d];
                    for (p, w) in visible.zip(&weights) {
                        let (_, value) = key_row(p)?;
                        for (o, x) in o.iter_mut().zip(&value[kv..kv + d]) {
                            *o += w * x;
                        }
                    }
                }
            }
        }
        let dims = [common.num_actual_tokens, layer.num_heads, d];
        tensor3(out, dims, &Device::Cpu)
    }

    fn read_slots(
        &self,
        cache: &dyn LayerKvCache,
        slots: &[usize],
        keys: &mut [f32],
        values: Option<&mut [f32]>,
    ) -> Result<(), AttnError> {
        let cache = Self::own(cache)?;
        let row = cache.geometry.token_row_len();
        let num_slots = cache.keys.len() / row;
        if keys.len() != slots.len() * row {
            return Err(AttnError::LengthMismatch {
                what: "keys",
                expected: slots.len() * row,
                got: keys.len(),
            });
        }
        let mut values = values;
        for (i, &slot) in slots.iter().enumerate() {
            if slot >= num_slots {
                return Err(AttnError::SlotOutOfRange {
                    slot: slot as i64,
                    num_slots,
                });
            }
            keys[i * row..][..row].copy_from_slice(&cache.keys[slot * row..][..row]);
            if let Some(v) = values.as_deref_mut() {
                v[i * row..][..row].copy_from_slice(&cache.values[slot * row..][..row]);
            }
        }
        Ok(())
    }

    fn keep_rows(
        &self,
        rows: usize,
        row_len: usize,
    ) -> Option<Result<Box<dyn KeptRows>, AttnError>> {
        match self.kept {
            Kept::Host => None,
            Kept::NoRoom => Some(Err(AttnError::Unsupported("no room".into()))),
            Kept::Device => {
                self.traffic.alive.fetch_add(1, Ordering::SeqCst);
                Some(Ok(Box::new(SlotKeptRows {
                    values: vec![0.0; rows * row_len],
                    row_len,
                    traffic: Arc::clone(&self.traffic),
                })))
            }
        }
    }

    fn probability_map(
        &self,
        cache: &dyn LayerKvCache,
        block_table: &[u32],
        job: &ProbabilityMapJob<'_>,
    ) -> Option<Result<ProbabilityMap, AttnError>> {
        let cache = match Self::own(cache) {
            Ok(c) => c,
            Err(e) => return Some(Err(e)),
        };
        match self.maps {
            Maps::Declined => None,
            Maps::Computed => Some(Self::map(cache, block_table, job)),
            Maps::Failing => Some(Err(AttnError::Unsupported("out of device memory".into()))),
            Maps::Misshapen => Some(Self::map(cache, block_table, job).map(|mut m| {
                m.values.pop();
                m
            })),
        }
    }

    fn step_graphs(&self) -> Option<&dyn StepGraphs> {
        self.graphs.as_deref().map(|g| g as &dyn StepGraphs)
    }
}

fn engine(backend: Box<dyn AttentionBackend>) -> (Engine, tempfile::TempDir) {
    // f32 weights: the two backends then differ only in how they sum.
    let (loaded, dir) = common::tiny_gemma3_model(LAYERS, GgmlDType::F32);
    let config = lantern_engine::EngineConfig {
        kv_cache_memory: 4 << 20,
        block_size: 4,
        // Prompts of 23 and 31 tokens are prefilled in chunks beside decodes.
        max_num_batched_tokens: 16,
        ..common::f32_kv()
    };
    (Engine::with_backend(loaded, config, backend).unwrap(), dir)
}

/// Three requests batched, prompts longer than the sliding window (8), some chunked,
/// one capturing every layer and head (with the attention output, which finalize checks
/// P·V against).
fn run(engine: &mut Engine) -> Vec<Completion> {
    let mut spec = CaptureSpec::everything(LAYERS, 4);
    spec.keep_attention_output = true;
    let requests = [(23, 5, Some(spec)), (9, 7, None), (31, 3, None)]
        .into_iter()
        .map(|(len, max_tokens, capture)| {
            let prompt = (0..len)
                .map(|j| ((len * 7 + j * 13) % 250) as u32)
                .collect();
            let params = SamplingParams {
                ignore_eos: true,
                prompt_logits: true,
                ..SamplingParams::greedy(max_tokens)
            };
            (prompt, params, capture)
        })
        .collect();
    common::run_to_completion(engine, requests)
}

/// Both backends sum in the same order, so today the results are equal; the bounds leave
/// room for another order and still catch an output off by 0.1% (logits then move by
/// ~9e-6, maps by ~5e-7).
#[test]
fn a_backend_from_outside_runs_the_engine_and_capture_unchanged() {
    let (mut theirs, _dir) = engine(Box::new(SlotBackend::new()));
    assert_eq!(theirs.attention_backend(), "slots");
    let (mut reference, _dir2) = engine(backend_by_name(CPU_REFERENCE).unwrap());
    let (got, want) = (run(&mut theirs), run(&mut reference));
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.token_ids, w.token_ids);
        let diff = common::max_abs_diff(
            g.prompt_logits.as_ref().unwrap(),
            w.prompt_logits.as_ref().unwrap(),
        );
        assert!(diff < 1e-6, "prompt logits differ by {diff}");
    }
    let finalize = |c: &Completion| {
        c.capture
            .as_ref()
            .unwrap()
            .as_ref()
            .unwrap()
            .finalize()
            .unwrap()
    };
    let (g, w) = (finalize(&got[0]), finalize(&want[0]));
    assert_eq!(g.meta, w.meta);
    assert_eq!(g.layers.len(), LAYERS);
    for (x, y) in g.layers.iter().zip(&w.layers) {
        assert_eq!(x.shape, y.shape);
        let diff = common::max_abs_diff(&x.values, &y.values);
        assert!(diff < 1e-7, "layer {}: maps differ by {diff}", x.layer_idx);
    }
}

/// The engine refuses to start when the backend cannot allocate what it asked for, with
/// the backend's own reason.
#[test]
fn a_cache_the_backend_cannot_allocate_is_an_error() {
    let (loaded, _dir) = common::tiny_gemma3_model(LAYERS, GgmlDType::F32);
    let config = lantern_engine::EngineConfig {
        kv_cache_memory: 4 << 20,
        block_size: 4,
        kv_cache_dtype: KvDtype::F16,
        ..lantern_engine::EngineConfig::default()
    };
    let err = Engine::with_backend(loaded, config, Box::new(SlotBackend::new()))
        .err()
        .expect("an f16 cache is refused");
    assert!(err.to_string().contains("F16"), "{err}");
}

/// Requests of many capture shapes, batched with a plain one: every head or a few,
/// heads kept, averaged or maxed, top-k or whole rows, prompt rows or generated ones.
fn capture_shapes() -> Vec<CaptureSpec> {
    let mut specs = Vec::new();
    for (reduce, top_k, rows) in [
        (HeadReduce::None, None, RowSelection::All),
        (HeadReduce::MeanHeads, None, RowSelection::Prompt),
        (HeadReduce::MaxHeads, Some(5), RowSelection::All),
        (HeadReduce::None, Some(3), RowSelection::Generated),
        (
            HeadReduce::MeanHeads,
            Some(40),
            RowSelection::Range { start: 4, end: 27 },
        ),
    ] {
        let mut spec = CaptureSpec::everything(LAYERS, 4);
        spec.reduce = reduce;
        spec.top_k = top_k;
        spec.rows = rows;
        specs.push(spec);
    }
    let mut few = CaptureSpec::everything(LAYERS, 4);
    few.layers = vec![1, 4, 6];
    few.heads = vec![3, 0];
    specs.push(few);
    specs
}

fn run_shapes(engine: &mut Engine) -> Vec<Completion> {
    run_specs(engine, capture_shapes())
}

fn run_specs(engine: &mut Engine, specs: Vec<CaptureSpec>) -> Vec<Completion> {
    let mut requests: Vec<_> = specs
        .into_iter()
        .enumerate()
        .map(|(i, spec)| {
            let prompt = (0..19 + i)
                .map(|j| ((i * 31 + j * 7) % 250) as u32)
                .collect();
            let params = SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(6)
            };
            (prompt, params, Some(spec))
        })
        .collect();
    requests.push((vec![5; 12], SamplingParams::greedy(4), None));
    common::run_to_completion(engine, requests)
}

/// A backend that computes maps where its cache lives gives the maps the capture's own
/// finalize gives (bit for bit, since it sums the same way), holds no keys for them, and
/// one that fails or returns a misshapen map leaves the capture to copy the keys: the
/// same maps again.
#[test]
fn maps_a_backend_computes_equal_the_ones_finalize_computes() {
    let (mut declined, _d0) = engine(Box::new(SlotBackend::with_maps(Maps::Declined)));
    let want = run_shapes(&mut declined);
    for maps in [Maps::Computed, Maps::Failing, Maps::Misshapen] {
        let (mut theirs, _dir) = engine(Box::new(SlotBackend::with_maps(maps)));
        let got = run_shapes(&mut theirs);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.token_ids, w.token_ids);
            let (Some(g), Some(w)) = (&g.capture, &w.capture) else {
                continue;
            };
            let (g, w) = (g.as_ref().unwrap(), w.as_ref().unwrap());
            assert!(!w.maps_computed_by_backend() && w.holds_keys());
            let computed = maps == Maps::Computed;
            assert_eq!(
                g.maps_computed_by_backend(),
                computed,
                "{maps:?} request {i}"
            );
            assert_eq!(g.holds_keys(), !computed, "{maps:?} request {i}");
            let (gr, wr) = (g.finalize().unwrap(), w.finalize().unwrap());
            assert_same_maps(&gr, &wr, &format!("{maps:?} request {i}"));
            // The owner's finalize moves the maps into the result: the same result.
            let owned = g.clone().into_result(1, || {}).unwrap();
            assert_eq!(owned.layers, gr.layers);
        }
    }
}

/// Equal metadata and the same maps bit for bit.
fn assert_same_maps(got: &CaptureResult, want: &CaptureResult, what: &str) {
    assert_eq!(got.meta, want.meta, "{what}");
    assert!(!got.layers.is_empty(), "{what}");
    assert_eq!(got.layers.len(), want.layers.len(), "{what}");
    for (x, y) in got.layers.iter().zip(&want.layers) {
        assert_eq!((x.layer_idx, x.shape), (y.layer_idx, y.shape), "{what}");
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&x.values), bits(&y.values), "{what}");
        assert_eq!(x.indices, y.indices, "{what}");
    }
}

/// Query rows the backend keeps on its "device" give the captures that rows kept on
/// the host give, bit for bit, in batches beside a capture whose rows stay on the host
/// (it checks the attention output). With maps computed where the rows are kept, no
/// row crosses to the host; where the host computes the maps from keys, the rows cross
/// once, when the request finishes; every layer's rows are freed with their request;
/// and a backend without room leaves the rows on the host.
#[test]
fn query_rows_kept_on_the_backend_give_the_same_captures() {
    let shapes = || {
        let mut specs = capture_shapes();
        let mut checked = CaptureSpec::everything(LAYERS, 4);
        checked.keep_attention_output = true;
        specs.insert(2, checked);
        specs
    };
    let (mut host, _d0) = engine(Box::new(SlotBackend::with_maps(Maps::Declined)));
    let want = run_specs(&mut host, shapes());
    for (maps, kept) in [
        (Maps::Computed, Kept::Device),
        (Maps::Declined, Kept::Device),
        (Maps::Failing, Kept::Device),
        (Maps::Computed, Kept::NoRoom),
    ] {
        let backend = SlotBackend::with_maps(maps).keeping(kept);
        let traffic = Arc::clone(&backend.traffic);
        let (mut theirs, _dir) = engine(Box::new(backend));
        let got = run_specs(&mut theirs, shapes());
        let what = format!("{maps:?}, rows {kept:?}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.token_ids, w.token_ids, "{what}");
            let (Some(g), Some(w)) = (&g.capture, &w.capture) else {
                continue;
            };
            let (g, w) = (g.as_ref().unwrap(), w.as_ref().unwrap());
            let (gr, wr) = (g.finalize().unwrap(), w.finalize().unwrap());
            assert_same_maps(&gr, &wr, &format!("{what}, request {i}"));
        }
        let count = |c: &AtomicUsize| c.load(Ordering::SeqCst);
        let (written, read) = (count(&traffic.written), count(&traffic.read));
        assert_eq!(
            count(&traffic.alive),
            0,
            "{what}: kept rows outlived their requests"
        );
        match (kept, maps) {
            (Kept::NoRoom, _) => assert_eq!(written, 0, "{what}"),
            (_, Maps::Computed) => assert!(written > 0 && read == 0, "{what}: {written} {read}"),
            _ => assert!(written > 0 && read > 0, "{what}: {written} {read}"),
        }
    }
}

/// A streamed capture with key statistics, on a backend that gives no probabilities as
/// rows run: each step's row is computed from the keys, and the statistics when the
/// request finishes, from query rows copied over from where they were kept. The same
/// streamed rows and the same capture as with rows kept on the host.
#[test]
fn streamed_rows_and_statistics_of_kept_rows_are_the_same() {
    let run_streamed = |kept: Kept| {
        let backend = SlotBackend::with_maps(Maps::Computed).keeping(kept);
        let traffic = Arc::clone(&backend.traffic);
        let (mut engine, _dir) = engine(Box::new(backend));
        let mut spec = CaptureSpec::everything(LAYERS, 4);
        spec.stats = vec![KeyStat::KeyMass, KeyStat::KeyMax];
        spec.stream_rows = true;
        spec.top_k = Some(4);
        let prompt: Vec<u32> = (0..21).map(|j| (j * 11 % 250) as u32).collect();
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(5)
        };
        let id = engine
            .add_request_with_capture(prompt, params, Some(spec))
            .unwrap();
        let mut rows = Vec::new();
        while engine.has_unfinished() {
            for out in engine.step().unwrap() {
                rows.extend(out.capture_row);
            }
        }
        let done = engine.take_completion(id).unwrap();
        let result = done.capture.unwrap().unwrap().finalize().unwrap();
        (rows, result, traffic)
    };
    let (want_rows, want, _) = run_streamed(Kept::Host);
    let (rows, got, traffic) = run_streamed(Kept::Device);
    assert_eq!(rows.len(), 5, "a streamed row for every sampled token");
    assert_eq!(rows, want_rows);
    assert_same_maps(&got, &want, "streamed");
    assert!(!got.stats.is_empty());
    assert_eq!(got.stats, want.stats);
    assert!(traffic.written.load(Ordering::SeqCst) > 0);
    assert!(traffic.read.load(Ordering::SeqCst) > 0);
}

/// Decode steps whose capturing requests keep their rows on the backend's device and
/// take nothing back per step run as graph steps (keys marked `capturing`), the tap
/// handed to the padded batch; steps with a capture that reads rows on the host (it
/// checks the attention output) or sums statistics from each step's probabilities do
/// not. The captures and tokens are those of eager steps, bit for bit.
#[test]
fn decode_steps_whose_capture_stays_on_the_device_run_as_graph_steps() {
    let specs = || {
        let mut specs = capture_shapes();
        let mut summed = CaptureSpec::everything(LAYERS, 4);
        summed.stats = vec![KeyStat::KeyMass];
        specs.push(summed);
        specs
    };
    let eager = SlotBackend::with_maps(Maps::Computed).keeping(Kept::Device);
    let (mut eager, _d0) = engine(Box::new(eager));
    let want = run_specs(&mut eager, specs());
    assert_eq!(eager.graph_stats(), None);
    let graphs = Arc::new(PassThroughGraphs::default());
    let graphed = SlotBackend::with_maps(Maps::Computed)
        .keeping(Kept::Device)
        .graphing(Arc::clone(&graphs));
    let (mut graphed, _d1) = engine(Box::new(graphed));
    let got = run_specs(&mut graphed, specs());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.token_ids, w.token_ids, "request {i}");
        let (Some(g), Some(w)) = (&g.capture, &w.capture) else {
            continue;
        };
        let (g, w) = (g.as_ref().unwrap(), w.as_ref().unwrap());
        let (gr, wr) = (g.finalize().unwrap(), w.finalize().unwrap());
        assert_same_maps(&gr, &wr, &format!("graph steps, request {i}"));
        assert_eq!(gr.stats, wr.stats, "request {i}");
    }
    let steps = graphs.steps.lock().unwrap().clone();
    let capturing = steps.iter().filter(|k| k.capturing).count();
    assert!(
        capturing >= 3 && steps.iter().all(|k| k.num_reqs.is_power_of_two()),
        "{steps:?}"
    );

    // A capture that reads its rows on the host keeps every step it is in eager.
    let graphs = Arc::new(PassThroughGraphs::default());
    let backend = SlotBackend::with_maps(Maps::Computed)
        .keeping(Kept::Device)
        .graphing(Arc::clone(&graphs));
    let (mut engine, _d2) = engine(Box::new(backend));
    let mut checked = CaptureSpec::everything(LAYERS, 4);
    checked.keep_attention_output = true;
    let prompt: Vec<u32> = (0..13).map(|j| (j * 17 % 250) as u32).collect();
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(6)
    };
    let done = common::run_to_completion(&mut engine, vec![(prompt, params, Some(checked))]);
    assert!(done[0].capture.as_ref().unwrap().is_ok());
    assert_eq!(*graphs.steps.lock().unwrap(), []);
}
