//! One prompt's request, from the body the server would receive to sequences on the
//! engine: the engine's one validation (`lantern_engine::validate`, which the server runs
//! too), so that a call means what the same HTTP request means and fails with the same
//! field named.

use lantern_engine::reasoning::ThinkTags;
use lantern_engine::serving::{EngineEvent, EngineHandle, PromptInput, ServeError};
use lantern_engine::validate::capture::CAPTURE_FIELDS;
use lantern_engine::validate::{
    self, CaptureSettings, Endpoint, InvalidRequest, ModelLimits, RequestContext,
};
use lantern_kv::RequestId;
use serde_json::{Map, Value};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

/// The keys of a `capture=` dict: the server's capture fields without `attn_capture_`,
/// but `delivery`, which is HTTP's alone (here the maps are numpy arrays in the output).
fn capture_keys() -> impl Iterator<Item = &'static str> {
    CAPTURE_FIELDS
        .iter()
        .filter_map(|f| f.strip_prefix("attn_capture_"))
        .filter(|&key| key != "delivery")
}

/// The body's capture fields for a `capture=` dict (`None`: no capture).
pub fn capture_fields(
    capture: Option<&Map<String, Value>>,
) -> Result<Map<String, Value>, InvalidRequest> {
    let mut fields = Map::new();
    let Some(capture) = capture else {
        return Ok(fields);
    };
    for (key, value) in capture {
        if let Some(short) = key
            .strip_prefix("attn_capture_")
            .filter(|short| capture_keys().any(|k| k == *short))
        {
            // Said without the HTTP name, which Python's messages rewrite.
            return Err(InvalidRequest::invalid(
                "capture",
                format!(
                    "capture's keys are the request fields without their prefix: use {short:?}"
                ),
            ));
        }
        if !capture_keys().any(|k| k == key) {
            return Err(InvalidRequest::invalid(
                "capture",
                format!(
                    "capture[{key:?}] is not a capture option; they are {}",
                    capture_keys().collect::<Vec<_>>().join(", ")
                ),
            ));
        }
        fields.insert(format!("attn_capture_{key}"), value.clone());
    }
    fields.insert("attn_capture".into(), Value::Bool(true));
    Ok(fields)
}

/// A request the engine took.
pub struct Submitted {
    pub ids: Vec<RequestId>,
    pub prompt_token_ids: Arc<[u32]>,
    pub events: UnboundedReceiver<EngineEvent>,
    pub captures: bool,
}

/// Bodies from Python name no model: an `LLM` serves one.
const LIMITS: ModelLimits<'static> = ModelLimits {
    served_name: "",
    aliases: &[],
};

/// Validates a body as the server would, without an engine (SamplingParams checks
/// itself when it is made): the sampling fields with a placeholder prompt.
pub fn check_sampling(mut body: Map<String, Value>) -> Result<(), InvalidRequest> {
    body.insert("prompt".into(), Value::from("x"));
    validate::completion_request(&Value::Object(body), &LIMITS)?;
    Ok(())
}

/// Token ids of a `/tokenize` body (a `prompt`, or chat `messages` with the rendering
/// fields), as the server's `/tokenize` gives them.
pub async fn tokenize(engine: &EngineHandle, body: &Value) -> Result<Vec<u32>, ServeError> {
    let request = validate::tokenize_request(body, &LIMITS)?;
    engine
        .tokenize(request.prompt, request.add_special_tokens)
        .await
}

/// Validates `body` (plus the capture fields) as the server does and submits it.
pub async fn submit(
    engine: &EngineHandle,
    settings: &CaptureSettings,
    reasoning: Option<&Arc<ThinkTags>>,
    endpoint: Endpoint,
    mut body: Map<String, Value>,
    capture: Map<String, Value>,
    stream: bool,
) -> Result<Submitted, ServeError> {
    body.extend(capture);
    // vLLM's `max_tokens=None`: as many as the context and the KV cache allow, as a
    // chat request without max_tokens gets (a completion's default is 16). Parsed as
    // unbounded, then left to the engine thread to settle.
    let unbounded = body.get("max_tokens").is_some_and(Value::is_null);
    if unbounded {
        body.insert("max_tokens".into(), Value::from(i64::MAX));
    }
    let body = Value::Object(body);
    let meta = engine.meta();
    let context = RequestContext::new(LIMITS, settings, meta);
    let mut request = validate::generation_request(endpoint, &body, &context)?;
    for item in &mut request.items {
        if unbounded {
            item.max_tokens = None;
        }
        // As vLLM's offline API: a sequence stops at the context's end (`length`)
        // rather than the request failing, unless a capture's size depends on it.
        if item.capture.is_none() {
            item.max_tokens_defaulted = true;
        }
        // As vLLM's engine: structured output waits for a reasoning model's thinking.
        item.reasoning = reasoning.cloned();
        if let Some(capture) = &mut item.capture {
            // Streamed, a capture's rows go out with their tokens, as over HTTP.
            capture.stream_rows(stream);
        }
    }
    if let Some(guide) = request.guide.take() {
        let constraint = validate::structured::compile(&meta.guided, guide).await?;
        for item in &mut request.items {
            item.constraint = Some(constraint.fork());
        }
    }
    if request.items.len() != request.n {
        return Err(InvalidRequest::invalid("prompt", "one prompt per request").into());
    }
    // Tokenized here, as the engine's prompter would (the same code), so that the
    // output can carry the prompt's token ids; the samples of the prompt share them.
    let first = request
        .items
        .first()
        .ok_or_else(|| InvalidRequest::invalid("prompt", "the request has no prompt"))?;
    let field = first.prompt_field;
    let mut ids = engine
        .prompter()
        .tokenize((*first.prompt).clone(), first.add_special_tokens, field)
        .await?;
    // Cut as the prompter cuts (`truncate_prompt_tokens`; cutting again is a no-op).
    if let Some(truncation) = first.truncate_prompt {
        let context = engine.meta().context_length;
        ids.drain(..truncation.cut(ids.len(), context, first.max_tokens));
    }
    let ids: Arc<[u32]> = ids.into();
    // Capture spans by characters or messages are resolved from the prompt's text: such
    // a prompt stays text, and the prompter tokenizes it again (the same code, so the
    // same ids).
    let spans = request
        .items
        .iter()
        .any(|i| i.capture.as_ref().is_some_and(|c| !c.spec.spans.is_empty()));
    if !spans {
        let tokens = Arc::new(PromptInput::Tokens(ids.to_vec()));
        for item in &mut request.items {
            item.prompt = tokens.clone();
        }
    }
    let (accepted, events) = match request.beam_search {
        Some(search) => engine.beam_search(request.items, search).await?,
        None => engine.add(request.items).await?,
    };
    Ok(Submitted {
        ids: accepted.iter().map(|a| a.id).collect(),
        prompt_token_ids: ids,
        events,
        captures: request.capture.is_some(),
    })
}
