//! The engine: accepts requests, runs steps, reports what each request produced.

use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::request::{FinishReason, Request, RequestStatus};
use crate::runner::ModelRunner;
use crate::sampling::{apply_penalties, token_logprobs, SamplingParams, TokenLogprobs};
use crate::scheduler::Scheduler;
use lantern_attn::AttentionLayerSpec;
use lantern_kv::{AttentionKind, KvCacheConfig, KvCacheManager, KvCacheSpec, RequestId};
use lantern_model::{ChatMessage, LoadedModel, ModelInfo, ModelTokenizer};
use std::collections::HashMap;
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
}

/// A finished request, all of it.
#[derive(Debug, Clone)]
pub struct Completion {
    pub id: RequestId,
    pub prompt_token_ids: Vec<u32>,
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub num_cached_prompt_tokens: usize,
    /// `[prompt_len, vocab]` when the request asked for prompt logits.
    pub prompt_logits: Option<Vec<f32>>,
    /// Arrival to first token.
    pub time_to_first_token: Duration,
    /// Arrival to finish.
    pub total_time: Duration,
}

pub struct Engine {
    loaded: LoadedModel,
    config: EngineConfig,
    kv: KvCacheManager,
    scheduler: Scheduler,
    runner: ModelRunner,
    requests: HashMap<RequestId, Request>,
    next_id: RequestId,
    finished: Vec<RequestId>,
}

