//! The OpenAI endpoints: completions and chat completions, whole or streamed (SSE).

use crate::capture;
use crate::error::ApiError;
use crate::tool_stream::{ToolCallStream, ToolDelta};
use crate::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use lantern_engine::lantern_capture::{CaptureFailure, PendingCapture};
use lantern_engine::reasoning::{ReasoningParser, ThinkingOutput, ThinkingPiece, ThinkingSplitter};
use lantern_engine::serving::prompter::Prompter;
use lantern_engine::serving::{
    guided_failure_message, no_token_left_message, Accepted, ChoiceEvent, EndReason, EngineEvent,
    EngineFailure, EngineHandle, Finish, LogprobEntry, PromptLogprobEntry, StopReason,
};
use lantern_engine::validate::tools::ToolCall;
use lantern_engine::validate::{
    self, CaptureRequest, Endpoint, GenerationRequest, ModelLimits, RequestContext,
};
use lantern_kv::RequestId;
use serde_json::{json, Value};
use std::borrow::Cow;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;

/// Which endpoint a response is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

impl Kind {
    fn id_prefix(self) -> &'static str {
        match self {
            Kind::Chat => "chatcmpl",
            Kind::Completion => "cmpl",
        }
    }

    fn object(self, stream: bool) -> &'static str {
        match (self, stream) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        }
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The response's id: the client's request id after the kind's prefix, as vLLM makes
/// it (the `X-Request-Id` header, else the body's `request_id`), or a new one.
fn client_response_id(kind: Kind, headers: &HeaderMap, body_id: Option<&str>) -> String {
    let header = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .and_then(validate::checked_request_id);
    match header.as_deref().or(body_id) {
        Some(base) => format!("{}-{base}", kind.id_prefix()),
        None => response_id(kind),
    }
}

fn response_id(kind: Kind) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{}-{nanos:x}{n:06x}", kind.id_prefix())
}

/// Aborts the requests of a response that is dropped before they finish (the client went
/// away), so their KV blocks are freed at once.
pub(crate) struct AbortGuard {
    pub(crate) engine: EngineHandle,
    pub(crate) pending: Vec<RequestId>,
}

impl AbortGuard {
    pub(crate) fn finished(&mut self, id: RequestId) {
        self.pending.retain(|&p| p != id);
    }
}

impl Drop for AbortGuard {
    fn drop(&mut self) {
        self.engine.abort(std::mem::take(&mut self.pending));
    }
}

pub(crate) fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        let status = rejection.status();
        let message = if status == axum::http::StatusCode::PAYLOAD_TOO_LARGE {
            "the request body is too large".to_string()
        } else {
            format!("could not read the request body: {}", rejection.body_text())
        };
        ApiError::with_status(status, message)
    })
}

pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, &headers, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /invocations` (vLLM's, for SageMaker): a chat completion when the body has
/// `messages`, a completion when it has `prompt`.
pub async fn invocations(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let routed = async {
        let value = validate::parse_body(&body_bytes(body)?)?;
        let kind = if value.get("messages").is_some() {
            Kind::Chat
        } else if value.get("prompt").is_some() {
            Kind::Completion
        } else {
            return Err(ApiError::invalid(
                None,
                "an invocation is a chat completion (with `messages`) or a completion (with `prompt`)",
            ));
        };
        generate_parsed(state, &headers, value, kind).await
    };
    routed.await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(state, &headers, body, Kind::Completion)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub async fn tokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let value = validate::parse_body(&body_bytes(body)?)?;
        let limits = ModelLimits {
            served_name: &state.served_model_name,
            aliases: &state.served_model_names,
        };
        let request = validate::tokenize_request(&value, &limits)?;
        let tokens = state
            .engine
            .tokenize(request.prompt, request.add_special_tokens)
            .await?;
        let mut out = json!({
            "count": tokens.len(),
            "max_model_len": state.engine.meta().context_length,
            "tokens": tokens,
        });
        if request.return_token_strs {
            let tokenizer = state.engine.prompter().tokenizer();
            let strs: Vec<_> = tokens.iter().map(|&t| tokenizer.token_piece(t)).collect();
            out["token_strs"] = json!(strs);
        }
        Ok::<_, ApiError>(Json(out))
    };
    result
        .await
        .map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

pub async fn detokenize(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let result = async {
        let value = validate::parse_body(&body_bytes(body)?)?;
        let limits = ModelLimits {
            served_name: &state.served_model_name,
            aliases: &state.served_model_names,
        };
        let tokens = validate::detokenize_request(&value, &limits)?;
        let text = state.engine.detokenize(tokens).await?;
        Ok::<_, ApiError>(Json(json!({"prompt": text})))
    };
    result
        .await
        .map_or_else(IntoResponse::into_response, IntoResponse::into_response)
}

/// `GET /tokenizer_info`: the tokenizer's special tokens and chat template, as vLLM's
/// endpoint of that name gives them, so a client (lm-evaluation-harness's `remote`
/// tokenizer) can work with the served model's tokenizer through `/tokenize` without a
/// copy of its own.
pub async fn tokenizer_info(State(state): State<AppState>) -> Response {
    let prompter = state.engine.prompter();
    let tokenizer = prompter.tokenizer();
    let mut info = serde_json::Map::new();
    info.insert("tokenizer_class".into(), json!(tokenizer.kind()));
    for (key, token) in [
        ("bos_token", tokenizer.bos_token()),
        ("eos_token", tokenizer.eos_token()),
        ("pad_token", tokenizer.pad_token()),
    ] {
        if let Some(token) = token {
            info.insert(key.into(), json!(token));
        }
    }
    info.insert("add_bos_token".into(), json!(tokenizer.adds_bos()));
    info.insert(
        "model_max_length".into(),
        json!(state.engine.meta().context_length),
    );
    info.insert("vocab_size".into(), json!(tokenizer.vocab_size()));
    if let Some(source) = prompter.template().and_then(|t| t.source()) {
        info.insert("chat_template".into(), json!(source));
    }
    Json(Value::Object(info)).into_response()
}

/// How a response delivers its capture, when its request asked for one.
pub(crate) struct CaptureDelivery {
    request: CaptureRequest,
    /// On a server with API keys, the request's key: only it can read a stored
    /// capture. `None` without keys.
    owner: Option<String>,
    state: AppState,
}

impl CaptureDelivery {
    pub(crate) async fn fields(
        &self,
        pending: Option<Result<PendingCapture, CaptureFailure>>,
    ) -> serde_json::Map<String, Value> {
        let pending = pending.unwrap_or(Err(CaptureFailure::Snapshot(
            "the request ended without a capture".to_string(),
        )));
        capture::deliver(
            pending,
            &self.request,
            self.state.captures.clone(),
            self.owner.clone(),
            &self.state.capture,
            &self.state.capture_worker,
        )
        .await
    }
}

/// How the validated request's capture will be delivered, once the store and the capture
/// worker have room for it.
pub(crate) fn capture_delivery(
    state: &AppState,
    headers: &HeaderMap,
    request: &GenerationRequest,
) -> Result<Option<CaptureDelivery>, ApiError> {
    let Some(capture) = &request.capture else {
        return Ok(None);
    };
    capture::check_capacity(capture, &state.captures, &state.capture_worker)?;
    // With API keys, a stored capture is its key's; without, its unguessable id is
    // the capability (as the viewer link is), whatever token a client sent.
    let owner = if state.api_keys.is_empty() {
        None
    } else {
        crate::bearer_token(headers)
    };
    Ok(Some(CaptureDelivery {
        request: capture.clone(),
        owner,
        state: state.clone(),
    }))
}

async fn generate(
    state: AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Result<Response, ApiError> {
    let value = validate::parse_body(&body_bytes(body)?)?;
    generate_parsed(state, headers, value, kind).await
}

/// [`generate`] for a body already parsed.
async fn generate_parsed(
    state: AppState,
    headers: &HeaderMap,
    mut value: Value,
    kind: Kind,
) -> Result<Response, ApiError> {
    // The model's recommended sampling defaults, for the fields the request leaves out.
    state.engine.meta().sampling_defaults.fill(&mut value);
    let limits = ModelLimits {
        served_name: &state.served_model_name,
        aliases: &state.served_model_names,
    };
    let context = RequestContext::new(limits, &state.capture, state.engine.meta());
    let endpoint = match kind {
        Kind::Chat => Endpoint::Chat,
        Kind::Completion => Endpoint::Completion,
    };
    let mut request = validate::generation_request(endpoint, &value, &context)?;
    warn_ignored(&request.ignored_fields);
    let capture = capture_delivery(&state, headers, &request)?;
    let guide_field = attach_guide(&state, &mut request).await?;
    let id = client_response_id(kind, headers, request.request_id.as_deref());
    let mut items = std::mem::take(&mut request.items);
    let log_id: std::sync::Arc<str> = id.as_str().into();
    // A reasoning parser reads chat outputs (vLLM's: completions stay raw text).
    let reasoning = state.reasoning.clone().filter(|_| kind == Kind::Chat);
    for item in &mut items {
        item.request_id = Some(log_id.clone());
        item.read_with(reasoning.clone());
    }
    state.seed_items(&mut items);
    let num_choices = items.len();
    let (accepted, events) = match request.beam_search {
        Some(search) => state.engine.beam_search(items, search).await?,
        None => state.engine.add(items).await?,
    };
    let guard = AbortGuard {
        engine: state.engine.clone(),
        pending: accepted.iter().map(|a| a.id).collect(),
    };
    let response = ResponseBuilder {
        kind,
        id,
        created: unix_now(),
        model: state.served_model_name.to_string(),
        n: request.n,
        accepted,
        finishes: vec![None; num_choices],
        logprobs: request.logprobs,
        echo_logprobs: request.echo_logprobs,
        prompt_logprobs: request.prompt_logprobs,
        text_offsets: vec![0; num_choices],
        tool_calls: request.tool_calls,
        reasoning: reasoning.map(|tags| tags.parser),
        reasoning_tokens: vec![0; num_choices],
        names: TokenNames {
            by_id: request.tokens_as_ids,
        },
        guide_field,
    };
    let request_id = response.id.clone();
    let answer = if request.stream {
        Ok(stream_response(response, request, events, guard, capture))
    } else {
        whole_response(response, request, events, guard, capture).await
    };
    answer.map(|answer| with_request_id(answer, &request_id))
}

/// The response's id as the `x-request-id` header too, as OpenAI's API sends it (the
/// `openai` client's `_request_id`).
pub(crate) fn with_request_id(mut response: Response, id: &str) -> Response {
    if let Ok(value) = axum::http::HeaderValue::from_str(id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// As vLLM: one line naming the fields a client sent in vain.
pub(crate) fn warn_ignored(fields: &[String]) {
    if !fields.is_empty() {
        tracing::warn!(
            "The following fields were present in the request but ignored: {}",
            fields.join(", ")
        );
    }
}

/// Compiles the request's structured output, if it asked for one, onto its sequences.
pub(crate) async fn attach_guide(
    state: &AppState,
    request: &mut GenerationRequest,
) -> Result<Option<&'static str>, ApiError> {
    let field = request.guide.as_ref().map(|guide| guide.field);
    if let Some(guide) = request.guide.take() {
        let constraint =
            lantern_engine::validate::structured::compile(&state.engine.meta().guided, guide)
                .await?;
        for item in &mut request.items {
            item.constraint = Some(constraint.fork());
        }
    }
    Ok(field)
}

/// What a response needs to know to write its chunks.
struct ResponseBuilder {
    kind: Kind,
    /// The field whose grammar guides the output, named if it fails while generating.
    guide_field: Option<&'static str>,
    id: String,
    created: u64,
    model: String,
    /// Samples per prompt.
    n: usize,
    accepted: Vec<Accepted>,
    finishes: Vec<Option<Finish>>,
    /// Whether choices carry logprobs.
    logprobs: bool,
    /// Completions' `echo` with `logprobs`: alternatives per echoed prompt token.
    echo_logprobs: Option<usize>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token.
    prompt_logprobs: Option<usize>,
    /// Characters of each choice's text so far, for completions' `text_offset`.
    text_offsets: Vec<usize>,
    /// Chat with tools: calls in a choice's text become its `tool_calls`.
    tool_calls: bool,
    /// Chat on a server with a reasoning parser: a choice's thinking becomes its
    /// `reasoning`.
    reasoning: Option<ReasoningParser>,
    /// With a reasoning parser: each choice's tokens spent thinking, counted as they come.
    reasoning_tokens: Vec<usize>,
    /// How logprobs name tokens.
    names: TokenNames,
}

/// The id of call `i` of a choice.
fn call_id(response_id: &str, choice: usize, i: usize) -> String {
    format!(
        "call_{}_{choice}_{i}",
        response_id.trim_start_matches("chatcmpl-")
    )
}

/// OpenAI's `tool_calls` list.
fn tool_calls_json(calls: &[ToolCall], response_id: &str, choice: usize) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({
                "id": call_id(response_id, choice, i),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            })
        })
        .collect()
}

/// A streamed chat delta with tools: content, a call's first delta (id, type, name and
/// empty arguments, as vLLM sends it) or a fragment of its arguments.
fn tool_delta_json(delta: &ToolDelta, response_id: &str, choice: usize) -> Value {
    match delta {
        ToolDelta::Content(text) => json!({"content": text}),
        ToolDelta::CallStart { index, name } => json!({"tool_calls": [{
            "index": index,
            "id": call_id(response_id, choice, *index),
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }]}),
        ToolDelta::Arguments { index, text } => json!({"tool_calls": [{
            "index": index,
            "function": {"arguments": text},
        }]}),
    }
}

/// A chat choice's message, and its finish reason: with a reasoning parser
/// (`reasoning`: the output's thinking, `text` what follows it, `calls` the calls the
/// parser read), the thinking becomes `reasoning`; those calls, and calls in the text
/// when the request offered tools, become `tool_calls` (finish reason `tool_calls`).
fn chat_message(
    text: &str,
    reasoning: Option<Option<&str>>,
    calls: &[ToolCall],
    finish_reason: Value,
    tools: bool,
    response_id: &str,
    choice: usize,
) -> (Value, Value) {
    let (mut message, finish_reason) =
        answer_message(text, calls, finish_reason, tools, response_id, choice);
    if let Some(thought) = reasoning {
        if thought.is_some() && text.is_empty() {
            message["content"] = Value::Null;
        }
        // vLLM's `reasoning`, and `reasoning_content`, the older name clients still read.
        message["reasoning"] = json!(thought);
        message["reasoning_content"] = json!(thought);
    }
    (message, finish_reason)
}

/// [`chat_message`]'s content and calls.
fn answer_message(
    text: &str,
    parsed_calls: &[ToolCall],
    finish_reason: Value,
    tools: bool,
    response_id: &str,
    choice: usize,
) -> (Value, Value) {
    let (text_calls, rest) = if tools {
        lantern_engine::validate::tools::parse_tool_calls(text)
    } else {
        (Vec::new(), text.to_string())
    };
    let calls: Vec<ToolCall> = parsed_calls.iter().cloned().chain(text_calls).collect();
    if calls.is_empty() {
        return (json!({"role": "assistant", "content": text}), finish_reason);
    }
    let content = if rest.is_empty() {
        Value::Null
    } else {
        json!(rest)
    };
    let reason = if finish_reason == json!("stop") {
        json!("tool_calls")
    } else {
        finish_reason
    };
    (
        json!({"role": "assistant", "content": content,
               "tool_calls": tool_calls_json(&calls, response_id, choice)}),
        reason,
    )
}

/// How logprobs name a token: by its text, or as `token_id:{id}` (vLLM's
/// `return_tokens_as_token_ids`, for tokens whose text alone is not enough to tell them
/// apart: byte pieces of one character, special tokens written as text).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TokenNames {
    pub by_id: bool,
}

impl TokenNames {
    fn name<'a>(self, id: u32, text: &'a str) -> Cow<'a, str> {
        if self.by_id {
            Cow::Owned(format!("token_id:{id}"))
        } else {
            Cow::Borrowed(text)
        }
    }
}

/// Chat's `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
/// `bytes` are always the token's text's, whatever `names` calls it.
pub(crate) fn chat_logprobs(entries: &[LogprobEntry], names: TokenNames) -> Value {
    let token = |id: u32, t: &str, l: f32| json!({"token": names.name(id, t), "logprob": l, "bytes": t.as_bytes()});
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = token(e.token_id, &e.token, e.logprob);
            let top: Vec<Value> = e.top.iter().map(|(id, t, l)| token(*id, t, *l)).collect();
            v["top_logprobs"] = Value::Array(top);
            v
        })
        .collect();
    json!({ "content": content })
}

