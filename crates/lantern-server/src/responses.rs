//! OpenAI's Responses API: `POST /v1/responses`, whole or streamed as its typed events.
//! A request runs as one chat sequence ([`validate::responses_request`]); its output
//! becomes a `message` item with one `output_text` part, and, when tools were offered,
//! `function_call` items for the calls in it. Each response is kept (unless `store` is
//! false) with its conversation, for a follow-up's `previous_response_id` and for
//! `GET /v1/responses/{id}` ([`crate::response_store`]).

use crate::error::ApiError;
use crate::openai::{
    attach_guide, body_bytes, capture_delivery, chat_logprobs, check_index, engine_failure,
    unix_now, warn_ignored, with_request_id, AbortGuard, CaptureDelivery, TokenNames,
};
use crate::response_store::ResponseStore;
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
use lantern_engine::reasoning::{
    ReasoningParser, SplitOutput, ThinkingOutput, ThinkingPiece, ThinkingSplitter,
};
use lantern_engine::serving::prompter::Prompter;
use lantern_engine::serving::{EngineEvent, Finish, LogprobEntry};
use lantern_engine::validate::tools::{parse_tool_calls, ToolCall};
use lantern_engine::validate::{self, ModelLimits, RequestContext, ResponsesEcho};
use serde_json::{json, Map, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

pub async fn responses(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    respond(state, &headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// The API key a request came with, on a server with keys: it owns what it stores.
fn owner(state: &AppState, headers: &HeaderMap) -> Option<String> {
    if state.api_keys.is_empty() {
        None
    } else {
        crate::bearer_token(headers)
    }
}

fn not_kept(id: &str) -> ApiError {
    let id: String = id.chars().take(64).collect();
    ApiError::not_found(format!(
        "no response {id} is kept here (responses are kept in memory, the oldest dropped past --max-stored-response-bytes, none across restarts, none asked with store false)"
    ))
}

/// `GET /v1/responses/{id}`: a kept response, as it was answered (whole: its events
/// are not kept to replay, so `stream=true` is refused rather than answered as JSON a
/// client's stream reader would find empty).
pub async fn get_response(
    State(state): State<AppState>,
    headers: HeaderMap,
    crate::PathId(id): crate::PathId,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let asks_stream = query.as_deref().unwrap_or_default().split('&').any(|pair| {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        name == "stream" && value != "false"
    });
    if asks_stream {
        return ApiError::invalid(
            "stream".to_string(),
            "a kept response is returned whole: its events are not kept to stream again (leave out stream)",
        )
        .into_response();
    }
    match state.responses.get(&id, owner(&state, &headers).as_deref()) {
        Some(stored) => Json(stored.response).into_response(),
        None => not_kept(&id).into_response(),
    }
}

/// `GET /v1/responses/{id}/input_items`'s query (OpenAI's: newest first by default).
#[derive(Debug, serde::Deserialize)]
pub struct InputItemsQuery {
    limit: Option<usize>,
    order: Option<String>,
    after: Option<String>,
}

/// `GET /v1/responses/{id}/input_items`: the input a kept response was asked with, as
/// Responses items (its own input; a continued response's input is listed by that one).
pub async fn get_input_items(
    State(state): State<AppState>,
    headers: HeaderMap,
    crate::PathId(id): crate::PathId,
    query: Result<axum::extract::Query<InputItemsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let query = match query {
        Ok(axum::extract::Query(q)) => q,
        Err(e) => {
            let text = e.body_text();
            // serde names the parameter it could not read.
            let param = ["limit", "order", "after"].into_iter().find(|name| {
                text.contains(&format!("{name}:")) || text.contains(&format!("`{name}`"))
            });
            return ApiError::invalid(param.map(str::to_string), text).into_response();
        }
    };
    let limit = query.limit.unwrap_or(20);
    if !(1..=100).contains(&limit) {
        return ApiError::invalid(
            Some("limit".into()),
            format!("limit must be in [1, 100], got {limit}"),
        )
        .into_response();
    }
    let ascending = match query.order.as_deref() {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(other) => {
            return ApiError::invalid(
                Some("order".into()),
                format!("order must be `asc` or `desc`, got `{other}`"),
            )
            .into_response()
        }
    };
    let Some(stored) = state.responses.get(&id, owner(&state, &headers).as_deref()) else {
        return not_kept(&id).into_response();
    };
    let mut items: Vec<&Value> = stored.input_items.iter().collect();
    if !ascending {
        items.reverse();
    }
    if let Some(after) = &query.after {
        match items.iter().position(|item| item["id"] == after.as_str()) {
            Some(at) => items.drain(..=at),
            None => {
                return ApiError::invalid(
                    Some("after".into()),
                    format!("no input item `{after}` in response `{id}`"),
                )
                .into_response()
            }
        };
    }
    let has_more = items.len() > limit;
    items.truncate(limit);
    Json(json!({
        "object": "list",
        "data": items,
        "first_id": items.first().map(|item| &item["id"]),
        "last_id": items.last().map(|item| &item["id"]),
        "has_more": has_more,
    }))
    .into_response()
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete_response(
    State(state): State<AppState>,
    headers: HeaderMap,
    crate::PathId(id): crate::PathId,
) -> Response {
    if state
        .responses
        .delete(&id, owner(&state, &headers).as_deref())
    {
        Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        not_kept(&id).into_response()
    }
}

fn new_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    format!("{nanos:x}{:06x}", COUNTER.fetch_add(1, Ordering::Relaxed))
}

async fn respond(
    state: AppState,
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let mut value = validate::parse_body(&body_bytes(body)?)?;
    state.engine.meta().sampling_defaults.fill(&mut value);
    let limits = ModelLimits {
        served_name: &state.served_model_name,
        aliases: &state.served_model_names,
    };
    let context = RequestContext::new(limits, &state.capture, state.engine.meta());
    let owner = owner(&state, headers);
    let previous_id = validate::previous_response_id(&value)?;
    let previous = match &previous_id {
        None => None,
        Some(id) => Some(
            state
                .responses
                .get(id, owner.as_deref())
                .ok_or_else(|| ApiError {
                    param: Some("previous_response_id".into()),
                    ..not_kept(id)
                })?,
        ),
    };
    let previous_conversation = previous.as_ref().map_or(&[][..], |p| &p.conversation[..]);
    let validated = validate::responses_request(&value, &context, previous_conversation)?;
    let (mut request, echo) = (validated.generation, validated.echo);
    let keep = echo.store.then(|| Keep {
        store: state.responses.clone(),
        conversation: validated.conversation,
        input_items: validated.input_items,
        owner,
    });
    warn_ignored(&request.ignored_fields);
    let capture = capture_delivery(&state, headers, &request)?;
    // Structured output comes from `text.format`: its errors name `text`, the field the
    // client sent, as validation's do.
    let guide_field = attach_guide(&state, &mut request)
        .await
        .map_err(|mut e| {
            if e.param.as_deref() == Some("response_format") {
                e.param = Some("text".into());
                e.message = e.message.replace("response_format", "text.format");
            }
            e
        })?
        .map(|field| match field {
            "response_format" => "text",
            other => other,
        });
    let id = new_id();
    let mut items = std::mem::take(&mut request.items);
    let log_id: std::sync::Arc<str> = format!("resp_{id}").into();
    for item in &mut items {
        item.request_id = Some(log_id.clone());
        item.read_with(state.reasoning.clone());
    }
    state.seed_items(&mut items);
    let (accepted, events) = state.engine.add(items).await?;
    let reasoning = state
        .reasoning
        .as_ref()
        .zip(accepted.first())
        .map(|(tags, a)| (tags.parser, a.thinking));
    let guard = AbortGuard {
        engine: state.engine.clone(),
        pending: accepted.iter().map(|a| a.id).collect(),
    };
    let object = ResponseObject {
        id,
        created_at: unix_now(),
        model: state.served_model_name.to_string(),
        echo,
        tools: request.tool_calls,
        previous_response_id: previous_id,
        keep,
        guide_field,
        reasoning,
        reasoning_tokens: 0,
    };
    let request_id = format!("resp_{}", object.id);
    let answer = if request.stream {
        Ok(stream_response(object, events, guard, capture))
    } else {
        whole_response(object, events, guard, capture).await
    };
    answer.map(|answer| with_request_id(answer, &request_id))
}

/// What a response object says besides its output.
struct ResponseObject {
    id: String,
    created_at: u64,
    model: String,
    echo: ResponsesEcho,
    /// Tools were offered: calls in the text become `function_call` items.
    tools: bool,
    previous_response_id: Option<String>,
    /// Where the finished response is kept (`None`: `store` false).
    keep: Option<Keep>,
    /// The field whose grammar guides the output, named if it fails while generating.
    guide_field: Option<&'static str>,
    /// On a server with a reasoning parser: the parser, and whether the output begins
    /// thinking. Its thinking becomes a `reasoning` item before the rest.
    reasoning: Option<(ReasoningParser, bool)>,
    /// Output tokens spent thinking (with a reasoning parser), counted as they come.
    reasoning_tokens: usize,
}

/// A response to keep once it is finished, with the conversation it ends.
struct Keep {
    store: Arc<ResponseStore>,
    /// The conversation before the output (chat messages).
    conversation: Vec<Value>,
    /// The request's input as Responses items.
    input_items: Vec<Value>,
    owner: Option<String>,
}

impl ResponseObject {
    /// Keeps the finished response (before a capture's fields join it) with its
    /// conversation: the input's, then the output as the assistant's message.
    fn keep(&mut self, response: &Value, output: &[Value]) {
        let Some(keep) = self.keep.take() else {
            return;
        };
        let mut conversation = keep.conversation;
        conversation.push(assistant_message(output));
        let id = format!("resp_{}", self.id);
        // Items the client sent without an id get one, unique within the store.
        let input_items = keep
            .input_items
            .into_iter()
            .enumerate()
            .map(|(i, mut item)| {
                if !item["id"].is_string() {
                    item["id"] = json!(format!("in_{}_{i}", self.id));
                }
                item
            })
            .collect();
        keep.store
            .put(&id, response.clone(), conversation, input_items, keep.owner);
    }
}

/// A response's output items as the chat message that continues its conversation: the
/// text, its reasoning (which templates such as gpt-oss's write before a call) and the
/// calls it made.
fn assistant_message(output: &[Value]) -> Value {
    let mut text = String::new();
    let mut reasoning = String::new();
    let mut calls = Vec::new();
    for item in output {
        match item["type"].as_str() {
            Some("reasoning") => {
                for part in item["content"].as_array().into_iter().flatten() {
                    reasoning.push_str(part["text"].as_str().unwrap_or_default());
                }
            }
            Some("message") => {
                for part in item["content"].as_array().into_iter().flatten() {
                    text.push_str(part["text"].as_str().unwrap_or_default());
                }
            }
            Some("function_call") => calls.push(json!({
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            })),
            _ => {}
        }
    }
    let mut message = json!({"role": "assistant", "content": text});
    if !calls.is_empty() {
        message["tool_calls"] = Value::Array(calls);
    }
    if !reasoning.is_empty() {
        message["reasoning"] = json!(reasoning);
    }
    message
}

impl ResponseObject {
    fn message_id(&self) -> String {
        format!("msg_{}", self.id)
    }

    fn reasoning_id(&self) -> String {
        format!("rs_{}", self.id)
    }

    /// A `reasoning` item holding one `reasoning_text` part.
    fn reasoning(&self, text: &str, status: &str) -> Value {
        json!({
            "type": "reasoning",
            "id": self.reasoning_id(),
            "status": status,
            "summary": [],
            "content": [reasoning_text(text)],
        })
    }

    fn call_ids(&self, i: usize) -> (String, String) {
        (
            format!("fc_{}_{i}", self.id),
            format!("call_{}_{i}", self.id),
        )
    }

    /// The response object: `status` `in_progress`, `completed` or `incomplete`
    /// (`finish` tells which), its output items and usage.
    fn json(&self, output: Vec<Value>, finish: Option<&Finish>) -> Value {
        let length = finish.is_some_and(|f| f.reason.as_str() == "length");
        let status = match finish {
            None => "in_progress",
            Some(_) if length => "incomplete",
            Some(_) => "completed",
        };
        let usage = finish.map_or(Value::Null, |f| {
            json!({
                "input_tokens": f.prompt_tokens,
                // Every computed token goes through the KV cache; none is billed.
                "input_tokens_details": {"cached_tokens": f.cached_tokens, "cache_write_tokens": 0},
                "output_tokens": f.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                "total_tokens": f.prompt_tokens + f.completion_tokens,
            })
        });
        let e = &self.echo;
        json!({
            "id": format!("resp_{}", self.id),
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": null,
            "incomplete_details": if length { json!({"reason": "max_output_tokens"}) } else { Value::Null },
            "instructions": e.instructions,
            "max_output_tokens": e.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": e.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "completed_at": finish.map(|_| unix_now()),
            "service_tier": "default",
            "reasoning": e.reasoning,
            "store": self.echo.store,
            "temperature": e.temperature,
            "text": e.text,
            "tool_choice": e.tool_choice,
            "tools": e.tools,
            "top_logprobs": e.top_logprobs,
            "top_p": e.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": e.user,
            "metadata": e.metadata,
        })
    }

    /// A `message` item holding one `output_text` part.
    fn message(&self, text: &str, logprobs: Vec<Value>, status: &str) -> Value {
        json!({
            "type": "message",
            "id": self.message_id(),
            "status": status,
            "role": "assistant",
            "content": [output_text(text, logprobs)],
        })
    }

    /// Call `i` as a `function_call` item.
    fn function_call(&self, i: usize, name: &str, arguments: &str, status: &str) -> Value {
        let (id, call_id) = self.call_ids(i);
        json!({
            "type": "function_call",
            "id": id,
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": status,
        })
    }

    /// A finished output's items: its thinking (`split.reasoning`, with a reasoning
    /// parser) as a reasoning item, the answer after it as a message (none when tool
    /// calls are all it holds), then its calls (the parser's, then those in the answer).
    /// The tokens' logprobs go with a message that is the whole output. `status`: the
    /// items' once the output finished ([`item_status`]).
    fn output(&self, split: SplitOutput, logprobs: &[LogprobEntry], status: &str) -> Vec<Value> {
        let SplitOutput {
            reasoning: thought,
            answer: text,
            calls: parsed_calls,
        } = split;
        let mut output = Vec::new();
        let logprobs = if thought.is_some() { &[] } else { logprobs };
        let thought_alone = thought.is_some() && text.is_empty();
        if let Some(thought) = thought {
            // Closed thinking is complete even when the answer was cut short.
            let thinking_status = if text.is_empty() { status } else { "completed" };
            output.push(self.reasoning(&thought, thinking_status));
        }
        let (text_calls, rest) = if self.tools {
            parse_tool_calls(&text)
        } else {
            (Vec::new(), text.clone())
        };
        let calls: Vec<ToolCall> = parsed_calls.into_iter().chain(text_calls).collect();
        if calls.is_empty() {
            // Thinking with nothing after it has no message.
            if !thought_alone {
                output.push(self.message(&text, logprob_entries(logprobs), status));
            }
        } else if !rest.is_empty() {
            output.push(self.message(&rest, Vec::new(), status));
        }
        for (i, call) in calls.iter().enumerate() {
            output.push(self.function_call(i, &call.name, &call.arguments, "completed"));
        }
        output
    }
}

fn output_text(text: &str, logprobs: Vec<Value>) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
}

fn reasoning_text(text: &str) -> Value {
    json!({"type": "reasoning_text", "text": text})
}

/// An output item's status once its sequence finished.
fn item_status(finish: &Finish) -> &'static str {
    if finish.reason.as_str() == "length" {
        "incomplete"
    } else {
        "completed"
    }
}

/// Tokens' logprobs as the Responses API lists them (chat's entries).
fn logprob_entries(entries: &[LogprobEntry]) -> Vec<Value> {
    match chat_logprobs(entries, TokenNames::default())
        .get_mut("content")
        .map(Value::take)
    {
        Some(Value::Array(entries)) => entries,
        _ => Vec::new(),
    }
}

async fn whole_response(
    mut object: ResponseObject,
    mut events: UnboundedReceiver<EngineEvent>,
    mut guard: AbortGuard,
    capture: Option<CaptureDelivery>,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut logprobs = Vec::new();
    // With a reasoning parser: split as it arrives, the thinking tokens counted as a
    // stream counts them.
    let mut thinking = object
        .reasoning
        .map(|(parser, thinking)| ThinkingOutput::new(parser, thinking));
    let mut finish = loop {
        let Some(event) = events.recv().await else {
            return Err(ApiError::unavailable());
        };
        let event = guard.engine.prompter().resolve(event).await?;
        check_index(&event, 1)?;
        match &mut thinking {
            Some(output) => output.push(&event.text, event.token_ids.len()),
            None => text.push_str(&event.text),
        }
        logprobs.extend(event.logprobs);
        if let Some(finish) = event.finish {
            if let Some(error) = engine_failure(&finish, object.guide_field) {
                return Err(error);
            }
            guard.pending.clear();
            break finish;
        }
    };
    let pending_capture = finish.capture.take();
    let split = match thinking {
        Some(output) => {
            object.reasoning_tokens = output.reasoning_tokens();
            output.finish()
        }
        None => SplitOutput {
            answer: text,
            ..SplitOutput::default()
        },
    };
    let output = object.output(split, &logprobs, item_status(&finish));
    let mut whole = object.json(output.clone(), Some(&finish));
    object.keep(&whole, &output);
    if let (Some(capture), Value::Object(obj)) = (&capture, &mut whole) {
        obj.extend(capture.fields(pending_capture).await);
    }
    Ok(Json(whole).into_response())
}

/// The output item a stream is writing.
enum OpenItem {
    Reasoning {
        text: String,
    },
    Message {
        text: String,
        logprobs: Vec<Value>,
    },
    Call {
        index: usize,
        name: String,
        arguments: String,
    },
}

/// The state of a streamed response.
struct ResponseStream {
    object: ResponseObject,
    events: UnboundedReceiver<EngineEvent>,
    prompter: Prompter,
    guard: AbortGuard,
    queue: VecDeque<Event>,
    sequence_number: u64,
    done: bool,
    /// Finished output items.
    output: Vec<Value>,
    open: Option<OpenItem>,
    calls: usize,
    /// With tools: the output turned into content and call deltas as it arrives.
    tool_stream: Option<ToolCallStream>,
    /// With a reasoning parser: the output split into thinking and the rest as it
    /// arrives.
    thinking: Option<ThinkingSplitter>,
    capture: Option<CaptureDelivery>,
    /// The sequence finished; its capture (when asked for) is still to be delivered.
    finished: Option<(Finish, Option<Result<PendingCapture, CaptureFailure>>)>,
}

impl ResponseStream {
    /// Queues one event: its `type` names the SSE event too, and every event carries
    /// the next sequence number.
    fn send_json(&mut self, kind: &str, mut fields: Value) {
        fields["type"] = json!(kind);
        fields["sequence_number"] = json!(self.sequence_number);
        self.sequence_number += 1;
        let event = Event::default().event(kind).data(fields.to_string());
        self.queue.push_back(event);
    }

    fn start(&mut self) {
        let response = self.object.json(Vec::new(), None);
        self.send_json("response.created", json!({"response": response}));
        let response = self.object.json(Vec::new(), None);
        self.send_json("response.in_progress", json!({"response": response}));
    }

    /// Text of the message item, which opens first if it is not open.
    fn text(&mut self, text: &str, logprobs: Vec<Value>) {
        if !matches!(self.open, Some(OpenItem::Message { .. })) {
            self.close(None);
            let item = json!({
                "type": "message",
                "id": self.object.message_id(),
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            });
            self.open_item(item, self.object.message_id(), output_text("", Vec::new()));
            self.open = Some(OpenItem::Message {
                text: String::new(),
                logprobs: Vec::new(),
            });
        }
        if text.is_empty() && logprobs.is_empty() {
            return;
        }
        let fields = json!({
            "item_id": self.object.message_id(),
            "output_index": self.output.len(),
            "content_index": 0,
            "delta": text,
            "logprobs": logprobs,
        });
        if let Some(OpenItem::Message {
            text: all,
            logprobs: all_logprobs,
        }) = &mut self.open
        {
            all.push_str(text);
            all_logprobs.extend(logprobs);
        }
        self.send_json("response.output_text.delta", fields);
    }

    /// Announces a new output item (`item`, whose id is `item_id`) and its first content
    /// part.
    fn open_item(&mut self, item: Value, item_id: String, part: Value) {
        let index = self.output.len();
        self.send_json(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        self.send_json(
            "response.content_part.added",
            json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": part}),
        );
    }

    /// Thinking text, in the reasoning item, which opens first if it is not open.
    fn reasoning(&mut self, text: &str) {
        if !matches!(self.open, Some(OpenItem::Reasoning { .. })) {
            self.close(None);
            let mut item = self.object.reasoning("", "in_progress");
            item["content"] = json!([]);
            self.open_item(item, self.object.reasoning_id(), reasoning_text(""));
            self.open = Some(OpenItem::Reasoning {
                text: String::new(),
            });
        }
        let fields = json!({
            "item_id": self.object.reasoning_id(),
            "output_index": self.output.len(),
            "content_index": 0,
            "delta": text,
        });
        if let Some(OpenItem::Reasoning { text: all }) = &mut self.open {
            all.push_str(text);
        }
        self.send_json("response.reasoning_text.delta", fields);
    }

    /// Ends the open item, if any: its `done` events, and it joins the output.
    fn close(&mut self, finish: Option<&Finish>) {
        let index = self.output.len();
        let status = finish.map_or("completed", item_status);
        let item = match self.open.take() {
            None => return,
            Some(OpenItem::Reasoning { text }) => {
                let id = self.object.reasoning_id();
                self.send_json(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                );
                self.send_json(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": reasoning_text(&text)}),
                );
                self.object.reasoning(&text, status)
            }
            Some(OpenItem::Message { text, logprobs }) => {
                let id = self.object.message_id();
                self.send_json(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": logprobs}),
                );
                self.send_json(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": output_text(&text, logprobs.clone())}),
                );
                self.object.message(&text, logprobs, status)
            }
            Some(OpenItem::Call {
                index: call,
                name,
                arguments,
            }) => {
                let (id, _) = self.object.call_ids(call);
                self.send_json(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "arguments": arguments}),
                );
                self.object
                    .function_call(call, &name, &arguments, "completed")
            }
        };
        self.send_json(
            "response.output_item.done",
            json!({"output_index": index, "item": item.clone()}),
        );
        self.output.push(item);
    }

    fn call_start(&mut self, name: String) {
        self.close(None);
        let index = self.calls;
        self.calls += 1;
        let item = self.object.function_call(index, &name, "", "in_progress");
        self.send_json(
            "response.output_item.added",
            json!({"output_index": self.output.len(), "item": item}),
        );
        self.open = Some(OpenItem::Call {
            index,
            name,
            arguments: String::new(),
        });
    }

    fn call_arguments(&mut self, text: &str) {
        let output_index = self.output.len();
        let Some(OpenItem::Call {
            index, arguments, ..
        }) = &mut self.open
        else {
            return;
        };
        arguments.push_str(text);
        let (id, _) = self.object.call_ids(*index);
        self.send_json(
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": output_index, "delta": text}),
        );
    }

    /// A streamed capture's live row, with the item the token it sampled went to.
    fn capture_row(&mut self, row: Value) {
        let output_index = self.output.len();
        if let Some(OpenItem::Reasoning { .. }) = &self.open {
            self.send_json(
                "response.reasoning_text.delta",
                json!({
                    "item_id": self.object.reasoning_id(),
                    "output_index": output_index,
                    "content_index": 0,
                    "delta": "",
                    "attn_capture_row": row,
                }),
            );
            return;
        }
        if let Some(OpenItem::Call { index, .. }) = &self.open {
            let (id, _) = self.object.call_ids(*index);
            self.send_json(
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": output_index, "delta": "", "attn_capture_row": row}),
            );
            return;
        }
        self.text("", Vec::new());
        self.send_json(
            "response.output_text.delta",
            json!({
                "item_id": self.object.message_id(),
                "output_index": output_index,
                "content_index": 0,
                "delta": "",
                "logprobs": [],
                "attn_capture_row": row,
            }),
        );
    }

    fn on_event(&mut self, event: lantern_engine::serving::ChoiceEvent) {
        if let Some(finish) = &event.finish {
            if let Some(error) = engine_failure(finish, self.object.guide_field) {
                self.fail(&error);
                return;
            }
        }
        let finished = event.finish.is_some();
        let tokens = event.token_ids.len();
        let reasoning_tokens = &mut self.object.reasoning_tokens;
        let pieces = self.thinking.as_mut().map(|splitter| {
            let mut pieces = splitter.push_counted(&event.text, tokens, reasoning_tokens);
            if finished {
                pieces.extend(splitter.finish());
            }
            pieces
        });
        match pieces {
            // Thinking splits the text: its tokens' logprobs are left out, as in the
            // response that is not streamed.
            Some(pieces) => {
                for piece in pieces {
                    match piece {
                        ThinkingPiece::Reasoning(text) => self.reasoning(&text),
                        ThinkingPiece::Answer(text) => self.answer(&text, Vec::new(), false),
                        ThinkingPiece::Call { name } => self.call_start(name),
                        ThinkingPiece::Arguments(text) => self.call_arguments(&text),
                    }
                }
                if finished {
                    self.answer("", Vec::new(), true);
                }
            }
            None => {
                let logprobs = logprob_entries(&event.logprobs);
                self.answer(&event.text, logprobs, finished);
            }
        }
        if let Some(row) = event.capture_row.as_ref() {
            if let Ok(row) = serde_json::to_value(row) {
                self.capture_row(row);
            }
        }
        if let Some(mut finish) = event.finish {
            self.guard.pending.clear();
            if self.output.is_empty() && self.open.is_none() {
                // Every response holds a message, empty or not, unless it called.
                self.text("", Vec::new());
            }
            self.close(Some(&finish));
            let capture = finish.capture.take();
            self.finished = Some((finish, capture));
        }
    }

    /// Text after any thinking: content and, with tools, calls (`finished`: the output's
    /// last text, which ends the tool parser's).
    fn answer(&mut self, text: &str, logprobs: Vec<Value>, finished: bool) {
        match &mut self.tool_stream {
            None => {
                if !text.is_empty() || !logprobs.is_empty() {
                    self.text(text, logprobs);
                }
            }
            Some(stream) => {
                let mut deltas = stream.push(text);
                if finished {
                    deltas.extend(stream.finish());
                }
                for delta in deltas {
                    match delta {
                        ToolDelta::Content(text) => self.text(&text, Vec::new()),
                        ToolDelta::CallStart { name, .. } => self.call_start(name),
                        ToolDelta::Arguments { text, .. } => self.call_arguments(&text),
                    }
                }
            }
        }
    }

    /// The last event: `response.completed` with the whole response, the capture's
    /// fields in it when one was asked for.
    fn complete(&mut self, finish: &Finish, capture_fields: Map<String, Value>) {
        let output = std::mem::take(&mut self.output);
        let mut response = self.object.json(output.clone(), Some(finish));
        self.object.keep(&response, &output);
        if let Value::Object(obj) = &mut response {
            obj.extend(capture_fields);
        }
        // `response.completed` whatever the status (an `incomplete` response says so in
        // it): the `openai` client's stream helpers end on that event only.
        self.send_json("response.completed", json!({"response": response}));
        self.done = true;
    }

    /// An error event (its `error` object as other endpoints send it), ending the stream.
    fn fail(&mut self, error: &ApiError) {
        let mut body = error.body();
        if let Some(e) = body.get("error").cloned() {
            for name in ["message", "code", "param"] {
                body[name] = e[name].clone();
            }
        }
        self.send_json("error", body);
        self.done = true;
    }
}

