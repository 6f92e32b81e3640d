//! Bad inputs to `forward` are errors, never panics, for every backend.

mod common;

use std::sync::Arc;

use common::*;
use lantern_attn::{
    backend_by_name, AttentionLayerSpec, AttnError, CacheGeometry, CommonAttentionMetadata,
    KvCacheLayout, KvCacheShape, LayerKvCache, PagedKvCache, ScheduledSeq, BACKEND_NAMES,
};
use lantern_kv::KvDtype;

struct Setup {
    layer: AttentionLayerSpec,
    common: CommonAttentionMetadata,
    q: Vec<f32>,
    kv: Vec<f32>,
}

fn setup() -> Setup {
    let layer = AttentionLayerSpec::new(4, 2, 8);
    let table = [3, 1];
    let seqs = [ScheduledSeq {
        num_computed_tokens: 2,
        num_scheduled_tokens: 3,
        block_table: &table,
        slot_window: None,
    }];
    let common = CommonAttentionMetadata::build(&seqs, 4).unwrap();
    Setup {
        q: vec![0.1; 3 * 4 * 8],
        kv: vec![0.2; 3 * 2 * 8],
        layer,
        common,
    }
}

fn geom(num_blocks: usize) -> CacheGeometry {
    CacheGeometry {
        num_blocks,
        block_size: 4,
        num_kv_heads: 2,
        head_dim: 8,
    }
}

#[test]
fn forward_rejects_bad_input() {
    for name in BACKEND_NAMES {
        let backend = backend_by_name(name).unwrap();
        let layout = backend.kv_cache_layout();
        let fresh = || PagedKvCache::new(geom(4), layout, KvDtype::F32).unwrap();
        let run = |s: &mut Setup, cache: &mut dyn LayerKvCache| {
            let meta = backend.build_metadata(Arc::new(s.common.clone()));
            forward_slices(backend.as_ref(), &s.layer, &meta, &s.q, &s.kv, &s.kv, cache)
        };

        let mut s = setup();
        let out = run(&mut s, &mut fresh()).unwrap();
        assert_eq!(out.len(), 3 * 4 * 8);
        assert!(out.iter().all(|x| x.is_finite()));

        let mut s = setup();
        s.q.pop();
        assert!(matches!(
            run(&mut s, &mut fresh()),
            Err(AttnError::ShapeMismatch { what: "q", .. })
        ));

        // One token too many for the metadata's three.
        let mut s = setup();
        s.q.extend([0.1; 4 * 8]);
        assert!(matches!(
            run(&mut s, &mut fresh()),
            Err(AttnError::ShapeMismatch { what: "q", .. })
        ));

        let mut s = setup();
        s.kv.truncate(8);
        assert!(run(&mut s, &mut fresh()).is_err());

        let mut s = setup();
        s.layer.num_kv_heads = 4;
        assert!(run(&mut s, &mut fresh()).is_err());

        let mut s = setup();
        s.layer.num_heads = 3;
        assert!(matches!(
            run(&mut s, &mut fresh()),
            Err(AttnError::InvalidLayerSpec(_))
        ));

        let mut s = setup();
        s.common.causal = false;
        assert!(matches!(
            run(&mut s, &mut fresh()),
            Err(AttnError::Unsupported(_))
        ));

        let mut s = setup();
        s.common.seq_lens[0] = 9;
        assert!(matches!(
            run(&mut s, &mut fresh()),
            Err(AttnError::InvalidMetadata(_))
        ));

        let mut s = setup();
        s.common.query_start_loc = vec![0, 7];
        assert!(run(&mut s, &mut fresh()).is_err());

        // Block 3 does not exist in a 3-block cache.
        let mut s = setup();
        let mut small = PagedKvCache::new(geom(3), layout, KvDtype::F32).unwrap();
        assert!(matches!(
            run(&mut s, &mut small),
            Err(AttnError::BlockOutOfRange { block: 3, .. })
        ));

        // A cache allocated with another layout.
        let other = if layout == KvCacheLayout::contiguous(KvCacheShape::KvFirst) {
            KvCacheLayout::hnd(KvCacheShape::BlocksFirst)
        } else {
            KvCacheLayout::contiguous(KvCacheShape::KvFirst)
        };
        let mut s = setup();
        let mut wrong = PagedKvCache::new(geom(4), other, KvDtype::F32).unwrap();
        assert!(matches!(
            run(&mut s, &mut wrong),
            Err(AttnError::LayoutMismatch { .. })
        ));

        // Block size of the metadata differs from the cache's.
        let mut s = setup();
        let mut other_bs = PagedKvCache::new(
            CacheGeometry {
                block_size: 8,
                ..geom(4)
            },
            layout,
            KvDtype::F32,
        )
        .unwrap();
        assert!(matches!(
            run(&mut s, &mut other_bs),
            Err(AttnError::Mismatch(_))
        ));
    }
}

