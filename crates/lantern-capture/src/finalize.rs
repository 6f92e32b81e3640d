//! Finalization: attention probabilities from the buffered query rows and the keys read
//! back from the paged KV cache.
//!
//! When a capturing request finishes, the engine reads the keys (and, for verification,
//! the values) of the captured layers out of the cache through the backend that owns it
//! ([`snapshot_layer`], [`AttentionBackend::read_slots`]) before its blocks are released, so no later request can
//! overwrite them. The probabilities themselves are computed by
//! [`PendingCapture::finalize`], which needs nothing from the engine and runs on any
//! thread: the scores use the layer's own description — scale, causal/window/chunk
//! masks, soft-cap, sinks, GQA head mapping — in f32, through the attention kernel's own
//! dot-product, scaling and exponential code ([`lantern_attn::row_probabilities`]): the
//! same bits at every kernel level.
//!
//! A backend that can compute the maps where its cache lives (the GPU's) is asked first
//! ([`map_on_backend`], [`AttentionBackend::probability_map`]): its maps come back alone,
//! with the heads combined and top-k kept as [`lantern_attn::maps`] defines them, no keys
//! are copied for them, and finalizing takes them as they are.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use lantern_attn::{
    combine_heads, top_k, AttentionBackend, AttentionLayerSpec, LayerKvCache, ProbabilityMap,
    ProbabilityMapJob, RowScorer,
};

use crate::buffer::QueryRowBuffer;
use crate::error::CaptureError;
use crate::pages;
use crate::result::{
    AbsentRow, CaptureMeta, CaptureResult, LayerAttentionInfo, LayerMap, TokenInfo, CAPTURE_FORMAT,
};
use crate::spans::SpanMassAccumulator;
use crate::spec::RowSelection;
use crate::stats::{KeyStat, KeyStatsAccumulator};

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
    /// `[num_kv_heads, num_keys - first_key, head_dim]`: each head's keys contiguous, as
    /// the score kernel reads them.
    pub keys: Vec<f32>,
    /// Same shape, when values were asked for.
    pub values: Option<Vec<f32>>,
}

impl KeySnapshot {
    /// A snapshot of no keys that says how far the keys went (`keys.end`), for a capture
    /// that needs none of them ([`QueryRowBuffer::needs_keys`]): rows computed from it
    /// see no keys.
    pub fn without_keys(keys: Range<usize>, num_kv_heads: usize, head_dim: usize) -> Self {
        Self {
            first_key: keys.end,
            num_keys: keys.end,
            num_kv_heads,
            head_dim,
            keys: Vec::new(),
            values: None,
        }
    }

    /// Keys (or values) `positions` of kv head `head`, `[positions.len(), head_dim]`.
    fn rows<'a>(&self, plane: &'a [f32], positions: Range<usize>, head: usize) -> &'a [f32] {
        let per_head = self.num_keys - self.first_key;
        let start = (head * per_head + positions.start - self.first_key) * self.head_dim;
        &plane[start..start + positions.len() * self.head_dim]
    }

    /// The keys of positions `positions` (within `first_key..num_keys`) for kv head
    /// `head`, one after another.
    pub fn keys_of(&self, positions: Range<usize>, head: usize) -> &[f32] {
        self.rows(&self.keys, positions, head)
    }

    /// The key of position `pos` (`first_key <= pos < num_keys`) for kv head `head`.
    pub fn key(&self, pos: usize, head: usize) -> &[f32] {
        self.keys_of(pos..pos + 1, head)
    }

    /// The value of position `pos` for kv head `head`, when values were read.
    pub fn value(&self, pos: usize, head: usize) -> Option<&[f32]> {
        let v = self.values.as_deref()?;
        Some(self.rows(v, pos..pos + 1, head))
    }
}

/// `[tokens, heads, dim]` → `[heads, tokens, dim]`.
fn heads_first(rows: &[f32], heads: usize, dim: usize) -> Vec<f32> {
    let tokens = rows.len() / (heads * dim).max(1);
    let mut out = Vec::with_capacity(rows.len());
    for h in 0..heads {
        for t in 0..tokens {
            out.extend_from_slice(&rows[(t * heads + h) * dim..][..dim]);
        }
    }
    out
}

