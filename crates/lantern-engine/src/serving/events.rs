//! What the engine sends back for each sequence: new text and tokens, logprobs, live
//! capture rows, and how the sequence ended.

use super::prompter::PromptLogprobRows;
use crate::{FinishReason, TokenLogprobs};
use lantern_capture::{CaptureFailure, PendingCapture, RowCapture};

/// Why a sequence stopped: the stop string or stop token id that ended it.
#[derive(Debug, Clone, PartialEq)]
pub enum StopReason {
    Text(String),
    Token(u32),
}

/// Why a sequence ended.
#[derive(Debug, Clone, PartialEq)]
pub enum EndReason {
    /// An end-of-sequence or stop token, a stop string, or a complete grammar.
    Stop,
    /// `max_tokens` or the context.
    Length,
    /// Its client went away or the server shut down.
    Abort,
    /// The engine failed while running it (the client gets a 500), or its structured
    /// output's grammar did (a 400).
    Failed(EngineFailure),
}

/// How the engine failed a sequence.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineFailure {
    /// A step returned this error.
    Step(String),
    /// The request's grammar (a schema, pattern, choice list or forced tool call) failed
    /// on a sampled token: llguidance's error, e.g. a schema whose every instance is
    /// infinite outgrowing its limits.
    Guided(String),
    /// vLLM's `allowed_token_ids` and `bad_words` (with the grammar, if any) left no
    /// token to sample next; names the field.
    NoTokenLeft(&'static str),
    /// A panic on the engine thread, contained ([`super::ENGINE_FAULT_MESSAGE`]); `restarted`
    /// is false when restarting the engine failed too (the thread then ended).
    Fault { restarted: bool },
}

/// What a client is told when its grammar failed while generating.
pub fn guided_failure_message(error: &str) -> String {
    // llguidance ends some errors with a marker line of its own.
    let error = error
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && *line != "<non-verbose/>")
        .collect::<Vec<_>>()
        .join(" ");
    format!(
        "structured output failed while generating: {error} (the grammar cannot be \
         followed: a schema whose instances are all infinite, or one past the grammar \
         engine's limits; simplify the schema, pattern or tools)"
    )
}

/// What a client is told when its token filter left no token to sample.
pub fn no_token_left_message(field: &str) -> String {
    format!(
        "{field} left no token to sample next: with allowed_token_ids, bad_words (and any \
         structured output) together, every token was banned"
    )
}

impl EndReason {
    /// The name OpenAI's `finish_reason` (and vLLM's metrics) use.
    pub fn as_str(&self) -> &'static str {
        match self {
            EndReason::Stop => "stop",
            EndReason::Length => "length",
            EndReason::Abort => "abort",
            EndReason::Failed(_) => "error",
        }
    }
}

impl From<FinishReason> for EndReason {
    fn from(reason: FinishReason) -> Self {
        match reason {
            FinishReason::Stop => EndReason::Stop,
            FinishReason::Length => EndReason::Length,
            FinishReason::Abort => EndReason::Abort,
        }
    }
}

/// The end of one sequence.
#[derive(Debug, Clone)]
pub struct Finish {
    pub reason: EndReason,
    pub stop_reason: Option<StopReason>,
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    /// A capturing sequence's capture, to finalize off the engine thread.
    pub capture: Option<Result<PendingCapture, CaptureFailure>>,
}

/// The log-probability of one generated token and its most likely alternatives, with
/// each token as text (the token decoded alone, special tokens included).
#[derive(Debug, Clone)]
pub struct LogprobEntry {
    pub token_id: u32,
    /// The token decoded alone (special tokens included).
    pub token: String,
    pub logprob: f32,
    /// The most likely tokens: id, text, logprob.
    pub top: Vec<(u32, String, f32)>,
}

/// One prompt token with its log-probability given the tokens before it: the log-softmax
/// of the raw logits (no penalties, no temperature).
#[derive(Debug, Clone)]
pub struct PromptLogprobEntry {
    pub token_id: u32,
    /// The token decoded alone (special tokens included).
    pub token: String,
    /// `None` for the first prompt token: nothing predicts it.
    pub logprob: Option<f32>,
    /// 1 + how many tokens are more likely (0 for the first prompt token).
    pub rank: usize,
    /// The most likely tokens (id, text, logprob), most likely first; empty for the first.
    pub top: Vec<(u32, String, f32)>,
}

/// New output of one sequence as the engine thread sends it: logprobs still as ids and
/// logits, for the request task to turn into text ([`super::Prompter::resolve`]).
#[derive(Debug)]
pub struct EngineEvent {
    pub index: usize,
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Option<TokenLogprobs>,
    pub prompt_logprobs: Option<PromptLogprobRows>,
    /// A streamed capture's live figures of the row that sampled the new token.
    pub capture_row: Option<Box<RowCapture>>,
    pub finish: Option<Finish>,
}

/// New output of one sequence, tagged with its choice index.
#[derive(Debug, Clone)]
pub struct ChoiceEvent {
    pub index: usize,
    pub text: String,
    pub token_ids: Vec<u32>,
    /// One entry per new token, when the request asked for logprobs.
    pub logprobs: Vec<LogprobEntry>,
    /// One entry per prompt token, on the first event of a sequence that asked for them.
    pub prompt_logprobs: Option<Vec<PromptLogprobEntry>>,
    /// A streamed capture's live figures of the row that sampled the new token.
    pub capture_row: Option<Box<RowCapture>>,
    pub finish: Option<Finish>,
}
