//! The per-request buffer of query rows, and the tap that fills it during a step.
//!
//! Rows are indexed by absolute token position, so a chunked prefill, a decode and a
//! recomputation after preemption all write to the same place: recomputing a position
//! overwrites its row with the same values. Copies are per contiguous range of a
//! request's tokens, never per-token map inserts.
//!
//! Where the backend keeps them on its device ([`QueryRowBuffer::keep_rows_on`]), the
//! rows are written there instead, and copied to the host's planes only when something
//! computed on the host reads them ([`QueryRowBuffer::sync_host`]).

use std::any::Any;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use lantern_attn::{
    host_f32, AttentionBackend, AttentionLayerSpec, AttentionTap, AttnError, KeptHeads, KeptRows,
    MapQueries, RecordedRows, RowProbabilities, Tensor,
};
use lantern_quant::share;

use crate::spans::SpanOwners;
use crate::spec::CaptureSpec;
use crate::stats::{KeyStat, KeyStatsAccumulator, LastRow, LiveFigures, LiveSums};

/// Query rows (and optionally attention outputs) of the captured layers and heads of one
/// request, for the positions its row selection can reach.
#[derive(Debug, Clone)]
pub struct QueryRowBuffer {
    spec: CaptureSpec,
    /// Query heads per token in the model's q (all heads, before selection).
    num_heads: usize,
    head_dim: usize,
    /// Positions whose rows are kept (`start..` capacity end).
    positions: Range<usize>,
    /// `layer_slot[l]`: index of layer `l` in `spec.layers`, if captured.
    layer_slot: Vec<Option<usize>>,
    /// Per captured layer: `[positions, spec.heads, head_dim]`.
    q: Vec<Vec<f32>>,
    /// Per captured layer, same shape, when `spec.keep_attention_output`.
    out: Vec<Vec<f32>>,
    /// Per captured layer, its rows on the backend's device, when the backend keeps
    /// them there ([`Self::keep_rows_on`]); empty otherwise, and once released. Clones
    /// of the buffer share them.
    device: Vec<SharedKeptRows>,
    /// Where the rows were ever kept on the device: one past the last position copied
    /// to `q` ([`Self::sync_host`], every layer at once). `None` where they never were
    /// (`q` then holds every recorded row).
    host_to: Option<usize>,
    /// One past the highest position written.
    filled_to: usize,
    /// Key statistics and span masses summed as rows run, when enabled
    /// ([`Self::with_live_sums`]).
    live: Option<LiveSums>,
}

impl QueryRowBuffer {
    /// A buffer for a request of `prompt_len` prompt tokens and up to `max_tokens`
    /// generated ones, in a model of `num_layers` layers whose captured layers have
    /// `num_heads` query heads of `head_dim`. A layer's rows are reserved at its first
    /// record, for every position the selection can reach (what admission counts,
    /// never a doubled capacity); the pages are written, so resident, as rows arrive.
    pub fn new(
        spec: CaptureSpec,
        num_layers: usize,
        num_heads: usize,
        head_dim: usize,
        prompt_len: usize,
        max_tokens: usize,
    ) -> Self {
        let positions = spec.rows.positions(prompt_len, prompt_len + max_tokens);
        let mut layer_slot = vec![None; num_layers];
        for (i, &l) in spec.layers.iter().enumerate() {
            if let Some(slot) = layer_slot.get_mut(l) {
                *slot = Some(i);
            }
        }
        let n = spec.layers.len();
        let keep_out = spec.keep_attention_output;
        Self {
            spec,
            num_heads,
            head_dim,
            positions,
            layer_slot,
            q: vec![Vec::new(); n],
            out: if keep_out {
                vec![Vec::new(); n]
            } else {
                Vec::new()
            },
            device: Vec::new(),
            host_to: None,
            filled_to: 0,
            live: None,
        }
    }

    /// Keeps the rows on `backend`'s device, where it has room for every captured
    /// layer's ([`AttentionBackend::keep_rows`]): steps then copy none to the host. Left
    /// on the host where the backend keeps none (the host backends), where it cannot
    /// (no room on the device: logged), and for a capture that checks the attention
    /// output, which is read on the host beside them.
    pub fn keep_rows_on(mut self, backend: &dyn AttentionBackend) -> Self {
        if self.spec.keep_attention_output || self.positions.is_empty() {
            return self;
        }
        let (rows, row_len) = (self.positions.len(), self.row_len());
        let mut planes = Vec::with_capacity(self.spec.layers.len());
        for _ in &self.spec.layers {
            match backend.keep_rows(rows, row_len) {
                Some(Ok(plane)) => planes.push(Arc::new(Mutex::new(plane))),
                Some(Err(e)) => {
                    tracing::warn!(
                        backend = backend.name(),
                        error = %e,
                        "a capture's query rows are kept on the host: the backend could not \
                         keep them on its device"
                    );
                    return self;
                }
                None => return self,
            }
        }
        self.host_to = Some(self.positions.start);
        self.device = planes;
        self
    }

    /// Whether the rows are being kept on the backend's device.
    pub fn keeps_on_device(&self) -> bool {
        !self.device.is_empty()
    }

    /// Copies the rows recorded on the device that the host's planes do not hold yet
    /// to them, for what computes on the host (finalizing from keys, live figures of
    /// a streamed row). A buffer without device rows has them all already.
    pub fn sync_host(&mut self) -> Result<(), AttnError> {
        let end = self.filled_to.min(self.positions.end);
        let (start, row_len) = (self.positions.start, self.row_len());
        let full = self.positions.len() * row_len;
        let from = self.host_to.unwrap_or(end);
        if self.device.is_empty() || from >= end {
            return Ok(());
        }
        let rows = from - start..end - start;
        for (slot, plane) in self.device.iter().enumerate() {
            let values = lock(plane).read(rows.clone())?;
            let q = &mut self.q[slot];
            let needed = rows.end * row_len;
            if q.len() < needed {
                q.reserve_exact(full.max(needed) - q.len());
                q.resize(needed, 0.0);
            }
            q[rows.start * row_len..needed].copy_from_slice(&values);
        }
        self.host_to = Some(end);
        Ok(())
    }

