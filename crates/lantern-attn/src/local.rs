//! Chunked-local attention (Llama 4) as a *virtual batch*, the way vLLM's
//! `make_local_attention_virtual_batches` builds it.
//!
//! In a chunked-local layer with chunk size `C`, a query at position `p` sees the keys
//! `k <= p` with `k / C == p / C` (see
//! [`AttentionLayerSpec::key_visible`](crate::AttentionLayerSpec::key_visible)). Instead of
//! masking inside the kernel, each request's scheduled queries are cut at chunk
//! boundaries into *virtual requests*; a virtual request's keys are exactly its chunk's
//! keys up to its last query, so plain causal attention over the virtual batch is
//! chunked-local attention over the real one.
//!
//! A virtual request counts positions from its chunk's start: its `seq_len` is the
//! number of keys of the chunk it sees, its `num_computed_tokens` the chunk's keys
//! before its first query, and its block table starts at the chunk's first block. That
//! last part needs every chunk to start on a block boundary, so `C` must be a multiple
//! of the block size (vLLM asserts the same).
//!
//! The example of vLLM's docstring: chunk size 4, block size 2, three requests with
//! query lengths `[4, 10, 5]` and sequence lengths `[6, 17, 9]`:
//!
//! ```text
//! request 0 (queries at 2..6):  [2, 3] in chunk 0..4, [4, 5] in chunk 4..8
//!   virtual 0: q_len 2, seq_len 4, keys 0..4  (positions 2, 3 see 0..=2, 0..=3)
//!   virtual 1: q_len 2, seq_len 2, keys 4..6  (positions 4, 5 see 4..=4, 4..=5)
//! request 1 (queries at 7..17): 7 | 8..12 | 12..16 | 16
//! request 2 (queries at 4..9):  4..8 | 8
//!
//! q_lens   = [2, 2, 1, 4, 4, 1, 4, 1]
//! seq_lens = [4, 2, 4, 4, 4, 1, 4, 1]
//! chunk_start (absolute position of each virtual request's first key)
//!          = [0, 4, 4, 8, 12, 16, 4, 8]
//! ```
//!
//! The batch's tokens keep their order: virtual request `v` owns the same batch rows
//! `query_start_loc[v]..query_start_loc[v + 1]` of `q`, `k`, `v` and `out` as they have
//! in the original batch, and the slot mapping is the original one. Only the grouping
//! into requests, the lengths and the block tables change.

use std::ops::Range;
use std::sync::Arc;

use lantern_kv::BlockId;

use crate::error::AttnError;
use crate::metadata::{BlockTable, CommonAttentionMetadata};

/// The virtual batch of a chunked-local layer (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalVirtualBatch {
    /// The chunk size `C` the batch was cut with.
    pub chunk_size: usize,
    /// The virtual requests as ordinary causal metadata, positions counted from each
    /// virtual request's chunk start. Same tokens, same slot mapping, same block size as
    /// the original metadata.
    pub common: Arc<CommonAttentionMetadata>,
    /// `[num_virtual]`: the original request each virtual request belongs to.
    pub request: Vec<usize>,
    /// `[num_virtual]`: absolute position of the first key of each virtual request
    /// (the start of its chunk, a multiple of `C`). Local position `i` of virtual
    /// request `v` is absolute position `chunk_start[v] + i`.
    pub chunk_start: Vec<usize>,
    /// `[num_reqs + 1]`: original request `r` became virtual requests
    /// `virtual_start[r]..virtual_start[r + 1]` (vLLM's cumulative `local_blocks`).
    pub virtual_start: Vec<usize>,
}

impl LocalVirtualBatch {
    /// Number of virtual requests.
    pub fn num_virtual(&self) -> usize {
        self.request.len()
    }

    /// Batch rows (query tokens) of virtual request `v`: rows of the original batch,
    /// all belonging to original request `self.request[v]`.
    pub fn rows(&self, v: usize) -> Range<usize> {
        self.common.query_start_loc[v]..self.common.query_start_loc[v + 1]
    }

