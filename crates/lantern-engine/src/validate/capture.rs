//! The capture fields of a request (`attn_capture`, `attn_capture_*`): parsed into a
//! [`CaptureSpec`] against the model and the front end's [`CaptureSettings`], and the size
//! checks that refuse, before any work, a capture that could not be delivered.

use std::path::PathBuf;
use std::time::Duration;

use lantern_capture::{
    largest_fitting, CaptureDtype, CaptureError, CaptureGeometry, CaptureSpan, CaptureSpec,
    HeadReduce, KeyStat, RowSelection, SpanAt, StatHeads, MAX_SPANS,
};
use serde_json::Value;

use super::InvalidRequest;
use crate::serving::ItemCapture;

/// Default cap on one capture's size (the maps before compression).
pub const DEFAULT_MAX_CAPTURE_BYTES: u64 = 256 << 20;
/// Default time a stored capture is kept.
pub const DEFAULT_CAPTURE_TTL: Duration = Duration::from_secs(600);
/// Default cap on the bytes of all stored captures and capture files together.
pub const DEFAULT_MAX_STORED_CAPTURE_BYTES: u64 = 1 << 30;

/// The server's capture settings.
#[derive(Debug, Clone)]
pub struct CaptureSettings {
    /// Off by default: a request that asks for capture gets a 400 saying so.
    pub enabled: bool,
    /// Layers captured when a request names none (`None`: every layer).
    pub default_layers: Option<Vec<usize>>,
    /// Largest capture one request may ask for, in bytes.
    pub max_bytes: u64,
    /// How long references and files are kept.
    pub ttl: Duration,
    /// Where delivery `"file"` writes (only when set).
    pub dir: Option<PathBuf>,
    /// Bytes that stored captures and capture files may take together; past it,
    /// requests for delivery by reference or file are refused with a 503.
    pub max_stored_bytes: u64,
    /// Finished captures that may wait for the capture worker; past it, capturing
    /// requests are refused with a 503.
    pub max_queued: usize,
    /// Panics while finalizing a chosen capture (tests of fault containment only).
    pub fault: crate::fault::Trigger,
}

impl Default for CaptureSettings {
    fn default() -> Self {
        Self {
            enabled: false,
            default_layers: None,
            max_bytes: DEFAULT_MAX_CAPTURE_BYTES,
            ttl: DEFAULT_CAPTURE_TTL,
            dir: None,
            max_stored_bytes: DEFAULT_MAX_STORED_CAPTURE_BYTES,
            max_queued: lantern_capture::DEFAULT_MAX_QUEUED_CAPTURES,
            fault: Default::default(),
        }
    }
}

/// How a finished capture reaches the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// In the response, gzip+base64 per layer.
    Inline,
    /// Stored; the response carries an id for `GET /v1/captures/{id}`.
    Reference,
    /// A safetensors file in the server's capture directory.
    File,
}

/// What one request asked to capture, validated against the model.
#[derive(Debug, Clone)]
pub struct CaptureRequest {
    pub spec: CaptureSpec,
    pub delivery: Delivery,
}

fn field_error(e: CaptureError) -> InvalidRequest {
    match e {
        CaptureError::InvalidField { field, message } => InvalidRequest::invalid(field, message),
        other => InvalidRequest::invalid("attn_capture", other.to_string()),
    }
}

