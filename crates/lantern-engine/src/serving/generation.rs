//! A validated generation request as the engine takes it: its prompt, its sampling,
//! its stops, its capture and structured output, one item per sequence.

use crate::reasoning::ThinkTags;
use crate::validate::InvalidRequest;
use crate::SamplingParams;
use lantern_capture::CaptureSpec;
use lantern_guided::Constraint;
use lantern_kv::RequestId;
use lantern_model::{ChatMessage, ChatRenderOptions};
use std::sync::Arc;

/// A prompt as the client gave it; a request task renders and tokenizes it.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Raw text, tokenized as is (BOS added when the model asks for it).
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
    /// A conversation, rendered through the model's chat template with these options.
    Chat(Vec<ChatMessage>, ChatRenderOptions),
}

/// One sequence to generate (one choice of a response).
#[derive(Debug, Clone)]
pub struct GenerationItem {
    /// Shared by the samples of one prompt (`n > 1`): one copy, however many samples.
    pub prompt: Arc<PromptInput>,
    /// `max_tokens` is overwritten by [`Self::max_tokens`] once the prompt's length is known.
    pub params: SamplingParams,
    /// `None`: as many as the context (and the KV cache) allow.
    pub max_tokens: Option<usize>,
    /// Whether `max_tokens` is the endpoint's default (completions' 16) rather than the
    /// request's: then it is a ceiling, lowered to what the context (and a capture's
    /// cap) leave room for, rather than a figure to refuse.
    pub max_tokens_defaulted: bool,
    /// Which field set `max_tokens`, for error messages (`max_tokens`,
    /// `max_completion_tokens` or `max_output_tokens`).
    pub max_tokens_field: &'static str,
    /// Shared by every sample of the request.
    pub stop: Arc<[String]>,
    pub include_stop_str_in_output: bool,
    /// vLLM's `add_special_tokens`: the tokenizer's BOS goes before a text prompt (a
    /// chat's, unless its template writes it). True unless the request says false.
    pub add_special_tokens: bool,
    /// vLLM's `bad_words`: tokenized with the prompt into `params.token_filter`.
    pub bad_words: Arc<[String]>,
    /// Return the prompt's text (completions' `echo`).
    pub echo: bool,
    /// Which field holds the prompt, for error messages (`prompt` or `messages`).
    pub prompt_field: &'static str,
    /// Attention capture, when the request asked for it.
    pub capture: Option<ItemCapture>,
    /// Prompt logprobs with this many alternatives per token (completions' `echo` with
    /// `logprobs`, vLLM's `prompt_logprobs`); `params.prompt_logprobs` must be set too.
    pub prompt_logprobs: Option<usize>,
    /// Structured output: the compiled grammar the output follows.
    pub constraint: Option<Constraint>,
    /// A reasoning model's parser and end tag (`--reasoning-parser`): structured output
    /// waits for its thinking to end, and [`Accepted::thinking`] says whether the
    /// output begins in it.
    pub reasoning: Option<Arc<ThinkTags>>,
    /// Whether the output begins inside the reasoning model's thinking: set when the
    /// prompt is prepared, from its end ([`ReasoningParser::thinking_after`]).
    ///
    /// [`ReasoningParser::thinking_after`]: crate::reasoning::ReasoningParser::thinking_after
    pub begins_thinking: bool,
    /// The response's id, for the request log.
    pub request_id: Option<Arc<str>>,
    /// A client's request, or a step of a beam search.
    pub origin: Origin,
    /// vLLM's `truncate_prompt_tokens`: only the end of the prompt is kept.
    pub truncate_prompt: Option<PromptTruncation>,
}

/// How a sequence came to the engine: a client's request, or a step of a beam search
/// ([`super::beam`]), which counts otherwise against the waiting queue's limit and has
/// no request-log line of its own (the search logs itself).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Request,
    /// A beam search's first step, one per prompt: it counts for the `width` sequences
    /// the search will queue at once.
    BeamStart {
        width: usize,
    },
    /// A later step: part of a search already admitted, never refused for the queue's
    /// length (that would throw its work away).
    BeamStep,
}

