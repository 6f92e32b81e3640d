//! A hook through which an attention layer hands its query rows (and its output) to
//! whoever captures attention for some requests of the step.
//!
//! The model asks [`AttentionTap::wants_layer`] once per layer per step; a step with no
//! capturing request passes no tap at all, so capture costs nothing when unused.
//!
//! A tap may also ask for some rows' probabilities ([`AttentionTap::probability_rows`]):
//! model code whose backend can compute them while it runs the layer
//! ([`crate::CpuFlashBackend::forward_with_probabilities`]) hands them over before the
//! query rows ([`AttentionTap::record_probabilities`]); with any other backend they never
//! come, and the tap computes what it needed from the keys later.

use std::ops::Range;

use crate::device::Tensor;
use crate::error::AttnError;

/// Receives a layer's query rows after RoPE (exactly what the backend scored with) and
/// the backend's output, for the whole step's batch, as the tensors that crossed the
/// backend boundary (read them with [`crate::host_f32`]).
pub trait AttentionTap {
    /// Whether any request of this step captures `layer`.
    fn wants_layer(&self, layer: usize) -> bool;

    /// Whether [`Self::record`] of `layer` needs the backend's output (for checking P·V),
    /// or only the query rows: a device's model code then copies no output to the host.
    fn wants_output(&self, _layer: usize) -> bool {
        true
    }

    /// The batch rows [`Self::record`] reads on `layer`, as ranges in batch order: the
    /// capturing requests' tokens. A device's model code copies only these rows to the
    /// host ([`RecordedRows::Read`]).
    fn rows_read(&self, layer: usize) -> Vec<Range<usize>>;

    /// `q`: `[rows, num_heads, head_dim]`; `attn_out`: the backend's output, same shape
    /// (`None` where [`Self::wants_output`] said it is not needed); `rows` says which
    /// rows of the step they hold. Errors when the tensors cannot be read back to the
    /// host or do not hold the rows `rows` says.
    fn record(
        &mut self,
        layer: usize,
        rows: RecordedRows,
        q: &Tensor,
        attn_out: Option<&Tensor>,
    ) -> Result<(), AttnError>;

    /// Whether some request capturing `layer` keeps its query rows on the backend's
    /// device ([`crate::KeptRows`]): a device's model code then hands the step's q over
    /// with [`Self::record_kept`] for them, and copies to the host only the rows of the
    /// others ([`Self::rows_read`] and [`Self::record`] concern only those).
    fn keeps_on_device(&self, _layer: usize) -> bool {
        false
    }

    /// The step's whole q (`[tokens, num_heads, head_dim]`) as the backend's own device
    /// tensor, for the requests that keep their rows on the device to copy them there;
    /// only where [`Self::keeps_on_device`] said some do.
    fn record_kept(&mut self, layer: usize, _q: &dyn std::any::Any) -> Result<(), AttnError> {
        Err(AttnError::Unsupported(format!(
            "layer {layer}'s query rows handed over on the device to a capture that keeps \
             them on the host"
        )))
    }

    /// Whether everything this tap does in the step stays on the backend's device until
    /// the step's layers have all run: every capturing request keeps its rows there
    /// ([`Self::keeps_on_device`]), none takes rows back to the host during the step
    /// ([`Self::rows_read`] gives nothing), and the probabilities it asks for
    /// ([`Self::probability_rows`]) may be handed over after the layers. Such a step can
    /// be replayed from a recorded graph ([`crate::GraphKey::capturing`]), whose backend
    /// computes those probabilities as its layers run and hands them over after them (or
    /// leaves them unfilled).
    fn device_only(&self) -> bool {
        false
    }

    /// How many rows [`Self::probability_rows`] will ask for on each layer in this step
    /// (empty: none), without asking: steps that ask alike replay one graph
    /// ([`crate::GraphKey::probabilities`]).
    fn probability_plan(&self) -> Vec<usize> {
        Vec::new()
    }

    /// The rows of this step whose probabilities on `layer` the tap takes from the
    /// backend, if any (called after [`Self::wants_layer`], before the layer runs).
    fn probability_rows(&mut self, _layer: usize) -> Option<RowProbabilities> {
        None
    }

