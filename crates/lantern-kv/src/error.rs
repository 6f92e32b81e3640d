//! The one error type of this crate.
//!
//! Every public operation that can be handed bad input (an unknown block, a budget that
//! is too small, a block table that is too short) reports it as a [`KvError`] value so a
//! request path never panics; the variants carry the numbers a person needs to see what
//! went wrong without a debugger.

use crate::hash::BlockHash;
use crate::BlockId;

/// Everything that can go wrong while sizing, allocating or addressing the KV cache.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// Not enough free blocks for an all-or-nothing allocation.
    #[error("out of KV cache blocks: {needed} needed, {free} free")]
    OutOfBlocks { needed: usize, free: usize },

    /// The memory budget cannot hold even one block for every layer.
    #[error(
        "KV cache budget of {budget_bytes} bytes is too small: one block for every layer \
         needs at least {min_bytes} bytes"
    )]
    BudgetTooSmall {
        budget_bytes: usize,
        min_bytes: usize,
    },

    /// A configuration was asked for with zero blocks.
    #[error("a KV cache needs at least one block")]
    NoBlocks,

    /// A configuration was asked for with no layers.
    #[error("no layers given: a KV cache needs at least one layer spec")]
    NoLayers,

    /// Layers disagree on the block size, so one block id cannot address them all.
    #[error(
        "all layers must share one block size: layer {layer} has block size {other}, \
         layer 0 has {first}"
    )]
    MixedBlockSizes {
        first: usize,
        other: usize,
        layer: usize,
    },

    /// A spec with a zero (or overflowing) dimension.
    #[error("invalid KV cache spec for layer {layer}: {reason}")]
    InvalidSpec { layer: usize, reason: String },

    /// Sizes multiply past `usize`.
    #[error("KV cache size overflows usize: {what}")]
    SizeOverflow { what: &'static str },

    /// A block id outside the pool.
    #[error("block {block} is out of range: the pool has {num_blocks} blocks")]
    BlockOutOfRange { block: BlockId, num_blocks: usize },

    /// `free` on a block nobody holds (a double free).
    #[error("block {block} is already free (reference count 0): double free")]
    DoubleFree { block: BlockId },

    /// An operation that needs a held block (reference count > 0) got a free one.
    #[error("block {block} is not allocated (reference count 0)")]
    BlockNotAllocated { block: BlockId },

    /// A block already carries a different content hash.
    #[error("block {block} already holds hash {existing}, cannot re-key it to {new}")]
    HashConflict {
        block: BlockId,
        existing: BlockHash,
        new: BlockHash,
    },

    /// A request id the manager does not know.
    #[error("unknown request {0}")]
    UnknownRequest(u64),

    /// A request id that is already in use.
    #[error("request {0} already exists")]
    RequestExists(u64),

    /// A block size of zero in slot arithmetic.
    #[error("block size must be at least 1")]
    ZeroBlockSize,

    /// `start > end` in a token range.
    #[error("invalid token range: start {start} is past end {end}")]
    InvalidRange { start: usize, end: usize },

    /// The block table does not reach a token position that needs a slot.
    #[error(
        "block table too short: position {position} needs block index {block_index} \
         but the table has {table_len} blocks"
    )]
    BlockTableTooShort {
        position: usize,
        block_index: usize,
        table_len: usize,
    },

    /// A slot number that does not fit in `i64`.
    #[error("slot for position {position} overflows i64")]
    SlotOverflow { position: usize },

    /// Text that is not 32 hex digits.
    #[error("invalid block hash {0:?}: expected 32 hex digits")]
    InvalidHashHex(String),

    /// Internal bookkeeping disagrees with itself (found by the invariant checks).
    #[error("KV cache invariant violated: {0}")]
    InvariantViolated(String),
}
