//! What one layer's KV cache looks like: its attention kind, its page geometry and how
//! many blocks a sequence needs.
//!
//! A spec is plain data so that layers with an equal spec can be grouped (see
//! [`crate::config`]) and share one block table and one attention-metadata build per step.

use crate::error::KvError;
use crate::KvDtype;

/// How far back a query token can see, which decides how many blocks a sequence must
/// keep and which prompt tokens need no cache slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Every query sees every earlier key.
    FullAttention,
    /// A query sees at most `window` keys, itself included (vLLM's semantics): the query
    /// at position `p` sees keys `p + 1 - window ..= p`.
    SlidingWindow { window: usize },
    /// Positions are cut into chunks of `chunk_size`; a query sees only the keys of its
    /// own chunk up to itself (Llama 4's local attention).
    ChunkedLocal { chunk_size: usize },
}

/// The KV cache geometry of one layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvCacheSpec {
    pub kind: AttentionKind,
    /// Tokens per block (page).
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_size: usize,
    pub dtype: KvDtype,
}

impl KvCacheSpec {
    /// A full-attention layer.
    pub fn full_attention(
        block_size: usize,
        num_kv_heads: usize,
        head_size: usize,
        dtype: KvDtype,
    ) -> Self {
        Self {
            kind: AttentionKind::FullAttention,
            block_size,
            num_kv_heads,
            head_size,
            dtype,
        }
    }

    /// A sliding-window layer whose queries see at most `window` keys, themselves included.
    pub fn sliding_window(
        window: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_size: usize,
        dtype: KvDtype,
    ) -> Self {
        Self {
            kind: AttentionKind::SlidingWindow { window },
            ..Self::full_attention(block_size, num_kv_heads, head_size, dtype)
        }
    }

    /// A chunked-local layer with chunks of `chunk_size` positions.
    pub fn chunked_local(
        chunk_size: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_size: usize,
        dtype: KvDtype,
    ) -> Self {
        Self {
            kind: AttentionKind::ChunkedLocal { chunk_size },
            ..Self::full_attention(block_size, num_kv_heads, head_size, dtype)
        }
    }

    /// Checks that every dimension is non-zero and the page size fits in `usize`.
    ///
    /// `layer` only labels the error. The fields are public, so arithmetic on an
    /// unchecked spec must not panic either: the methods below saturate instead.
    pub fn validate(&self, layer: usize) -> Result<(), KvError> {
        let bad = |reason: &str| {
            Err(KvError::InvalidSpec {
                layer,
                reason: reason.to_string(),
            })
        };
        if self.block_size == 0 {
            return bad("block_size is 0");
        }
        if self.num_kv_heads == 0 {
            return bad("num_kv_heads is 0");
        }
        if self.head_size == 0 {
            return bad("head_size is 0");
        }
        match self.kind {
            AttentionKind::SlidingWindow { window: 0 } => return bad("sliding window is 0"),
            AttentionKind::ChunkedLocal { chunk_size: 0 } => return bad("chunk size is 0"),
            _ => {}
        }
        if self.checked_page_size_bytes().is_none() {
            return bad("page size overflows usize");
        }
        Ok(())
    }

    /// Bytes of one block of this layer, K and V together:
    /// `2 * block_size * num_kv_heads * head_size * dtype bytes`, or `None` on overflow.
    pub fn checked_page_size_bytes(&self) -> Option<usize> {
        2usize
            .checked_mul(self.block_size)?
            .checked_mul(self.num_kv_heads)?
            .checked_mul(self.head_size)?
            .checked_mul(self.dtype.size_bytes())
    }

    /// Bytes of one block of this layer, K and V together (saturating; see
    /// [`Self::checked_page_size_bytes`]).
    pub fn page_size_bytes(&self) -> usize {
        self.checked_page_size_bytes().unwrap_or(usize::MAX)
    }

    /// Blocks that hold `num_tokens` tokens: `ceil(num_tokens / block_size)`.
    ///
    /// With a zero block size (an invalid spec) any non-zero count needs `usize::MAX`
    /// blocks, so it can never be allocated instead of dividing by zero.
    pub fn blocks_for_tokens(&self, num_tokens: usize) -> usize {
        if num_tokens == 0 {
            0
        } else if self.block_size == 0 {
            usize::MAX
        } else {
            num_tokens.div_ceil(self.block_size)
        }
    }

    /// The most keys one query token can attend to, or `None` when unbounded.
    pub fn max_visible_keys(&self) -> Option<usize> {
        match self.kind {
            AttentionKind::FullAttention => None,
            AttentionKind::SlidingWindow { window } => Some(window),
            AttentionKind::ChunkedLocal { chunk_size } => Some(chunk_size),
        }
    }

