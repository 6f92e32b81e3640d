//! Errors of attention capture.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum CaptureError {
    /// A request field is malformed or out of range; names the field.
    #[error("{field}: {message}")]
    InvalidField {
        field: &'static str,
        message: String,
    },
    /// The capture would hold more than allowed (its admission figure,
    /// [`crate::CaptureSpec::admission_bytes`], in parts).
    #[error("{0}")]
    TooLarge(Box<crate::spec::TooLarge>),
    /// A capture file or message could not be decoded.
    #[error("malformed capture: {0}")]
    Malformed(String),
    /// The buffered data does not cover what finalization needs.
    #[error("capture is incomplete: {0}")]
    Incomplete(String),
    #[error(transparent)]
    Attn(#[from] lantern_attn::AttnError),
}

/// Why a request's capture was not delivered (its generated text still was). Carries
/// messages rather than sources so that it can be cloned along with the request's end.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CaptureFailure {
    /// The keys could not be copied out of the KV cache when the request finished.
    #[error("could not copy the captured keys out of the KV cache: {0}")]
    Snapshot(String),
    /// The maps could not be computed from the copied keys and buffered queries.
    #[error("could not compute the attention maps: {0}")]
    Finalize(String),
    #[error("could not encode the capture: {0}")]
    Encode(String),
    /// The store of captures delivered by reference or file is full.
    #[error("{0}")]
    StoreFull(String),
    #[error("the server has no capture directory")]
    NoDirectory,
    #[error("could not write the capture file: {0}")]
    WriteFile(String),
    #[error(transparent)]
    Worker(#[from] crate::worker::SubmitError),
    /// The worker ended before answering.
    #[error("the capture worker stopped")]
    WorkerStopped,
    /// Finalizing panicked; the worker contained it.
    #[error("an internal fault occurred while finalizing this capture (a panic on the capture worker); the generated text is unaffected; see the server log")]
    Panicked,
}
