//! How the KV cache memory is laid out: which layers share a block table (groups) and
//! which raw byte buffers back which layers (tensors).
//!
//! The attention crate allocates one raw buffer per [`KvCacheTensor`] and views it per
//! layer through its backend's layout; this crate only does the arithmetic. Every layer
//! currently gets a tensor of its own with `num_blocks` pages. vLLM additionally lets the
//! i-th layers of different groups share one buffer when their page sizes agree, which
//! stops a hybrid model (full + sliding-window groups drawing from one block pool) from
//! leaving pages of the other groups unused; `shared_by` is a list so that can come
//! later without changing the type.

use crate::error::KvError;
use crate::spec::KvCacheSpec;

/// Layers with one spec: they share block tables and one metadata build per step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheGroup {
    pub spec: KvCacheSpec,
    /// Layer ids (indices into the model's layers), ascending.
    pub layer_ids: Vec<usize>,
}

/// One raw buffer of `size_bytes` bytes, viewed as a KV cache by every layer in
/// `shared_by`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheTensor {
    pub size_bytes: usize,
    /// Layer ids that read and write this buffer.
    pub shared_by: Vec<usize>,
}

/// The whole KV cache: block count, groups and buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// Blocks in the (one, shared) block pool.
    pub num_blocks: usize,
    /// Groups in order of their first layer.
    pub groups: Vec<KvCacheGroup>,
    /// One per layer, in layer order.
    pub tensors: Vec<KvCacheTensor>,
}

impl KvCacheConfig {
    /// As many blocks as fit in `budget_bytes` when every layer keeps `num_blocks` pages.
    ///
    /// `layer_specs[i]` is layer `i`'s spec. Errors when there are no layers, a spec is
    /// invalid, block sizes differ (one block id must address every layer), or not even
    /// one block fits (the error names the budget and the minimum).
    pub fn from_memory_budget(
        layer_specs: &[KvCacheSpec],
        budget_bytes: usize,
    ) -> Result<Self, KvError> {
        let per_block = Self::validate_specs(layer_specs)?;
        let num_blocks = budget_bytes / per_block;
        if num_blocks == 0 {
            return Err(KvError::BudgetTooSmall {
                budget_bytes,
                min_bytes: per_block,
            });
        }
        Self::build(layer_specs, num_blocks.min(crate::block_pool::MAX_BLOCKS))
    }

    /// A config with exactly `num_blocks` blocks (for tests and for callers that sized
    /// the cache themselves).
    pub fn with_num_blocks(
        layer_specs: &[KvCacheSpec],
        num_blocks: usize,
    ) -> Result<Self, KvError> {
        Self::validate_specs(layer_specs)?;
        if num_blocks == 0 {
            return Err(KvError::NoBlocks);
        }
        if num_blocks > crate::block_pool::MAX_BLOCKS {
            return Err(KvError::SizeOverflow {
                what: "num_blocks exceeds the block id range",
            });
        }
        Self::build(layer_specs, num_blocks)
    }

    /// Bytes one block costs across every layer (the sum of all page sizes).
    pub fn bytes_per_block_all_layers(&self) -> usize {
        self.groups
            .iter()
            .map(|g| g.spec.page_size_bytes().saturating_mul(g.layer_ids.len()))
            .fold(0usize, usize::saturating_add)
    }

    /// Total bytes of all tensors.
    pub fn total_bytes(&self) -> usize {
        self.tensors
            .iter()
            .map(|t| t.size_bytes)
            .fold(0usize, usize::saturating_add)
    }

    /// Number of layers covered.
    pub fn num_layers(&self) -> usize {
        self.groups.iter().map(|g| g.layer_ids.len()).sum()
    }

    /// Index of the group that holds `layer`, if any.
    pub fn group_of_layer(&self, layer: usize) -> Option<usize> {
        self.groups
            .iter()
            .position(|g| g.layer_ids.contains(&layer))
    }

    /// The block size shared by every group (`None` without groups).
    pub fn block_size(&self) -> Option<usize> {
        self.groups.first().map(|g| g.spec.block_size)
    }

    /// Validates the specs and returns the bytes of one block over all layers.
    fn validate_specs(layer_specs: &[KvCacheSpec]) -> Result<usize, KvError> {
        let first = layer_specs.first().ok_or(KvError::NoLayers)?;
        let mut per_block = 0usize;
        for (layer, spec) in layer_specs.iter().enumerate() {
            spec.validate(layer)?;
            if spec.block_size != first.block_size {
                return Err(KvError::MixedBlockSizes {
                    first: first.block_size,
                    other: spec.block_size,
                    layer,
                });
            }
            per_block =
                per_block
                    .checked_add(spec.page_size_bytes())
                    .ok_or(KvError::SizeOverflow {
                        what: "bytes per block over all layers",
                    })?;
        }
        Ok(per_block)
    }

