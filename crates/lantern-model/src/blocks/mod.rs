//! The building blocks every decoder is made of, written once: norms, the attention
//! layer, the MLP and its mixture of experts, and the loader they read their tensors through.

pub mod attention;
pub mod loader;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod projections;

pub use attention::{Attention, AttentionShape};
pub use loader::Loader;
pub use mlp::{Activation, Mlp, PlainMlp};
pub use moe::Moe;
pub use norm::{BlockInput, Norm, NormKind, RmsNorm};
pub use projections::Projections;
