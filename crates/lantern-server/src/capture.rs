//! Attention capture over HTTP: the request fields, the server's limits, and delivery
//! of a finished capture (inline JSON, a stored reference, or a file).
//!
//! Finalization (the maps) and encoding run on the capture worker, a low-priority
//! thread of their own, never on the engine thread or the async workers, so other
//! requests keep running at full speed while a capture is computed.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use lantern_engine::lantern_capture::{
    largest_fitting, wire, CaptureDtype, CaptureError, CaptureFailure, CaptureGeometry,
    CaptureSpan, CaptureSpec, CaptureWorker, HeadReduce, KeyStat, Pacer, PendingCapture,
    RowSelection, SpanAt, StatHeads, MAX_SPANS,
};
use rand::RngCore;
use serde_json::{json, Map, Value};

use crate::engine_thread::ItemCapture;
use crate::error::ApiError;
use crate::invalid_request::InvalidRequest;

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
    pub fault: lantern_engine::fault::Trigger,
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
            max_queued: lantern_engine::lantern_capture::DEFAULT_MAX_QUEUED_CAPTURES,
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

/// One stored capture.
struct Stored {
    bytes: Arc<Vec<u8>>,
    /// The bearer token that made it (`None` on a server without keys).
    owner: Option<String>,
    expires: Instant,
}

/// Captures delivered by reference, and files written for delivery `"file"`, until
/// they expire, at most `max_bytes` of them together. A timer task started by
/// [`CaptureStore::start`] frees each at its expiry; the files still held when the
/// store is dropped (the server stopping) are deleted then.
pub struct CaptureStore {
    entries: Mutex<HashMap<String, Stored>>,
    /// Wakes the expiry timer when something new is stored.
    stored_new: Arc<tokio::sync::Notify>,
    /// Each file with its expiry and size.
    files: Mutex<Vec<(PathBuf, Instant, u64)>>,
    delivered: AtomicU64,
    failed: AtomicU64,
    /// Failed captures whose finalizing panicked (contained on the capture worker).
    panicked: AtomicU64,
    max_bytes: u64,
}

impl Default for CaptureStore {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_STORED_CAPTURE_BYTES)
    }
}

/// The store has no room for a capture.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreFull {
    pub stored: u64,
    pub wanted: u64,
    pub max: u64,
}

impl std::fmt::Display for StoreFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the capture store is full ({} of {} bytes held, {} more wanted): fetch and delete stored captures, or retry after they expire",
            self.stored, self.max, self.wanted
        )
    }
}