/// Reads keys `keys` of a request from one layer's cache, through the backend that
/// allocated it. `block_table` is the request's block table in the layer's KV cache group.
pub fn snapshot_layer(
    backend: &dyn AttentionBackend,
    cache: &dyn LayerKvCache,
    block_table: &[u32],
    keys: Range<usize>,
    with_values: bool,
) -> Result<KeySnapshot, CaptureError> {
    let geom = *cache.geometry();
    let (heads, dim, bs) = (geom.num_kv_heads, geom.head_dim, geom.block_size);
    let slots = keys
        .clone()
        .map(|pos| match block_table.get(pos / bs) {
            Some(&block) => Ok(block as usize * bs + pos % bs),
            None => Err(CaptureError::Incomplete(format!(
                "position {pos} has no block in the block table"
            ))),
        })
        .collect::<Result<Vec<usize>, _>>()?;
    let n = keys.len() * heads * dim;
    let mut k = vec![0f32; n];
    let mut v = if with_values {
        vec![0f32; n]
    } else {
        Vec::new()
    };
    backend.read_slots(cache, &slots, &mut k, with_values.then_some(&mut v[..]))?;
    Ok(KeySnapshot {
        first_key: keys.start,
        num_keys: keys.end,
        num_kv_heads: heads,
        head_dim: dim,
        keys: heads_first(&k, heads, dim),
        values: with_values.then(|| heads_first(&v, heads, dim)),
    })
}

/// Captured layer slot `slot`'s map (`layer`; rows `rows`, keys `0..num_keys`), computed
/// by `backend` where `cache` lives from `buffer`'s query rows and the request's keys at
/// `block_table` ([`AttentionBackend::probability_map`]); checked to have the map's
/// shape. `None` when the capture delivers no maps or the backend computes none.
#[allow(clippy::too_many_arguments)]
pub fn map_on_backend(
    backend: &dyn AttentionBackend,
    cache: &dyn LayerKvCache,
    block_table: &[u32],
    buffer: &QueryRowBuffer,
    slot: usize,
    layer: &AttentionLayerSpec,
    rows: Range<usize>,
    num_keys: usize,
) -> Option<Result<ProbabilityMap, CaptureError>> {
    let spec = buffer.spec();
    if !spec.maps {
        return None;
    }
    let computed = buffer.with_map_queries(slot, rows.clone(), |queries| {
        let job = ProbabilityMapJob {
            layer,
            queries,
            positions: rows.clone(),
            heads: &spec.heads,
            num_keys,
            combine: spec.reduce.into(),
            top_k: spec.top_k,
        };
        let map = backend.probability_map(cache, block_table, &job)?;
        Some(map.map(|map| (map, job.map_len())))
    });
    let Some(computed) = computed else {
        return Some(Err(CaptureError::Incomplete(format!(
            "no query rows for positions {rows:?}"
        ))));
    };
    let (map, len) = match computed? {
        Ok(done) => done,
        Err(e) => return Some(Err(e.into())),
    };
    let indices_len = map.indices.as_ref().map(Vec::len);
    if map.values.len() != len || indices_len != spec.top_k.map(|_| len) {
        return Some(Err(CaptureError::Incomplete(format!(
            "the backend's map has {} values and {indices_len:?} indices, not {len}",
            map.values.len()
        ))));
    }
    Some(Ok(map))
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
    /// Per captured layer, its map when the backend computed it where the cache lives
    /// ([`map_on_backend`]); empty, or `None` for a layer, where finalize computes it
    /// from the keys.
    pub computed_maps: Vec<Option<ProbabilityMap>>,
    pub prompt_len: usize,
    /// The longest the sequence could have grown (the prompt plus `max_tokens`): rows
    /// of an explicit range up to here that the sequence did not reach are absent.
    pub max_len: usize,
    /// Tokens per KV cache block (the blocks of `block_mass`).
    pub block_size: usize,
    /// Every position of the sequence, prompt then generated.
    pub tokens: Vec<TokenInfo>,
    /// Positions whose K/V were computed (the keys), `<= tokens.len()`.
    pub num_computed: usize,
    /// Threads finalizing may use, the calling thread included: the host cores the
    /// engine leaves idle (`lantern_engine::host_threads`); 1 finalizes on the calling
    /// thread alone.
    pub finalize_threads: usize,
}