    /// Frees the rows kept on the device (a finished request's, once its maps were
    /// computed there and what the host needs was copied, [`Self::sync_host`]); rows
    /// the host never got stay absent from it.
    pub fn release_device_rows(&mut self) {
        self.device.clear();
    }

    /// Calls `f` with rows `rows` of captured layer slot `slot` as a map job reads
    /// them: where they are kept on the device, or else from the host's planes; `None`
    /// unless every one was recorded.
    pub fn with_map_queries<R>(
        &self,
        slot: usize,
        rows: Range<usize>,
        f: impl FnOnce(MapQueries<'_>) -> R,
    ) -> Option<R> {
        let Some(plane) = self.device.get(slot) else {
            return self.queries(slot, rows).map(|q| f(MapQueries::Host(q)));
        };
        let recorded = self.positions.start..self.filled_to.min(self.positions.end);
        if !rows.is_empty() && (rows.start < recorded.start || rows.end > recorded.end) {
            return None;
        }
        let plane = lock(plane);
        let first = rows.start.saturating_sub(self.positions.start);
        Some(f(MapQueries::Kept {
            rows: &**plane,
            first,
        }))
    }

    /// Whether the row of position `pos` was recorded (on the host or the device).
    pub fn has_row(&self, pos: usize) -> bool {
        self.positions.contains(&pos) && pos < self.filled_to
    }

    /// One past the last position the host's planes hold.
    fn host_end(&self) -> usize {
        self.host_to.unwrap_or(self.filled_to)
    }

    /// Sums the key statistics and span masses as rows run, from the probabilities the
    /// attention kernel computes for them ([`StepTap`] asks the backend for them),
    /// instead of computing them from the keys when finalizing, and keeps each layer's
    /// last row for a streamed response's live figures
    /// ([`crate::live::row_capture_from_sums`]). `attention`: every layer of the model.
    /// Does nothing without statistics, spans or streamed top-k; where the backend gives
    /// no probabilities, or the rows do not all run in order once, finalizing (and
    /// [`crate::live::row_capture`]) compute them from the keys as before.
    pub fn with_live_sums(mut self, attention: &[AttentionLayerSpec]) -> Self {
        let spec = &self.spec;
        let spans = spec
            .spans
            .iter()
            .map(|s| s.tokens.clone())
            .collect::<Option<Vec<_>>>()
            .filter(|s| !s.is_empty())
            .map(|s| SpanOwners::new(&s));
        let streams_top_k = spec.stream_rows && spec.top_k.is_some();
        if spec.stats.is_empty() && spans.is_none() && !streams_top_k {
            return self;
        }
        let groups = spec
            .layers
            .iter()
            .map(|&l| {
                attention
                    .get(l)
                    .map(|layer| spec.stats_heads.groups(&spec.heads, layer))
            })
            .collect::<Option<Vec<_>>>();
        if let Some(groups) = groups {
            let figures = LiveFigures {
                key_mass: !spec.stats.is_empty(),
                key_max: spec.stats.contains(&KeyStat::KeyMax),
            };
            self.live = Some(LiveSums::new(groups, self.positions.start, figures, spans));
        }
        self
    }

    /// Whether figures are being summed live from the rows' probabilities as they run.
    fn sums_live(&self) -> bool {
        self.live.as_ref().is_some_and(|l| !l.is_stopped())
    }

    /// The captured layer slot of `layer` when its figures are being summed live.
    fn live_slot(&self, layer: usize) -> Option<usize> {
        let slot = (*self.layer_slot.get(layer)?)?;
        self.sums_live().then_some(slot)
    }

    /// The live key statistics as accumulators over `rows`, `num_keys` wide, if they
    /// cover exactly those rows (see [`LiveSums::accumulators`]).
    pub(crate) fn live_stats(
        &self,
        rows: &Range<usize>,
        num_keys: usize,
    ) -> Option<Vec<KeyStatsAccumulator>> {
        self.live.as_ref()?.accumulators(rows, num_keys)
    }

    /// What the live sums kept of the row at `pos` on captured layer slot `slot`, when it
    /// is the last row they summed there (see [`LiveSums::last_row`]).
    pub(crate) fn live_last_row(&self, slot: usize, pos: usize) -> Option<LastRow<'_>> {
        self.live.as_ref()?.last_row(slot, pos)
    }

    /// The live span masses per captured layer slot, if they cover exactly `rows` (see
    /// [`LiveSums::span_masses`]).
    pub(crate) fn live_span_masses(
        &self,
        rows: &Range<usize>,
        num_keys: usize,
    ) -> Option<Vec<&[f32]>> {
        self.live.as_ref()?.span_masses(rows, num_keys)
    }

    /// Whether finalizing rows `rows` (`num_keys` keys wide) needs the keys: for maps
    /// (unless `maps_computed`: the backend computed them where its cache lives) or the
    /// attention output's check, or for key statistics and span masses unless they were
    /// summed as the rows ran.
    pub fn needs_keys(&self, rows: &Range<usize>, num_keys: usize, maps_computed: bool) -> bool {
        let spec = &self.spec;
        (spec.maps && !maps_computed)
            || spec.keep_attention_output
            || ((!spec.stats.is_empty() || !spec.spans.is_empty())
                && !self.live.as_ref().is_some_and(|l| l.covers(rows, num_keys)))
    }

    /// Whether key statistics or span masses are being summed as rows run, and so far
    /// every row came.
    pub fn live_sums_active(&self) -> bool {
        self.live.as_ref().is_some_and(|l| !l.is_stopped())
    }

