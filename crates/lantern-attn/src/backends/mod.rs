//! The CPU attention backends and the pieces they share.
//!
//! Both backends read keys the same way: a key position of request `r` is looked up in
//! the cache through the block table, except for this step's tokens whose slot is
//! padding, which were never written and are taken from the step's own K/V (rounded to
//! the cache's element type so the result matches what the cache would have held).

pub mod cpu_flash;
pub mod cpu_reference;
pub(crate) mod kernels;

use std::ops::Range;

use lantern_kv::{BlockId, KvDtype};

use crate::cache::round_to_dtype;
use crate::metadata::CommonAttentionMetadata;

/// One request's slice of validated metadata.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RequestView<'a> {
    /// Batch rows of this request's step tokens.
    pub tokens: (usize, usize),
    pub num_computed: usize,
    pub table: &'a [BlockId],
    /// Slot mapping entries of this request's step tokens.
    pub slots: &'a [i64],
}

impl<'a> RequestView<'a> {
    /// Request `r` of `common`, which must have passed `validate` (so every index here
    /// is in range).
    pub fn new(common: &'a CommonAttentionMetadata, r: usize) -> Self {
        let (a, b) = (common.query_start_loc[r], common.query_start_loc[r + 1]);
        Self {
            tokens: (a, b),
            num_computed: common.num_computed_tokens[r],
            table: common.block_table.row(r),
            slots: &common.slot_mapping[a..b],
        }
    }

    /// Absolute position of batch row `row` (one of this request's tokens).
    #[inline]
    pub fn position(&self, row: usize) -> usize {
        self.num_computed + (row - self.tokens.0)
    }

    /// If key position `pos` is a step token whose slot is padding, its batch row.
    #[inline]
    pub fn padded_step_row(&self, pos: usize) -> Option<usize> {
        let i = pos.checked_sub(self.num_computed)?;
        match self.slots.get(i) {
            Some(&s) if s < 0 => Some(self.tokens.0 + i),
            _ => None,
        }
    }

    /// Whether any position in `positions` is a padded step token.
    pub fn any_padded(&self, positions: Range<usize>) -> bool {
        let lo = positions.start.max(self.num_computed) - self.num_computed;
        let hi = positions.end.max(self.num_computed) - self.num_computed;
        self.slots
            .get(lo..hi.min(self.slots.len()))
            .is_some_and(|s| s.iter().any(|&x| x < 0))
    }
}

/// Copies head `head` of step token `row` from `src` (`[tokens, kv_heads, head_dim]`)
/// into `out`, rounded to `dtype`.
pub(crate) fn load_step_row(
    src: &[f32],
    row: usize,
    head: usize,
    num_kv_heads: usize,
    dtype: KvDtype,
    out: &mut [f32],
) {
    let d = out.len();
    let start = (row * num_kv_heads + head) * d;
    out.copy_from_slice(&src[start..start + d]);
    round_to_dtype(out, dtype);
}