    /// The virtual requests that original request `r` was cut into.
    pub fn virtual_requests_of(&self, r: usize) -> Range<usize> {
        self.virtual_start[r]..self.virtual_start[r + 1]
    }

    /// The absolute key positions virtual request `v` reads: its chunk's keys up to its
    /// last query.
    pub fn key_positions(&self, v: usize) -> Range<usize> {
        self.chunk_start[v]..self.chunk_start[v] + self.common.seq_lens[v]
    }
}

/// Cuts `common`'s requests at multiples of `chunk_size` into virtual requests (see the
/// module docs); vLLM's `make_local_attention_virtual_batches`.
///
/// Errors when `chunk_size` is zero or not a multiple of `common.block_size` (a chunk
/// must start on a block boundary for its block table to start at the chunk's first
/// block), or when `common` is inconsistent ([`CommonAttentionMetadata::validate`]).
///
/// Cost: `O(num_tokens + num_virtual * chunk_size / block_size)`, once per step per KV
/// cache group when cached in [`crate::AttentionMetadata`].
pub fn make_local_attention_virtual_batches(
    chunk_size: usize,
    common: &CommonAttentionMetadata,
) -> Result<LocalVirtualBatch, AttnError> {
    let block_size = common.block_size;
    if chunk_size == 0 {
        return Err(AttnError::InvalidLayerSpec(
            "chunked-local attention needs a non-zero chunk_size".into(),
        ));
    }
    if chunk_size.checked_rem(block_size) != Some(0) {
        return Err(AttnError::Unsupported(format!(
            "chunked-local attention needs chunk_size to be a multiple of the KV cache \
             block_size (every chunk must start on a block boundary): chunk_size \
             {chunk_size} is not a multiple of block_size {block_size}"
        )));
    }
    common.validate()?;
    let blocks_per_chunk = chunk_size / block_size;

    let mut query_start_loc = vec![0usize];
    let mut seq_lens = Vec::new();
    let mut num_computed_tokens = Vec::new();
    let mut tables: Vec<&[BlockId]> = Vec::new();
    let mut request = Vec::new();
    let mut chunk_start = Vec::new();
    let mut virtual_start = Vec::with_capacity(common.num_reqs + 1);
    virtual_start.push(0);
    let (mut max_query_len, mut max_seq_len) = (0, 0);
    for r in 0..common.num_reqs {
        let table = common.block_table.row(r);
        let seq_len = common.seq_lens[r];
        let mut row = common.query_start_loc[r];
        let mut pos = common.num_computed_tokens[r];
        // Requests schedule at least one token, so every request gets at least one
        // virtual request (validate guarantees pos < seq_len or an empty query).
        while pos < seq_len {
            let start = pos / chunk_size * chunk_size;
            let end = (start + chunk_size).min(seq_len);
            let q_len = end - pos;
            let first_block = start / block_size;
            // The chunk's blocks, as many as the row has (vLLM pads by repeating the
            // last column instead; `BlockTable` keeps the real length). The row covers
            // `seq_len`, so it holds every block up to `end`.
            let last_block = (first_block + blocks_per_chunk).min(table.len());
            tables.push(&table[first_block..last_block]);
            row += q_len;
            query_start_loc.push(row);
            seq_lens.push(end - start);
            num_computed_tokens.push(pos - start);
            request.push(r);
            chunk_start.push(start);
            max_query_len = max_query_len.max(q_len);
            max_seq_len = max_seq_len.max(end - start);
            pos = end;
        }
        virtual_start.push(request.len());
    }
    let virtual_common = CommonAttentionMetadata {
        num_reqs: request.len(),
        query_start_loc,
        seq_lens,
        num_computed_tokens,
        block_table: BlockTable::from_rows(&tables),
        slot_mapping: common.slot_mapping.clone(),
        num_actual_tokens: common.num_actual_tokens,
        max_query_len,
        max_seq_len,
        causal: true,
        block_size,
    };
    Ok(LocalVirtualBatch {
        chunk_size,
        common: Arc::new(virtual_common),
        request,
        chunk_start,
        virtual_start,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layer::AttentionLayerSpec;
    use crate::metadata::ScheduledSeq;

    /// Metadata for requests given as (query_len, seq_len), like vLLM's `BatchSpec`,
    /// with block tables `tables`.
    fn metadata(
        spec: &[(usize, usize)],
        tables: &[Vec<BlockId>],
        block_size: usize,
    ) -> CommonAttentionMetadata {
        let seqs: Vec<ScheduledSeq<'_>> = spec
            .iter()
            .zip(tables)
            .map(|(&(q, s), t)| ScheduledSeq {
                num_computed_tokens: s - q,
                num_scheduled_tokens: q,
                block_table: t,
                slot_window: None,
            })
            .collect();
        CommonAttentionMetadata::build(&seqs, block_size).unwrap()
    }

    /// Block tables `[r * width, r * width + 1, ...]`, `width` blocks per request.
    fn arange_tables(num_reqs: usize, width: usize) -> Vec<Vec<BlockId>> {
        (0..num_reqs)
            .map(|r| ((r * width) as BlockId..((r + 1) * width) as BlockId).collect())
            .collect()
    }

    fn q_lens(b: &LocalVirtualBatch) -> Vec<usize> {
        b.common.query_lens()
    }

    fn rows(b: &LocalVirtualBatch) -> Vec<Vec<BlockId>> {
        (0..b.num_virtual())
            .map(|v| b.common.block_table.row(v).to_vec())
            .collect()
    }

    /// The docstring of vLLM's `make_local_attention_virtual_batches`, with its numbers:
    /// chunk 4, q_seqlens [4, 10, 5], kv_seqlens [6, 17, 9], block size 2, block table
    /// rows 0..10, 10..20, 20..30.
    #[test]
    fn vllm_docstring_example() {
        let common = metadata(&[(4, 6), (10, 17), (5, 9)], &arange_tables(3, 10), 2);
        assert_eq!(common.query_start_loc, vec![0, 4, 14, 19]);
        let b = make_local_attention_virtual_batches(4, &common).unwrap();
        //                          __b0__  ______b1______  __b2__ < original requests
        assert_eq!(q_lens(&b), vec![2, 2, 1, 4, 4, 1, 4, 1]);
        // (The docstring prints cu_seqlens_q_local as [0, 4, 6, 10, 14, 18, 19, 23, 24],
        // which is not the cumulative sum of its own q_seqlens_local; this is.)
        assert_eq!(
            b.common.query_start_loc,
            vec![0, 2, 4, 5, 9, 13, 14, 18, 19]
        );
        assert_eq!(b.common.seq_lens, vec![4, 2, 4, 4, 4, 1, 4, 1]);
        // num_computed_tokens_local = seqlens_k_local - seqlens_q_local
        assert_eq!(b.common.num_computed_tokens, vec![2, 0, 3, 0, 0, 0, 0, 0]);
        // k_seqstarts_absolute
        assert_eq!(b.chunk_start, vec![0, 4, 4, 8, 12, 16, 4, 8]);
        assert_eq!(b.request, vec![0, 0, 1, 1, 1, 1, 2, 2]);
        assert_eq!(b.virtual_start, vec![0, 2, 6, 8]);
        #[rustfmt::skip]
        assert_eq!(rows(&b), vec![
            vec![0, 1],   // local-batch 0, (batch 0, starting from k[0])
            vec![2, 3],   // local-batch 1, (batch 0, starting from k[4])
            vec![12, 13], // local-batch 2, (batch 1, starting from k[4])
            vec![14, 15], // local-batch 3, (batch 1, starting from k[8])
            vec![16, 17], // local-batch 4, (batch 1, starting from k[12])
            vec![18, 19], // local-batch 5, (batch 1, starting from k[16])
            vec![22, 23], // local-batch 6, (batch 2, starting from k[4])
            vec![24, 25], // local-batch 7, (batch 2, starting from k[8])
        ]);
        assert_eq!(b.common.num_reqs, 8);
        assert_eq!(b.common.num_actual_tokens, 19);
        assert_eq!(b.common.max_query_len, 4);
        assert_eq!(b.common.max_seq_len, 4);
        assert_eq!(b.common.slot_mapping, common.slot_mapping);
        assert!(b.common.causal);
        b.common.validate().unwrap();
        // Mapping back: virtual request 2 is original request 1's first query row.
        assert_eq!(b.rows(2), 4..5);
        assert_eq!(b.virtual_requests_of(1), 2..6);
        assert_eq!(b.key_positions(5), 16..17);
    }

    /// vLLM's unit-test cases (block tables sized exactly, arange ids). Where vLLM pads
    /// a short row by repeating its last block, `BlockTable` keeps the real length.
    #[test]
    fn vllm_test_cases() {
        // The docstring example with 9 columns: the last chunk of request 1 has 1 block.
        let common = metadata(&[(4, 6), (10, 17), (5, 9)], &arange_tables(3, 9), 2);
        let b = make_local_attention_virtual_batches(4, &common).unwrap();
        assert_eq!(q_lens(&b), vec![2, 2, 1, 4, 4, 1, 4, 1]);
        assert_eq!(b.common.seq_lens, vec![4, 2, 4, 4, 4, 1, 4, 1]);
        #[rustfmt::skip]
        assert_eq!(rows(&b), vec![
            vec![0, 1], vec![2, 3], vec![11, 12], vec![13, 14],
            vec![15, 16], vec![17], vec![20, 21], vec![22, 23],
        ]);

        // The last chunk is full: nothing to clip.
        let common = metadata(&[(8, 12)], &arange_tables(1, 6), 2);
        let b = make_local_attention_virtual_batches(4, &common).unwrap();
        assert_eq!(q_lens(&b), vec![4, 4]);
        assert_eq!(b.common.seq_lens, vec![4, 4]);
        assert_eq!(rows(&b), vec![vec![2, 3], vec![4, 5]]);

        // Every key position is read.
        let common = metadata(&[(7, 10)], &arange_tables(1, 5), 2);
        let b = make_local_attention_virtual_batches(4, &common).unwrap();
        assert_eq!(q_lens(&b), vec![1, 4, 2]);
        assert_eq!(b.common.seq_lens, vec![4, 4, 2]);
        assert_eq!(rows(&b), vec![vec![0, 1], vec![2, 3], vec![4]]);

        // Chunk larger than the sequence: one virtual request, unchanged lengths.
        let common = metadata(&[(4, 6)], &arange_tables(1, 3), 2);
        let b = make_local_attention_virtual_batches(10, &common).unwrap();
        assert_eq!(q_lens(&b), vec![4]);
        assert_eq!(b.common.seq_lens, vec![6]);
        assert_eq!(rows(&b), vec![vec![0, 1, 2]]);

        // Block size equal to chunk size: one block per virtual request.
        let common = metadata(&[(6, 8), (6, 8)], &arange_tables(2, 2), 4);
        let b = make_local_attention_virtual_batches(4, &common).unwrap();
        assert_eq!(q_lens(&b), vec![2, 4, 2, 4]);
        assert_eq!(b.common.seq_lens, vec![4, 4, 4, 4]);
        assert_eq!(rows(&b), vec![vec![0], vec![1], vec![2], vec![3]]);

        // A decode that opens the second chunk sees only itself.
        let common = metadata(&[(1, 5)], &arange_tables(1, 3), 2);
        let b = make_local_attention_virtual_batches(4, &common).unwrap();
        assert_eq!(q_lens(&b), vec![1]);
        assert_eq!(b.common.seq_lens, vec![1]);
        assert_eq!(b.common.num_computed_tokens, vec![0]);
        assert_eq!(rows(&b), vec![vec![2]]);
        assert_eq!(b.chunk_start, vec![4]);
    }

    /// vLLM's bound test cases: how many virtual requests a batch becomes.
    #[test]
    fn number_of_virtual_requests() {
        let bs = 16;
        for (spec, chunk, expected) in [
            (vec![(1000, 1000)], 256, 4),
            (vec![(1000, 1255)], 256, 5),
            (vec![(300, 300), (700, 1400), (90, 90)], 128, 10),
            (vec![(64, 64), (64, 64)], 256, 2),
            (vec![(1, 16), (1, 32), (1, 48), (1, 64)], 16, 4),
        ] {
            let tables: Vec<Vec<BlockId>> = spec
                .iter()
                .map(|&(_, s): &(usize, usize)| (0..s.div_ceil(bs) as BlockId).collect())
                .collect();
            let common = metadata(&spec, &tables, bs);
            let b = make_local_attention_virtual_batches(chunk, &common).unwrap();
            assert_eq!(b.common.num_reqs, expected, "{spec:?} chunk {chunk}");
            let tokens: usize = spec.iter().map(|s| s.0).sum();
            assert_eq!(b.common.num_actual_tokens, tokens);
            assert!(b.common.query_lens().iter().all(|&q| q <= chunk));
            assert!(b.common.seq_lens.iter().all(|&s| s <= chunk));
        }
    }

    #[test]
    fn chunk_not_a_multiple_of_block_size_is_a_clear_error() {
        let common = metadata(&[(4, 6)], &arange_tables(1, 2), 4);
        let err = make_local_attention_virtual_batches(6, &common).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("chunk_size 6 is not a multiple of block_size 4"),
            "{msg}"
        );
        assert!(make_local_attention_virtual_batches(0, &common).is_err());
        let mut bad = common.clone();
        bad.seq_lens[0] += 1;
        assert!(make_local_attention_virtual_batches(4, &bad).is_err());
    }

    #[test]
    fn empty_batch() {
        let common = CommonAttentionMetadata::build(&[], 4).unwrap();
        let b = make_local_attention_virtual_batches(8, &common).unwrap();
        assert_eq!(b.num_virtual(), 0);
        assert_eq!(b.common.query_start_loc, vec![0]);
        assert_eq!(b.virtual_start, vec![0]);
        b.common.validate().unwrap();
    }

    /// Causal attention over the virtual batch sees exactly the keys the layer's own
    /// mask ([`AttentionLayerSpec::key_visible`]) makes visible, for every query of
    /// many batches, and the virtual slots are the original ones.
    #[test]
    fn virtual_causal_equals_the_layers_chunk_mask() {
        for block_size in [1usize, 2, 3, 4] {
            for mult in [1usize, 2, 3] {
                let chunk = block_size * mult;
                let layer = AttentionLayerSpec {
                    chunk_size: Some(chunk),
                    ..AttentionLayerSpec::new(1, 1, 1)
                };
                let spec: Vec<(usize, usize)> = vec![(1, 1), (1, 13), (9, 9), (7, 20), (3, 5)];
                let tables: Vec<Vec<BlockId>> = spec
                    .iter()
                    .scan(0, |next, &(_, s)| {
                        let n = s.div_ceil(block_size);
                        // Reversed ids so table order matters.
                        let t = (*next..*next + n).rev().map(|b| b as BlockId).collect();
                        *next += n;
                        Some(t)
                    })
                    .collect();
                let common = metadata(&spec, &tables, block_size);
                let b = make_local_attention_virtual_batches(chunk, &common).unwrap();
                b.common.validate().unwrap();
                for v in 0..b.num_virtual() {
                    let r = b.request[v];
                    for row in b.rows(v) {
                        let local = b.common.num_computed_tokens[v] + row - b.rows(v).start;
                        let pos = common.num_computed_tokens[r] + row - common.query_start_loc[r];
                        assert_eq!(b.chunk_start[v] + local, pos);
                        // Keys the virtual request reads causally, in absolute positions.
                        let seen: Vec<usize> = (0..=local).map(|k| b.chunk_start[v] + k).collect();
                        let expected: Vec<usize> = (0..common.seq_lens[r])
                            .filter(|&k| layer.key_visible(pos, k))
                            .collect();
                        assert_eq!(seen, expected, "bs {block_size} chunk {chunk} v {v}");
                        // Same physical slot for every seen key.
                        for k in 0..=local {
                            assert_eq!(
                                crate::slot_for_position(
                                    b.common.block_table.row(v),
                                    block_size,
                                    k
                                ),
                                crate::slot_for_position(
                                    common.block_table.row(r),
                                    block_size,
                                    b.chunk_start[v] + k
                                )
                            );
                        }
                    }
                }
            }
        }
    }
}
