//! `lantern._lantern.Engine`: the model loaded and the engine running on its own
//! thread (the server's `EngineHandle`), so the GIL is never held while it steps.

use crate::batch::Batch;
use crate::errors::{build_error, engine_error, option_error, serve_error};
use crate::options::{ByteCount, RawOptions};
use lantern_engine::reasoning::ThinkTags;
use lantern_engine::serving::{EngineBuildPanicked, EngineHandle, EngineThread};
use lantern_engine::validate::CaptureSettings;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::runtime::Runtime;

/// Building the engine failed: why.
struct BuildError(String);

impl From<EngineBuildPanicked> for BuildError {
    fn from(e: EngineBuildPanicked) -> Self {
        Self(e.to_string())
    }
}

#[derive(FromPyObject)]
enum Bytes {
    Int(i64),
    Text(String),
}

impl From<Bytes> for ByteCount {
    fn from(b: Bytes) -> Self {
        match b {
            Bytes::Int(n) => ByteCount::Int(n),
            Bytes::Text(s) => ByteCount::Text(s),
        }
    }
}

#[pyclass(module = "lantern._lantern")]
pub struct Engine {
    handle: EngineHandle,
    thread: Mutex<Option<EngineThread>>,
    runtime: Arc<Runtime>,
    settings: Arc<CaptureSettings>,
    /// `reasoning_parser`'s end tag in the model's tokens, when one was given.
    reasoning: Option<Arc<ThinkTags>>,
    /// The model as given, or the default model's file name.
    model: String,
}