/// Indices into `count` items (layers or heads), as Python indexes: `"all"`, one
/// integer, a list of integers, or a string of comma-separated integers and ranges
/// (`"0,7,15"`, `"0:4"`, `"-4:"`, `"-1"`). Negative numbers count from the end, and a
/// range `a:b` is `a` up to but not including `b` (either side may be left out).
/// An index out of range is an error; a range is clipped, as a Python slice is.
fn parse_indices(
    field: &'static str,
    value: &Value,
    count: usize,
) -> Result<Vec<usize>, InvalidRequest> {
    let bad = || {
        InvalidRequest::invalid(
            field,
            format!(
                "{field} must be \"all\", an integer, a list of integers, or a string like \"0,7,15\", \"0:4\" or \"-1\" (negative counts from the end)"
            ),
        )
    };
    let what = if field == "attn_capture_heads" {
        "query heads"
    } else {
        "layers"
    };
    let resolve = |i: i64| -> Result<usize, InvalidRequest> {
        let resolved = if i < 0 { i + count as i64 } else { i };
        usize::try_from(resolved)
            .ok()
            .filter(|&r| r < count)
            .ok_or_else(|| {
                InvalidRequest::invalid(
                    field,
                    format!(
                        "{i} is out of range: the model has {count} {what} (0..{}, or -{count}..-1 from the end)",
                        count.saturating_sub(1)
                    ),
                )
            })
    };
    // A slice bound: negative counts from the end; clipped to 0..=count.
    let bound = |i: i64| -> usize {
        let i = if i < 0 { i + count as i64 } else { i };
        i.clamp(0, count as i64) as usize
    };
    let integer = |text: &str| text.trim().parse::<i64>().map_err(|_| bad());
    let index = |v: &Value| v.as_i64().ok_or_else(bad).and_then(resolve);
    match value {
        Value::String(s) if s.trim() == "all" => Ok((0..count).collect()),
        Value::String(s) => {
            let mut indices = Vec::new();
            for part in s.split(',') {
                match part.split_once(':') {
                    Some((start, end)) => {
                        let start = match start.trim() {
                            "" => 0,
                            text => bound(integer(text)?),
                        };
                        let end = match end.trim() {
                            "" => count,
                            text => bound(integer(text)?),
                        };
                        if start >= end {
                            return Err(InvalidRequest::invalid(
                                field,
                                format!(
                                    "{:?} selects no {what}: the model has {count} (0..{})",
                                    part.trim(),
                                    count.saturating_sub(1)
                                ),
                            ));
                        }
                        indices.extend(start..end);
                    }
                    None => indices.push(resolve(integer(part)?)?),
                }
            }
            Ok(indices)
        }
        Value::Array(items) => items.iter().map(index).collect(),
        Value::Number(_) => Ok(vec![index(value)?]),
        _ => Err(bad()),
    }
}

