//! CUDA graphs for decode steps: a step's kernels recorded once per [`GraphKey`] and
//! replayed after, so that a decode step costs one graph launch instead of hundreds of
//! kernel launches.
//!
//! The model code does not change. A key's first step runs eagerly while its buffers come
//! from the graph arena (*record*), so that its second step, captured into a graph
//! (*capture*), allocates nothing; later steps run the same host code once more without
//! launching anything (*replay*): every buffer comes out of the arena at the same address
//! as when captured (the arena hands out the lowest free entry of a size, and every entry
//! is free when a step begins), every upload is written to the same offset of one pinned
//! host buffer, and the first download copies that buffer to the device in one piece and
//! launches the graph. Work after the first download runs eagerly.
//!
//! A step whose sequence of buffer and upload sizes differs from its recording (a hash of
//! the sequence is compared before anything is launched) fails without running;
//! the caller runs it eagerly and the key is not graphed again.

use std::collections::{BTreeSet, HashMap};
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{result as driver, CudaGraph, CudaSlice, DeviceRepr};
use lantern_attn::{GraphKey, GraphStats};

use crate::gpu::{Gpu, Kernel};
use crate::launch::Launch;
use crate::pool::Pooled;
use crate::{CudaError, Result};

/// Request counts of the decode steps graphs are recorded for (a step pads to the next).
pub const GRAPH_BATCH_SIZES: &[usize] = &[1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256];

/// What the device does with a step's work.
pub(crate) const EAGER: u8 = 0;
/// Kernels run; buffers and uploads come from the arena and the input buffer.
const RECORD: u8 = 1;
/// As `RECORD`, the stream being captured into a graph.
const CAPTURE: u8 = 2;
/// Nothing is launched until the first download, which launches the graph.
const REPLAY: u8 = 3;

/// Alignment of every arena entry and upload.
const ALIGN: usize = 256;
/// Bytes of a step's uploads (token ids, RoPE tables, attention metadata) a graph step
/// may have: larger steps run eagerly.
const INPUT_BYTES: usize = 16 << 20;
/// Arena memory is taken from the driver in chunks of at least this much.
const CHUNK_BYTES: usize = 32 << 20;

/// Device memory of graph steps' buffers. Entries are never freed while graphs may hold
/// their addresses; which entry a request gets depends only on the step's own sequence.
pub(crate) struct Arena {
    chunks: Vec<CudaSlice<u8>>,
    /// Bytes used in the last chunk.
    chunk_used: usize,
    entries: Vec<(u64, usize)>,
    /// Free entries by size, lowest index first.
    free: HashMap<usize, BTreeSet<usize>>,
    in_use: usize,
}

/// An arena entry lent to a [`Pooled`] buffer.
pub(crate) struct ArenaEntry {
    arena: Arc<Mutex<Arena>>,
    index: usize,
}

impl ArenaEntry {
    pub(crate) fn release(&self) {
        let mut a = lock(&self.arena);
        let bytes = a.entries[self.index].1;
        a.free.entry(bytes).or_default().insert(self.index);
        a.in_use -= 1;
    }
}

impl Arena {
    /// The lowest free entry of `bytes`; a new one only when `grow`.
    fn take(&mut self, gpu: &Gpu, bytes: usize, grow: bool) -> Result<(usize, u64)> {
        if let Some(index) = self.free.get_mut(&bytes).and_then(|f| f.pop_first()) {
            self.in_use += 1;
            return Ok((index, self.entries[index].0));
        }
        if !grow {
            return Err(diverged(format!(
                "a buffer of {bytes} bytes its recording did not ask for"
            )));
        }
        let room = self.chunks.last().map_or(0, |c| c.len() - self.chunk_used);
        if room < bytes {
            let size = bytes.max(CHUNK_BYTES);
            gpu.check_fits(size)?;
            // SAFETY: arena memory is written by kernels before it is read.
            self.chunks.push(unsafe { gpu.stream.alloc::<u8>(size) }?);
            self.chunk_used = 0;
        }
        let chunk = self.chunks.last().expect("a chunk was just ensured");
        let (base, _guard) = cudarc::driver::DevicePtr::device_ptr(chunk, &gpu.stream);
        let ptr = base + self.chunk_used as u64;
        self.chunk_used += bytes;
        self.entries.push((ptr, bytes));
        self.in_use += 1;
        Ok((self.entries.len() - 1, ptr))
    }

    fn bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.len()).sum()
    }
}

/// A step's uploads: written to pinned host memory, copied to one device buffer.
struct Inputs {
    device: CudaSlice<u8>,
    host: *mut u8,
    used: usize,
}

