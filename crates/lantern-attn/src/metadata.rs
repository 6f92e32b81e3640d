//! Per-step attention metadata for a mixed batch of prefills and decodes, and the batch
//! helpers vLLM's backends use on it.
//!
//! [`CommonAttentionMetadata`] is built once per step per KV cache group (all layers of
//! the group share it) from what the scheduler decided for each request
//! ([`ScheduledSeq`]). Tokens of the batch are laid out request after request; request
//! `r` owns tokens `query_start_loc[r]..query_start_loc[r + 1]`, and its `i`-th token
//! sits at absolute position `num_computed_tokens[r] + i`.

use lantern_kv::{BlockId, PAD_SLOT_ID};

use crate::error::AttnError;

/// Per-request block ids, padded to a rectangle (the form a GPU kernel wants), with each
/// row's real length kept so that [`BlockTable::row`] never returns padding.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockTable {
    num_rows: usize,
    max_blocks_per_row: usize,
    data: Vec<BlockId>,
    row_lens: Vec<usize>,
}

impl BlockTable {
    /// Block id used to pad rows shorter than the longest.
    pub const PAD_BLOCK: BlockId = 0;

    /// A table holding `rows`, padded to the longest row.
    pub fn from_rows<R: AsRef<[BlockId]>>(rows: &[R]) -> Self {
        let max_blocks_per_row = rows.iter().map(|r| r.as_ref().len()).max().unwrap_or(0);
        let mut data = Vec::with_capacity(rows.len() * max_blocks_per_row);
        let mut row_lens = Vec::with_capacity(rows.len());
        for r in rows {
            let r = r.as_ref();
            data.extend_from_slice(r);
            data.resize(data.len() + max_blocks_per_row - r.len(), Self::PAD_BLOCK);
            row_lens.push(r.len());
        }
        Self {
            num_rows: rows.len(),
            max_blocks_per_row,
            data,
            row_lens,
        }
    }

    /// Number of rows (requests).
    pub fn num_rows(&self) -> usize {
        self.num_rows
    }

    /// Width of the padded table.
    pub fn max_blocks_per_row(&self) -> usize {
        self.max_blocks_per_row
    }

    /// The valid block ids of row `i`; empty for a row that does not exist.
    pub fn row(&self, i: usize) -> &[BlockId] {
        let len = self.row_lens.get(i).copied().unwrap_or(0);
        let start = i.saturating_mul(self.max_blocks_per_row);
        self.data
            .get(start..start.saturating_add(len))
            .unwrap_or(&[])
    }

    /// Number of valid block ids in row `i` (0 for a row that does not exist).
    pub fn row_len(&self, i: usize) -> usize {
        self.row_lens.get(i).copied().unwrap_or(0)
    }

    /// The padded table, `[num_rows, max_blocks_per_row]` row-major.
    pub fn as_padded(&self) -> &[BlockId] {
        &self.data
    }

    /// The table padded to `width` blocks a row (at least its longest row) and to
    /// `num_rows` rows; an added row holds one valid [`Self::PAD_BLOCK`].
    pub fn padded_to(&self, num_rows: usize, width: usize) -> Result<Self, AttnError> {
        if width < self.max_blocks_per_row || num_rows < self.num_rows {
            return Err(AttnError::InvalidMetadata(format!(
                "a block table of {} rows of {} blocks cannot pad to {num_rows} rows of {width}",
                self.num_rows, self.max_blocks_per_row
            )));
        }
        let mut data = Vec::with_capacity(num_rows * width);
        let mut row_lens = self.row_lens.clone();
        for r in 0..self.num_rows {
            let start = r * self.max_blocks_per_row;
            data.extend_from_slice(&self.data[start..start + self.max_blocks_per_row]);
            data.resize((r + 1) * width, Self::PAD_BLOCK);
        }
        data.resize(num_rows * width, Self::PAD_BLOCK);
        row_lens.resize(num_rows, 1);
        Ok(Self {
            num_rows,
            max_blocks_per_row: width,
            data,
            row_lens,
        })
    }
}

