//! OpenAI request bodies: parsing and validation into engine work.
//!
//! Bodies are parsed by hand from JSON values so that every error names its field. Fields
//! lantern does not know are ignored (OpenAI clients' `extra_body` puts extensions at the
//! top level) and named in the request's `ignored_fields`, which the server logs as one
//! warning, as vLLM does; fields it knows but cannot honour yet are refused with a 400
//! rather than silently ignored.

use super::capture::{parse_capture_request, CaptureRequest, CaptureSettings, Delivery};
use super::structured::{parse_guide, FieldGuide};
use crate::serving::{
    BeamSearch, EarlyStopping, GenerationItem, ItemCapture, ModelMeta, Origin, PromptInput,
    PromptTruncation,
};
use crate::token_filter::TokenFilter;
use crate::validate::InvalidRequest;
use crate::SamplingParams;
use lantern_model::{ChatMessage, ChatRenderOptions};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

/// Most sequences one request may ask for (prompts × n).
pub const MAX_SEQUENCES_PER_REQUEST: usize = 256;
/// Most alternatives per token: chat's `top_logprobs` (OpenAI's limit).
const MAX_CHAT_TOP_LOGPROBS: i64 = 20;
/// Most alternatives per token: completions' `logprobs` (vLLM's default `max_logprobs`;
/// OpenAI's own limit is 5, and clients written for it never ask for more).
const MAX_COMPLETION_LOGPROBS: i64 = 20;
/// `reasoning_effort`'s values (vLLM's, gpt-oss's).
const REASONING_EFFORTS: [&str; 3] = ["low", "medium", "high"];
/// Largest `chat_template_kwargs`, as JSON: template variables, not documents.
pub const MAX_CHAT_TEMPLATE_KWARGS_BYTES: usize = 64 << 10;
/// Largest `chat_template` a request may bring (real ones are a few KiB; the longest,
/// with tool-calling instructions, some tens).
pub const MAX_CHAT_TEMPLATE_BYTES: usize = 256 << 10;
/// Largest `logit_bias` (tokens).
const MAX_LOGIT_BIAS_ENTRIES: usize = 1024;
/// Longest `request_id` (and `X-Request-Id`): an id, not a document.
pub const MAX_REQUEST_ID_CHARS: usize = 256;

/// A client's request id as a response id's base: visible ASCII (it goes into ids,
/// headers and log lines), not empty, not too long.
pub fn checked_request_id(id: &str) -> Option<String> {
    let ok =
        (1..=MAX_REQUEST_ID_CHARS).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic());
    ok.then(|| id.to_string())
}

/// Longest `cache_salt`: a tenant's key, not a document.
const MAX_CACHE_SALT_BYTES: usize = 1024;
/// Most `bad_words` one request may give.
const MAX_BAD_WORDS: usize = 1024;
/// Most unknown field names a warning lists, and the most characters of each.
const MAX_IGNORED_FIELDS: usize = 16;
const MAX_IGNORED_FIELD_CHARS: usize = 64;

/// Fields both endpoints read (structured output and capture fields included).
const COMMON_FIELD_NAMES: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "n",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
    "skip_special_tokens",
    "cache_salt",
    "request_id",
    "add_special_tokens",
    // Only slow tokenizers' decoding reads it (vLLM's fast ones ignore it too).
    "spaces_between_special_tokens",
    "prompt_logprobs",
    "min_tokens",
    "best_of",
    "return_tokens_as_token_ids",
    "truncate_prompt_tokens",
    // OpenAI's end-user id: accepted, with nothing to do.
    "user",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    // vLLM's beam search: `n` beams (see `beam_search`).
    "use_beam_search",
    "length_penalty",
    "early_stopping",
    // vLLM's, refused when they ask for something (see `refuse_unsupported`).
    "structural_tag",
    "logits_processors",
    "priority",
];
const CHAT_FIELD_NAMES: &[&str] = &[
    "messages",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "chat_template",
    "echo",
    "reasoning_effort",
];
const COMPLETION_FIELD_NAMES: &[&str] = &["prompt", "logprobs", "echo", "suffix"];

/// The top-level fields of `body` that neither `COMMON_FIELD_NAMES` nor `own` name
/// (capture fields, `attn_capture*`, are known), at most [`MAX_IGNORED_FIELDS`] of them,
/// each cut to [`MAX_IGNORED_FIELD_CHARS`] characters.
fn ignored_fields(body: &Value, own: &[&str]) -> Vec<String> {
    unknown_fields(body, |k| {
        COMMON_FIELD_NAMES.contains(&k) || own.contains(&k)
    })
}

/// The top-level fields of `body` that are not `known` nor capture fields, at most
/// [`MAX_IGNORED_FIELDS`] of them, each cut to [`MAX_IGNORED_FIELD_CHARS`] characters.
pub(super) fn unknown_fields(body: &Value, known: impl Fn(&str) -> bool) -> Vec<String> {
    let Some(obj) = body.as_object() else {
        return Vec::new();
    };
    obj.keys()
        .filter(|k| !known(k) && !k.starts_with("attn_capture"))
        .take(MAX_IGNORED_FIELDS)
        .map(|k| k.chars().take(MAX_IGNORED_FIELD_CHARS).collect())
        .collect()
}

/// Parses a body as a JSON object.
pub fn parse_body(bytes: &[u8]) -> Result<Value, InvalidRequest> {
    let mut value: Value = match serde_json::from_slice(bytes) {
        Ok(value) => value,
        // Python's `json.dumps` writes a string's lone surrogates (text cut inside an
        // emoji) as escapes JSON parsers refuse: read them as U+FFFD, as a decoder
        // replaces bytes it cannot read.
        Err(e) => {
            let invalid = |e: serde_json::Error| {
                InvalidRequest::Body(if e.to_string().starts_with("recursion limit exceeded") {
                    format!("the body nests arrays and objects more than 128 levels deep, more than this server reads ({e})")
                } else {
                    format!("the body is not valid JSON: {e}")
                })
            };
            let lone = lone_surrogate_escapes(bytes);
            if lone.is_empty() {
                return Err(invalid(e));
            }
            serde_json::from_slice(&replace_escapes(bytes, &lone)).map_err(invalid)?
        }
    };
    let Some(fields) = value.as_object_mut() else {
        return Err(InvalidRequest::Body(
            "the body must be a JSON object".to_string(),
        ));
    };
    for name in INTEGER_FIELDS {
        if let Some(field) = fields.get_mut(*name) {
            integral_float_as_integer(field);
        }
    }
    Ok(value)
}

/// The `\uXXXX` escapes of `bytes` (a JSON text): (offset, value). A backslash escapes
/// the byte after it, so `\\u` is no escape.
fn unicode_escapes(bytes: &[u8]) -> impl Iterator<Item = (usize, u16)> + '_ {
    let mut i = 0;
    std::iter::from_fn(move || {
        while i + 1 < bytes.len() {
            if bytes[i] != b'\\' {
                i += 1;
                continue;
            }
            let at = i;
            i += 2;
            if bytes[at + 1] == b'u' {
                let hex = bytes.get(at + 2..at + 6)?;
                let value = std::str::from_utf8(hex)
                    .ok()
                    .and_then(|h| u16::from_str_radix(h, 16).ok());
                if let Some(value) = value {
                    i = at + 6;
                    return Some((at, value));
                }
            }
        }
        None
    })
}

/// The offsets of the `\uXXXX` escapes that are surrogates without their pair.
fn lone_surrogate_escapes(bytes: &[u8]) -> Vec<usize> {
    let escapes: Vec<(usize, u16)> = unicode_escapes(bytes).collect();
    let mut lone = Vec::new();
    let mut k = 0;
    while k < escapes.len() {
        let (at, value) = escapes[k];
        let paired = (0xD800..0xDC00).contains(&value)
            && escapes
                .get(k + 1)
                .is_some_and(|&(next, low)| next == at + 6 && (0xDC00..0xE000).contains(&low));
        if paired {
            k += 2;
            continue;
        }
        if (0xD800..0xE000).contains(&value) {
            lone.push(at);
        }
        k += 1;
    }
    lone
}

/// `bytes` with the `\uXXXX` escapes at `offsets` written as `\ufffd` (the same
/// length).
fn replace_escapes(bytes: &[u8], offsets: &[usize]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    for &at in offsets {
        out[at..at + 6].copy_from_slice(b"\\ufffd");
    }
    out
}

/// Integer fields a client may write as floats (Python's `json.dumps(16.0)` is `16.0`):
/// taken as the integer when they have no fraction, as vLLM's validation does.
const INTEGER_FIELDS: &[&str] = &[
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "min_tokens",
    "n",
    "best_of",
    "top_k",
    "seed",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "attn_capture_top_k",
];

