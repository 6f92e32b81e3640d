//! The engine: accepts requests, runs steps, reports what each request produced.

use crate::config::EngineConfig;
use crate::error::{EngineError, RequestError, Result};
use crate::fault::FaultPlan;
use crate::host_threads;
use crate::request::{FinishReason, Request, RequestStatus};
use crate::runner::ModelRunner;
use crate::sampling::{
    apply_penalties, apply_token_mask, prompt_token_logprob, suppress_stop_tokens, token_logprobs,
    PromptTokenLogprob, SamplingParams, TokenLogprobs,
};
use crate::scheduler::Scheduler;
use crate::scored_prefix::{ScoredBlocks, DEFAULT_SCORED_PREFIX_BYTES};
use lantern_attn::{backend_by_name, AttentionBackend, AttentionLayerSpec, AttentionTap};
use lantern_capture::{
    keys_needed, map_on_backend, row_capture, row_capture_from_sums, snapshot_layer, CaptureError,
    CaptureFailure, CaptureSpec, KeySnapshot, PendingCapture, QueryRowBuffer, RowCapture, StepTap,
    TokenInfo,
};
use lantern_guided::{Constraint, TokenMask};
use lantern_kv::{
    AttentionKind, KvCacheConfig, KvCacheManager, KvCacheSpec, PrefixCacheStats, RequestId,
};
use lantern_model::hf::generation_config::SamplingDefaults;
use lantern_model::{CausalLm, ChatMessage, ChatTemplate, LoadedModel, ModelInfo, ModelTokenizer};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The KV cache kind a layer's attention needs: sliding layers keep only their window.
fn kv_cache_kind(layer: &AttentionLayerSpec) -> AttentionKind {
    match (layer.sliding_window, layer.chunk_size) {
        (Some(window), _) => AttentionKind::SlidingWindow { window },
        (None, Some(chunk_size)) => AttentionKind::ChunkedLocal { chunk_size },
        (None, None) => AttentionKind::FullAttention,
    }
}

/// What one request produced in one step.
#[derive(Debug, Clone)]
pub struct RequestOutput {
    pub id: RequestId,
    pub new_token_ids: Vec<u32>,
    /// Text made printable by the new tokens.
    pub new_text: String,
    pub finished: Option<FinishReason>,
    /// Log-probabilities of the new token, when the request asked for them.
    pub logprobs: Option<TokenLogprobs>,
    /// A streamed capture's live figures of the row that sampled the new token, when
    /// that row is captured ([`CaptureSpec::stream_rows`]).
    pub capture_row: Option<Box<RowCapture>>,
    /// Why sampling ended the request (`finished` is then `Abort`).
    pub sampling_failure: Option<SamplingFailure>,
}

/// Why a request could not sample its next token.
#[derive(Debug, Clone, PartialEq)]
pub enum SamplingFailure {
    /// Structured output's grammar failed on the new token (llguidance's error).
    Guided(String),
    /// Its token filter (with its grammar, if any) left no token; names the request
    /// field that did (`allowed_token_ids` or `bad_words`).
    NoTokenLeft(&'static str),
}

/// A finished request, all of it.
#[derive(Debug, Clone)]
pub struct Completion {
    pub id: RequestId,
    /// Shared with the request's other samples.
    pub prompt_token_ids: Arc<[u32]>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub num_cached_prompt_tokens: usize,
    /// Times the request was preempted and recomputed.
    pub num_preemptions: usize,
    /// `[prompt_len, vocab]` when the request asked for prompt logits.
    pub prompt_logits: Option<Vec<f32>>,
    /// A capturing request's capture, ready for [`PendingCapture::finalize`] on any
    /// thread (its blocks are already free), or why it could not be taken. `None` for
    /// requests that did not ask, and for aborted ones.
    pub capture: Option<std::result::Result<PendingCapture, CaptureFailure>>,
    /// Arrival to first token.
    pub time_to_first_token: Duration,
    /// Arrival to finish.
    pub total_time: Duration,
    /// Arrival to first scheduled (vLLM's queue time).
    pub queue_time: Duration,
    /// First scheduled to first token (vLLM's prefill time).
    pub prefill_time: Duration,
    /// First token to finish (vLLM's decode time).
    pub decode_time: Duration,
}

pub struct Engine {
    model: Box<dyn CausalLm>,
    /// Shared with request tasks, which tokenize off the engine thread.
    tokenizer: Arc<ModelTokenizer>,
    chat_template: Option<Arc<ChatTemplate>>,
    /// The model's recommended sampling defaults, for requests that leave them out.
    sampling_defaults: SamplingDefaults,
    config: EngineConfig,
    /// Kept to start the KV cache over after a fault ([`Engine::reset`]).
    kv_config: KvCacheConfig,
    kv: KvCacheManager,
    scheduler: Scheduler,
    /// Prompt logprobs of cached prefixes, so requests asking for them take hits.
    scored: ScoredBlocks,
    runner: ModelRunner,
    requests: HashMap<RequestId, Request>,
    next_id: RequestId,
    finished: Vec<RequestId>,
    /// Tokens computed by the last step (prompt and generated), for vLLM's
    /// `iteration_tokens_total`.
    last_step_tokens: usize,
    /// The model's description, its context cut to `max_model_len` when set.
    info: ModelInfo,
    /// Prefix-cache counters of the caches before the last [`Engine::reset`].
    prefix_stats_before_reset: PrefixCacheStats,
    faults: FaultPlan,
    /// Threads a finished capture's finalizing may use ([`host_threads`]).
    finalize_threads: usize,
    /// Bytes the model's weights take on its GPU (set by [`crate::device::PlacedModel`]).
    pub(crate) device_weight_bytes: Option<usize>,
}

/// A logits row the step's threads reduce to its token ([`Engine::tokens_on_threads`]).
struct RowOnThreads<'a> {
    /// Its index among the step's requests.
    request: usize,
    row: &'a [f32],
    /// What its penalties read of its request.
    penalties: RowRequest<'a>,
    /// The draw taken for it when sampled; `None`: its argmax.
    draw: Option<f32>,
}