    pub fn spec(&self) -> &CaptureSpec {
        &self.spec
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Positions this buffer keeps rows for.
    pub fn positions(&self) -> Range<usize> {
        self.positions.clone()
    }

    /// The requested rows of a sequence of `total_len` tokens (the first `prompt_len`
    /// the prompt) that have a recorded query and keys, `num_computed` of them having
    /// keys in the cache: the rows a capture delivers.
    pub fn rows_present(
        &self,
        prompt_len: usize,
        total_len: usize,
        num_computed: usize,
    ) -> Range<usize> {
        let requested = self.spec.rows.positions(prompt_len, total_len);
        let end = requested.end.min(num_computed).min(self.filled_to);
        requested.start..end.max(requested.start)
    }

    /// One past the highest position recorded so far.
    pub fn filled_to(&self) -> usize {
        self.filled_to
    }

    fn row_len(&self) -> usize {
        self.spec.heads.len() * self.head_dim
    }

    pub fn captures_layer(&self, layer: usize) -> bool {
        matches!(self.layer_slot.get(layer), Some(Some(_)))
    }

    /// The query row of position `pos` for the `i`-th captured head of captured layer
    /// slot `slot`; `None` when it was never recorded.
    pub fn query(&self, slot: usize, pos: usize, head_index: usize) -> Option<&[f32]> {
        self.row_of(&self.q, slot, pos, head_index)
    }

    /// The query rows of positions `rows` on captured layer slot `slot`, one after
    /// another: `[rows.len(), heads, head_dim]`; `None` unless every one was recorded.
    pub fn queries(&self, slot: usize, rows: Range<usize>) -> Option<&[f32]> {
        if rows.is_empty() {
            return Some(&[]);
        }
        if rows.start < self.positions.start || rows.end > self.host_end().min(self.positions.end) {
            return None;
        }
        let start = (rows.start - self.positions.start) * self.row_len();
        self.q
            .get(slot)?
            .get(start..start + rows.len() * self.row_len())
    }

    /// The attention output recorded beside the query (with `keep_attention_output`).
    pub fn attention_output(&self, slot: usize, pos: usize, head_index: usize) -> Option<&[f32]> {
        self.row_of(&self.out, slot, pos, head_index)
    }

    fn row_of<'a>(
        &self,
        planes: &'a [Vec<f32>],
        slot: usize,
        pos: usize,
        head_index: usize,
    ) -> Option<&'a [f32]> {
        if !self.positions.contains(&pos) || pos >= self.host_end() {
            return None;
        }
        let start = (pos - self.positions.start) * self.row_len() + head_index * self.head_dim;
        planes.get(slot)?.get(start..start + self.head_dim)
    }

    /// Copies the rows of tokens `first_pos..first_pos + num_tokens` of layer `layer`
    /// from `q` / `out` (`[num_tokens, num_heads, head_dim]`, this request's part of the
    /// batch) into the buffer.
    pub fn record(&mut self, layer: usize, first_pos: usize, q: &[f32], out: &[f32]) {
        let Some(Some(slot)) = self.layer_slot.get(layer).copied() else {
            return;
        };
        let token_len = self.num_heads * self.head_dim;
        let num_tokens = q.len() / token_len.max(1);
        let wanted =
            first_pos.max(self.positions.start)..(first_pos + num_tokens).min(self.positions.end);
        if wanted.is_empty() {
            return;
        }
        let row_len = self.row_len();
        let needed = (wanted.end - self.positions.start) * row_len;
        let full = self.positions.len() * row_len;
        let all_heads = self.spec.heads.len() == self.num_heads;
        let keep_out = self.spec.keep_attention_output;
        for (plane, src) in [(&mut self.q[slot], q)]
            .into_iter()
            .chain(keep_out.then(|| (&mut self.out[slot], out)))
        {
            if plane.len() < needed {
                plane.reserve_exact(full.max(needed) - plane.len());
                plane.resize(needed, 0.0);
            }
            let dst_start = (wanted.start - self.positions.start) * row_len;
            let src_rows = wanted.start - first_pos..wanted.end - first_pos;
            if all_heads {
                // One contiguous copy for the whole range.
                plane[dst_start..dst_start + wanted.len() * row_len]
                    .copy_from_slice(&src[src_rows.start * token_len..src_rows.end * token_len]);
            } else {
                for (i, t) in src_rows.enumerate() {
                    for (hi, &h) in self.spec.heads.iter().enumerate() {
                        let s = t * token_len + h * self.head_dim;
                        let d = dst_start + i * row_len + hi * self.head_dim;
                        plane[d..d + self.head_dim].copy_from_slice(&src[s..s + self.head_dim]);
                    }
                }
            }
        }
        self.filled_to = self.filled_to.max(wanted.end);
    }

    /// [`Self::record`] for rows kept on the device: copies the rows of tokens
    /// `first_pos..first_pos + num_tokens` of layer `layer` from the step's `q` (the
    /// backend's device tensor; this request's tokens start at its row `batch_row`)
    /// into the layer's device rows, there.
    pub fn record_kept(
        &mut self,
        layer: usize,
        first_pos: usize,
        q: &dyn Any,
        (batch_row, num_tokens): (usize, usize),
    ) -> Result<(), AttnError> {
        let Some(Some(slot)) = self.layer_slot.get(layer).copied() else {
            return Ok(());
        };
        let wanted =
            first_pos.max(self.positions.start)..(first_pos + num_tokens).min(self.positions.end);
        if wanted.is_empty() {
            return Ok(());
        }
        let plane = self.device.get(slot).ok_or_else(|| {
            AttnError::Unsupported(format!(
                "layer {layer}'s query rows handed over on the device to a capture that \
                 keeps them on the host"
            ))
        })?;
        let tokens = batch_row + (wanted.start - first_pos)..batch_row + (wanted.end - first_pos);
        let heads = KeptHeads {
            num_heads: self.num_heads,
            kept: &self.spec.heads,
            head_dim: self.head_dim,
        };
        let first_row = wanted.start - self.positions.start;
        lock(plane).write(q, tokens, heads, first_row)?;
        self.filled_to = self.filled_to.max(wanted.end);
        Ok(())
    }

    /// Bytes allocated on the host for the buffered rows (and the live sums); rows kept
    /// on the device are not counted.
    pub fn size_bytes(&self) -> usize {
        (self
            .q
            .iter()
            .chain(&self.out)
            .map(Vec::capacity)
            .sum::<usize>())
            * 4
            + self.live.as_ref().map_or(0, LiveSums::size_bytes)
    }
}

