//! OpenAI's Responses API (`POST /v1/responses`) validated into the same typed request as
//! a chat completion: `instructions` and `input` become the chat's messages,
//! `max_output_tokens` its token limit, `text.format` its structured output, the flat
//! `tools` chat's, and `include: ["message.output_text.logprobs"]` with `top_logprobs`
//! its logprobs. Sampling fields (and vLLM's and lantern's own, capture included) are
//! chat's. What the response repeats of the request is kept in [`ResponsesEcho`].
//!
//! A follow-up names the response it continues (`previous_response_id`): the server
//! keeps each response's conversation and passes it here, before the new input.
//! `conversation` (server-side conversations) and `background` are refused.

use super::body::{
    generation_request, unknown_fields, Endpoint, GenerationRequest, RequestContext,
};
use super::InvalidRequest;
use serde_json::{json, Map, Value};

/// Most alternatives per token (`top_logprobs`), as on chat.
const MAX_TOP_LOGPROBS: i64 = 20;
/// The `include` value that asks for the output text's logprobs.
const INCLUDE_LOGPROBS: &str = "message.output_text.logprobs";

/// Fields of the Responses API this endpoint reads or accepts.
const RESPONSES_FIELD_NAMES: &[&str] = &[
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "include",
    "top_logprobs",
    "stream",
    "store",
    "metadata",
    "user",
    "temperature",
    "top_p",
    "previous_response_id",
    "conversation",
    "background",
    // Its `effort` goes to the chat template as `reasoning_effort`.
    "reasoning",
    // Accepted, with nothing to do: no truncation, one service tier.
    "truncation",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
];

/// Chat fields a Responses body may carry as extensions (the `openai` client's
/// `extra_body`), read as on chat.
const CHAT_EXTENSION_NAMES: &[&str] = &[
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "truncate_prompt_tokens",
    "chat_template_kwargs",
    "chat_template",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "cache_salt",
];

/// What a response object repeats of its request (OpenAI's response carries them).
#[derive(Debug, Clone)]
pub struct ResponsesEcho {
    pub instructions: Value,
    pub max_output_tokens: Value,
    pub temperature: f64,
    pub top_p: f64,
    pub top_logprobs: Value,
    /// The tools as the request gave them (Responses' flat shape).
    pub tools: Value,
    pub tool_choice: Value,
    pub parallel_tool_calls: bool,
    /// `{"format": …}`, `{"format": {"type": "text"}}` when not given.
    pub text: Value,
    pub metadata: Value,
    pub user: Value,
    /// Whether the response is to be kept (`store`, true unless the request says false).
    pub store: bool,
    /// `reasoning` as the request gave it (`{"effort": null, "summary": null}` when not),
    /// echoed as OpenAI's API does; its effort is the template's `reasoning_effort`.
    pub reasoning: Value,
}

/// A validated Responses request: the chat request it runs as, what its response
/// repeats, and its conversation for a follow-up to continue.
#[derive(Debug, Clone)]
pub struct ResponsesRequest {
    pub generation: GenerationRequest,
    pub echo: ResponsesEcho,
    /// The conversation before the output: the continued response's, then this
    /// request's input, as chat messages (no instructions: a follow-up gives its own).
    pub conversation: Vec<Value>,
    /// This request's input as Responses items (a string as one user message; content
    /// given as a string as one text part), for `GET /v1/responses/{id}/input_items`.
    pub input_items: Vec<Value>,
}

/// The response a body continues (`previous_response_id`), if it names one.
pub fn previous_response_id(body: &Value) -> Result<Option<String>, InvalidRequest> {
    match body.get("previous_response_id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(id)) if !id.is_empty() => Ok(Some(id.clone())),
        Some(_) => Err(InvalidRequest::invalid(
            "previous_response_id",
            "previous_response_id must be a response's id (a non-empty string)",
        )),
    }
}