/// A token chosen on the step's threads, with the logprobs its request asked for.
type TokenOnThreads = (u32, Option<TokenLogprobs>);

impl Engine {
    /// An engine running attention on the backend `config.attention_backend` names.
    pub fn new(loaded: LoadedModel, config: EngineConfig) -> Result<Self> {
        let backend = backend_by_name(&config.attention_backend)?;
        Self::with_backend(loaded, config, backend)
    }

    /// An engine running attention on `backend` (any [`AttentionBackend`]: it allocates
    /// the KV caches and the engine never looks inside them); `config.attention_backend`
    /// is not read.
    pub fn with_backend(
        loaded: LoadedModel,
        config: EngineConfig,
        backend: Box<dyn AttentionBackend>,
    ) -> Result<Self> {
        for (flag, value) in [
            ("--block-size", config.block_size),
            ("--max-num-seqs", config.max_num_seqs),
            ("--max-num-batched-tokens", config.max_num_batched_tokens),
        ] {
            if value == 0 {
                return Err(EngineError::InvalidConfig(format!(
                    "{flag} must be at least 1"
                )));
            }
        }
        let mut info = loaded.model.info().clone();
        if let Some(max) = config.max_model_len {
            if max < 2 || max > info.context_length {
                return Err(EngineError::InvalidConfig(format!(
                    "--max-model-len {max} must be between 2 and the model's context of {} tokens",
                    info.context_length
                )));
            }
            info.context_length = max;
        }
        let specs: Vec<KvCacheSpec> = info
            .attention
            .iter()
            .map(|a| KvCacheSpec {
                kind: kv_cache_kind(a),
                block_size: config.block_size,
                num_kv_heads: a.num_kv_heads,
                head_size: a.head_dim,
                dtype: config.kv_cache_dtype,
            })
            .collect();
        if let Some(chunk) = info
            .attention
            .iter()
            .filter_map(|a| a.chunk_size)
            .find(|c| c % config.block_size != 0)
        {
            return Err(EngineError::InvalidConfig(format!(
                "the model's chunked-local attention uses chunks of {chunk} tokens, which is not a multiple of the KV cache block size {}; choose a --block-size that divides it",
                config.block_size
            )));
        }
        let kv_config = KvCacheConfig::from_memory_budget(&specs, config.kv_cache_memory)?;
        // The CUDA backends' names start so (`lantern_cuda::CUDA_BACKEND_NAMES`): their
        // caches are sized from the card's memory, and their forward leaves the host's
        // cores idle.
        let on_host = !backend.name().starts_with("cuda");
        if on_host {
            crate::host_memory::check_kv_cache_fits(
                kv_config.total_bytes(),
                crate::host_memory::total_bytes(),
            )?;
        }
        let mut runner =
            ModelRunner::new(&kv_config, info.num_layers, config.kv_cache_dtype, backend)?;
        runner.stop_ids = loaded.tokenizer.stop_ids().to_vec();
        let finalize_threads = host_threads::finalize_threads(on_host);
        tracing::info!(
            blocks = kv_config.num_blocks,
            block_size = config.block_size,
            tokens = kv_config.num_blocks * config.block_size,
            backend = runner.backend_name(),
            "KV cache ready"
        );
        Ok(Self {
            kv: KvCacheManager::new(&kv_config, config.enable_prefix_caching),
            scheduler: Scheduler::new(config.max_num_batched_tokens, config.max_num_seqs),
            scored: ScoredBlocks::new(config.block_size, DEFAULT_SCORED_PREFIX_BYTES),
            runner,
            model: loaded.model,
            tokenizer: Arc::new(loaded.tokenizer),
            chat_template: loaded.chat_template.map(Arc::new),
            sampling_defaults: loaded.sampling_defaults,
            config,
            kv_config,
            requests: HashMap::new(),
            next_id: 0,
            finished: Vec::new(),
            last_step_tokens: 0,
            info,
            prefix_stats_before_reset: PrefixCacheStats::default(),
            faults: FaultPlan::default(),
            finalize_threads,
            device_weight_bytes: None,
        })
    }

    /// The model's description; `context_length` is the context requests get (the
    /// model's own, or `max_model_len` when set).
    pub fn model_info(&self) -> &ModelInfo {
        &self.info
    }

    pub fn tokenizer(&self) -> &ModelTokenizer {
        &self.tokenizer
    }

    /// The tokenizer, for use on other threads.
    pub fn shared_tokenizer(&self) -> Arc<ModelTokenizer> {
        self.tokenizer.clone()
    }

    /// The sampling defaults the model recommends (`generation_config.json`), which a
    /// front end gives requests that leave those fields out.
    pub fn sampling_defaults(&self) -> &SamplingDefaults {
        &self.sampling_defaults
    }

    /// The chat template, for use on other threads.
    pub fn shared_chat_template(&self) -> Option<Arc<ChatTemplate>> {
        self.chat_template.clone()
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn attention_backend(&self) -> &'static str {
        self.runner.backend_name()
    }

    /// The accelerator the model runs on, described; `None` on the CPU.
    pub fn accelerator(&self) -> Option<String> {
        self.runner.backend().accelerator()
    }

    /// Device time per kernel so far, where the backend times its kernels
    /// (`LANTERN_CUDA_PROFILE=on`); `None` otherwise.
    pub fn kernel_times(&self) -> Option<Vec<lantern_attn::KernelTime>> {
        self.runner.backend().kernel_times()
    }

    /// Bytes the model's weights take on its GPU; `None` on the CPU.
    pub fn device_weight_bytes(&self) -> Option<usize> {
        self.device_weight_bytes
    }

    /// What the backend's decode-step graphs did so far; `None` where steps run eagerly
    /// (the CPU, `enforce_eager`).
    pub fn graph_stats(&self) -> Option<lantern_attn::GraphStats> {
        self.runner.backend().step_graphs().map(|g| g.stats())
    }

    /// Testing: rows that need only their argmax, or a sample of the whole softmax, are
    /// reduced by the model even when it keeps its logits on the host (as a GPU model does
    /// on its device), so the path that takes a picked token runs without a GPU.
    pub fn set_pick_on_host(&mut self, on: bool) {
        self.runner.pick_on_host = on;
    }

