//! A batch: prompts submitted together, run in one continuous batch by the engine
//! thread, their events merged into one channel that Python polls with the GIL
//! released.

use crate::errors::{invalid_request, serve_error};
use crate::events::{forward, Ready};
use crate::request::{capture_fields, submit};
use lantern_engine::reasoning::ThinkTags;
use lantern_engine::serving::EngineHandle;
use lantern_engine::validate::CaptureSettings;
use lantern_engine::validate::Endpoint;
use lantern_kv::RequestId;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyList;
use serde_json::{Map, Value};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::runtime::Runtime;
use tokio::sync::mpsc::{self, UnboundedReceiver, UnboundedSender};

#[pyclass(module = "lantern._lantern")]
pub struct Batch {
    engine: EngineHandle,
    runtime: Arc<Runtime>,
    settings: Arc<CaptureSettings>,
    reasoning: Option<Arc<ThinkTags>>,
    /// Dropped at the first poll: the channel then closes once every prompt is done.
    tx: Mutex<Option<UnboundedSender<Ready>>>,
    rx: Mutex<UnboundedReceiver<Ready>>,
    /// Every sequence submitted, for `abort`.
    ids: Mutex<Vec<RequestId>>,
    prompts: Mutex<usize>,
}

impl Batch {
    pub fn new(
        engine: EngineHandle,
        runtime: Arc<Runtime>,
        settings: Arc<CaptureSettings>,
        reasoning: Option<Arc<ThinkTags>>,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        Self {
            engine,
            runtime,
            settings,
            reasoning,
            tx: Mutex::new(Some(tx)),
            rx: Mutex::new(rx),
            ids: Mutex::new(Vec::new()),
            prompts: Mutex::new(0),
        }
    }
}

pub fn json_object(what: &str, text: &str) -> PyResult<Map<String, Value>> {
    match serde_json::from_str(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(PyValueError::new_err(format!(
            "{what} must be a JSON object"
        ))),
        Err(e) => Err(PyValueError::new_err(format!("{what} is not JSON: {e}"))),
    }
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic cannot leave these half-updated: recover the guard.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[pymethods]
impl Batch {
    /// Submits one prompt's request: `kind` "completion" or "chat", `body` the JSON
    /// the server's endpoint would take, `capture` the `capture=` dict as JSON;
    /// `stream`: its events are read as they come, so a capture with spans or top-k
    /// sends each row's live figures. Returns the prompt's token ids.
    #[pyo3(signature = (kind, body, capture=None, stream=false))]
    fn submit(
        &self,
        py: Python<'_>,
        kind: &str,
        body: &str,
        capture: Option<&str>,
        stream: bool,
    ) -> PyResult<Vec<u32>> {
        let kind = match kind {
            "completion" => Endpoint::Completion,
            "chat" => Endpoint::Chat,
            other => return Err(PyValueError::new_err(format!("unknown kind {other:?}"))),
        };
        let body = json_object("body", body)?;
        let capture = capture.map(|c| json_object("capture", c)).transpose()?;
        let fields = capture_fields(capture.as_ref()).map_err(invalid_request)?;
        let tx = locked(&self.tx)
            .clone()
            .ok_or_else(|| PyValueError::new_err("this batch is already running"))?;
        let submitted = py
            .detach(|| {
                self.runtime.block_on(submit(
                    &self.engine,
                    &self.settings,
                    self.reasoning.as_ref(),
                    kind,
                    body,
                    fields,
                    stream,
                ))
            })
            .map_err(serve_error)?;
        locked(&self.ids).extend(&submitted.ids);
        let mut prompts = locked(&self.prompts);
        let prompt = *prompts;
        *prompts += 1;
        self.runtime.spawn(forward(
            self.engine.prompter().clone(),
            self.engine.busy_flag(),
            prompt,
            submitted.captures,
            submitted.events,
            tx,
        ));
        Ok(submitted.prompt_token_ids.to_vec())
    }

    /// The events that arrive within `timeout` seconds (all that are ready, or the
    /// first to come), as dicts; `None` once every prompt is done. The GIL is released
    /// while it waits, and Ctrl-C is seen between waits.
    fn poll<'py>(&self, py: Python<'py>, timeout: f64) -> PyResult<Option<Bound<'py, PyList>>> {
        locked(&self.tx).take();
        let wait = Duration::from_secs_f64(timeout.max(0.0));
        let (events, closed) = py.detach(|| {
            let mut rx = locked(&self.rx);
            let mut events = Vec::new();
            let first = self
                .runtime
                .block_on(async { tokio::time::timeout(wait, rx.recv()).await });
            let closed = match first {
                Ok(Some(event)) => {
                    events.push(event);
                    false
                }
                Ok(None) => true,
                Err(_) => false,
            };
            while let Ok(event) = rx.try_recv() {
                events.push(event);
            }
            (events, closed)
        });
        py.check_signals()?;
        if closed && events.is_empty() {
            return Ok(None);
        }
        let list = PyList::empty(py);
        for event in events {
            list.append(crate::convert::ready(py, event)?)?;
        }
        Ok(Some(list))
    }

    /// Aborts every sequence of the batch that is still running and returns once the
    /// engine has freed their KV blocks.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        let ids = std::mem::take(&mut *locked(&self.ids));
        self.engine.abort(ids);
        // The engine thread takes commands in order: once it answers this, the aborts
        // above are done.
        let _ = py.detach(|| self.runtime.block_on(self.engine.stats()));
        Ok(())
    }
}