/// An echoed prompt's part of completions' `logprobs`: its tokens, `top` alternatives
/// each, and the length (in characters) of the prompt's text as echoed.
struct EchoedPrompt<'a> {
    entries: &'a [PromptLogprobEntry],
    top: usize,
    text_chars: usize,
}

/// Completions' `logprobs` object: `{tokens, token_logprobs, top_logprobs, text_offset}`,
/// over an echoed prompt's tokens (the first with null logprob and alternatives: nothing
/// predicts it), then the generated `entries`. `offset` is the choice's text length (in
/// characters) before these tokens, advanced past them; generated tokens start after the
/// echoed prompt's text.
fn completion_logprobs(
    prompt: Option<EchoedPrompt>,
    entries: &[LogprobEntry],
    names: TokenNames,
    offset: &mut usize,
) -> Value {
    let len = prompt.as_ref().map_or(0, |p| p.entries.len()) + entries.len();
    let mut tokens = Vec::with_capacity(len);
    let mut token_logprobs = Vec::with_capacity(len);
    let mut top_logprobs = Vec::with_capacity(len);
    let mut text_offset = Vec::with_capacity(len);
    // The offsets count the tokens' text, whatever `names` calls them.
    let mut push = |offset: &mut usize, id: u32, token: &str, logprob, top: Option<Value>| {
        tokens.push(json!(names.name(id, token)));
        token_logprobs.push(json!(logprob));
        top_logprobs.push(top.unwrap_or(Value::Null));
        text_offset.push(*offset);
        *offset += token.chars().count();
    };
    // The most likely tokens, then the token itself when it is not among them: OpenAI's
    // legacy logprobs always hold the chosen token (up to `logprobs` + 1 entries).
    let map = |top: &[(u32, String, f32)], (id, token, logprob): (u32, &str, f32)| {
        let mut map: serde_json::Map<String, Value> = top
            .iter()
            .map(|(id, t, l)| (names.name(*id, t).into_owned(), json!(l)))
            .collect();
        if !top.iter().any(|(top_id, _, _)| *top_id == id) {
            map.insert(names.name(id, token).into_owned(), json!(logprob));
        }
        Value::Object(map)
    };
    if let Some(prompt) = prompt {
        for e in prompt.entries {
            let top = e.logprob.map(|lp| {
                let top = &e.top[..prompt.top.min(e.top.len())];
                map(top, (e.token_id, &e.token, lp))
            });
            push(offset, e.token_id, &e.token, e.logprob, top);
        }
        // The echoed text, not its tokens decoded one by one, is what generation follows.
        *offset = prompt.text_chars;
    }
    for e in entries {
        let top = map(&e.top, (e.token_id, &e.token, e.logprob));
        push(offset, e.token_id, &e.token, Some(e.logprob), Some(top));
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    })
}