fn stream_response(
    object: ResponseObject,
    events: UnboundedReceiver<EngineEvent>,
    guard: AbortGuard,
    capture: Option<CaptureDelivery>,
) -> Response {
    let tools = object.tools;
    let thinking = object
        .reasoning
        .map(|(parser, thinking)| ThinkingSplitter::new(parser, thinking));
    let mut state = ResponseStream {
        object,
        events,
        prompter: guard.engine.prompter().clone(),
        guard,
        queue: VecDeque::new(),
        sequence_number: 0,
        done: false,
        output: Vec::new(),
        open: None,
        calls: 0,
        tool_stream: tools.then(ToolCallStream::default),
        thinking,
        capture,
        finished: None,
    };
    state.start();
    Sse::new(sse_events(state))
        .keep_alive(KeepAlive::default())
        .into_response()
}

fn sse_events(state: ResponseStream) -> impl Stream<Item = Result<Event, Infallible>> {
    stream::unfold(state, |mut state| async move {
        loop {
            if let Some(event) = state.queue.pop_front() {
                return Some((Ok(event), state));
            }
            if state.done {
                return None;
            }
            if let Some((finish, pending)) = state.finished.take() {
                let fields = match &state.capture {
                    Some(capture) => capture.fields(pending).await,
                    None => Map::new(),
                };
                state.complete(&finish, fields);
                continue;
            }
            match state.events.recv().await {
                Some(event) => match state
                    .prompter
                    .resolve(event)
                    .await
                    .map_err(ApiError::from)
                    .and_then(|event| check_index(&event, 1).map(|()| event))
                {
                    Ok(event) => state.on_event(event),
                    Err(error) => state.fail(&error),
                },
                None => state.fail(&ApiError::unavailable()),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn object(tools: bool) -> ResponseObject {
        let echo = ResponsesEcho {
            instructions: Value::Null,
            max_output_tokens: Value::Null,
            temperature: 1.0,
            top_p: 1.0,
            top_logprobs: Value::Null,
            tools: Value::Null,
            tool_choice: Value::Null,
            parallel_tool_calls: true,
            text: Value::Null,
            metadata: Value::Null,
            user: Value::Null,
            store: false,
            reasoning: Value::Null,
        };
        ResponseObject {
            id: "r".into(),
            created_at: 0,
            model: "m".into(),
            echo,
            tools,
            previous_response_id: None,
            keep: None,
            guide_field: None,
            reasoning: Some((ReasoningParser::OpenaiGptoss, true)),
            reasoning_tokens: 0,
        }
    }

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    /// Each item's type and its text (reasoning and message) or name and arguments.
    fn items(output: &[Value]) -> Vec<(String, String)> {
        output
            .iter()
            .map(|item| {
                let kind = item["type"].as_str().unwrap_or_default().to_string();
                let said = match kind.as_str() {
                    "function_call" => format!("{}{}", item["name"], item["arguments"]),
                    _ => item["content"][0]["text"].to_string(),
                };
                (kind, said)
            })
            .collect()
    }

    fn item(kind: &str, said: &str) -> (String, String) {
        (kind.to_string(), said.to_string())
    }

    #[test]
    fn a_parsers_calls_follow_the_reasoning_and_the_answer() {
        // Harmony: calls the parser read are items whether or not tools were offered.
        for tools in [false, true] {
            let split = SplitOutput {
                reasoning: Some("Need weather.".into()),
                answer: String::new(),
                calls: vec![call("get_weather", "{}")],
            };
            assert_eq!(
                items(&object(tools).output(split, &[], "completed")),
                vec![
                    item("reasoning", "\"Need weather.\""),
                    item("function_call", "\"get_weather\"\"{}\""),
                ]
            );
        }
        // A preamble as the message, then the parser's call, then a call in the text.
        let split = SplitOutput {
            reasoning: None,
            answer: "Let me look.<tool_call>{\"name\": \"t\", \"arguments\": {}}</tool_call>"
                .into(),
            calls: vec![call("f", "{\"a\": 1}")],
        };
        assert_eq!(
            items(&object(true).output(split, &[], "completed")),
            vec![
                item("message", "\"Let me look.\""),
                item("function_call", "\"f\"\"{\\\"a\\\": 1}\""),
                item("function_call", "\"t\"\"{}\""),
            ]
        );
        // Thinking alone: no message.
        let split = SplitOutput {
            reasoning: Some("Hmm".into()),
            ..SplitOutput::default()
        };
        assert_eq!(
            items(&object(false).output(split, &[], "incomplete")),
            vec![item("reasoning", "\"Hmm\"")]
        );
    }
}
