//! The port opens before the model has loaded, so that orchestrators see a live
//! process and clients get an answer rather than a refused connection. Until the
//! server's routes are ready, `/health` answers 503 (as llama-server does while
//! loading), `/version` answers, and every other path gets a 503 JSON error with
//! `Retry-After`; then every request goes to the routes.

use crate::error::ApiError;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Json, Router};
use hyper::service::Service as _;
use hyper_util::service::TowerToHyperService;
use serde_json::json;
use std::sync::{Arc, OnceLock};

/// Where the routes go once the model is loaded.
pub type ReadyRoutes = Arc<OnceLock<Router>>;

/// A router that answers as loading until `ready` holds the server's routes, then
/// passes every request to them.
pub fn gate(ready: ReadyRoutes) -> Router {
    Router::new().fallback(move |request: Request| {
        let ready = ready.clone();
        async move {
            match ready.get() {
                Some(routes) => {
                    match TowerToHyperService::new(routes.clone()).call(request).await {
                        Ok(response) => response,
                        Err(never) => match never {},
                    }
                }
                None => loading_response(request.uri().path()),
            }
        }
    })
}

fn loading_response(path: &str) -> Response {
    match path {
        "/health" => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response(),
        "/version" => crate::version_json().into_response(),
        _ => ApiError {
            code: Some("model_loading"),
            ..ApiError::with_status(
                StatusCode::SERVICE_UNAVAILABLE,
                "the model is still loading; retry once GET /health answers 200",
            )
        }
        .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::routing::get;

    async fn call(router: &Router, path: &str) -> (StatusCode, serde_json::Value) {
        let request = Request::builder().uri(path).body(Body::empty()).unwrap();
        let response = TowerToHyperService::new(router.clone())
            .call(request)
            .await
            .unwrap_or_else(|never| match never {});
        let status = response.status();
        let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
            .await
            .unwrap();
        (status, serde_json::from_slice(&bytes).unwrap_or_default())
    }

    #[test]
    fn answers_as_loading_until_the_routes_are_ready() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(async {
            let ready: ReadyRoutes = Arc::new(OnceLock::new());
            let gate = gate(ready.clone());
            let (status, body) = call(&gate, "/health").await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(body, json!({"status": "loading"}));
            let (status, body) = call(&gate, "/v1/models").await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
            assert_eq!(body["error"]["code"], "model_loading");
            let (status, body) = call(&gate, "/version").await;
            assert_eq!(status, StatusCode::OK);
            assert!(body["version"].is_string());
            let routes = Router::new().route("/health", get(|| async { Json(json!({"up": 1})) }));
            assert!(ready.set(routes).is_ok());
            let (status, body) = call(&gate, "/health").await;
            assert_eq!(status, StatusCode::OK);
            assert_eq!(body, json!({"up": 1}));
        });
    }
}