    /// Groups equal specs in order of first appearance; one tensor per layer.
    fn build(layer_specs: &[KvCacheSpec], num_blocks: usize) -> Result<Self, KvError> {
        let mut groups: Vec<KvCacheGroup> = Vec::new();
        let mut tensors = Vec::with_capacity(layer_specs.len());
        for (layer, spec) in layer_specs.iter().enumerate() {
            match groups.iter_mut().find(|g| g.spec == *spec) {
                Some(g) => g.layer_ids.push(layer),
                None => groups.push(KvCacheGroup {
                    spec: *spec,
                    layer_ids: vec![layer],
                }),
            }
            let size_bytes =
                spec.page_size_bytes()
                    .checked_mul(num_blocks)
                    .ok_or(KvError::SizeOverflow {
                        what: "tensor size (num_blocks * page size)",
                    })?;
            tensors.push(KvCacheTensor {
                size_bytes,
                shared_by: vec![layer],
            });
        }
        Ok(Self {
            num_blocks,
            groups,
            tensors,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::KvDtype;

    fn full() -> KvCacheSpec {
        KvCacheSpec::full_attention(16, 2, 64, KvDtype::F16)
    }

    fn swa() -> KvCacheSpec {
        KvCacheSpec::sliding_window(512, 16, 2, 64, KvDtype::F16)
    }

    #[test]
    fn groups_equal_specs_in_order_of_first_appearance() {
        let specs = [swa(), full(), swa(), full(), swa()];
        let page = full().page_size_bytes();
        let cfg = KvCacheConfig::from_memory_budget(&specs, page * 5 * 10 + 7).unwrap();
        assert_eq!(cfg.num_blocks, 10);
        assert_eq!(cfg.groups.len(), 2);
        assert_eq!(cfg.groups[0].spec, swa());
        assert_eq!(cfg.groups[0].layer_ids, vec![0, 2, 4]);
        assert_eq!(cfg.groups[1].layer_ids, vec![1, 3]);
        assert_eq!(cfg.tensors.len(), 5);
        for (layer, t) in cfg.tensors.iter().enumerate() {
            assert_eq!(t.shared_by, vec![layer]);
            assert_eq!(t.size_bytes, 10 * page);
        }
        assert_eq!(cfg.bytes_per_block_all_layers(), 5 * page);
        assert_eq!(cfg.total_bytes(), 50 * page);
        assert_eq!(cfg.num_layers(), 5);
        assert_eq!(cfg.group_of_layer(3), Some(1));
        assert_eq!(cfg.group_of_layer(9), None);
        assert_eq!(cfg.block_size(), Some(16));
    }

    #[test]
    fn budget_too_small_names_budget_and_minimum() {
        let specs = [full(), full()];
        let min = 2 * full().page_size_bytes();
        let err = KvCacheConfig::from_memory_budget(&specs, min - 1).unwrap_err();
        assert_eq!(
            err,
            KvError::BudgetTooSmall {
                budget_bytes: min - 1,
                min_bytes: min
            }
        );
        let msg = err.to_string();
        assert!(msg.contains(&(min - 1).to_string()) && msg.contains(&min.to_string()));
        assert_eq!(
            KvCacheConfig::from_memory_budget(&specs, min)
                .unwrap()
                .num_blocks,
            1
        );
    }

    #[test]
    fn rejects_empty_and_mixed_block_sizes() {
        assert_eq!(
            KvCacheConfig::from_memory_budget(&[], 1 << 30),
            Err(KvError::NoLayers)
        );
        let mut other = swa();
        other.block_size = 32;
        assert_eq!(
            KvCacheConfig::from_memory_budget(&[full(), other], 1 << 30),
            Err(KvError::MixedBlockSizes {
                first: 16,
                other: 32,
                layer: 1
            })
        );
        let mut bad = full();
        bad.num_kv_heads = 0;
        assert!(matches!(
            KvCacheConfig::from_memory_budget(&[full(), bad], 1 << 30),
            Err(KvError::InvalidSpec { layer: 1, .. })
        ));
    }

    #[test]
    fn with_num_blocks_is_exact() {
        let cfg = KvCacheConfig::with_num_blocks(&[full()], 3).unwrap();
        assert_eq!(cfg.num_blocks, 3);
        assert_eq!(cfg.tensors[0].size_bytes, 3 * full().page_size_bytes());
        assert_eq!(
            KvCacheConfig::with_num_blocks(&[full()], 0),
            Err(KvError::NoBlocks)
        );
        assert!(KvCacheConfig::with_num_blocks(&[full()], usize::MAX).is_err());
    }
}