fn integral_float_as_integer(value: &mut Value) {
    // Past 2^53 a float no longer holds every integer: left as sent (and refused).
    const EXACT: f64 = (1u64 << 53) as f64;
    if let Some(x) = value.as_f64().filter(|_| value.is_f64()) {
        if x.fract() == 0.0 && x.abs() <= EXACT {
            *value = Value::from(x as i64);
        }
    }
}

/// Deserializes `value` into `T`; a type error names the field's path.
fn typed<T: DeserializeOwned>(value: &Value) -> Result<T, InvalidRequest> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if path.is_empty() || path == "." {
            InvalidRequest::WrongType {
                field: None,
                message: inner.to_string(),
            }
        } else {
            let field = path.split(['.', '[']).next().unwrap_or("").to_string();
            InvalidRequest::WrongType {
                field: Some(field),
                message: format!("{path}: {inner}"),
            }
        }
    })
}

#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct StreamOptions {
    /// vLLM's default when `stream_options` is given: true.
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// vLLM's: usage so far in every chunk (with `include_usage`).
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

/// Fields shared by completions and chat completions.
#[derive(Debug, Default, Deserialize)]
struct CommonFields {
    model: Option<String>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    seed: Option<i64>,
    stop: Option<Value>,
    stop_token_ids: Option<Vec<u32>>,
    ignore_eos: Option<bool>,
    include_stop_str_in_output: Option<bool>,
    n: Option<i64>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    allowed_token_ids: Option<Vec<u32>>,
    bad_words: Option<Vec<String>>,
    skip_special_tokens: Option<bool>,
    cache_salt: Option<String>,
    request_id: Option<String>,
    add_special_tokens: Option<bool>,
    prompt_logprobs: Option<i64>,
    truncate_prompt_tokens: Option<i64>,
    min_tokens: Option<i64>,
    best_of: Option<i64>,
    return_tokens_as_token_ids: Option<bool>,
    use_beam_search: Option<bool>,
    length_penalty: Option<f64>,
    early_stopping: Option<Value>,
    structural_tag: Option<Value>,
    logits_processors: Option<Value>,
    priority: Option<i64>,
}

/// vLLM's fields that would change the output in ways lantern does not offer: refused
/// when they ask for anything, rather than ignored.
fn refuse_unsupported(fields: &CommonFields) -> Result<(), InvalidRequest> {
    if fields.structural_tag.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(InvalidRequest::unsupported(
            "structural_tag",
            "structural tags (use response_format json_schema, or structured_outputs)",
        ));
    }
    // vLLM refuses a priority too unless its scheduler orders by them.
    if fields.priority.is_some_and(|p| p != 0) {
        return Err(InvalidRequest::unsupported(
            "priority",
            "priority scheduling (requests run first come, first served)",
        ));
    }
    let asks = |v: &Value| !(v.is_null() || v.as_array().is_some_and(Vec::is_empty));
    if fields.logits_processors.as_ref().is_some_and(asks) {
        return Err(InvalidRequest::unsupported(
            "logits_processors",
            "logits processors loaded by name",
        ));
    }
    Ok(())
}

#[derive(Debug, Default, Deserialize)]
struct ChatFields {
    messages: Option<Value>,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    chat_template_kwargs: Option<Value>,
    chat_template: Option<String>,
    echo: Option<bool>,
    reasoning_effort: Option<Value>,
}

#[derive(Debug, Default, Deserialize)]
struct CompletionFields {
    prompt: Option<Value>,
    logprobs: Option<i64>,
    echo: Option<bool>,
    suffix: Option<String>,
}

/// A validated request: what to submit, and how to answer.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// `prompts × n` sequences; choice `i` is prompt `i / n`, sample `i % n`.
    pub items: Vec<GenerationItem>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// vLLM's `stream_options.continuous_usage_stats`: every streamed chunk carries its
    /// choice's usage so far (only with `include_usage`).
    pub continuous_usage: bool,
    /// vLLM's `return_tokens_as_token_ids`: logprobs name tokens as `token_id:{id}`.
    pub tokens_as_ids: bool,
    pub echo: bool,
    /// Whether the response carries logprobs (the number of alternatives is in the items).
    pub logprobs: bool,
    /// Completions' `echo` with `logprobs`: the `logprobs` cover the prompt tokens first,
    /// with this many alternatives each.
    pub echo_logprobs: Option<usize>,
    /// vLLM's `prompt_logprobs`: alternatives per prompt token in a `prompt_logprobs`
    /// field (whole responses only).
    pub prompt_logprobs: Option<usize>,
    /// Structured output the request asked for, and the field that asked.
    pub guide: Option<FieldGuide>,
    /// Chat with tools: calls in the output become `tool_calls`.
    pub tool_calls: bool,
    /// Chat's `echo` (vLLM's): the final message's content, when it is the assistant's,
    /// goes before each choice's text.
    pub chat_echo: Option<String>,
    /// Top-level fields lantern does not know (ignored; the server logs them).
    pub ignored_fields: Vec<String>,
    /// The attention capture asked for (its spec is also on the one item) and how it is
    /// to be delivered.
    pub capture: Option<CaptureRequest>,
    /// vLLM's `request_id`: the base of the response's id (the server's `X-Request-Id`
    /// header wins over it).
    pub request_id: Option<String>,
    /// vLLM's `use_beam_search`: each prompt's `n` choices are the `n` best beams.
    pub beam_search: Option<BeamSearch>,
}

/// The served model's name and limits, as validation needs them.
#[derive(Debug, Clone)]
pub struct ModelLimits<'a> {
    /// The name responses report (`--served-model-name`'s first).
    pub served_name: &'a str,
    /// Further names a request may give as `model` (the other served names).
    pub aliases: &'a [String],
}

/// Settings common to both endpoints, validated.
struct Common {
    params: SamplingParams,
    max_tokens: Option<usize>,
    /// Whether `max_tokens` is the endpoint's default (the request gave none).
    max_tokens_defaulted: bool,
    /// The field that set `max_tokens` (`max_tokens` when neither did).
    max_tokens_field: &'static str,
    stop: Arc<[String]>,
    include_stop: bool,
    /// vLLM's `bad_words`, tokenized with the prompt (see `Prompter`).
    bad_words: Arc<[String]>,
    n: usize,
    stream: bool,
    include_usage: bool,
    continuous_usage: bool,
    tokens_as_ids: bool,
    /// vLLM's `prompt_logprobs`, validated (`None` when streaming: vLLM sends none then).
    prompt_logprobs: Option<usize>,
    truncate_prompt: Option<PromptTruncation>,
    request_id: Option<String>,
    add_special_tokens: bool,
    beam_search: Option<BeamSearch>,
}

fn check_model(model: &Option<String>, limits: &ModelLimits) -> Result<(), InvalidRequest> {
    match model {
        Some(m) if m != limits.served_name && !limits.aliases.contains(m) => {
            Err(InvalidRequest::UnknownModel(m.clone()))
        }
        _ => Ok(()),
    }
}

fn parse_stop(value: &Option<Value>) -> Result<Vec<String>, InvalidRequest> {
    let wrong = || InvalidRequest::invalid("stop", "stop must be a string or a list of strings");
    let stop: Vec<String> = match value {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_str().map(str::to_string).ok_or_else(wrong))
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(wrong()),
    };
    // As vLLM: an empty stop string would match everywhere.
    if stop.iter().any(String::is_empty) {
        return Err(InvalidRequest::invalid(
            "stop",
            "stop cannot contain an empty string",
        ));
    }
    Ok(stop)
}

/// vLLM's `use_beam_search`: `n` beams, scored with `length_penalty`. Refused with what
/// it cannot honour: a beam's tokens are each step's prompt, so penalties on generated
/// tokens would not apply, and token masks act after the logprobs the beams are
/// ranked by.
fn beam_search(
    fields: &CommonFields,
    n: usize,
    max_tokens: Option<usize>,
    max_field: &'static str,
) -> Result<Option<BeamSearch>, InvalidRequest> {
    let length_penalty = fields.length_penalty.unwrap_or(1.0);
    if !(length_penalty as f32).is_finite() {
        return Err(InvalidRequest::out_of_range(
            "length_penalty",
            "a finite number",
            length_penalty,
        ));
    }
    let early_stopping = match &fields.early_stopping {
        None | Some(Value::Null) => EarlyStopping::Exact,
        Some(Value::String(s)) if s == "never" => EarlyStopping::Exact,
        Some(Value::Bool(false)) => EarlyStopping::Heuristic,
        Some(Value::Bool(true)) => EarlyStopping::Finished,
        Some(_) => {
            return Err(InvalidRequest::invalid(
                "early_stopping",
                "early_stopping must be true, false or \"never\"",
            ))
        }
    };
    if fields.use_beam_search != Some(true) {
        return Ok(None);
    }
    let asked = [
        (
            "presence_penalty",
            fields.presence_penalty.is_some_and(|p| p != 0.0),
        ),
        (
            "frequency_penalty",
            fields.frequency_penalty.is_some_and(|p| p != 0.0),
        ),
        (
            "bad_words",
            fields.bad_words.as_ref().is_some_and(|w| !w.is_empty()),
        ),
        ("allowed_token_ids", fields.allowed_token_ids.is_some()),
    ];
    if let Some((field, _)) = asked.iter().find(|(_, asked)| *asked) {
        return Err(InvalidRequest::conflict(
            field,
            format!("{field} cannot be combined with use_beam_search"),
        ));
    }
    if max_tokens == Some(0) {
        return Err(InvalidRequest::conflict(
            max_field,
            format!("{max_field} must be at least 1 with use_beam_search"),
        ));
    }
    Ok(Some(BeamSearch {
        width: n,
        length_penalty: length_penalty as f32,
        early_stopping,
    }))
}