// SAFETY: the host pointer is pinned memory owned by this value alone, used under the
// graph state's mutex.
unsafe impl Send for Inputs {}

impl Drop for Inputs {
    fn drop(&mut self) {
        // SAFETY: allocated by `malloc_host` in `Inputs::new`, freed once.
        let _ = unsafe { driver::free_host(self.host as *mut c_void) };
    }
}

impl Inputs {
    fn new(gpu: &Gpu) -> Result<Self> {
        gpu.ctx.bind_to_thread()?;
        // SAFETY: a plain pinned allocation, freed in `drop`.
        let host = unsafe { driver::malloc_host(INPUT_BYTES, 0) }? as *mut u8;
        // SAFETY: every byte a kernel reads is copied in first.
        let device = match unsafe { gpu.stream.alloc::<u8>(INPUT_BYTES) } {
            Ok(d) => d,
            Err(e) => {
                // SAFETY: allocated just above.
                let _ = unsafe { driver::free_host(host as *mut c_void) };
                return Err(e.into());
            }
        };
        Ok(Self {
            device,
            host,
            used: 0,
        })
    }

    /// The host bytes written so far.
    fn written(&self) -> &[u8] {
        // SAFETY: `host` holds INPUT_BYTES bytes; `used` never exceeds that.
        unsafe { std::slice::from_raw_parts(self.host, self.used) }
    }
}

/// A recorded graph (cudarc's handle is not `Send`: it is used under the state's mutex).
struct Graph {
    exec: CudaGraph,
    /// The hash of the step sequence it was captured from.
    sequence: u64,
}

// SAFETY: used only under the graph state's mutex, on the stream it was captured on.
unsafe impl Send for Graph {}

enum KeyState {
    Recorded,
    Captured(Graph),
    Failed,
}

/// The step in progress.
struct Current {
    key: GraphKey,
    flushed: bool,
    /// FNV-1a over the sizes of the step's buffers and uploads, in order.
    sequence: u64,
}

/// Graphs of one device (the `Gpu`'s `graphs` field).
pub(crate) struct GraphState {
    arena: Arc<Mutex<Arena>>,
    inputs: Option<Inputs>,
    keys: HashMap<GraphKey, KeyState>,
    current: Option<Current>,
    stats: GraphStats,
}

