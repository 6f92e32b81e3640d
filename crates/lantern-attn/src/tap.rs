//! A hook through which an attention layer hands its query rows (and its output) to
//! whoever captures attention for some requests of the step.
//!
//! The model asks [`AttentionTap::wants_layer`] once per layer per step; a step with no
//! capturing request passes no tap at all, so capture costs nothing when unused.

use crate::device::Tensor;
use crate::error::AttnError;

/// Receives a layer's query rows after RoPE (exactly what the backend scored with) and
/// the backend's output, for the whole step's batch, as the tensors that crossed the
/// backend boundary (read them with [`crate::host_f32`]).
pub trait AttentionTap {
    /// Whether any request of this step captures `layer`.
    fn wants_layer(&self, layer: usize) -> bool;

    /// `q`: `[num_tokens, num_heads, head_dim]`; `attn_out`: the backend's output,
    /// same shape. Rows are the step's tokens in batch order. Errors when the tensors
    /// cannot be read back to the host.
    fn record(&mut self, layer: usize, q: &Tensor, attn_out: &Tensor) -> Result<(), AttnError>;
}