/// vLLM's `prompt_logprobs`: per prompt token, null for the first, then
/// `{token_id: {logprob, rank, decoded_token}}` for the token itself and the `top` most
/// likely ones.
fn vllm_prompt_logprobs(entries: Option<&[PromptLogprobEntry]>, top: usize) -> Value {
    let Some(entries) = entries else {
        return Value::Null;
    };
    let entry = |logprob: f32, rank: usize, token: &str| json!({"logprob": logprob, "rank": rank, "decoded_token": token});
    entries
        .iter()
        .map(|e| {
            let Some(logprob) = e.logprob else {
                return Value::Null;
            };
            let mut map = serde_json::Map::new();
            map.insert(e.token_id.to_string(), entry(logprob, e.rank, &e.token));
            for (i, (id, token, l)) in e.top.iter().take(top).enumerate() {
                map.entry(id.to_string())
                    .or_insert_with(|| entry(*l, i + 1, token));
            }
            Value::Object(map)
        })
        .collect()
}

fn stop_reason_json(reason: &Option<StopReason>) -> Value {
    match reason {
        None => Value::Null,
        Some(StopReason::Text(s)) => json!(s),
        Some(StopReason::Token(t)) => json!(t),
    }
}

impl ResponseBuilder {
    /// The `logprobs` value of one choice's new tokens (null when not asked for), after
    /// its echoed prompt's tokens when they are given and asked for.
    fn logprobs_json(
        &mut self,
        index: usize,
        prompt: Option<&[PromptLogprobEntry]>,
        entries: &[LogprobEntry],
    ) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => chat_logprobs(entries, self.names),
            Kind::Completion => {
                let prompt = match (prompt, self.echo_logprobs) {
                    (Some(entries), Some(top)) => Some(EchoedPrompt {
                        entries,
                        top,
                        text_chars: self.accepted[index]
                            .prompt_text
                            .as_ref()
                            .map_or(0, |t| t.chars().count()),
                    }),
                    _ => None,
                };
                completion_logprobs(prompt, entries, self.names, &mut self.text_offsets[index])
            }
        }
    }

    /// A splitter per choice with a reasoning parser (none without one).
    fn thinking_splitters(&self) -> Vec<ThinkingSplitter> {
        self.per_choice(ThinkingSplitter::new)
    }

    /// `make(parser, whether the output begins thinking)` per choice with a reasoning
    /// parser (none without one).
    fn per_choice<T>(&self, make: impl Fn(ReasoningParser, bool) -> T) -> Vec<T> {
        match self.reasoning {
            Some(parser) => self
                .accepted
                .iter()
                .map(|a| make(parser, a.thinking))
                .collect(),
            None => Vec::new(),
        }
    }

    fn all_finished(&self) -> bool {
        self.finishes.iter().all(Option::is_some)
    }

    /// Usage over all choices: each prompt counted once, however many samples it has.
    fn usage(&self) -> Value {
        let mut prompt_tokens = 0;
        let mut cached_tokens = 0;
        let mut completion_tokens = 0;
        for (i, f) in self.finishes.iter().enumerate() {
            let prompt = self.accepted[i].prompt_tokens;
            let (completion, cached) = f
                .as_ref()
                .map_or((0, 0), |f| (f.completion_tokens, f.cached_tokens));
            completion_tokens += completion;
            if i % self.n == 0 {
                prompt_tokens += prompt;
                cached_tokens += cached;
            }
        }
        let mut usage = json!({
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        });
        if self.reasoning.is_some() {
            let thinking: usize = self.reasoning_tokens.iter().sum();
            usage["completion_tokens_details"] = json!({"reasoning_tokens": thinking});
        }
        usage
    }

    fn envelope(&self, stream: bool, choices: Vec<Value>) -> serde_json::Map<String, Value> {
        let mut obj = serde_json::Map::new();
        obj.insert("id".into(), json!(self.id));
        obj.insert("object".into(), json!(self.kind.object(stream)));
        obj.insert("created".into(), json!(self.created));
        obj.insert("model".into(), json!(self.model));
        obj.insert("choices".into(), Value::Array(choices));
        if self.kind == Kind::Chat {
            obj.insert("system_fingerprint".into(), Value::Null);
        }
        obj
    }

    /// A streamed chunk of one choice.
    fn chunk(
        &self,
        index: usize,
        text: Option<&str>,
        role: bool,
        finish: Option<&Finish>,
        logprobs: Value,
        include_usage: bool,
    ) -> Value {
        let finish_reason = finish.map_or(Value::Null, |f| json!(f.reason.as_str()));
        let stop_reason = finish.map_or(Value::Null, |f| stop_reason_json(&f.stop_reason));
        let choice = match self.kind {
            Kind::Chat => {
                let mut delta = serde_json::Map::new();
                if role {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(text) = text {
                    delta.insert("content".into(), json!(text));
                }
                json!({
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs,
                    "finish_reason": finish_reason,
                    "stop_reason": stop_reason,
                })
            }
            Kind::Completion => json!({
                "index": index,
                "text": text.unwrap_or(""),
                "logprobs": logprobs,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }),
        };
        let mut obj = self.envelope(true, vec![choice]);
        if include_usage {
            obj.insert("usage".into(), Value::Null);
        }
        Value::Object(obj)
    }

    fn usage_chunk(&self) -> Value {
        let mut obj = self.envelope(true, Vec::new());
        obj.insert("usage".into(), self.usage());
        Value::Object(obj)
    }

    /// The whole, non-streamed response (`thoughts`: with a reasoning parser, each
    /// choice's thinking and the calls the parser read, `texts` then holding what
    /// follows it).
    fn whole(
        &mut self,
        texts: &[String],
        thoughts: &[(Option<String>, Vec<ToolCall>)],
        logprobs: &[Vec<LogprobEntry>],
        prompts: &[Option<Vec<PromptLogprobEntry>>],
    ) -> Value {
        let logprobs: Vec<Value> = logprobs
            .iter()
            .enumerate()
            .map(|(i, entries)| self.logprobs_json(i, prompts[i].as_deref(), entries))
            .collect();
        let choices = texts
            .iter()
            .zip(logprobs)
            .enumerate()
            .map(|(i, (text, logprobs))| {
                let f = self.finishes[i].as_ref();
                let finish_reason = f.map_or(Value::Null, |f| json!(f.reason.as_str()));
                let stop_reason = f.map_or(Value::Null, |f| stop_reason_json(&f.stop_reason));
                match self.kind {
                    Kind::Chat => {
                        let thought = thoughts.get(i);
                        let reasoning = self
                            .reasoning
                            .map(|_| thought.and_then(|(r, _)| r.as_deref()));
                        let calls = thought.map_or(&[][..], |(_, calls)| calls);
                        let (message, finish_reason) = chat_message(
                            text,
                            reasoning,
                            calls,
                            finish_reason,
                            self.tool_calls,
                            &self.id,
                            i,
                        );
                        json!({
                            "index": i,
                            "message": message,
                            "logprobs": logprobs,
                            "finish_reason": finish_reason,
                            "stop_reason": stop_reason,
                        })
                    }
                    Kind::Completion => {
                        let mut choice = json!({
                            "index": i,
                            "text": text,
                            "logprobs": logprobs,
                            "finish_reason": finish_reason,
                            "stop_reason": stop_reason,
                        });
                        if let Some(top) = self.prompt_logprobs {
                            choice["prompt_logprobs"] =
                                vllm_prompt_logprobs(prompts[i].as_deref(), top);
                        }
                        choice
                    }
                }
            })
            .collect();
        let mut obj = self.envelope(false, choices);
        if let (Kind::Chat, Some(top)) = (self.kind, self.prompt_logprobs) {
            // vLLM's chat: one prompt, so one list, beside the choices.
            let first = prompts.first().and_then(Option::as_deref);
            obj.insert("prompt_logprobs".into(), vllm_prompt_logprobs(first, top));
        }
        obj.insert("usage".into(), self.usage());
        Value::Object(obj)
    }
}

