//! Slot arithmetic: where in the paged cache each token's key and value are written.
//!
//! A *slot* is a token's row in the flattened `[num_blocks * block_size]` cache:
//! `slot = block_table[pos / block_size] * block_size + pos % block_size`.
//!
//! Prompt tokens under a sliding window that no query will ever see get [`PAD_SLOT_ID`]
//! instead, so the backend skips writing them (vLLM's `compute_slot_mapping`). For a
//! prompt of `seq_len` tokens and a window of `w` keys, the last prompt query (position
//! `seq_len - 1`) sees back to `seq_len - w`, and every later query sees even less far
//! back; positions before `max(0, seq_len - w)` are therefore never read *from the
//! cache*. The earlier prompt queries that do see them must get them elsewhere: the
//! padding is only right when
//! - the whole prompt runs in one forward pass and the backend takes the prompt's keys
//!   from the fresh K/V, not from the paged cache (a chunked prefill or a backend that
//!   attends over the paged cache would read unwritten slots);
//! - nothing else reads those keys later: attention capture reads every key back from
//!   the cache, and a prefix-cache hit would serve a block whose padded slots were never
//!   written to another request whose window does reach them.
//!
//! Otherwise pass `None` and write every token (what vLLM v1 does).
//!
//! All functions are pure and return errors rather than panicking on bad input.

use crate::error::KvError;
use crate::{BlockId, PAD_SLOT_ID};

/// The slot of token position `pos`, or `None` when the table does not reach it, the
/// block size is zero, or the slot does not fit in `i64`.
pub fn slot_for_position(block_table: &[BlockId], block_size: usize, pos: usize) -> Option<i64> {
    if block_size == 0 {
        return None;
    }
    let block = *block_table.get(pos / block_size)?;
    let offset = pos % block_size;
    i64::from(block)
        .checked_mul(i64::try_from(block_size).ok()?)?
        .checked_add(i64::try_from(offset).ok()?)
}

/// Slots for token positions `start..end` of one sequence.
///
/// `prompt_len_for_window = Some((seq_len, window))` marks a prompt under a sliding
/// window: positions before `max(0, seq_len - window)` get [`PAD_SLOT_ID`] (and need no
/// block). Errors on a zero block size, `start > end`, a table that does not reach a
/// position that needs a slot, or a slot past `i64`.
pub fn compute_slot_mapping(
    block_table: &[BlockId],
    block_size: usize,
    start: usize,
    end: usize,
    prompt_len_for_window: Option<(usize, usize)>,
) -> Result<Vec<i64>, KvError> {
    let mut out = Vec::new();
    extend_slot_mapping(
        &mut out,
        block_table,
        block_size,
        start,
        end,
        prompt_len_for_window,
    )?;
    Ok(out)
}