    /// Blocks a sequence of `num_tokens` tokens needs at most for its next decode step
    /// once out-of-reach blocks are dropped.
    ///
    /// Full attention needs them all. A window of `w` keys (the query included) reaches
    /// `w - 1` tokens back plus the current token; at worst those start at the last slot
    /// of a block, so they span `ceil((w - 1) / block_size) + 1` blocks. A chunk of `c`
    /// positions spans at most the same number with `w = c`. Either bound is capped by
    /// the blocks the sequence has at all.
    pub fn max_blocks_needed(&self, num_tokens: usize) -> usize {
        let all = self.blocks_for_tokens(num_tokens);
        match self.max_visible_keys() {
            None => all,
            Some(_) if self.block_size == 0 => all,
            Some(keys) => {
                let span = keys.saturating_sub(1).div_ceil(self.block_size) + 1;
                all.min(span)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full(block_size: usize) -> KvCacheSpec {
        KvCacheSpec::full_attention(block_size, 8, 128, KvDtype::F16)
    }

    #[test]
    fn page_size_counts_k_and_v() {
        // 2 (K,V) * 16 tokens * 8 heads * 128 dims * 2 bytes
        assert_eq!(full(16).page_size_bytes(), 2 * 16 * 8 * 128 * 2);
        let f32_spec = KvCacheSpec::full_attention(4, 2, 8, KvDtype::F32);
        assert_eq!(f32_spec.page_size_bytes(), 2 * 4 * 2 * 8 * 4);
    }

    #[test]
    fn blocks_for_tokens_rounds_up() {
        let s = full(4);
        assert_eq!(s.blocks_for_tokens(0), 0);
        assert_eq!(s.blocks_for_tokens(1), 1);
        assert_eq!(s.blocks_for_tokens(4), 1);
        assert_eq!(s.blocks_for_tokens(5), 2);
        assert_eq!(s.blocks_for_tokens(10), 3);
    }

    #[test]
    fn sliding_window_bounds_blocks() {
        // window 8, block 4: 7 tokens back span ceil(7/4) = 2 blocks, plus the current.
        let s = KvCacheSpec::sliding_window(8, 4, 1, 1, KvDtype::F32);
        assert_eq!(s.max_blocks_needed(1), 1);
        assert_eq!(s.max_blocks_needed(8), 2);
        assert_eq!(s.max_blocks_needed(9), 3);
        assert_eq!(s.max_blocks_needed(1000), 3);
        // window 1: only the query itself, one block.
        let one = KvCacheSpec::sliding_window(1, 4, 1, 1, KvDtype::F32);
        assert_eq!(one.max_blocks_needed(100), 1);
        // window 5, block 4: 4 back -> 1 block, plus the current.
        let five = KvCacheSpec::sliding_window(5, 4, 1, 1, KvDtype::F32);
        assert_eq!(five.max_blocks_needed(100), 2);
    }

    #[test]
    fn full_attention_needs_every_block() {
        assert_eq!(full(4).max_blocks_needed(1000), 250);
    }

    #[test]
    fn chunked_local_bounds_blocks() {
        let s = KvCacheSpec::chunked_local(8, 4, 1, 1, KvDtype::F32);
        assert_eq!(s.max_blocks_needed(3), 1);
        assert_eq!(s.max_blocks_needed(100), 3);
    }

    #[test]
    fn validate_rejects_zero_dimensions() {
        assert!(full(16).validate(0).is_ok());
        assert!(matches!(
            full(0).validate(3),
            Err(KvError::InvalidSpec { layer: 3, .. })
        ));
        let w0 = KvCacheSpec::sliding_window(0, 16, 1, 1, KvDtype::F32);
        assert!(w0.validate(0).is_err());
        let c0 = KvCacheSpec::chunked_local(0, 16, 1, 1, KvDtype::F32);
        assert!(c0.validate(0).is_err());
        let huge = KvCacheSpec::full_attention(usize::MAX, 2, 2, KvDtype::F32);
        assert!(huge.validate(0).is_err());
        assert_eq!(huge.page_size_bytes(), usize::MAX);
    }

    #[test]
    fn zero_block_size_never_panics() {
        let s = full(0);
        assert_eq!(s.blocks_for_tokens(0), 0);
        assert_eq!(s.blocks_for_tokens(5), usize::MAX);
        let w = KvCacheSpec::sliding_window(8, 0, 1, 1, KvDtype::F32);
        assert_eq!(w.max_blocks_needed(5), usize::MAX);
    }
}
