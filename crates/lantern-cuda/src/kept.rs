//! A capturing request's query rows kept on the device between steps ([`KeptRows`]):
//! each capturing step copies the request's rows (its asked heads) out of the step's q
//! on the device (a graph step: one launch a layer, from a [`KeptRowsTable`]), and
//! finalize's maps (`maps.rs`) read them where they are. Nothing crosses to the host on
//! the step's path.

use std::any::Any;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, DevicePtr};
use lantern_attn::{AttnError, KeptHeads, KeptRows};

use crate::cache::attn_error;
use crate::error::{ensure, CudaError, Result};
use crate::gpu::Gpu;

/// Device memory the kept rows leave alone: the steps' activations and the maps of
/// finishing captures are allocated from what is free beyond the KV cache.
const RESERVE_BYTES: usize = 1 << 30;

/// One captured layer's rows of one request: `[capacity, row_len]` f32 on the device.
pub struct CudaKeptRows {
    gpu: Arc<Gpu>,
    rows: CudaSlice<f32>,
    row_len: usize,
    capacity: usize,
}

impl std::fmt::Debug for CudaKeptRows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKeptRows")
            .field("capacity", &self.capacity)
            .field("row_len", &self.row_len)
            .finish()
    }
}

impl CudaKeptRows {
    /// Room for `capacity` rows of `row_len` values, zeroed. Refused (out of memory)
    /// where it would take more than half of the device's free memory beyond a reserve
    /// of [`RESERVE_BYTES`]: the capture then keeps its rows on the host.
    pub fn new(gpu: Arc<Gpu>, capacity: usize, row_len: usize) -> Result<Self> {
        let len = capacity
            .checked_mul(row_len)
            .ok_or_else(|| CudaError::Shape(format!("{capacity} kept rows of {row_len} values")))?;
        let bytes = len.saturating_mul(4);
        let (free, _) = gpu.memory_info()?;
        let spare = free.saturating_sub(RESERVE_BYTES) / 2;
        if bytes > spare {
            return Err(CudaError::OutOfMemory { bytes, free: spare });
        }
        let rows = gpu.zeros(len)?;
        Ok(Self {
            gpu,
            rows,
            row_len,
            capacity,
        })
    }

    /// The rows as the device holds them, for the map kernels.
    pub fn rows(&self) -> &CudaSlice<f32> {
        &self.rows
    }

    /// Checks a write of `tokens`' rows (`heads` of each) of a q of `q_len` values at
    /// row `first_row`.
    fn check_write(
        &self,
        q_len: usize,
        tokens: &Range<usize>,
        heads: &KeptHeads<'_>,
        first_row: usize,
    ) -> Result<()> {
        let KeptHeads {
            num_heads,
            kept,
            head_dim,
        } = *heads;
        let token_len = num_heads * head_dim;
        ensure(kept.len() * head_dim == self.row_len, || {
            format!(
                "kept rows of {} values written with {} heads of {head_dim}",
                self.row_len,
                kept.len()
            )
        })?;
        ensure(kept.iter().all(|&h| h < num_heads), || {
            format!("kept heads {kept:?} of a q of {num_heads} heads")
        })?;
        ensure(tokens.end * token_len <= q_len, || {
            format!(
                "kept rows copied from tokens {tokens:?} of a q of {} tokens",
                q_len / token_len.max(1)
            )
        })?;
        ensure(first_row + tokens.len() <= self.capacity, || {
            format!(
                "kept rows {first_row}..{} written, of {}",
                first_row + tokens.len(),
                self.capacity
            )
        })
    }

    fn copy_in(
        &mut self,
        q: &CudaSlice<f32>,
        tokens: Range<usize>,
        heads: KeptHeads<'_>,
        first_row: usize,
    ) -> Result<()> {
        self.check_write(q.len(), &tokens, &heads, first_row)?;
        let KeptHeads {
            num_heads,
            kept,
            head_dim,
        } = heads;
        let token_len = num_heads * head_dim;
        let n = tokens.len();
        if n == 0 {
            return Ok(());
        }
        let mut dst = self
            .rows
            .slice_mut(first_row * self.row_len..(first_row + n) * self.row_len);
        if kept.iter().copied().eq(0..num_heads) {
            // Every head in order: the tokens' rows are one contiguous range of q.
            let src = q.slice(tokens.start * token_len..tokens.end * token_len);
            return Ok(self.gpu.stream().memcpy_dtod(&src, &mut dst)?);
        }
        // Some heads: q's rows of one head each, gathered.
        let idx = tokens
            .flat_map(|t| kept.iter().map(move |&h| t * num_heads + h))
            .map(|i| crate::kernels::u32_of("kept q row", i))
            .collect::<Result<Vec<u32>>>()?;
        let idx = self.gpu.step_upload(&idx)?;
        self.gpu.gather_rows(q, &*idx, &mut dst, head_dim)
    }