#[pymethods]
impl Engine {
    #[new]
    #[pyo3(signature = (
        model=None, *, kv_cache_memory=None, kv_cache_dtype=None, block_size=None,
        attention_backend=None, max_num_batched_tokens=None, max_num_seqs=None,
        enable_prefix_caching=None, f32_weights=None, quantize=None, chat_template=None,
        generation_config=None, max_model_len=None, threads=None, enable_attention_capture=None,
        max_capture_bytes=None, device=None, gpu_memory_utilization=None, enforce_eager=None,
        reasoning_parser=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        model: Option<PathBuf>,
        kv_cache_memory: Option<Bytes>,
        kv_cache_dtype: Option<String>,
        block_size: Option<usize>,
        attention_backend: Option<String>,
        max_num_batched_tokens: Option<usize>,
        max_num_seqs: Option<usize>,
        enable_prefix_caching: Option<bool>,
        f32_weights: Option<bool>,
        quantize: Option<String>,
        chat_template: Option<PathBuf>,
        generation_config: Option<String>,
        max_model_len: Option<usize>,
        threads: Option<usize>,
        enable_attention_capture: Option<bool>,
        max_capture_bytes: Option<Bytes>,
        device: Option<String>,
        gpu_memory_utilization: Option<f32>,
        enforce_eager: Option<bool>,
        reasoning_parser: Option<String>,
    ) -> PyResult<Self> {
        let options = RawOptions {
            model,
            kv_cache_memory: kv_cache_memory.map(Into::into),
            kv_cache_dtype,
            block_size,
            attention_backend,
            max_num_batched_tokens,
            max_num_seqs,
            enable_prefix_caching,
            f32_weights,
            quantize,
            chat_template,
            generation_config,
            max_model_len,
            threads,
            enable_attention_capture,
            max_capture_bytes: max_capture_bytes.map(Into::into),
            device,
            gpu_memory_utilization,
            enforce_eager,
            reasoning_parser,
        }
        .resolve()
        .map_err(option_error)?;
        options.init_threads().map_err(option_error)?;
        let model = match &options.model {
            Some(path) => path.to_string_lossy().into_owned(),
            None => lantern_model::default_model::DEFAULT_MODEL_FILE.to_string(),
        };
        let settings = Arc::new(options.capture.clone());
        let parser = options.reasoning_parser;
        let started = py.detach(move || {
            let path = options.model_path().map_err(BuildError)?;
            EngineHandle::start(move || options.build_engine(&path).map_err(BuildError))
        });
        let (handle, thread) = started.map_err(|BuildError(e)| build_error(e))?;
        let reasoning = parser
            .map(|p| ThinkTags::for_tokenizer(p, handle.prompter().tokenizer()).map(Arc::new))
            .transpose()
            .map_err(build_error)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("lantern-python")
            .enable_all()
            .build()
            .map_err(|e| engine_error(format!("starting the runtime: {e}")))?;
        Ok(Self {
            handle,
            thread: Mutex::new(Some(thread)),
            runtime: Arc::new(runtime),
            settings,
            reasoning,
            model,
        })
    }

    /// A new batch to submit prompts to.
    fn batch(&self) -> Batch {
        Batch::new(
            self.handle.clone(),
            self.runtime.clone(),
            self.settings.clone(),
            self.reasoning.clone(),
        )
    }

    /// The model as given (or the default model's file), its name, context and shape.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let meta = self.handle.meta();
        let d = PyDict::new(py);
        d.set_item("model", &self.model)?;
        d.set_item("name", &meta.name)?;
        d.set_item("context_length", meta.context_length)?;
        d.set_item("vocab_size", meta.vocab_size)?;
        d.set_item("num_layers", meta.num_layers)?;
        d.set_item("num_heads", meta.num_heads)?;
        d.set_item("block_size", meta.block_size)?;
        d.set_item("capture_enabled", self.settings.enabled)?;
        let defaults = serde_json::to_string(meta.sampling_defaults.fields())
            .map_err(|e| engine_error(e.to_string()))?;
        d.set_item("sampling_defaults", defaults)?;
        Ok(d)
    }

    /// The engine between two steps: requests running and waiting, KV blocks.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = py
            .detach(|| self.runtime.block_on(self.handle.stats()))
            .map_err(serve_error)?;
        let d = PyDict::new(py);
        d.set_item("num_requests_running", stats.num_requests_running)?;
        d.set_item("num_requests_waiting", stats.num_requests_waiting)?;
        d.set_item("kv_cache_free_blocks", stats.kv_cache_free_blocks)?;
        d.set_item("kv_cache_total_blocks", stats.kv_cache_total_blocks)?;
        d.set_item("kv_cache_usage", stats.kv_cache_usage)?;
        d.set_item("num_preemptions", stats.num_preemptions)?;
        Ok(d)
    }

    /// Token ids of `text` (with BOS when the model adds it, as a prompt is).
    #[pyo3(signature = (text, add_special_tokens=true))]
    fn encode(&self, text: &str, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        self.handle
            .prompter()
            .tokenizer()
            .encode(text, add_special_tokens)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
    }

    /// Token ids of a `/tokenize` body as JSON: a `prompt`, or chat `messages` rendered
    /// through the chat template with vLLM's rendering fields.
    fn tokenize(&self, py: Python<'_>, body: &str) -> PyResult<Vec<u32>> {
        let body: serde_json::Value = serde_json::from_str(body)
            .map_err(|e| engine_error(format!("the request is not JSON: {e}")))?;
        py.detach(|| {
            self.runtime
                .block_on(crate::request::tokenize(&self.handle, &body))
        })
        .map_err(serve_error)
    }

    /// The tokenizer's special tokens, whether it adds BOS, and the chat template's text.
    fn tokenizer_info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let prompter = self.handle.prompter();
        let tokenizer = prompter.tokenizer();
        let d = PyDict::new(py);
        d.set_item("bos_token", tokenizer.bos_token())?;
        d.set_item("eos_token", tokenizer.eos_token())?;
        d.set_item("pad_token", tokenizer.pad_token())?;
        d.set_item("add_bos_token", tokenizer.adds_bos())?;
        d.set_item("vocab_size", tokenizer.vocab_size())?;
        d.set_item("stop_token_ids", tokenizer.stop_ids().to_vec())?;
        d.set_item(
            "chat_template",
            prompter.template().and_then(|t| t.source()),
        )?;
        Ok(d)
    }

    /// Each token as the vocabulary spells it (`None` for an id outside it).
    fn token_pieces(&self, token_ids: Vec<u32>) -> Vec<Option<String>> {
        let prompter = self.handle.prompter();
        let tokenizer = prompter.tokenizer();
        token_ids
            .iter()
            .map(|&t| tokenizer.token_piece(t).map(str::to_string))
            .collect()
    }

    /// The text of token ids (special tokens included).
    #[pyo3(signature = (token_ids, skip_special_tokens=false))]
    fn decode(&self, token_ids: Vec<u32>, skip_special_tokens: bool) -> PyResult<String> {
        self.handle
            .prompter()
            .tokenizer()
            .decode(&token_ids, skip_special_tokens)
            .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
    }

    /// Stops the engine thread (aborting whatever runs) and waits for it.
    fn close(&self, py: Python<'_>) {
        self.handle.shutdown();
        let thread = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(thread) = thread {
            py.detach(|| thread.join());
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.handle.shutdown();
        if let Some(thread) = self
            .thread
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            thread.join();
        }
    }
}