/// Validates a `POST /v1/responses` body; `previous` is the conversation of the
/// response it continues (chat messages, as [`ResponsesRequest::conversation`] gave
/// them), empty when it continues none.
pub fn responses_request(
    body: &Value,
    context: &RequestContext,
    previous: &[Value],
) -> Result<ResponsesRequest, InvalidRequest> {
    let obj = body
        .as_object()
        .ok_or_else(|| InvalidRequest::Body("the body must be a JSON object".into()))?;
    check_types(obj)?;
    let present = |name: &str| obj.get(name).filter(|v| !v.is_null());
    if present("conversation").is_some() {
        return Err(InvalidRequest::unsupported(
            "conversation",
            "conversation (continue one with previous_response_id, or send it whole as input)",
        ));
    }
    if present("background").and_then(Value::as_bool) == Some(true) {
        return Err(InvalidRequest::unsupported(
            "background",
            "background responses",
        ));
    }
    if present("use_beam_search").and_then(Value::as_bool) == Some(true) {
        return Err(InvalidRequest::unsupported(
            "use_beam_search",
            "beam search in the Responses API (ask chat completions for it)",
        ));
    }
    if let Some(n) = present("n") {
        if n.as_i64() != Some(1) {
            return Err(InvalidRequest::invalid(
                "n",
                "a response has one output: ask chat completions for several samples",
            ));
        }
    }
    let mut chat = Map::new();
    for (name, value) in obj {
        let extension = CHAT_EXTENSION_NAMES.contains(&name.as_str());
        let shared = matches!(name.as_str(), "model" | "temperature" | "top_p" | "stream");
        if extension || shared || name.starts_with("attn_capture") {
            chat.insert(name.clone(), value.clone());
        }
    }
    let mut conversation = previous.to_vec();
    conversation.extend(input_messages(obj)?);
    check_call_outputs(&conversation)?;
    let mut messages = instructions(obj)?;
    messages.extend(conversation.iter().cloned());
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(max) = present("max_output_tokens") {
        chat.insert("max_completion_tokens".into(), max.clone());
    }
    if let Some(format) = text_format(present("text"))? {
        chat.insert("response_format".into(), format);
    }
    if let Some(tools) = present("tools") {
        chat.insert("tools".into(), chat_tools(tools)?);
    }
    if let Some(choice) = present("tool_choice") {
        chat.insert("tool_choice".into(), chat_tool_choice(choice));
    }
    if let Some(effort) = present("reasoning").and_then(|r| r.get("effort")) {
        chat.insert("reasoning_effort".into(), effort.clone());
    }
    let top_logprobs = match present("top_logprobs") {
        None => None,
        Some(v) => match v.as_i64() {
            Some(n) if (0..=MAX_TOP_LOGPROBS).contains(&n) => Some(n),
            _ => {
                return Err(InvalidRequest::out_of_range(
                    "top_logprobs",
                    format!("an integer in [0, {MAX_TOP_LOGPROBS}]"),
                    v,
                ))
            }
        },
    };
    if includes_logprobs(present("include"))? || top_logprobs.is_some_and(|n| n > 0) {
        chat.insert("logprobs".into(), json!(true));
        chat.insert("top_logprobs".into(), json!(top_logprobs.unwrap_or(0)));
    }
    let chat = Value::Object(chat);
    let mut generation = generation_request(Endpoint::Chat, &chat, context).map_err(renamed)?;
    for item in &mut generation.items {
        item.prompt_field = "input";
        item.max_tokens_field = "max_output_tokens";
    }
    generation.ignored_fields = unknown_fields(body, |k| {
        RESPONSES_FIELD_NAMES.contains(&k) || CHAT_EXTENSION_NAMES.contains(&k) || k == "n"
    });
    let number = |name: &str| present(name).and_then(Value::as_f64).unwrap_or(1.0);
    let echo = ResponsesEcho {
        instructions: present("instructions").cloned().unwrap_or(Value::Null),
        max_output_tokens: present("max_output_tokens").cloned().unwrap_or(Value::Null),
        temperature: number("temperature"),
        top_p: number("top_p"),
        top_logprobs: top_logprobs.map_or(Value::Null, |n| json!(n)),
        tools: present("tools").cloned().unwrap_or_else(|| json!([])),
        tool_choice: present("tool_choice")
            .cloned()
            .unwrap_or_else(|| json!("auto")),
        parallel_tool_calls: present("parallel_tool_calls")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        text: match present("text") {
            Some(text) if text.get("format").is_some() => text.clone(),
            _ => json!({"format": {"type": "text"}}),
        },
        metadata: present("metadata").cloned().unwrap_or_else(|| json!({})),
        user: present("user").cloned().unwrap_or(Value::Null),
        store: present("store").and_then(Value::as_bool).unwrap_or(true),
        reasoning: present("reasoning")
            .cloned()
            .unwrap_or_else(|| json!({"effort": null, "summary": null})),
    };
    Ok(ResponsesRequest {
        generation,
        echo,
        conversation,
        input_items: input_as_items(obj.get("input")),
    })
}

