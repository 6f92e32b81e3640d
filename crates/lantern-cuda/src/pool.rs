//! Device buffers kept for reuse. A step asks for the same few sizes layer after layer;
//! taking them from a free list instead of the driver's allocator saves an allocation
//! and a free per operation on the step's path. Everything runs on the one stream, so a
//! buffer handed back while kernels that use it are still queued is safe to reuse: the
//! next user's work is queued after theirs. During a graph step (see `graph.rs`) buffers
//! come from the graph arena instead, whose addresses the recorded graphs hold.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaSlice, DeviceRepr};

use crate::gpu::Gpu;
use crate::graph::ArenaEntry;
use crate::Result;

/// Bytes the free lists may hold before handed-back buffers are freed instead.
const RETAINED_BYTES: usize = 512 << 20;

pub struct Pool<T: DeviceRepr> {
    gpu: Arc<Gpu>,
    free: Mutex<Free<T>>,
}

struct Free<T> {
    by_len: HashMap<usize, Vec<CudaSlice<T>>>,
    bytes: usize,
}

/// A device buffer of a step, given back to where it came from when dropped.
pub struct Pooled<T: DeviceRepr> {
    /// Taken only by `drop`.
    slice: ManuallyDrop<CudaSlice<T>>,
    home: Home<T>,
}

/// Where a [`Pooled`] buffer goes when dropped.
enum Home<T: DeviceRepr> {
    /// Back to a pool's free list.
    Pool(Arc<Pool<T>>),
    /// Freed: a buffer of its own.
    Own,
    /// Marked free in the graph arena, whose memory it is a view of.
    Arena(ArenaEntry),
    /// Nowhere: a view of memory someone else owns (the graph step's inputs).
    Borrowed,
}

impl<T: DeviceRepr> Pool<T> {
    pub fn new(gpu: Arc<Gpu>) -> Arc<Self> {
        Arc::new(Self {
            gpu,
            free: Mutex::new(Free {
                by_len: HashMap::new(),
                bytes: 0,
            }),
        })
    }

    /// A buffer of `n` elements with unspecified contents, for an output a kernel
    /// overwrites entirely.
    pub fn output(self: &Arc<Self>, n: usize) -> Result<Pooled<T>> {
        if let Some(b) = self.gpu.graph_buffer(n)? {
            return Ok(b);
        }
        let reused = {
            let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
            let slice = free.by_len.get_mut(&n).and_then(Vec::pop);
            if slice.is_some() {
                free.bytes -= n * std::mem::size_of::<T>();
            }
            slice
        };
        let slice = match reused {
            Some(s) => s,
            None => self.gpu.output(n)?,
        };
        Ok(self.adopt(slice))
    }

    /// `slice` as a pooled buffer: it joins the free lists when dropped.
    pub fn adopt(self: &Arc<Self>, slice: CudaSlice<T>) -> Pooled<T> {
        Pooled {
            slice: ManuallyDrop::new(slice),
            home: Home::Pool(Arc::clone(self)),
        }
    }

    fn hand_back(&self, slice: CudaSlice<T>) {
        let bytes = slice.len() * std::mem::size_of::<T>();
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.bytes + bytes <= RETAINED_BYTES {
            free.bytes += bytes;
            free.by_len.entry(slice.len()).or_default().push(slice);
        }
    }
}

impl<T: DeviceRepr> Pooled<T> {
    /// A buffer of its own, freed when dropped.
    pub fn own(slice: CudaSlice<T>) -> Self {
        Self {
            slice: ManuallyDrop::new(slice),
            home: Home::Own,
        }
    }

    /// A view of arena memory, marked free in the arena when dropped.
    pub(crate) fn arena(slice: CudaSlice<T>, entry: ArenaEntry) -> Self {
        Self {
            slice: ManuallyDrop::new(slice),
            home: Home::Arena(entry),
        }
    }

    /// A view of memory owned elsewhere, left alone when dropped.
    pub(crate) fn borrowed(slice: CudaSlice<T>) -> Self {
        Self {
            slice: ManuallyDrop::new(slice),
            home: Home::Borrowed,
        }
    }
}

impl<T: DeviceRepr> Deref for Pooled<T> {
    type Target = CudaSlice<T>;

    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T: DeviceRepr> DerefMut for Pooled<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T: DeviceRepr> Drop for Pooled<T> {
    fn drop(&mut self) {
        // SAFETY: the slice is taken once, here, and never used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        match &self.home {
            Home::Pool(pool) => pool.hand_back(slice),
            Home::Own => drop(slice),
            Home::Arena(entry) => {
                // A view: the arena owns the memory.
                slice.leak();
                entry.release();
            }
            Home::Borrowed => {
                slice.leak();
            }
        }
    }
}