    pub fn kv_cache(&self) -> &KvCacheManager {
        &self.kv
    }

    /// Prefix-cache counters since the engine was built (across [`Engine::reset`]s).
    pub fn prefix_cache_stats(&self) -> PrefixCacheStats {
        let now = self.kv.prefix_cache_stats();
        let before = &self.prefix_stats_before_reset;
        PrefixCacheStats {
            queries: before.queries + now.queries,
            hits: before.hits + now.hits,
            evictions: before.evictions + now.evictions,
        }
    }

    /// Makes the engine panic where `plan` says (tests of fault containment only).
    pub fn set_fault_plan(&mut self, plan: FaultPlan) {
        self.faults = plan;
    }

    /// Drops every request and starts the KV cache and the scheduler over, keeping the
    /// model and the cache tensors: after a panic left the book-keeping in an unknown
    /// state, this is the state of a freshly built engine (no block in use, nothing
    /// waiting, an empty prefix cache). Request ids keep counting and counters carry
    /// over, so stale ids name nothing and metrics stay monotonic.
    pub fn reset(&mut self) {
        self.faults.reset.panic_if_hit("while resetting the engine");
        self.prefix_stats_before_reset = self.prefix_cache_stats();
        let preemptions = self.scheduler.num_preemptions;
        self.requests.clear();
        self.finished.clear();
        self.kv = KvCacheManager::new(&self.kv_config, self.config.enable_prefix_caching);
        self.scheduler =
            Scheduler::new(self.config.max_num_batched_tokens, self.config.max_num_seqs);
        self.scheduler.num_preemptions = preemptions;
        self.scored.clear();
    }