/// A field's name, what it must be (for the message), and the check that it is.
type FieldType = (&'static str, &'static str, fn(&Value) -> bool);

/// Responses fields this endpoint echoes or takes as they are, and the type each must
/// have (OpenAI's), so that a wrong one is a 400 rather than read as its default.
const FIELD_TYPES: &[FieldType] = &[
    ("store", "a boolean", Value::is_boolean),
    ("parallel_tool_calls", "a boolean", Value::is_boolean),
    ("background", "a boolean", Value::is_boolean),
    ("text", "an object ({\"format\": …})", Value::is_object),
    ("reasoning", "an object", Value::is_object),
    ("metadata", "an object of strings", |v| {
        v.as_object()
            .is_some_and(|m| m.values().all(Value::is_string))
    }),
    ("truncation", "\"auto\" or \"disabled\"", |v| {
        matches!(v.as_str(), Some("auto" | "disabled"))
    }),
    ("user", "a string", Value::is_string),
    ("service_tier", "a string", Value::is_string),
    ("prompt_cache_key", "a string", Value::is_string),
    ("safety_identifier", "a string", Value::is_string),
];

/// Refuses a field of [`FIELD_TYPES`] of the wrong type, naming it (null is absent).
fn check_types(obj: &Map<String, Value>) -> Result<(), InvalidRequest> {
    for &(name, what, holds) in FIELD_TYPES {
        match obj.get(name) {
            Some(value) if !value.is_null() && !holds(value) => {
                return Err(InvalidRequest::invalid(
                    name,
                    format!("{name} must be {what}"),
                ))
            }
            _ => {}
        }
    }
    Ok(())
}

/// The Responses field a chat field was made from.
fn responses_field(chat_field: &str) -> Option<&'static str> {
    match chat_field {
        "messages" => Some("input"),
        "max_completion_tokens" | "max_tokens" => Some("max_output_tokens"),
        "response_format" => Some("text"),
        "logprobs" => Some("include"),
        "reasoning_effort" => Some("reasoning.effort"),
        _ => None,
    }
}

/// A chat field's error, naming the Responses field it came from (in its message too:
/// the client never sent the chat field), and the Responses names of other chat fields
/// its message mentions.
fn renamed(mut e: InvalidRequest) -> InvalidRequest {
    let mention = |message: &mut String| {
        for chat in [
            "max_completion_tokens",
            "response_format",
            "reasoning_effort",
        ] {
            if let Some(name) = responses_field(chat) {
                *message = message.replace(chat, name);
            }
        }
    };
    match &mut e {
        InvalidRequest::Conflict { field: f, message }
        | InvalidRequest::Invalid { field: f, message }
        | InvalidRequest::Unsupported {
            field: f,
            what: message,
        } => {
            if let Some(name) = responses_field(f) {
                *message = message.replace(*f, name);
                *f = name;
            }
            mention(message);
        }
        InvalidRequest::Missing(f) | InvalidRequest::OutOfRange { field: f, .. } => {
            if let Some(name) = responses_field(f) {
                *f = name;
            }
        }
        InvalidRequest::WrongType {
            field: Some(f),
            message,
        } => {
            if let Some(name) = responses_field(f) {
                *message = message.replacen(f.as_str(), name, 1);
                *f = name.to_string();
            }
            mention(message);
        }
        _ => {}
    }
    e
}

/// OpenAI's other `include` values: accepted, with nothing to add (no tool here
/// searches, runs code or reasons). Any other value is a typo, refused.
const INCLUDE_NOTHING_TO_ADD: &[&str] = &[
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "reasoning.encrypted_content",
    "web_search_call.action.sources",
    "web_search_call.results",
];