/// The error a failed sequence gives its client (`guide_field`: the request field whose
/// grammar guided it, named when that grammar failed).
pub(crate) fn engine_failure(
    finish: &Finish,
    guide_field: Option<&'static str>,
) -> Option<ApiError> {
    match &finish.reason {
        EndReason::Failed(EngineFailure::Fault { restarted }) => {
            Some(ApiError::engine_fault(*restarted))
        }
        EndReason::Failed(EngineFailure::Guided(error)) => Some(ApiError {
            code: Some("structured_output_failed"),
            ..ApiError::invalid(
                guide_field.map(str::to_string),
                guided_failure_message(error),
            )
        }),
        EndReason::Failed(EngineFailure::NoTokenLeft(field)) => Some(ApiError {
            code: Some("no_token_left"),
            ..ApiError::invalid(Some(field.to_string()), no_token_left_message(field))
        }),
        EndReason::Failed(EngineFailure::Step(error)) => Some(ApiError {
            code: Some("engine_error"),
            ..ApiError::internal(format!("the engine failed while generating: {error}"))
        }),
        _ => None,
    }
}

/// Checks that an event names one of the response's choices, so that indexing the
/// per-choice state by it cannot fail.
pub(crate) fn check_index(event: &ChoiceEvent, num_choices: usize) -> Result<(), ApiError> {
    if event.index < num_choices {
        return Ok(());
    }
    Err(ApiError::internal(format!(
        "the engine sent an event for choice {} of a response with {num_choices}",
        event.index
    )))
}

