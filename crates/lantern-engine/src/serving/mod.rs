//! The engine's public API for front ends (the HTTP server, the Python module): the
//! engine runs on a thread of its own ([`EngineHandle::start`]); a front end validates a
//! request once ([`crate::validate`]) into [`GenerationItem`]s, submits them
//! ([`EngineHandle::add`]), reads each sequence's [`EngineEvent`]s from the returned
//! channel (text, tokens, logprobs, live capture rows, the finish with its capture) and
//! aborts what its client no longer wants ([`EngineHandle::abort`]). Tokenizing, chat
//! rendering and turning logprobs into text run on the caller's tasks ([`Prompter`]),
//! never on the engine thread.

pub mod beam;
mod engine_loop;
pub mod error;
pub mod events;
pub mod generation;
pub mod handle;
pub mod health;
pub mod metrics;
pub mod prompter;
pub mod request_log;
pub mod stop;

pub use beam::{BeamSearch, EarlyStopping};
pub use error::ServeError;
pub use events::{
    guided_failure_message, no_token_left_message, ChoiceEvent, EndReason, EngineEvent,
    EngineFailure, Finish, LogprobEntry, PromptLogprobEntry, StopReason,
};
pub use generation::{
    Accepted, GenerationItem, ItemCapture, Origin, PromptInput, PromptTruncation,
};
pub use handle::{EngineHandle, EngineThread, ModelMeta};
pub use health::{
    panic_message, EngineBuildPanicked, EngineFaults, EngineHealth, CLEAN_STEPS_TO_RECOVER,
    ENGINE_FAULT_MESSAGE, ENGINE_FAULT_STOPPED_MESSAGE,
};
pub use metrics::{EngineMetrics, EngineStats};
pub use prompter::{PreparedItem, PromptLogprobRows, Prompter};
pub use request_log::EngineLogging;