impl Origin {
    /// The sequences it counts for against `--max-waiting-requests`.
    pub fn waiting_weight(self) -> usize {
        match self {
            Origin::Request => 1,
            Origin::BeamStart { width } => width,
            Origin::BeamStep => 0,
        }
    }

    /// Whether the request log has a line for it when it ends.
    pub fn logged(self) -> bool {
        self == Origin::Request
    }
}

impl GenerationItem {
    /// The output is read by `tags`' reasoning parser (a server's chat): a parser that
    /// reads control tokens (harmony's markers) gets them in the output's text, whatever
    /// `skip_special_tokens` says.
    pub fn read_with(&mut self, tags: Option<Arc<ThinkTags>>) {
        if tags
            .as_ref()
            .is_some_and(|t| t.parser.reads_control_tokens())
        {
            self.params.skip_special_tokens = false;
        }
        self.reasoning = tags;
    }

    /// `max_tokens` for a prompt of `prompt_len`: the endpoint's default lowered to the
    /// room the context leaves, the request's own refused past it, and none at all as
    /// many as the context and the KV cache allow (`longest`: the longest sequence the
    /// cache could ever hold, at most `context`).
    pub fn settled_max_tokens(
        &self,
        prompt_len: usize,
        context: usize,
        longest: usize,
    ) -> Result<usize, InvalidRequest> {
        let room = context.saturating_sub(prompt_len);
        match self.max_tokens {
            Some(m) if self.max_tokens_defaulted => Ok(m.min(room).max(1)),
            Some(m) if m > room => {
                let field = self.max_tokens_field;
                Err(InvalidRequest::conflict(
                    field,
                    format!(
                        "{field} is {m}, but the prompt has {prompt_len} tokens and this model's context is {context} tokens: at most {room} tokens can be generated"
                    ),
                ))
            }
            Some(m) => Ok(m),
            None => Ok(longest.saturating_sub(prompt_len).max(1)),
        }
    }
}

/// How much of a prompt's end a request keeps (vLLM's `truncate_prompt_tokens`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptTruncation {
    /// The last `n` tokens.
    Last(usize),
    /// As many of the last tokens as leave room in the context for `max_tokens` (for
    /// one token when it is not given): vLLM's `-1`.
    ToFit,
}

impl PromptTruncation {
    /// The tokens of a prompt of `len` to drop from its start.
    pub fn cut(self, len: usize, context: usize, max_tokens: Option<usize>) -> usize {
        let keep = match self {
            PromptTruncation::Last(n) => n,
            // Room for `max_tokens` (one when not given; none for a prompt alone).
            PromptTruncation::ToFit => context.saturating_sub(max_tokens.unwrap_or(1)),
        };
        len.saturating_sub(keep.max(1))
    }
}

/// What a sequence captures, and the most bytes it may take.
#[derive(Debug, Clone)]
pub struct ItemCapture {
    pub spec: CaptureSpec,
    /// The server's cap on one capture's admission figure.
    pub max_bytes: u64,
    /// For delivery by reference or file: the capture store's whole size, which the
    /// maps can never exceed.
    pub max_stored_bytes: Option<u64>,
}

impl ItemCapture {
    /// Whether each row's span masses and top-k keys go out with its token: when the
    /// response streams and the capture asks for either.
    pub fn stream_rows(&mut self, streamed: bool) {
        let spec = &mut self.spec;
        spec.stream_rows = streamed && (!spec.spans.is_empty() || spec.top_k.is_some());
    }
}

/// A request the engine took.
#[derive(Debug, Clone)]
pub struct Accepted {
    pub id: RequestId,
    pub prompt_tokens: usize,
    /// The prompt's text, when the item asked for `echo` (shared by its samples).
    pub prompt_text: Option<Arc<str>>,
    /// Whether the output begins inside a reasoning model's thinking
    /// ([`GenerationItem::begins_thinking`]).
    pub thinking: bool,
}