/// Key statistics from a list of names or one comma-separated string.
fn parse_stats(value: &Value) -> Result<Vec<KeyStat>, InvalidRequest> {
    let names: Vec<&str> = match value {
        Value::String(s) => s.split(',').collect(),
        Value::Array(items) => items
            .iter()
            .map(|v| {
                v.as_str().ok_or_else(|| {
                    InvalidRequest::invalid(
                        "attn_capture_stats",
                        "attn_capture_stats must be a list of \"key_mass\", \"key_max\", \"block_mass\"",
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        _ => {
            return Err(InvalidRequest::invalid(
                "attn_capture_stats",
                "attn_capture_stats must be a list of \"key_mass\", \"key_max\", \"block_mass\"",
            ))
        }
    };
    names
        .into_iter()
        .map(|name| KeyStat::parse(name).map_err(field_error))
        .collect()
}

/// Spans of the prompt: a list of `{"label": str}` objects, each with one of
/// `"tokens": [start, end)`, `"chars": [start, end)`, `"message": i`, or `"message": i`
/// with `"chars"`. Checked here as far as the request alone allows; resolved to tokens
/// once the prompt is tokenized ([`crate::prompt`]).
fn parse_spans(value: &Value) -> Result<Vec<CaptureSpan>, InvalidRequest> {
    const FIELD: &str = "attn_capture_spans";
    let bad = |message: String| InvalidRequest::invalid(FIELD, message);
    let items = value.as_array().ok_or_else(|| {
        bad(format!(
            "{FIELD} must be a list of objects like {{\"label\": \"doc 1\", \"chars\": [0, 120]}}"
        ))
    })?;
    if items.is_empty() {
        return Err(bad(format!(
            "{FIELD} is empty; name at least one span or leave it out"
        )));
    }
    if items.len() > MAX_SPANS {
        return Err(bad(format!(
            "{FIELD} names {} spans; at most {MAX_SPANS} are allowed",
            items.len()
        )));
    }
    let range =
        |at: &str, key: &str, v: &Value| -> Result<std::ops::Range<usize>, InvalidRequest> {
            let pair = v
                .as_array()
                .filter(|a| a.len() == 2)
                .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)));
            match pair {
                Some((start, end)) => Ok(start as usize..end as usize),
                None => Err(bad(format!(
                    "{at}: \"{key}\" must be [start, end), two integers >= 0 (end excluded)"
                ))),
            }
        };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let at = format!("{FIELD}[{i}]");
            let object = item.as_object().ok_or_else(|| {
                bad(format!("{at} must be an object with \"label\" and one of \"tokens\", \"chars\", \"message\""))
            })?;
            if let Some(unknown) = object
                .keys()
                .find(|k| !["label", "tokens", "chars", "message"].contains(&k.as_str()))
            {
                return Err(bad(format!(
                    "{at}: unknown key {unknown:?}; a span has \"label\" and one of \"tokens\", \"chars\", \"message\" (or \"message\" with \"chars\")"
                )));
            }
            let label = object
                .get("label")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("{at}: \"label\" must be a string")))?;
            let message = match object.get("message") {
                None => None,
                Some(v) => Some(v.as_u64().ok_or_else(|| {
                    bad(format!("{at}: \"message\" must be a message index (an integer >= 0)"))
                })? as usize),
            };
            let tokens = object.get("tokens").map(|v| range(&at, "tokens", v)).transpose()?;
            let chars = object.get("chars").map(|v| range(&at, "chars", v)).transpose()?;
            let span_at = match (tokens, chars, message) {
                (Some(t), None, None) => SpanAt::Tokens(t),
                (None, Some(c), None) => SpanAt::Chars(c),
                (None, None, Some(m)) => SpanAt::Message(m),
                (None, Some(c), Some(m)) => SpanAt::MessageChars(m, c),
                (None, None, None) => {
                    return Err(bad(format!(
                        "{at} ({label:?}) names no range: give \"tokens\", \"chars\" or \"message\""
                    )))
                }
                _ => {
                    return Err(bad(format!(
                        "{at} ({label:?}): \"tokens\" goes alone; give one of \"tokens\", \"chars\", \"message\" (or \"message\" with \"chars\")"
                    )))
                }
            };
            Ok(CaptureSpan::new(label, span_at))
        })
        .collect()
}

fn string_field<'a>(
    body: &'a Value,
    field: &'static str,
) -> Result<Option<&'a str>, InvalidRequest> {
    match body.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(InvalidRequest::invalid(
            field,
            format!("{field} must be a string"),
        )),
    }
}

/// The capture fields a request may send beside `attn_capture`.
pub const CAPTURE_FIELDS: [&str; 11] = [
    "attn_capture_layers",
    "attn_capture_heads",
    "attn_capture_rows",
    "attn_capture_reduce",
    "attn_capture_top_k",
    "attn_capture_dtype",
    "attn_capture_delivery",
    "attn_capture_stats",
    "attn_capture_stats_heads",
    "attn_capture_maps",
    "attn_capture_spans",
];