/// What the scheduler decided for one request in this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledSeq<'a> {
    /// Tokens whose K/V are already in the cache (context, prefix-cache hits, earlier chunks).
    pub num_computed_tokens: usize,
    /// Tokens computed in this step (1 for a plain decode).
    pub num_scheduled_tokens: usize,
    /// The request's blocks in this group, covering at least `num_computed +
    /// num_scheduled` tokens.
    pub block_table: &'a [BlockId],
    /// Sliding window `w` of the group's layers, if the slot mapping should skip writing
    /// tokens that no query after this step can see: positions before `seq_len - w` get
    /// `PAD_SLOT_ID` (vLLM's `compute_slot_mapping_start_idx`). Backends read such
    /// tokens' K/V from this step's inputs instead of the cache.
    pub slot_window: Option<usize>,
}

/// Batch metadata shared by every layer of a KV cache group and by every backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommonAttentionMetadata {
    /// `[num_reqs + 1]`: request `r` owns batch tokens `query_start_loc[r]..query_start_loc[r + 1]`.
    pub query_start_loc: Vec<usize>,
    /// `[num_reqs]`: tokens in context after this step (`num_computed + query_len`).
    pub seq_lens: Vec<usize>,
    /// `[num_reqs]`: tokens already in the cache before this step.
    pub num_computed_tokens: Vec<usize>,
    /// `[num_reqs, max_blocks]` block ids per request.
    pub block_table: BlockTable,
    /// `[num_actual_tokens]`: where each token's K/V is written; negative = do not write.
    pub slot_mapping: Vec<i64>,
    pub num_reqs: usize,
    pub num_actual_tokens: usize,
    pub max_query_len: usize,
    pub max_seq_len: usize,
    /// Decoder self-attention is causal; the CPU backends support nothing else.
    pub causal: bool,
    pub block_size: usize,
}

