//! Attention capture over HTTP: delivery of a finished capture (inline JSON, a stored
//! reference, or a file) and the store behind references and files. The capture fields
//! are parsed and checked by the engine's validation (`lantern_engine::validate::capture`).
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
use lantern_engine::lantern_capture::{wire, CaptureFailure, CaptureWorker, Pacer, PendingCapture};
pub use lantern_engine::validate::capture::{
    CaptureRequest, CaptureSettings, Delivery, DEFAULT_CAPTURE_TTL, DEFAULT_MAX_CAPTURE_BYTES,
    DEFAULT_MAX_STORED_CAPTURE_BYTES,
};
use rand::RngCore;
use serde_json::{json, Map, Value};

use crate::error::ApiError;

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
        let pending = pending?;
        // An idle engine leaves every core to finalizing; a busy one those it does not
        // use (helpers finish the layers they took if requests arrive meanwhile: they
        // run in the worker's `SCHED_IDLE` class, behind every step thread).
        let threads = if pacer.engine_busy() {
            pending.finalize_threads
        } else {
            lantern_engine::host_threads::idle_finalize_threads()
        };
        let result = pending
            .into_result(threads, || pacer.pause())
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
                let message = lantern_engine::serving::panic_message(panic.as_ref());
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

    fn parse(body: Value) -> Option<CaptureRequest> {
        let enabled = CaptureSettings {
            enabled: true,
            ..CaptureSettings::default()
        };
        lantern_engine::validate::capture::parse_capture_request(&body, &enabled, 30, 9).unwrap()
    }

    #[test]
    fn a_full_store_or_worker_queue_refuses_with_503() {
        let reference =
            parse(json!({"attn_capture": true, "attn_capture_delivery": "reference"})).unwrap();
        let inline = parse(json!({"attn_capture": true})).unwrap();
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