    /// Those rows' probabilities, filled in by the backend: before [`Self::record`] of
    /// the same layer, or, from a device that keeps them until the step's layers have all
    /// run (one wait for the device instead of one a layer), after it, before
    /// [`Self::finish_step`].
    fn record_probabilities(&mut self, _layer: usize, _probabilities: RowProbabilities) {}

    /// After the step's forward, every layer recorded and every probability handed over:
    /// the tap checks that what it sums as rows run covers them.
    fn finish_step(&mut self) {}
}

/// Which rows of a step the tensors handed to [`AttentionTap::record`] hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordedRows {
    /// Every row of the step, in batch order.
    All,
    /// Only the rows [`AttentionTap::rows_read`] named for the layer, one range after
    /// another.
    Read,
}

/// Probabilities of chosen query rows of a step on one layer, computed by the backend as
/// it runs them (from the very scores it weights the values with), so that attention
/// capture need not compute them again from the keys. The tap names the rows
/// ([`Self::ask`]); the backend fills in, per row, the key positions the row sees and the
/// probabilities of every query head over them.
///
/// The values are the same bits as [`crate::row_probabilities`] gives for that row,
/// head and those keys.
#[derive(Debug, Clone, Default)]
pub struct RowProbabilities {
    /// Batch rows asked for.
    rows: Vec<usize>,
    /// Filled by the backend: per row, the key positions it sees.
    keys: Vec<Range<usize>>,
    /// Filled by the backend: per row, where its `[num_heads, keys]` values start.
    offsets: Vec<usize>,
    num_heads: usize,
    values: Vec<f32>,
}

impl RowProbabilities {
    /// Asks for batch rows `rows` (any order, each once), forgetting what was filled;
    /// the allocation is kept for the next layer.
    pub fn ask(&mut self, rows: impl IntoIterator<Item = usize>) {
        self.rows.clear();
        self.rows.extend(rows);
        self.keys.clear();
        self.offsets.clear();
    }

    /// The batch rows asked for.
    pub fn rows(&self) -> &[usize] {
        &self.rows
    }

    /// Whether a backend filled them in.
    pub fn is_filled(&self) -> bool {
        self.keys.len() == self.rows.len() && !self.rows.is_empty()
    }

    /// Probabilities filled in, over every row and head.
    pub fn num_values(&self) -> usize {
        self.keys.iter().map(|k| k.len() * self.num_heads).sum()
    }

    /// Query heads per row.
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }

    /// The key positions the `i`-th row sees: the columns of [`Self::head`].
    pub fn keys(&self, i: usize) -> Range<usize> {
        self.keys[i].clone()
    }

    /// The probabilities of the `i`-th row, `[num_heads, keys]`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.values[self.offsets[i]..][..self.keys[i].len() * self.num_heads]
    }

    /// The probabilities of the `i`-th row for query head `head` over [`Self::keys`].
    pub fn head(&self, i: usize, head: usize) -> &[f32] {
        let len = self.keys[i].len();
        &self.values[self.offsets[i] + head * len..][..len]
    }

    /// For a backend: sets every row's keys (`keys_of(batch_row)`) and sizes the values,
    /// `num_heads` per row, `[num_heads, keys]` per row in the order of [`Self::rows`].
    pub fn prepare(&mut self, num_heads: usize, keys_of: impl Fn(usize) -> Range<usize>) {
        self.num_heads = num_heads;
        self.keys.clear();
        self.offsets.clear();
        let mut len = 0;
        for &row in &self.rows {
            let keys = keys_of(row);
            self.offsets.push(len);
            len += keys.len() * num_heads;
            self.keys.push(keys);
        }
        // Every value is written by the backend before it is read: the buffer is only
        // zeroed where it grows.
        if self.values.len() < len {
            self.values.resize(len, 0.0);
        }
        self.values.truncate(len);
    }

    /// For a backend, after [`Self::prepare`]: the values to fill, each row's keys and
    /// each row's offset in the values.
    pub fn parts_mut(&mut self) -> (&mut [f32], &[Range<usize>], &[usize]) {
        (&mut self.values, &self.keys, &self.offsets)
    }

    /// Forgets what a backend filled in (when it could not finish).
    pub fn clear_filled(&mut self) {
        self.keys.clear();
        self.offsets.clear();
    }
}