    /// Renders a conversation through the model's chat template, ready for the assistant.
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or(RequestError::NoChatTemplate)?;
        Ok(template.render(messages, true)?)
    }

    /// Token ids of a conversation rendered through the chat template, ready for the
    /// assistant: control tokens come only from the template's own text, never from
    /// message contents (see [`lantern_model::prompt::tokenize_chat`]).
    pub fn tokenize_chat(
        &self,
        messages: &[ChatMessage],
        add_special_tokens: bool,
    ) -> Result<Vec<u32>> {
        lantern_model::prompt::tokenize_chat(
            self.chat_template.as_deref(),
            &self.tokenizer,
            messages,
            add_special_tokens,
            usize::MAX,
        )
        .map_err(|e| EngineError::ChatPrompt(Box::new(e)))
    }

    /// Queues a request; it runs from the next step on.
    pub fn add_request(
        &mut self,
        prompt: impl Into<Arc<[u32]>>,
        params: SamplingParams,
    ) -> Result<RequestId> {
        self.add_request_with_capture(prompt, params, None)
    }

    /// Queues a request whose prompt equals `leader`'s (one of `n` samples of a
    /// prompt): it is admitted once the leader's prompt is computed and takes the
    /// prompt's full blocks from the prefix cache, sharing them by reference count.
    /// Without prefix caching it runs like any request. Pass the leader's own `Arc`, so
    /// that the samples hold one copy of the prompt.
    pub fn add_sibling_request(
        &mut self,
        leader: RequestId,
        prompt: impl Into<Arc<[u32]>>,
        params: SamplingParams,
    ) -> Result<RequestId> {
        let prompt = prompt.into();
        let same_prompt = self
            .requests
            .get(&leader)
            .is_some_and(|l| l.prompt() == &*prompt);
        let id = self.add_request(prompt, params)?;
        if same_prompt {
            if let Some(req) = self.requests.get_mut(&id) {
                req.prompt_leader = Some(leader);
            }
        }
        Ok(id)
    }

    /// Checks a capture request against the model (layers and heads in range) and
    /// normalizes it (sorted, without repeats).
    pub fn validate_capture(&self, spec: &mut CaptureSpec) -> Result<()> {
        let info = &self.info;
        let heads = info
            .attention
            .iter()
            .map(|a| a.num_heads)
            .min()
            .unwrap_or(0);
        Ok(spec.validate(info.num_layers, heads)?)
    }

    /// Queues a request that captures its attention as `capture` says (see
    /// `lantern-capture`): it skips the prefix-cache lookup and computes every position
    /// itself, so each query row pairs only with its own keys.
    pub fn add_request_with_capture(
        &mut self,
        prompt: impl Into<Arc<[u32]>>,
        params: SamplingParams,
        capture: Option<CaptureSpec>,
    ) -> Result<RequestId> {
        let prompt: Arc<[u32]> = prompt.into();
        self.faults
            .admission
            .panic_if_hit("while admitting a request");
        params.validate()?;
        let info = &self.info;
        if prompt.is_empty() {
            return Err(RequestError::EmptyPrompt.into());
        }
        if let Some(&token) = prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(RequestError::TokenOutsideVocabulary {
                token,
                vocab_size: info.vocab_size,
            }
            .into());
        }
        if prompt.len() > crate::request::longest_prompt(info.context_length, params.max_tokens) {
            return Err(RequestError::PromptTooLong {
                tokens: prompt.len(),
                context: info.context_length,
            }
            .into());
        }
        let longest = prompt
            .len()
            .saturating_add(params.max_tokens)
            .min(info.context_length);
        if !self.kv.can_fit_ever(longest) {
            return Err(RequestError::NeverFitsKvCache {
                tokens: longest,
                blocks: self.kv.num_blocks(),
                block_size: self.config.block_size,
            }
            .into());
        }
        let buffer = match capture {
            Some(mut spec) => {
                self.validate_capture(&mut spec)?;
                let first = spec
                    .layers
                    .first()
                    .and_then(|&l| info.attention.get(l))
                    .ok_or_else(|| lantern_capture::CaptureError::InvalidField {
                        field: "attn_capture_layers",
                        message: "no layer of this model".to_string(),
                    })?;
                Some(Box::new(
                    QueryRowBuffer::new(
                        spec,
                        info.num_layers,
                        first.num_heads,
                        first.head_dim,
                        prompt.len(),
                        params.max_tokens,
                    )
                    .with_live_sums(&info.attention)
                    .keep_rows_on(self.runner.backend()),
                ))
            }
            None => None,
        };
        let id = self.next_id;
        self.next_id += 1;
        let mut request = Request::new(id, prompt, params);
        request.capture = buffer;
        self.requests.insert(id, request);
        self.scheduler.add(id);
        Ok(id)
    }

    /// Makes a queued request's output follow `constraint` (structured output): before
    /// each token, the tokens the grammar does not allow are masked out, and the request
    /// finishes (`Stop`) once the grammar is complete. Call it before the request's first
    /// step; unknown ids are ignored.
    pub fn constrain(&mut self, id: RequestId, constraint: Constraint) {
        if let Some(req) = self.requests.get_mut(&id) {
            req.constraint = Some(Box::new(constraint));
        }
    }

    /// As [`Engine::constrain`], from the token after the output first ends with
    /// `thinking_end` (a reasoning model's end tag): its thinking is not constrained.
    pub fn constrain_after(
        &mut self,
        id: RequestId,
        constraint: Constraint,
        thinking_end: Arc<[u32]>,
    ) {
        if let Some(req) = self.requests.get_mut(&id) {
            req.constraint_after = Some((Box::new(constraint), thinking_end));
        }
    }

    /// Cancels a request and gives its blocks back (a capture is dropped).
    pub fn abort(&mut self, id: RequestId) {
        self.finish(id, FinishReason::Abort);
    }

    /// Ends a running request early as finished for `reason` (e.g. a stop string the
    /// caller matched on the text): unlike an abort, its capture is taken.
    pub fn finish_early(&mut self, id: RequestId, reason: FinishReason) {
        self.finish(id, reason);
    }

    /// Takes the prompt logits (`[prompt_len, vocab]`, as [`Completion::prompt_logits`])
    /// of a request that asked for them, as soon as every prompt row is in (from the step
    /// that samples its first token), so they can be used while the request still runs.
    /// The request stops keeping them: a later preemption recomputes without them (and
    /// may use the prefix cache), and its completion carries none. `None` before the
    /// rows are complete, for requests that did not ask, and after the first take.
    pub fn take_prompt_logits(&mut self, id: RequestId) -> Option<Vec<f32>> {
        let req = self.requests.get_mut(&id)?;
        if !req.params.prompt_logits || !req.prompt_logits_complete {
            return None;
        }
        req.params.prompt_logits = false;
        req.prompt_logits_complete = false;
        Some(std::mem::take(&mut req.prompt_logits))
    }

    /// Takes the prompt logprobs of a request that asked for them (one entry per prompt
    /// token after the first) once they are all in, as [`Self::take_prompt_logits`] does
    /// for logits. `None` before that, for requests that did not ask, and after the first
    /// take.
    pub fn take_prompt_logprobs(&mut self, id: RequestId) -> Option<Vec<PromptTokenLogprob>> {
        let req = self.requests.get_mut(&id)?;
        if req.params.prompt_logprobs.is_none() || !req.prompt_logprobs_complete() {
            return None;
        }
        req.params.prompt_logprobs = None;
        Some(std::mem::take(&mut req.prompt_logprobs))
    }

    /// Marks a request finished, takes its capture while its blocks still hold its
    /// keys, then gives the blocks back.
    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        if req.is_finished() {
            return;
        }
        req.status = RequestStatus::Finished(reason);
        req.times.finished.get_or_insert_with(Instant::now);
        self.scheduler.remove(id);
        if reason != FinishReason::Abort {
            self.take_capture(id);
        }
        match self.requests.get(&id) {
            Some(req) if req.params.keep_tail && reason != FinishReason::Abort => {
                self.kv.free_keeping_tail(
                    id,
                    req.token_seq(),
                    req.num_computed_tokens,
                    req.cache_keys(),
                )
            }
            _ => self.kv.free(id),
        }
        self.finished.push(id);
    }

    /// Copies a finishing capturing request's keys (and values, when verification
    /// asked for them) out of the cache, so its blocks can be freed right away and the
    /// maps computed later, off the step loop.
    fn take_capture(&mut self, id: RequestId) {
        let Some(req) = self.requests.get_mut(&id) else {
            return;
        };
        let Some(mut buffer) = req.capture.take() else {
            return;
        };
        let info = &self.info;
        let tokenizer = &self.tokenizer;
        let total = req.num_tokens();
        let num_computed = req.num_computed_tokens;
        let spec = buffer.spec();
        let rows = buffer.rows_present(req.prompt_len(), total, num_computed);
        // Statistics and span masses summed as the rows ran need no keys: then none
        // are copied.
        let num_keys = spec
            .layers
            .iter()
            .filter_map(|&l| info.attention.get(l))
            .map(|layer| keys_needed(layer, rows.clone(), num_computed).end)
            .max()
            .unwrap_or(0);
        let mut layers = Vec::with_capacity(spec.layers.len());
        let mut computed_maps = Vec::with_capacity(spec.layers.len());
        let mut failure = None;
        let mut host_reads_queries = false;
        for (slot, &l) in spec.layers.iter().enumerate() {
            let (Some(layer), Some(cache)) = (info.attention.get(l), self.runner.caches().get(l))
            else {
                failure = Some(CaptureFailure::Snapshot(format!(
                    "layer {l} is not a layer of this model"
                )));
                break;
            };
            let table = self.kv.block_table(id, self.runner.layer_group(l));
            let keys = keys_needed(layer, rows.clone(), num_computed);
            // A backend that computes maps where its cache lives (the GPU's) sends back
            // the map alone; if it cannot, the keys are copied and finalize computes it.
            let backend = self.runner.backend();
            let (buf, range) = (&*buffer, rows.clone());
            let map = map_on_backend(backend, &**cache, table, buf, slot, layer, range, num_keys)
                .and_then(|computed| {
                    let why = |e: CaptureError| {
                        tracing::warn!(
                            layer = l,
                            backend = backend.name(),
                            error = %e,
                            "the backend did not compute a capture's map; its keys are copied \
                             for the host to compute it"
                        )
                    };
                    computed.map_err(why).ok()
                });
            let needs_keys = buffer.needs_keys(&rows, num_keys, map.is_some());
            host_reads_queries |= needs_keys;
            computed_maps.push(map);
            if !needs_keys {
                let snapshot = KeySnapshot::without_keys(keys, layer.num_kv_heads, layer.head_dim);
                layers.push((layer.clone(), snapshot));
                continue;
            }
            match snapshot_layer(
                backend,
                cache.as_ref(),
                table,
                keys,
                spec.keep_attention_output,
            ) {
                Ok(snapshot) => layers.push((layer.clone(), snapshot)),
                Err(e) => {
                    failure = Some(CaptureFailure::Snapshot(e.to_string()));
                    break;
                }
            }
        }
        // Rows kept on the device go to the host only where finalize computes from
        // them there; then the device's copy is freed.
        if host_reads_queries && failure.is_none() {
            if let Err(e) = buffer.sync_host() {
                failure = Some(CaptureFailure::Snapshot(format!(
                    "the query rows kept on the device could not be read: {e}"
                )));
            }
        }
        buffer.release_device_rows();
        let tokens = req
            .prompt()
            .iter()
            .chain(req.output_ids())
            .map(|&t| TokenInfo {
                id: t,
                text: tokenizer.decode(&[t], false).unwrap_or_default(),
            })
            .collect();
        req.pending_capture = Some(match failure {
            Some(e) => Err(e),
            None => Ok(PendingCapture {
                buffer: *buffer,
                layers,
                computed_maps,
                prompt_len: req.prompt_len(),
                max_len: req.prompt_len().saturating_add(req.params.max_tokens),
                block_size: self.config.block_size,
                tokens,
                num_computed,
                finalize_threads: self.finalize_threads,
            }),
        });
    }

    pub fn has_unfinished(&self) -> bool {
        self.scheduler.num_running() + self.scheduler.num_waiting() > 0
    }

    pub fn num_running(&self) -> usize {
        self.scheduler.num_running()
    }

    pub fn num_waiting(&self) -> usize {
        self.scheduler.num_waiting()
    }

    pub fn num_preemptions(&self) -> u64 {
        self.scheduler.num_preemptions
    }

    /// Tokens the last [`Self::step`] computed, over every scheduled request.
    pub fn last_step_tokens(&self) -> usize {
        self.last_step_tokens
    }

    /// Runs one step: one forward pass over every scheduled request.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>> {
        let plan = self
            .scheduler
            .schedule(&mut self.requests, &mut self.kv, &self.scored);
        self.last_step_tokens = plan.scheduled.iter().map(|s| s.num_tokens).sum();
        if plan.is_empty() {
            if self.has_unfinished() {
                // Admission checks that every request fits the pool alone, so an empty
                // plan with work left means the scheduler lost track of blocks.
                return Err(EngineError::Stalled {
                    waiting: self.scheduler.num_waiting(),
                    free_blocks: self.kv.num_free_blocks(),
                });
            }
            return Ok(Vec::new());
        }
        self.faults.step.panic_if_hit("inside an engine step");
        let logits = self.execute_plan_with_masks(&plan)?;
        for s in &plan.scheduled {
            let req = self
                .requests
                .get_mut(&s.id)
                .ok_or(EngineError::LostRequest(s.id))?;
            req.num_computed_tokens += s.num_tokens;
            let computed = req.token_seq().prefix(req.num_computed_tokens);
            self.kv.cache_blocks(s.id, computed, req.cache_keys())?;
            // Sliding-window blocks no later query can see go back to the pool; a
            // capturing request keeps them, since its early rows read them at the end.
            if req.capture.is_none() {
                self.kv.release_out_of_reach(s.id, req.num_computed_tokens);
            }
        }
        let on_threads = self.tokens_on_threads(&logits)?;
        let mut outputs = Vec::with_capacity(logits.requests.len());
        for (rows, on_threads) in logits.requests.iter().zip(on_threads) {
            let req = self
                .requests
                .get_mut(&rows.id)
                .ok_or(EngineError::LostRequest(rows.id))?;
            let wanted = req.prompt_len() * logits.vocab;
            let sample_row = rows.first_row + rows.num_prompt_rows;
            if req.params.prompt_logits && req.prompt_logits.len() < wanted {
                req.prompt_logits
                    .extend_from_slice(logits.rows(rows.first_row, rows.num_prompt_rows)?);
                if rows.samples && req.prompt_logits.len() < wanted {
                    req.prompt_logits
                        .extend_from_slice(logits.rows(sample_row, 1)?);
                }
                req.prompt_logits_complete = req.prompt_logits.len() == wanted;
            }
            if let Some(k) = req.params.prompt_logprobs {
                // Row `p` predicts prompt token `p + 1`; rows arrive in order (a
                // preemption before the last one starts them over).
                let wanted = req
                    .prompt_len()
                    .saturating_sub(1 + req.prompt_logprobs.len());
                let take = rows.num_prompt_rows.min(wanted);
                let first_token = req.prompt_logprobs.len() + 1;
                let tokens: Vec<u32> = (first_token..first_token + take)
                    .map(|t| req.token(t).unwrap_or(u32::MAX))
                    .collect();
                let entries = prompt_logprob_rows(&logits, rows.first_row, &tokens, k)?;
                req.prompt_logprobs.extend(entries);
                if req.scores_prompt_only() && self.kv.prefix_caching_enabled() {
                    let salt = req.cache_keys();
                    self.scored
                        .record(req.prompt(), &req.prompt_logprobs, k, salt);
                }
            }
            if rows.samples && req.params.max_tokens == 0 {
                outputs.push(self.finish_prompt_only(rows.id));
            } else if rows.samples {
                // Before the token is appended: a token that ends the request takes
                // its capture, and with it the query row.
                let live = self.live_row(rows.id);
                let mut output = match (logits.picked(sample_row), on_threads) {
                    (Some(reduced), _) => {
                        let logprobs = reduced.score.as_ref().map(|s| TokenLogprobs {
                            token_id: reduced.token,
                            logprob: s.logprob,
                            rank: s.rank,
                            top: s.top.clone(),
                        });
                        self.append_picked(rows.id, reduced.token, logprobs)?
                    }
                    (None, Some((token, logprobs))) => {
                        self.append_picked(rows.id, token, logprobs)?
                    }
                    (None, None) => self.append_token(rows.id, logits.rows(sample_row, 1)?)?,
                };
                output.capture_row = live;
                outputs.push(output);
            }
        }
        Ok(outputs)
    }

    /// Runs the plan's forward pass while the masks of the constrained requests that
    /// sample in this step are computed on the thread pool, in parallel with it and with
    /// each other, so structured output adds no serial step to the batch.
    fn execute_plan_with_masks(
        &mut self,
        plan: &crate::scheduler::SchedulerOutput,
    ) -> Result<crate::runner::StepLogits> {
        let mut constrained: Vec<(RequestId, Box<Constraint>)> = Vec::new();
        for s in &plan.scheduled {
            let req = self
                .requests
                .get_mut(&s.id)
                .ok_or(EngineError::LostRequest(s.id))?;
            let samples = req.num_computed_tokens + s.num_tokens == req.num_tokens();
            if samples {
                if let Some(constraint) = req.constraint.take() {
                    constrained.push((s.id, constraint));
                }
            }
        }
        if constrained.is_empty() {
            return self.execute_plan(plan);
        }
        let mut masks: Vec<std::result::Result<TokenMask, String>> = Vec::new();
        let logits = rayon::in_place_scope(|scope| {
            scope.spawn(|_| {
                use rayon::prelude::*;
                masks = constrained
                    .par_iter_mut()
                    .map(|(_, c)| c.compute_mask().map_err(|e| e.to_string()))
                    .collect();
            });
            self.execute_plan(plan)
        });
        for ((id, constraint), mask) in constrained.into_iter().zip(masks) {
            if let Some(req) = self.requests.get_mut(&id) {
                req.constraint = Some(constraint);
                req.mask = Some(mask);
            }
        }
        logits
    }

    /// Runs the plan's forward pass, handing the query rows of capturing requests to
    /// their buffers. Steps without a capturing request pass no tap at all.
    fn execute_plan(
        &mut self,
        plan: &crate::scheduler::SchedulerOutput,
    ) -> Result<crate::runner::StepLogits> {
        let mut buffers = Vec::new();
        let mut batch_row = 0;
        // A sampled token takes its draw now, from the request's stream, as the host
        // sampler would after the step (one draw a token, whatever samples it): the model
        // may sample it where its logits are (`Request::reduces_row`), the step's threads
        // on the host (`tokens_on_threads`), or `append_token`.
        for s in &plan.scheduled {
            let Some(req) = self.requests.get_mut(&s.id) else {
                continue;
            };
            let samples = req.num_computed_tokens + s.num_tokens == req.num_tokens();
            if samples && req.params.temperature > 0.0 {
                req.sampler.draw_ahead();
            }
            if let Some(buffer) = req.capture.take() {
                buffers.push((
                    s.id,
                    batch_row,
                    s.num_tokens,
                    req.num_computed_tokens,
                    buffer,
                ));
            }
            batch_row += s.num_tokens;
        }
        let model = self.model.as_ref();
        let result = if buffers.is_empty() {
            self.runner
                .execute(model, plan, &self.requests, &self.kv, None)
        } else {
            let info = model.info();
            let (heads, head_dim) = info
                .attention
                .first()
                .map_or((0, 0), |a| (a.num_heads, a.head_dim));
            let mut tap = StepTap::new(info.num_layers, heads, head_dim);
            for (_, row, n, pos, buffer) in &mut buffers {
                tap.add(*row, *n, *pos, buffer);
            }
            let result = self
                .runner
                .execute(model, plan, &self.requests, &self.kv, Some(&mut tap));
            tap.finish_step();
            result
        };
        for (id, _, _, _, buffer) in buffers {
            if let Some(req) = self.requests.get_mut(&id) {
                req.capture = Some(buffer);
            }
        }
        result
    }

    /// A streamed capture's live figures of the row that samples this step's token
    /// (the last computed position), when that row is captured: from what the live sums
    /// kept of the row (the attention kernel's probabilities), or else from its keys read
    /// from the cache through the backend, as finalizing reads them. `None` otherwise, or
    /// when they cannot be computed (the finished capture then says why).
    fn live_row(&mut self, id: RequestId) -> Option<Box<RowCapture>> {
        let req = self.requests.get(&id)?;
        let buffer = req.capture.as_deref()?;
        let num_computed = req.num_computed_tokens;
        let pos = num_computed.checked_sub(1)?;
        if !buffer.spec().stream_rows || !buffer.has_row(pos) {
            return None;
        }
        if let Some(row) = row_capture_from_sums(buffer, pos) {
            return Some(Box::new(row));
        }
        // From the keys, on the host: its query row comes over first where the device
        // keeps it.
        if buffer.keeps_on_device() {
            let buffer = self.requests.get_mut(&id)?.capture.as_deref_mut()?;
            if let Err(e) = buffer.sync_host() {
                tracing::warn!(error = %e, "a streamed capture row's query could not be read");
                return None;
            }
        }
        let buffer = self.requests.get(&id)?.capture.as_deref()?;
        let spec = buffer.spec();
        let mut layers = Vec::with_capacity(spec.layers.len());
        for &l in &spec.layers {
            let layer = self.info.attention.get(l)?;
            let cache = self.runner.caches().get(l)?;
            let keys = keys_needed(layer, pos..pos + 1, num_computed);
            let table = self.kv.block_table(id, self.runner.layer_group(l));
            let snapshot =
                snapshot_layer(self.runner.backend(), cache.as_ref(), table, keys, false).ok()?;
            layers.push((layer.clone(), snapshot));
        }
        row_capture(buffer, pos, &layers).ok().map(Box::new)
    }

    /// Ends a `max_tokens: 0` request once its whole prompt has run: nothing is
    /// sampled, its capture covers every prompt row.
    fn finish_prompt_only(&mut self, id: RequestId) -> RequestOutput {
        self.finish(id, FinishReason::Length);
        RequestOutput {
            id,
            new_token_ids: Vec::new(),
            new_text: String::new(),
            finished: Some(FinishReason::Length),
            logprobs: None,
            capture_row: None,
            sampling_failure: None,
        }
    }

    fn append_token(&mut self, id: RequestId, logits: &[f32]) -> Result<RequestOutput> {
        let req = self
            .requests
            .get_mut(&id)
            .ok_or(EngineError::LostRequest(id))?;
        let penalized = penalized_row(logits, &RowRequest::of(req), self.tokenizer.stop_ids());
        let logits = &penalized[..];
        // The grammar's mask and the token filter narrow one copy of the row.
        let grammar_mask = match (req.constraint.as_mut(), req.mask.take()) {
            (None, _) => Ok(None),
            (Some(_), Some(mask)) => mask.map(Some),
            (Some(constraint), None) => constraint
                .compute_mask()
                .map(Some)
                .map_err(|e| e.to_string()),
        };
        let filter = &req.params.token_filter;
        let mut failure = None;
        let token = match grammar_mask {
            Err(e) => {
                failure = Some(SamplingFailure::Guided(e));
                crate::sampling::argmax(logits)
            }
            Ok(None) if filter.is_empty() => req.sampler.sample(logits, &req.params),
            Ok(mask) => {
                let mut masked = logits.to_vec();
                if let Some(mask) = &mask {
                    apply_token_mask(&mut masked, mask.words());
                }
                if filter.apply(&mut masked, &req.output) {
                    req.sampler.sample(&masked, &req.params)
                } else {
                    failure = Some(SamplingFailure::NoTokenLeft(filter.field()));
                    crate::sampling::argmax(logits)
                }
            }
        };
        if failure.is_none() {
            if let Some(Err(e)) = req.constraint.as_mut().map(|c| c.consume(token)) {
                failure = Some(SamplingFailure::Guided(e.to_string()));
            }
        }
        // Logprobs are those of the model's distribution, before any mask.
        let logprobs = req
            .params
            .logprobs
            .map(|k| token_logprobs(logits, token, k));
        self.push_token(id, token, logprobs, failure)
    }

    /// Per request of the step's logits: its next token, with the logprobs it asks for,
    /// when its row is left on the host and read alone (`Request::reads_row_alone`:
    /// greedy, or sampled with the draw taken before the step; penalties applied to a
    /// copy), the rows reduced on the step's threads (each row whole by one thread: what
    /// `append_token` would give, from the same draw), so that a large batch's rows do not
    /// run on this thread alone.
    fn tokens_on_threads(
        &self,
        logits: &crate::runner::StepLogits,
    ) -> Result<Vec<Option<TokenOnThreads>>> {
        let mut rows: Vec<RowOnThreads<'_>> = Vec::new();
        for (i, r) in logits.requests.iter().enumerate() {
            let sample_row = r.first_row + r.num_prompt_rows;
            let req = self
                .requests
                .get(&r.id)
                .ok_or(EngineError::LostRequest(r.id))?;
            let skip = !r.samples || req.params.max_tokens == 0 || !req.reads_row_alone();
            if skip || logits.picked(sample_row).is_some() {
                continue;
            }
            let draw = match req.sampler.drawn() {
                _ if req.params.temperature == 0.0 => None,
                Some(draw) => Some(draw),
                None => continue,
            };
            rows.push(RowOnThreads {
                request: i,
                row: logits.rows(sample_row, 1)?,
                penalties: RowRequest::of(req),
                draw,
            });
        }
        let stop_ids = self.tokenizer.stop_ids();
        let picked: Vec<std::sync::OnceLock<TokenOnThreads>> =
            rows.iter().map(|_| std::sync::OnceLock::new()).collect();
        lantern_quant::share::run(rows.len(), &|c| {
            let r = &rows[c];
            let params = r.penalties.params;
            let row = penalized_row(r.row, &r.penalties, stop_ids);
            let token = match r.draw {
                Some(draw) => crate::sampling::sample_with_draw(&row, params, draw),
                None => crate::sampling::argmax(&row),
            };
            let logprobs = params.logprobs.map(|k| token_logprobs(&row, token, k));
            let _ = picked[c].set((token, logprobs));
        });
        let mut tokens = vec![None; logits.requests.len()];
        for (r, token) in rows.iter().zip(picked) {
            tokens[r.request] = token.into_inner();
        }
        Ok(tokens)
    }

    /// Appends a token chosen outside `append_token` with the draw taken ahead, as it
    /// would have chosen it: on the step's threads (`tokens_on_threads`), or by the model
    /// where its logits are (`Request::reduces_row`), with the logprobs it scored there.
    fn append_picked(
        &mut self,
        id: RequestId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
    ) -> Result<RequestOutput> {
        if let Some(req) = self.requests.get_mut(&id) {
            req.sampler.used_draw();
        }
        self.push_token(id, token, logprobs, None)
    }

    /// Appends the sampled `token` and decides whether the request is done.
    fn push_token(
        &mut self,
        id: RequestId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        failure: Option<SamplingFailure>,
    ) -> Result<RequestOutput> {
        let context_length = self.info.context_length;
        let req = self
            .requests
            .get_mut(&id)
            .ok_or(EngineError::LostRequest(id))?;
        req.push_output(token);
        if req
            .constraint_after
            .as_ref()
            .is_some_and(|(_, end)| req.output.ends_with(end))
        {
            req.constraint = req.constraint_after.take().map(|(c, _)| c);
        }
        let now = Instant::now();
        req.times.first_token.get_or_insert(now);
        let tokenizer = &self.tokenizer;
        let is_stop = !req.params.ignore_eos && tokenizer.stop_ids().contains(&token)
            || req.params.stop_token_ids.contains(&token);
        let grammar_done = req.constraint.as_ref().is_some_and(|c| c.is_finished());
        match &failure {
            Some(SamplingFailure::Guided(error)) => {
                tracing::warn!(request = id, %error, "structured output failed; ending the request")
            }
            Some(SamplingFailure::NoTokenLeft(field)) => {
                tracing::info!(
                    request = id,
                    field,
                    "no token left to sample; ending the request"
                )
            }
            None => {}
        }
        let finished = if failure.is_some() {
            Some(FinishReason::Abort)
        } else if is_stop || grammar_done {
            Some(FinishReason::Stop)
        } else if req.num_output_tokens() >= req.params.max_tokens
            || req.num_tokens() >= context_length
        {
            Some(FinishReason::Length)
        } else {
            None
        };
        // A stop token's text stays out of the text unless the request asks for it.
        let new_text = if is_stop && !req.params.stop_token_text {
            String::new()
        } else {
            req.decoder
                .step(tokenizer, &req.output, req.params.skip_special_tokens)?
        };
        req.text.push_str(&new_text);
        if let Some(reason) = finished {
            req.times.finished = Some(now);
            self.finish(id, reason);
        }
        Ok(RequestOutput {
            id,
            new_token_ids: vec![token],
            new_text,
            finished,
            logprobs,
            capture_row: None,
            sampling_failure: failure,
        })
    }

    /// Takes a finished request out of the engine.
    pub fn take_completion(&mut self, id: RequestId) -> Option<Completion> {
        if !self.requests.get(&id)?.is_finished() {
            return None;
        }
        self.finished.retain(|&f| f != id);
        let req = self.requests.remove(&id)?;
        let RequestStatus::Finished(finish_reason) = req.status else {
            return None;
        };
        let end = req.times.finished.unwrap_or_else(Instant::now);
        let times = req.times;
        let scheduled = times.first_scheduled.unwrap_or(end);
        let first_token = times.first_token.unwrap_or(end);
        Some(Completion {
            id,
            prompt_token_ids: req.shared_prompt().clone(),
            token_ids: req.output_ids().to_vec(),
            text: req.text,
            finish_reason,
            num_cached_prompt_tokens: req.num_cached_prompt_tokens,
            num_preemptions: req.num_preemptions,
            prompt_logits: req.params.prompt_logits.then_some(req.prompt_logits),
            capture: req.pending_capture,
            time_to_first_token: req
                .times
                .first_token
                .unwrap_or(end)
                .duration_since(req.times.arrival),
            total_time: end.duration_since(times.arrival),
            queue_time: scheduled.saturating_duration_since(times.arrival),
            prefill_time: first_token.saturating_duration_since(scheduled),
            decode_time: end.saturating_duration_since(first_token),
        })
    }

    /// Runs prompts to completion as one batch and returns them in input order.
    pub fn generate(
        &mut self,
        prompts: Vec<(Vec<u32>, SamplingParams)>,
    ) -> Result<Vec<Completion>> {
        let ids = prompts
            .into_iter()
            .map(|(prompt, params)| self.add_request(prompt, params))
            .collect::<Result<Vec<_>>>()?;
        while self.has_unfinished() {
            self.step()?;
        }
        Ok(ids
            .into_iter()
            .filter_map(|id| self.take_completion(id))
            .collect())
    }
}

