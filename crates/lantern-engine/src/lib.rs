//! The lantern engine: requests and their states, the scheduler, the model runner, the
//! sampler, and the loop that ties them together ([`serving`]), with the validation of
//! requests into one typed value ([`validate`]). This is lantern's public Rust API, which
//! the HTTP server and the Python module both drive.

pub mod config;
mod cut;
pub mod device;
pub mod engine;
pub mod error;
pub mod fault;
pub mod host_memory;
pub mod host_threads;
pub mod options;
pub mod reasoning;
pub mod request;
pub mod runner;
pub mod sampling;
pub mod scheduler;
pub mod scored_prefix;
pub mod serving;
pub mod token_filter;
pub mod validate;
mod vocab_row;

pub use config::EngineConfig;
pub use engine::{Completion, Engine, RequestOutput};
pub use error::{EngineError, RequestError, Result};
pub use lantern_capture;
pub use lantern_guided;
pub use request::{FinishReason, RequestStatus};
pub use sampling::{PromptTokenLogprob, SamplingParams, TokenLogprobs};
