//! KV cache layouts: the logical shape a backend declares for one layer's cache tensor,
//! and the order in which those logical dimensions are laid out in memory.
//!
//! Layouts are types, never guessed from shapes: a tensor of shape `[2, 2, 16, 8, 64]`
//! could be either shape below, so every reader of the cache (the cache write, the
//! backends, attention capture) asks the [`KvCacheLayout`] where an element lives.
//!
//! The stride order follows vLLM's `get_kv_cache_stride_order`: it is the permutation
//! of logical dimensions into physical memory order. Physical dimension `j` is logical
//! dimension `stride_order[j]`, so the last entry names the fastest-moving dimension.
//! The identity order means "contiguous in the logical shape".

use crate::error::AttnError;

/// Number of dimensions of a KV cache tensor.
pub const KV_CACHE_RANK: usize = 5;

/// Logical dimension indices shared by both shapes, after the leading pair
/// (`kv`/`block` in one order or the other).
const DIM_IN_BLOCK: usize = 2;
const DIM_HEAD: usize = 3;
const DIM_HEAD_DIM: usize = 4;

/// The logical shape of one layer's cache tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvCacheShape {
    /// `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K plane, then V plane).
    KvFirst,
    /// `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (K and V of a block together).
    BlocksFirst,
}

impl KvCacheShape {
    /// Logical indices of the `kv` and `block` dimensions for this shape.
    fn kv_and_block_dims(self) -> (usize, usize) {
        match self {
            KvCacheShape::KvFirst => (0, 1),
            KvCacheShape::BlocksFirst => (1, 0),
        }
    }
}

/// Sizes of one layer's paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CacheGeometry {
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl CacheGeometry {
    /// Checks that every dimension except `num_blocks` is non-zero and that the whole
    /// tensor's element count fits in `usize`.
    pub fn validate(&self) -> Result<(), AttnError> {
        if self.block_size == 0 || self.num_kv_heads == 0 || self.head_dim == 0 {
            return Err(AttnError::InvalidGeometry(format!(
                "block_size, num_kv_heads and head_dim must be non-zero: {self:?}"
            )));
        }
        self.num_elements().map(|_| ())
    }

    /// Number of token slots (`num_blocks * block_size`).
    pub fn num_slots(&self) -> Result<usize, AttnError> {
        self.num_blocks
            .checked_mul(self.block_size)
            .ok_or_else(|| overflow(self))
    }

    /// Elements in one token's K (or V) row: `num_kv_heads * head_dim`.
    pub fn token_row_len(&self) -> usize {
        self.num_kv_heads.saturating_mul(self.head_dim)
    }

    /// Elements in the whole tensor (K and V).
    pub fn num_elements(&self) -> Result<usize, AttnError> {
        [
            self.num_blocks,
            self.block_size,
            self.num_kv_heads,
            self.head_dim,
        ]
        .iter()
        .try_fold(2usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| overflow(self))
    }
}

fn overflow(geom: &CacheGeometry) -> AttnError {
    AttnError::InvalidGeometry(format!("tensor size overflows usize: {geom:?}"))
}

/// A backend's cache layout: logical shape plus physical stride order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvCacheLayout {
    pub shape: KvCacheShape,
    /// Permutation of logical dims into physical memory order (vLLM's stride order).
    pub stride_order: [usize; KV_CACHE_RANK],
}

impl KvCacheLayout {
    /// The identity stride order: memory is contiguous in the logical shape.
    pub const IDENTITY_ORDER: [usize; KV_CACHE_RANK] = [0, 1, 2, 3, 4];
    /// "HND" order: the kv-head dim is placed before the in-block position, so one
    /// head's `block_size x head_dim` tile of a block is contiguous.
    pub const HND_ORDER: [usize; KV_CACHE_RANK] = [0, 1, 3, 2, 4];

    /// A validated layout.
    pub fn new(
        shape: KvCacheShape,
        stride_order: [usize; KV_CACHE_RANK],
    ) -> Result<Self, AttnError> {
        let layout = Self {
            shape,
            stride_order,
        };
        layout.validate()?;
        Ok(layout)
    }

    /// `shape` stored contiguously in its logical order.
    pub fn contiguous(shape: KvCacheShape) -> Self {
        Self {
            shape,
            stride_order: Self::IDENTITY_ORDER,
        }
    }

    /// `shape` with the HND stride order (see [`Self::HND_ORDER`]).
    pub fn hnd(shape: KvCacheShape) -> Self {
        Self {
            shape,
            stride_order: Self::HND_ORDER,
        }
    }