#[test]
fn empty_batch_is_fine() {
    for name in BACKEND_NAMES {
        let backend = backend_by_name(name).unwrap();
        let layer = AttentionLayerSpec::new(2, 1, 4);
        let common = CommonAttentionMetadata::build(&[], 4).unwrap();
        let meta = backend.build_metadata(Arc::new(common));
        let g = CacheGeometry {
            num_blocks: 1,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 4,
        };
        let mut cache = backend.allocate_cache(g, KvDtype::F16).unwrap();
        let out = forward_slices(
            backend.as_ref(),
            &layer,
            &meta,
            &[],
            &[],
            &[],
            cache.as_mut(),
        )
        .unwrap();
        assert!(out.is_empty());
        let _ = rng(0);
    }
}

/// A released block (`NULL_BLOCK`) is accepted only where no query of the step can see
/// it; anywhere else it is an error, never an out-of-bounds read.
#[test]
fn released_blocks_only_behind_the_window() {
    for name in BACKEND_NAMES {
        let backend = backend_by_name(name).unwrap();
        let layout = backend.kv_cache_layout();
        let mut layer = AttentionLayerSpec::new(4, 2, 8);
        layer.sliding_window = Some(4);
        let run = |table: &[u32], layer: &AttentionLayerSpec| {
            // Positions 0..12 computed, one decode at 12: it sees keys 9..=12.
            let seqs = [ScheduledSeq {
                num_computed_tokens: 12,
                num_scheduled_tokens: 1,
                block_table: table,
                slot_window: None,
            }];
            let common = CommonAttentionMetadata::build(&seqs, 4).unwrap();
            let meta = backend.build_metadata(Arc::new(common));
            let mut cache = PagedKvCache::new(geom(4), layout, KvDtype::F32).unwrap();
            let (q, kv) = (vec![0.1; 4 * 8], vec![0.2; 2 * 8]);
            forward_slices(backend.as_ref(), layer, &meta, &q, &kv, &kv, &mut cache)
        };
        let null = lantern_kv::NULL_BLOCK;
        run(&[null, null, 0, 1], &layer).unwrap();
        assert!(matches!(
            run(&[null, null, null, 1], &layer),
            Err(AttnError::BlockOutOfRange { .. })
        ));
        layer.sliding_window = None;
        assert!(matches!(
            run(&[null, null, 0, 1], &layer),
            Err(AttnError::BlockOutOfRange { .. })
        ));
    }
}

/// A cache of a type no CPU backend allocates, standing in for another backend's.
#[derive(Debug)]
struct ForeignCache {
    inner: PagedKvCache,
}

impl LayerKvCache for ForeignCache {
    fn geometry(&self) -> &CacheGeometry {
        self.inner.geometry()
    }
    fn layout(&self) -> &KvCacheLayout {
        self.inner.layout()
    }
    fn dtype(&self) -> KvDtype {
        self.inner.dtype()
    }
    fn size_bytes(&self) -> usize {
        self.inner.size_bytes()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
}

/// A backend handed a cache it did not allocate says so, for forward and for key reads,
/// even when the foreign cache has the right geometry and layout.
#[test]
fn another_backends_cache_is_refused() {
    for name in BACKEND_NAMES {
        let backend = backend_by_name(name).unwrap();
        let inner = PagedKvCache::new(geom(4), backend.kv_cache_layout(), KvDtype::F32).unwrap();
        let mut foreign = ForeignCache { inner };
        let s = setup();
        let meta = backend.build_metadata(Arc::new(s.common.clone()));
        let err = forward_slices(
            backend.as_ref(),
            &s.layer,
            &meta,
            &s.q,
            &s.kv,
            &s.kv,
            &mut foreign,
        )
        .unwrap_err();
        assert!(matches!(err, AttnError::ForeignCache { .. }), "{err:?}");
        assert!(err.to_string().contains(name), "{err}");
        let mut keys = vec![0.0; 2 * 8];
        assert!(matches!(
            backend.read_slots(&foreign, &[0], &mut keys, None),
            Err(AttnError::ForeignCache { .. })
        ));
    }
}