impl CommonAttentionMetadata {
    /// Builds the metadata for `seqs` in batch order.
    ///
    /// Errors when `block_size` is zero, a request schedules no tokens, its block table
    /// does not cover its sequence, a window is zero, or a slot does not fit in `i64`.
    pub fn build(seqs: &[ScheduledSeq<'_>], block_size: usize) -> Result<Self, AttnError> {
        if block_size == 0 {
            return Err(AttnError::InvalidMetadata(
                "block_size must be non-zero".into(),
            ));
        }
        let mut query_start_loc = Vec::with_capacity(seqs.len() + 1);
        query_start_loc.push(0usize);
        let mut seq_lens = Vec::with_capacity(seqs.len());
        let mut num_computed_tokens = Vec::with_capacity(seqs.len());
        let mut slot_mapping = Vec::new();
        let mut max_query_len = 0;
        for (r, s) in seqs.iter().enumerate() {
            if s.num_scheduled_tokens == 0 {
                return Err(AttnError::InvalidMetadata(format!(
                    "request {r} schedules no tokens"
                )));
            }
            let seq_len = s
                .num_computed_tokens
                .checked_add(s.num_scheduled_tokens)
                .ok_or_else(|| {
                    AttnError::InvalidMetadata(format!("request {r}: sequence length overflows"))
                })?;
            check_table_covers(r, s.block_table.len(), block_size, seq_len)?;
            let pad_before = match s.slot_window {
                Some(0) => {
                    return Err(AttnError::InvalidMetadata(format!(
                        "request {r}: slot_window must be non-zero"
                    )))
                }
                Some(w) => seq_len.saturating_sub(w),
                None => 0,
            };
            for pos in s.num_computed_tokens..seq_len {
                let slot = if pos < pad_before {
                    PAD_SLOT_ID
                } else {
                    slot_for_position(s.block_table, block_size, pos).ok_or_else(|| {
                        AttnError::InvalidMetadata(format!(
                            "request {r}: slot of position {pos} overflows i64"
                        ))
                    })?
                };
                slot_mapping.push(slot);
            }
            let end = query_start_loc[r] + s.num_scheduled_tokens;
            query_start_loc.push(end);
            seq_lens.push(seq_len);
            num_computed_tokens.push(s.num_computed_tokens);
            max_query_len = max_query_len.max(s.num_scheduled_tokens);
        }
        let tables: Vec<&[BlockId]> = seqs.iter().map(|s| s.block_table).collect();
        Ok(Self {
            num_actual_tokens: slot_mapping.len(),
            max_seq_len: seq_lens.iter().copied().max().unwrap_or(0),
            max_query_len,
            num_reqs: seqs.len(),
            query_start_loc,
            seq_lens,
            num_computed_tokens,
            block_table: BlockTable::from_rows(&tables),
            slot_mapping,
            causal: true,
            block_size,
        })
    }

    /// The batch padded to `num_reqs` requests with a block table `table_width` blocks
    /// wide: the fixed shapes a recorded graph step replays. Each added request computes
    /// one token at position 0 that reads the first slot of [`BlockTable::PAD_BLOCK`] and
    /// writes nothing (`PAD_SLOT_ID`); its output is thrown away. Padding a batch never
    /// changes what its own requests compute.
    pub fn padded_for_graph(&self, num_reqs: usize, table_width: usize) -> Result<Self, AttnError> {
        let extra = num_reqs.checked_sub(self.num_reqs).ok_or_else(|| {
            AttnError::InvalidMetadata(format!(
                "a batch of {} requests cannot pad to {num_reqs}",
                self.num_reqs
            ))
        })?;
        let mut padded = self.clone();
        padded.block_table = self.block_table.padded_to(num_reqs, table_width)?;
        for _ in 0..extra {
            let end = padded.num_actual_tokens + 1;
            padded.query_start_loc.push(end);
            padded.seq_lens.push(1);
            padded.num_computed_tokens.push(0);
            padded.slot_mapping.push(PAD_SLOT_ID);
            padded.num_actual_tokens = end;
        }
        padded.num_reqs = num_reqs;
        if extra > 0 {
            padded.max_query_len = padded.max_query_len.max(1);
            padded.max_seq_len = padded.max_seq_len.max(1);
        }
        Ok(padded)
    }

    /// Number of this step's tokens of request `r` (0 for a request that does not exist).
    pub fn query_len(&self, r: usize) -> usize {
        match (self.query_start_loc.get(r), self.query_start_loc.get(r + 1)) {
            (Some(&a), Some(&b)) => b.saturating_sub(a),
            _ => 0,
        }
    }

    /// Query lengths of all requests.
    pub fn query_lens(&self) -> Vec<usize> {
        self.query_start_loc
            .windows(2)
            .map(|w| w[1].saturating_sub(w[0]))
            .collect()
    }

    /// Checks that the metadata is consistent with itself: lengths of every per-request
    /// vector, monotone `query_start_loc` ending at `num_actual_tokens`, `seq_len =
    /// num_computed + query_len`, maxima, block tables covering every sequence, and that
    /// every non-padding slot is the one the block table gives for that token.
    ///
    /// Backends call this before touching any buffer, since the fields are public and a
    /// hand-built or stale value must produce an error, not a panic.
    pub fn validate(&self) -> Result<(), AttnError> {
        let bad = |msg: String| Err(AttnError::InvalidMetadata(msg));
        let n = self.num_reqs;
        if self.block_size == 0 {
            return bad("block_size must be non-zero".into());
        }
        if self.query_start_loc.len() != n + 1
            || self.seq_lens.len() != n
            || self.num_computed_tokens.len() != n
            || self.block_table.num_rows() < n
        {
            return bad(format!(
                "per-request lengths disagree with num_reqs {n}: query_start_loc {}, seq_lens {}, \
                 num_computed_tokens {}, block_table rows {}",
                self.query_start_loc.len(),
                self.seq_lens.len(),
                self.num_computed_tokens.len(),
                self.block_table.num_rows()
            ));
        }
        if self.query_start_loc.first() != Some(&0)
            || self.query_start_loc.last() != Some(&self.num_actual_tokens)
        {
            return bad(format!(
                "query_start_loc must run from 0 to num_actual_tokens {}",
                self.num_actual_tokens
            ));
        }
        if self.slot_mapping.len() != self.num_actual_tokens {
            return bad(format!(
                "slot_mapping has {} entries for {} tokens",
                self.slot_mapping.len(),
                self.num_actual_tokens
            ));
        }
        let (mut max_q, mut max_s) = (0, 0);
        for r in 0..n {
            let (start, end) = (self.query_start_loc[r], self.query_start_loc[r + 1]);
            if end < start || end > self.num_actual_tokens {
                return bad(format!("query_start_loc is not monotone at request {r}"));
            }
            let q = end - start;
            let seq_len = self.seq_lens[r];
            if self.num_computed_tokens[r].checked_add(q) != Some(seq_len) {
                return bad(format!(
                    "request {r}: seq_len {seq_len} != num_computed {} + query_len {q}",
                    self.num_computed_tokens[r]
                ));
            }
            let table = self.block_table.row(r);
            check_table_covers(r, table.len(), self.block_size, seq_len)?;
            for (i, &slot) in self.slot_mapping[start..end].iter().enumerate() {
                let pos = self.num_computed_tokens[r] + i;
                if slot >= 0 && slot_for_position(table, self.block_size, pos) != Some(slot) {
                    return bad(format!(
                        "request {r}: slot {slot} of position {pos} disagrees with the block table"
                    ));
                }
            }
            max_q = max_q.max(q);
            max_s = max_s.max(seq_len);
        }
        if max_q != self.max_query_len || max_s != self.max_seq_len {
            return bad(format!(
                "max_query_len/max_seq_len {}/{} differ from the actual {max_q}/{max_s}",
                self.max_query_len, self.max_seq_len
            ));
        }
        Ok(())
    }
}

/// `table[pos / block_size] * block_size + pos % block_size`, or `None` when the table
/// is too short or the slot overflows `i64`.
pub fn slot_for_position(table: &[BlockId], block_size: usize, pos: usize) -> Option<i64> {
    let block = *table.get(pos.checked_div(block_size)?)?;
    let slot = (block as usize)
        .checked_mul(block_size)?
        .checked_add(pos % block_size)?;
    i64::try_from(slot).ok()
}

fn check_table_covers(
    r: usize,
    table_len: usize,
    block_size: usize,
    seq_len: usize,
) -> Result<(), AttnError> {
    if table_len.saturating_mul(block_size) < seq_len {
        return Err(AttnError::InvalidMetadata(format!(
            "request {r}: {table_len} blocks of {block_size} cannot hold {seq_len} tokens"
        )));
    }
    Ok(())
}

/// Where decodes end and prefills begin in a batch ordered decodes first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DecodePrefillSplit {
    pub num_decodes: usize,
    pub num_prefills: usize,
    pub num_decode_tokens: usize,
    pub num_prefill_tokens: usize,
}