async fn whole_response(
    mut response: ResponseBuilder,
    request: GenerationRequest,
    mut events: UnboundedReceiver<EngineEvent>,
    mut guard: AbortGuard,
    capture: Option<CaptureDelivery>,
) -> Result<Response, ApiError> {
    let mut pending_capture = None;
    let mut texts: Vec<String> = response
        .accepted
        .iter()
        .map(|a| {
            if request.echo {
                a.prompt_text.as_deref().unwrap_or_default().to_string()
            } else {
                request.chat_echo.clone().unwrap_or_default()
            }
        })
        .collect();
    let mut logprobs: Vec<Vec<LogprobEntry>> = vec![Vec::new(); texts.len()];
    let mut prompts: Vec<Option<Vec<PromptLogprobEntry>>> = vec![None; texts.len()];
    // With a reasoning parser: each choice split as it arrives (after any echo, as the
    // whole text is read), its thinking tokens counted as a stream counts them.
    let mut thinking = response.per_choice(ThinkingOutput::new);
    for (output, echo) in thinking.iter_mut().zip(&mut texts) {
        output.push(&std::mem::take(echo), 0);
    }
    while !response.all_finished() {
        let Some(event) = events.recv().await else {
            return Err(ApiError::unavailable());
        };
        let event = guard.engine.prompter().resolve(event).await?;
        check_index(&event, texts.len())?;
        match thinking.get_mut(event.index) {
            Some(output) => output.push(&event.text, event.token_ids.len()),
            None => texts[event.index].push_str(&event.text),
        }
        logprobs[event.index].extend(event.logprobs);
        if event.prompt_logprobs.is_some() {
            prompts[event.index] = event.prompt_logprobs;
        }
        if let Some(mut finish) = event.finish {
            if let Some(error) = engine_failure(&finish, response.guide_field) {
                return Err(error);
            }
            guard.finished(response.accepted[event.index].id);
            pending_capture = finish.capture.take();
            response.finishes[event.index] = Some(finish);
        }
    }
    let mut thoughts = Vec::with_capacity(thinking.len());
    for (i, output) in thinking.into_iter().enumerate() {
        response.reasoning_tokens[i] = output.reasoning_tokens();
        let split = output.finish();
        thoughts.push((split.reasoning, split.calls));
        texts[i] = split.answer;
    }
    let mut whole = response.whole(&texts, &thoughts, &logprobs, &prompts);
    if let (Some(capture), Value::Object(obj)) = (&capture, &mut whole) {
        obj.extend(capture.fields(pending_capture).await);
    }
    Ok(Json(whole).into_response())
}

/// The state of an SSE stream.
struct StreamState {
    response: ResponseBuilder,
    events: UnboundedReceiver<EngineEvent>,
    prompter: Prompter,
    guard: AbortGuard,
    include_usage: bool,
    /// vLLM's `continuous_usage_stats`: each choice chunk carries its choice's usage so far.
    continuous_usage: bool,
    /// Tokens each choice has generated so far.
    completion_tokens: Vec<usize>,
    /// Events ready to send.
    queue: VecDeque<Event>,
    /// `[DONE]` was queued: the stream ends once the queue is empty.
    done: bool,
    /// Choices whose echoed prompt waits for its logprobs (it goes with the first token).
    echo_due: Vec<bool>,
    capture: Option<CaptureDelivery>,
    /// Every choice finished and the capture is still to be delivered.
    capture_due: Option<Option<Result<PendingCapture, CaptureFailure>>>,
    /// Chat with tools: each choice's output, turned into content and `tool_calls`
    /// deltas as it arrives.
    tool_streams: Vec<ToolCallStream>,
    /// Chat with a reasoning parser: each choice's output, split into reasoning and the
    /// rest as it arrives (empty without one).
    thinking: Vec<ThinkingSplitter>,
    /// Chat with tools or reasoning: each choice's logprobs not yet sent.
    held_logprobs: Vec<Vec<LogprobEntry>>,
}

