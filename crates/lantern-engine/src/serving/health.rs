//! Panics the engine thread contained, and what `/health` says of them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Building the engine panicked; the panic's message.
#[derive(Debug, Clone)]
pub struct EngineBuildPanicked(pub String);

impl std::fmt::Display for EngineBuildPanicked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "building the engine panicked: {}", self.0)
    }
}

impl std::error::Error for EngineBuildPanicked {}

impl EngineBuildPanicked {
    pub(super) fn from_payload(payload: Box<dyn std::any::Any + Send>) -> Self {
        Self(panic_message(payload.as_ref()))
    }
}

/// The message a panic was raised with.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".to_string())
}

/// What a client is told when a panic ended its request (the panic's own message goes
/// to the log, not to clients).
pub const ENGINE_FAULT_MESSAGE: &str =
    "an internal engine fault occurred (a panic on the engine thread); this request was ended and the engine restarted; see the server log";

/// [`ENGINE_FAULT_MESSAGE`] when restarting the engine failed too.
pub const ENGINE_FAULT_STOPPED_MESSAGE: &str =
    "an internal engine fault occurred (a panic on the engine thread); this request was ended and the engine could not restart: the server must be restarted; see the server log";

/// Steps the engine must run without a panic after a contained one before `/health`
/// says `ok` again: proof that the restarted engine works, not only that it restarted.
pub const CLEAN_STEPS_TO_RECOVER: u64 = 32;

/// What `/health` reports about the engine thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineHealth {
    /// No panic yet, or [`CLEAN_STEPS_TO_RECOVER`] clean steps since the last one.
    Ok,
    /// A panic was contained and the engine restarted, but has not yet run
    /// [`CLEAN_STEPS_TO_RECOVER`] steps since.
    Degraded,
    /// Restarting after a panic failed: the engine thread ended for good.
    Stopped,
}

/// Panics the engine thread contained, for `/health` and `/metrics`.
#[derive(Debug, Default)]
pub struct EngineFaults {
    count: AtomicU64,
    last: Mutex<Option<String>>,
    clean_steps_since_last: AtomicU64,
    unrecoverable: AtomicBool,
}

impl EngineFaults {
    pub(super) fn record(&self, message: &str) {
        self.count.fetch_add(1, Ordering::SeqCst);
        self.clean_steps_since_last.store(0, Ordering::SeqCst);
        if let Ok(mut last) = self.last.lock() {
            *last = Some(message.to_string());
        }
    }

    /// Counts a step that computed tokens and returned without a panic or an error.
    pub(super) fn step_succeeded(&self) {
        if self.count() > 0 {
            self.clean_steps_since_last.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The restart after a panic failed: the engine thread ends.
    pub(super) fn record_unrecoverable(&self) {
        self.unrecoverable.store(true, Ordering::SeqCst);
    }

    /// Panics contained since the server started.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::SeqCst)
    }

    /// The last panic's message.
    pub fn last(&self) -> Option<String> {
        self.last.lock().ok().and_then(|l| l.clone())
    }

    /// Steps run without a panic since the last one.
    pub fn clean_steps_since_last(&self) -> u64 {
        self.clean_steps_since_last.load(Ordering::Relaxed)
    }

    /// Whether a restart after a panic failed, so the engine thread ended.
    pub fn unrecoverable(&self) -> bool {
        self.unrecoverable.load(Ordering::SeqCst)
    }

    pub fn health(&self) -> EngineHealth {
        if self.unrecoverable() {
            EngineHealth::Stopped
        } else if self.count() == 0 || self.clean_steps_since_last() >= CLEAN_STEPS_TO_RECOVER {
            EngineHealth::Ok
        } else {
            EngineHealth::Degraded
        }
    }
}