/// Splits a batch ordered decodes first (see
/// [`reorder_batch_to_split_decodes_and_prefills`]) into its decode and prefill parts. A
/// request is a decode when its query length is at most `decode_threshold`; the decodes
/// are the leading run of such requests, and everything from the first longer request on
/// counts as prefill (as in vLLM, which assumes the batch was reordered).
pub fn split_decodes_and_prefills(
    meta: &CommonAttentionMetadata,
    decode_threshold: usize,
) -> DecodePrefillSplit {
    let lens = meta.query_lens();
    let num_decodes = lens.iter().take_while(|&&q| q <= decode_threshold).count();
    let num_decode_tokens: usize = lens[..num_decodes].iter().sum();
    let total: usize = lens.iter().sum();
    DecodePrefillSplit {
        num_decodes,
        num_prefills: lens.len() - num_decodes,
        num_decode_tokens,
        num_prefill_tokens: total - num_decode_tokens,
    }
}

/// The order that puts decodes (query length at most `decode_threshold`) first,
/// keeping the relative order within decodes and within prefills: entry `i` is the
/// current index of the request that should go to position `i`.
pub fn reorder_batch_to_split_decodes_and_prefills(
    query_lens: &[usize],
    decode_threshold: usize,
) -> Vec<usize> {
    let decodes = (0..query_lens.len()).filter(|&i| query_lens[i] <= decode_threshold);
    let prefills = (0..query_lens.len()).filter(|&i| query_lens[i] > decode_threshold);
    decodes.chain(prefills).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// vLLM's docstring example: prompt of 10, window 8, block 4 gives
    /// `[-1, -1, 2, 3, 4, 5, 6, 7, 0, 1]` (the window reuses block 0 for the tail).
    #[test]
    fn sliding_window_slot_mapping_matches_vllm_example() {
        let table = [0, 1, 0];
        let seqs = [ScheduledSeq {
            num_computed_tokens: 0,
            num_scheduled_tokens: 10,
            block_table: &table,
            slot_window: Some(8),
        }];
        let m = CommonAttentionMetadata::build(&seqs, 4).unwrap();
        assert_eq!(m.slot_mapping, vec![-1, -1, 2, 3, 4, 5, 6, 7, 0, 1]);
        m.validate().unwrap();
    }

    /// Two decodes followed by two prefills, the second a continuing chunk.
    fn mixed_batch() -> CommonAttentionMetadata {
        let (t0, t1, t2, t3) = ([7, 2], [5], [9, 4, 8], [1, 3, 6]);
        let seqs = [
            // decode: 5 tokens cached, the 6th is computed now.
            ScheduledSeq {
                num_computed_tokens: 5,
                num_scheduled_tokens: 1,
                block_table: &t0,
                slot_window: None,
            },
            // decode at the very start of a block.
            ScheduledSeq {
                num_computed_tokens: 3,
                num_scheduled_tokens: 1,
                block_table: &t1,
                slot_window: None,
            },
            // fresh prompt of 9 tokens.
            ScheduledSeq {
                num_computed_tokens: 0,
                num_scheduled_tokens: 9,
                block_table: &t2,
                slot_window: None,
            },
            // chunked prefill: 6 tokens done in an earlier step, 4 more now.
            ScheduledSeq {
                num_computed_tokens: 6,
                num_scheduled_tokens: 4,
                block_table: &t3,
                slot_window: None,
            },
        ];
        CommonAttentionMetadata::build(&seqs, 4).unwrap()
    }

    #[test]
    fn padding_for_a_graph_adds_requests_that_write_nothing() {
        let m = mixed_batch();
        let p = m.padded_for_graph(6, 8).unwrap();
        p.validate().unwrap();
        assert_eq!((p.num_reqs, p.num_actual_tokens), (6, 17));
        assert_eq!(p.query_start_loc, vec![0, 1, 2, 11, 15, 16, 17]);
        assert_eq!(p.seq_lens, vec![6, 4, 9, 10, 1, 1]);
        assert_eq!(&p.slot_mapping[..15], &m.slot_mapping[..]);
        assert_eq!(&p.slot_mapping[15..], &[PAD_SLOT_ID, PAD_SLOT_ID]);
        assert_eq!(p.block_table.max_blocks_per_row(), 8);
        assert_eq!(p.block_table.as_padded().len(), 48);
        for r in 0..4 {
            assert_eq!(p.block_table.row(r), m.block_table.row(r));
        }
        assert_eq!(p.block_table.row(5), &[BlockTable::PAD_BLOCK]);
        assert_eq!((p.max_seq_len, p.max_query_len), (10, 9));
        // A table narrower than a row, or fewer requests than the batch has, is refused.
        assert!(m.padded_for_graph(6, 2).is_err());
        assert!(m.padded_for_graph(3, 8).is_err());
        // No padding at all is the batch itself.
        assert_eq!(m.padded_for_graph(4, 3).unwrap(), m);
    }

    #[test]
    fn mixed_batch_metadata() {
        let m = mixed_batch();
        m.validate().unwrap();
        assert_eq!(m.num_reqs, 4);
        assert_eq!(m.query_start_loc, vec![0, 1, 2, 11, 15]);
        assert_eq!(m.seq_lens, vec![6, 4, 9, 10]);
        assert_eq!(m.num_computed_tokens, vec![5, 3, 0, 6]);
        assert_eq!(m.num_actual_tokens, 15);
        assert_eq!(m.max_query_len, 9);
        assert_eq!(m.max_seq_len, 10);
        assert!(m.causal);
        assert_eq!(m.query_lens(), vec![1, 1, 9, 4]);
        #[rustfmt::skip]
        let expected: Vec<i64> = vec![
            2 * 4 + 1,                                       // req 0, pos 5: block 2, offset 1
            5 * 4 + 3,                                       // req 1, pos 3: block 5, offset 3
            36, 37, 38, 39, 16, 17, 18, 19, 32,              // req 2, pos 0..9: blocks 9, 4, 8
            3 * 4 + 2, 3 * 4 + 3, 6 * 4, 6 * 4 + 1,          // req 3, pos 6..10: blocks 3, 6
        ];
        assert_eq!(m.slot_mapping, expected);
        assert_eq!(m.block_table.row(2), &[9, 4, 8]);
        assert_eq!(m.block_table.row(1), &[5]);
        assert_eq!(m.block_table.max_blocks_per_row(), 3);
        assert_eq!(m.block_table.as_padded()[3..6], [5, 0, 0]);
        assert_eq!(m.block_table.row(7), &[] as &[BlockId]);
    }

    #[test]
    fn mixed_batch_split() {
        let m = mixed_batch();
        assert_eq!(
            split_decodes_and_prefills(&m, 1),
            DecodePrefillSplit {
                num_decodes: 2,
                num_prefills: 2,
                num_decode_tokens: 2,
                num_prefill_tokens: 13
            }
        );
        // A threshold of 4 makes the 4-token chunk a decode too, but it is not in the
        // leading run, so only the first two count.
        assert_eq!(split_decodes_and_prefills(&m, 4).num_decodes, 2);
        assert_eq!(
            split_decodes_and_prefills(&m, 9),
            DecodePrefillSplit {
                num_decodes: 4,
                num_prefills: 0,
                num_decode_tokens: 15,
                num_prefill_tokens: 0
            }
        );
    }

    #[test]
    fn reorder_puts_decodes_first_stably() {
        assert_eq!(
            reorder_batch_to_split_decodes_and_prefills(&[9, 1, 4, 1, 2], 1),
            vec![1, 3, 0, 2, 4]
        );
        assert_eq!(
            reorder_batch_to_split_decodes_and_prefills(&[9, 1, 4, 1, 2], 2),
            vec![1, 3, 4, 0, 2]
        );
        assert_eq!(
            reorder_batch_to_split_decodes_and_prefills(&[], 1),
            Vec::<usize>::new()
        );
    }

    #[test]
    fn chunked_prefill_with_window_pads_only_out_of_window_positions() {
        let table = [3, 1, 2];
        let seqs = [ScheduledSeq {
            num_computed_tokens: 4,
            num_scheduled_tokens: 6,
            block_table: &table,
            slot_window: Some(3),
        }];
        let m = CommonAttentionMetadata::build(&seqs, 4).unwrap();
        // seq_len 10, window 3: positions 4..7 are padded, 7..10 are written.
        assert_eq!(m.slot_mapping, vec![-1, -1, -1, 7, 8, 9]);
        m.validate().unwrap();
    }

    #[test]
    fn build_rejects_bad_input() {
        let table = [0];
        let seq = |computed, scheduled, window| ScheduledSeq {
            num_computed_tokens: computed,
            num_scheduled_tokens: scheduled,
            block_table: &table,
            slot_window: window,
        };
        assert!(CommonAttentionMetadata::build(&[seq(0, 4, None)], 0).is_err());
        assert!(CommonAttentionMetadata::build(&[seq(0, 5, None)], 4).is_err());
        assert!(CommonAttentionMetadata::build(&[seq(0, 0, None)], 4).is_err());
        assert!(CommonAttentionMetadata::build(&[seq(0, 2, Some(0))], 4).is_err());
        let empty = CommonAttentionMetadata::build(&[], 4).unwrap();
        assert_eq!(empty.query_start_loc, vec![0]);
        empty.validate().unwrap();
    }

    #[test]
    fn validate_catches_inconsistent_metadata() {
        let mut m = mixed_batch();
        m.seq_lens[1] += 1;
        assert!(m.validate().is_err());
        let mut m = mixed_batch();
        m.slot_mapping[0] += 1;
        assert!(m.validate().is_err());
        let mut m = mixed_batch();
        m.slot_mapping.pop();
        assert!(m.validate().is_err());
        let mut m = mixed_batch();
        m.query_start_loc[2] = 0;
        assert!(m.validate().is_err());
        let mut m = mixed_batch();
        m.max_seq_len = 3;
        assert!(m.validate().is_err());
    }
}
