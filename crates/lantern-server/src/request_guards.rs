//! Checks every request passes before a handler sees it: CORS (off unless origins are
//! allowed), `415` for POST bodies that are not JSON, and a time limit on reading a body.
//!
//! Why `415`: a browser sends a "simple" cross-origin POST (`text/plain`, form types, or
//! no content type) without asking the server first, so with no API key any web page
//! could make a visitor's browser run requests on a server at `127.0.0.1`. A JSON body
//! needs a CORS preflight, which this server answers only for the origins it is told to
//! allow.

use crate::error::ApiError;
use crate::invalid_request::InvalidRequest;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Duration;

/// Default: a client has this long to send a whole request body.
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// What the guards need to know.
#[derive(Debug, Clone)]
pub struct GuardSettings {
    pub max_body_bytes: usize,
    pub body_read_timeout: Duration,
    /// Origins allowed to call the API from a browser (`*` for any); empty: CORS off.
    pub allowed_origins: Vec<String>,
}

/// Whether a `Content-Type` value is JSON (`application/json`, `application/*+json`,
/// parameters such as `charset` allowed).
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || essence
            .strip_prefix("application/")
            .is_some_and(|sub| sub.ends_with("+json"))
}

/// Refuses a POST whose body is not declared JSON, then reads the body within the time
/// limit (and the size limit), so handlers never wait on a slow client.
pub async fn json_body_in_time(
    State(settings): State<Arc<GuardSettings>>,
    request: Request,
    next: Next,
) -> Response {
    // `POST /ping` is a health check, with no body to read.
    if request.method() != Method::POST || request.uri().path() == "/ping" {
        return next.run(request).await;
    }
    let content_type = request
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok());
    match content_type {
        Some(t) if is_json(t) => {}
        Some(t) => {
            return unsupported_media_type(format!(
                "the body must be JSON (Content-Type: application/json), not `{t}`"
            ))
        }
        None => {
            return unsupported_media_type(
                "the body must be JSON; send `Content-Type: application/json`".to_string(),
            )
        }
    }
    let (parts, body) = request.into_parts();
    let read = axum::body::to_bytes(body, settings.max_body_bytes);
    let bytes = match tokio::time::timeout(settings.body_read_timeout, read).await {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(e)) => {
            let too_large = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            return if too_large {
                ApiError::with_status(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    format!(
                        "the request body is too large (the limit is {} bytes)",
                        settings.max_body_bytes
                    ),
                )
                .into_response()
            } else {
                ApiError::from(InvalidRequest::Body(format!(
                    "could not read the request body: {e}"
                )))
                .into_response()
            };
        }
        Err(_) => {
            return ApiError::with_status(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s",
                    settings.body_read_timeout.as_secs_f64()
                ),
            )
            .into_response()
        }
    };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

fn unsupported_media_type(message: String) -> Response {
    ApiError::with_status(StatusCode::UNSUPPORTED_MEDIA_TYPE, message).into_response()
}

/// The request's `Origin` when it is one of the allowed ones.
fn allowed_origin(settings: &GuardSettings, request: &Request) -> Option<HeaderValue> {
    let origin = request.headers().get(header::ORIGIN)?;
    let text = origin.to_str().ok()?;
    settings
        .allowed_origins
        .iter()
        .any(|o| o == "*" || o.eq_ignore_ascii_case(text))
        .then(|| origin.clone())
}

/// CORS for the allowed origins only: preflights from them are answered, their
/// responses carry `Access-Control-Allow-Origin`. Other origins get no CORS header at all
/// (so a browser keeps the response from the page), and their preflights a `403`.
pub async fn cors(
    State(settings): State<Arc<GuardSettings>>,
    request: Request,
    next: Next,
) -> Response {
    let origin = allowed_origin(&settings, &request);
    let preflight = request.method() == Method::OPTIONS
        && request
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        let Some(origin) = origin else {
            return ApiError::with_status(
                StatusCode::FORBIDDEN,
                "cross-origin requests from this origin are not allowed (see --allowed-origins)",
            )
            .into_response();
        };
        let mut response = StatusCode::NO_CONTENT.into_response();
        let headers = response.headers_mut();
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, DELETE, OPTIONS"),
        );
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_HEADERS,
            HeaderValue::from_static("authorization, content-type"),
        );
        headers.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        headers.insert(header::VARY, HeaderValue::from_static("Origin"));
        return response;
    }
    let mut response = next.run(request).await;
    if let Some(origin) = origin {
        let headers = response.headers_mut();
        headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        headers.append(header::VARY, HeaderValue::from_static("Origin"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_content_types() {
        for yes in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/merge-patch+json",
        ] {
            assert!(is_json(yes), "{yes}");
        }
        for no in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "",
            "application/jsonp",
        ] {
            assert!(!is_json(no), "{no}");
        }
    }
}
