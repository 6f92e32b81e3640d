//! The crate's error type.
//!
//! Everything reachable from a request path returns these as values: a malformed batch
//! (bad lengths, a slot outside the cache, a layer that does not match its cache) must
//! fail that step cleanly instead of taking the whole engine down with a panic.

use crate::layout::KvCacheLayout;

/// Errors from layouts, caches, metadata building and attention backends.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AttnError {
    /// A KV cache layout that cannot describe a tensor (e.g. stride order not a permutation).
    #[error("invalid KV cache layout: {0}")]
    InvalidLayout(String),

    /// Cache geometry with a zero dimension or a size that overflows `usize`.
    #[error("invalid cache geometry: {0}")]
    InvalidGeometry(String),

    /// A slot (`block * block_size + offset`) that is not inside the cache.
    #[error("slot {slot} is out of range (the cache has {num_slots} slots)")]
    SlotOutOfRange { slot: i64, num_slots: usize },

    /// A KV head index not below the cache's number of KV heads.
    #[error("kv head {head} is out of range (the cache has {num_kv_heads} kv heads)")]
    HeadOutOfRange { head: usize, num_kv_heads: usize },

    /// A block id not below the cache's number of blocks.
    #[error("block {block} is out of range (the cache has {num_blocks} blocks)")]
    BlockOutOfRange { block: u64, num_blocks: usize },

    /// A buffer whose length does not match what its shape requires.
    #[error("{what}: expected length {expected}, got {got}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },

    /// A tensor crossing the backend boundary with the wrong shape.
    #[error("{what}: expected shape {expected:?}, got {got:?}")]
    ShapeMismatch {
        what: &'static str,
        expected: Vec<usize>,
        got: Vec<usize>,
    },

    /// A tensor the backend cannot take as it is (element type, device).
    #[error("{what}: {problem}")]
    UnsupportedTensor { what: &'static str, problem: String },

    /// A cache handed to a backend that did not allocate it (another backend's type).
    #[error("the {backend} backend was given a KV cache it did not allocate")]
    ForeignCache { backend: &'static str },

    /// A tensor operation failed (device copy, allocation on a device).
    #[error("tensor operation failed: {0}")]
    Tensor(String),

    /// A layer description that is inconsistent (heads not divisible by kv heads, ...).
    #[error("invalid attention layer spec: {0}")]
    InvalidLayerSpec(String),

    /// Attention metadata that is inconsistent with itself or with the cache.
    #[error("invalid attention metadata: {0}")]
    InvalidMetadata(String),

    /// The layer, metadata and cache disagree (head counts, head size, block size).
    #[error("layer/cache mismatch: {0}")]
    Mismatch(String),

    /// The cache was allocated with a layout other than the one the backend declares.
    #[error("cache layout {got:?} differs from the backend's layout {expected:?}")]
    LayoutMismatch {
        expected: KvCacheLayout,
        got: KvCacheLayout,
    },

    /// A feature the backend does not implement (e.g. non-causal attention).
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// `backend_by_name` was given a name it does not know.
    #[error("unknown attention backend {name:?} (known: {known})")]
    UnknownBackend { name: String, known: String },
}

impl From<candle_core::Error> for AttnError {
    fn from(e: candle_core::Error) -> Self {
        AttnError::Tensor(e.to_string())
    }
}
