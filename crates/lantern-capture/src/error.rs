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
    /// The capture would be larger than allowed.
    #[error("the attention capture would take about {estimate_bytes} bytes, over the limit of {limit_bytes} bytes; ask for fewer layers, heads or rows, a reduction, top-k or float16")]
    TooLarge {
        estimate_bytes: u64,
        limit_bytes: u64,
    },
    /// A capture file or message could not be decoded.
    #[error("malformed capture: {0}")]
    Malformed(String),
    /// The buffered data does not cover what finalization needs.
    #[error("capture is incomplete: {0}")]
    Incomplete(String),
    #[error(transparent)]
    Attn(#[from] lantern_attn::AttnError),
}
