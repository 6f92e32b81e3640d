//! The model runner: turns a scheduler plan into one flattened forward pass.

use crate::error::{EngineError, Result};
use crate::request::Request;
use crate::sampling::logit_edits;
use crate::scheduler::SchedulerOutput;
use lantern_attn::{
    AttentionBackend, AttentionMetadata, AttentionTap, CacheGeometry, CommonAttentionMetadata,
    GraphKey, LayerKvCache, ScheduledSeq, MAX_GRAPH_PROBABILITY_BYTES,
};
use lantern_kv::{AttentionKind, KvCacheConfig, KvCacheManager, KvDtype, RequestId};
use lantern_model::{
    CausalLm, ForwardBatch, LogitEdit, ReducedRow, RowPick, RowReduction, SampleDraw,
    StepLogitRows, TokenChoice, MAX_REDUCED_TOP_LOGPROBS,
};
use std::collections::HashMap;
use std::sync::Arc;

/// The logits rows of one request in a step.
pub struct RequestRows {
    pub id: RequestId,
    /// First row of this request in `StepLogits::logits`.
    pub first_row: usize,
    /// Rows for prompt positions (requests that asked for prompt logits).
    pub num_prompt_rows: usize,
    /// Whether the last row is the one the next token is sampled from.
    pub samples: bool,
}

/// The logits a step computed: the rows each request needs, in plan order.
pub struct StepLogits {
    pub requests: Vec<RequestRows>,
    /// `[whole rows, vocab]`: every row but the reduced ones, in row order.
    pub logits: Vec<f32>,
    /// Per row: what the model reduced it to, if it did (empty: no row was).
    pub picked: Vec<Option<ReducedRow>>,
    pub vocab: usize,
}

/// A step's logits go back for the next step's product to fill (a large buffer's first
/// touch costs page faults: `lantern_quant::spare`).
impl Drop for StepLogits {
    fn drop(&mut self) {
        lantern_quant::spare::give_back(std::mem::take(&mut self.logits));
    }
}

impl StepLogits {
    /// Rows `first..first + count` (none of them picked), or an error when the step
    /// computed fewer.
    pub fn rows(&self, first: usize, count: usize) -> Result<&[f32]> {
        // Picked rows are left out of `logits`: those before `first` shift it, and none
        // of the rows asked for may be one.
        let picked_in = |rows: std::ops::Range<usize>| {
            self.picked
                .get(rows.start.min(self.picked.len())..rows.end.min(self.picked.len()))
                .map_or(0, |p| p.iter().filter(|p| p.is_some()).count())
        };
        let end = first.saturating_add(count);
        let start_row = first - picked_in(0..first);
        start_row
            .checked_mul(self.vocab)
            .zip(
                start_row
                    .checked_add(count)
                    .and_then(|e| e.checked_mul(self.vocab)),
            )
            .filter(|_| picked_in(first..end) == 0)
            .and_then(|(start, end)| self.logits.get(start..end))
            .ok_or(EngineError::MissingLogits {
                first,
                count,
                rows: self.logits.len() / self.vocab.max(1),
            })
    }

    /// What the model reduced row `row` to, if it did.
    pub fn picked(&self, row: usize) -> Option<&ReducedRow> {
        self.picked.get(row).and_then(Option::as_ref)
    }
}