impl GraphState {
    pub(crate) fn new() -> Self {
        Self {
            arena: Arc::new(Mutex::new(Arena {
                chunks: Vec::new(),
                chunk_used: 0,
                entries: Vec::new(),
                free: HashMap::new(),
                in_use: 0,
            })),
            inputs: None,
            keys: HashMap::new(),
            current: None,
            stats: GraphStats::default(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn diverged(what: String) -> CudaError {
    CudaError::Graph(format!("the step diverged from its recording: {what}"))
}

const FNV_PRIME: u64 = 0x100_0000_01b3;

fn mix(hash: &mut u64, tag: u64, value: u64) {
    for v in [tag, value] {
        *hash = (*hash ^ v).wrapping_mul(FNV_PRIME);
    }
}

impl Gpu {
    fn mode(&self) -> u8 {
        self.graph_mode.load(Ordering::Acquire)
    }

    fn set_mode(&self, mode: u8) {
        self.graph_mode.store(mode, Ordering::Release);
    }

    fn note(state: &mut GraphState, tag: u64, value: u64) {
        if let Some(c) = state.current.as_mut() {
            mix(&mut c.sequence, tag, value);
        }
    }

    /// Whether kernel launches are skipped (a replay before its graph is launched).
    pub(crate) fn skips_launches(&self) -> bool {
        self.mode() == REPLAY
    }

    /// Whether a graph step is recording or replaying (buffers come from the arena).
    pub(crate) fn in_graph_step(&self) -> bool {
        self.mode() != EAGER
    }

    /// Whether a graph step of capturing requests is in progress
    /// ([`GraphKey::capturing`]): every layer copies their kept rows in one launch.
    pub(crate) fn in_capturing_graph_step(&self) -> bool {
        self.in_graph_step()
            && lock(&self.graphs)
                .current
                .as_ref()
                .is_some_and(|c| c.key.capturing)
    }

    /// A launch builder for `f`, or `None` while replaying (nothing is launched then).
    pub(crate) fn launcher<'a>(&'a self, f: Kernel<'a>) -> Result<Option<Launch<'a>>> {
        // Kernels are not part of the sequence hash: a replay returns at a wrapper's first
        // launch, so later launches of the same wrapper are never reached. Which kernels a
        // step runs follows from its buffers' sizes, which are hashed.
        Ok((self.mode() != REPLAY).then(|| Launch::new(self, f)))
    }

    /// A buffer of `n` elements from the arena during a graph step; `None` otherwise.
    pub(crate) fn graph_buffer<T: DeviceRepr>(&self, n: usize) -> Result<Option<Pooled<T>>> {
        let mode = self.mode();
        if mode == EAGER {
            return Ok(None);
        }
        let bytes = n
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| CudaError::Shape(format!("a buffer of {n} elements overflows")))?
            .max(1)
            .next_multiple_of(ALIGN);
        let mut state = lock(&self.graphs);
        Self::note(&mut state, 2, bytes as u64);
        let arena = Arc::clone(&state.arena);
        let (index, ptr) = lock(&arena).take(self, bytes, mode == RECORD)?;
        // SAFETY: `ptr` is `bytes` >= n * size_of::<T>() bytes of arena memory, aligned
        // to 256; the view never frees it (its `Pooled` leaks it).
        let slice = unsafe { self.stream.upgrade_device_ptr::<T>(ptr, n) };
        Ok(Some(Pooled::arena(slice, ArenaEntry { arena, index })))
    }

    /// A buffer of `n` elements for a step's output: from the arena during a graph step,
    /// else a new one.
    pub(crate) fn step_output<T: DeviceRepr>(&self, n: usize) -> Result<Pooled<T>> {
        match self.graph_buffer(n)? {
            Some(b) => Ok(b),
            None => Ok(Pooled::own(self.output(n)?)),
        }
    }

    /// `data` on the device for this step: written into the graph step's input buffer
    /// during a graph step (copied when recording, with the graph's launch otherwise),
    /// else a new buffer.
    pub(crate) fn step_upload<T: DeviceRepr>(&self, data: &[T]) -> Result<Pooled<T>> {
        let mode = self.mode();
        if mode == EAGER {
            return Ok(Pooled::own(self.upload(data)?));
        }
        let bytes = std::mem::size_of_val(data);
        let mut state = lock(&self.graphs);
        Self::note(&mut state, 3, bytes as u64);
        let inputs = state
            .inputs
            .as_mut()
            .ok_or_else(|| CudaError::Graph("no input buffer in a graph step".into()))?;
        let offset = inputs.used;
        let end = offset + bytes.max(1).next_multiple_of(ALIGN);
        if end > INPUT_BYTES {
            return Err(CudaError::Graph(format!(
                "the step's inputs exceed the graph input buffer's {INPUT_BYTES} bytes"
            )));
        }
        // SAFETY: `offset + bytes <= INPUT_BYTES`, the host buffer's size; plain bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr() as *const u8,
                inputs.host.add(offset),
                bytes,
            )
        };
        inputs.used = end;
        let (base, _guard) = cudarc::driver::DevicePtr::device_ptr(&inputs.device, &self.stream);
        let ptr = base + offset as u64;
        if mode == RECORD {
            // SAFETY: the pinned bytes stay as written until the step's end, which waits
            // for the stream; the destination holds them.
            unsafe {
                driver::memcpy_htod_async(
                    ptr,
                    &inputs.written()[offset..offset + bytes],
                    self.stream.cu_stream(),
                )
            }?;
        }
        // SAFETY: `ptr` holds `data.len()` elements of T (aligned to 256) inside the input
        // buffer, which outlives every graph step; the view never frees it.
        let slice = unsafe { self.stream.upgrade_device_ptr::<T>(ptr, data.len()) };
        Ok(Pooled::borrowed(slice))
    }

    /// Starts a decode step of graph `key`: recorded the first time, captured the second,
    /// replayed after. `false`: the key is not graphed (it failed before); run eagerly.
    pub fn begin_graph_step(&self, key: GraphKey) -> Result<bool> {
        let mut state = lock(&self.graphs);
        if state.current.is_some() || self.mode() != EAGER {
            return Err(CudaError::Graph(
                "a graph step is already in progress".into(),
            ));
        }
        let mode = match state.keys.get(&key) {
            Some(KeyState::Failed) => return Ok(false),
            None => RECORD,
            Some(KeyState::Recorded) => CAPTURE,
            Some(KeyState::Captured(_)) => REPLAY,
        };
        if lock(&state.arena).in_use != 0 {
            return Err(CudaError::Graph(
                "graph arena buffers outlived their step".into(),
            ));
        }
        // The previous step's input copy must be done before its bytes are overwritten.
        self.stream.synchronize()?;
        if state.inputs.is_none() {
            state.inputs = Some(Inputs::new(self)?);
        }
        if let Some(inputs) = state.inputs.as_mut() {
            inputs.used = 0;
        }
        if mode == CAPTURE {
            self.stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
        }
        state.current = Some(Current {
            key,
            flushed: false,
            sequence: 0xcbf2_9ce4_8422_2325,
        });
        self.set_mode(mode);
        Ok(true)
    }

    /// Before the host reads results: a captured step's graph is instantiated, and a
    /// captured or replayed step's inputs are copied and its graph launched. Work after
    /// this runs eagerly.
    pub(crate) fn flush_graph(&self) -> Result<()> {
        let mode = self.mode();
        if mode == EAGER {
            return Ok(());
        }
        let mut state = lock(&self.graphs);
        let Some(current) = state.current.as_mut() else {
            self.set_mode(EAGER);
            return Ok(());
        };
        current.flushed = true;
        let (key, sequence) = (current.key, current.sequence);
        self.set_mode(EAGER);
        match mode {
            RECORD => {
                state.keys.insert(key, KeyState::Recorded);
                state.stats.recorded += 1;
            }
            CAPTURE => {
                let exec = self
                    .stream
                    .end_capture(CUgraphInstantiate_flags(0))?
                    .ok_or_else(|| CudaError::Graph("the capture made no graph".into()))?;
                self.launch_graph(&state, &exec)?;
                state
                    .keys
                    .insert(key, KeyState::Captured(Graph { exec, sequence }));
                state.stats.captured += 1;
            }
            _ => {
                let Some(KeyState::Captured(graph)) = state.keys.get(&key) else {
                    return Err(CudaError::Graph("replay of a graph that is gone".into()));
                };
                if graph.sequence != sequence {
                    return Err(diverged(String::from("its buffers or uploads differ")));
                }
                self.launch_graph(&state, &graph.exec)?;
                state.stats.replayed += 1;
            }
        }
        Ok(())
    }

    fn launch_graph(&self, state: &GraphState, exec: &CudaGraph) -> Result<()> {
        let inputs = state
            .inputs
            .as_ref()
            .ok_or_else(|| CudaError::Graph("no input buffer".into()))?;
        if inputs.used > 0 {
            let (base, _guard) =
                cudarc::driver::DevicePtr::device_ptr(&inputs.device, &self.stream);
            // SAFETY: the pinned bytes stay unchanged until the next step begins, which
            // waits for the stream first.
            unsafe { driver::memcpy_htod_async(base, inputs.written(), self.stream.cu_stream()) }?;
        }
        exec.launch()?;
        Ok(())
    }

    /// Ends the step begun by [`Gpu::begin_graph_step`]. `ok`: the step succeeded (a step
    /// that read nothing back is flushed now). A failed step's capture is dropped and its
    /// key not graphed again.
    pub fn end_graph_step(&self, ok: bool) -> Result<()> {
        let flushed = lock(&self.graphs)
            .current
            .as_ref()
            .is_none_or(|c| c.flushed);
        let result = if ok && !flushed {
            self.flush_graph()
        } else {
            Ok(())
        };
        let failed = !ok || result.is_err();
        if self.mode() == CAPTURE {
            // A capture that failed: end it to give the stream back, and drop the graph.
            let _ = self.stream.end_capture(CUgraphInstantiate_flags(0));
        }
        self.set_mode(EAGER);
        let mut state = lock(&self.graphs);
        if let Some(current) = state.current.take() {
            if failed {
                state.keys.insert(current.key, KeyState::Failed);
                state.stats.failed += 1;
            }
        }
        result
    }

    /// What graphs did so far.
    pub fn graph_stats(&self) -> GraphStats {
        let state = lock(&self.graphs);
        let arena_bytes = lock(&state.arena).bytes();
        GraphStats {
            arena_bytes,
            ..state.stats
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_hash_tells_orders_apart() {
        let hash = |ops: &[(u64, u64)]| {
            let mut h = 0xcbf2_9ce4_8422_2325;
            for &(t, v) in ops {
                mix(&mut h, t, v);
            }
            h
        };
        assert_eq!(hash(&[(2, 256), (3, 512)]), hash(&[(2, 256), (3, 512)]));
        assert_ne!(hash(&[(2, 256), (3, 512)]), hash(&[(3, 512), (2, 256)]));
        assert_ne!(hash(&[(2, 256)]), hash(&[(2, 512)]));
    }

    #[test]
    fn batch_sizes_ascend() {
        assert!(GRAPH_BATCH_SIZES.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(GRAPH_BATCH_SIZES[0], 1);
    }
}