fn common(
    fields: &CommonFields,
    default_max_tokens: Option<usize>,
) -> Result<Common, InvalidRequest> {
    refuse_unsupported(fields)?;
    let (max_field, max_value) = match (fields.max_completion_tokens, fields.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let max_tokens = match max_value {
        // 0 (the prompt only) is allowed with a capture; see `openai::generate`.
        Some(m) if m < 0 => return Err(InvalidRequest::out_of_range(max_field, "at least 1", m)),
        Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
        None => default_max_tokens,
    };
    let temperature = fields.temperature.unwrap_or(1.0);
    // Checked as the f32 the sampler uses: 1e300 is finite in f64 but not in f32.
    if !(temperature as f32).is_finite() || temperature < 0.0 {
        return Err(InvalidRequest::out_of_range(
            "temperature",
            ">= 0",
            temperature,
        ));
    }
    let top_p = fields.top_p.unwrap_or(1.0);
    if !(top_p.is_finite() && top_p > 0.0 && top_p <= 1.0) {
        return Err(InvalidRequest::out_of_range("top_p", "in (0, 1]", top_p));
    }
    let top_k = match fields.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(InvalidRequest::out_of_range(
                "top_k",
                "-1 or 0 (disabled) or at least 1",
                k,
            ))
        }
    };
    let min_p = fields.min_p.unwrap_or(0.0);
    if !(0.0..=1.0).contains(&min_p) {
        return Err(InvalidRequest::out_of_range("min_p", "in [0, 1]", min_p));
    }
    let n = fields.n.unwrap_or(1);
    if n < 1 {
        return Err(InvalidRequest::out_of_range("n", "at least 1", n));
    }
    if n as usize > MAX_SEQUENCES_PER_REQUEST {
        return Err(InvalidRequest::out_of_range(
            "n",
            format!("at most {MAX_SEQUENCES_PER_REQUEST}"),
            n,
        ));
    }
    if let Some(best_of) = fields.best_of {
        if best_of != n {
            return Err(InvalidRequest::unsupported(
                "best_of",
                "best_of other than n",
            ));
        }
    }
    for (name, value) in [
        ("presence_penalty", fields.presence_penalty),
        ("frequency_penalty", fields.frequency_penalty),
    ] {
        if let Some(v) = value {
            if !(-2.0..=2.0).contains(&v) {
                return Err(InvalidRequest::out_of_range(name, "in [-2, 2]", v));
            }
        }
    }
    if let Some(v) = fields.repetition_penalty {
        if !((v as f32).is_finite() && v > 0.0) {
            return Err(InvalidRequest::out_of_range("repetition_penalty", "> 0", v));
        }
    }
    let logit_bias = parse_logit_bias(fields.logit_bias.as_ref())?;
    let token_filter = match &fields.allowed_token_ids {
        None => TokenFilter::default(),
        Some(ids) if ids.is_empty() => {
            return Err(InvalidRequest::invalid(
                "allowed_token_ids",
                "allowed_token_ids is empty: it must name at least one token (or be left out)",
            ))
        }
        Some(ids) => TokenFilter::allowing(ids),
    };
    let cache_salt = match &fields.cache_salt {
        None => None,
        Some(salt) if salt.is_empty() || salt.len() > MAX_CACHE_SALT_BYTES => {
            return Err(InvalidRequest::invalid(
                "cache_salt",
                format!(
                    "cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_BYTES} bytes"
                ),
            ))
        }
        Some(salt) => Some(Arc::from(salt.as_str())),
    };
    let bad_words: Arc<[String]> = fields.bad_words.clone().unwrap_or_default().into();
    if bad_words.len() > MAX_BAD_WORDS {
        return Err(InvalidRequest::invalid(
            "bad_words",
            format!(
                "bad_words has {} words; at most {MAX_BAD_WORDS}",
                bad_words.len()
            ),
        ));
    }
    let min_tokens = match fields.min_tokens {
        None => 0,
        Some(m) if m < 0 => {
            return Err(InvalidRequest::out_of_range("min_tokens", "at least 0", m))
        }
        Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
    };
    if let Some(max) = max_tokens.filter(|&max| min_tokens > max) {
        return Err(InvalidRequest::conflict(
            "min_tokens",
            format!("min_tokens ({min_tokens}) must be at most {max_field} ({max})"),
        ));
    }
    let stream = fields.stream.unwrap_or(false);
    let prompt_logprobs = match fields.prompt_logprobs {
        None => None,
        Some(-1) => {
            return Err(InvalidRequest::unsupported(
                "prompt_logprobs",
                "prompt_logprobs of -1 (the whole vocabulary)",
            ))
        }
        Some(k) if !(0..=MAX_CHAT_TOP_LOGPROBS).contains(&k) => {
            return Err(InvalidRequest::out_of_range(
                "prompt_logprobs",
                format!("in [0, {MAX_CHAT_TOP_LOGPROBS}]"),
                k,
            ))
        }
        // As vLLM: refused with `stream` when it would return anything.
        Some(k) if stream && k > 0 => {
            return Err(InvalidRequest::conflict(
                "prompt_logprobs",
                "prompt_logprobs are not available when streaming (stream is true)",
            ))
        }
        Some(_) if stream => None,
        Some(k) => Some(k as usize),
    };
    let params = SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        min_p: min_p as f32,
        // vLLM's -1 is no seed.
        seed: fields.seed.filter(|&s| s != -1).map(|s| s as u64),
        max_tokens: max_tokens.unwrap_or(1),
        ignore_eos: fields.ignore_eos.unwrap_or(false),
        stop_token_ids: fields.stop_token_ids.clone().unwrap_or_default().into(),
        presence_penalty: fields.presence_penalty.unwrap_or(0.0) as f32,
        frequency_penalty: fields.frequency_penalty.unwrap_or(0.0) as f32,
        repetition_penalty: fields.repetition_penalty.unwrap_or(1.0) as f32,
        min_tokens,
        logit_bias,
        token_filter,
        skip_special_tokens: fields.skip_special_tokens.unwrap_or(true),
        cache_salt,
        ..SamplingParams::default()
    };
    let stream_options = fields.stream_options;
    // As vLLM: options of a stream that will not be sent are a mistake (an empty
    // object says nothing).
    let says_something =
        |o: &StreamOptions| o.include_usage.is_some() || o.continuous_usage_stats.is_some();
    if stream_options.as_ref().is_some_and(says_something) && !stream {
        return Err(InvalidRequest::conflict(
            "stream_options",
            "stream_options are only allowed when stream is true",
        ));
    }
    let include_usage = stream && stream_options.is_some_and(|o| o.include_usage.unwrap_or(true));
    Ok(Common {
        params,
        max_tokens,
        max_tokens_defaulted: max_value.is_none() && max_tokens.is_some(),
        max_tokens_field: max_field,
        stop: parse_stop(&fields.stop)?.into(),
        include_stop: fields.include_stop_str_in_output.unwrap_or(false),
        bad_words,
        n: n as usize,
        stream,
        prompt_logprobs,
        include_usage,
        continuous_usage: include_usage
            && stream_options
                .and_then(|o| o.continuous_usage_stats)
                .unwrap_or(false),
        tokens_as_ids: fields.return_tokens_as_token_ids.unwrap_or(false),
        beam_search: beam_search(fields, n as usize, max_tokens, max_field)?,
        add_special_tokens: fields.add_special_tokens.unwrap_or(true),
        request_id: match &fields.request_id {
            None => None,
            Some(id) => Some(checked_request_id(id).ok_or_else(|| {
                InvalidRequest::invalid(
                    "request_id",
                    format!(
                        "request_id must be 1 to {MAX_REQUEST_ID_CHARS} visible ASCII characters"
                    ),
                )
            })?),
        },
        truncate_prompt: match fields.truncate_prompt_tokens {
            None => None,
            Some(-1) => Some(PromptTruncation::ToFit),
            Some(n) if n >= 1 => Some(PromptTruncation::Last(n as usize)),
            Some(n) => {
                return Err(InvalidRequest::out_of_range(
                    "truncate_prompt_tokens",
                    "at least 1, or -1 (as much of the prompt's end as fits)",
                    n,
                ))
            }
        },
    })
}

