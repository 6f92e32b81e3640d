//! Why a request is refused before any work, as a type: each error says which field it
//! concerns and what kind of fault it is. Validation ([`crate::validate`]) returns these;
//! each front end turns them into its own errors (the server into OpenAI's error shape,
//! a 400 naming the field; Python into a `ValueError` naming it).

use lantern_capture::{human_bytes, TooLarge};
use std::fmt;

/// vLLM's answer to a request for a model it does not serve.
pub fn model_not_found_message(model: &str) -> String {
    format!("The model `{model}` does not exist.")
}

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

    /// Names `field` instead of `prompt`, for errors about the prompt on an endpoint
    /// whose prompt is another field (chat's `messages`).
    pub fn for_prompt_field(mut self, field: &'static str) -> Self {
        match &mut self {
            Self::Missing(f)
            | Self::OutOfRange { field: f, .. }
            | Self::Conflict { field: f, .. }
            | Self::Invalid { field: f, .. }
            | Self::Unsupported { field: f, .. }
                if *f == "prompt" =>
            {
                *f = field
            }
            _ => {}
        }
        self
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
            Self::UnknownModel(model) => f.write_str(&model_not_found_message(model)),
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