/// 128 random bits as hex: ids and file names nobody can guess.
fn unguessable() -> String {
    let mut bytes = [0u8; 16];
    rand::rngs::OsRng.fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn same_owner(stored: &Option<String>, asking: &Option<String>) -> bool {
    match (stored, asking) {
        (None, _) => true,
        (Some(a), Some(b)) => crate::same_secret(a.as_bytes(), b.as_bytes()),
        (Some(_), None) => false,
    }
}

/// Whether `name` is one lantern gives a capture file ([`write_private_file`]).
fn is_capture_file_name(name: &str) -> bool {
    name.strip_prefix(CAPTURE_FILE_PREFIX)
        .and_then(|rest| rest.strip_suffix(CAPTURE_FILE_SUFFIX))
        .is_some_and(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
}

const CAPTURE_FILE_PREFIX: &str = "lantern-capture-";
const CAPTURE_FILE_SUFFIX: &str = ".safetensors";

/// Deletes the capture files an earlier server left in `dir` (only names of
/// lantern's own pattern); returns how many.
pub fn remove_leftover_files(dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(is_capture_file_name))
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter(|e| std::fs::remove_file(e.path()).is_ok())
        .count()
}

/// Frees what expires, at its expiry: sleeps until the next expiry or a new entry,
/// and ends once the store is gone.
async fn expire_on_time(store: std::sync::Weak<CaptureStore>) {
    // Without anything stored, look again now and then to notice the store is gone.
    const IDLE: Duration = Duration::from_secs(60);
    loop {
        let Some(live) = store.upgrade() else { return };
        live.purge();
        let wake = live.stored_new.clone();
        let until = live.next_expiry().unwrap_or_else(|| Instant::now() + IDLE);
        drop(live);
        tokio::select! {
            () = wake.notified() => {}
            () = tokio::time::sleep_until(until.into()) => {}
        }
    }
}

impl Drop for CaptureStore {
    /// The server is stopping: its capture files (on a tmpfs, memory) go with it.
    fn drop(&mut self) {
        if let Ok(files) = self.files.get_mut() {
            for (path, _, _) in files.drain(..) {
                let _ = std::fs::remove_file(path);
            }
        }
    }
}

impl CaptureStore {
    /// The server's store: deletes the capture files an earlier server left in the
    /// capture directory, and, inside a Tokio runtime, starts the timer that frees
    /// each capture at its expiry.
    pub fn start(settings: &CaptureSettings) -> Arc<Self> {
        if let Some(dir) = &settings.dir {
            let removed = remove_leftover_files(dir);
            if removed > 0 {
                tracing::info!(
                    "removed {removed} capture files an earlier server left in {}",
                    dir.display()
                );
            }
        }
        let store = Arc::new(Self::new(settings.max_stored_bytes));
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(expire_on_time(Arc::downgrade(&store)));
        }
        store
    }

    /// When the next stored capture or file expires.
    fn next_expiry(&self) -> Option<Instant> {
        let entries = self
            .entries
            .lock()
            .ok()
            .and_then(|e| e.values().map(|s| s.expires).min());
        let files = self
            .files
            .lock()
            .ok()
            .and_then(|f| f.iter().map(|(_, expires, _)| *expires).min());
        entries.into_iter().chain(files).min()
    }

    pub fn new(max_bytes: u64) -> Self {
        Self {
            entries: Mutex::default(),
            stored_new: Arc::default(),
            files: Mutex::default(),
            delivered: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            panicked: AtomicU64::new(0),
            max_bytes,
        }
    }

    /// Bytes held by stored captures and capture files (expired ones excluded).
    pub fn stored_bytes(&self) -> u64 {
        self.purge();
        let entries: u64 = self
            .entries
            .lock()
            .map_or(0, |e| e.values().map(|s| s.bytes.len() as u64).sum());
        let files: u64 = self
            .files
            .lock()
            .map_or(0, |f| f.iter().map(|(_, _, size)| size).sum());
        entries + files
    }

    /// Whether `wanted` more bytes fit.
    pub fn check_room(&self, wanted: u64) -> Result<(), StoreFull> {
        let stored = self.stored_bytes();
        if stored.saturating_add(wanted) > self.max_bytes {
            return Err(StoreFull {
                stored,
                wanted,
                max: self.max_bytes,
            });
        }
        Ok(())
    }

    /// Drops expired entries and deletes expired files.
    fn purge(&self) {
        let now = Instant::now();
        if let Ok(mut entries) = self.entries.lock() {
            entries.retain(|_, s| s.expires > now);
        }
        if let Ok(mut files) = self.files.lock() {
            files.retain(|(path, expires, _)| {
                if *expires > now {
                    return true;
                }
                let _ = std::fs::remove_file(path);
                false
            });
        }
    }

    /// Stores `bytes` under a new id, if they fit.
    fn insert(
        &self,
        bytes: Vec<u8>,
        owner: Option<String>,
        ttl: Duration,
    ) -> Result<String, StoreFull> {
        // Inserts come from the one capture worker, so the room checked stays free.
        self.check_room(bytes.len() as u64)?;
        let id = format!("cap-{}", unguessable());
        let stored = Stored {
            bytes: Arc::new(bytes),
            owner,
            expires: Instant::now() + ttl,
        };
        if let Ok(mut entries) = self.entries.lock() {
            entries.insert(id.clone(), stored);
        }
        self.stored_new.notify_one();
        Ok(id)
    }

    /// Whether capture `id` is stored, whoever owns it.
    pub fn contains(&self, id: &str) -> bool {
        self.purge();
        self.entries.lock().is_ok_and(|e| e.contains_key(id))
    }

    pub(crate) fn not_found(id: &str) -> ApiError {
        ApiError::not_found(format!(
            "no capture `{id}`: it never existed, expired, was deleted, or belongs to another API key"
        ))
    }

    /// The safetensors bytes of capture `id`, for the key that made it.
    pub fn get(&self, id: &str, asking: &Option<String>) -> Result<Arc<Vec<u8>>, ApiError> {
        self.purge();
        let entries = self.entries.lock().map_err(|_| ApiError::unavailable())?;
        match entries.get(id) {
            Some(s) if same_owner(&s.owner, asking) => Ok(s.bytes.clone()),
            _ => Err(Self::not_found(id)),
        }
    }

    /// Frees capture `id`.
    pub fn remove(&self, id: &str, asking: &Option<String>) -> Result<(), ApiError> {
        self.purge();
        let mut entries = self.entries.lock().map_err(|_| ApiError::unavailable())?;
        match entries.get(id) {
            Some(s) if same_owner(&s.owner, asking) => {
                entries.remove(id);
                Ok(())
            }
            _ => Err(Self::not_found(id)),
        }
    }

    /// Number of stored captures (expired ones excluded).
    pub fn len(&self) -> usize {
        self.purge();
        self.entries.lock().map_or(0, |e| e.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Counts of delivered and failed captures and the stored ones, for `/metrics`.
    pub fn stats(&self) -> crate::metrics::CaptureStats {
        crate::metrics::CaptureStats {
            delivered: self.delivered.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            panicked: self.panicked.load(Ordering::Relaxed),
            stored: self.len(),
        }
    }

    fn track_file(&self, path: PathBuf, ttl: Duration, size: u64) {
        if let Ok(mut files) = self.files.lock() {
            files.push((path, Instant::now() + ttl, size));
        }
        self.stored_new.notify_one();
    }
}

/// Writes `bytes` to a new file with an unguessable name, readable by its owner only.
fn write_private_file(dir: &std::path::Path, bytes: &[u8]) -> std::io::Result<PathBuf> {
    let path = dir.join(format!(
        "{CAPTURE_FILE_PREFIX}{}{CAPTURE_FILE_SUFFIX}",
        unguessable()
    ));
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(&path)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    Ok(path)
}

/// Finalizes a capture on the capture worker and turns it into the response fields of
/// its delivery. A capture that fails yields `attn_capture_error` instead: the
/// generated text is still good.
pub async fn deliver(
    pending: Result<PendingCapture, CaptureFailure>,
    request: &CaptureRequest,
    store: Arc<CaptureStore>,
    owner: Option<String>,
    settings: &CaptureSettings,
    worker: &CaptureWorker,
) -> Map<String, Value> {
    let delivery = request.delivery;
    let dtype = request.spec.dtype;
    let ttl = settings.ttl;
    let dir = settings.dir.clone();
    let counters = store.clone();
    let fault = settings.fault.clone();
    let work = move |pacer: &Pacer| -> Result<Map<String, Value>, CaptureFailure> {
        fault.panic_if_hit("while finalizing a capture");
        let result = pending?
            .finalize_with(|| pacer.pause())
            .map_err(|e| CaptureFailure::Finalize(e.to_string()))?;
        let encode = |e: &dyn std::fmt::Display| CaptureFailure::Encode(e.to_string());
        let meta = serde_json::to_value(&result.meta).map_err(|e| encode(&e))?;
        let mut fields = Map::new();
        match delivery {
            Delivery::Inline => {
                if let Value::Object(inline) = wire::to_json(&result, dtype) {
                    fields.extend(inline);
                }
            }
            Delivery::Reference => {
                let bytes = wire::to_safetensors(&result, dtype).map_err(|e| encode(&e))?;
                let id = store
                    .insert(bytes, owner, ttl)
                    .map_err(|e| CaptureFailure::StoreFull(e.to_string()))?;
                fields.insert("attn_capture_id".into(), json!(id));
                fields.insert("attn_capture_expires_in".into(), json!(ttl.as_secs()));
                fields.insert("attn_capture_meta".into(), meta);
            }
            Delivery::File => {
                let dir = dir.ok_or(CaptureFailure::NoDirectory)?;
                let bytes = wire::to_safetensors(&result, dtype).map_err(|e| encode(&e))?;
                store
                    .check_room(bytes.len() as u64)
                    .map_err(|e| CaptureFailure::StoreFull(e.to_string()))?;
                let path = write_private_file(&dir, &bytes)
                    .map_err(|e| CaptureFailure::WriteFile(e.to_string()))?;
                store.track_file(path.clone(), ttl, bytes.len() as u64);
                fields.insert("attn_capture_path".into(), json!(path));
                fields.insert("attn_capture_expires_in".into(), json!(ttl.as_secs()));
                fields.insert("attn_capture_meta".into(), meta);
            }
        }
        Ok(fields)
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let outcome = match worker.submit(move |pacer| {
        // A panic fails this capture only; the worker goes on with the others.
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(pacer)))
            .unwrap_or_else(|panic| {
                let message = crate::engine_thread::panic_message(panic.as_ref());
                tracing::error!(panic = %message, "finalizing a capture panicked");
                Err(CaptureFailure::Panicked)
            });
        let _ = tx.send(outcome);
    }) {
        Ok(()) => rx.await.unwrap_or(Err(CaptureFailure::WorkerStopped)),
        Err(e) => Err(e.into()),
    };
    let counter = if outcome.is_ok() {
        &counters.delivered
    } else {
        &counters.failed
    };
    counter.fetch_add(1, Ordering::Relaxed);
    if matches!(outcome, Err(CaptureFailure::Panicked)) {
        counters.panicked.fetch_add(1, Ordering::Relaxed);
    }
    outcome.unwrap_or_else(|error| {
        tracing::warn!(%error, "attention capture failed");
        let mut fields = Map::new();
        fields.insert("attn_capture_error".into(), json!(error.to_string()));
        fields
    })
}

/// Refuses a capturing request up front (503, with `Retry-After`) while the capture
/// worker's queue is full, or, for delivery by reference or file, the store is.
pub fn check_capacity(
    request: &CaptureRequest,
    store: &CaptureStore,
    worker: &CaptureWorker,
) -> Result<(), ApiError> {
    let busy = |message: String| ApiError {
        code: Some("capture_capacity"),
        ..ApiError::with_status(StatusCode::SERVICE_UNAVAILABLE, message)
    };
    if worker.is_full() {
        return Err(busy(format!(
            "the capture worker has {} captures waiting, its limit; retry later",
            worker.queued()
        )));
    }
    if request.delivery != Delivery::Inline {
        // Any room at all admits it; a capture that does not fit when it is done fails
        // with `attn_capture_error` (its size is known only then).
        store.check_room(1).map_err(|e| busy(e.to_string()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enabled() -> CaptureSettings {
        CaptureSettings {
            enabled: true,
            ..CaptureSettings::default()
        }
    }

    fn parse(body: Value) -> Result<Option<CaptureRequest>, ApiError> {
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
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
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
        let e = ApiError::from(
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
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
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
        let e = ApiError::from(check_capture(&capture, 100, 4000, GEOMETRY).unwrap_err());
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
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.code, Some("capture_too_large"));
        assert_eq!(e.param.as_deref(), Some("attn_capture"));
        // Prompt rows past the cap: no max_tokens helps, and none is offered.
        let prompt = parse(json!({"attn_capture": true, "attn_capture_rows": "prompt"}))
            .unwrap()
            .unwrap()
            .spec;
        let e = ApiError::from(
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
        lantern_engine::lantern_capture::human_bytes(bytes)
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
        let e = ApiError::from(check_capture(&capture, 9, 100, GEOMETRY).unwrap_err());
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
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
            let e = ApiError::from(
                check_capture(&rows(selection), prompt, max_tokens, GEOMETRY).unwrap_err(),
            );
            assert_eq!(e.param.as_deref(), Some("attn_capture_rows"), "{selection}");
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
        }
        let e = ApiError::from(check_capture(&rows("100:200"), 9, 16, GEOMETRY).unwrap_err());
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

    #[test]
    fn store_is_per_owner_and_expires() {
        let store = CaptureStore::default();
        let owner = Some("key-a".to_string());
        let id = store
            .insert(vec![1, 2, 3], owner.clone(), Duration::from_secs(60))
            .unwrap();
        assert!(id.starts_with("cap-") && id.len() == 36);
        assert_eq!(*store.get(&id, &owner).unwrap(), vec![1, 2, 3]);
        assert!(store.get(&id, &Some("key-b".into())).is_err());
        assert!(store.get(&id, &None).is_err());
        assert!(store.remove(&id, &Some("key-b".into())).is_err());
        store.remove(&id, &owner).unwrap();
        assert!(store.get(&id, &owner).is_err());
        let short = store
            .insert(vec![0], None, Duration::from_millis(1))
            .unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(store.get(&short, &None).is_err());
        assert!(store.is_empty());
    }

    #[test]
    fn only_lantern_capture_file_names_are_leftovers() {
        let dir = tempfile_dir();
        let id = "0123456789abcdef".repeat(2);
        let ours = dir.join(format!("lantern-capture-{id}.safetensors"));
        let others = [
            dir.join("notes.txt"),
            dir.join("lantern-capture-short.safetensors"),
            dir.join(format!("lantern-capture-{id}.npy")),
            dir.join(format!("my-lantern-capture-{id}.safetensors")),
        ];
        for path in others.iter().chain([&ours]) {
            std::fs::write(path, b"x").unwrap();
        }
        assert_eq!(remove_leftover_files(&dir), 1);
        assert!(!ours.exists());
        assert!(others.iter().all(|p| p.exists()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(format!("lantern-store-test-{}", unguessable()));
        std::fs::create_dir(&dir).unwrap();
        dir
    }

    #[test]
    fn files_go_at_their_ttl_by_the_timer_and_with_the_store() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let dir = tempfile_dir();
        let settings = CaptureSettings {
            dir: Some(dir.clone()),
            ..CaptureSettings::default()
        };
        runtime.block_on(async {
            let store = CaptureStore::start(&settings);
            let short = write_private_file(&dir, b"short").unwrap();
            store.track_file(short.clone(), Duration::from_millis(50), 5);
            let long = write_private_file(&dir, b"long").unwrap();
            store.track_file(long.clone(), Duration::from_secs(600), 4);
            let id = store
                .insert(vec![0; 8], None, Duration::from_millis(50))
                .unwrap();
            // Nothing touches the store meanwhile: only the timer can free them.
            tokio::time::sleep(Duration::from_millis(300)).await;
            assert!(!short.exists(), "the expired file is deleted on time");
            assert!(long.exists());
            let entries = store.entries.lock().unwrap();
            assert!(
                !entries.contains_key(&id),
                "the expired capture is freed on time"
            );
            drop(entries);
            drop(store);
            assert!(!long.exists(), "the store's files go with it");
        });
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_store_is_bounded_in_bytes_and_frees_on_delete() {
        let store = CaptureStore::new(100);
        let ttl = Duration::from_secs(60);
        let a = store.insert(vec![0; 60], None, ttl).unwrap();
        let full = store.insert(vec![0; 60], None, ttl).unwrap_err();
        assert_eq!((full.stored, full.wanted, full.max), (60, 60, 100));
        assert!(full.to_string().contains("capture store is full"));
        store.insert(vec![0; 40], None, ttl).unwrap();
        assert_eq!(store.stored_bytes(), 100);
        store.remove(&a, &None).unwrap();
        assert_eq!(store.stored_bytes(), 40);
        store.insert(vec![0; 60], None, ttl).unwrap();
    }

    #[test]
    fn a_full_store_or_worker_queue_refuses_with_503() {
        let reference = parse(json!({"attn_capture": true, "attn_capture_delivery": "reference"}))
            .unwrap()
            .unwrap();
        let inline = parse(json!({"attn_capture": true})).unwrap().unwrap();
        let busy = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let worker = CaptureWorker::start(busy, 1).unwrap();
        let store = CaptureStore::new(10);
        check_capacity(&reference, &store, &worker).unwrap();
        store
            .insert(vec![0; 10], None, Duration::from_secs(60))
            .unwrap();
        let e = check_capacity(&reference, &store, &worker).unwrap_err();
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(e.message.contains("capture store is full"), "{}", e.message);
        // Inline delivery stores nothing: the full store does not refuse it.
        check_capacity(&inline, &store, &worker).unwrap();
        // A worker held by one job, with one more waiting, is full.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let (started_tx, started) = std::sync::mpsc::channel::<()>();
        worker
            .submit(move |_| {
                started_tx.send(()).unwrap();
                held.recv().unwrap();
            })
            .unwrap();
        started.recv().unwrap();
        worker.submit(|_| {}).unwrap();
        let e = check_capacity(&inline, &store, &worker).unwrap_err();
        assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(e.message.contains("captures waiting"), "{}", e.message);
        let response = axum::response::IntoResponse::into_response(e);
        assert!(response.headers().contains_key("retry-after"));
        release.send(()).unwrap();
    }
}
