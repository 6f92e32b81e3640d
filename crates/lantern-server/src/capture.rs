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
    wire, CaptureDtype, CaptureError, CaptureFailure, CaptureGeometry, CaptureSpec, CaptureWorker,
    HeadReduce, Pacer, PendingCapture, RowSelection,
};
use rand::RngCore;
use serde_json::{json, Map, Value};

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

/// A list of indices from `"all"`, `"0,7,15"`, a list of integers or one integer.
fn parse_indices(
    field: &'static str,
    value: &Value,
    all: usize,
) -> Result<Vec<usize>, InvalidRequest> {
    let bad = || {
        InvalidRequest::invalid(
            field,
            format!("{field} must be \"all\", a comma-separated string like \"0,7,15\" or a list of integers"),
        )
    };
    let index = |v: &Value| v.as_u64().map(|i| i as usize).ok_or_else(bad);
    match value {
        Value::String(s) if s.trim() == "all" => Ok((0..all).collect()),
        Value::String(s) => s
            .split(',')
            .map(|part| part.trim().parse::<usize>().map_err(|_| bad()))
            .collect(),
        Value::Array(items) => items.iter().map(index).collect(),
        Value::Number(_) => Ok(vec![index(value)?]),
        _ => Err(bad()),
    }
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

/// Whether the body asks for capture: `attn_capture` true or 1.
fn wants_capture(body: &Value) -> Result<bool, InvalidRequest> {
    match body.get("attn_capture") {
        None | Some(Value::Null) => Ok(false),
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
    let mut spec = CaptureSpec {
        layers,
        heads,
        rows,
        reduce,
        top_k,
        dtype,
        keep_attention_output: false,
    };
    spec.validate(num_layers, num_heads).map_err(field_error)?;
    Ok(Some(CaptureRequest { spec, delivery }))
}

/// Refuses a capture whose admission figure (maps plus the memory computing them
/// holds) is over the server's cap, before any work.
pub fn check_capture_size(
    spec: &CaptureSpec,
    prompt_len: usize,
    max_tokens: usize,
    limit: u64,
    geometry: CaptureGeometry,
) -> Result<(), InvalidRequest> {
    spec.check_size(prompt_len, max_tokens, limit, geometry)
        .map_err(|e| match e {
            CaptureError::TooLarge {
                estimate_bytes,
                limit_bytes,
            } => InvalidRequest::CaptureTooLarge {
                estimate_bytes,
                limit_bytes,
            },
            other => field_error(other),
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
/// they expire, at most `max_bytes` of them together.
pub struct CaptureStore {
    entries: Mutex<HashMap<String, Stored>>,
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

impl CaptureStore {
    pub fn new(max_bytes: u64) -> Self {
        Self {
            entries: Mutex::default(),
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
    }
}

/// Writes `bytes` to a new file with an unguessable name, readable by its owner only.
fn write_private_file(dir: &std::path::Path, bytes: &[u8]) -> std::io::Result<PathBuf> {
    let path = dir.join(format!("lantern-capture-{}.safetensors", unguessable()));
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

    #[test]
    fn size_cap_gives_the_admission_figure() {
        let spec = parse(json!({"attn_capture": true})).unwrap().unwrap().spec;
        let geometry = CaptureGeometry {
            num_kv_heads: 3,
            head_dim: 64,
        };
        let e = ApiError::from(check_capture_size(&spec, 100, 100, 1000, geometry).unwrap_err());
        let figure = spec.admission_bytes(100, 100, geometry);
        // More than the maps alone (30 layers x 9 heads x 200 rows x 200 keys x 4 bytes).
        assert!(figure > 30 * 9 * 200 * 200 * 4);
        assert!(e.message.contains(&figure.to_string()), "{}", e.message);
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.code, Some("capture_too_large"));
        assert_eq!(e.param.as_deref(), Some("attn_capture"));
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