/// What a model that reduces rows where its logits are does with a request's sampling
/// row (row `row` of the step's logits): its argmax (greedy) or a sample with the draw the
/// engine took ahead (at a temperature, with top-k, top-p and min-p), after the edits its
/// penalties and `min_tokens` make (added to `edits`), with the logprobs the request asks
/// for; the row whole for the host's sampler otherwise (structured output, too many
/// edits, ...).
fn row_pick(
    req: &Request,
    row: usize,
    vocab: usize,
    stop_ids: &[u32],
    edits: &mut Vec<LogitEdit>,
) -> RowPick {
    let p = &req.params;
    if !req.reduces_row() {
        return RowPick::Whole;
    }
    let token = if p.temperature == 0.0 {
        TokenChoice::Argmax
    } else {
        match req.sampler.drawn() {
            Some(draw) => TokenChoice::Sample(SampleDraw {
                draw,
                inv_temperature: 1.0 / p.temperature,
                top_k: p.top_k,
                top_p: p.top_p,
                min_p: p.min_p,
            }),
            None => return RowPick::Whole,
        }
    };
    if p.has_penalties() || req.below_min_tokens() {
        // As `Engine::append_token` edits the row on the host.
        let mut suppressed: Vec<&[u32]> = Vec::new();
        if req.below_min_tokens() {
            if !p.ignore_eos {
                suppressed.push(stop_ids);
            }
            suppressed.push(&p.stop_token_ids);
        }
        let Ok(row) = u32::try_from(row) else {
            return RowPick::Whole;
        };
        match logit_edits(p, req.prompt(), req.output_ids(), &suppressed, vocab, row) {
            Some(row_edits) => edits.extend(row_edits),
            None => return RowPick::Whole,
        }
    }
    RowPick::Reduced(RowReduction {
        token,
        logprobs: p.logprobs,
    })
}

/// What a model that reduces rows where its logits are does with the prompt row of
/// position `pos` (which predicts the prompt token after it): that token scored, when the
/// request wants prompt logprobs alone (not the logits) of at most
/// [`MAX_REDUCED_TOP_LOGPROBS`] alternatives; else the row whole.
fn prompt_row_pick(req: &Request, pos: usize, vocab: usize) -> RowPick {
    let scored = match req.params.prompt_logprobs {
        Some(k) if !req.params.prompt_logits && k <= MAX_REDUCED_TOP_LOGPROBS => k,
        _ => return RowPick::Whole,
    };
    match req.token(pos + 1) {
        // A token outside the vocabulary takes the host's path, which names it.
        Some(token) if (token as usize) < vocab => RowPick::Reduced(RowReduction {
            token: TokenChoice::Given(token),
            logprobs: Some(scored),
        }),
        _ => RowPick::Whole,
    }
}

/// Keys a graph step can attend over at least (the block-table width of its smallest
/// graphs): shorter contexts share these graphs.
const MIN_GRAPH_CONTEXT: usize = 256;

/// Fewest and most logit edits a graph step carries (more: the step runs eagerly).
const MIN_GRAPH_EDITS: usize = 256;
const MAX_GRAPH_EDITS: usize = 1 << 16;

/// What a step feeds the model, before any padding.
struct StepInputs {
    token_ids: Vec<u32>,
    positions: Vec<usize>,
    logits_rows: Vec<usize>,
    /// Per logits row: whole, or reduced (see `row_pick`, `prompt_row_pick`).
    pick: Vec<RowPick>,
    /// Edits of reduced rows' logits before they are reduced (penalties, `min_tokens`).
    edits: Vec<LogitEdit>,
}

pub struct ModelRunner {
    backend: Box<dyn AttentionBackend>,
    /// One per layer, allocated by `backend` (the engine never looks inside).
    caches: Vec<Box<dyn LayerKvCache>>,
    /// KV cache group of each layer.
    layer_group: Vec<usize>,
    /// Chunk size of each group's chunked-local attention (`None` for other kinds): its
    /// virtual batch is built with the group's metadata, once per step.
    group_chunk: Vec<Option<usize>>,
    block_size: usize,
    /// Ask for picked rows (argmax or sampled) even from a model that keeps its logits on
    /// the host (it reduces them there): the picked-row path tested without a GPU.
    pub pick_on_host: bool,
    /// The tokenizer's stop tokens, suppressed in reduced rows below `min_tokens`.
    pub stop_ids: Vec<u32>,
}