    /// Checks that `stride_order` is a permutation of `0..5`.
    pub fn validate(&self) -> Result<(), AttnError> {
        let mut seen = [false; KV_CACHE_RANK];
        for &d in &self.stride_order {
            match seen.get_mut(d) {
                Some(s) if !*s => *s = true,
                _ => {
                    return Err(AttnError::InvalidLayout(format!(
                        "stride order {:?} is not a permutation of 0..{KV_CACHE_RANK}",
                        self.stride_order
                    )))
                }
            }
        }
        Ok(())
    }

    /// The logical shape of the tensor for `geom`.
    pub fn logical_shape(&self, geom: &CacheGeometry) -> [usize; KV_CACHE_RANK] {
        let tail = [geom.block_size, geom.num_kv_heads, geom.head_dim];
        match self.shape {
            KvCacheShape::KvFirst => [2, geom.num_blocks, tail[0], tail[1], tail[2]],
            KvCacheShape::BlocksFirst => [geom.num_blocks, 2, tail[0], tail[1], tail[2]],
        }
    }

    /// The shape of the tensor as laid out in memory (logical dims in stride order).
    pub fn physical_shape(&self, geom: &CacheGeometry) -> [usize; KV_CACHE_RANK] {
        let logical = self.logical_shape(geom);
        self.stride_order
            .map(|d| logical.get(d).copied().unwrap_or(1))
    }

    /// Element strides of the logical dimensions.
    ///
    /// Meaningful only for a layout that passes [`Self::validate`]; for any other it
    /// returns some value without panicking.
    pub fn strides(&self, geom: &CacheGeometry) -> [usize; KV_CACHE_RANK] {
        let logical = self.logical_shape(geom);
        let mut strides = [0usize; KV_CACHE_RANK];
        let mut acc = 1usize;
        for &d in self.stride_order.iter().rev() {
            if let Some(s) = strides.get_mut(d) {
                *s = acc;
            }
            acc = acc.wrapping_mul(logical.get(d).copied().unwrap_or(1));
        }
        strides
    }

    /// Strides of the named dimensions, independent of the logical shape's order.
    pub fn named_strides(&self, geom: &CacheGeometry) -> NamedStrides {
        let s = self.strides(geom);
        let (kv, block) = self.shape.kv_and_block_dims();
        NamedStrides {
            kv: s[kv],
            block: s[block],
            in_block: s[DIM_IN_BLOCK],
            head: s[DIM_HEAD],
            dim: s[DIM_HEAD_DIM],
        }
    }

    /// Element offset of `(kv, block, in_block, head, dim)`; `kv` is 0 for K, 1 for V.
    ///
    /// Does no range checks (it is on the hot path): indices outside `geom` give an
    /// offset outside the tensor. [`Self::checked_offset`] checks them.
    pub fn offset(
        &self,
        geom: &CacheGeometry,
        kv: usize,
        block: usize,
        in_block: usize,
        head: usize,
        dim: usize,
    ) -> usize {
        self.named_strides(geom)
            .offset(kv, block, in_block, head, dim)
    }

    /// [`Self::offset`] after checking every index against `geom`.
    pub fn checked_offset(
        &self,
        geom: &CacheGeometry,
        kv: usize,
        block: usize,
        in_block: usize,
        head: usize,
        dim: usize,
    ) -> Result<usize, AttnError> {
        if kv >= 2 {
            return Err(AttnError::InvalidLayout(format!(
                "kv index {kv} is not 0 (K) or 1 (V)"
            )));
        }
        if block >= geom.num_blocks {
            return Err(AttnError::BlockOutOfRange {
                block: block as u64,
                num_blocks: geom.num_blocks,
            });
        }
        if head >= geom.num_kv_heads {
            return Err(AttnError::HeadOutOfRange {
                head,
                num_kv_heads: geom.num_kv_heads,
            });
        }
        if in_block >= geom.block_size || dim >= geom.head_dim {
            return Err(AttnError::InvalidLayout(format!(
                "in-block position {in_block} / dim {dim} outside block_size {} / head_dim {}",
                geom.block_size, geom.head_dim
            )));
        }
        Ok(self.offset(geom, kv, block, in_block, head, dim))
    }
}

/// Element strides of a cache tensor by dimension name. Computed once per cache so the
/// hot paths do not re-derive them from the stride order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NamedStrides {
    pub kv: usize,
    pub block: usize,
    pub in_block: usize,
    pub head: usize,
    pub dim: usize,
}

