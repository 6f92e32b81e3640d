//! One prompt's request, from the body the server would receive to sequences on the
//! engine: the server's own parsing (`lantern_server::protocol`), capture fields
//! (`lantern_server::capture`) and structured output, so that a call means what the
//! same HTTP request means and fails with the same field named.

use lantern_kv::RequestId;
use lantern_server::capture::{parse_capture_request, Delivery};
use lantern_server::engine_thread::{EngineEvent, ItemCapture};
use lantern_server::invalid_request::InvalidRequest;
use lantern_server::protocol::{self, GenerationRequest, ModelLimits};
use lantern_server::{ApiError, CaptureSettings, EngineHandle, PromptInput};
use serde_json::{Map, Value};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedReceiver;

/// Which endpoint's body a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// The keys of a `capture=` dict: the server's capture fields without `attn_capture_`,
/// but `delivery`, which is HTTP's alone (here the maps are numpy arrays in the output).
fn capture_keys() -> impl Iterator<Item = &'static str> {
    lantern_server::capture::CAPTURE_FIELDS
        .iter()
        .filter_map(|f| f.strip_prefix("attn_capture_"))
        .filter(|&key| key != "delivery")
}

/// The body's capture fields for a `capture=` dict (`None`: no capture).
pub fn capture_fields(
    capture: Option<&Map<String, Value>>,
) -> Result<Map<String, Value>, ApiError> {
    let mut fields = Map::new();
    let Some(capture) = capture else {
        return Ok(fields);
    };
    for (key, value) in capture {
        if !capture_keys().any(|k| k == key) {
            return Err(ApiError::field(
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

/// `max_tokens: 0` runs the prompt only, which is of use only for a capture (the
/// server's rule; Python has no `echo`).
fn check_prompt_only(request: &GenerationRequest, captures: bool) -> Result<(), ApiError> {
    if captures || request.items.iter().all(|i| i.max_tokens != Some(0)) {
        return Ok(());
    }
    Err(InvalidRequest::conflict(
        "max_tokens",
        "max_tokens must be at least 1; 0 (the prompt only) needs a capture",
    )
    .into())
}

/// Validates a body as the server would, without an engine (SamplingParams checks
/// itself when it is made): the sampling fields with a placeholder prompt.
pub fn check_sampling(mut body: Map<String, Value>) -> Result<(), ApiError> {
    body.insert("prompt".into(), Value::from("x"));
    protocol::completion_request(&Value::Object(body), &LIMITS)?;
    Ok(())
}

/// Validates `body` (plus the capture fields) as the server does and submits it.
pub async fn submit(
    engine: &EngineHandle,
    settings: &CaptureSettings,
    kind: Kind,
    mut body: Map<String, Value>,
    capture: Map<String, Value>,
    stream: bool,
) -> Result<Submitted, ApiError> {
    body.extend(capture);
    // vLLM's `max_tokens=None`: as many as the context and the KV cache allow, as a
    // chat request without max_tokens gets (a completion's default is 16). Parsed as
    // unbounded, then left to the engine thread to settle.
    let unbounded = body.get("max_tokens").is_some_and(Value::is_null);
    if unbounded {
        body.insert("max_tokens".into(), Value::from(i64::MAX));
    }
    let body = Value::Object(body);
    let mut request = match kind {
        Kind::Chat => protocol::chat_request(&body, &LIMITS)?,
        Kind::Completion => protocol::completion_request(&body, &LIMITS)?,
    };
    if unbounded {
        for item in &mut request.items {
            item.max_tokens = None;
        }
    }
    let meta = engine.meta();
    let capture = parse_capture_request(&body, settings, meta.num_layers, meta.num_heads)?;
    if let Some(capture) = &capture {
        if request.items.len() != 1 {
            return Err(InvalidRequest::conflict(
                "attn_capture",
                format!(
                    "a capturing request must generate exactly one sequence (n = 1); this one asks for {}",
                    request.items.len()
                ),
            )
            .into());
        }
        debug_assert_eq!(capture.delivery, Delivery::Inline);
        let mut spec = capture.spec.clone();
        // Streamed, a row's span masses and top-k keys go out with its token, as over HTTP.
        spec.stream_rows = stream && (!spec.spans.is_empty() || spec.top_k.is_some());
        request.items[0].capture = Some(ItemCapture {
            spec,
            max_bytes: settings.max_bytes,
            max_stored_bytes: None,
        });
    }
    check_prompt_only(&request, capture.is_some())?;
    if let Some(guide) = request.guide.take() {
        let constraint = lantern_server::structured::compile(&meta.guided, guide).await?;
        for item in &mut request.items {
            item.constraint = Some(constraint.fork());
        }
    }
    if request.items.len() != request.n {
        return Err(ApiError::field("prompt", "one prompt per request"));
    }
    // Tokenized here, as the engine's prompter would (the same code), so that the
    // output can carry the prompt's token ids; the samples of the prompt share them.
    let first = request
        .items
        .first()
        .ok_or_else(|| ApiError::field("prompt", "the request has no prompt"))?;
    let field = first.prompt_field;
    let ids: Arc<[u32]> = engine
        .prompter()
        .tokenize((*first.prompt).clone(), true, field)
        .await?
        .into();
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
    let (accepted, events) = engine.add(request.items).await?;
    Ok(Submitted {
        ids: accepted.iter().map(|a| a.id).collect(),
        prompt_token_ids: ids,
        events,
        captures: capture.is_some(),
    })
}
