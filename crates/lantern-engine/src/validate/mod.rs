//! Requests validated once into one typed value: a body with OpenAI's and vLLM's field
//! names (a JSON object, as the HTTP server receives it and as the Python module builds
//! it from `SamplingParams`) becomes a [`GenerationRequest`] — sampling, stops, logprobs,
//! structured output, tools, the capture and its delivery — or an [`InvalidRequest`]
//! naming the field at fault. Front ends read nothing from the body afterwards.

pub mod body;
pub mod capture;
pub mod invalid;
pub mod responses;
pub mod structured;
pub mod tools;

pub use body::{
    chat_messages, chat_request, checked_request_id, completion_request, detokenize_request,
    generation_request, parse_body, tokenize_request, Endpoint, GenerationRequest, ModelLimits,
    RequestContext, StreamOptions, TokenizeRequest, MAX_CHAT_TEMPLATE_KWARGS_BYTES,
    MAX_SEQUENCES_PER_REQUEST,
};
pub use capture::{CaptureRequest, CaptureSettings, Delivery};
pub use invalid::{model_not_found_message, InvalidRequest};
pub use responses::{previous_response_id, responses_request, ResponsesEcho, ResponsesRequest};

/// An [`InvalidRequest`] as a client sees it, for tests: the field it names, its message,
/// and its kind as the status and code the server answers with.
#[cfg(test)]
#[derive(Debug)]
pub(crate) struct Seen {
    pub param: Option<String>,
    pub message: String,
    pub status: u16,
    pub code: Option<&'static str>,
}

#[cfg(test)]
impl From<InvalidRequest> for Seen {
    fn from(e: InvalidRequest) -> Self {
        let (status, code) = match &e {
            InvalidRequest::UnknownModel(_) => (404, Some("model_not_found")),
            InvalidRequest::Unsupported { .. } => (400, Some("unsupported_parameter")),
            InvalidRequest::CaptureTooLarge(_) | InvalidRequest::CaptureOverStore { .. } => {
                (400, Some("capture_too_large"))
            }
            _ => (400, None),
        };
        Self {
            param: e.field().map(str::to_string),
            message: e.to_string(),
            status,
            code,
        }
    }
}
