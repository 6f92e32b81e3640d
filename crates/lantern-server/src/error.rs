//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use lantern_engine::serving::ServeError;
use lantern_engine::EngineError;
use serde_json::json;

/// An error answered to a client.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, ...
    pub kind: &'static str,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

pub use lantern_engine::validate::model_not_found_message;

impl ApiError {
    /// A 400 naming the field at fault.
    pub fn invalid(param: impl Into<Option<String>>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into(),
            code: None,
        }
    }

    /// A 400 about `field`.
    pub fn field(field: &str, message: impl Into<String>) -> Self {
        Self::invalid(Some(field.to_string()), message)
    }

    /// A 400 for a feature lantern does not offer yet.
    pub fn unsupported(field: &str, what: &str) -> Self {
        Self {
            code: Some("unsupported_parameter"),
            ..Self::field(field, format!("{what} is not supported yet"))
        }
    }

    /// A 404 for a model the server does not serve, worded as vLLM's.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: model_not_found_message(model),
            kind: "invalid_request_error",
            param: Some("model".to_string()),
            code: Some("model_not_found"),
        }
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: message.into(),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    pub fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind: if status.is_server_error() {
                "server_error"
            } else {
                "invalid_request_error"
            },
            param: None,
            code: None,
        }
    }

    /// The engine thread is gone (the server is shutting down).
    pub fn unavailable() -> Self {
        Self::with_status(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine is not running (the server is shutting down)",
        )
    }

    /// The engine thread ended after a panic it could not restart from: nothing will
    /// run until the server is restarted.
    pub fn engine_stopped() -> Self {
        Self {
            code: Some("engine_stopped"),
            ..Self::with_status(
                StatusCode::SERVICE_UNAVAILABLE,
                "the engine stopped after an internal fault it could not recover from (see the server log); restart the server",
            )
        }
    }

    /// A panic on the engine thread ended this request; the engine restarted, or
    /// stopped for good when that failed too.
    pub fn engine_fault(restarted: bool) -> Self {
        use lantern_engine::serving::{ENGINE_FAULT_MESSAGE, ENGINE_FAULT_STOPPED_MESSAGE};
        let message = if restarted {
            ENGINE_FAULT_MESSAGE
        } else {
            ENGINE_FAULT_STOPPED_MESSAGE
        };
        Self {
            code: Some("engine_fault"),
            ..Self::internal(message)
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::with_status(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// Names `field` instead of `prompt`, for errors about the prompt on an endpoint
    /// whose prompt is another field (chat's `messages`).
    pub fn for_prompt_field(mut self, field: &str) -> Self {
        if self.param.as_deref() == Some("prompt") {
            self.param = Some(field.to_string());
        }
        self
    }

    /// The JSON body, also sent as an SSE event when a stream fails midway.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

impl std::error::Error for ApiError {}

/// A request the engine refused is a 400 naming the field at fault; the engine's own
/// failures are 500s.
impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        if e.is_client_fault() {
            Self::invalid(e.field().map(str::to_string), e.client_message())
        } else {
            Self {
                code: Some("engine_error"),
                ..Self::internal(format!("the engine failed: {e}"))
            }
        }
    }
}

/// The engine API's errors as HTTP answers: a request at fault is a 400 naming its field
/// (a 404 for an unknown model), a full queue a 429, an engine that does not run a 503,
/// the engine's own failures 500s.
impl From<ServeError> for ApiError {
    fn from(e: ServeError) -> Self {
        match e {
            ServeError::Invalid(invalid) => invalid.into(),
            ServeError::TooManyWaiting { .. } => Self {
                code: Some("too_many_waiting_requests"),
                ..Self::with_status(StatusCode::TOO_MANY_REQUESTS, e.to_string())
            },
            ServeError::Unavailable => Self::unavailable(),
            ServeError::Stopped => Self::engine_stopped(),
            ServeError::Fault { restarted } => Self::engine_fault(restarted),
            ServeError::Engine(message) => Self {
                code: Some("engine_error"),
                ..Self::internal(format!("the engine failed: {message}"))
            },
            ServeError::Internal(message) => Self::internal(message),
        }
    }
}

/// Seconds a client is told to wait before retrying a 429 or 503.
pub const RETRY_AFTER_SECS: u64 = 1;

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from(RETRY_AFTER_SECS),
            );
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lantern_engine::RequestError;

    #[test]
    fn engine_errors_are_400s_naming_the_field_or_500s() {
        let out_of_range = EngineError::from(RequestError::OutOfRange {
            field: "temperature",
            expected: ">= 0",
            got: "-1".to_string(),
        });
        let e = ApiError::from(out_of_range);
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert_eq!(e.message, "temperature must be >= 0, got -1");

        // Prompt errors name the field that holds the prompt on the endpoint.
        let e = ApiError::from(EngineError::from(RequestError::EmptyPrompt));
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert_eq!(
            e.for_prompt_field("messages").param.as_deref(),
            Some("messages")
        );

        let capture = EngineError::Capture(
            lantern_engine::lantern_capture::CaptureError::InvalidField {
                field: "attn_capture_heads",
                message: "head 99 is out of range".to_string(),
            },
        );
        assert_eq!(
            ApiError::from(capture).param.as_deref(),
            Some("attn_capture_heads")
        );

        let stalled = ApiError::from(EngineError::Stalled {
            waiting: 1,
            free_blocks: 0,
        });
        assert_eq!(stalled.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(stalled.kind, "server_error");
        assert_eq!(stalled.code, Some("engine_error"));
        assert_eq!(stalled.param, None);
    }
}
