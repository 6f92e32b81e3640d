//! Ready events as Python objects: plain dicts and lists for the `lantern` package to
//! shape like vLLM's outputs, and a capture's maps as numpy arrays that own the
//! engine's buffers (float32 maps are moved, never copied).

use crate::events::{Finished, Ready, TokenLogprob};
use half::f16;
use lantern_engine::lantern_capture::{CaptureResult, LayerMap};
use lantern_engine::serving::{PromptLogprobEntry, StopReason};
use numpy::ndarray::{Array2, Array3};
use numpy::PyArray;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

fn shape(layer: &LayerMap) -> (usize, usize, usize) {
    let [rows, heads, keys] = layer.shape;
    (rows, heads, keys)
}

fn bad_shape(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(format!("a capture map does not fit its shape: {e}"))
}

/// One layer's values `[rows, heads, keys]` in the capture's dtype: float32 moves the
/// buffer into numpy; float16 rounds each value as the wire formats do.
fn values<'py>(py: Python<'py>, layer: LayerMap, float16: bool) -> PyResult<Bound<'py, PyAny>> {
    let dims = shape(&layer);
    if float16 {
        let halves: Vec<f16> = layer.values.iter().map(|&v| f16::from_f32(v)).collect();
        let array = Array3::from_shape_vec(dims, halves).map_err(bad_shape)?;
        return Ok(PyArray::from_owned_array(py, array).into_any());
    }
    let array = Array3::from_shape_vec(dims, layer.values).map_err(bad_shape)?;
    Ok(PyArray::from_owned_array(py, array).into_any())
}

/// Top-k key positions as int32, the type every delivery uses.
fn indices<'py>(
    py: Python<'py>,
    dims: (usize, usize, usize),
    indices: Vec<u32>,
) -> PyResult<Bound<'py, PyAny>> {
    let as_i32: Vec<i32> = indices.into_iter().map(|i| i as i32).collect();
    let array = Array3::from_shape_vec(dims, as_i32).map_err(bad_shape)?;
    Ok(PyArray::from_owned_array(py, array).into_any())
}

/// `{"meta": <JSON text>, "maps": [...], "indices": [...] or None, "stats": [...],
/// "span_mass": [...]}`, maps in `meta.layers` order (none without maps), statistics as
/// `(layer, name, float32 array)`, span masses as `(layer, float32 array)`.
fn capture<'py>(py: Python<'py>, result: CaptureResult) -> PyResult<Bound<'py, PyDict>> {
    let meta = serde_json::to_string(&result.meta)
        .map_err(|e| PyValueError::new_err(format!("the capture's meta: {e}")))?;
    let float16 = result.meta.dtype == "float16";
    let top_k = result.meta.top_k.is_some();
    let maps = PyList::empty(py);
    let index_maps = PyList::empty(py);
    for mut layer in result.layers {
        let dims = shape(&layer);
        if let Some(ids) = layer.indices.take() {
            index_maps.append(indices(py, dims, ids)?)?;
        }
        maps.append(values(py, layer, float16)?)?;
    }
    let stats = PyList::empty(py);
    for stat in result.stats {
        let array = Array2::from_shape_vec((stat.shape[0], stat.shape[1]), stat.values)
            .map_err(bad_shape)?;
        stats.append((
            stat.layer_idx,
            stat.stat.as_str(),
            PyArray::from_owned_array(py, array),
        ))?;
    }
    let span_mass = PyList::empty(py);
    for layer in result.span_mass {
        let [rows, groups, columns] = layer.shape;
        let array =
            Array3::from_shape_vec((rows, groups, columns), layer.values).map_err(bad_shape)?;
        span_mass.append((layer.layer_idx, PyArray::from_owned_array(py, array)))?;
    }
    let out = PyDict::new(py);
    out.set_item("stats", stats)?;
    out.set_item("span_mass", span_mass)?;
    out.set_item("meta", meta)?;
    out.set_item("maps", maps)?;
    out.set_item("indices", if top_k { Some(index_maps) } else { None })?;
    Ok(out)
}

fn token_logprob<'py>(py: Python<'py>, lp: TokenLogprob) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("token_id", lp.token_id)?;
    d.set_item("token", lp.token)?;
    d.set_item("logprob", lp.logprob)?;
    d.set_item("rank", lp.rank)?;
    d.set_item("top", lp.top)?;
    Ok(d)
}

fn prompt_logprob<'py>(py: Python<'py>, e: PromptLogprobEntry) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("token_id", e.token_id)?;
    d.set_item("token", e.token)?;
    d.set_item("logprob", e.logprob)?;
    d.set_item("rank", e.rank)?;
    d.set_item("top", e.top)?;
    Ok(d)
}

fn finished<'py>(py: Python<'py>, f: Finished) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("reason", f.reason)?;
    match f.stop_reason {
        Some(StopReason::Text(s)) => d.set_item("stop_reason", s)?,
        Some(StopReason::Token(t)) => d.set_item("stop_reason", t)?,
        None => d.set_item("stop_reason", py.None())?,
    }
    d.set_item("cached_tokens", f.cached_tokens)?;
    d.set_item("error", f.error)?;
    match f.capture {
        Some(Ok(result)) => d.set_item("capture", capture(py, result)?)?,
        Some(Err(message)) => {
            let failed = PyDict::new(py);
            failed.set_item("error", message)?;
            d.set_item("capture", failed)?;
        }
        None => d.set_item("capture", py.None())?,
    }
    Ok(d)
}

/// One event as a dict: `prompt`, `index`, `text`, `token_ids`, `logprobs`,
/// `prompt_logprobs`, `finished`, `time`.
pub fn ready<'py>(py: Python<'py>, r: Ready) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("prompt", r.prompt)?;
    d.set_item("index", r.index)?;
    d.set_item("text", r.text)?;
    d.set_item("token_ids", r.token_ids)?;
    d.set_item("capture_row", r.capture_row)?;
    let logprobs = match r.logprobs {
        Some(lps) => {
            let list = PyList::empty(py);
            for lp in lps {
                list.append(token_logprob(py, lp)?)?;
            }
            Some(list)
        }
        None => None,
    };
    d.set_item("logprobs", logprobs)?;
    let prompt_logprobs = match r.prompt_logprobs {
        Some(entries) => {
            let list = PyList::empty(py);
            for e in entries {
                list.append(prompt_logprob(py, e)?)?;
            }
            Some(list)
        }
        None => None,
    };
    d.set_item("prompt_logprobs", prompt_logprobs)?;
    match r.finished {
        Some(f) => d.set_item("finished", finished(py, f)?)?,
        None => d.set_item("finished", py.None())?,
    }
    d.set_item("time", r.time)?;
    Ok(d)
}
