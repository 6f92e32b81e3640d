//! Decode steps replayed from recorded graphs (CUDA graphs): vLLM's "full graphs of
//! decode-only batches". A backend that supports them says so through
//! [`crate::AttentionBackend::step_graphs`]; the runner pads a step of decodes to one of
//! its batch sizes, gives the block table a fixed width, and runs the step between
//! [`StepGraphs::begin_step`] and [`StepGraphs::end_step`].

use crate::error::AttnError;

/// What a recorded step is recorded for: everything that shapes its kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GraphKey {
    /// Requests of the padded batch, one decode token each.
    pub num_reqs: usize,
    /// Width of every KV cache group's padded block table.
    pub table_width: usize,
    /// Whether every logits row is read back whole (else each is reduced where the
    /// logits are, as parameters uploaded with the step say).
    pub whole_logits: bool,
    /// Whether the step carries capturing requests that keep their query rows on the
    /// device ([`crate::AttentionTap::device_only`]): every layer of such a step copies
    /// their rows there, in one launch whose destinations are uploaded with the step.
    pub capturing: bool,
    /// A fingerprint of how many rows' probabilities the step's capture takes on each
    /// layer ([`crate::AttentionTap::probability_plan`]; 0: none): each such layer
    /// computes them into a buffer with room for every key of the table, read after the
    /// step (at most [`MAX_GRAPH_PROBABILITY_BYTES`] in all).
    pub probabilities: u64,
    /// Edits of the logits before they are reduced (penalties) the step uploads, padded
    /// to this many (0: none, and no launch for them).
    pub edit_capacity: usize,
}

/// Device bytes a graph step may hold for its capture's probabilities until its layers
/// have all run (each row with room for every key of the step's table): a step that
/// would need more runs eagerly.
pub const MAX_GRAPH_PROBABILITY_BYTES: usize = 64 << 20;

/// What a backend's graphs did so far (for tests, benchmarks and logs).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    /// Keys whose first step ran eagerly, recording what the graph needs.
    pub recorded: usize,
    /// Graphs captured.
    pub captured: usize,
    /// Steps replayed from a graph.
    pub replayed: usize,
    /// Keys given up on (their steps run eagerly).
    pub failed: usize,
    /// Device bytes held for graph steps' buffers.
    pub arena_bytes: usize,
}

/// A backend's recorded decode steps.
pub trait StepGraphs: Send + Sync {
    /// Request counts steps are recorded for, ascending; a step of decodes pads to the
    /// smallest one that holds it.
    fn batch_sizes(&self) -> &[usize];

    /// Starts a step of `key`: until [`Self::end_step`], the device's work is recorded into
    /// or replayed from that key's graph. `false`: the key is not graphed (it failed before):
    /// run the step eagerly.
    fn begin_step(&self, key: GraphKey) -> Result<bool, AttnError>;

    /// Ends the step begun last. `ok`: the step succeeded. A step that failed leaves its
    /// KV cache as an eager rerun of it will write it; its key is not graphed again.
    fn end_step(&self, ok: bool) -> Result<(), AttnError>;

    /// What its graphs did so far.
    fn stats(&self) -> GraphStats;
}