/// Whether the body asks for capture: `attn_capture` true or 1. Capture fields
/// without `attn_capture` are refused (they would do nothing); with `attn_capture`
/// false they are ignored, so a client can switch capture off with one flag.
fn wants_capture(body: &Value) -> Result<bool, InvalidRequest> {
    let set = |field: &str| body.get(field).is_some_and(|v| !v.is_null());
    if let Value::Object(fields) = body {
        if let Some(unknown) = fields
            .keys()
            .find(|k| k.starts_with("attn_capture_") && !CAPTURE_FIELDS.contains(&k.as_str()))
        {
            return Err(InvalidRequest::invalid(
                "attn_capture",
                format!(
                    "{unknown} is not a capture field; they are attn_capture, {}",
                    CAPTURE_FIELDS.join(", ")
                ),
            ));
        }
    }
    match body.get("attn_capture") {
        None | Some(Value::Null) => match CAPTURE_FIELDS.into_iter().find(|f| set(f)) {
            Some(field) => Err(InvalidRequest::invalid(
                field,
                format!(
                    "{field} is set but attn_capture is not: add \"attn_capture\": true to capture"
                ),
            )),
            None => Ok(false),
        },
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::Number(n)) if n.as_u64() == Some(0) => Ok(false),
        Some(Value::Number(n)) if n.as_u64() == Some(1) => Ok(true),
        Some(_) => Err(InvalidRequest::invalid(
            "attn_capture",
            "attn_capture must be true/false or 1/0",
        )),
    }
}

/// Reads the capture fields of a request body (top level, where the `openai` client's
/// `extra_body` puts them). `None` when the request does not ask for capture.
pub fn parse_capture_request(
    body: &Value,
    settings: &CaptureSettings,
    num_layers: usize,
    num_heads: usize,
) -> Result<Option<CaptureRequest>, InvalidRequest> {
    if !wants_capture(body)? {
        return Ok(None);
    }
    if !settings.enabled {
        return Err(InvalidRequest::invalid(
            "attn_capture",
            "attention capture is disabled on this server; start it with --enable-attention-capture",
        ));
    }
    let layers = match body.get("attn_capture_layers") {
        None | Some(Value::Null) => settings
            .default_layers
            .clone()
            .unwrap_or_else(|| (0..num_layers).collect()),
        Some(v) => parse_indices("attn_capture_layers", v, num_layers)?,
    };
    let heads = match body.get("attn_capture_heads") {
        None | Some(Value::Null) => (0..num_heads).collect(),
        Some(v) => parse_indices("attn_capture_heads", v, num_heads)?,
    };
    let rows = match string_field(body, "attn_capture_rows")? {
        None => RowSelection::All,
        Some(s) => RowSelection::parse(s).map_err(field_error)?,
    };
    let reduce = match string_field(body, "attn_capture_reduce")? {
        None => HeadReduce::None,
        Some(s) => HeadReduce::parse(s).map_err(field_error)?,
    };
    let dtype = match string_field(body, "attn_capture_dtype")? {
        None => CaptureDtype::Float32,
        Some(s) => CaptureDtype::parse(s).map_err(field_error)?,
    };
    let top_k = match body.get("attn_capture_top_k") {
        None | Some(Value::Null) => None,
        Some(v) => match v.as_u64() {
            Some(k) if k >= 1 => Some(k as usize),
            _ => {
                return Err(InvalidRequest::invalid(
                    "attn_capture_top_k",
                    "attn_capture_top_k must be a positive integer",
                ))
            }
        },
    };
    let delivery = match string_field(body, "attn_capture_delivery")? {
        None | Some("inline") => Delivery::Inline,
        Some("reference") => Delivery::Reference,
        Some("file") if settings.dir.is_some() => Delivery::File,
        Some("file") => {
            return Err(InvalidRequest::invalid(
                "attn_capture_delivery",
                "delivery \"file\" needs the server to run with --capture-dir DIR",
            ))
        }
        Some(other) => {
            return Err(InvalidRequest::invalid(
                "attn_capture_delivery",
                format!("{other:?} is not \"inline\", \"reference\" or \"file\""),
            ))
        }
    };
    let stats = match body.get("attn_capture_stats") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => parse_stats(v)?,
    };
    let stats_heads = match string_field(body, "attn_capture_stats_heads")? {
        None => StatHeads::default(),
        Some(s) => StatHeads::parse(s).map_err(field_error)?,
    };
    let spans = match body.get("attn_capture_spans") {
        None | Some(Value::Null) => Vec::new(),
        Some(v) => parse_spans(v)?,
    };
    // Statistics and spans are asked for instead of the maps, unless the maps are
    // asked too.
    let maps = match body.get("attn_capture_maps") {
        None | Some(Value::Null) => stats.is_empty() && spans.is_empty(),
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(InvalidRequest::invalid(
                "attn_capture_maps",
                "attn_capture_maps must be true or false",
            ))
        }
    };
    let mut spec = CaptureSpec {
        layers,
        heads,
        rows,
        reduce,
        top_k,
        dtype,
        keep_attention_output: false,
        stats,
        stats_heads,
        maps,
        spans,
        span_text: None,
        // Set by the endpoint, which knows whether the response streams.
        stream_rows: false,
    };
    spec.validate(num_layers, num_heads).map_err(field_error)?;
    Ok(Some(CaptureRequest { spec, delivery }))
}

