//! Structured output: a request's grammar (a JSON schema, any JSON object, a regular
//! expression, a fixed list of choices or a Lark grammar) is compiled with `llguidance`
//! into a [`Constraint`] that says, before each token is sampled, which tokens may come
//! next ([`TokenMask`]), and when the output is complete.
//!
//! Compiling takes milliseconds to seconds, so it happens on the request's own task,
//! never on the engine thread; the engine only asks constraints for masks (in parallel
//! with the forward pass) and feeds them the sampled tokens.

mod constraint;
mod error;
mod guide;
mod vocab;

pub use constraint::{Constraint, TokenMask};
pub use error::GuidedError;
pub use guide::{compact_json_options, Guide};
pub use vocab::GuidedVocab;
