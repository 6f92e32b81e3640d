//! Prompt logprobs kept per prefix-cache block, so that a request asking for them can
//! still take a prefix-cache hit.
//!
//! A prompt logprob needs the logits row of the position before its token, which a hit
//! skips computing: without these records every such request computes its whole prompt.
//! That is the common case of evaluation (lm-evaluation-harness scores each choice of a
//! question as the context's tokens and the choice's, echoed with their logprobs, after
//! the same few-shot prefix). A block's record holds the logprobs of the block's own
//! tokens (each given every token before it), keyed by the block's chained hash, which
//! names the whole prefix: so a record is what computing that prefix again would give
//! (the forward is batch and chunk invariant). The first block's first token has none.
//!
//! A block is recorded with one number of alternatives: a request asking for as many or
//! fewer takes the record (alternatives are ordered by logit, ties to the lower id, so
//! the first `k` of them are the `k` computed), one asking for more computes its prompt
//! and its records replace the old. Oldest dropped first past a byte budget.

use crate::sampling::PromptTokenLogprob;
use lantern_kv::{hash_request_blocks, BlockHash};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Bytes the records may take by default.
pub const DEFAULT_SCORED_PREFIX_BYTES: usize = 64 << 20;

struct BlockScores {
    /// Alternatives per token.
    top: usize,
    /// One per token of the block (the first block: from its second token on).
    rows: Arc<[PromptTokenLogprob]>,
    bytes: usize,
}

/// The records, by block hash.
pub struct ScoredBlocks {
    block_size: usize,
    max_bytes: usize,
    bytes: usize,
    blocks: HashMap<BlockHash, BlockScores>,
    /// Insertion order, for dropping the oldest.
    order: VecDeque<BlockHash>,
}

fn row_bytes(row: &PromptTokenLogprob) -> usize {
    std::mem::size_of::<PromptTokenLogprob>() + row.top.len() * std::mem::size_of::<(u32, f32)>()
}

impl ScoredBlocks {
    pub fn new(block_size: usize, max_bytes: usize) -> Self {
        Self {
            block_size,
            max_bytes,
            bytes: 0,
            blocks: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// The prompt logprobs with `top` alternatives the records hold for `prompt`'s
    /// leading full blocks: entry `i` for token `i + 1`, through the last block with a
    /// record of at least `top` alternatives (empty when the first has none). `salt`:
    /// the request's cache keys ([`crate::request::Request::cache_keys`]).
    pub fn known(&self, prompt: &[u32], top: usize, salt: &[u8]) -> Vec<PromptTokenLogprob> {
        if self.blocks.is_empty() || self.block_size == 0 {
            return Vec::new();
        }
        let mut known = Vec::new();
        for hash in hash_request_blocks(prompt, self.block_size, salt) {
            match self.blocks.get(&hash) {
                Some(block) if block.top >= top => {
                    known.extend(block.rows.iter().map(|row| PromptTokenLogprob {
                        logprob: row.logprob,
                        rank: row.rank,
                        top: row.top[..top.min(row.top.len())].to_vec(),
                    }))
                }
                _ => break,
            }
        }
        known
    }

    /// Records the blocks of `prompt` whose tokens all have their logprob in `rows`
    /// (entry `i` for token `i + 1`, with `top` alternatives each) and are not recorded
    /// with `top` or more yet.
    pub fn record(&mut self, prompt: &[u32], rows: &[PromptTokenLogprob], top: usize, salt: &[u8]) {
        let bs = self.block_size;
        if bs == 0 || self.max_bytes == 0 {
            return;
        }
        // Block b's tokens are rows b*bs-1 .. (b+1)*bs-1 (the first block's from row 0).
        let full_blocks = ((rows.len() + 1) / bs).min(prompt.len() / bs);
        if full_blocks == 0 {
            return;
        }
        let hashes = hash_request_blocks(&prompt[..full_blocks * bs], bs, salt);
        for (b, hash) in hashes.into_iter().enumerate() {
            if self.blocks.get(&hash).is_some_and(|s| s.top >= top) {
                continue;
            }
            let rows: Arc<[PromptTokenLogprob]> = rows
                [(b * bs).saturating_sub(1)..(b + 1) * bs - 1]
                .iter()
                .cloned()
                .collect();
            let bytes = rows.iter().map(row_bytes).sum::<usize>();
            if bytes > self.max_bytes {
                return;
            }
            if let Some(old) = self.blocks.remove(&hash) {
                self.bytes -= old.bytes;
                self.order.retain(|h| *h != hash);
            }
            while self.bytes + bytes > self.max_bytes {
                let Some(oldest) = self.order.pop_front() else {
                    break;
                };
                if let Some(old) = self.blocks.remove(&oldest) {
                    self.bytes -= old.bytes;
                }
            }
            self.bytes += bytes;
            self.order.push_back(hash);
            self.blocks.insert(hash, BlockScores { top, rows, bytes });
        }
    }

    /// Forgets every record.
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.order.clear();
        self.bytes = 0;
    }

    /// Bytes the records take.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(token: u32, top: usize) -> PromptTokenLogprob {
        PromptTokenLogprob {
            logprob: -(token as f32) / 7.0,
            rank: token as usize % 5 + 1,
            top: (0..top as u32).map(|t| (t, -(t as f32))).collect(),
        }
    }