/// OpenAI's `logit_bias`: `{"token id": bias}` with each bias in [-100, 100]. Token ids
/// are checked against the vocabulary when the prompt is (see `Prompter`).
fn parse_logit_bias(
    value: Option<&serde_json::Map<String, Value>>,
) -> Result<Vec<(u32, f32)>, InvalidRequest> {
    let Some(map) = value else {
        return Ok(Vec::new());
    };
    if map.len() > MAX_LOGIT_BIAS_ENTRIES {
        return Err(InvalidRequest::invalid(
            "logit_bias",
            format!(
                "logit_bias has {} entries; at most {MAX_LOGIT_BIAS_ENTRIES}",
                map.len()
            ),
        ));
    }
    map.iter()
        .map(|(key, bias)| {
            let token: u32 = key.trim().parse().map_err(|_| {
                InvalidRequest::invalid(
                    "logit_bias",
                    format!("logit_bias keys must be token ids, got {key:?}"),
                )
            })?;
            let bias = bias
                .as_f64()
                .filter(|b| (-100.0..=100.0).contains(b))
                .ok_or_else(|| {
                    InvalidRequest::invalid(
                        "logit_bias",
                        format!("logit_bias[{key}] must be a number in [-100, 100], got {bias}"),
                    )
                })?;
            Ok((token, bias as f32))
        })
        .collect()
}

/// Chat's rendering options: vLLM's `add_generation_prompt` (default true),
/// `continue_final_message` and `chat_template_kwargs`, and OpenAI's `reasoning_effort`
/// as the template variable of that name (gpt-oss's template writes it in its system
/// message), unless `chat_template_kwargs` sets it.
fn chat_render_options(chat: &ChatFields) -> Result<ChatRenderOptions, InvalidRequest> {
    let continue_final_message = chat.continue_final_message.unwrap_or(false);
    let add_generation_prompt = chat
        .add_generation_prompt
        .unwrap_or(!continue_final_message);
    if continue_final_message && add_generation_prompt {
        return Err(InvalidRequest::conflict(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        ));
    }
    let mut kwargs = match &chat.chat_template_kwargs {
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(Value::Object(map)) => {
            let size = serde_json::to_vec(map).map_or(usize::MAX, |b| b.len());
            if size > MAX_CHAT_TEMPLATE_KWARGS_BYTES {
                return Err(InvalidRequest::invalid(
                    "chat_template_kwargs",
                    format!(
                        "chat_template_kwargs has {size} bytes of JSON; at most {MAX_CHAT_TEMPLATE_KWARGS_BYTES}"
                    ),
                ));
            }
            map.clone()
        }
        Some(_) => {
            return Err(InvalidRequest::invalid(
                "chat_template_kwargs",
                "chat_template_kwargs must be an object of template variables",
            ))
        }
    };
    match &chat.reasoning_effort {
        None | Some(Value::Null) => {}
        Some(Value::String(e)) if REASONING_EFFORTS.contains(&e.as_str()) => {
            kwargs
                .entry("reasoning_effort")
                .or_insert_with(|| Value::String(e.clone()));
        }
        Some(other) => {
            return Err(InvalidRequest::invalid(
                "reasoning_effort",
                format!(
                    "reasoning_effort must be one of {}, not {other}",
                    REASONING_EFFORTS.join(", ")
                ),
            ))
        }
    }
    let template = match &chat.chat_template {
        Some(t) if t.len() > MAX_CHAT_TEMPLATE_BYTES => {
            return Err(InvalidRequest::invalid(
                "chat_template",
                format!(
                    "chat_template has {} bytes; at most {MAX_CHAT_TEMPLATE_BYTES}",
                    t.len()
                ),
            ))
        }
        t => t.as_deref().map(Arc::from),
    };
    Ok(ChatRenderOptions {
        add_generation_prompt,
        continue_final_message,
        kwargs,
        tools: None,
        template,
    })
}

/// `n` items per prompt; sample `i` of a prompt gets seed `seed + i`. Items compute prompt
/// logprobs with `prompt_logprobs` alternatives when it is set.
fn expand(
    common: &Common,
    prompts: Vec<PromptInput>,
    prompt_field: &'static str,
    echo: bool,
    prompt_logprobs: Option<usize>,
) -> Result<Vec<GenerationItem>, InvalidRequest> {
    let total = prompts.len().saturating_mul(common.n);
    if total > MAX_SEQUENCES_PER_REQUEST {
        return Err(InvalidRequest::invalid(
            prompt_field,
            format!(
                "{} prompts × n = {} sequences; at most {MAX_SEQUENCES_PER_REQUEST} per request",
                prompts.len(),
                total
            ),
        ));
    }
    let mut items = Vec::with_capacity(total);
    for prompt in prompts {
        let prompt = Arc::new(prompt);
        for i in 0..common.n {
            let mut params = common.params.clone();
            params.seed = params.seed.map(|s| s.wrapping_add(i as u64));
            params.prompt_logprobs = prompt_logprobs;
            items.push(GenerationItem {
                origin: Origin::Request,
                prompt: prompt.clone(),
                params,
                max_tokens: common.max_tokens,
                max_tokens_defaulted: common.max_tokens_defaulted,
                max_tokens_field: common.max_tokens_field,
                stop: common.stop.clone(),
                include_stop_str_in_output: common.include_stop,
                add_special_tokens: common.add_special_tokens,
                bad_words: common.bad_words.clone(),
                echo,
                prompt_field,
                capture: None,
                prompt_logprobs,
                constraint: None,
                reasoning: None,
                begins_thinking: false,
                request_id: None,
                truncate_prompt: common.truncate_prompt,
            });
        }
    }
    Ok(items)
}

/// Which endpoint's body a request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/completions`: a `prompt`.
    Completion,
    /// `POST /v1/chat/completions`: `messages`.
    Chat,
}

/// What validation needs to know beyond the body: the model's names and shape, and what
/// the front end allows of capture.
#[derive(Debug, Clone)]
pub struct RequestContext<'a> {
    pub limits: ModelLimits<'a>,
    pub capture: &'a CaptureSettings,
    pub num_layers: usize,
    pub num_heads: usize,
}

impl<'a> RequestContext<'a> {
    /// The context of a request to the engine whose model is `meta`.
    pub fn new(limits: ModelLimits<'a>, capture: &'a CaptureSettings, meta: &ModelMeta) -> Self {
        Self {
            limits,
            capture,
            num_layers: meta.num_layers,
            num_heads: meta.num_heads,
        }
    }
}

/// Validates a body once into the typed request every front end submits: the endpoint's
/// fields, the capture fields (the spec attached to the request's one sequence) and the
/// rules between them. Nothing needs to read the body afterwards.
pub fn generation_request(
    endpoint: Endpoint,
    body: &Value,
    context: &RequestContext,
) -> Result<GenerationRequest, InvalidRequest> {
    let mut request = match endpoint {
        Endpoint::Chat => chat_request(body, &context.limits)?,
        Endpoint::Completion => completion_request(body, &context.limits)?,
    };
    request.capture =
        parse_capture_request(body, context.capture, context.num_layers, context.num_heads)?;
    if request.beam_search.is_some() {
        if request.capture.is_some() {
            return Err(InvalidRequest::conflict(
                "attn_capture",
                "attn_capture cannot be combined with use_beam_search: send the chosen beam's tokens back as the prompt, with max_tokens 0 and attn_capture, to capture its attention",
            ));
        }
        if let Some(guide) = &request.guide {
            // Tools' grammar is a required or named tool_choice's.
            let field = match guide.field {
                "tools" => "tool_choice",
                field => field,
            };
            return Err(InvalidRequest::conflict(
                field,
                format!("structured output ({field}) cannot be combined with use_beam_search"),
            ));
        }
    }
    if let Some(capture) = &request.capture {
        // A capture's spans, rows and maps name positions of the prompt as sent.
        if request.items.iter().any(|i| i.truncate_prompt.is_some()) {
            return Err(InvalidRequest::conflict(
                "truncate_prompt_tokens",
                "truncate_prompt_tokens cannot be combined with attn_capture (the capture's positions are those of the prompt as sent)",
            ));
        }
        if request.items.len() != 1 {
            return Err(InvalidRequest::conflict(
                "attn_capture",
                format!(
                    "a capturing request must generate exactly one sequence (n = 1 and one prompt); this one asks for {}",
                    request.items.len()
                ),
            ));
        }
        let stores = capture.delivery != Delivery::Inline;
        let mut item_capture = ItemCapture {
            spec: capture.spec.clone(),
            max_bytes: context.capture.max_bytes,
            max_stored_bytes: stores.then_some(context.capture.max_stored_bytes),
        };
        item_capture.stream_rows(request.stream);
        request.items[0].capture = Some(item_capture);
    }
    check_prompt_only(body, &request)?;
    Ok(request)
}