/// `logits`, the next row of a request, as its sampler reads it: with its penalties and
/// bias, and its stop tokens suppressed below `min_tokens` (`stop_ids`: the tokenizer's).
fn penalized_row<'a>(logits: &'a [f32], row: &RowRequest<'_>, stop_ids: &[u32]) -> Cow<'a, [f32]> {
    let p = row.params;
    if !p.has_penalties() && !row.below_min_tokens {
        return Cow::Borrowed(logits);
    }
    let mut penalized = logits.to_vec();
    apply_penalties(&mut penalized, p, row.prompt, row.output);
    if row.below_min_tokens {
        if !p.ignore_eos {
            suppress_stop_tokens(&mut penalized, stop_ids);
        }
        suppress_stop_tokens(&mut penalized, &p.stop_token_ids);
    }
    Cow::Owned(penalized)
}

/// What of a request its next row's penalties read.
struct RowRequest<'a> {
    params: &'a SamplingParams,
    prompt: &'a [u32],
    output: &'a [u32],
    below_min_tokens: bool,
}

impl<'a> RowRequest<'a> {
    fn of(req: &'a Request) -> Self {
        Self {
            params: &req.params,
            prompt: req.prompt(),
            output: req.output_ids(),
            below_min_tokens: req.below_min_tokens(),
        }
    }
}