    /// Rows as an engine computing `prompt` would give them (a function of the token
    /// scored and everything before it; here of the token alone).
    fn rows(prompt: &[u32], top: usize) -> Vec<PromptTokenLogprob> {
        prompt[1..].iter().map(|&t| row(t, top)).collect()
    }

    #[test]
    fn a_shared_prefix_gives_its_full_blocks_rows_back() {
        let mut scored = ScoredBlocks::new(4, 1 << 20);
        let first: Vec<u32> = (0..11).collect();
        scored.record(&first, &rows(&first, 2), 2, b"");
        // Two full blocks of the first prompt recorded: rows for tokens 1..=7.
        let mut second = first[..9].to_vec();
        second.extend([50, 51, 52]);
        let known = scored.known(&second, 2, b"");
        assert_eq!(known, rows(&first, 2)[..7].to_vec());
        // Fewer alternatives: the first of them; more, or another first block: nothing.
        assert_eq!(scored.known(&second, 1, b""), rows(&first, 1)[..7].to_vec());
        assert_eq!(scored.known(&second, 0, b""), rows(&first, 0)[..7].to_vec());
        assert!(scored.known(&second, 3, b"").is_empty());
        assert!(scored.known(&[9, 1, 2, 3, 4, 5, 6, 7], 2, b"").is_empty());
        // Under another cache salt: none of them.
        assert!(scored.known(&second, 2, b"tenant b").is_empty());
    }

    #[test]
    fn more_alternatives_replace_a_record_and_fewer_keep_it() {
        let mut scored = ScoredBlocks::new(4, 1 << 20);
        let prompt: Vec<u32> = (0..9).collect();
        scored.record(&prompt, &rows(&prompt, 1), 1, b"");
        scored.record(&prompt, &rows(&prompt, 3), 3, b"");
        assert_eq!(
            scored.known(&prompt, 3, b""),
            rows(&prompt, 3)[..7].to_vec()
        );
        let bytes = scored.bytes();
        scored.record(&prompt, &rows(&prompt, 2), 2, b"");
        assert_eq!(
            scored.bytes(),
            bytes,
            "a record of fewer alternatives is not kept"
        );
        assert_eq!(
            scored.known(&prompt, 2, b""),
            rows(&prompt, 2)[..7].to_vec()
        );
    }

    #[test]
    fn partial_rows_record_only_the_blocks_they_cover() {
        let mut scored = ScoredBlocks::new(4, 1 << 20);
        let prompt: Vec<u32> = (0..16).collect();
        let all = rows(&prompt, 1);
        // Rows for tokens 1..=6: only the first block (tokens 0..=3) is whole.
        scored.record(&prompt, &all[..6], 1, b"");
        assert_eq!(scored.known(&prompt, 1, b""), all[..3].to_vec());
        scored.record(&prompt, &all, 1, b"");
        assert_eq!(scored.known(&prompt, 1, b""), all[..15].to_vec());
    }

    #[test]
    fn the_oldest_records_go_past_the_budget() {
        let one_block = 3 * row_bytes(&row(1, 1)) + row_bytes(&row(1, 1));
        let mut scored = ScoredBlocks::new(4, 3 * one_block);
        for start in 0..6u32 {
            let prompt: Vec<u32> = (0..4).map(|j| 100 * start + j).collect();
            scored.record(&prompt, &rows(&prompt, 1), 1, b"");
            assert!(scored.bytes() <= 3 * one_block);
        }
        let newest: Vec<u32> = (0..4).map(|j| 500 + j).collect();
        let oldest: Vec<u32> = (0..4).collect();
        assert_eq!(scored.known(&newest, 1, b"").len(), 3);
        assert!(scored.known(&oldest, 1, b"").is_empty());
        scored.clear();
        assert_eq!(scored.bytes(), 0);
        assert!(scored.known(&newest, 1, b"").is_empty());
    }
}