impl NamedStrides {
    /// Element offset of `(kv, block, in_block, head, dim)` (no range checks; wrapping
    /// arithmetic so that garbage indices cannot panic in debug builds).
    #[inline]
    pub fn offset(
        &self,
        kv: usize,
        block: usize,
        in_block: usize,
        head: usize,
        dim: usize,
    ) -> usize {
        kv.wrapping_mul(self.kv)
            .wrapping_add(block.wrapping_mul(self.block))
            .wrapping_add(in_block.wrapping_mul(self.in_block))
            .wrapping_add(head.wrapping_mul(self.head))
            .wrapping_add(dim.wrapping_mul(self.dim))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GEOM: CacheGeometry = CacheGeometry {
        num_blocks: 3,
        block_size: 4,
        num_kv_heads: 2,
        head_dim: 5,
    };

    #[test]
    fn identity_strides_are_row_major() {
        let l = KvCacheLayout::contiguous(KvCacheShape::KvFirst);
        assert_eq!(l.logical_shape(&GEOM), [2, 3, 4, 2, 5]);
        assert_eq!(l.strides(&GEOM), [120, 40, 10, 5, 1]);
        let l = KvCacheLayout::contiguous(KvCacheShape::BlocksFirst);
        assert_eq!(l.logical_shape(&GEOM), [3, 2, 4, 2, 5]);
        assert_eq!(l.strides(&GEOM), [80, 40, 10, 5, 1]);
    }

    #[test]
    fn hnd_puts_head_before_position() {
        let l = KvCacheLayout::hnd(KvCacheShape::BlocksFirst);
        assert_eq!(l.physical_shape(&GEOM), [3, 2, 2, 4, 5]);
        // in_block stride is head_dim, head stride is block_size * head_dim.
        assert_eq!(l.strides(&GEOM), [80, 40, 5, 20, 1]);
        let s = l.named_strides(&GEOM);
        assert_eq!(
            (s.kv, s.block, s.in_block, s.head, s.dim),
            (40, 80, 5, 20, 1)
        );
    }

    #[test]
    fn offsets_cover_the_tensor_exactly_once() {
        for shape in [KvCacheShape::KvFirst, KvCacheShape::BlocksFirst] {
            for order in [
                [0, 1, 2, 3, 4],
                [0, 1, 3, 2, 4],
                [4, 3, 2, 1, 0],
                [2, 0, 4, 1, 3],
            ] {
                let l = KvCacheLayout::new(shape, order).unwrap();
                let n = GEOM.num_elements().unwrap();
                let mut seen = vec![false; n];
                for kv in 0..2 {
                    for b in 0..GEOM.num_blocks {
                        for p in 0..GEOM.block_size {
                            for h in 0..GEOM.num_kv_heads {
                                for d in 0..GEOM.head_dim {
                                    let o = l.checked_offset(&GEOM, kv, b, p, h, d).unwrap();
                                    assert!(!seen[o]);
                                    seen[o] = true;
                                }
                            }
                        }
                    }
                }
                assert!(seen.iter().all(|&s| s));
            }
        }
    }

    #[test]
    fn rejects_non_permutations() {
        assert!(KvCacheLayout::new(KvCacheShape::KvFirst, [0, 0, 1, 2, 3]).is_err());
        assert!(KvCacheLayout::new(KvCacheShape::KvFirst, [0, 1, 2, 3, 5]).is_err());
        // Never panics, even on an invalid layout.
        let bad = KvCacheLayout {
            shape: KvCacheShape::KvFirst,
            stride_order: [9, 9, 9, 9, 9],
        };
        let _ = bad.strides(&GEOM);
        let _ = bad.physical_shape(&GEOM);
    }

    #[test]
    fn checked_offset_rejects_out_of_range() {
        let l = KvCacheLayout::contiguous(KvCacheShape::KvFirst);
        assert!(l.checked_offset(&GEOM, 2, 0, 0, 0, 0).is_err());
        assert!(l.checked_offset(&GEOM, 0, 3, 0, 0, 0).is_err());
        assert!(l.checked_offset(&GEOM, 0, 0, 4, 0, 0).is_err());
        assert!(l.checked_offset(&GEOM, 0, 0, 0, 2, 0).is_err());
        assert!(l.checked_offset(&GEOM, 0, 0, 0, 0, 5).is_err());
    }
}
