//! Engine errors: a request the engine refuses names the request field at fault
//! ([`RequestError`]); everything else is the engine's own failure.

/// Why the engine refuses a request; each names the request field it concerns.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RequestError {
    /// A sampling parameter outside its range (`expected` says the range).
    #[error("{field} must be {expected}, got {got}")]
    OutOfRange {
        field: &'static str,
        expected: &'static str,
        got: String,
    },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("token id {token} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutsideVocabulary { token: u32, vocab_size: usize },
    #[error("the prompt has {tokens} tokens; the model's context is {context} tokens")]
    PromptTooLong { tokens: usize, context: usize },
    #[error("a request of up to {tokens} tokens can never fit the KV cache ({blocks} blocks of {block_size} tokens)")]
    NeverFitsKvCache {
        tokens: usize,
        blocks: usize,
        block_size: usize,
    },
    #[error("{}", lantern_model::prompt::NO_CHAT_TEMPLATE)]
    NoChatTemplate,
}

impl RequestError {
    /// The request field at fault; `prompt` stands for the prompt whichever field holds
    /// it (`messages` on chat).
    pub fn field(&self) -> &'static str {
        match self {
            RequestError::OutOfRange { field, .. } => field,
            RequestError::EmptyPrompt
            | RequestError::TokenOutsideVocabulary { .. }
            | RequestError::PromptTooLong { .. }
            | RequestError::NeverFitsKvCache { .. } => "prompt",
            RequestError::NoChatTemplate => "messages",
        }
    }
}

impl From<RequestError> for EngineError {
    fn from(e: RequestError) -> Self {
        EngineError::InvalidRequest(e)
    }
}

/// What can go wrong while accepting or running requests.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request error is this error's message, not its source, so that an error
    /// chain printed whole (`{:#}`) names it once.
    #[error("invalid request: {0}")]
    InvalidRequest(RequestError),
    #[error("invalid engine configuration: {0}")]
    InvalidConfig(String),
    /// The device asked for cannot be used (no driver or library, a build without it).
    #[error("device {device}: {message}")]
    Device { device: String, message: String },
    #[error("the scheduler cannot make progress: {waiting} requests wait with {free_blocks} free blocks")]
    Stalled { waiting: usize, free_blocks: usize },
    #[error(transparent)]
    ChatPrompt(Box<lantern_model::prompt::ChatPromptError>),
    #[error(transparent)]
    Model(#[from] lantern_model::ModelError),
    #[error(transparent)]
    Attention(#[from] lantern_attn::AttnError),
    #[error(transparent)]
    Capture(#[from] lantern_capture::CaptureError),
    #[error(transparent)]
    KvCache(#[from] lantern_kv::KvError),
    /// A request the scheduler planned is not in the engine (a book-keeping fault).
    #[error("request {0} was scheduled but is not in the engine")]
    LostRequest(lantern_kv::RequestId),
    /// The plan for a request reaches past its tokens (a book-keeping fault).
    #[error("the step's plan for request {0} reaches past its tokens")]
    PlanPastTokens(lantern_kv::RequestId),
    /// A step returned fewer logits rows than its plan needs.
    #[error("the step computed {rows} logits rows; rows {first}..{first}+{count} were needed")]
    MissingLogits {
        first: usize,
        count: usize,
        rows: usize,
    },
}

impl EngineError {
    /// Whether the request is at fault (a 4xx), not the engine (a 5xx).
    pub fn is_client_fault(&self) -> bool {
        use lantern_capture::CaptureError;
        use lantern_model::prompt::ChatPromptError;
        match self {
            EngineError::InvalidRequest(_) => true,
            EngineError::Capture(e) => matches!(
                e,
                CaptureError::InvalidField { .. } | CaptureError::TooLarge { .. }
            ),
            EngineError::ChatPrompt(e) => !matches!(**e, ChatPromptError::Tokenizer(_)),
            _ => false,
        }
    }

    /// The request field a client fault concerns (see [`RequestError::field`]).
    pub fn field(&self) -> Option<&'static str> {
        use lantern_capture::CaptureError;
        match self {
            EngineError::InvalidRequest(e) => Some(e.field()),
            EngineError::Capture(CaptureError::InvalidField { field, .. }) => Some(field),
            EngineError::Capture(CaptureError::TooLarge { .. }) => Some("attn_capture"),
            EngineError::ChatPrompt(_) => Some("messages"),
            _ => None,
        }
    }

    /// The message for a client: a refused request's reason without the prefix.
    pub fn client_message(&self) -> String {
        match self {
            EngineError::InvalidRequest(e) => e.to_string(),
            other => other.to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, EngineError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invalid_request_names_its_reason_once() {
        let e = EngineError::from(RequestError::EmptyPrompt);
        assert_eq!(e.to_string(), "invalid request: the prompt is empty");
        // Printers of the whole chain (anyhow's `{:#}`) add each source's message.
        assert!(std::error::Error::source(&e).is_none());
    }
}