/// Whether `include` asks for the output text's logprobs.
fn includes_logprobs(include: Option<&Value>) -> Result<bool, InvalidRequest> {
    match include {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Array(items)) => {
            let mut logprobs = false;
            for item in items {
                let name = item.as_str().ok_or_else(|| {
                    InvalidRequest::invalid("include", "include must be a list of strings")
                })?;
                if name != INCLUDE_LOGPROBS && !INCLUDE_NOTHING_TO_ADD.contains(&name) {
                    return Err(InvalidRequest::invalid(
                        "include",
                        format!(
                            "include has an unknown value {name:?}; the values are \
                             {INCLUDE_LOGPROBS:?} and OpenAI's {}",
                            INCLUDE_NOTHING_TO_ADD.join(", ")
                        ),
                    ));
                }
                logprobs |= name == INCLUDE_LOGPROBS;
            }
            Ok(logprobs)
        }
        Some(_) => Err(InvalidRequest::invalid(
            "include",
            "include must be a list of strings",
        )),
    }
}

/// `instructions` as a system message (none when not given).
fn instructions(obj: &Map<String, Value>) -> Result<Vec<Value>, InvalidRequest> {
    match obj.get("instructions") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![json!({"role": "system", "content": s})]),
        Some(_) => Err(InvalidRequest::invalid(
            "instructions",
            "instructions must be a string",
        )),
    }
}

/// `input` as chat messages: a string (one user message) or a list of messages,
/// function calls and their outputs.
fn input_messages(obj: &Map<String, Value>) -> Result<Vec<Value>, InvalidRequest> {
    let mut messages = Vec::new();
    match obj.get("input") {
        None | Some(Value::Null) => return Err(InvalidRequest::Missing("input")),
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) if !items.is_empty() => {
            for (i, item) in items.iter().enumerate() {
                input_item(i, item, &mut messages)?;
            }
        }
        Some(_) => {
            return Err(InvalidRequest::invalid(
                "input",
                "input must be a string or a non-empty list of input items",
            ))
        }
    }
    Ok(messages)
}

/// Every function call output answers a call made before it in the conversation (its
/// input, or the response it continues), as OpenAI's API requires: an unknown `call_id`
/// is a mistake to name, not a result to show the model.
fn check_call_outputs(conversation: &[Value]) -> Result<(), InvalidRequest> {
    let mut calls = std::collections::HashSet::new();
    for message in conversation {
        for call in message["tool_calls"].as_array().into_iter().flatten() {
            calls.insert(call["id"].as_str().unwrap_or_default());
        }
        if message["role"] == "tool" {
            let id = message["tool_call_id"].as_str().unwrap_or_default();
            if !calls.contains(id) {
                return Err(InvalidRequest::invalid(
                    "input",
                    format!("no function call with call_id `{id}` comes before its function_call_output (give the call in input, or continue its response with previous_response_id)"),
                ));
            }
        }
    }
    Ok(())
}

/// Input (validated) as the Responses API lists it: items with their content as parts.
fn input_as_items(input: Option<&Value>) -> Vec<Value> {
    let message = |role: &Value, text: &Value| {
        let kind = if role == "assistant" {
            "output_text"
        } else {
            "input_text"
        };
        json!({"type": "message", "role": role, "content": [{"type": kind, "text": text}]})
    };
    match input {
        Some(text @ Value::String(_)) => vec![message(&json!("user"), text)],
        Some(Value::Array(items)) => items
            .iter()
            .map(|item| {
                let mut item = item.clone();
                if item.get("type").is_none() {
                    item["type"] = json!("message");
                }
                if item["type"] == "message" && item["content"].is_string() {
                    let id = item.get("id").cloned();
                    item = message(&item["role"], &item["content"]);
                    if let Some(id) = id {
                        item["id"] = id;
                    }
                }
                item
            })
            .collect(),
        _ => Vec::new(),
    }
}