/// Refuses, before any work, a capture that cannot be delivered for a prompt of
/// `prompt_len` tokens and up to `max_tokens` generated ones: rows that can never
/// exist, an admission figure (maps plus the memory computing them holds) over the
/// server's cap, or maps larger than the whole capture store for delivery by
/// reference or file.
pub fn check_capture(
    capture: &ItemCapture,
    prompt_len: usize,
    max_tokens: usize,
    geometry: CaptureGeometry,
) -> Result<(), InvalidRequest> {
    let spec = &capture.spec;
    spec.check_rows(prompt_len, max_tokens)
        .map_err(field_error)?;
    spec.check_size(prompt_len, max_tokens, capture.max_bytes, geometry)
        .map_err(|e| match e {
            CaptureError::TooLarge(too_large) => InvalidRequest::CaptureTooLarge(too_large),
            other => field_error(other),
        })?;
    if let Some(store_bytes) = capture.max_stored_bytes {
        let estimate_bytes = spec.estimate_bytes(prompt_len, max_tokens);
        if estimate_bytes > store_bytes {
            return Err(InvalidRequest::CaptureOverStore {
                estimate_bytes,
                store_bytes,
                fitting_max_tokens: largest_fitting(max_tokens, |m| {
                    spec.estimate_bytes(prompt_len, m) <= store_bytes
                }),
            });
        }
    }
    Ok(())
}