/// One captured layer's rows on the device, shared by clones of the buffer.
type SharedKeptRows = Arc<Mutex<Box<dyn KeptRows>>>;

/// The rows, whether or not a thread panicked while holding them (a write either
/// happened or errored; the rows stay as valid as the device left them).
fn lock(plane: &SharedKeptRows) -> MutexGuard<'_, Box<dyn KeptRows>> {
    plane.lock().unwrap_or_else(|e| e.into_inner())
}

/// One capturing request's part of a step's batch.
struct TapTarget<'a> {
    /// First row of the request's tokens in the batch.
    batch_row: usize,
    num_tokens: usize,
    /// Absolute position of its first token in this step.
    first_pos: usize,
    buffer: &'a mut QueryRowBuffer,
}

/// The [`AttentionTap`] of one step: copies each capturing request's query rows into
/// its buffer, by contiguous range, and for requests that sum key statistics live
/// ([`QueryRowBuffer::with_live_sums`]) asks the backend for their rows' probabilities
/// and adds them up.
pub struct StepTap<'a> {
    targets: Vec<TapTarget<'a>>,
    /// `wanted[l]`: some target captures layer `l`.
    wanted: Vec<bool>,
    /// Elements per token row of q (`num_heads * head_dim`).
    token_len: usize,
    num_heads: usize,
    /// Per layer, per row asked of the backend: its target and position (kept per
    /// layer: a device may hand the probabilities over after later layers have run).
    asked: Vec<Vec<(usize, usize)>>,
    /// The probabilities' buffers, kept from layer to layer.
    spare: Option<RowProbabilities>,
}

/// Probabilities asked of the backend in one layer call, at most (16 MiB): a longer
/// prefill chunk's rows are left to finalizing.
const MAX_LIVE_VALUES: usize = 1 << 22;

impl<'a> StepTap<'a> {
    pub fn new(num_layers: usize, num_heads: usize, head_dim: usize) -> Self {
        Self {
            targets: Vec::new(),
            wanted: vec![false; num_layers],
            token_len: num_heads * head_dim,
            num_heads,
            asked: vec![Vec::new(); num_layers],
            spare: None,
        }
    }

    /// Positions of target `t`'s step tokens whose rows its buffer keeps.
    fn kept_positions(t: &TapTarget<'_>) -> Range<usize> {
        let kept = t.buffer.positions();
        let start = t.first_pos.max(kept.start);
        start..(t.first_pos + t.num_tokens).min(kept.end).max(start)
    }

    /// Adds a request whose `num_tokens` tokens start at batch row `batch_row` and
    /// absolute position `first_pos`.
    pub fn add(
        &mut self,
        batch_row: usize,
        num_tokens: usize,
        first_pos: usize,
        buffer: &'a mut QueryRowBuffer,
    ) {
        for (l, w) in self.wanted.iter_mut().enumerate() {
            *w |= buffer.captures_layer(l);
        }
        self.targets.push(TapTarget {
            batch_row,
            num_tokens,
            first_pos,
            buffer,
        });
    }

    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// Whether target `t` captures `layer` with its rows on the host: the rows
    /// [`AttentionTap::rows_read`] names and [`AttentionTap::record`] copies.
    fn records_on_host(t: &TapTarget<'_>, layer: usize) -> bool {
        t.buffer.captures_layer(layer) && !t.buffer.keeps_on_device()
    }

    /// Every kept row of target `t`'s step on `layer` must have been summed live by the
    /// end of the step (or the live sums stop).
    fn expect_summed(t: &mut TapTarget<'_>, layer: usize) {
        if let Some(slot) = t.buffer.live_slot(layer) {
            let end = Self::kept_positions(t).end;
            if let Some(live) = &mut t.buffer.live {
                live.expect_rows(slot, end);
            }
        }
    }
}