/// One input item as chat messages: a message (its text parts joined), a function call
/// (joined to the assistant message of the calls just before it) or a call's output (a
/// tool message).
fn input_item(i: usize, item: &Value, messages: &mut Vec<Value>) -> Result<(), InvalidRequest> {
    let at = |what: String| InvalidRequest::invalid("input", format!("input[{i}]: {what}"));
    let obj = item
        .as_object()
        .ok_or_else(|| at("an input item must be an object".into()))?;
    let text_field = |name: &str| match obj.get(name) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(at(format!("`{name}` must be a string"))),
    };
    match obj.get("type").and_then(Value::as_str).unwrap_or("message") {
        "message" => {
            let role = text_field("role")?;
            if !matches!(role.as_str(), "user" | "assistant" | "system" | "developer") {
                return Err(at(format!(
                    "unknown role `{role}` (expected user, assistant, system or developer)"
                )));
            }
            let content = match obj.get("content") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => message_text(i, parts)?,
                _ => {
                    return Err(at(
                        "`content` must be a string or a list of content parts".into()
                    ))
                }
            };
            match messages.last_mut() {
                // The answer after a reasoning item given back: one assistant message.
                Some(last) if role == "assistant" && bare_reasoning(last) => {
                    last["content"] = json!(content)
                }
                _ => messages.push(json!({"role": role, "content": content})),
            }
        }
        "function_call" => {
            let call = json!({
                "id": text_field("call_id")?,
                "type": "function",
                "function": {"name": text_field("name")?, "arguments": text_field("arguments")?},
            });
            let joins = messages.last().is_some_and(|m| {
                m["role"] == "assistant"
                    && m["content"] == ""
                    && (m.get("tool_calls").is_some() || bare_reasoning(m))
            });
            match messages.last_mut() {
                Some(Value::Object(last)) if joins => {
                    let calls = last.entry("tool_calls").or_insert_with(|| json!([]));
                    if let Value::Array(calls) = calls {
                        calls.push(call);
                    }
                }
                _ => {
                    messages.push(json!({"role": "assistant", "content": "", "tool_calls": [call]}))
                }
            }
        }
        "function_call_output" => {
            let output = match obj.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => message_text(i, parts)?,
                _ => {
                    return Err(at(
                        "`output` must be a string or a list of content parts".into()
                    ))
                }
            };
            messages.push(json!({
                "role": "tool",
                "tool_call_id": text_field("call_id")?,
                "content": output,
            }));
        }
        // Reasoning a client gives back (a reasoning parser's item): the reasoning of
        // the assistant message, or calls, that follow it, for templates that write it
        // (gpt-oss's before a call). An item without text (a summary only) adds nothing.
        "reasoning" => {
            let text: String = obj
                .get("content")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(|part| part.get("text").and_then(Value::as_str))
                .collect();
            if !text.is_empty() {
                messages.push(json!({"role": "assistant", "content": "", "reasoning": text}));
            }
        }
        other => {
            return Err(InvalidRequest::unsupported(
                "input",
                format!("input[{i}]: input items of type `{other}`"),
            ))
        }
    }
    Ok(())
}

/// Whether `message` is an assistant's reasoning given back, with no answer or calls yet.
fn bare_reasoning(message: &Value) -> bool {
    message["role"] == "assistant"
        && message["content"] == ""
        && message.get("reasoning").is_some()
        && message.get("tool_calls").is_none()
}

/// The text of a message's content parts (`input_text`, `output_text`).
fn message_text(i: usize, parts: &[Value]) -> Result<String, InvalidRequest> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        match part.get("type").and_then(Value::as_str) {
            Some("input_text" | "output_text" | "text") => match part.get("text") {
                Some(Value::String(t)) => text.push_str(t),
                _ => {
                    return Err(InvalidRequest::invalid(
                        "input",
                        format!("input[{i}].content[{j}]: a text part needs a `text` string"),
                    ))
                }
            },
            Some(other) => {
                return Err(InvalidRequest::unsupported(
                    "input",
                    format!("input[{i}].content[{j}]: content of type `{other}` (text only)"),
                ))
            }
            None => {
                return Err(InvalidRequest::invalid(
                    "input",
                    format!("input[{i}].content[{j}]: a content part needs a `type`"),
                ))
            }
        }
    }
    Ok(text)
}

