//! Requests and their states.

use crate::sampling::{PromptTokenLogprob, Sampler, SamplingParams};
use lantern_capture::{CaptureFailure, PendingCapture, QueryRowBuffer};
use lantern_guided::{Constraint, TokenMask};
use lantern_kv::{BlockHash, RequestId, TokenSeq};
use lantern_model::{IncrementalDecoder, MAX_REDUCED_TOP_LOGPROBS};
use std::cell::OnceCell;
use std::sync::Arc;
use std::time::Instant;

/// Prompt positions computed per step for a request that wants a logits row for each
/// (see [`Request::num_tokens_next_step`]).
pub const MAX_PROMPT_ROWS_PER_STEP: usize = 128;

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence or stop token.
    Stop,
    /// `max_tokens` or the model's context length.
    Length,
    /// Cancelled by its client.
    Abort,
}

/// The longest prompt a context of `context_length` tokens takes: all of it when the
/// request generates nothing (`max_tokens` 0, scoring), else one token less, for the
/// first generated token.
pub fn longest_prompt(context_length: usize, max_tokens: usize) -> usize {
    match max_tokens {
        0 => context_length,
        _ => context_length.saturating_sub(1),
    }
}

impl FinishReason {
    /// The name OpenAI's API uses.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    Waiting,
    Running,
    /// Its blocks were taken back; it waits to be recomputed.
    Preempted,
    Finished(FinishReason),
}

/// Timestamps of one request.
#[derive(Debug, Clone, Copy)]
pub struct RequestTimes {
    pub arrival: Instant,
    pub first_scheduled: Option<Instant>,
    pub first_token: Option<Instant>,
    pub finished: Option<Instant>,
}

/// One generation request inside the engine.
pub struct Request {
    pub id: RequestId,
    /// Shared with the other samples of its request (`n > 1`): one copy, however many.
    prompt: Arc<[u32]>,
    /// The tokens generated so far (crate-visible so that the decoder can borrow it
    /// beside the request's other fields; append with [`Self::push_output`]).
    pub(crate) output: Vec<u32>,
    /// Tokens whose K/V are in the cache.
    pub num_computed_tokens: usize,
    pub params: SamplingParams,
    pub status: RequestStatus,
    pub sampler: Sampler,
    pub decoder: IncrementalDecoder,
    pub text: String,
    pub times: RequestTimes,
    pub num_preemptions: usize,
    pub num_cached_prompt_tokens: usize,
    /// `[prompt_len, vocab]` once complete, when the request asked for them.
    pub prompt_logits: Vec<f32>,
    /// Whether `prompt_logits` holds every prompt row (a preemption before that point
    /// recomputes the prompt from its start, so partial rows are dropped).
    pub prompt_logits_complete: bool,
    /// One entry per prompt token after the first, when the request asked for prompt
    /// logprobs; reduced row by row as the prompt is computed.
    pub prompt_logprobs: Vec<PromptTokenLogprob>,
    /// A sibling with the same prompt (`n > 1`): this request waits until the leader's
    /// prompt is in the cache, then takes its full blocks from the prefix cache, sharing
    /// them by reference count instead of computing the prompt again.
    pub prompt_leader: Option<RequestId>,
    /// The prefix-cache keys of the prompt's full blocks, hashed once when first needed.
    prompt_hashes: OnceCell<Vec<BlockHash>>,
    /// Query rows of a capturing request, filled while it runs.
    pub capture: Option<Box<QueryRowBuffer>>,
    /// A finished capturing request's capture, ready to finalize (or why it failed).
    pub pending_capture: Option<std::result::Result<PendingCapture, CaptureFailure>>,
    /// Structured output: the grammar the output follows.
    pub constraint: Option<Box<Constraint>>,
    /// The constraint's mask for the token this step samples, computed beside the forward.
    pub mask: Option<std::result::Result<TokenMask, String>>,
    /// Structured output that waits for a reasoning model's thinking to end: the grammar,
    /// which becomes `constraint` once the output ends with these token ids (the end tag).
    pub constraint_after: Option<(Box<Constraint>, Arc<[u32]>)>,
}

impl Request {
    pub fn new(id: RequestId, prompt: Arc<[u32]>, params: SamplingParams) -> Self {
        Self {
            id,
            prompt,
            output: Vec::new(),
            num_computed_tokens: 0,
            sampler: Sampler::new(params.seed),
            params,
            status: RequestStatus::Waiting,
            decoder: IncrementalDecoder::default(),
            text: String::new(),
            times: RequestTimes {
                arrival: Instant::now(),
                first_scheduled: None,
                first_token: None,
                finished: None,
            },
            num_preemptions: 0,
            num_cached_prompt_tokens: 0,
            prompt_logits: Vec::new(),
            prompt_logits_complete: false,
            prompt_logprobs: Vec::new(),
            prompt_leader: None,
            prompt_hashes: OnceCell::new(),
            capture: None,
            pending_capture: None,
            constraint: None,
            mask: None,
            constraint_after: None,
        }
    }

    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// The prompt, as shared with the request's other samples.
    pub fn shared_prompt(&self) -> &Arc<[u32]> {
        &self.prompt
    }

