//! lantern's errors as Python exceptions: a request the engine's validation refuses is an
//! `InvalidRequestError` (a `ValueError`) whose `param` names the field at fault, under
//! the name Python gave it; the engine's own faults are an `EngineError`.

use crate::options::OptionError;
use lantern_engine::serving::ServeError;
use lantern_engine::validate::InvalidRequest;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    lantern,
    InvalidRequestError,
    PyValueError,
    "A bad parameter; `param` names it, as the server's 400 does."
);
pyo3::create_exception!(
    lantern,
    EngineError,
    PyRuntimeError,
    "The engine failed, or is not running."
);

/// HTTP field names and what Python calls them, longest first so that no name is
/// replaced inside a longer one.
const PYTHON_NAMES: [(&str, &str); 15] = [
    // The server's flags are LLM's options.
    (
        "--enable-attention-capture",
        "LLM(enable_attention_capture=True)",
    ),
    ("--max-capture-bytes", "LLM(max_capture_bytes=...)"),
    ("attn_capture_stats_heads", "capture[\"stats_heads\"]"),
    ("attn_capture_delivery", "capture[\"delivery\"]"),
    ("attn_capture_layers", "capture[\"layers\"]"),
    ("attn_capture_reduce", "capture[\"reduce\"]"),
    ("attn_capture_heads", "capture[\"heads\"]"),
    ("attn_capture_dtype", "capture[\"dtype\"]"),
    ("attn_capture_top_k", "capture[\"top_k\"]"),
    ("attn_capture_spans", "capture[\"spans\"]"),
    ("attn_capture_stats", "capture[\"stats\"]"),
    ("attn_capture_rows", "capture[\"rows\"]"),
    ("attn_capture_maps", "capture[\"maps\"]"),
    ("attn_capture", "capture"),
    // Chat's alternatives per token are SamplingParams.logprobs.
    ("top_logprobs", "logprobs"),
];

/// `text` with the HTTP field names Python does not use replaced by its own.
fn python_names(text: &str) -> String {
    let mut out = text.to_string();
    // Placeholders first, so that a replacement is never replaced again.
    for (i, (field, _)) in PYTHON_NAMES.iter().enumerate() {
        out = out.replace(field, &format!("\u{0}{i}\u{0}"));
    }
    for (i, (_, name)) in PYTHON_NAMES.iter().enumerate() {
        out = out.replace(&format!("\u{0}{i}\u{0}"), name);
    }
    out
}

/// An exception with `param` and `status` attributes.
fn raise(is_client: bool, message: String, param: Option<String>, status: u16) -> PyErr {
    let err = if is_client {
        InvalidRequestError::new_err(message)
    } else {
        EngineError::new_err(message)
    };
    Python::attach(|py| {
        let value = err.value(py);
        let _ = value.setattr("param", param);
        let _ = value.setattr("status", status);
    });
    err
}

/// A refused request: a ValueError naming the field as Python calls it.
pub fn invalid_request(e: InvalidRequest) -> PyErr {
    let status = match e {
        InvalidRequest::UnknownModel(_) => 404,
        _ => 400,
    };
    let param = e.field().map(python_names);
    let mut message = python_names(&e.to_string());
    if let Some(param) = &param {
        if !message.contains(param.as_str()) {
            message = format!("{param}: {message}");
        }
    }
    raise(true, message, param, status)
}

/// The engine API's error as Python sees it: a request at fault is a ValueError
/// ([`invalid_request`]); anything else an `EngineError`, with the status the server
/// would answer.
pub fn serve_error(e: ServeError) -> PyErr {
    let status = match &e {
        ServeError::Invalid(_) => 400,
        ServeError::TooManyWaiting { .. } => 429,
        ServeError::Unavailable | ServeError::Stopped => 503,
        ServeError::Fault { .. } | ServeError::Engine(_) | ServeError::Internal(_) => 500,
    };
    match e {
        ServeError::Invalid(invalid) => invalid_request(invalid),
        other => raise(
            false,
            other
                .to_string()
                .replace("see the server log", "see the log"),
            None,
            status,
        ),
    }
}

/// A bad engine option (`LLM(kv_cache_dtype="f8")`).
pub fn option_error(e: OptionError) -> PyErr {
    raise(
        true,
        format!("{}: {}", e.option, e.message),
        Some(e.option.to_string()),
        400,
    )
}

/// The engine's flags and what `LLM` calls them, the first named in a message being the
/// option at fault ("--gpu-memory-utilization applies to --device cuda only").
const OPTION_FLAGS: [(&str, &str); 9] = [
    ("--max-num-batched-tokens", "max_num_batched_tokens"),
    ("--gpu-memory-utilization", "gpu_memory_utilization"),
    ("--kv-cache-memory", "kv_cache_memory"),
    ("--max-model-len", "max_model_len"),
    ("--max-num-seqs", "max_num_seqs"),
    ("--block-size", "block_size"),
    ("--device", "device"),
    ("--attention-backend", "attention_backend"),
    ("--quantize", "quantize"),
];

/// The engine could not be built: an invalid configuration, whose message names the
/// server's flag, is an `InvalidRequestError` naming `LLM`'s option; anything else (a
/// model that does not load) an `EngineError`.
pub fn build_error(message: String) -> PyErr {
    const INVALID: &str = "invalid engine configuration: ";
    if message.starts_with("reading chat template ") || message.starts_with("chat template ") {
        return raise(
            true,
            format!("chat_template: {message}"),
            Some("chat_template".to_string()),
            400,
        );
    }
    let Some(detail) = message.strip_prefix(INVALID) else {
        return engine_error(message);
    };
    let at_fault = OPTION_FLAGS
        .iter()
        .filter_map(|&(flag, option)| detail.find(flag).map(|at| (at, option)))
        .min_by_key(|&(at, _)| at)
        .map(|(_, option)| option);
    let mut python = detail.to_string();
    for (flag, option) in OPTION_FLAGS {
        python = python.replace(flag, option);
    }
    match at_fault {
        Some(option) => raise(true, python, Some(option.to_string()), 400),
        None => engine_error(message),
    }
}

/// The engine could not start, or stopped.
pub fn engine_error(message: impl Into<String>) -> PyErr {
    raise(false, message.into(), None, 500)
}
