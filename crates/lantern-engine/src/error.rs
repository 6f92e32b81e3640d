//! Engine errors.

/// What can go wrong while accepting or running requests.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("invalid engine configuration: {0}")]
    InvalidConfig(String),
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
}

pub type Result<T> = std::result::Result<T, EngineError>;