impl AttentionTap for StepTap<'_> {
    fn wants_layer(&self, layer: usize) -> bool {
        self.wanted.get(layer).copied().unwrap_or(false)
    }

    fn wants_output(&self, layer: usize) -> bool {
        self.targets.iter().any(|t| {
            t.buffer.spec().keep_attention_output && t.buffer.spec().layers.contains(&layer)
        })
    }

    fn rows_read(&self, layer: usize) -> Vec<Range<usize>> {
        self.targets
            .iter()
            .filter(|t| Self::records_on_host(t, layer))
            .map(|t| t.batch_row..t.batch_row + t.num_tokens)
            .collect()
    }

    fn record(
        &mut self,
        layer: usize,
        rows: RecordedRows,
        q: &Tensor,
        attn_out: Option<&Tensor>,
    ) -> Result<(), AttnError> {
        let q = host_f32(q)?;
        let attn_out = attn_out.map(host_f32).transpose()?;
        let n = self.token_len;
        // With `Read`, the rows of the targets before this one that it names.
        let mut read = 0;
        for t in self.targets.iter_mut() {
            if !Self::records_on_host(t, layer) {
                continue;
            }
            let first = match rows {
                RecordedRows::All => t.batch_row,
                RecordedRows::Read => read,
            };
            read += t.num_tokens;
            let span = first * n..(first + t.num_tokens) * n;
            let q = q
                .get(span.clone())
                .ok_or_else(|| AttnError::UnsupportedTensor {
                    what: "captured query rows",
                    problem: format!(
                        "layer {layer}: {} values handed over, where the capture reads rows \
                         {first}..{} of {n} values",
                        q.len(),
                        first + t.num_tokens
                    ),
                })?;
            let out = attn_out.as_ref().and_then(|o| o.get(span));
            if out.is_none() && t.buffer.spec().keep_attention_output {
                return Err(AttnError::Unsupported(format!(
                    "layer {layer}'s attention output was not handed to a capture that keeps it"
                )));
            }
            t.buffer.record(layer, t.first_pos, q, out.unwrap_or(&[]));
        }
        Ok(())
    }

    fn device_only(&self) -> bool {
        self.targets.iter().all(|t| t.buffer.keeps_on_device())
    }

    fn probability_plan(&self) -> Vec<usize> {
        // What `probability_rows` will ask, layer by layer: the rows of each live-summing
        // target, but for those it stops on the way (too many values), which it asks for
        // on no later layer either.
        let mut stopped = vec![false; self.targets.len()];
        let mut plan = vec![0; self.wanted.len()];
        for (layer, planned) in plan.iter_mut().enumerate() {
            let mut values = 0usize;
            for (ti, t) in self.targets.iter().enumerate() {
                if stopped[ti] || t.buffer.live_slot(layer).is_none() {
                    continue;
                }
                let kept = Self::kept_positions(t);
                let need: usize = kept.clone().map(|pos| (pos + 1) * self.num_heads).sum();
                if values + need > MAX_LIVE_VALUES {
                    stopped[ti] = true;
                    continue;
                }
                values += need;
                *planned += kept.len();
            }
        }
        if plan.iter().all(|&rows| rows == 0) {
            plan.clear();
        }
        plan
    }

    fn keeps_on_device(&self, layer: usize) -> bool {
        self.targets
            .iter()
            .any(|t| t.buffer.captures_layer(layer) && t.buffer.keeps_on_device())
    }

    fn record_kept(&mut self, layer: usize, q: &dyn Any) -> Result<(), AttnError> {
        for t in self.targets.iter_mut() {
            if !t.buffer.captures_layer(layer) || !t.buffer.keeps_on_device() {
                continue;
            }
            let rows = (t.batch_row, t.num_tokens);
            t.buffer.record_kept(layer, t.first_pos, q, rows)?;
        }
        Ok(())
    }

    fn probability_rows(&mut self, layer: usize) -> Option<RowProbabilities> {
        let mut asked = std::mem::take(self.asked.get_mut(layer)?);
        asked.clear();
        let mut rows = Vec::new();
        let mut values = 0usize;
        for (ti, t) in self.targets.iter_mut().enumerate() {
            if t.buffer.live_slot(layer).is_none() {
                continue;
            }
            let kept = Self::kept_positions(t);
            let need: usize = kept.clone().map(|pos| (pos + 1) * self.num_heads).sum();
            if values + need > MAX_LIVE_VALUES {
                if let Some(live) = &mut t.buffer.live {
                    live.stop();
                }
                continue;
            }
            values += need;
            for pos in kept {
                rows.push(t.batch_row + (pos - t.first_pos));
                asked.push((ti, pos));
            }
        }
        self.asked[layer] = asked;
        if rows.is_empty() {
            return None;
        }
        let mut probabilities = self.spare.take().unwrap_or_default();
        probabilities.ask(rows);
        Some(probabilities)
    }

    fn record_probabilities(&mut self, layer: usize, probabilities: RowProbabilities) {
        let asked = self.asked.get(layer).map_or(&[][..], Vec::as_slice);
        if probabilities.is_filled() && probabilities.rows().len() == asked.len() {
            // Each target's rows are consecutive among those asked; targets in parallel.
            let mut runs: Vec<(usize, Range<usize>)> = Vec::new();
            for (i, &(ti, _)) in asked.iter().enumerate() {
                match runs.last_mut() {
                    Some((last, r)) if *last == ti => r.end = i + 1,
                    _ => runs.push((ti, i..i + 1)),
                }
            }
            let probabilities = &probabilities;
            let targets = share::SharedMut::new(&mut self.targets);
            let add = |run: usize| {
                let (ti, rows) = runs[run].clone();
                // SAFETY: one task per target.
                let t = unsafe { &mut targets.range(ti, 1)[0] };
                let heads = &t.buffer.spec.heads;
                let Some(slot) = t.buffer.layer_slot.get(layer).copied().flatten() else {
                    return;
                };
                if let Some(live) = &mut t.buffer.live {
                    for i in rows {
                        live.add_row(slot, asked[i].1, heads, probabilities, i);
                    }
                }
            };
            if runs.len() > 1 && probabilities.num_values() >= share::SERIAL_VALUES {
                share::run(runs.len(), &add);
            } else {
                (0..runs.len()).for_each(add);
            }
        }
        self.spare = Some(probabilities);
    }

    fn finish_step(&mut self) {
        for t in self.targets.iter_mut() {
            for i in 0..t.buffer.spec.layers.len() {
                let layer = t.buffer.spec.layers[i];
                Self::expect_summed(t, layer);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::RowSelection;

    fn spec(layers: Vec<usize>, heads: Vec<usize>, rows: RowSelection) -> CaptureSpec {
        let mut s = CaptureSpec::everything(4, 3);
        s.layers = layers;
        s.heads = heads;
        s.rows = rows;
        s.keep_attention_output = true;
        s
    }

    /// q value encoding (token position, head, dim) so rows can be checked.
    fn batch(first_pos: usize, num_tokens: usize, heads: usize, dim: usize) -> Vec<f32> {
        let mut v = Vec::new();
        for t in 0..num_tokens {
            for h in 0..heads {
                for d in 0..dim {
                    v.push(((first_pos + t) * 100 + h * 10 + d) as f32);
                }
            }
        }
        v
    }

    /// Rows "kept on a device": a vector, written from a step's q given as one.
    #[derive(Debug)]
    struct VecRows {
        values: Vec<f32>,
        row_len: usize,
    }

    impl KeptRows for VecRows {
        fn row_len(&self) -> usize {
            self.row_len
        }
        fn capacity(&self) -> usize {
            self.values.len() / self.row_len
        }
        fn write(
            &mut self,
            q: &dyn Any,
            tokens: Range<usize>,
            heads: KeptHeads<'_>,
            first_row: usize,
        ) -> Result<(), AttnError> {
            let q: &Vec<f32> = q.downcast_ref().unwrap();
            let d = heads.head_dim;
            for (i, t) in tokens.enumerate() {
                for (j, &h) in heads.kept.iter().enumerate() {
                    let dst = (first_row + i) * self.row_len + j * d;
                    let src = (t * heads.num_heads + h) * d;
                    self.values[dst..dst + d].copy_from_slice(&q[src..src + d]);
                }
            }
            Ok(())
        }
        fn read(&self, rows: Range<usize>) -> Result<Vec<f32>, AttnError> {
            Ok(self.values[rows.start * self.row_len..rows.end * self.row_len].to_vec())
        }
        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    /// Rows kept on the device land where the host's would (the same values once
    /// copied over), reach the host's planes only through `sync_host`, are read where
    /// they are by a map job, and stay on the host once the device's are released.
    #[test]
    fn rows_kept_on_the_device_reach_the_host_when_synced() {
        let mut s = spec(
            vec![1],
            vec![0, 2],
            RowSelection::Range { start: 2, end: 7 },
        );
        s.keep_attention_output = false;
        let mut host = QueryRowBuffer::new(s.clone(), 4, 3, 2, 5, 3);
        let mut kept = QueryRowBuffer::new(s, 4, 3, 2, 5, 3);
        let rows = VecRows {
            values: vec![0.0; kept.positions().len() * 4],
            row_len: 4,
        };
        kept.device = vec![Arc::new(Mutex::new(Box::new(rows) as Box<dyn KeptRows>))];
        kept.host_to = Some(kept.positions().start);
        assert!(kept.keeps_on_device());
        for (first, n) in [(0, 3), (3, 2), (5, 1)] {
            // Another request's rows first in the batch.
            let mut q = batch(900, 2, 3, 2);
            q.extend(batch(first, n, 3, 2));
            host.record(1, first, &q[2 * 6..], &[]);
            kept.record_kept(1, first, &q, (2, n)).unwrap();
            kept.record_kept(0, first, &q, (2, n)).unwrap(); // a layer not captured
        }
        assert!(kept.has_row(5) && !kept.has_row(6) && !kept.has_row(1));
        assert_eq!(kept.queries(0, 2..6), None, "not on the host before a sync");
        let on_device = kept
            .with_map_queries(0, 3..6, |q| match q {
                MapQueries::Kept { rows, first } => rows.read(first..first + 3).unwrap(),
                MapQueries::Host(_) => panic!("read from the host"),
            })
            .unwrap();
        assert_eq!(on_device, host.queries(0, 3..6).unwrap());
        kept.sync_host().unwrap();
        assert_eq!(kept.queries(0, 2..6), host.queries(0, 2..6));
        // Position 4, the second kept head (2): 4 * 100 + 2 * 10 + d.
        assert_eq!(kept.query(0, 4, 1), Some(&[420.0, 421.0][..]));
        kept.release_device_rows();
        assert!(!kept.keeps_on_device());
        assert_eq!(kept.queries(0, 2..6), host.queries(0, 2..6));
        let from_host = kept.with_map_queries(0, 2..4, |q| matches!(q, MapQueries::Host(_)));
        assert_eq!(from_host, Some(true));
        let q = batch(6, 1, 3, 2);
        assert!(kept.record_kept(1, 6, &q, (0, 1)).is_err());
    }

    /// A step's capture stays on the device, so that the step may run from a recorded
    /// graph, only where every capturing request keeps its rows there and sums nothing
    /// live from the step's probabilities.
    #[test]
    fn a_step_stays_on_the_device_only_where_every_capture_does() {
        let on_device = |mut b: QueryRowBuffer| {
            let rows = VecRows {
                values: vec![0.0; b.positions().len() * 4],
                row_len: 4,
            };
            b.device = vec![Arc::new(Mutex::new(Box::new(rows) as Box<dyn KeptRows>))];
            b.host_to = Some(b.positions().start);
            b
        };
        let mut s = spec(vec![1], vec![0, 2], RowSelection::All);
        s.keep_attention_output = false;
        let mut kept = on_device(QueryRowBuffer::new(s.clone(), 4, 3, 2, 5, 3));
        let mut host = QueryRowBuffer::new(s.clone(), 4, 3, 2, 5, 3);
        let mut summing = s.clone();
        summing.stats = vec![KeyStat::KeyMass];
        let layers = vec![AttentionLayerSpec::new(3, 3, 2); 4];
        let summing = QueryRowBuffer::new(summing, 4, 3, 2, 5, 3).with_live_sums(&layers);
        assert!(summing.sums_live());
        let mut summing = on_device(summing);

        let mut tap = StepTap::new(4, 3, 2);
        tap.add(0, 1, 5, &mut kept);
        assert!(tap.device_only());
        tap.add(1, 1, 5, &mut host);
        assert!(!tap.device_only(), "a capture on the host");
        assert!(tap.probability_plan().is_empty(), "nothing summed live");
        let mut tap = StepTap::new(4, 3, 2);
        tap.add(0, 1, 5, &mut kept);
        tap.add(1, 1, 5, &mut summing);
        assert!(
            tap.device_only(),
            "statistics summed live, rows on the device"
        );
        let live = tap.probability_plan();
        assert_eq!(live, [0, 1, 0, 0], "statistics summed live on layer 1");
        let mut other = StepTap::new(4, 3, 2);
        other.add(0, 1, 5, &mut host);
        assert!(other.probability_plan().is_empty());
        drop((tap, other));
        let mut tap = StepTap::new(4, 3, 2);
        tap.add(2, 1, 5, &mut summing);
        assert_eq!(
            tap.probability_plan(),
            live,
            "the same rows on the same layers, wherever in the batch"
        );
        let mut two = StepTap::new(4, 3, 2);
        two.add(0, 1, 5, &mut kept);
        drop(tap);
        let mut summing_too =
            QueryRowBuffer::new(summing.spec().clone(), 4, 3, 2, 5, 3).with_live_sums(&layers);
        two.add(1, 1, 5, &mut summing);
        two.add(2, 1, 5, &mut summing_too);
        assert_eq!(two.probability_plan(), [0, 2, 0, 0], "two rows a layer");
        drop(two);
        summing.live.as_mut().unwrap().stop();
        let mut tap = StepTap::new(4, 3, 2);
        tap.add(0, 1, 5, &mut summing);
        assert!(tap.device_only(), "live sums stopped");
        assert!(tap.probability_plan().is_empty(), "live sums stopped");
    }

    /// The plan a step's graph is keyed by names the rows `probability_rows` then asks
    /// for, layer by layer: also where asking stops a target that needs too many values
    /// (on that layer and every later one).
    #[test]
    fn the_probability_plan_names_the_rows_asked() {
        let layers = vec![AttentionLayerSpec::new(3, 3, 2); 4];
        let mut s = spec(vec![0, 1, 3], vec![0, 2], RowSelection::All);
        s.stats = vec![KeyStat::KeyMass];
        let live = |prompt: usize| {
            QueryRowBuffer::new(s.clone(), 4, 3, 2, prompt, 3).with_live_sums(&layers)
        };
        // (pos + 1) · 3 heads past MAX_LIVE_VALUES on its own.
        let far = MAX_LIVE_VALUES / 3 + 10;
        let (mut near, mut next, mut beyond) = (live(5), live(9), live(far + 1));
        let mut host = QueryRowBuffer::new(s.clone(), 4, 3, 2, 5, 3);
        let asked = |tap: &mut StepTap<'_>| -> Vec<usize> {
            (0..4)
                .map(|layer| tap.probability_rows(layer).map_or(0, |p| p.rows().len()))
                .collect()
        };
        let mut tap = StepTap::new(4, 3, 2);
        tap.add(0, 1, 5, &mut near);
        tap.add(1, 1, 9, &mut next);
        tap.add(2, 1, far, &mut beyond);
        tap.add(3, 1, 5, &mut host);
        let predicted = tap.probability_plan();
        assert_eq!(
            predicted,
            [2, 2, 0, 2],
            "two targets; the third needs too many values"
        );
        assert_eq!(
            predicted,
            asked(&mut tap),
            "three targets, one stopped on the way"
        );
        drop(tap);
        assert!(!beyond.sums_live() && near.sums_live() && next.sums_live());
        let mut tap = StepTap::new(4, 3, 2);
        tap.add(0, 1, 6, &mut near);
        tap.add(1, 1, 10, &mut next);
        tap.add(2, 1, far + 1, &mut beyond);
        assert_eq!(
            tap.probability_plan(),
            predicted,
            "the next step asks alike"
        );
        assert_eq!(tap.probability_plan(), asked(&mut tap));
    }

    /// Probabilities a device hands over after the layers have run (after the rows were
    /// recorded, layers out of order) keep the live sums, as long as every layer's come
    /// before the step ends; a layer whose never came stops them at the step's end.
    #[test]
    fn probabilities_handed_over_after_the_layers_count_until_the_step_ends() {
        let layers = vec![AttentionLayerSpec::new(3, 3, 2); 4];
        let mut s = spec(vec![1, 3], vec![0, 2], RowSelection::All);
        s.stats = vec![KeyStat::KeyMass];
        let q = lantern_attn::tensor3(batch(0, 2, 3, 2), [2, 3, 2], &lantern_attn::Device::Cpu)
            .unwrap();
        for deliver_all in [true, false] {
            let mut b = QueryRowBuffer::new(s.clone(), 4, 3, 2, 2, 1).with_live_sums(&layers);
            let mut tap = StepTap::new(4, 3, 2);
            tap.add(0, 2, 0, &mut b);
            let mut asked = Vec::new();
            for layer in [1, 3] {
                asked.push((layer, tap.probability_rows(layer).unwrap()));
                let out = Some(&q);
                tap.record(layer, RecordedRows::All, &q, out).unwrap();
            }
            // Handed over last layer first, as a device's queue may; each row's keys
            // share its mass evenly.
            for (layer, mut p) in asked.into_iter().rev() {
                if !deliver_all && layer == 1 {
                    continue;
                }
                p.prepare(3, |t| 0..t + 1);
                let (values, keys, offsets) = p.parts_mut();
                let filled: Vec<(usize, usize)> = keys
                    .iter()
                    .map(|k| k.len())
                    .zip(offsets.iter().copied())
                    .collect();
                for (n, offset) in filled {
                    values[offset..offset + 3 * n].fill(1.0 / n as f32);
                }
                tap.record_probabilities(layer, p);
            }
            tap.finish_step();
            drop(tap);
            assert_eq!(
                b.sums_live(),
                deliver_all,
                "every layer delivered: {deliver_all}"
            );
        }
    }

    #[test]
    fn chunks_and_decodes_land_by_position() {
        let mut b =
            QueryRowBuffer::new(spec(vec![1], vec![0, 2], RowSelection::All), 4, 3, 2, 5, 3);
        // Prefill in two chunks, then a decode, through a step tap with another request
        // occupying the first rows of the batch.
        for (first, n) in [(0, 3), (3, 2), (5, 1)] {
            let mut q = batch(900, 2, 3, 2); // someone else's rows
            q.extend(batch(first, n, 3, 2));
            let out: Vec<f32> = q.iter().map(|x| -x).collect();
            let mut tap = StepTap::new(4, 3, 2);
            tap.add(2, n, first, &mut b);
            assert!(tap.wants_layer(1) && !tap.wants_layer(0));
            let shape = [q.len() / 6, 3, 2];
            let q = lantern_attn::tensor3(q, shape, &lantern_attn::Device::Cpu).unwrap();
            let out = lantern_attn::tensor3(out, shape, &lantern_attn::Device::Cpu).unwrap();
            tap.record(1, RecordedRows::All, &q, Some(&out)).unwrap();
        }
        assert_eq!(b.filled_to(), 6);
        for pos in 0..6 {
            for (hi, h) in [0, 2].into_iter().enumerate() {
                let want = [(pos * 100 + h * 10) as f32, (pos * 100 + h * 10 + 1) as f32];
                assert_eq!(b.query(0, pos, hi).unwrap(), want);
                assert_eq!(
                    b.attention_output(0, pos, hi).unwrap(),
                    [-want[0], -want[1]]
                );
            }
        }
        assert!(b.query(0, 6, 0).is_none());
    }

    /// A device hands over only the rows the tap reads (`RecordedRows::Read`): the
    /// capturing requests' rows, one after another, without the others between them.
    /// They land as the whole batch's do; a request that keeps outputs but does not
    /// capture the layer asks for none; too few rows are an error, not a silent skip.
    #[test]
    fn rows_read_alone_land_as_the_whole_batch_does() {
        let shape = |rows: usize| [rows, 3, 2];
        let tensor = |v: Vec<f32>| {
            let rows = v.len() / 6;
            lantern_attn::tensor3(v, shape(rows), &lantern_attn::Device::Cpu).unwrap()
        };
        // Batch: request A (positions 4..7, rows 0..3), someone else (rows 3..5),
        // request B (position 9, row 5); C keeps outputs of layer 0 only.
        let mut whole = batch(4, 3, 3, 2);
        whole.extend(batch(900, 2, 3, 2));
        whole.extend(batch(9, 1, 3, 2));
        let make = || {
            let plain = |layers, heads| CaptureSpec {
                keep_attention_output: false,
                ..spec(layers, heads, RowSelection::All)
            };
            let a = QueryRowBuffer::new(plain(vec![1], vec![0, 2]), 4, 3, 2, 8, 4);
            let b = QueryRowBuffer::new(plain(vec![1, 3], vec![1]), 4, 3, 2, 9, 3);
            let c = QueryRowBuffer::new(spec(vec![0], vec![0], RowSelection::All), 4, 3, 2, 9, 3);
            [a, b, c]
        };
        let (mut via_all, mut via_read) = (make(), make());
        for (buffers, read) in [(&mut via_all, false), (&mut via_read, true)] {
            let [a, b, c] = buffers;
            let mut tap = StepTap::new(4, 3, 2);
            tap.add(0, 3, 4, a);
            tap.add(5, 1, 9, b);
            tap.add(3, 2, 900, c);
            assert_eq!(tap.rows_read(1), [0..3, 5..6]);
            assert_eq!(tap.rows_read(0), vec![Range { start: 3, end: 5 }]);
            // C keeps outputs, of layer 0 only: layer 1 is recorded without them.
            assert!(!tap.wants_output(1) && tap.wants_output(0));
            if read {
                let mut picked = whole[..3 * 6].to_vec();
                picked.extend(&whole[5 * 6..]);
                // One row short of what the capturing requests need.
                let short = tensor(picked[..3 * 6].to_vec());
                assert!(tap.record(1, RecordedRows::Read, &short, None).is_err());
                tap.record(1, RecordedRows::Read, &tensor(picked), None)
                    .unwrap();
            } else {
                tap.record(1, RecordedRows::All, &tensor(whole.clone()), None)
                    .unwrap();
            }
        }
        for (x, y) in via_all.iter().zip(&via_read) {
            assert_eq!(x.q, y.q);
            assert_eq!(x.filled_to(), y.filled_to());
        }
        assert_eq!(via_read[0].query(0, 6, 1).unwrap(), [620.0, 621.0]);
        assert_eq!(via_read[1].query(0, 9, 0).unwrap(), [910.0, 911.0]);
        assert_eq!(via_read[2].filled_to(), 0);
    }

    /// The attention output is asked for only by a capture that keeps it, and a tap
    /// records query rows without it; a capture that keeps it refuses a step without it.
    #[test]
    fn the_output_is_asked_for_only_where_it_is_kept() {
        let shape = [2, 3, 2];
        let q = lantern_attn::tensor3(batch(0, 2, 3, 2), shape, &lantern_attn::Device::Cpu);
        let q = q.unwrap();
        for keep in [false, true] {
            let mut s = spec(vec![1], vec![0, 1, 2], RowSelection::All);
            s.keep_attention_output = keep;
            let mut b = QueryRowBuffer::new(s, 4, 3, 2, 2, 1);
            let mut tap = StepTap::new(4, 3, 2);
            tap.add(0, 2, 0, &mut b);
            assert_eq!(tap.wants_output(1), keep);
            assert!(!tap.wants_output(0), "a layer nobody captures");
            assert_eq!(tap.record(1, RecordedRows::All, &q, None).is_ok(), !keep);
            if !keep {
                assert_eq!(b.filled_to(), 2);
                assert_eq!(b.query(0, 1, 2).unwrap(), [120.0, 121.0]);
            }
        }
    }

    #[test]
    fn keeps_only_selected_rows_and_recompute_overwrites() {
        let rows = RowSelection::Range { start: 2, end: 4 };
        let mut b = QueryRowBuffer::new(spec(vec![0], vec![0, 1, 2], rows), 4, 3, 2, 6, 2);
        let q = batch(0, 6, 3, 2);
        b.record(0, 0, &q, &q);
        assert_eq!(b.size_bytes(), 2 * 2 * 3 * 2 * 4);
        assert!(b.query(0, 1, 0).is_none());
        assert_eq!(b.query(0, 3, 1).unwrap(), [310.0, 311.0]);
        b.record(0, 0, &q, &q);
        assert_eq!(b.query(0, 3, 1).unwrap(), [310.0, 311.0]);
    }

    #[test]
    fn holds_exactly_the_rows_admission_counts() {
        // 10 prompt rows in chunks of 3, then 4 decodes: a doubling vector would hold
        // 24 rows after the fourth chunk.
        let mut b = QueryRowBuffer::new(
            spec(vec![0, 2], vec![0, 1, 2], RowSelection::All),
            4,
            3,
            2,
            10,
            4,
        );
        let steps = [
            (0, 3),
            (3, 3),
            (6, 3),
            (9, 1),
            (10, 1),
            (11, 1),
            (12, 1),
            (13, 1),
        ];
        for (first, n) in steps {
            let q = batch(first, n, 3, 2);
            for layer in 0..4 {
                b.record(layer, first, &q, &q);
            }
        }
        // 2 layers x (queries and outputs) x 14 rows x 3 heads x 2 dims x 4 bytes.
        assert_eq!(b.size_bytes(), 2 * 2 * 14 * 3 * 2 * 4);
        assert_eq!(b.query(1, 13, 2).unwrap(), [1320.0, 1321.0]);
    }
}