/// The prompt logprobs of `tokens` from the step's rows `first_row..` (row `r` predicts
/// `tokens[r]`): as the model scored them where its logits are (`prompt_row_pick`), or
/// reduced here, each row whole by one of the step's threads (a 128-row chunk of a long
/// prompt on one thread would take as long as its forward).
fn prompt_logprob_rows(
    logits: &crate::runner::StepLogits,
    first_row: usize,
    tokens: &[u32],
    k: usize,
) -> Result<Vec<PromptTokenLogprob>> {
    let outside = |token: u32| {
        EngineError::InvalidRequest(RequestError::TokenOutsideVocabulary {
            token,
            vocab_size: logits.vocab,
        })
    };
    // Rows the model scored, and the others, reduced on the step's threads.
    let scored: Vec<Option<&lantern_model::RowScore>> = (0..tokens.len())
        .map(|r| logits.picked(first_row + r).and_then(|p| p.score.as_ref()))
        .collect();
    let mut on_host = Vec::new();
    for (r, &token) in tokens.iter().enumerate() {
        if scored[r].is_none() {
            on_host.push((token, logits.rows(first_row + r, 1)?));
        }
    }
    let reduced: Vec<std::sync::OnceLock<Option<PromptTokenLogprob>>> =
        on_host.iter().map(|_| std::sync::OnceLock::new()).collect();
    lantern_quant::share::run(on_host.len(), &|c| {
        let (token, row) = on_host[c];
        let _ = reduced[c].set(prompt_token_logprob(row, token, k));
    });
    let mut reduced = on_host
        .iter()
        .zip(reduced)
        .map(|(&(token, _), r)| r.into_inner().flatten().ok_or_else(|| outside(token)));
    tokens
        .iter()
        .zip(scored)
        .map(|(&token, score)| match score {
            Some(score) => Ok(PromptTokenLogprob::from(score.clone())),
            None => reduced.next().unwrap_or_else(|| Err(outside(token))),
        })
        .collect()
}