/// Puts a live capture row in a chunk, beside `choices` (as the finished capture's
/// fields are).
fn attach_capture_row<T: serde::Serialize>(chunk: &mut Value, row: Option<T>) {
    if let (Some(row), Value::Object(fields)) = (row, chunk) {
        if let Ok(row) = serde_json::to_value(row) {
            fields.insert("attn_capture_row".into(), row);
        }
    }
}

fn data(value: &Value) -> Event {
    Event::default().data(value.to_string())
}

impl StreamState {
    fn start(&mut self, echo: bool, chat_echo: Option<&str>) {
        for i in 0..self.response.accepted.len() {
            let chunk = match self.response.kind {
                Kind::Chat => Some(self.response.chunk(
                    i,
                    Some(chat_echo.unwrap_or("")),
                    true,
                    None,
                    Value::Null,
                    self.include_usage,
                )),
                Kind::Completion if echo && self.response.echo_logprobs.is_some() => {
                    self.echo_due[i] = true;
                    None
                }
                Kind::Completion if echo => {
                    let prompt = self.response.accepted[i].prompt_text.clone();
                    Some(self.response.chunk(
                        i,
                        prompt.as_deref(),
                        false,
                        None,
                        Value::Null,
                        self.include_usage,
                    ))
                }
                Kind::Completion => None,
            };
            if let Some(chunk) = chunk {
                self.push_choice_chunk(i, chunk);
            }
        }
    }

    fn on_event(&mut self, mut event: ChoiceEvent) {
        if let Some(finish) = &event.finish {
            if let Some(error) = engine_failure(finish, self.response.guide_field) {
                self.queue.push_back(data(&error.body()));
                self.finish_stream();
                return;
            }
        }
        self.completion_tokens[event.index] = match &event.finish {
            Some(finish) => finish.completion_tokens,
            None => self.completion_tokens[event.index] + event.token_ids.len(),
        };
        if self.response.tool_calls || self.response.reasoning.is_some() {
            self.on_parsed_event(event);
            return;
        }
        let prompt = event.prompt_logprobs.as_deref();
        let has_logprobs =
            self.response.logprobs && (!event.logprobs.is_empty() || prompt.is_some());
        // An echoed prompt that waited for its logprobs goes out before the first token.
        let echoed = std::mem::take(&mut self.echo_due[event.index])
            .then(|| self.response.accepted[event.index].prompt_text.clone())
            .flatten()
            .map(|p| p.to_string() + &event.text);
        if event.text.is_empty()
            && event.finish.is_none()
            && !has_logprobs
            && echoed.is_none()
            && event.capture_row.is_none()
        {
            return;
        }
        let text = echoed.as_deref().or_else(|| {
            (!event.text.is_empty() || self.response.kind == Kind::Completion)
                .then_some(event.text.as_str())
        });
        let logprobs = if has_logprobs {
            self.response
                .logprobs_json(event.index, prompt, &event.logprobs)
        } else {
            Value::Null
        };
        let mut chunk = self.response.chunk(
            event.index,
            text,
            false,
            event.finish.as_ref(),
            logprobs,
            self.include_usage,
        );
        attach_capture_row(&mut chunk, event.capture_row.take());
        self.push_choice_chunk(event.index, chunk);
        self.after_chunk(event);
    }

    /// Chat with tools or a reasoning parser: the event's text as `reasoning`, content
    /// and `tool_calls` deltas, then a last chunk with the finish reason (`tool_calls`
    /// when the choice called).
    fn on_parsed_event(&mut self, mut event: ChoiceEvent) {
        let index = event.index;
        // The tokens' logprobs go out with the next chunk of their choice: the parsers
        // may hold text back over several events.
        self.held_logprobs[index].append(&mut event.logprobs);
        let finished = event.finish.is_some();
        let pieces = match self.thinking.get_mut(index) {
            Some(splitter) => {
                let counted = &mut self.response.reasoning_tokens[index];
                let mut pieces = splitter.push_counted(&event.text, event.token_ids.len(), counted);
                if finished {
                    pieces.extend(splitter.finish());
                }
                pieces
            }
            None => vec![ThinkingPiece::Answer(std::mem::take(&mut event.text))],
        };
        let mut deltas = Vec::new();
        let tools = self.response.tool_calls;
        let stream = &mut self.tool_streams[index];
        for piece in pieces {
            match piece {
                ThinkingPiece::Reasoning(text) => {
                    deltas.push(json!({"reasoning": text, "reasoning_content": text}))
                }
                ThinkingPiece::Answer(text) if tools => deltas.extend(
                    stream
                        .push(&text)
                        .iter()
                        .map(|d| tool_delta_json(d, &self.response.id, index)),
                ),
                ThinkingPiece::Answer(text) if !text.is_empty() => {
                    deltas.push(json!({"content": text}))
                }
                ThinkingPiece::Answer(_) => {}
                ThinkingPiece::Call { name } => {
                    let delta = stream.start_call(name);
                    deltas.push(tool_delta_json(&delta, &self.response.id, index))
                }
                ThinkingPiece::Arguments(text) => {
                    let delta = stream.call_arguments(text);
                    deltas.push(tool_delta_json(&delta, &self.response.id, index))
                }
            }
        }
        if finished && tools {
            deltas.extend(
                stream
                    .finish()
                    .iter()
                    .map(|d| tool_delta_json(d, &self.response.id, index)),
            );
        }
        let called = stream.called();
        let mut capture_row = event.capture_row.take();
        for delta in deltas {
            let logprobs = self.take_held_logprobs(index);
            let mut chunk =
                self.response
                    .chunk(index, None, false, None, logprobs, self.include_usage);
            if let Some(choice) = chunk.pointer_mut("/choices/0") {
                choice["delta"] = delta;
            }
            attach_capture_row(&mut chunk, capture_row.take());
            self.push_choice_chunk(index, chunk);
        }
        let Some(finish) = &event.finish else {
            if capture_row.is_some() {
                // A row whose text the parsers hold back goes out in a chunk of its own.
                let mut chunk =
                    self.response
                        .chunk(index, None, false, None, Value::Null, self.include_usage);
                attach_capture_row(&mut chunk, capture_row);
                self.push_choice_chunk(index, chunk);
            }
            return;
        };
        let logprobs = self.take_held_logprobs(index);
        let mut chunk = self.response.chunk(
            index,
            None,
            false,
            Some(finish),
            logprobs,
            self.include_usage,
        );
        if let Some(choice) = chunk.pointer_mut("/choices/0") {
            if called && choice["finish_reason"] == json!("stop") {
                choice["finish_reason"] = json!("tool_calls");
            }
        }
        attach_capture_row(&mut chunk, capture_row);
        self.push_choice_chunk(index, chunk);
        let event = ChoiceEvent {
            text: String::new(),
            ..event
        };
        self.after_chunk(event);
    }