    /// Adds the copies of a write to a graph step's table instead of making them.
    fn add_to(
        &self,
        table: &KeptRowsTable,
        tokens: Range<usize>,
        heads: KeptHeads<'_>,
        first_row: usize,
    ) -> Result<()> {
        self.check_write(table.q_len, &tokens, &heads, first_row)?;
        let (base, _guard) = self.rows.device_ptr(self.gpu.stream());
        let head_bytes = (heads.head_dim * size_of::<f32>()) as u64;
        let mut entries = table.lock();
        let adding = tokens.len() * heads.kept.len();
        ensure(entries.len() + adding <= table.capacity, || {
            format!(
                "{} kept head rows in a step of {} query head rows",
                entries.len() + adding,
                table.capacity
            )
        })?;
        for (i, t) in tokens.enumerate() {
            let row = base + ((first_row + i) * self.row_len * size_of::<f32>()) as u64;
            for (k, &h) in heads.kept.iter().enumerate() {
                entries.push([
                    row + k as u64 * head_bytes,
                    (t * heads.num_heads + h) as u64,
                ]);
            }
        }
        Ok(())
    }
}

/// The copies into kept rows of one layer of a graph step ([`GraphKey::capturing`]):
/// handed to the capture in place of q, filled by each request's [`CudaKeptRows`], then
/// made by one launch ([`KeptRowsTable::scatter`]) whose table has a row for every
/// query head row of the step, so that the graph replays it with each step's own
/// destinations.
///
/// [`GraphKey::capturing`]: lantern_attn::GraphKey::capturing
pub struct KeptRowsTable {
    /// Values of the step's q `[tokens, num_heads, head_dim]`.
    q_len: usize,
    /// Query head rows of the step: the table's fixed length.
    capacity: usize,
    /// Destination address and source head row of each copy.
    entries: Mutex<Vec<[u64; 2]>>,
}

impl KeptRowsTable {
    /// An empty table for a q of `q_len` values in heads of `head_dim`.
    pub fn new(q_len: usize, head_dim: usize) -> Self {
        let capacity = q_len / head_dim.max(1);
        Self {
            q_len,
            capacity,
            entries: Mutex::new(Vec::with_capacity(capacity)),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<[u64; 2]>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes the copies from `q`, the tensor the table was made for: one launch over the
    /// whole table (unused rows copy nothing), its contents uploaded with the step.
    pub fn scatter(self, gpu: &Gpu, q: &CudaSlice<f32>, head_dim: usize) -> Result<()> {
        ensure(q.len() == self.q_len, || {
            format!(
                "a kept rows table of a q of {} values used with one of {}",
                self.q_len,
                q.len()
            )
        })?;
        let mut entries = self.entries.into_inner().unwrap_or_else(|e| e.into_inner());
        entries.resize(self.capacity, [0, 0]);
        let table = gpu.step_upload(entries.as_flattened())?;
        // SAFETY: every destination was computed by `CudaKeptRows::add_to` inside its
        // rows, checked against their capacity; the rows are freed on this stream, after
        // the copy, and written by nothing else during the step.
        unsafe { gpu.scatter_rows(q, &*table, head_dim) }
    }
}

impl KeptRows for CudaKeptRows {
    fn row_len(&self) -> usize {
        self.row_len
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn write(
        &mut self,
        q: &dyn Any,
        tokens: Range<usize>,
        heads: KeptHeads<'_>,
        first_row: usize,
    ) -> std::result::Result<(), AttnError> {
        if let Some(table) = q.downcast_ref::<KeptRowsTable>() {
            return self
                .add_to(table, tokens, heads, first_row)
                .map_err(attn_error);
        }
        let q: &CudaSlice<f32> = q.downcast_ref().ok_or_else(|| {
            AttnError::Unsupported(
                "query rows kept on the GPU handed over from another device's tensor".into(),
            )
        })?;
        self.copy_in(q, tokens, heads, first_row)
            .map_err(attn_error)
    }

    fn read(&self, rows: Range<usize>) -> std::result::Result<Vec<f32>, AttnError> {
        if rows.end > self.capacity || rows.start > rows.end {
            return Err(AttnError::Unsupported(format!(
                "kept rows {rows:?} read, of {}",
                self.capacity
            )));
        }
        let span = rows.start * self.row_len..rows.end * self.row_len;
        self.gpu
            .download(&self.rows.slice(span))
            .map_err(attn_error)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
