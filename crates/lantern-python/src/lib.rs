//! `lantern._lantern`: lantern's engine as a Python extension module, a thin adapter
//! over the engine's API (`lantern_engine::serving::EngineHandle`), as the HTTP server is.
//! Requests are the server's request bodies, validated by the engine's one validation
//! (`lantern_engine::validate`); outputs are
//! plain dicts, and captures numpy arrays, which the pure-Python `lantern` package
//! shapes like vLLM's `RequestOutput`.

mod batch;
mod convert;
mod engine;
mod errors;
mod events;
mod options;
mod request;

use pyo3::prelude::*;

/// Checks SamplingParams' fields (their JSON) as the server checks a request's: a bad
/// one raises InvalidRequestError naming it.
#[pyfunction]
fn check_sampling(body: &str) -> PyResult<()> {
    let body = batch::json_object("sampling params", body)?;
    request::check_sampling(body).map_err(errors::invalid_request)
}

#[pymodule]
fn _lantern(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<engine::Engine>()?;
    m.add_class::<batch::Batch>()?;
    m.add_function(wrap_pyfunction!(check_sampling, m)?)?;
    m.add(
        "InvalidRequestError",
        py.get_type::<errors::InvalidRequestError>(),
    )?;
    m.add("EngineError", py.get_type::<errors::EngineError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