impl PendingCapture {
    /// Rows that will be delivered and requested rows that are absent. A range with an
    /// explicit end names its positions: those the sequence could have reached but did
    /// not (it stopped early) are absent; `all`, `generated` and an open range mean
    /// whatever the sequence has.
    pub fn row_plan(&self) -> (Range<usize>, Vec<AbsentRow>) {
        let total = self.tokens.len();
        let rows = self.buffer.spec().rows;
        let reach = match rows {
            RowSelection::Range { end, .. } if end != usize::MAX => self.max_len.max(total),
            _ => total,
        };
        let requested = rows.positions(self.prompt_len, reach);
        let present = self
            .buffer
            .rows_present(self.prompt_len, total, self.num_computed);
        let absent = (present.end.max(requested.start)..requested.end)
            .map(|position| AbsentRow {
                position,
                reason: if position >= total {
                    format!("the sequence ended at {total} tokens, before this position")
                } else if position + 1 == total && position >= self.num_computed {
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
            + self
                .computed_maps
                .iter()
                .flatten()
                .map(ProbabilityMap::size_bytes)
                .sum::<usize>()
    }

    /// Whether the backend computed every captured layer's map where its cache lives.
    pub fn maps_computed_by_backend(&self) -> bool {
        let slots = self.buffer.spec().layers.len();
        self.buffer.spec().maps
            && self.computed_maps.len() == slots
            && self.computed_maps.iter().all(Option::is_some)
    }

    /// Whether keys were copied out of the cache for finalizing (none are when the
    /// figures asked for were all summed as the rows ran).
    pub fn holds_keys(&self) -> bool {
        self.layers.iter().any(|(_, s)| !s.keys.is_empty())
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

    /// Probabilities of the row at position `pos` on layer `layer` (captured layer slot
    /// `slot`, keys `keys`) for every requested head, into `out`: `[heads, num_keys]`,
    /// zero where a key is not visible.
    fn row_probabilities(
        &self,
        slot: usize,
        layer: &(AttentionLayerSpec, KeySnapshot),
        pos: usize,
        out: &mut [f32],
    ) -> Result<(), CaptureError> {
        row_probabilities(&self.buffer, slot, layer, pos, out)
    }

    /// Whether the key statistics were summed as the rows ran (from the attention
    /// kernel's probabilities), so finalizing has no rows to compute for them.
    pub fn stats_summed_live(&self) -> bool {
        let (rows, _) = self.row_plan();
        !self.buffer.spec().stats.is_empty()
            && self.buffer.live_stats(&rows, self.num_keys()).is_some()
    }

    /// Whether the span masses were summed as the rows ran, so finalizing has no rows
    /// to compute for them.
    pub fn span_masses_summed_live(&self) -> bool {
        let (rows, _) = self.row_plan();
        self.buffer
            .live_span_masses(&rows, self.num_keys())
            .is_some()
    }

    /// Computes the maps: probabilities, then the head reduction, then top-k.
    pub fn finalize(&self) -> Result<CaptureResult, CaptureError> {
        self.finalize_with(|| {})
    }

    /// [`Self::finalize`], calling `after_layer` once each layer the calling thread
    /// computed is done (the capture worker paces itself there). With
    /// `finalize_threads` above one, that many threads (the caller and helpers, which do
    /// not pace: they stand for cores the engine leaves idle) take the layers in turn;
    /// every layer's figures are the same bits either way.
    pub fn finalize_with(&self, after_layer: impl FnMut()) -> Result<CaptureResult, CaptureError> {
        self.finalize_on(self.finalize_threads, after_layer)
    }

    /// [`Self::finalize_with`] on `threads` threads instead of `finalize_threads`: for a
    /// caller that knows the engine is idle (the CLI, once every prompt has run).
    pub fn finalize_on(
        &self,
        threads: usize,
        after_layer: impl FnMut(),
    ) -> Result<CaptureResult, CaptureError> {
        let computed = |slot: usize| self.computed_maps.get(slot).cloned().flatten();
        self.finalize_taking(threads, after_layer, &computed)
    }

    /// [`Self::finalize_on`] for an owner done with the capture: the maps the backend
    /// computed move into the result instead of being copied.
    pub fn into_result(
        mut self,
        threads: usize,
        after_layer: impl FnMut(),
    ) -> Result<CaptureResult, CaptureError> {
        let maps: Vec<Mutex<Option<ProbabilityMap>>> = std::mem::take(&mut self.computed_maps)
            .into_iter()
            .map(Mutex::new)
            .collect();
        let computed = |slot: usize| maps.get(slot)?.lock().ok()?.take();
        self.finalize_taking(threads, after_layer, &computed)
    }

    /// Finalizing, with `computed(slot)` giving each slot's map when the backend
    /// computed it (called once a slot).
    fn finalize_taking(
        &self,
        threads: usize,
        mut after_layer: impl FnMut(),
        computed: &(dyn Fn(usize) -> Option<ProbabilityMap> + Sync),
    ) -> Result<CaptureResult, CaptureError> {
        let spec = self.buffer.spec();
        let (rows, absent_rows) = self.row_plan();
        let num_keys = self.num_keys();
        // Key statistics summed as the rows ran, when they cover exactly these rows: one
        // per layer slot, taken by the thread that finalizes the slot.
        let live_stats: Vec<Mutex<Option<KeyStatsAccumulator>>> = if spec.stats.is_empty() {
            Vec::new()
        } else {
            let live = self.buffer.live_stats(&rows, num_keys).unwrap_or_default();
            live.into_iter().map(|a| Mutex::new(Some(a))).collect()
        };
        let plan = LayerPlan {
            rows: rows.clone(),
            num_keys,
            // Span masses summed as the rows ran, likewise.
            live_spans: self.buffer.live_span_masses(&rows, num_keys),
            span_ranges: spec
                .spans
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    s.tokens.clone().ok_or_else(|| {
                        CaptureError::Incomplete(format!(
                            "span {i} ({:?}) was never resolved to tokens",
                            s.label
                        ))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
        };
        // The threads take the layer slots in order; once one fails, no more are taken.
        let slots = spec.layers.len();
        let done: Vec<Mutex<Option<Result<LayerOutcome, CaptureError>>>> =
            (0..slots).map(|_| Mutex::new(None)).collect();
        let (next, failed) = (AtomicUsize::new(0), AtomicBool::new(false));
        let work = |pace: &mut dyn FnMut()| {
            while !failed.load(Ordering::Relaxed) {
                let slot = next.fetch_add(1, Ordering::Relaxed);
                if slot >= slots {
                    break;
                }
                let live = live_stats.get(slot).and_then(|l| l.lock().ok()?.take());
                let outcome = self.finalize_layer(slot, &plan, live, computed(slot));
                failed.fetch_or(outcome.is_err(), Ordering::Relaxed);
                if let Ok(mut d) = done[slot].lock() {
                    *d = Some(outcome);
                }
                pace();
            }
        };
        std::thread::scope(|scope| {
            for _ in 1..threads.clamp(1, slots.max(1)) {
                scope.spawn(|| work(&mut || {}));
            }
            work(&mut after_layer);
        });
        let mut maps = Vec::with_capacity(slots);
        let mut stats = Vec::new();
        let mut stats_groups = Vec::new();
        let mut span_mass = Vec::new();
        // Slots are taken in order, so every slot before a failed one is done.
        for (slot, outcome) in done.into_iter().enumerate() {
            let outcome = outcome.into_inner().ok().flatten().unwrap_or_else(|| {
                Err(CaptureError::Incomplete(format!(
                    "layer slot {slot} was not finalized"
                )))
            })?;
            stats_groups.extend(outcome.stats_groups);
            maps.extend(outcome.map);
            stats.extend(outcome.stats);
            span_mass.extend(outcome.span_mass);
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
            maps: spec.maps,
            stats: spec.stats.iter().map(|s| s.as_str().to_string()).collect(),
            stats_heads: (!spec.stats.is_empty() || !spec.spans.is_empty())
                .then(|| spec.stats_heads.as_str().to_string()),
            stats_groups,
            block_size: (!spec.stats.is_empty()).then_some(self.block_size),
            spans: spec.spans.iter().map(|s| s.info()).collect(),
            span_offsets: spec.span_text.as_ref().map(|t| t.offsets.clone()),
            span_messages: spec.span_text.as_ref().and_then(|t| t.messages.clone()),
            span_prompt: spec.span_text.as_ref().and_then(|t| t.prompt.clone()),
        };
        Ok(CaptureResult {
            meta,
            layers: maps,
            stats,
            span_mass,
        })
    }
}

/// What finalizing needs for every layer alike.
struct LayerPlan<'a> {
    rows: Range<usize>,
    num_keys: usize,
    live_spans: Option<Vec<&'a [f32]>>,
    span_ranges: Vec<Range<usize>>,
}

/// One captured layer's share of a [`CaptureResult`].
struct LayerOutcome {
    map: Option<LayerMap>,
    stats: Vec<crate::stats::LayerStat>,
    stats_groups: Option<Vec<Vec<usize>>>,
    span_mass: Option<crate::spans::LayerSpanMass>,
}

impl PendingCapture {
    /// Captured layer slot `slot`'s map, statistics and span masses; `live` its key
    /// statistics when they were summed as the rows ran, `computed` its map when the
    /// backend computed it.
    fn finalize_layer(
        &self,
        slot: usize,
        plan: &LayerPlan<'_>,
        live: Option<KeyStatsAccumulator>,
        computed: Option<ProbabilityMap>,
    ) -> Result<LayerOutcome, CaptureError> {
        let spec = self.buffer.spec();
        let (rows, num_keys) = (plan.rows.clone(), plan.num_keys);
        let layer_idx = spec.layers[slot];
        let heads = spec.heads.len();
        let width = spec.top_k.map_or(num_keys, |k| k.min(num_keys));
        let layer = self
            .layers
            .get(slot)
            .ok_or_else(|| CaptureError::Incomplete(format!("no keys for layer slot {slot}")))?;
        // A map the backend computed is taken as it is; otherwise it is built row by row.
        let map_from_rows = spec.maps && computed.is_none();
        let map_len = if map_from_rows {
            rows.len() * spec.output_heads() * width
        } else {
            0
        };
        let mut values = pages::vec_to_fill(map_len);
        let mut indices = spec.top_k.map(|_| pages::vec_to_fill(map_len));
        let groups = spec.stats_heads.groups(&spec.heads, &layer.0);
        let stats_groups = (!spec.stats.is_empty() || !spec.spans.is_empty()).then(|| {
            groups
                .iter()
                .map(|g| g.iter().map(|&i| spec.heads[i]).collect())
                .collect()
        });
        let mut summed_spans = None;
        let mut spans = match &plan.live_spans {
            Some(live) => {
                summed_spans = Some(SpanMassAccumulator::summed(
                    layer_idx,
                    rows.len(),
                    groups.len(),
                    plan.span_ranges.len(),
                    live[slot],
                ));
                None
            }
            None => (!spec.spans.is_empty()).then(|| {
                SpanMassAccumulator::new(groups.clone(), num_keys, &plan.span_ranges, rows.len())
            }),
        };
        let summed = live.is_some();
        let mut accumulator = match live {
            Some(live) => Some(live),
            None => (!spec.stats.is_empty()).then(|| {
                KeyStatsAccumulator::new(groups, num_keys, spec.stats.contains(&KeyStat::KeyMax))
            }),
        };
        // Two rows at a time, so that what finalizing holds beside the maps is two rows of
        // every head (`2 × heads × keys`) and a transposed copy of the layer's keys a
        // thread, never `rows × heads × keys`: the maps are what the admission estimate
        // counts.
        let mut dense = [vec![0f32; heads * num_keys], vec![0f32; heads * num_keys]];
        let mut reduced = Vec::new();
        // Rows are computed for what is not summed yet: maps, span masses, statistics.
        let rows_needed = map_from_rows || spans.is_some() || (accumulator.is_some() && !summed);
        let mut take_row = |dense: &[f32]| {
            if let Some(accumulator) = accumulator.as_mut().filter(|_| !summed) {
                accumulator.add_row(dense);
            }
            if let Some(spans) = &mut spans {
                spans.add_row(dense);
            }
            if !map_from_rows {
                return;
            }
            let combine = spec.reduce.into();
            match &mut indices {
                None => combine_heads(dense, heads, num_keys, combine, &mut values),
                Some(indices) => {
                    reduced.clear();
                    combine_heads(dense, heads, num_keys, combine, &mut reduced);
                    top_k(&reduced, num_keys, width, &mut values, indices);
                }
            }
        };
        // Two at a time, over keys transposed once per kv head.
        if rows_needed {
            let mut scorers = RowScorers::new(&self.buffer, layer);
            let mut pos = rows.start;
            while pos < rows.end {
                let [first, second] = &mut dense;
                if pos + 1 < rows.end {
                    scorers.pair(&self.buffer, slot, pos, [first, second])?;
                    take_row(first);
                    take_row(second);
                    pos += 2;
                } else {
                    self.row_probabilities(slot, layer, pos, first)?;
                    take_row(first);
                    pos += 1;
                }
            }
        }
        if let Some(map) = computed.filter(|_| spec.maps) {
            values = map.values;
            indices = map.indices;
        }
        Ok(LayerOutcome {
            map: spec.maps.then(|| LayerMap {
                layer_idx,
                shape: [rows.len(), spec.output_heads(), width],
                values,
                indices,
            }),
            stats: accumulator
                .map(|a| a.finish(layer_idx, &spec.stats, self.block_size))
                .unwrap_or_default(),
            stats_groups,
            span_mass: summed_spans.or_else(|| spans.map(|s| s.finish(layer_idx))),
        })
    }
}

/// One captured layer's keys made ready for scoring rows two at a time: a
/// [`RowScorer`] per kv head the requested heads read.
struct RowScorers<'a> {
    layer: &'a AttentionLayerSpec,
    keys: &'a KeySnapshot,
    /// Per kv head, `None` where no requested head reads it.
    scorers: Vec<Option<RowScorer<'a>>>,
}

impl<'a> RowScorers<'a> {
    fn new(buffer: &QueryRowBuffer, (layer, keys): &'a (AttentionLayerSpec, KeySnapshot)) -> Self {
        let mut scorers: Vec<Option<RowScorer<'a>>> =
            (0..keys.num_kv_heads).map(|_| None).collect();
        for &h in &buffer.spec().heads {
            let kv = layer.kv_head_for(h);
            if keys.keys.is_empty() || scorers.get(kv).is_none_or(Option::is_some) {
                continue;
            }
            let all = keys.keys_of(keys.first_key..keys.num_keys, kv);
            scorers[kv] = Some(RowScorer::new(all, keys.head_dim));
        }
        Self {
            layer,
            keys,
            scorers,
        }
    }

    /// [`row_probabilities`] of the rows at positions `pos` and `pos + 1`, into `out`.
    fn pair(
        &mut self,
        buffer: &QueryRowBuffer,
        slot: usize,
        pos: usize,
        out: [&mut [f32]; 2],
    ) -> Result<(), CaptureError> {
        let heads = &buffer.spec().heads;
        let num_keys = out[0].len() / heads.len().max(1);
        let [out0, out1] = out;
        out0.fill(0.0);
        out1.fill(0.0);
        let first_key = self.keys.first_key;
        // Each row's visible keys, as positions and as indices among the snapshot's.
        let visible = [pos, pos + 1].map(|p| {
            let v = self.layer.visible_key_range(p);
            let v = v.start.max(first_key)..v.end.min(self.keys.num_keys).min(num_keys);
            if v.is_empty() {
                first_key..first_key
            } else {
                v
            }
        });
        let indices = visible
            .clone()
            .map(|v| v.start - first_key..v.end - first_key);
        for (hi, &h) in heads.iter().enumerate() {
            let query = |p: usize| {
                buffer.query(slot, p, hi).ok_or_else(|| {
                    CaptureError::Incomplete(format!("no query row for position {p}"))
                })
            };
            let q = [query(pos)?, query(pos + 1)?];
            let Some(scorer) = self
                .scorers
                .get_mut(self.layer.kv_head_for(h))
                .and_then(Option::as_mut)
            else {
                continue; // no keys: every probability is zero
            };
            let row = hi * num_keys;
            scorer.probabilities(
                self.layer,
                h,
                q,
                indices.clone(),
                [
                    &mut out0[row..][visible[0].clone()],
                    &mut out1[row..][visible[1].clone()],
                ],
            );
        }
        Ok(())
    }
}

/// Probabilities of the row at position `pos` on captured layer slot `slot` (its
/// attention and keys `keys`) for every requested head of `buffer`, into `out`:
/// `[heads, num_keys]`, zero where a key is not visible.
pub(crate) fn row_probabilities(
    buffer: &QueryRowBuffer,
    slot: usize,
    (layer, keys): &(AttentionLayerSpec, KeySnapshot),
    pos: usize,
    out: &mut [f32],
) -> Result<(), CaptureError> {
    let num_keys = out.len() / buffer.spec().heads.len().max(1);
    out.fill(0.0);
    let visible = layer.visible_key_range(pos);
    let visible = visible.start.max(keys.first_key)..visible.end.min(keys.num_keys).min(num_keys);
    if visible.is_empty() {
        return Ok(());
    }
    for (hi, &h) in buffer.spec().heads.iter().enumerate() {
        let q = buffer
            .query(slot, pos, hi)
            .ok_or_else(|| CaptureError::Incomplete(format!("no query row for position {pos}")))?;
        let row = &mut out[hi * num_keys..][visible.clone()];
        let k = keys.keys_of(visible.clone(), layer.kv_head_for(h));
        lantern_attn::row_probabilities(layer, h, q, k, row);
    }
    Ok(())
}
