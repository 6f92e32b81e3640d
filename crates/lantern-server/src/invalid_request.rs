//! Why a request body is refused before any work, as a type: each error says which
//! field it concerns and what kind of fault it is. Validation ([`crate::protocol`])
//! returns these; the one `From` impl below turns them into OpenAI's error shape.

use crate::error::ApiError;
use lantern_engine::lantern_capture::{human_bytes, TooLarge};
use std::fmt;

#[derive(Debug, Clone, PartialEq)]
pub enum InvalidRequest {
    /// The body is not JSON, or not an object: no one field to name.
    Body(String),
    /// A field's JSON has the wrong type; `field` is the top-level field of the path.
    WrongType {
        field: Option<String>,
        message: String,
    },
    /// The request names a model this server does not serve.
    UnknownModel(String),
    /// A required field is absent.
    Missing(&'static str),
    /// A number outside the field's range: "`field` must be `allowed`, got `got`".
    OutOfRange {
        field: &'static str,
        allowed: String,
        got: String,
    },
    /// The field cannot be combined with another field's value.
    Conflict {
        field: &'static str,
        message: String,
    },
    /// A value of the field that cannot be used, and why.
    Invalid {
        field: &'static str,
        message: String,
    },
    /// A feature lantern does not offer yet.
    Unsupported { field: &'static str, what: String },
    /// The attention capture asked for would be larger than the server's cap.
    CaptureTooLarge(Box<TooLarge>),
    /// A capture delivered by reference or file could never fit the capture store.
    CaptureOverStore {
        estimate_bytes: u64,
        store_bytes: u64,
        /// The largest `max_tokens` whose capture would fit, if any.
        fitting_max_tokens: Option<usize>,
    },
}

impl InvalidRequest {
    pub fn out_of_range(
        field: &'static str,
        allowed: impl Into<String>,
        got: impl fmt::Display,
    ) -> Self {
        Self::OutOfRange {
            field,
            allowed: allowed.into(),
            got: got.to_string(),
        }
    }

    pub fn invalid(field: &'static str, message: impl Into<String>) -> Self {
        Self::Invalid {
            field,
            message: message.into(),
        }
    }

    pub fn conflict(field: &'static str, message: impl Into<String>) -> Self {
        Self::Conflict {
            field,
            message: message.into(),
        }
    }

    pub fn unsupported(field: &'static str, what: impl Into<String>) -> Self {
        Self::Unsupported {
            field,
            what: what.into(),
        }
    }

    /// The request field the error is about.
    pub fn field(&self) -> Option<&str> {
        match self {
            Self::Body(_) => None,
            Self::WrongType { field, .. } => field.as_deref(),
            Self::UnknownModel(_) => Some("model"),
            Self::CaptureTooLarge(_) => Some("attn_capture"),
            Self::CaptureOverStore { .. } => Some("attn_capture_delivery"),
            Self::Missing(field)
            | Self::OutOfRange { field, .. }
            | Self::Conflict { field, .. }
            | Self::Invalid { field, .. }
            | Self::Unsupported { field, .. } => Some(field),
        }
    }
}

impl fmt::Display for InvalidRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Body(message)
            | Self::WrongType { message, .. }
            | Self::Conflict { message, .. }
            | Self::Invalid { message, .. } => f.write_str(message),
            Self::UnknownModel(model) => f.write_str(&crate::error::model_not_found_message(model)),
            Self::Missing(field) => write!(f, "{field} is required"),
            Self::OutOfRange {
                field,
                allowed,
                got,
            } => write!(f, "{field} must be {allowed}, got {got}"),
            Self::Unsupported { what, .. } => write!(f, "{what} is not supported yet"),
            Self::CaptureTooLarge(too_large) => too_large.fmt(f),
            Self::CaptureOverStore {
                estimate_bytes,
                store_bytes,
                fitting_max_tokens,
            } => {
                write!(
                    f,
                    "the attention capture may take up to {} ({estimate_bytes} bytes) stored, more than this server's whole capture store, {} (--max-stored-capture-bytes), so it could never be stored",
                    human_bytes(*estimate_bytes),
                    human_bytes(*store_bytes),
                )?;
                match fitting_max_tokens {
                    Some(m) => write!(f, "; it fits with max_tokens {m} or fewer, or"),
                    None => f.write_str(";"),
                }?;
                f.write_str(" ask for less (fewer layers, heads or rows, a reduction, top-k or float16) or use delivery \"inline\"")
            }
        }
    }
}

impl std::error::Error for InvalidRequest {}

/// A 400 naming the field (a 404 for an unknown model, as OpenAI answers).
impl From<InvalidRequest> for ApiError {
    fn from(error: InvalidRequest) -> Self {
        match &error {
            InvalidRequest::UnknownModel(model) => ApiError::model_not_found(model),
            InvalidRequest::Unsupported { field, what } => ApiError::unsupported(field, what),
            InvalidRequest::CaptureTooLarge(_) | InvalidRequest::CaptureOverStore { .. } => {
                ApiError {
                    code: Some("capture_too_large"),
                    ..ApiError::invalid(error.field().map(str::to_string), error.to_string())
                }
            }
            _ => ApiError::invalid(error.field().map(str::to_string), error.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    #[test]
    fn each_kind_maps_to_a_400_naming_its_field() {
        let cases = [
            (
                InvalidRequest::Body("the body must be a JSON object".into()),
                None,
                "the body must be a JSON object",
            ),
            (
                InvalidRequest::Missing("prompt"),
                Some("prompt"),
                "prompt is required",
            ),
            (
                InvalidRequest::out_of_range("top_p", "in (0, 1]", 1.5),
                Some("top_p"),
                "top_p must be in (0, 1], got 1.5",
            ),
            (
                InvalidRequest::conflict("top_logprobs", "top_logprobs needs logprobs set to true"),
                Some("top_logprobs"),
                "top_logprobs needs logprobs set to true",
            ),
        ];
        for (error, field, message) in cases {
            let api = ApiError::from(error);
            assert_eq!(api.status, StatusCode::BAD_REQUEST);
            assert_eq!(api.param.as_deref(), field);
            assert_eq!(api.message, message);
            assert_eq!(api.code, None);
        }
        let unsupported = ApiError::from(InvalidRequest::unsupported("suffix", "suffix"));
        assert_eq!(unsupported.code, Some("unsupported_parameter"));
        assert_eq!(unsupported.message, "suffix is not supported yet");
        let model = ApiError::from(InvalidRequest::UnknownModel("gpt-9".into()));
        assert_eq!(model.status, StatusCode::NOT_FOUND);
        assert_eq!(model.param.as_deref(), Some("model"));
        assert_eq!(
            model.message,
            InvalidRequest::UnknownModel("gpt-9".into()).to_string()
        );
    }
}
