//! lantern-capture: exact per-request attention capture.
//!
//! - [`spec`]: what a request asked for (layers, heads, rows, reduction, top-k, dtype)
//!   and the size of the result, known before any work starts.
//! - [`buffer`]: the per-request buffer of query rows, filled by contiguous ranges while
//!   the request runs (chunked prefill and decode alike).
//! - [`stats`]: key statistics (each key's mass, its maximum, the mass per KV cache
//!   block) accumulated row by row from the same probabilities.
//! - [`spans`]: labelled spans of the prompt (character ranges resolved to tokens) and
//!   the attention mass each row gives each of them.
//! - [`finalize`]: the attention probabilities from the buffered queries and the keys
//!   read back from the paged KV cache through its layout, with the layer's own
//!   description (scale, masks, soft-cap, sinks, GQA mapping).
//! - [`result`]: the finished capture and its token metadata.
//! - [`worker`]: the low-priority thread that finalizes captures off the step loop.
//! - [`wire`]: JSON (gzip+base64 per layer) and safetensors encodings, both ways.
//! - [`view`]: the HTML viewer page, with a capture inside or fetching one.

pub mod buffer;
pub mod error;
pub mod finalize;
pub mod live;
mod pages;
pub mod result;
pub mod spans;
pub mod spec;
pub mod stats;
pub mod view;
pub mod wire;
pub mod worker;

pub use buffer::{QueryRowBuffer, StepTap};
pub use error::{CaptureError, CaptureFailure};
pub use finalize::{
    keys_needed, map_on_backend, snapshot_layer, KeySnapshot, PendingCapture, LAST_TOKEN_ABSENT,
};
pub use live::{row_capture, row_capture_from_sums, RowCapture, RowLayer, TopKeys};
pub use result::{AbsentRow, CaptureMeta, CaptureResult, LayerAttentionInfo, LayerMap, TokenInfo};
pub use spans::{
    resolve_spans, CaptureSpan, LayerSpanMass, PromptText, SpanAt, SpanInfo, SpanText, MAX_SPANS,
};
pub use spec::{
    human_bytes, largest_fitting, AdmissionParts, CaptureDtype, CaptureGeometry, CaptureSpec,
    HeadReduce, RowSelection, TooLarge, TOKEN_META_BYTES,
};
pub use stats::{KeyStat, LayerStat, StatHeads};
pub use worker::{CaptureWorker, Pacer, SubmitError, BUSY_DUTY_CYCLE, DEFAULT_MAX_QUEUED_CAPTURES};