    /// The logprobs held for choice `index`'s next chunk (null when there are none).
    fn take_held_logprobs(&mut self, index: usize) -> Value {
        let held = std::mem::take(&mut self.held_logprobs[index]);
        if held.is_empty() {
            return Value::Null;
        }
        self.response.logprobs_json(index, None, &held)
    }

    /// Queues a chunk of choice `index`, with the choice's usage so far when the request
    /// asked for it in every chunk (as vLLM counts it: the choice's prompt and its tokens).
    fn push_choice_chunk(&mut self, index: usize, mut chunk: Value) {
        if self.continuous_usage {
            let prompt_tokens = self.response.accepted[index].prompt_tokens;
            let completion_tokens = self.completion_tokens[index];
            chunk["usage"] = json!({
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            });
        }
        self.queue.push_back(data(&chunk));
    }

    /// Book-keeping once a choice's chunk is queued: a finish ends the choice, and the
    /// last one the stream.
    fn after_chunk(&mut self, event: ChoiceEvent) {
        if let Some(mut finish) = event.finish {
            let id = self.response.accepted[event.index].id;
            self.guard.finished(id);
            let pending_capture = finish.capture.take();
            self.response.finishes[event.index] = Some(finish);
            if self.response.all_finished() {
                if self.capture.is_some() {
                    // The capture goes in a chunk of its own once it is computed, then
                    // the usage chunk, which OpenAI's clients read as the last.
                    self.capture_due = Some(pending_capture);
                } else {
                    self.finish_stream();
                }
            }
        }
    }

    /// Ends the stream: the usage chunk when asked for (always the last before
    /// `[DONE]`, as OpenAI sends it), then `[DONE]`.
    fn finish_stream(&mut self) {
        if self.include_usage && self.response.all_finished() {
            let usage = self.response.usage_chunk();
            self.queue.push_back(data(&usage));
        }
        self.queue.push_back(Event::default().data("[DONE]"));
        self.done = true;
    }
}

fn stream_response(
    response: ResponseBuilder,
    request: GenerationRequest,
    events: UnboundedReceiver<EngineEvent>,
    guard: AbortGuard,
    capture: Option<CaptureDelivery>,
) -> Response {
    let num_choices = response.accepted.len();
    let thinking = response.thinking_splitters();
    let mut state = StreamState {
        response,
        events,
        prompter: guard.engine.prompter().clone(),
        guard,
        include_usage: request.include_usage,
        continuous_usage: request.continuous_usage,
        completion_tokens: vec![0; num_choices],
        queue: VecDeque::new(),
        done: false,
        echo_due: vec![false; num_choices],
        capture,
        capture_due: None,
        tool_streams: (0..num_choices)
            .map(|_| ToolCallStream::default())
            .collect(),
        thinking,
        held_logprobs: vec![Vec::new(); num_choices],
    };
    state.start(request.echo, request.chat_echo.as_deref());
    let events = sse_events(state);
    Sse::new(events)
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn sse_events(state: StreamState) -> impl Stream<Item = Result<Event, Infallible>> {
    stream::unfold(state, |mut state| async move {
        loop {
            if let Some(event) = state.queue.pop_front() {
                return Some((Ok(event), state));
            }
            if state.done {
                return None;
            }
            if let Some(pending) = state.capture_due.take() {
                if let Some(capture) = &state.capture {
                    let fields = capture.fields(pending).await;
                    let mut chunk = state.response.envelope(true, Vec::new());
                    chunk.extend(fields);
                    state.queue.push_back(data(&Value::Object(chunk)));
                }
                state.finish_stream();
                continue;
            }
            match state.events.recv().await {
                Some(event) => match state
                    .prompter
                    .resolve(event)
                    .await
                    .map_err(ApiError::from)
                    .and_then(|event| {
                        check_index(&event, state.response.accepted.len())?;
                        Ok(event)
                    }) {
                    Ok(event) => state.on_event(event),
                    Err(error) => {
                        state.queue.push_back(data(&error.body()));
                        state.finish_stream();
                    }
                },
                None => {
                    // The engine thread ended without finishing the request.
                    state.queue.push_back(data(&ApiError::unavailable().body()));
                    state.finish_stream();
                }
            }
        }
    })
}
