//! Requests refused before any work ([`InvalidRequest`], from the engine's validation) as
//! OpenAI's error shape.

use crate::error::ApiError;
pub use lantern_engine::validate::InvalidRequest;

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