/// `max_tokens: 0` runs the prompt only, which is only of use for what the prompt
/// yields: a capture, the prompt echoed (with its logprobs on completions, as vLLM), or
/// its `prompt_logprobs`.
fn check_prompt_only(body: &Value, request: &GenerationRequest) -> Result<(), InvalidRequest> {
    if request.capture.is_some()
        || request.echo
        || request.prompt_logprobs.is_some()
        || request.items.iter().all(|i| i.max_tokens != Some(0))
    {
        return Ok(());
    }
    let field = match body.get("max_completion_tokens") {
        Some(v) if !v.is_null() => "max_completion_tokens",
        _ => "max_tokens",
    };
    Err(InvalidRequest::conflict(
        field,
        format!(
            "{field} must be at least 1; 0 (the prompt only) needs attn_capture, echo or prompt_logprobs"
        ),
    ))
}

/// Validates a `POST /v1/chat/completions` body's own fields (not the capture's: see
/// [`generation_request`]).
pub fn chat_request(
    body: &Value,
    limits: &ModelLimits,
) -> Result<GenerationRequest, InvalidRequest> {
    let fields: CommonFields = typed(body)?;
    check_model(&fields.model, limits)?;
    let chat: ChatFields = typed(body)?;
    let messages = parse_messages(chat.messages.as_ref())?;
    let logprobs = chat.logprobs.unwrap_or(false);
    let top_logprobs = match chat.top_logprobs {
        Some(n) if !(0..=MAX_CHAT_TOP_LOGPROBS).contains(&n) => {
            return Err(InvalidRequest::out_of_range(
                "top_logprobs",
                format!("in [0, {MAX_CHAT_TOP_LOGPROBS}]"),
                n,
            ))
        }
        Some(n) if n > 0 && !logprobs => {
            return Err(InvalidRequest::conflict(
                "top_logprobs",
                "top_logprobs needs logprobs set to true",
            ))
        }
        Some(n) => n as usize,
        None => 0,
    };
    let mut guide = parse_guide(body)?;
    let tools = super::tools::parse_tools(body)?;
    if let Some(tools) = &tools {
        if let Some(tool_guide) = tools.guide() {
            if let Some(other) = &guide {
                return Err(InvalidRequest::conflict(
                    "tool_choice",
                    format!(
                        "a required or named tool_choice cannot be combined with {}",
                        other.field
                    ),
                ));
            }
            // The grammar is made of the tools' parameter schemas: a fault in it is theirs.
            guide = Some(FieldGuide {
                guide: tool_guide,
                field: "tools",
            });
        }
    }
    let mut options = chat_render_options(&chat)?;
    options.tools = tools.as_ref().map(super::tools::ChatTools::offered);
    // vLLM's chat `echo`: the final message, when it is the assistant's, is echoed.
    let chat_echo = match messages.last() {
        Some(last) if chat.echo.unwrap_or(false) && last.role == "assistant" => {
            Some(last.content.clone())
        }
        _ => None,
    };
    let mut common = common(&fields, None)?;
    common.params.logprobs = logprobs.then_some(top_logprobs);
    let items = expand(
        &common,
        vec![PromptInput::Chat(messages, options)],
        "messages",
        false,
        common.prompt_logprobs,
    )?;
    Ok(GenerationRequest {
        items,
        n: common.n,
        stream: common.stream,
        include_usage: common.include_usage,
        continuous_usage: common.continuous_usage,
        tokens_as_ids: common.tokens_as_ids,
        echo: false,
        logprobs,
        echo_logprobs: None,
        prompt_logprobs: common.prompt_logprobs,
        guide,
        tool_calls: tools.is_some(),
        chat_echo,
        ignored_fields: ignored_fields(body, CHAT_FIELD_NAMES),
        capture: None,
        request_id: common.request_id,
        beam_search: common.beam_search,
    })
}

/// A chat's `messages` list, checked as a request's are (for front ends that read
/// conversations from elsewhere, such as `lantern generate --file`).
pub fn chat_messages(value: &Value) -> Result<Vec<ChatMessage>, InvalidRequest> {
    parse_messages(Some(value))
}

fn parse_messages(value: Option<&Value>) -> Result<Vec<ChatMessage>, InvalidRequest> {
    let items = match value {
        None | Some(Value::Null) => return Err(InvalidRequest::Missing("messages")),
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(InvalidRequest::invalid(
                "messages",
                "messages must be a list of messages",
            ))
        }
    };
    if items.is_empty() {
        return Err(InvalidRequest::invalid(
            "messages",
            "messages must contain at least one message",
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect()
}

fn parse_message(i: usize, m: &Value) -> Result<ChatMessage, InvalidRequest> {
    let at = |what: &str| InvalidRequest::invalid("messages", format!("messages[{i}]: {what}"));
    let obj = m
        .as_object()
        .ok_or_else(|| at("a message must be an object with `role` and `content`"))?;
    let role = match obj.get("role") {
        Some(Value::String(r)) => r.as_str(),
        None | Some(Value::Null) => return Err(at("`role` is required")),
        Some(_) => return Err(at("`role` must be a string")),
    };
    let role = match role {
        // OpenAI's legacy function results and Llama 3's tool results (`ipython`) go to
        // the template as they are, as vLLM passes them.
        "system" | "user" | "assistant" | "tool" | "function" | "ipython" => role,
        // OpenAI's newer name for system instructions.
        "developer" => "system",
        other => {
            return Err(at(&format!(
                "unknown role `{other}` (expected system, developer, user, assistant, tool, function or ipython)"
            )))
        }
    };
    let content = match obj.get("content") {
        Some(Value::String(s)) => s.clone(),
        None | Some(Value::Null) => {
            if role == "assistant" {
                String::new()
            } else {
                return Err(at("`content` is required"));
            }
        }
        Some(Value::Array(parts)) => {
            // Text parts joined by newlines, as vLLM joins them for a template that takes
            // content as a string.
            let mut texts: Vec<&str> = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let Some(kind) = part.get("type").and_then(Value::as_str) else {
                    return Err(at(&format!("content[{j}]: a content part needs a `type`")));
                };
                // The Responses API's part types, and a refusal, are text too.
                let key = match kind {
                    "text" | "input_text" | "output_text" => "text",
                    "refusal" => "refusal",
                    other => {
                        return Err(InvalidRequest::unsupported(
                            "messages",
                            format!(
                                "messages[{i}].content[{j}]: content of type `{other}` (text only)"
                            ),
                        ))
                    }
                };
                match part.get(key) {
                    Some(Value::String(t)) => texts.push(t),
                    _ => {
                        return Err(at(&format!(
                            "content[{j}]: a {kind} part needs a `{key}` string"
                        )))
                    }
                }
            }
            texts.join("\n")
        }
        Some(_) => return Err(at("`content` must be a string or a list of content parts")),
    };
    let mut message = ChatMessage::new(role, &content);
    super::tools::read_tool_fields(role, obj, &mut message).map_err(|e| at(&e))?;
    if role == "assistant" {
        message.reasoning = given_reasoning(obj).map_err(|e| at(&e))?;
    }
    Ok(message)
}

/// An assistant message's reasoning given back (vLLM's `reasoning`, or
/// `reasoning_content`, the older name): templates that write earlier thinking read it.
fn given_reasoning(obj: &serde_json::Map<String, Value>) -> Result<Option<String>, String> {
    for field in ["reasoning", "reasoning_content"] {
        match obj.get(field) {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s.is_empty() => {}
            Some(Value::String(s)) => return Ok(Some(s.clone())),
            Some(_) => return Err(format!("`{field}` must be a string")),
        }
    }
    Ok(None)
}

/// Validates a `POST /v1/completions` body's own fields (not the capture's: see
/// [`generation_request`]).
pub fn completion_request(
    body: &Value,
    limits: &ModelLimits,
) -> Result<GenerationRequest, InvalidRequest> {
    let fields: CommonFields = typed(body)?;
    check_model(&fields.model, limits)?;
    let completion: CompletionFields = typed(body)?;
    let prompts = parse_prompts(&completion.prompt)?;
    let logprobs = match completion.logprobs {
        Some(n) if !(0..=MAX_COMPLETION_LOGPROBS).contains(&n) => {
            return Err(InvalidRequest::out_of_range(
                "logprobs",
                format!("in [0, {MAX_COMPLETION_LOGPROBS}]"),
                n,
            ))
        }
        Some(n) => Some(n as usize),
        None => None,
    };
    if completion.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(InvalidRequest::unsupported("suffix", "suffix"));
    }
    let echo = completion.echo.unwrap_or(false);
    let guide = parse_guide(body)?;
    let echo_logprobs = logprobs.filter(|_| echo);
    // OpenAI's (and vLLM's) default for completions.
    let mut common = common(&fields, Some(16))?;
    common.params.logprobs = logprobs;
    // One computation serves both: the most alternatives either asks for.
    let prompt_top = match (echo_logprobs, common.prompt_logprobs) {
        (Some(a), Some(b)) => Some(a.max(b)),
        (a, b) => a.or(b),
    };
    let items = expand(&common, prompts, "prompt", echo, prompt_top)?;
    Ok(GenerationRequest {
        items,
        n: common.n,
        stream: common.stream,
        include_usage: common.include_usage,
        continuous_usage: common.continuous_usage,
        tokens_as_ids: common.tokens_as_ids,
        echo,
        logprobs: logprobs.is_some(),
        echo_logprobs,
        prompt_logprobs: common.prompt_logprobs,
        guide,
        tool_calls: false,
        chat_echo: None,
        ignored_fields: ignored_fields(body, COMPLETION_FIELD_NAMES),
        capture: None,
        request_id: common.request_id,
        beam_search: common.beam_search,
    })
}

