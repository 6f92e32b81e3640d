//! Paged KV cache management for lantern.
//!
//! This crate owns the bookkeeping of the paged KV cache — which blocks belong to which
//! request, how many are free, where each token's key and value live — and never the
//! values themselves (those live in `lantern-attn`'s cache tensors).
//!
//! - [`spec`] — one layer's cache geometry and attention kind.
//! - [`config`] — groups of layers with one spec, the raw tensors, sizing from a budget.
//! - [`hash`] — the stable, documented prefix-cache key of a block.
//! - [`block_pool`] — reference counts, the LRU free queue, cached keys and eviction.
//! - [`manager`] — per-request block tables per group, prefix hits, forks.
//! - [`policy`] — per-group rule for blocks a window or chunk can no longer reach.
//! - [`slot`] — pure slot arithmetic (`slot = block * block_size + offset`).
//! - [`tokens`] — a request's shared prompt and own output, read as one sequence.
//! - [`error`] — [`KvError`].
//!
//! One request's life, as the scheduler and model runner drive it:
//!
//! ```
//! use lantern_kv::{compute_slot_mapping, KvCacheConfig, KvCacheManager, KvCacheSpec, KvDtype};
//!
//! let layers = vec![KvCacheSpec::full_attention(4, 2, 64, KvDtype::F16); 2];
//! let config = KvCacheConfig::from_memory_budget(&layers, 1 << 20)?;
//! let mut kv = KvCacheManager::new(&config, true);
//!
//! let prompt: Vec<u32> = (0..10).collect();
//! let cached = kv.get_computed_blocks(7, &prompt, b""); // tokens served from cache
//! kv.allocate_slots(7, prompt.len())?;
//! let slots = compute_slot_mapping(kv.block_table(7, 0), 4, cached, prompt.len(), None)?;
//! assert_eq!(slots.len(), prompt.len() - cached);
//! // ... run the model, writing K/V to `slots` ...
//! kv.cache_blocks(7, &prompt, b"")?;
//! kv.free(7);
//! assert_eq!(kv.num_free_blocks(), config.num_blocks);
//! # Ok::<(), lantern_kv::KvError>(())
//! ```

pub mod block_pool;
pub mod config;
pub mod error;
pub mod hash;
pub mod manager;
pub mod policy;
pub mod slot;
pub mod spec;
pub mod tokens;

pub use block_pool::{BlockPool, CacheKey, KvCacheEvent, PrefixCacheStats};
pub use config::{KvCacheConfig, KvCacheGroup, KvCacheTensor};
pub use error::KvError;
pub use hash::{hash_block, hash_request_blocks, BlockHash, ROOT_PARENT_HASH};
pub use manager::{ForkOutcome, KvCacheManager, RequestId};
pub use policy::BlockRetention;
pub use slot::{compute_slot_mapping, extend_slot_mapping, slot_for_position};
pub use spec::{AttentionKind, KvCacheSpec};
pub use tokens::TokenSeq;

/// Index of one block (page) of the KV cache.
pub type BlockId = u32;

/// Block-table entry of a block given back because no query can reach it any more
/// (sliding-window and chunked-local groups). It keeps the table's positions aligned
/// and is never read: attention reads only keys its layer's mask makes visible, and
/// those never lie in a released block.
pub const NULL_BLOCK: BlockId = BlockId::MAX;

/// Slot id given to a token whose K/V must not be written (e.g. prompt tokens that
/// fall outside a sliding window). Backends skip these slots when writing the cache.
pub const PAD_SLOT_ID: i64 = -1;

/// Element type of the KV cache tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F32,
    F16,
    BF16,
}

impl KvDtype {
    /// Bytes per element.
    pub fn size_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::BF16 => 2,
        }
    }
}
