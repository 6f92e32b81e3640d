//! Which of a sequence's blocks a KV cache group still needs: the per-group place where
//! sliding-window and chunked-local groups will give back blocks no query can reach.
//!
//! Only the arithmetic lives here for now. The manager keeps every block of every group
//! until the request is freed, because dropping a block from the front of a block table
//! needs a placeholder ("null block") that the slot mapping and every attention backend
//! agree never to read, and capture reads keys back after the request ends. When that
//! lands, the manager asks [`BlockRetention::blocks_out_of_reach`] after each step and
//! frees that many leading blocks of the group.

use crate::spec::{AttentionKind, KvCacheSpec};

/// A group's rule for which leading blocks can be dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockRetention {
    /// Full attention: every block stays reachable.
    KeepAll,
    /// A query sees at most `window` keys, itself included.
    Window { window: usize },
    /// A query sees only keys of its own chunk of `chunk_size` positions.
    Chunk { chunk_size: usize },
}

impl BlockRetention {
    pub fn for_spec(spec: &KvCacheSpec) -> Self {
        match spec.kind {
            AttentionKind::FullAttention => Self::KeepAll,
            AttentionKind::SlidingWindow { window } => Self::Window { window },
            AttentionKind::ChunkedLocal { chunk_size } => Self::Chunk { chunk_size },
        }
    }

    /// First key position the query at `pos` can see.
    pub fn first_visible_key(&self, pos: usize) -> usize {
        match *self {
            Self::KeepAll => 0,
            Self::Window { window } => (pos + 1).saturating_sub(window),
            Self::Chunk { chunk_size: 0 } => pos,
            Self::Chunk { chunk_size } => pos - pos % chunk_size,
        }
    }

    /// Leading blocks that no future query can see once `num_computed_tokens` tokens are
    /// in the cache: every position in them is below the first key visible to the next
    /// query (at position `num_computed_tokens`). Later queries only see further right.
    pub fn blocks_out_of_reach(&self, num_computed_tokens: usize, block_size: usize) -> usize {
        if block_size == 0 {
            return 0;
        }
        self.first_visible_key(num_computed_tokens) / block_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvDtype;

    #[test]
    fn full_attention_keeps_everything() {
        let r = BlockRetention::for_spec(&KvCacheSpec::full_attention(4, 1, 1, KvDtype::F32));
        assert_eq!(r, BlockRetention::KeepAll);
        assert_eq!(r.blocks_out_of_reach(1000, 4), 0);
    }

    #[test]
    fn window_drops_blocks_wholly_behind_it() {
        // window 8, block 4. Next query at 10 sees keys 3..=10: block 0 holds 0..=3,
        // key 3 is still visible, so nothing is out of reach.
        let r = BlockRetention::Window { window: 8 };
        assert_eq!(r.first_visible_key(10), 3);
        assert_eq!(r.blocks_out_of_reach(10, 4), 0);
        // Next query at 11 sees 4..=11: block 0 is out of reach.
        assert_eq!(r.blocks_out_of_reach(11, 4), 1);
        assert_eq!(r.blocks_out_of_reach(5, 4), 0);
    }

    #[test]
    fn chunk_drops_blocks_of_earlier_chunks() {
        let r = BlockRetention::Chunk { chunk_size: 8 };
        assert_eq!(r.first_visible_key(7), 0);
        assert_eq!(r.first_visible_key(8), 8);
        assert_eq!(r.blocks_out_of_reach(8, 4), 2);
        assert_eq!(r.blocks_out_of_reach(13, 4), 2);
        assert_eq!(
            BlockRetention::Chunk { chunk_size: 0 }.blocks_out_of_reach(3, 0),
            0
        );
    }
}