/// The most tokens (up to `room`) a capturing request may generate and still pass
/// [`check_capture`]'s size checks; `None` when not even one token does.
pub fn max_tokens_within(
    capture: &ItemCapture,
    prompt_len: usize,
    room: usize,
    geometry: CaptureGeometry,
) -> Option<usize> {
    let spec = &capture.spec;
    largest_fitting(room, |m| {
        spec.admission_bytes(prompt_len, m, geometry) <= capture.max_bytes
            && capture
                .max_stored_bytes
                .is_none_or(|store| spec.estimate_bytes(prompt_len, m) <= store)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::Seen;
    use serde_json::json;

    fn enabled() -> CaptureSettings {
        CaptureSettings {
            enabled: true,
            ..CaptureSettings::default()
        }
    }

    fn parse(body: Value) -> Result<Option<CaptureRequest>, Seen> {
        Ok(parse_capture_request(&body, &enabled(), 30, 9)?)
    }

    #[test]
    fn span_forms_and_bad_spans() {
        let spans = |v: Value| {
            parse(json!({"attn_capture": true, "attn_capture_spans": v})).map(|r| r.unwrap().spec)
        };
        let spec = spans(json!([
            {"label": "a", "tokens": [0, 3]},
            {"label": "b", "chars": [5, 9]},
            {"label": "c", "message": 2},
            {"label": "d", "message": 1, "chars": [0, 4]},
        ]))
        .unwrap();
        let at: Vec<_> = spec.spans.iter().map(|s| s.at.clone()).collect();
        assert_eq!(
            at,
            [
                SpanAt::Tokens(0..3),
                SpanAt::Chars(5..9),
                SpanAt::Message(2),
                SpanAt::MessageChars(1, 0..4)
            ]
        );
        // Spans alone: no maps unless asked.
        assert!(!spec.maps);
        let too_many: Vec<Value> = (0..=MAX_SPANS)
            .map(|i| json!({"label": i.to_string(), "tokens": [i, i + 1]}))
            .collect();
        for (bad, expected) in [
            (json!({"label": "a"}), "must be a list"),
            (json!([]), "empty"),
            (json!(too_many), "at most 256"),
            (
                json!([{"label": "a", "tokens": [0, 2]}, {"label": "b", "tokens": [1, 3]}]),
                "overlap",
            ),
            (json!([{"label": "a", "tokens": [2, 2]}]), "empty"),
            (json!([{"label": "a", "tokens": [0, -2]}]), "two integers"),
            (
                json!([{"label": "a", "tokens": [0, 2], "chars": [0, 2]}]),
                "goes alone",
            ),
            (json!([{"label": "a"}]), "names no range"),
            (json!([{"tokens": [0, 2]}]), "label"),
            (json!([{"label": "a", "words": [0, 2]}]), "unknown key"),
            (json!([{"label": "a", "message": -1}]), "message index"),
            (
                json!([{"label": "a", "tokens": [0, 1]}, {"label": "a", "tokens": [2, 3]}]),
                "labels must differ",
            ),
        ] {
            let e = spans(bad.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("attn_capture_spans"), "{bad}");
            assert!(e.message.contains(expected), "{bad}: {}", e.message);
        }
    }

    #[test]
    fn no_capture_unless_asked() {
        assert!(parse(json!({})).unwrap().is_none());
        assert!(parse(json!({"attn_capture": false})).unwrap().is_none());
        assert!(parse(json!({"attn_capture": 0})).unwrap().is_none());
    }

    #[test]
    fn disabled_server_refuses() {
        let e = Seen::from(
            parse_capture_request(
                &json!({"attn_capture": true}),
                &CaptureSettings::default(),
                30,
                9,
            )
            .unwrap_err(),
        );
        assert_eq!(e.param.as_deref(), Some("attn_capture"));
        assert!(e.message.contains("--enable-attention-capture"));
    }

    #[test]
    fn layer_forms() {
        let layers = |v: Value| {
            parse(json!({"attn_capture": 1, "attn_capture_layers": v}))
                .unwrap()
                .unwrap()
                .spec
                .layers
        };
        assert_eq!(layers(json!("all")).len(), 30);
        assert_eq!(layers(json!("15, 0,7")), vec![0, 7, 15]);
        assert_eq!(layers(json!([3, 1, 3])), vec![1, 3]);
        assert_eq!(layers(json!(4)), vec![4]);
        // As Python indexes and slices: from the end, and half-open ranges.
        assert_eq!(layers(json!(-1)), vec![29]);
        assert_eq!(layers(json!([0, -1])), vec![0, 29]);
        assert_eq!(layers(json!("-1")), vec![29]);
        assert_eq!(layers(json!("0:4")), vec![0, 1, 2, 3]);
        assert_eq!(layers(json!("-2:")), vec![28, 29]);
        assert_eq!(layers(json!(":2, 10:12, -1")), vec![0, 1, 10, 11, 29]);
        assert_eq!(layers(json!("28:100")), vec![28, 29]);
        let heads = parse(json!({"attn_capture": 1, "attn_capture_heads": "-3:"}))
            .unwrap()
            .unwrap()
            .spec
            .heads;
        assert_eq!(heads, vec![6, 7, 8]);
    }

    #[test]
    fn out_of_range_layers_and_empty_ranges_are_refused() {
        for (value, says) in [
            (json!(30), "30 is out of range: the model has 30 layers"),
            (json!(-31), "-31 is out of range"),
            (json!("0,-31"), "-31 is out of range"),
            (json!("4:4"), "\"4:4\" selects no layers"),
            (json!("30:"), "\"30:\" selects no layers"),
            (json!("0:x"), "must be \"all\""),
            (json!(1.5), "must be \"all\""),
        ] {
            let e = parse(json!({"attn_capture": true, "attn_capture_layers": value})).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("attn_capture_layers"), "{value}");
            assert!(e.message.contains(says), "{value}: {}", e.message);
        }
    }

    #[test]
    fn capture_fields_need_attn_capture() {
        let e = parse(json!({"attn_capture_layers": [0]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("attn_capture_layers"));
        assert!(
            e.message.contains("\"attn_capture\": true"),
            "{}",
            e.message
        );
        let e = parse(json!({"attn_capture_delivery": "reference"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("attn_capture_delivery"));
        // Switched off by the flag, the other fields are ignored.
        assert!(
            parse(json!({"attn_capture": false, "attn_capture_layers": [0]}))
                .unwrap()
                .is_none()
        );
        assert!(parse(json!({"attn_capture_layers": null}))
            .unwrap()
            .is_none());
        // A misspelt field is named, not ignored.
        let e = parse(json!({"attn_capture": true, "attn_capture_layer": [0]})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("attn_capture"));
        assert!(
            e.message
                .contains("attn_capture_layer is not a capture field"),
            "{}",
            e.message
        );
    }

    #[test]
    fn malformed_fields_name_themselves() {
        for (body, field) in [
            (json!({"attn_capture": "yes"}), "attn_capture"),
            (json!({"attn_capture": 2}), "attn_capture"),
            (
                json!({"attn_capture": true, "attn_capture_layers": "0,x"}),
                "attn_capture_layers",
            ),
            (
                json!({"attn_capture": true, "attn_capture_layers": [30]}),
                "attn_capture_layers",
            ),
            (
                json!({"attn_capture": true, "attn_capture_heads": [9]}),
                "attn_capture_heads",
            ),
            (
                json!({"attn_capture": true, "attn_capture_rows": "middle"}),
                "attn_capture_rows",
            ),
            (
                json!({"attn_capture": true, "attn_capture_reduce": "sum"}),
                "attn_capture_reduce",
            ),
            (
                json!({"attn_capture": true, "attn_capture_top_k": 0}),
                "attn_capture_top_k",
            ),
            (
                json!({"attn_capture": true, "attn_capture_dtype": "int8"}),
                "attn_capture_dtype",
            ),
            (
                json!({"attn_capture": true, "attn_capture_delivery": "file"}),
                "attn_capture_delivery",
            ),
            (
                json!({"attn_capture": true, "attn_capture_delivery": "email"}),
                "attn_capture_delivery",
            ),
        ] {
            let e = parse(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
        }
    }

    fn item(spec: CaptureSpec, max_bytes: u64, max_stored_bytes: Option<u64>) -> ItemCapture {
        ItemCapture {
            spec,
            max_bytes,
            max_stored_bytes,
        }
    }

    const GEOMETRY: CaptureGeometry = CaptureGeometry {
        num_kv_heads: 3,
        head_dim: 64,
    };

    #[test]
    fn size_cap_gives_the_admission_figure_in_binary_units_and_what_fits() {
        let spec = parse(json!({"attn_capture": true})).unwrap().unwrap().spec;
        let capture = item(spec.clone(), 64 << 20, None);
        let e = Seen::from(check_capture(&capture, 100, 4000, GEOMETRY).unwrap_err());
        let figure = spec.admission_bytes(100, 4000, GEOMETRY);
        // More than the maps alone (30 layers x 9 heads x 4100 rows x 4100 keys x 4 bytes).
        assert!(figure > 30 * 9 * 4100 * 4100 * 4);
        assert!(e.message.contains(&figure.to_string()), "{}", e.message);
        assert!(
            e.message.contains(&format!("about {}", human(figure))),
            "{}",
            e.message
        );
        assert!(
            e.message
                .contains("limit of 64.0 MiB (--max-capture-bytes)"),
            "{}",
            e.message
        );
        // Every row of every head: the maps dominate.
        assert!(
            e.message.contains("most of it is the maps delivered"),
            "{}",
            e.message
        );
        let fits = capture_spec_fit(&spec, 100, 4000, 64 << 20);
        assert!(fits > 0 && fits < 4000);
        assert!(
            e.message.contains(&format!(
                "fits with max_tokens {fits} or fewer (this request's is 4000"
            )),
            "{}",
            e.message
        );
        check_capture(&capture, 100, fits, GEOMETRY).unwrap();
        assert_eq!(e.code, Some("capture_too_large"));
        assert_eq!(e.param.as_deref(), Some("attn_capture"));
        // Prompt rows past the cap: no max_tokens helps, and none is offered.
        let prompt = parse(json!({"attn_capture": true, "attn_capture_rows": "prompt"}))
            .unwrap()
            .unwrap()
            .spec;
        let e = Seen::from(
            check_capture(&item(prompt, 1 << 20, None), 2000, 10, GEOMETRY).unwrap_err(),
        );
        assert!(!e.message.contains("fits with max_tokens"), "{}", e.message);
        assert!(
            e.message.contains("fewer layers, heads or rows"),
            "{}",
            e.message
        );
    }

    fn human(bytes: u64) -> String {
        lantern_capture::human_bytes(bytes)
    }

    fn capture_spec_fit(spec: &CaptureSpec, prompt: usize, room: usize, limit: u64) -> usize {
        spec.max_tokens_within(prompt, room, limit, GEOMETRY)
            .unwrap()
    }

    #[test]
    fn a_capture_larger_than_the_whole_store_is_refused_before_any_work() {
        let spec = parse(json!({"attn_capture": true, "attn_capture_delivery": "reference"}))
            .unwrap()
            .unwrap()
            .spec;
        let maps = spec.estimate_bytes(9, 100);
        let capture = item(spec.clone(), u64::MAX, Some(maps - 1));
        let e = Seen::from(check_capture(&capture, 9, 100, GEOMETRY).unwrap_err());
        assert_eq!(e.param.as_deref(), Some("attn_capture_delivery"));
        assert!(
            e.message.contains("--max-stored-capture-bytes"),
            "{}",
            e.message
        );
        assert!(e.message.contains("could never be stored"), "{}", e.message);
        assert!(
            e.message.contains("fits with max_tokens 99 or fewer"),
            "{}",
            e.message
        );
        check_capture(&capture, 9, 99, GEOMETRY).unwrap();
        // Unasked, max_tokens stops where the store would overflow.
        assert_eq!(max_tokens_within(&capture, 9, 100, GEOMETRY), Some(99));
        // Inline delivery stores nothing.
        check_capture(&item(spec, u64::MAX, None), 9, 100, GEOMETRY).unwrap();
    }

    #[test]
    fn rows_that_can_never_exist_are_refused() {
        let rows = |rows: &str| {
            let spec = parse(json!({"attn_capture": true, "attn_capture_rows": rows}))
                .unwrap()
                .unwrap()
                .spec;
            item(spec, u64::MAX, None)
        };
        for (selection, prompt, max_tokens) in [
            ("100:200", 9, 16),
            ("generated", 9, 0),
            ("generated", 9, 1),
            ("9:", 9, 1),
        ] {
            let e = Seen::from(
                check_capture(&rows(selection), prompt, max_tokens, GEOMETRY).unwrap_err(),
            );
            assert_eq!(e.param.as_deref(), Some("attn_capture_rows"), "{selection}");
        }
        let e = Seen::from(check_capture(&rows("100:200"), 9, 16, GEOMETRY).unwrap_err());
        assert!(e.message.contains("positions 0..24"), "{}", e.message);
        // Rows that may exist are fine, even where the rest of the range cannot.
        for (selection, prompt, max_tokens) in [
            ("generated", 9, 2),
            ("23:200", 9, 16),
            ("prompt", 9, 0),
            ("all", 9, 0),
        ] {
            check_capture(&rows(selection), prompt, max_tokens, GEOMETRY).unwrap();
        }
    }
}