#[derive(Debug, Default, Deserialize)]
struct TokenizeFields {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Value>,
    add_special_tokens: Option<bool>,
    return_token_strs: Option<bool>,
}

/// A validated `POST /tokenize` body.
#[derive(Debug)]
pub struct TokenizeRequest {
    pub prompt: PromptInput,
    pub add_special_tokens: bool,
    /// vLLM's `return_token_strs`: each token as the vocabulary spells it, too.
    pub return_token_strs: bool,
}

/// Validates a `POST /tokenize` body (vLLM's): a `prompt` string or chat `messages`.
pub fn tokenize_request(
    body: &Value,
    limits: &ModelLimits,
) -> Result<TokenizeRequest, InvalidRequest> {
    let fields: TokenizeFields = typed(body)?;
    check_model(&fields.model, limits)?;
    let prompt = match (&fields.prompt, &fields.messages) {
        (Some(prompt), None) => PromptInput::Text(prompt.clone()),
        (None, Some(_)) => {
            // vLLM's rendering fields apply here too.
            let chat: ChatFields = typed(body)?;
            let mut options = chat_render_options(&chat)?;
            options.tools = super::tools::parse_tools(body)?.map(|t| t.offered());
            PromptInput::Chat(parse_messages(fields.messages.as_ref())?, options)
        }
        _ => {
            return Err(InvalidRequest::invalid(
                "prompt",
                "give either `prompt` (a string) or `messages`",
            ))
        }
    };
    Ok(TokenizeRequest {
        prompt,
        add_special_tokens: fields.add_special_tokens.unwrap_or(true),
        return_token_strs: fields.return_token_strs.unwrap_or(false),
    })
}

#[derive(Debug, Default, Deserialize)]
struct DetokenizeFields {
    model: Option<String>,
    tokens: Option<Vec<u32>>,
}

/// Validates a `POST /detokenize` body (vLLM's).
pub fn detokenize_request(body: &Value, limits: &ModelLimits) -> Result<Vec<u32>, InvalidRequest> {
    let fields: DetokenizeFields = typed(body)?;
    check_model(&fields.model, limits)?;
    fields.tokens.ok_or(InvalidRequest::Missing("tokens"))
}