impl Engine {
    pub fn new(loaded: LoadedModel, config: EngineConfig) -> Result<Self> {
        let info = loaded.model.info();
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
        let kv_config = KvCacheConfig::from_memory_budget(&specs, config.kv_cache_memory)?;
        let runner = ModelRunner::new(
            &kv_config,
            info.num_layers,
            config.kv_cache_dtype,
            &config.attention_backend,
        )?;
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
            runner,
            loaded,
            config,
            requests: HashMap::new(),
            next_id: 0,
            finished: Vec::new(),
        })
    }

    pub fn model_info(&self) -> &ModelInfo {
        self.loaded.model.info()
    }

    pub fn tokenizer(&self) -> &ModelTokenizer {
        &self.loaded.tokenizer
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn attention_backend(&self) -> &'static str {
        self.runner.backend_name()
    }

    pub fn kv_cache(&self) -> &KvCacheManager {
        &self.kv
    }

    /// Renders a conversation through the model's chat template, ready for the assistant.
    pub fn apply_chat_template(&self, messages: &[ChatMessage]) -> Result<String> {
        let template = self.loaded.chat_template.as_ref().ok_or_else(|| {
            EngineError::InvalidRequest("this model has no chat template".to_string())
        })?;
        Ok(template.render(messages, true)?)
    }

    /// Queues a request; it runs from the next step on.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: SamplingParams) -> Result<RequestId> {
        params.validate().map_err(EngineError::InvalidRequest)?;
        let info = self.loaded.model.info();
        if prompt.is_empty() {
            return Err(EngineError::InvalidRequest(
                "the prompt is empty".to_string(),
            ));
        }
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                info.vocab_size
            )));
        }
        if prompt.len() >= info.context_length {
            return Err(EngineError::InvalidRequest(format!(
                "the prompt has {} tokens; the model's context is {} tokens",
                prompt.len(),
                info.context_length
            )));
        }
        let longest = (prompt.len() + params.max_tokens).min(info.context_length);
        if !self.kv.can_fit_ever(longest) {
            return Err(EngineError::InvalidRequest(format!(
                "a request of up to {longest} tokens can never fit the KV cache ({} blocks of {} tokens)",
                self.kv.num_blocks(),
                self.config.block_size
            )));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.requests.insert(id, Request::new(id, prompt, params));
        self.scheduler.add(id);
        Ok(id)
    }

    /// Cancels a request and gives its blocks back.
    pub fn abort(&mut self, id: RequestId) {
        if let Some(req) = self.requests.get_mut(&id) {
            if !req.is_finished() {
                req.status = RequestStatus::Finished(FinishReason::Abort);
                req.times.finished = Some(Instant::now());
                self.scheduler.remove(id);
                self.kv.free(id);
                self.finished.push(id);
            }
        }
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

    /// Runs one step: one forward pass over every scheduled request.
    pub fn step(&mut self) -> Result<Vec<RequestOutput>> {
        let plan = self.scheduler.schedule(&mut self.requests, &mut self.kv);
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
        let logits =
            self.runner
                .execute(self.loaded.model.as_ref(), &plan, &self.requests, &self.kv)?;
        for s in &plan.scheduled {
            let req = self
                .requests
                .get_mut(&s.id)
                .expect("scheduled requests exist");
            req.num_computed_tokens += s.num_tokens;
            self.kv
                .cache_blocks(s.id, &req.token_ids[..req.num_computed_tokens], &[])?;
        }
        let mut outputs = Vec::with_capacity(logits.requests.len());
        for rows in &logits.requests {
            let req = self
                .requests
                .get_mut(&rows.id)
                .expect("scheduled requests exist");
            let wanted = req.prompt_len * logits.vocab;
            if req.params.prompt_logits && req.prompt_logits.len() < wanted {
                req.prompt_logits
                    .extend_from_slice(logits.rows(rows.first_row, rows.num_prompt_rows));
                if rows.samples && req.prompt_logits.len() < wanted {
                    let last = rows.first_row + rows.num_prompt_rows;
                    req.prompt_logits.extend_from_slice(logits.row(last));
                }
                req.prompt_logits_complete = req.prompt_logits.len() == wanted;
            }
            if rows.samples {
                let row = logits.row(rows.first_row + rows.num_prompt_rows);
                outputs.push(self.append_token(rows.id, row)?);
            }
        }
        Ok(outputs)
    }

    fn append_token(&mut self, id: RequestId, logits: &[f32]) -> Result<RequestOutput> {
        let context_length = self.loaded.model.info().context_length;
        let req = self.requests.get_mut(&id).expect("sampled requests exist");
        let penalized;
        let logits = if req.params.has_penalties() {
            let mut row = logits.to_vec();
            let (prompt, output) = req.token_ids.split_at(req.prompt_len);
            apply_penalties(&mut row, &req.params, prompt, output);
            penalized = row;
            &penalized[..]
        } else {
            logits
        };
        let token = req.sampler.sample(logits, &req.params);
        let logprobs = req
            .params
            .logprobs
            .map(|k| token_logprobs(logits, token, k));
        req.token_ids.push(token);
        let now = Instant::now();
        req.times.first_token.get_or_insert(now);
        let tokenizer = &self.loaded.tokenizer;
        let is_stop = !req.params.ignore_eos && tokenizer.stop_ids().contains(&token)
            || req.params.stop_token_ids.contains(&token);
        let finished = if is_stop {
            Some(FinishReason::Stop)
        } else if req.num_output_tokens() >= req.params.max_tokens
            || req.token_ids.len() >= context_length
        {
            Some(FinishReason::Length)
        } else {
            None
        };
        let new_text = req
            .decoder
            .step(tokenizer, &req.token_ids[req.prompt_len..])?;
        req.text.push_str(&new_text);
        if let Some(reason) = finished {
            req.status = RequestStatus::Finished(reason);
            req.times.finished = Some(now);
            self.scheduler.remove(id);
            self.kv.free(id);
            self.finished.push(id);
        }
        Ok(RequestOutput {
            id,
            new_token_ids: vec![token],
            new_text,
            finished,
            logprobs,
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
        Some(Completion {
            id,
            prompt_token_ids: req.prompt().to_vec(),
            token_ids: req.output_ids().to_vec(),
            text: req.text,
            finish_reason,
            num_cached_prompt_tokens: req.num_cached_prompt_tokens,
            prompt_logits: req.params.prompt_logits.then_some(req.prompt_logits),
            time_to_first_token: req
                .times
                .first_token
                .unwrap_or(end)
                .duration_since(req.times.arrival),
            total_time: end.duration_since(req.times.arrival),
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
