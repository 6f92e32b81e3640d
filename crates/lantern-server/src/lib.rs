//! lantern's OpenAI-compatible HTTP server (axum + tokio).
//!
//! A thin adapter over the engine's API (`lantern_engine::serving`): the engine runs on
//! its own thread ([`EngineHandle`]); the HTTP handlers read a body, have the engine's
//! validation turn it into one typed request (`lantern_engine::validate`), submit it
//! through the handle and turn the engine's events into OpenAI responses, whole or
//! streamed as server-sent events.
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses`
//! (OpenAI's Responses API, run as a chat), `GET /v1/models`,
//! `GET /v1/models/{model}`, `POST /tokenize` and `POST /detokenize` (vLLM's), `GET /health`,
//! `GET /version`,
//! `GET /metrics` (OpenMetrics text, written by prometheus-client, under vLLM's metric
//! names, `vllm:*`; lantern's own metrics are `lantern:*`). With an API key, `/v1/*` and
//! the tokenizer endpoints want
//! `Authorization: Bearer KEY`; `/health` and `/metrics` stay open (`/health` shows an
//! engine fault's message only with the key).

pub mod capture;
pub mod connections;
pub mod error;
pub mod invalid_request;
pub mod loading;
pub mod metrics;
mod openai;
pub mod request_guards;
pub mod response_store;
mod responses;
pub mod tool_stream;

pub use capture::{CaptureSettings, CaptureStore};
pub use connections::{serve_with_limits, ConnectionLimits};
pub use error::ApiError;
pub use lantern_engine::reasoning::ReasoningParser;
use lantern_engine::reasoning::ThinkTags;
pub use lantern_engine::serving::{
    EngineBuildPanicked, EngineHandle, EngineHealth, EngineLogging, EngineThread, GenerationItem,
    ModelMeta, PromptInput,
};

use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;
use std::future::Future;
use std::sync::Arc;

/// Default limit on a request body.
pub const DEFAULT_MAX_BODY_BYTES: usize = 16 << 20;

/// How the server answers.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// When not empty, `/v1/*` requires `Authorization: Bearer KEY` with one of these.
    /// Each key is its own client: a stored capture can be read only with the key
    /// that made it.
    pub api_keys: Vec<String>,
    /// The names clients may send as `model`; the first is the one responses and
    /// metrics report (empty: the model's own name).
    pub served_model_names: Vec<String>,
    /// The model's `root` on `/v1/models`, as vLLM's: the model as it was given (a
    /// path). Default: the model's own name.
    pub model_root: Option<String>,
    /// Larger bodies are refused with 413.
    pub max_body_bytes: usize,
    /// Attention capture: off unless enabled.
    pub capture: CaptureSettings,
    /// A POST body must arrive within this time (else `408`).
    pub body_read_timeout: std::time::Duration,
    /// Origins a browser may call the API from (`*`: any); empty: no CORS at all.
    pub allowed_origins: Vec<String>,
    /// Header read timeout and connection limit (applied by [`serve_with_limits`]).
    pub connections: ConnectionLimits,
    /// Bytes the Responses API's kept responses may take (the oldest go first).
    pub max_stored_response_bytes: usize,
    /// vLLM's `--reasoning-parser`: a chat output's thinking becomes its message's
    /// `reasoning`, and structured output applies to the answer after it. Without one,
    /// a vocabulary with harmony's markers implies `openai_gptoss` ([`router`]).
    pub reasoning_parser: Option<ReasoningParser>,
    /// vLLM's `--seed`: requests that give no seed get one from this seed's sequence.
    pub seed: Option<u64>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            api_keys: Vec::new(),
            served_model_names: Vec::new(),
            model_root: None,
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            capture: CaptureSettings::default(),
            body_read_timeout: request_guards::DEFAULT_BODY_READ_TIMEOUT,
            allowed_origins: Vec::new(),
            connections: ConnectionLimits::default(),
            max_stored_response_bytes: response_store::DEFAULT_RESPONSE_STORE_BYTES,
            reasoning_parser: None,
            seed: None,
        }
    }
}

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    /// The first of [`Self::served_model_names`]: the name responses report.
    pub served_model_name: Arc<str>,
    /// Every name a request may give as `model`.
    pub served_model_names: Arc<[String]>,
    models: Arc<ModelCards>,
    api_keys: Arc<[String]>,
    pub capture: Arc<CaptureSettings>,
    pub captures: Arc<CaptureStore>,
    pub capture_worker: Arc<lantern_engine::lantern_capture::CaptureWorker>,
    /// Responses kept for `previous_response_id` and `GET /v1/responses/{id}`.
    pub responses: Arc<response_store::ResponseStore>,
    /// The reasoning parser and its end tag in the model's tokens, when the server has one.
    pub reasoning: Option<Arc<ThinkTags>>,
    /// Seeds for requests that give none (`--seed`).
    seeds: Option<Arc<RequestSeeds>>,
}

/// `--seed`'s sequence: one seed per request that gives none, in the order they come.
struct RequestSeeds {
    base: u64,
    taken: std::sync::atomic::AtomicU64,
}

impl RequestSeeds {
    fn next(&self) -> u64 {
        let n = self
            .taken
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        splitmix64(self.base ^ splitmix64(n))
    }
}

/// SplitMix64's finalizer: nearby inputs give unrelated seeds.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl AppState {
    /// Gives the items that have no seed one from `--seed`'s sequence (none without it).
    pub(crate) fn seed_items(&self, items: &mut [GenerationItem]) {
        if let Some(seeds) = &self.seeds {
            for item in items.iter_mut().filter(|i| i.params.seed.is_none()) {
                item.params.seed = Some(seeds.next());
            }
        }
    }
}

/// The server's routes, on an engine already running. Fails only when the capture
/// worker thread cannot be started or the reasoning parser's end tag cannot be tokenized.
pub fn router(engine: EngineHandle, config: &ServerConfig) -> std::io::Result<Router> {
    let tokenizer = engine.prompter().tokenizer();
    let implied =
        ReasoningParser::implied_by(tokenizer).filter(|_| config.reasoning_parser.is_none());
    if let Some(parser) = implied {
        tracing::info!(
            "chat replies are read with the reasoning parser {parser}: the vocabulary writes harmony messages"
        );
    }
    let reasoning = config
        .reasoning_parser
        .or(implied)
        .map(|parser| {
            ThinkTags::for_tokenizer(parser, engine.prompter().tokenizer())
                .map(Arc::new)
                .map_err(std::io::Error::other)
        })
        .transpose()?;
    let busy = engine.busy_flag();
    let mut names: Vec<String> = config
        .served_model_names
        .iter()
        .filter(|n| !n.is_empty())
        .cloned()
        .collect();
    if names.is_empty() {
        names.push(engine.meta().name.clone());
    }
    let created = openai::unix_now();
    let models = ModelCards {
        root: config
            .model_root
            .clone()
            .unwrap_or_else(|| engine.meta().name.clone()),
        created,
        permission_ids: names.iter().map(|_| permission_id()).collect(),
    };
    let state = AppState {
        engine,
        served_model_name: names[0].as_str().into(),
        served_model_names: names.into(),
        models: Arc::new(models),
        api_keys: config
            .api_keys
            .iter()
            .filter(|k| !k.is_empty())
            .cloned()
            .collect(),
        capture: Arc::new(config.capture.clone()),
        captures: CaptureStore::start(&config.capture),
        responses: Arc::new(response_store::ResponseStore::new(
            config.max_stored_response_bytes,
        )),
        capture_worker: Arc::new(lantern_engine::lantern_capture::CaptureWorker::start(
            busy,
            config.capture.max_queued,
        )?),
        reasoning,
        seeds: config.seed.map(|base| {
            Arc::new(RequestSeeds {
                base,
                taken: Default::default(),
            })
        }),
    };
    let v1 = Router::new()
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/invocations", post(openai::invocations))
        .route("/v1/responses", post(responses::responses))
        .route(
            "/v1/responses/{id}",
            get(responses::get_response).delete(responses::delete_response),
        )
        .route(
            "/v1/responses/{id}/input_items",
            get(responses::get_input_items),
        )
        .route("/v1/models", get(list_models))
        .route("/v1/models/{*model}", get(get_model))
        .route("/tokenize", post(openai::tokenize))
        .route("/detokenize", post(openai::detokenize))
        .route("/tokenizer_info", get(openai::tokenizer_info))
        .route("/v1/captures/{id}", get(get_capture).delete(delete_capture))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_api_key,
        ));
    let guards = Arc::new(request_guards::GuardSettings {
        max_body_bytes: config.max_body_bytes,
        body_read_timeout: config.body_read_timeout,
        allowed_origins: config.allowed_origins.clone(),
    });
    Ok(Router::new()
        .merge(v1)
        .route("/v1/captures/{id}/view", get(view_capture))
        .route("/health", get(health))
        // vLLM's health check for SageMaker, with either method.
        .route("/ping", get(health).post(health))
        .route("/load", get(load))
        .route("/version", get(version))
        .route("/metrics", get(metrics))
        .method_not_allowed_fallback(method_not_allowed)
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(config.max_body_bytes))
        .layer(middleware::from_fn_with_state(
            guards.clone(),
            request_guards::json_body_in_time,
        ))
        .layer(middleware::from_fn_with_state(guards, request_guards::cors))
        .with_state(state))
}

/// Serves `router` on `listener` with the default [`ConnectionLimits`] until `shutdown`
/// resolves, then lets open responses end.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with_limits(listener, router, ConnectionLimits::default(), shutdown).await
}

/// A route's `{id}` (or model name): a path that is not valid UTF-8 is a JSON 400, as
/// every other error is, not axum's plain-text rejection.
pub(crate) struct PathId(pub String);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for PathId {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, ApiError> {
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(id)) => Ok(PathId(id)),
            Err(e) => Err(ApiError::invalid(
                None,
                format!("the request's path is not valid: {}", e.body_text()),
            )),
        }
    }
}

/// Compares without stopping at the first difference.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The bearer token of a request, if it sent one.
pub(crate) fn bearer_token(headers: &axum::http::HeaderMap) -> Option<String> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(|v| v.trim().to_string())
}

/// `GET /v1/captures/{id}`: a stored capture as a safetensors file.
async fn get_capture(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    PathId(id): PathId,
) -> Response {
    match state.captures.get(&id, &bearer_token(&headers)) {
        Ok(bytes) => (
            [
                (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                (
                    header::CONTENT_DISPOSITION,
                    format!("attachment; filename=\"{id}.safetensors\""),
                ),
            ],
            bytes.as_ref().clone(),
        )
            .into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/captures/{id}/view`: the viewer page, which fetches the capture from
/// `GET /v1/captures/{id}`. A browser opening a page sends no bearer token, so this
/// route asks for none: the page holds no capture data, and its fetch is checked as
/// usual (the key goes after `#key=` in the page's address, which no server sees).
async fn view_capture(State(state): State<AppState>, PathId(id): PathId) -> Response {
    if !state.captures.contains(&id) {
        return CaptureStore::not_found(&id).into_response();
    }
    let page = lantern_engine::lantern_capture::view::fetching_page(&format!("../{id}"), &id);
    axum::response::Html(page).into_response()
}

/// `DELETE /v1/captures/{id}`: frees a stored capture.
async fn delete_capture(
    State(state): State<AppState>,
    headers: axum::http::HeaderMap,
    PathId(id): PathId,
) -> Response {
    match state.captures.remove(&id, &bearer_token(&headers)) {
        Ok(()) => Json(json!({"id": id, "object": "capture", "deleted": true})).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Whether the request may see what `/v1/*` shows: no key is configured, or it sent one.
fn is_authorized(state: &AppState, headers: &axum::http::HeaderMap) -> bool {
    state.api_keys.is_empty()
        || bearer_token(headers).is_some_and(|given| {
            state
                .api_keys
                .iter()
                .any(|key| same_secret(given.as_bytes(), key.as_bytes()))
        })
}

async fn require_api_key(State(state): State<AppState>, request: Request, next: Next) -> Response {
    if is_authorized(&state, request.headers()) {
        return next.run(request).await;
    }
    match bearer_token(request.headers()) {
        Some(_) => ApiError::unauthorized("Incorrect API key provided.").into_response(),
        None => ApiError::unauthorized(
            "You didn't provide an API key. Send it as `Authorization: Bearer KEY`.",
        )
        .into_response(),
    }
}

/// What `/v1/models` says beside each served name.
struct ModelCards {
    root: String,
    created: u64,
    /// One per served name, made once so that the cards stay the same between calls.
    permission_ids: Vec<String>,
}

/// vLLM's `modelperm-` ids: a random 128-bit hex string.
fn permission_id() -> String {
    let mut bytes = [0u8; 16];
    rand::RngCore::fill_bytes(&mut rand::thread_rng(), &mut bytes);
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!("modelperm-{hex}")
}

/// The card of the `index`th served name, in vLLM's `ModelCard` shape (its fields and
/// their order; one `ModelPermission` with vLLM's values).
fn model_card(state: &AppState, index: usize) -> serde_json::Value {
    let cards = &state.models;
    json!({
        "id": state.served_model_names[index],
        "object": "model",
        "created": cards.created,
        "owned_by": "lantern",
        "root": cards.root,
        "parent": null,
        "max_model_len": state.engine.meta().context_length,
        "permission": [{
            "id": cards.permission_ids[index],
            "object": "model_permission",
            "created": cards.created,
            "allow_create_engine": false,
            "allow_sampling": true,
            "allow_logprobs": true,
            "allow_search_indices": false,
            "allow_view": true,
            "allow_fine_tuning": false,
            "organization": "*",
            "group": null,
            "is_blocking": false,
        }],
    })
}

/// `GET /v1/models`: one card per served name, as vLLM lists them.
async fn list_models(State(state): State<AppState>) -> Response {
    let data: Vec<_> = (0..state.served_model_names.len())
        .map(|i| model_card(&state, i))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn get_model(State(state): State<AppState>, PathId(model): PathId) -> Response {
    match state.served_model_names.iter().position(|n| *n == model) {
        Some(index) => Json(model_card(&state, index)).into_response(),
        None => ApiError::model_not_found(&model).into_response(),
    }
}

/// `200 {"status": "ok"}`; `200 {"status": "degraded", ...}` after the engine thread
/// contained a panic, until the restarted engine has run
/// [`lantern_engine::serving::CLEAN_STEPS_TO_RECOVER`] steps without one; 503 once the engine
/// thread is gone. The panic's message is shown only to clients that may use `/v1/*`.
async fn health(State(state): State<AppState>, headers: axum::http::HeaderMap) -> Response {
    let faults = state.engine.faults();
    let health = if state.engine.is_alive() {
        faults.health()
    } else {
        EngineHealth::Stopped
    };
    match health {
        EngineHealth::Stopped => ApiError::from(state.engine.gone()).into_response(),
        EngineHealth::Ok => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        EngineHealth::Degraded => {
            let mut body = json!({
                "status": "degraded",
                "engine_faults": faults.count(),
                "clean_steps_since_fault": faults.clean_steps_since_last(),
                "clean_steps_to_recover": lantern_engine::serving::CLEAN_STEPS_TO_RECOVER,
            });
            if is_authorized(&state, &headers) {
                body["last_engine_fault"] = json!(faults.last());
            }
            (StatusCode::OK, Json(body)).into_response()
        }
    }
}

/// `GET /load` (vLLM's): the requests the engine holds, running and waiting.
async fn load(State(state): State<AppState>) -> Response {
    match state.engine.stats().await {
        Ok(stats) => Json(json!({
            "server_load": stats.num_requests_running + stats.num_requests_waiting
        }))
        .into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// `GET /version` (vLLM's): the server's version.
async fn version() -> Response {
    version_json().into_response()
}

pub(crate) fn version_json() -> Json<serde_json::Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}

async fn metrics(State(state): State<AppState>) -> Response {
    match state.engine.stats().await {
        Ok(stats) => (
            [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
            metrics::render(&stats, &state.captures.stats(), &state.served_model_name),
        )
            .into_response(),
        Err(e) => ApiError::from(e).into_response(),
    }
}

/// A route asked with a method it does not take: a 405 with an OpenAI-style body, as
/// every other error.
async fn method_not_allowed(request: Request) -> Response {
    ApiError::with_status(
        axum::http::StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{} does not take {} requests",
            request.uri().path(),
            request.method()
        ),
    )
    .into_response()
}

async fn not_found(request: Request) -> Response {
    ApiError::not_found(format!(
        "no route for {} {}",
        request.method(),
        request.uri().path()
    ))
    .into_response()
}