/// `text.format` as chat's `response_format` (`None` for plain text).
fn text_format(text: Option<&Value>) -> Result<Option<Value>, InvalidRequest> {
    let Some(text) = text else {
        return Ok(None);
    };
    let wrong = |what: &str| InvalidRequest::invalid("text", format!("text.format: {what}"));
    let format = match text.get("format") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(f)) => f,
        Some(_) => return Err(wrong("must be an object")),
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for name in ["name", "schema", "strict", "description"] {
                if let Some(v) = format.get(name) {
                    schema.insert(name.into(), v.clone());
                }
            }
            if !schema.contains_key("schema") {
                return Err(wrong("a json_schema format needs `schema`"));
            }
            Ok(Some(
                json!({"type": "json_schema", "json_schema": Value::Object(schema)}),
            ))
        }
        _ => Err(wrong("`type` must be text, json_object or json_schema")),
    }
}

/// Responses' flat function tools (`{"type": "function", "name", "parameters"}`) in
/// chat's shape; other tool types (search, files, computers) are not offered here.
fn chat_tools(tools: &Value) -> Result<Value, InvalidRequest> {
    let Value::Array(tools) = tools else {
        return Err(InvalidRequest::invalid("tools", "tools must be a list"));
    };
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| match tool.get("type").and_then(Value::as_str) {
            Some("function") => {
                let mut function = Map::new();
                for name in ["name", "description", "parameters", "strict"] {
                    if let Some(v) = tool.get(name) {
                        function.insert(name.into(), v.clone());
                    }
                }
                Ok(json!({"type": "function", "function": Value::Object(function)}))
            }
            other => Err(InvalidRequest::unsupported(
                "tools",
                format!(
                    "tools[{i}]: tools of type `{}` (function tools only)",
                    other.unwrap_or("none")
                ),
            )),
        })
        .collect()
}