impl ModelRunner {
    /// A runner over `backend`, with one cache per layer allocated by it.
    pub fn new(
        config: &KvCacheConfig,
        num_layers: usize,
        dtype: KvDtype,
        backend: Box<dyn AttentionBackend>,
    ) -> Result<Self> {
        let mut layer_group = vec![0; num_layers];
        let mut caches = Vec::with_capacity(num_layers);
        let mut block_size = 0;
        for (g, group) in config.groups.iter().enumerate() {
            for &l in &group.layer_ids {
                layer_group[l] = g;
            }
            block_size = group.spec.block_size;
        }
        for &group in &layer_group {
            let spec = &config.groups[group].spec;
            let geometry = CacheGeometry {
                num_blocks: config.num_blocks,
                block_size: spec.block_size,
                num_kv_heads: spec.num_kv_heads,
                head_dim: spec.head_size,
            };
            caches.push(backend.allocate_cache(geometry, dtype)?);
        }
        Ok(Self {
            backend,
            caches,
            layer_group,
            group_chunk: config
                .groups
                .iter()
                .map(|g| match g.spec.kind {
                    AttentionKind::ChunkedLocal { chunk_size } => Some(chunk_size),
                    _ => None,
                })
                .collect(),
            block_size,
            pick_on_host: false,
            stop_ids: Vec::new(),
        })
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    pub fn caches(&self) -> &[Box<dyn LayerKvCache>] {
        &self.caches
    }

    /// The backend that allocated the caches and runs attention over them.
    pub fn backend(&self) -> &dyn AttentionBackend {
        self.backend.as_ref()
    }

    /// The KV cache group of layer `layer`.
    pub fn layer_group(&self, layer: usize) -> usize {
        self.layer_group[layer]
    }

    /// Runs the planned step and returns the logits of requests whose next token is due.
    pub fn execute(
        &mut self,
        model: &dyn CausalLm,
        plan: &SchedulerOutput,
        requests: &HashMap<RequestId, Request>,
        kv: &KvCacheManager,
        mut tap: Option<&mut dyn AttentionTap>,
    ) -> Result<StepLogits> {
        let (inputs, rows) =
            Self::step_inputs(model, plan, requests, self.pick_on_host, &self.stop_ids)?;
        let vocab = model.info().vocab_size;
        // A capture whose work stays on the device is recorded into the step's graph.
        if tap.as_ref().is_none_or(|t| t.device_only()) {
            if let Some(key) = self.graph_key(model, plan, kv, &inputs, tap.as_deref()) {
                // A reborrow: the tap is the eager run's again should the graph fail.
                let graph_tap = tap.as_mut().map(|t| &mut **t as &mut dyn AttentionTap);
                match self.execute_graphed(model, plan, requests, kv, &inputs, key, graph_tap) {
                    Ok(Some(out)) => {
                        return Ok(StepLogits {
                            requests: rows,
                            logits: out.logits,
                            picked: out.picked,
                            vocab,
                        })
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!(
                        "a decode step of {} requests could not run as a CUDA graph ({e}); \
                         running it eagerly, as every later step of its shape",
                        key.num_reqs
                    ),
                }
            }
        }
        let attention = (0..self.group_chunk.len())
            .map(|g| self.group_metadata(g, plan, requests, kv))
            .collect::<Result<Vec<_>>>()?;
        let out = self.forward(model, &inputs, &attention, tap)?;
        Ok(StepLogits {
            requests: rows,
            logits: out.logits,
            picked: out.picked,
            vocab,
        })
    }

    /// The step's tokens, positions and logits rows in plan order, and which request
    /// owns which rows.
    fn step_inputs(
        model: &dyn CausalLm,
        plan: &SchedulerOutput,
        requests: &HashMap<RequestId, Request>,
        pick_on_host: bool,
        stop_ids: &[u32],
    ) -> Result<(StepInputs, Vec<RequestRows>)> {
        let num_tokens = plan.num_tokens();
        let mut token_ids = Vec::with_capacity(num_tokens);
        let mut positions = Vec::with_capacity(num_tokens);
        let picking = model.picks_on_device() || pick_on_host;
        let mut logits_rows = Vec::new();
        // Per logits row: whole, or reduced (see `row_pick`, `prompt_row_pick`).
        let mut pick = Vec::new();
        let mut edits = Vec::new();
        let vocab = model.info().vocab_size;
        let mut rows = Vec::new();
        for s in &plan.scheduled {
            let req = requests.get(&s.id).ok_or(EngineError::LostRequest(s.id))?;
            let start = req.num_computed_tokens;
            let first_token_row = token_ids.len();
            let tokens = req
                .token_seq()
                .range(start..start + s.num_tokens)
                .ok_or(EngineError::PlanPastTokens(s.id))?;
            token_ids.extend_from_slice(&tokens);
            positions.extend(start..start + s.num_tokens);
            let samples = start + s.num_tokens == req.num_tokens();
            // Prompt logits: every prompt position computed in this step, except the last
            // one when it is also the sampling row (it is counted once, as that).
            let prompt_end = (start + s.num_tokens).min(req.prompt_len());
            let num_prompt_rows = if req.wants_prompt_rows() && prompt_end > start {
                prompt_end - start - usize::from(samples && prompt_end == start + s.num_tokens)
            } else {
                0
            };
            let first_row = logits_rows.len();
            logits_rows.extend(first_token_row..first_token_row + num_prompt_rows);
            pick.extend((start..start + num_prompt_rows).map(|pos| {
                if picking {
                    prompt_row_pick(req, pos, vocab)
                } else {
                    RowPick::Whole
                }
            }));
            if samples {
                logits_rows.push(token_ids.len() - 1);
                pick.push(if picking {
                    row_pick(req, logits_rows.len() - 1, vocab, stop_ids, &mut edits)
                } else {
                    RowPick::Whole
                });
            }
            if samples || num_prompt_rows > 0 {
                rows.push(RequestRows {
                    id: s.id,
                    first_row,
                    num_prompt_rows,
                    samples,
                });
            }
        }
        let inputs = StepInputs {
            token_ids,
            positions,
            logits_rows,
            pick,
            edits,
        };
        Ok((inputs, rows))
    }

    /// The graph a step replays, when the backend records graphs and the step is one
    /// they serve: decodes only (one token each, every one sampled), no chunked-local
    /// layers (their virtual batches change shape), at most the largest graph's requests.
    /// `tap`: the step's capturing requests, whose work stays on the device, asking for
    /// probabilities as their plan says ([`AttentionTap::probability_plan`]).
    fn graph_key(
        &self,
        model: &dyn CausalLm,
        plan: &SchedulerOutput,
        kv: &KvCacheManager,
        inputs: &StepInputs,
        tap: Option<&dyn AttentionTap>,
    ) -> Option<GraphKey> {
        let graphs = self.backend.step_graphs()?;
        let n = plan.scheduled.len();
        let decodes_only = plan.scheduled.iter().all(|s| s.num_tokens == 1)
            && inputs.logits_rows.len() == n
            && self.group_chunk.iter().all(Option::is_none);
        if n == 0 || !decodes_only {
            return None;
        }
        let num_reqs = graphs.batch_sizes().iter().copied().find(|&b| b >= n)?;
        let longest = (0..self.group_chunk.len())
            .flat_map(|g| {
                plan.scheduled
                    .iter()
                    .map(move |s| kv.block_table(s.id, g).len())
            })
            .max()
            .unwrap_or(0);
        // Widths in powers of two: a handful of graphs cover every context length.
        let table_width = longest
            .next_power_of_two()
            .max(MIN_GRAPH_CONTEXT.div_ceil(self.block_size.max(1)));
        // Edits in powers of two too (padded with edits of no row); a whole-logits graph
        // takes every row whole, edited on the host.
        let whole_logits = !inputs.pick.iter().all(|p| p.is_picked());
        let edit_capacity = match inputs.edits.len() {
            0 => 0,
            _ if whole_logits => 0,
            n if n > MAX_GRAPH_EDITS => return None,
            n => n.next_power_of_two().max(MIN_GRAPH_EDITS),
        };
        // Each asked row has room for every key of the table, on every layer it is asked.
        let capture = tap.map(|t| t.probability_plan());
        let capture = capture.as_deref();
        let keys = table_width * self.block_size;
        let probability_values: usize = (capture.unwrap_or_default().iter().enumerate())
            .map(|(l, &rows)| {
                rows * keys * model.info().attention.get(l).map_or(0, |a| a.num_heads)
            })
            .sum();
        if probability_values * size_of::<f32>() > MAX_GRAPH_PROBABILITY_BYTES {
            return None;
        }
        Some(GraphKey {
            num_reqs,
            table_width,
            whole_logits,
            capturing: capture.is_some(),
            probabilities: capture.map_or(0, plan_fingerprint),
            edit_capacity,
        })
    }

    /// Runs a step of decodes as graph `key`: padded to its requests and table width,
    /// recorded or replayed by the backend, the padding's rows dropped after. `None`:
    /// the backend does not graph this key (any more); run the step eagerly. `tap`: the
    /// step's capture, whose work stays on the device ([`AttentionTap::device_only`]).
    #[allow(clippy::too_many_arguments)]
    fn execute_graphed(
        &mut self,
        model: &dyn CausalLm,
        plan: &SchedulerOutput,
        requests: &HashMap<RequestId, Request>,
        kv: &KvCacheManager,
        inputs: &StepInputs,
        key: GraphKey,
        tap: Option<&mut dyn AttentionTap>,
    ) -> Result<Option<StepLogitRows>> {
        let Some(graphs) = self.backend.step_graphs() else {
            return Ok(None);
        };
        if !graphs.begin_step(key)? {
            return Ok(None);
        }
        let result = self.forward_padded(model, plan, requests, kv, inputs, key, tap);
        let ended = match self.backend.step_graphs() {
            Some(graphs) => graphs.end_step(result.is_ok()),
            None => Ok(()),
        };
        let mut out = result?;
        ended?;
        let n = inputs.token_ids.len();
        out.logits.truncate(n * model.info().vocab_size);
        out.picked.truncate(n);
        Ok(Some(out))
    }

    /// The step padded to graph `key`'s shapes: extra requests of one token at position
    /// 0 that write no KV (see `CommonAttentionMetadata::padded_for_graph`); the tap's
    /// requests keep their batch rows, the padding comes after them.
    #[allow(clippy::too_many_arguments)]
    fn forward_padded(
        &mut self,
        model: &dyn CausalLm,
        plan: &SchedulerOutput,
        requests: &HashMap<RequestId, Request>,
        kv: &KvCacheManager,
        inputs: &StepInputs,
        key: GraphKey,
        tap: Option<&mut dyn AttentionTap>,
    ) -> Result<StepLogitRows> {
        let b = key.num_reqs;
        // Every row whole in a whole-logits graph; else the rows' own picks, the
        // padding's rows reduced to their argmax.
        let pick = if key.whole_logits {
            vec![RowPick::Whole; b]
        } else {
            let mut pick = inputs.pick.clone();
            pick.resize(b, RowPick::ARGMAX);
            pick
        };
        // The graph's count of edits, the padding's naming no row (none for whole rows).
        let mut edits = if key.whole_logits {
            Vec::new()
        } else {
            inputs.edits.clone()
        };
        edits.resize(key.edit_capacity.max(edits.len()), LogitEdit::NONE);
        let mut padded = StepInputs {
            token_ids: inputs.token_ids.clone(),
            positions: inputs.positions.clone(),
            logits_rows: (0..b).collect(),
            pick,
            edits,
        };
        padded.token_ids.resize(b, 0);
        padded.positions.resize(b, 0);
        let attention = (0..self.group_chunk.len())
            .map(|g| {
                let common = self
                    .group_common(g, plan, requests, kv)?
                    .padded_for_graph(b, key.table_width)?;
                Ok(self.backend.build_metadata_for(Arc::new(common), None)?)
            })
            .collect::<Result<Vec<_>>>()?;
        self.forward(model, &padded, &attention, tap)
    }

    /// The model's forward over `inputs`: rows reduced as `pick` says where the logits
    /// are, the others whole.
    fn forward(
        &mut self,
        model: &dyn CausalLm,
        inputs: &StepInputs,
        attention: &[AttentionMetadata],
        tap: Option<&mut dyn AttentionTap>,
    ) -> Result<StepLogitRows> {
        let batch = ForwardBatch {
            token_ids: &inputs.token_ids,
            positions: &inputs.positions,
            attention,
            layer_group: &self.layer_group,
            logits_rows: &inputs.logits_rows,
        };
        let backend = self.backend.as_ref();
        Ok(if inputs.pick.iter().any(|p| p.is_picked()) {
            model.forward_picking(
                &batch,
                backend,
                &mut self.caches,
                tap,
                &inputs.pick,
                &inputs.edits,
            )?
        } else {
            StepLogitRows::all(model.forward(&batch, backend, &mut self.caches, tap)?)
        })
    }

    /// Metadata of one KV cache group, built once and shared by all its layers.
    fn group_metadata(
        &self,
        group: usize,
        plan: &SchedulerOutput,
        requests: &HashMap<RequestId, Request>,
        kv: &KvCacheManager,
    ) -> Result<AttentionMetadata> {
        let common = self.group_common(group, plan, requests, kv)?;
        Ok(self
            .backend
            .build_metadata_for(Arc::new(common), self.group_chunk[group])?)
    }

    /// The batch metadata of one KV cache group, before the backend adds its own.
    fn group_common(
        &self,
        group: usize,
        plan: &SchedulerOutput,
        requests: &HashMap<RequestId, Request>,
        kv: &KvCacheManager,
    ) -> Result<CommonAttentionMetadata> {
        let seqs: Vec<ScheduledSeq> = plan
            .scheduled
            .iter()
            .map(|s| {
                let req = &requests[&s.id];
                ScheduledSeq {
                    num_computed_tokens: req.num_computed_tokens,
                    num_scheduled_tokens: s.num_tokens,
                    block_table: kv.block_table(s.id, group),
                    // Every position is written, even one a sliding window has already
                    // left behind: padding would leave holes in blocks that the prefix
                    // cache then offers under their full content's key. Out-of-reach
                    // blocks are given back after the step instead.
                    slot_window: None,
                }
            })
            .collect();
        Ok(CommonAttentionMetadata::build(&seqs, self.block_size)?)
    }
}

/// A step's probability plan as a graph key's fingerprint (the process's own hash of the
/// layers' row counts): 0 when no layer asks for any, never 0 otherwise. Two plans that
/// collide share a key, and the second's launches differ from the recorded ones: the
/// graph diverges and the key runs eagerly from then on.
fn plan_fingerprint(plan: &[usize]) -> u64 {
    use std::hash::{Hash, Hasher};
    if plan.iter().all(|&rows| rows == 0) {
        return 0;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    plan.hash(&mut h);
    h.finish().max(1)
}

#[cfg(test)]
mod tests {
    use super::plan_fingerprint;

    #[test]
    fn a_plan_fingerprint_is_zero_only_for_no_rows_and_tells_plans_apart() {
        assert_eq!(plan_fingerprint(&[]), 0);
        assert_eq!(plan_fingerprint(&[0, 0, 0]), 0);
        let plans: [&[usize]; 5] = [&[1, 0, 0], &[0, 1, 0], &[0, 0, 1], &[2, 0, 0], &[1, 1, 0]];
        let prints: Vec<u64> = plans.iter().map(|p| plan_fingerprint(p)).collect();
        assert!(prints.iter().all(|&f| f != 0));
        for (i, a) in prints.iter().enumerate() {
            for b in &prints[i + 1..] {
                assert_ne!(a, b, "{plans:?}");
            }
        }
        assert_eq!(
            plan_fingerprint(&[0, 1, 0]),
            prints[1],
            "the same plan, the same key"
        );
    }
}
