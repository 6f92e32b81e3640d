//! Why the engine's API did not take or finish a request, as one type every front end
//! maps to its own errors: the server to HTTP statuses in OpenAI's shape, Python to
//! exceptions. A client's fault names its field ([`InvalidRequest`]); the rest say what
//! the engine could not do.

use super::health::{ENGINE_FAULT_MESSAGE, ENGINE_FAULT_STOPPED_MESSAGE};
use crate::error::EngineError;
use crate::validate::InvalidRequest;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ServeError {
    /// The request is at fault (a 400), naming its field.
    #[error(transparent)]
    Invalid(#[from] InvalidRequest),
    /// Taking the request would grow the waiting queue past the engine's limit (a 429).
    #[error("{waiting} requests are waiting to run and this one adds {new}; the limit is {limit} (--max-waiting-requests); retry later")]
    TooManyWaiting {
        waiting: usize,
        new: usize,
        limit: usize,
    },
    /// The engine thread is not running: it is shutting down.
    #[error("the engine is not running (it is shutting down)")]
    Unavailable,
    /// The engine thread ended after a panic it could not restart from.
    #[error("the engine stopped after an internal fault it could not recover from; restart it")]
    Stopped,
    /// A panic on the engine thread ended this request; the engine restarted, or stopped
    /// for good when that failed too.
    #[error("{}", if *restarted { ENGINE_FAULT_MESSAGE } else { ENGINE_FAULT_STOPPED_MESSAGE })]
    Fault { restarted: bool },
    /// The engine refused or failed the request for a reason of its own (a 500).
    #[error("the engine failed: {0}")]
    Engine(String),
    /// Work around the engine failed (a task that ended abnormally).
    #[error("{0}")]
    Internal(String),
}

impl ServeError {
    /// Names `field` instead of `prompt` (see [`InvalidRequest::for_prompt_field`]).
    pub fn for_prompt_field(self, field: &'static str) -> Self {
        match self {
            Self::Invalid(e) => Self::Invalid(e.for_prompt_field(field)),
            other => other,
        }
    }
}

/// A request the engine refused names the field at fault; the engine's own failures are
/// [`ServeError::Engine`].
impl From<EngineError> for ServeError {
    fn from(e: EngineError) -> Self {
        if e.is_client_fault() {
            Self::Invalid(InvalidRequest::invalid(
                e.field().unwrap_or("prompt"),
                e.client_message(),
            ))
        } else {
            Self::Engine(e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RequestError;

    #[test]
    fn engine_errors_name_the_field_or_are_the_engines() {
        let out_of_range = EngineError::from(RequestError::OutOfRange {
            field: "temperature",
            expected: ">= 0",
            got: "-1".to_string(),
        });
        let e = ServeError::from(out_of_range);
        assert_eq!(
            e,
            ServeError::Invalid(InvalidRequest::invalid(
                "temperature",
                "temperature must be >= 0, got -1"
            ))
        );

        // Prompt errors name the field that holds the prompt on the endpoint.
        let e = ServeError::from(EngineError::from(RequestError::EmptyPrompt));
        let ServeError::Invalid(prompt) = e.clone() else {
            panic!("{e:?}")
        };
        assert_eq!(prompt.field(), Some("prompt"));
        let ServeError::Invalid(messages) = e.for_prompt_field("messages") else {
            panic!("not invalid")
        };
        assert_eq!(messages.field(), Some("messages"));

        let capture = EngineError::Capture(lantern_capture::CaptureError::InvalidField {
            field: "attn_capture_heads",
            message: "head 99 is out of range".to_string(),
        });
        let ServeError::Invalid(capture) = ServeError::from(capture) else {
            panic!("not invalid")
        };
        assert_eq!(capture.field(), Some("attn_capture_heads"));

        let stalled = ServeError::from(EngineError::Stalled {
            waiting: 1,
            free_blocks: 0,
        });
        assert!(matches!(stalled, ServeError::Engine(_)), "{stalled:?}");
    }
}