/// Responses' `tool_choice` (`{"type": "function", "name"}` for one function) in chat's
/// shape; the strings are the same.
fn chat_tool_choice(choice: &Value) -> Value {
    match choice.get("name") {
        Some(name) if choice.get("type").and_then(Value::as_str) == Some("function") => {
            json!({"type": "function", "function": {"name": name}})
        }
        _ => choice.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::{CaptureSettings, ModelLimits, Seen};

    fn validate(body: Value) -> Result<ResponsesRequest, Seen> {
        continuing(body, &[])
    }

    /// Validates `body` as a follow-up of a response whose conversation was `previous`.
    fn continuing(body: Value, previous: &[Value]) -> Result<ResponsesRequest, Seen> {
        let settings = CaptureSettings::default();
        let context = RequestContext {
            limits: ModelLimits {
                served_name: "m",
                aliases: &[],
            },
            capture: &settings,
            num_layers: 2,
            num_heads: 2,
        };
        responses_request(&body, &context, previous).map_err(Seen::from)
    }

    fn chat_messages(r: &ResponsesRequest) -> Vec<(String, String)> {
        match &*r.generation.items[0].prompt {
            crate::serving::PromptInput::Chat(messages, _) => messages
                .iter()
                .map(|m| (m.role.clone(), m.content.clone()))
                .collect(),
            other => panic!("not a chat prompt: {other:?}"),
        }
    }

    #[test]
    fn reasoning_given_back_goes_with_the_calls_or_answer_after_it() {
        let reasoning = |text: &str| {
            json!({"type": "reasoning", "id": "rs_1", "summary": [],
                   "content": [{"type": "reasoning_text", "text": text}]})
        };
        let r = validate(json!({
            "input": [
                {"role": "user", "content": "Weather in Oslo?"},
                reasoning("Need the weather."),
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                reasoning("It is sunny."),
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
                {"role": "user", "content": "Thanks"},
            ],
        }))
        .unwrap();
        let crate::serving::PromptInput::Chat(messages, _) = &*r.generation.items[0].prompt else {
            panic!("not a chat prompt");
        };
        let seen: Vec<_> = messages
            .iter()
            .map(|m| {
                let calls = m.tool_calls.as_ref().map_or(0, Vec::len);
                (
                    m.role.as_str(),
                    m.content.as_str(),
                    m.reasoning.as_deref(),
                    calls,
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                ("user", "Weather in Oslo?", None, 0),
                ("assistant", "", Some("Need the weather."), 1),
                ("tool", "sunny", None, 0),
                ("assistant", "Sunny.", Some("It is sunny."), 0),
                ("user", "Thanks", None, 0),
            ]
        );
    }

    #[test]
    fn the_reasoning_effort_reaches_the_template() {
        let r = validate(json!({"input": "Hi", "reasoning": {"effort": "low"}})).unwrap();
        match &*r.generation.items[0].prompt {
            crate::serving::PromptInput::Chat(_, options) => {
                assert_eq!(options.kwargs["reasoning_effort"], json!("low"))
            }
            other => panic!("not a chat prompt: {other:?}"),
        }
        assert_eq!(r.echo.reasoning, json!({"effort": "low"}));
        let err = validate(json!({"input": "Hi", "reasoning": {"effort": "extreme"}})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("reasoning.effort"));
        assert!(
            err.message.starts_with("reasoning.effort must be one of"),
            "{}",
            err.message
        );
        assert!(validate(json!({"input": "Hi", "reasoning": {"effort": null}})).is_ok());
    }

    #[test]
    fn instructions_and_input_become_the_chats_messages() {
        let r = validate(json!({"model": "m", "input": "Hi", "instructions": "Be brief"})).unwrap();
        assert_eq!(
            chat_messages(&r),
            [
                ("system".into(), "Be brief".into()),
                ("user".into(), "Hi".into())
            ]
        );
        assert_eq!(r.generation.n, 1);
        assert_eq!(r.generation.items[0].max_tokens, None);
        let r = validate(json!({
            "input": [
                {"role": "developer", "content": "Answer in French"},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": " there"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour"}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
                {"type": "function_call_output", "call_id": "c1", "output": "one"},
                {"type": "reasoning", "summary": []},
            ],
            "max_output_tokens": 7,
        }))
        .unwrap();
        let roles: Vec<String> = chat_messages(&r).into_iter().map(|m| m.0).collect();
        assert_eq!(roles, ["system", "user", "assistant", "assistant", "tool"]);
        assert_eq!(chat_messages(&r)[1].1, "Hello there");
        assert_eq!(r.generation.items[0].max_tokens, Some(7));
        match &*r.generation.items[0].prompt {
            crate::serving::PromptInput::Chat(messages, _) => {
                let calls = messages[3].tool_calls.as_ref().expect("the calls joined");
                assert_eq!(calls.len(), 2);
                assert_eq!(messages[4].tool_call_id.as_deref(), Some("c1"));
            }
            other => panic!("not a chat prompt: {other:?}"),
        }
    }

    #[test]
    fn a_follow_up_continues_the_previous_conversation() {
        let previous = [
            json!({"role": "user", "content": "Hi"}),
            json!({"role": "assistant", "content": "Hello"}),
        ];
        let body = json!({"input": "And now?", "instructions": "Be kind", "previous_response_id": "resp_1"});
        assert_eq!(previous_response_id(&body), Ok(Some("resp_1".into())));
        let r = continuing(body, &previous).unwrap();
        let roles: Vec<String> = chat_messages(&r).into_iter().map(|m| m.0).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        // A follow-up of this one inherits the conversation, not the instructions.
        let contents: Vec<&str> = r
            .conversation
            .iter()
            .filter_map(|m| m["content"].as_str())
            .collect();
        assert_eq!(contents, ["Hi", "Hello", "And now?"]);
        assert!(r.echo.store);
        for bad in [json!(3), json!("")] {
            let e = previous_response_id(&json!({"previous_response_id": bad})).unwrap_err();
            assert_eq!(e.field(), Some("previous_response_id"));
        }
        let unstored = validate(json!({"input": "x", "store": false})).unwrap();
        assert!(!unstored.echo.store);
    }

    #[test]
    fn fields_map_onto_chats() {
        let r = validate(json!({
            "input": "Hi",
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "include": ["message.output_text.logprobs"],
            "top_logprobs": 3,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
            "tools": [{"type": "function", "name": "get", "parameters": {"type": "object"}}],
            "tool_choice": "auto",
            "store": true,
            "metadata": {"k": "v"},
            "made_up": 1,
        }))
        .unwrap();
        let params = &r.generation.items[0].params;
        assert_eq!(
            (params.temperature, params.top_p, params.top_k),
            (0.5, 0.9, 5)
        );
        assert_eq!(params.logprobs, Some(3));
        assert!(r.generation.logprobs);
        assert_eq!(
            r.generation.guide.as_ref().map(|g| g.field),
            Some("response_format")
        );
        assert!(r.generation.tool_calls);
        assert_eq!(r.generation.ignored_fields, ["made_up"]);
        assert_eq!(r.echo.metadata, json!({"k": "v"}));
        assert_eq!(r.echo.temperature, 0.5);
        assert_eq!(r.echo.text["format"]["name"], "x");
        let plain = validate(json!({"input": "Hi"})).unwrap();
        assert!(!plain.generation.logprobs);
        assert_eq!(plain.echo.text, json!({"format": {"type": "text"}}));
        assert_eq!(plain.echo.tool_choice, "auto");
        let named = validate(json!({
            "input": "Hi",
            "tools": [{"type": "function", "name": "get"}],
            "tool_choice": {"type": "function", "name": "get"},
        }))
        .unwrap();
        assert!(named.generation.guide.is_some(), "a named tool constrains");
    }

    #[test]
    fn errors_name_the_responses_fields() {
        let refused = |body: Value, param: &str, words: &str| {
            let e = validate(body).expect_err(param);
            assert_eq!(e.param.as_deref(), Some(param), "{}", e.message);
            assert!(e.message.contains(words), "{param}: {}", e.message);
        };
        refused(json!({}), "input", "required");
        refused(json!({"input": []}), "input", "non-empty");
        refused(json!({"input": 3}), "input", "string or");
        refused(
            json!({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
            "input",
            "input_image",
        );
        refused(
            json!({"input": [{"role": "robot", "content": "x"}]}),
            "input",
            "robot",
        );
        refused(
            json!({"input": [{"type": "web_search_call"}]}),
            "input",
            "web_search_call",
        );
        refused(
            json!({"input": [{"type": "function_call", "name": "f"}]}),
            "input",
            "call_id",
        );
        refused(
            json!({"input": "x", "max_output_tokens": -1}),
            "max_output_tokens",
            "at least",
        );
        refused(
            json!({"input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
            "max_output_tokens must be at least 1",
        );
        refused(
            json!({"input": "x", "tool_choice": "required"}),
            "tool_choice",
            "needs `tools`",
        );
        refused(
            json!({"input": "x", "max_output_tokens": "many"}),
            "max_output_tokens",
            "max_output_tokens",
        );
        refused(
            json!({"input": "x", "temperature": -1}),
            "temperature",
            ">= 0",
        );
        refused(
            json!({"input": "x", "top_logprobs": 21}),
            "top_logprobs",
            "[0, 20]",
        );
        refused(json!({"input": "x", "include": "all"}), "include", "list");
        refused(
            json!({"input": "x", "include": ["message.output_text.logprob"]}),
            "include",
            "unknown value",
        );
        let known = json!({"input": "x", "include": ["reasoning.encrypted_content"]});
        assert!(validate(known).is_ok());
        refused(
            json!({"input": "x", "text": {"format": {"type": "yaml"}}}),
            "text",
            "json_schema",
        );
        refused(
            json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}),
            "text",
            "schema",
        );
        refused(
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools",
            "web_search",
        );
        refused(
            json!({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}}),
            "tool_choice",
            "`g`",
        );
        refused(
            json!({"input": "x", "conversation": "conv_1"}),
            "conversation",
            "previous_response_id",
        );
        refused(
            json!({"input": "x", "background": true}),
            "background",
            "background",
        );
        refused(json!({"input": "x", "n": 2}), "n", "one output");
        refused(json!({"input": "x", "model": "other"}), "model", "other");
        refused(
            json!({"input": "x", "instructions": 1}),
            "instructions",
            "string",
        );
    }
}