fn parse_prompts(value: &Option<Value>) -> Result<Vec<PromptInput>, InvalidRequest> {
    let wrong = || {
        InvalidRequest::invalid(
            "prompt",
            "prompt must be a string, a list of token ids, a list of strings or a list of lists of token ids",
        )
    };
    let token_ids = |items: &[Value]| -> Option<Vec<u32>> {
        items
            .iter()
            .map(|v| v.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    match value {
        None | Some(Value::Null) => Err(InvalidRequest::Missing("prompt")),
        Some(Value::String(s)) => Ok(vec![PromptInput::Text(s.clone())]),
        Some(Value::Array(items)) if items.is_empty() => Err(InvalidRequest::invalid(
            "prompt",
            "prompt must not be empty",
        )),
        Some(Value::Array(items)) => match &items[0] {
            Value::Number(_) => Ok(vec![PromptInput::Tokens(
                token_ids(items).ok_or_else(wrong)?,
            )]),
            Value::String(_) => items
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(|s| PromptInput::Text(s.to_string()))
                        .ok_or_else(wrong)
                })
                .collect(),
            Value::Array(_) => items
                .iter()
                .map(|v| {
                    v.as_array()
                        .and_then(|ids| token_ids(ids))
                        .map(PromptInput::Tokens)
                        .ok_or_else(wrong)
                })
                .collect(),
            _ => Err(wrong()),
        },
        Some(_) => Err(wrong()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::Seen;
    use serde_json::json;

    const LIMITS: ModelLimits = ModelLimits {
        served_name: "m",
        aliases: &[],
    };

    #[test]
    fn every_served_name_is_accepted() {
        let aliases = ["alias".to_string()];
        let limits = ModelLimits {
            served_name: "m",
            aliases: &aliases,
        };
        for model in ["m", "alias"] {
            assert!(completion_request(&json!({"model": model, "prompt": "x"}), &limits).is_ok());
        }
        let e = completion_request(&json!({"model": "other", "prompt": "x"}), &limits).unwrap_err();
        let e = Seen::from(e);
        assert_eq!(e.code, Some("model_not_found"));
    }

    #[test]
    fn truncate_prompt_tokens_keeps_the_prompts_end() {
        let truncation = |value: Value| {
            let body = json!({"prompt": "x", "truncate_prompt_tokens": value});
            completion_request(&body, &LIMITS).map(|r| r.items[0].truncate_prompt)
        };
        assert_eq!(truncation(json!(5)), Ok(Some(PromptTruncation::Last(5))));
        assert_eq!(truncation(json!(-1)), Ok(Some(PromptTruncation::ToFit)));
        for bad in [json!(0), json!(-2)] {
            let e = Seen::from(truncation(bad).unwrap_err());
            assert_eq!(e.param.as_deref(), Some("truncate_prompt_tokens"));
        }
        // What a prompt of 10 tokens loses in a context of 8.
        assert_eq!(PromptTruncation::Last(4).cut(10, 8, None), 6);
        assert_eq!(PromptTruncation::Last(40).cut(10, 8, None), 0);
        assert_eq!(PromptTruncation::ToFit.cut(10, 8, None), 3);
        assert_eq!(PromptTruncation::ToFit.cut(10, 8, Some(5)), 7);
        assert_eq!(PromptTruncation::ToFit.cut(10, 8, Some(0)), 2);
    }

    #[test]
    fn integer_fields_take_floats_without_a_fraction() {
        let body = parse_body(
            br#"{"prompt": "x", "max_tokens": 16.0, "n": 2.0, "top_k": -1.0, "seed": 7.0}"#,
        )
        .unwrap();
        let r = completion_request(&body, &LIMITS).unwrap();
        assert_eq!(r.n, 2);
        assert_eq!(r.items[0].max_tokens, Some(16));
        assert_eq!(r.items[0].params.seed, Some(7));
        let body = parse_body(br#"{"prompt": "x", "max_tokens": 16.5}"#).unwrap();
        assert_eq!(completion_err(body).param.as_deref(), Some("max_tokens"));
    }

    #[test]
    fn usage_in_every_chunk_needs_a_stream_and_include_usage() {
        let usage = |stream: bool, options: Value| {
            let body = json!({"prompt": "x", "stream": stream, "stream_options": options});
            let r = completion_request(&body, &LIMITS).unwrap();
            (r.include_usage, r.continuous_usage)
        };
        let both = json!({"include_usage": true, "continuous_usage_stats": true});
        assert_eq!(usage(true, both.clone()), (true, true));
        assert_eq!(usage(false, Value::Null), (false, false));
        let body = json!({"prompt": "x", "stream": false, "stream_options": both});
        assert_eq!(
            completion_err(body).param.as_deref(),
            Some("stream_options")
        );
        let body = json!({"prompt": "x", "stream_options": {"include_usage": false}});
        assert_eq!(
            completion_err(body).param.as_deref(),
            Some("stream_options")
        );
        // As vLLM: given options include the usage unless they say not to.
        assert_eq!(
            usage(true, json!({"continuous_usage_stats": true})),
            (true, true)
        );
        assert_eq!(usage(true, json!({})), (true, false));
        assert_eq!(usage(true, json!({"include_usage": false})), (false, false));
        assert_eq!(usage(true, Value::Null), (false, false));
        assert_eq!(usage(false, json!({})), (false, false));
        assert_eq!(usage(true, json!({"include_usage": true})), (true, false));
    }

    #[test]
    fn tokens_as_ids_is_a_known_field() {
        let body = json!({"prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": true});
        let r = completion_request(&body, &LIMITS).unwrap();
        assert!(r.tokens_as_ids && r.ignored_fields.is_empty());
        let body = json!({"messages": [{"role": "user", "content": "x"}]});
        assert!(!chat_request(&body, &LIMITS).unwrap().tokens_as_ids);
    }

    fn chat_err(body: Value) -> Seen {
        chat_request(&body, &LIMITS).unwrap_err().into()
    }

    fn completion_err(body: Value) -> Seen {
        completion_request(&body, &LIMITS).unwrap_err().into()
    }

    #[test]
    fn chat_accepts_text_parts_and_unknown_fields() {
        let r = chat_request(
            &json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "input_text", "text": "!"}]},
                    {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                    {"role": "ipython", "content": "{}"}
                ],
                "max_tokens": 5, "n": 2, "seed": 7, "stop": "\n", "attn_capture": true, "user": "u",
                "frobnicate": 1
            }),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(r.ignored_fields, vec!["frobnicate".to_string()]);
        assert_eq!(r.items.len(), 2);
        assert_eq!(r.items[0].params.seed, Some(7));
        assert_eq!(r.items[1].params.seed, Some(8));
        assert_eq!(r.items[0].max_tokens, Some(5));
        assert_eq!(&*r.items[0].stop, ["\n".to_string()]);
        match &*r.items[0].prompt {
            PromptInput::Chat(m, options) => {
                assert_eq!(m[2].content, "No.");
                assert_eq!(m[3].role, "ipython");
                // Joined by a newline, as vLLM joins text parts.
                assert_eq!(m[1].content, "Hi\n!");
                assert_eq!(*options, ChatRenderOptions::default());
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_assistants_reasoning_given_back_goes_to_the_template() {
        let messages = |assistant: Value| {
            chat_messages(&json!([{"role": "user", "content": "Hi"}, assistant]))
                .map(|m| m[1].reasoning.clone())
                .map_err(|e| Seen::from(e).message)
        };
        for field in ["reasoning", "reasoning_content"] {
            let given = json!({"role": "assistant", "content": "4", field: "2 + 2"});
            assert_eq!(messages(given), Ok(Some("2 + 2".to_string())));
        }
        // vLLM's clients send both names; `reasoning` first.
        let both =
            json!({"role": "assistant", "content": "", "reasoning": "a", "reasoning_content": "b"});
        assert_eq!(messages(both), Ok(Some("a".to_string())));
        assert_eq!(
            messages(json!({"role": "assistant", "content": "4", "reasoning": null})),
            Ok(None)
        );
        let err = messages(json!({"role": "assistant", "content": "4", "reasoning": 1}));
        assert!(
            err.as_ref()
                .is_err_and(|e| e.contains("messages[1]: `reasoning` must be a string")),
            "{err:?}"
        );
    }

    #[test]
    fn reasoning_effort_is_the_templates_variable() {
        let kwargs = |extra: Value| {
            let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "Hi"}]});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            chat_request(&body, &LIMITS).map(|r| match &*r.items[0].prompt {
                PromptInput::Chat(_, options) => options.kwargs.get("reasoning_effort").cloned(),
                other => panic!("{other:?}"),
            })
        };
        assert_eq!(
            kwargs(json!({"reasoning_effort": "high"})).unwrap(),
            Some(json!("high"))
        );
        assert_eq!(kwargs(json!({})).unwrap(), None);
        let both = json!({"reasoning_effort": "high", "chat_template_kwargs": {"reasoning_effort": "low"}});
        assert_eq!(kwargs(both).unwrap(), Some(json!("low")));
        let err = Seen::from(kwargs(json!({"reasoning_effort": "max"})).unwrap_err());
        assert_eq!(err.param.as_deref(), Some("reasoning_effort"));
        assert!(err.message.contains("low, medium, high"), "{}", err.message);
    }

    #[test]
    fn chat_errors_name_the_field() {
        let e = chat_err(json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}));
        assert_eq!(e.status, 404);
        assert_eq!(e.code, Some("model_not_found"));
        assert_eq!(chat_err(json!({})).param.as_deref(), Some("messages"));
        assert_eq!(
            chat_err(json!({"messages": []})).param.as_deref(),
            Some("messages")
        );
        let e = chat_err(json!({"messages": [{"role": "wizard", "content": "x"}]}));
        assert!(e.message.contains("wizard"), "{}", e.message);
        let msg = json!([{"role": "user", "content": "x"}]);
        for (body, field) in [
            (json!({"messages": msg, "max_tokens": -1}), "max_tokens"),
            (
                json!({"messages": msg, "max_completion_tokens": -3}),
                "max_completion_tokens",
            ),
            (json!({"messages": msg, "temperature": -0.5}), "temperature"),
            (
                json!({"messages": msg, "temperature": 1e300}),
                "temperature",
            ),
            (
                json!({"messages": msg, "repetition_penalty": 1e300}),
                "repetition_penalty",
            ),
            (json!({"messages": msg, "top_p": 0}), "top_p"),
            (json!({"messages": msg, "top_p": 1.5}), "top_p"),
            (json!({"messages": msg, "n": 0}), "n"),
            (json!({"messages": msg, "stop": 5}), "stop"),
            (json!({"messages": msg, "stop": ["a", 1]}), "stop"),
            (
                json!({"messages": msg, "temperature": "hot"}),
                "temperature",
            ),
            (
                json!({"messages": msg, "logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (json!({"messages": msg, "top_logprobs": 2}), "top_logprobs"),
            (
                json!({"messages": msg, "presence_penalty": 2.5}),
                "presence_penalty",
            ),
            (
                json!({"messages": msg, "frequency_penalty": -3}),
                "frequency_penalty",
            ),
            (
                json!({"messages": msg, "repetition_penalty": 0}),
                "repetition_penalty",
            ),
        ] {
            let e = chat_err(body.clone());
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
            assert!(e.message.contains(field), "{body}: {}", e.message);
        }
    }

    #[test]
    fn completion_prompts() {
        let r = completion_request(&json!({"prompt": [1, 2, 3]}), &LIMITS).unwrap();
        assert!(matches!(&*r.items[0].prompt, PromptInput::Tokens(t) if t == &[1, 2, 3]));
        assert_eq!(r.items[0].max_tokens, Some(16));
        let r = completion_request(&json!({"prompt": ["a", "b"], "n": 2}), &LIMITS).unwrap();
        assert_eq!(r.items.len(), 4);
        let r = completion_request(&json!({"prompt": [[1], [2, 3]]}), &LIMITS).unwrap();
        assert_eq!(r.items.len(), 2);
        assert_eq!(completion_err(json!({})).param.as_deref(), Some("prompt"));
        assert_eq!(
            completion_err(json!({"prompt": [1, "a"]})).param.as_deref(),
            Some("prompt")
        );
        assert_eq!(
            completion_err(json!({"prompt": [-1]})).param.as_deref(),
            Some("prompt")
        );
        assert_eq!(
            completion_err(json!({"prompt": "x", "logprobs": 21}))
                .param
                .as_deref(),
            Some("logprobs")
        );
        let r = completion_request(&json!({"prompt": "x", "logprobs": 2}), &LIMITS).unwrap();
        assert_eq!(r.items[0].params.logprobs, Some(2));
        assert!(r.logprobs);
    }

    #[test]
    fn prompt_logprobs_ask_the_engine_for_them() {
        let r = completion_request(&json!({"prompt": "x"}), &LIMITS).unwrap();
        assert!(r.items[0].params.prompt_logprobs.is_none());
        assert_eq!(r.items[0].prompt_logprobs, None);
        // Logprobs without echo need no prompt logits.
        let r = completion_request(&json!({"prompt": "x", "logprobs": 2}), &LIMITS).unwrap();
        assert!(r.items[0].params.prompt_logprobs.is_none());
        assert_eq!(r.echo_logprobs, None);
        let r = completion_request(
            &json!({"prompt": ["x", "y"], "n": 2, "echo": true, "logprobs": 3}),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(r.echo_logprobs, Some(3));
        assert_eq!(r.prompt_logprobs, None);
        for item in &r.items {
            assert!(item.params.prompt_logprobs.is_some());
            assert_eq!(item.prompt_logprobs, Some(3));
            assert_eq!(item.params.logprobs, Some(3));
        }
        let r = completion_request(
            &json!({"prompt": "x", "echo": true, "logprobs": 1, "prompt_logprobs": 4}),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(r.items[0].prompt_logprobs, Some(4), "the larger of the two");
        assert_eq!((r.echo_logprobs, r.prompt_logprobs), (Some(1), Some(4)));
        let r = chat_request(
            &json!({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0}),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(r.prompt_logprobs, Some(0));
        assert!(r.items[0].params.prompt_logprobs.is_some());
        // Streaming: as vLLM, refused when it would return anything, else ignored.
        let r = completion_request(
            &json!({"prompt": "x", "stream": true, "prompt_logprobs": 0}),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(r.prompt_logprobs, None);
        assert!(r.items[0].params.prompt_logprobs.is_none());
        for body in [
            json!({"prompt": "x", "stream": true, "prompt_logprobs": 1}),
            json!({"prompt": "x", "prompt_logprobs": -1}),
            json!({"prompt": "x", "prompt_logprobs": 21}),
        ] {
            let e = completion_err(body.clone());
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some("prompt_logprobs"), "{body}");
        }
    }

    #[test]
    fn penalties_and_logprobs_reach_the_params() {
        let r = chat_request(
            &json!({
                "messages": [{"role": "user", "content": "x"}],
                "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3,
                "logprobs": true, "top_logprobs": 3
            }),
            &LIMITS,
        )
        .unwrap();
        let p = &r.items[0].params;
        assert_eq!(p.presence_penalty, 0.5);
        assert_eq!(p.frequency_penalty, -1.0);
        assert_eq!(p.repetition_penalty, 1.3);
        assert_eq!(p.logprobs, Some(3));
        assert!(r.logprobs);
        let r = chat_request(
            &json!({"messages": [{"role": "user", "content": "x"}], "logprobs": false}),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(r.items[0].params.logprobs, None);
    }

    #[test]
    fn bodies_must_be_json_objects() {
        assert!(parse_body(b"{not json")
            .unwrap_err()
            .to_string()
            .contains("JSON"));
        assert!(parse_body(b"[1]").is_err());
        assert!(parse_body(b"{}").is_ok());
    }

    #[test]
    fn vllm_chat_fields_are_read_and_checked() {
        let msgs = json!([
            {"role": "user", "content": "Name a fruit."},
            {"role": "assistant", "content": "The fruit is"}
        ]);
        let r = chat_request(
            &json!({"messages": msgs, "continue_final_message": true, "echo": true,
                    "chat_template_kwargs": {"enable_thinking": false}}),
            &LIMITS,
        )
        .unwrap();
        match &*r.items[0].prompt {
            PromptInput::Chat(_, o) => {
                assert!(o.continue_final_message);
                assert!(!o.add_generation_prompt, "continuing implies no new turn");
                assert_eq!(o.kwargs["enable_thinking"], json!(false));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(r.chat_echo.as_deref(), Some("The fruit is"));
        assert!(r.ignored_fields.is_empty());
        let e = chat_err(json!({"messages": msgs, "continue_final_message": true,
                                "add_generation_prompt": true}));
        assert_eq!(e.param.as_deref(), Some("continue_final_message"));
        let big = "x".repeat(MAX_CHAT_TEMPLATE_KWARGS_BYTES);
        for kwargs in [json!([1]), json!({"a": big})] {
            let e = chat_err(json!({"messages": msgs, "chat_template_kwargs": kwargs}));
            assert_eq!(e.param.as_deref(), Some("chat_template_kwargs"));
        }
        // Echo needs the assistant's message last.
        let r = chat_request(
            &json!({"messages": [{"role": "user", "content": "x"}], "echo": true}),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(r.chat_echo, None);
    }

    #[test]
    fn min_tokens_and_logit_bias_reach_the_params() {
        let r = completion_request(
            &json!({"prompt": "x", "max_tokens": 8, "min_tokens": 3,
                    "logit_bias": {"17": 100, "4": -5.5}}),
            &LIMITS,
        )
        .unwrap();
        let p = &r.items[0].params;
        assert_eq!(p.min_tokens, 3);
        let mut bias = p.logit_bias.clone();
        bias.sort_by_key(|b| b.0);
        assert_eq!(bias, vec![(4, -5.5), (17, 100.0)]);
        for (body, field) in [
            (
                json!({"prompt": "x", "max_tokens": 2, "min_tokens": 3}),
                "min_tokens",
            ),
            (json!({"prompt": "x", "min_tokens": -1}), "min_tokens"),
            (
                json!({"prompt": "x", "logit_bias": {"7": 101}}),
                "logit_bias",
            ),
            (
                json!({"prompt": "x", "logit_bias": {"7": "up"}}),
                "logit_bias",
            ),
            (
                json!({"prompt": "x", "logit_bias": {"seven": 1}}),
                "logit_bias",
            ),
            (json!({"prompt": "x", "logit_bias": [1]}), "logit_bias"),
            (json!({"prompt": "x", "stop": ["a", ""]}), "stop"),
            (json!({"prompt": "x", "stop": ""}), "stop"),
        ] {
            let e = completion_err(body.clone());
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
        }
        let r = completion_request(
            &json!({"prompt": "x", "wat": 1, "attn_capture_rows": "all"}),
            &LIMITS,
        )
        .unwrap();
        assert_eq!(r.ignored_fields, vec!["wat".to_string()]);
    }

    #[test]
    fn lone_surrogate_escapes_read_as_replacement_characters() {
        let prompt =
            |body: &[u8]| parse_body(body).map(|v| v["prompt"].as_str().unwrap().to_string());
        assert_eq!(
            prompt(br#"{"prompt": "a\ud83d b"}"#).unwrap(),
            "a\u{FFFD} b"
        );
        assert_eq!(
            prompt(br#"{"prompt": "\ude00\ud83d"}"#).unwrap(),
            "\u{FFFD}\u{FFFD}"
        );
        // A pair is one character; an escaped backslash is no escape.
        assert_eq!(
            prompt(br#"{"prompt": "\ud83d\ude00 \ud800"}"#).unwrap(),
            "\u{1F600} \u{FFFD}"
        );
        assert_eq!(prompt(br#"{"prompt": "\\ud800"}"#).unwrap(), "\\ud800");
        // Other broken JSON stays broken.
        assert!(parse_body(br#"{"prompt": "\ud800" "#).is_err());
        assert!(parse_body(br#"{"prompt": \ud800}"#).is_err());
    }

    #[test]
    fn token_filters_and_special_tokens_reach_the_items() {
        let r = completion_request(
            &json!({"prompt": "x", "n": 2, "allowed_token_ids": [9, 3, 9],
                    "bad_words": ["no", " way"], "skip_special_tokens": false}),
            &LIMITS,
        )
        .unwrap();
        assert!(r.ignored_fields.is_empty(), "{:?}", r.ignored_fields);
        for item in &r.items {
            let filter = &item.params.token_filter;
            assert_eq!(filter.allowed().collect::<Vec<_>>(), [3, 9]);
            assert_eq!(&*item.bad_words, ["no".to_string(), " way".to_string()]);
            assert!(!item.params.skip_special_tokens);
        }
        let p = &completion_request(&json!({"prompt": "x", "bad_words": null}), &LIMITS)
            .unwrap()
            .items[0];
        assert!(p.params.token_filter.is_empty() && p.bad_words.is_empty());
        assert!(p.params.skip_special_tokens);
        // vLLM's seed -1 is no seed.
        let r = completion_request(&json!({"prompt": "x", "seed": -1}), &LIMITS).unwrap();
        assert_eq!(r.items[0].params.seed, None);
        let many: Vec<String> = (0..=MAX_BAD_WORDS).map(|i| i.to_string()).collect();
        for body in [
            json!({"prompt": "x", "allowed_token_ids": []}),
            json!({"prompt": "x", "allowed_token_ids": [-1]}),
            json!({"prompt": "x", "allowed_token_ids": "3"}),
        ] {
            let e = completion_err(body.clone());
            assert_eq!(e.param.as_deref(), Some("allowed_token_ids"), "{body}");
        }
        for body in [
            json!({"prompt": "x", "bad_words": "no"}),
            json!({"prompt": "x", "bad_words": many}),
        ] {
            let e = completion_err(body.clone());
            assert_eq!(e.param.as_deref(), Some("bad_words"), "{body}");
        }
    }
}