/// [`compute_slot_mapping`] appending to `out`, for building one flat mapping for a
/// whole batch without a vector per request. On error `out` is left unchanged.
pub fn extend_slot_mapping(
    out: &mut Vec<i64>,
    block_table: &[BlockId],
    block_size: usize,
    start: usize,
    end: usize,
    prompt_len_for_window: Option<(usize, usize)>,
) -> Result<(), KvError> {
    if block_size == 0 {
        return Err(KvError::ZeroBlockSize);
    }
    if start > end {
        return Err(KvError::InvalidRange { start, end });
    }
    let pad_end = match prompt_len_for_window {
        Some((seq_len, window)) => seq_len.saturating_sub(window),
        None => 0,
    };
    let first_real = start.max(pad_end).min(end);
    // The table must reach the last position that needs a slot. Checking before any
    // allocation also bounds the output by the table's reach, not by a caller's `end`.
    if first_real < end {
        let last = end - 1;
        let block_index = last / block_size;
        if block_index >= block_table.len() {
            return Err(KvError::BlockTableTooShort {
                position: last,
                block_index,
                table_len: block_table.len(),
            });
        }
    }
    let orig_len = out.len();
    out.extend(std::iter::repeat_n(PAD_SLOT_ID, first_real - start));
    for pos in first_real..end {
        match slot_for_position(block_table, block_size, pos) {
            Some(slot) => out.push(slot),
            None => {
                out.truncate(orig_len);
                return Err(KvError::SlotOverflow { position: pos });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_docstring_example_prompt_10_window_8_block_4() {
        // "if the prompt len is 10, sliding window is 8, and block size is 4, the first
        // two tokens are masked and the slot mapping will be
        // [-1, -1, 2, 3, 4, 5, 6, 7, 0, 1]."
        let slots = compute_slot_mapping(&[0, 1, 0], 4, 0, 10, Some((10, 8))).unwrap();
        assert_eq!(slots, vec![-1, -1, 2, 3, 4, 5, 6, 7, 0, 1]);
    }

    #[test]
    fn plain_prompt_maps_block_by_block() {
        // Block size 4, blocks [3, 7]: positions 0..6 land in block 3 then block 7.
        let slots = compute_slot_mapping(&[3, 7], 4, 0, 6, None).unwrap();
        assert_eq!(slots, vec![12, 13, 14, 15, 28, 29]);
    }

    #[test]
    fn decode_step_maps_one_token() {
        // Context of 5 tokens, the 6th (position 5) is decoded: block 1 offset 1.
        let slots = compute_slot_mapping(&[2, 9], 4, 5, 6, None).unwrap();
        assert_eq!(slots, vec![37]);
        assert_eq!(slot_for_position(&[2, 9], 4, 5), Some(37));
    }

    #[test]
    fn chunked_prefill_continues_where_context_ends() {
        // Second chunk of a prompt: positions 4..8 with block size 4 use block index 1.
        let slots = compute_slot_mapping(&[5, 6], 4, 4, 8, None).unwrap();
        assert_eq!(slots, vec![24, 25, 26, 27]);
    }

    #[test]
    fn window_padding_only_covers_positions_in_range() {
        // Prompt of 10, window 8: padding ends at 2. A range starting at 1 pads one token.
        let slots = compute_slot_mapping(&[0, 1, 0], 4, 1, 4, Some((10, 8))).unwrap();
        assert_eq!(slots, vec![-1, 2, 3]);
        // A range wholly before the window is all padding and needs no blocks.
        let slots = compute_slot_mapping(&[], 4, 0, 2, Some((10, 8))).unwrap();
        assert_eq!(slots, vec![-1, -1]);
        // A window at least as long as the prompt pads nothing.
        let slots = compute_slot_mapping(&[0, 1], 4, 0, 6, Some((6, 8))).unwrap();
        assert_eq!(slots, vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn empty_range_is_empty() {
        assert_eq!(
            compute_slot_mapping(&[], 4, 3, 3, None).unwrap(),
            Vec::<i64>::new()
        );
    }

    #[test]
    fn short_table_is_an_error_not_a_panic() {
        assert_eq!(
            compute_slot_mapping(&[0], 4, 0, 5, None),
            Err(KvError::BlockTableTooShort {
                position: 4,
                block_index: 1,
                table_len: 1
            })
        );
        assert_eq!(slot_for_position(&[0], 4, 4), None);
        assert_eq!(slot_for_position(&[0], 0, 0), None);
        assert_eq!(
            compute_slot_mapping(&[0], 0, 0, 1, None),
            Err(KvError::ZeroBlockSize)
        );
        assert_eq!(
            compute_slot_mapping(&[0], 4, 3, 2, None),
            Err(KvError::InvalidRange { start: 3, end: 2 })
        );
    }

    #[test]
    fn errors_leave_the_output_untouched() {
        let mut out = vec![42];
        assert!(extend_slot_mapping(&mut out, &[0], 4, 0, 9, None).is_err());
        assert_eq!(out, vec![42]);
        extend_slot_mapping(&mut out, &[1], 4, 0, 2, None).unwrap();
        assert_eq!(out, vec![42, 4, 5]);
    }

    #[test]
    fn huge_slots_overflow_cleanly() {
        let bs = usize::MAX / 2;
        let r = compute_slot_mapping(&[u32::MAX, 0], bs, 0, 1, None);
        assert!(matches!(r, Err(KvError::SlotOverflow { .. })));
        // Two good slots in block 0, then block u32::MAX overflows: nothing is kept.
        let mut out = vec![7];
        let bs = 1usize << 40;
        let r = extend_slot_mapping(&mut out, &[0, u32::MAX], bs, bs - 2, bs + 2, None);
        assert_eq!(r, Err(KvError::SlotOverflow { position: bs }));
        assert_eq!(out, vec![7]);
    }
}