    pub fn prompt_len(&self) -> usize {
        self.prompt.len()
    }

    pub fn output_ids(&self) -> &[u32] {
        &self.output
    }

    pub fn num_output_tokens(&self) -> usize {
        self.output.len()
    }

    /// Prompt and output tokens.
    pub fn num_tokens(&self) -> usize {
        self.prompt.len() + self.output.len()
    }

    /// The prompt followed by the output, as one sequence.
    pub fn token_seq(&self) -> TokenSeq<'_> {
        TokenSeq::new(&self.prompt, &self.output)
    }

    /// The token at `position` of prompt-then-output.
    pub fn token(&self, position: usize) -> Option<u32> {
        match position.checked_sub(self.prompt.len()) {
            None => self.prompt.get(position).copied(),
            Some(i) => self.output.get(i).copied(),
        }
    }

    /// Appends a sampled token.
    pub fn push_output(&mut self, token: u32) {
        self.output.push(token);
    }

    /// Tokens still to compute before the next token can be sampled.
    pub fn num_pending_tokens(&self) -> usize {
        self.num_tokens().saturating_sub(self.num_computed_tokens)
    }

    /// The most tokens the next step may compute for this request: all pending ones,
    /// except that a request that wants a logits row per prompt position computes its
    /// prompt [`MAX_PROMPT_ROWS_PER_STEP`] positions at a time, so that a step's logits
    /// stay that many rows × vocabulary, however long the prompt.
    pub fn num_tokens_next_step(&self) -> usize {
        let pending = self.num_pending_tokens();
        if self.wants_prompt_rows() && self.num_computed_tokens < self.prompt_len() {
            pending.min(MAX_PROMPT_ROWS_PER_STEP)
        } else {
            pending
        }
    }

    /// Whether every position must be computed by this request itself (prompt logits
    /// or attention capture), so a prefix-cache hit cannot stand in for it.
    pub fn computes_every_position(&self) -> bool {
        self.wants_prompt_rows() || self.capture.is_some()
    }

    /// The prefix-cache keys of the prompt's full blocks of `block_size` tokens, with
    /// its [`Self::cache_keys`] as the scheduler's lookups.
    pub fn prompt_block_hashes(&self, block_size: usize) -> &[BlockHash] {
        self.prompt_hashes.get_or_init(|| {
            lantern_kv::hash_request_blocks(&self.prompt, block_size, self.cache_keys())
        })
    }

    /// The extra bytes of its blocks' prefix-cache keys: its cache salt (none without).
    pub fn cache_keys(&self) -> &[u8] {
        self.params.cache_salt.as_deref().map_or(&[], str::as_bytes)
    }

    /// Whether the prompt positions it computes itself serve only its prompt logprobs
    /// (no prompt logits, no capture): a prefix-cache hit can stand in for them when
    /// the hit's prompt logprobs are kept ([`crate::scored_prefix`]).
    pub fn scores_prompt_only(&self) -> bool {
        self.params.prompt_logprobs.is_some()
            && !self.params.prompt_logits
            && self.capture.is_none()
    }

    /// Whether the next logits row can be reduced where the model's logits are: its
    /// token read from the row alone (see [`Self::reads_row_alone`]), with at most
    /// [`MAX_REDUCED_TOP_LOGPROBS`] alternatives (penalties are edits there:
    /// `sampling::logit_edits`).
    pub fn reduces_row(&self) -> bool {
        self.reads_row_alone()
            && self
                .params
                .logprobs
                .is_none_or(|k| k <= MAX_REDUCED_TOP_LOGPROBS)
    }

    /// Whether its next token and logprobs come from the next logits row, its own tokens
    /// and its parameters alone (penalties included): no structured output (whose mask
    /// the engine computes) nor token filter (a mask too), no prompt logits (which keep
    /// the row). The step's threads
    /// reduce such a row left on the host (`Engine::tokens_on_threads`), as
    /// `Engine::append_token` would.
    pub fn reads_row_alone(&self) -> bool {
        self.constraint.is_none()
            && self.params.token_filter.is_empty()
            && !self.params.prompt_logits
    }

    /// Whether its next token's row is still below `min_tokens` (its stop tokens are
    /// suppressed).
    pub fn below_min_tokens(&self) -> bool {
        self.num_output_tokens() < self.params.min_tokens
    }

    /// Whether the steps must return a logits row for every prompt position.
    pub fn wants_prompt_rows(&self) -> bool {
        self.params.prompt_logits || self.params.prompt_logprobs.is_some()
    }

    /// Whether every prompt token after the first has its prompt logprob.
    pub fn prompt_logprobs_complete(&self) -> bool {
        self.prompt_logprobs.len() + 1 >= self.prompt_len()
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, RequestStatus::Finished(_))
    }
}
