//! Chunked-local attention (Llama 4) run through vLLM-style virtual batches equals a
//! brute-force dense masked reference (a query at `p` sees keys `k <= p` with
//! `k / C == p / C`, written out in tests/common), on random batches: mixed decodes and
//! (chunked) prefills whose sequences cross several chunks, chunk sizes that are
//! multiples of the block size, GQA, both backends, both cache shapes.

mod common;

use std::sync::Arc;

use common::*;
use lantern_attn::{
    make_local_attention_virtual_batches, AttentionBackend, AttentionLayerSpec, AttnError,
    CacheGeometry, CommonAttentionMetadata, CpuFlashBackend, CpuReferenceBackend, FlashTuning,
    KvCacheLayout, PagedKvCache, ScheduledSeq,
};
use lantern_kv::KvDtype;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Params {
    num_kv_heads: usize,
    group: usize,
    head_dim: usize,
    block_size: usize,
    /// Chunk size in blocks.
    blocks_per_chunk: usize,
    sliding_window: Option<usize>,
    sinks: bool,
    reqs: Vec<Req>,
    extra_blocks: usize,
    seed: u64,
    tuning: FlashTuning,
}

impl Params {
    fn chunk_size(&self) -> usize {
        self.block_size * self.blocks_per_chunk
    }

    fn layer(&self) -> AttentionLayerSpec {
        let heads = self.num_kv_heads * self.group;
        AttentionLayerSpec {
            chunk_size: Some(self.chunk_size()),
            sliding_window: self.sliding_window,
            sinks: self
                .sinks
                .then(|| (0..heads).map(|h| h as f32 * 0.7 - 1.0).collect()),
            ..AttentionLayerSpec::new(heads, self.num_kv_heads, self.head_dim)
        }
    }
}

/// Decodes over contexts of up to 90 tokens, fresh prompts and continuing chunks of
/// up to 60 tokens: with chunks of 1..=48 positions, most requests cross chunks.
fn req_strategy() -> impl Strategy<Value = Req> {
    let decode = (0usize..=90).prop_map(|c| Req {
        num_computed: c,
        query_len: 1,
    });
    let fresh = (2usize..=60).prop_map(|q| Req {
        num_computed: 0,
        query_len: q,
    });
    let continuing = (1usize..=60, 2usize..=40).prop_map(|(c, q)| Req {
        num_computed: c,
        query_len: q,
    });
    prop_oneof![decode, fresh, continuing]
}

fn params() -> impl Strategy<Value = Params> {
    (
        (1usize..=3, prop_oneof![Just(1usize), Just(2), Just(4)]),
        prop_oneof![Just(1usize), Just(4), Just(16), Just(33)],
        (1usize..=8, 1usize..=6),
        (
            prop_oneof![3 => Just(None), 1 => (1usize..=24).prop_map(Some)],
            any::<bool>(),
        ),
        prop::collection::vec(req_strategy(), 1..=5),
        0usize..=4,
        any::<u64>(),
        (1usize..=8, 1usize..=16),
    )
        .prop_map(
            |(
                (num_kv_heads, group),
                head_dim,
                (block_size, blocks_per_chunk),
                (sliding_window, sinks),
                reqs,
                extra_blocks,
                seed,
                t,
            )| Params {
                num_kv_heads,
                group,
                head_dim,
                block_size,
                blocks_per_chunk,
                sliding_window,
                sinks,
                reqs,
                extra_blocks,
                seed,
                tuning: FlashTuning {
                    query_tile: t.0,
                    split_keys: t.1,
                },
            },
        )
}

fn backends_for(layout: KvCacheLayout, tuning: FlashTuning) -> Vec<Box<dyn AttentionBackend>> {
    let flash = CpuFlashBackend::with_layout(layout).unwrap();
    vec![
        Box::new(CpuReferenceBackend::with_layout(layout).unwrap()),
        Box::new(flash),
        Box::new(flash.with_tuning(tuning).unwrap()),
    ]
}

fn check(p: &Params) -> Result<(), TestCaseError> {
    let layer = p.layer();
    let batch = make_batch(p.seed, &layer, p.block_size, &p.reqs, p.extra_blocks);
    let expected = dense_attention(&layer, &batch, KvDtype::F32);
    // KvFirst and BlocksFirst, each in identity and HND order.
    for layout in layouts(&[]) {
        for backend in backends_for(layout, p.tuning) {
            // Lazily: the first chunked-local layer builds the virtual batch.
            let (lazy, _) =
                run_backend(backend.as_ref(), &layer, &batch, KvDtype::F32, None).unwrap();
            let err = max_rel_error(&lazy, &expected, p.head_dim);
            prop_assert!(
                err < 1e-5,
                "{} {layout:?} chunk {}: rel err {err}",
                backend.name(),
                p.chunk_size()
            );
            // Eagerly, once per step per group: the same bits.
            let (eager, _) = run_backend_with(
                backend.as_ref(),
                &layer,
                &batch,
                KvDtype::F32,
                None,
                |common| backend.build_metadata_for(common, layer.chunk_size),
            )
            .unwrap();
            prop_assert!(
                lazy.iter()
                    .zip(&eager)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{}: eager and lazy virtual batches differ",
                backend.name()
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    #[test]
    fn chunked_local_paged_equals_dense_masked(p in params()) {
        check(&p)?;
    }
}

/// A long prompt over many chunks next to decodes at chunk boundaries (the first
/// position of a chunk sees only itself), with half-precision caches too.
#[test]
fn long_prompt_and_decodes_at_chunk_boundaries() {
    let layer = AttentionLayerSpec {
        chunk_size: Some(32),
        ..AttentionLayerSpec::new(8, 2, 64)
    };
    let r = |num_computed, query_len| Req {
        num_computed,
        query_len,
    };
    let reqs = [r(64, 1), r(95, 1), r(31, 1), r(0, 300), r(17, 150)];
    for block_size in [1, 8, 16, 32] {
        let batch = make_batch(5, &layer, block_size, &reqs, 2);
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16] {
            let expected = dense_attention(&layer, &batch, dtype);
            for layout in layouts(&[]) {
                for backend in backends_for(
                    layout,
                    FlashTuning {
                        query_tile: 5,
                        split_keys: 8,
                    },
                ) {
                    let (out, _) =
                        run_backend(backend.as_ref(), &layer, &batch, dtype, None).unwrap();
                    let err = max_rel_error(&out, &expected, 64);
                    assert!(
                        err < tolerance(dtype),
                        "{} bs {block_size} {dtype:?} {layout:?}: {err}",
                        backend.name()
                    );
                }
            }
        }
    }
}

/// A chunk size that is not a multiple of the block size is refused with a clear error
/// by both backends, before anything is written to the cache.
#[test]
fn chunk_not_a_multiple_of_block_size_is_refused() {
    let layer = AttentionLayerSpec {
        chunk_size: Some(6),
        ..AttentionLayerSpec::new(2, 1, 4)
    };
    let reqs = [Req {
        num_computed: 3,
        query_len: 5,
    }];
    let batch = make_batch(1, &layer, 4, &reqs, 0);
    let backends: [Box<dyn AttentionBackend>; 2] = [
        Box::new(CpuReferenceBackend::new()),
        Box::new(CpuFlashBackend::new()),
    ];
    for backend in backends {
        let geom = CacheGeometry {
            num_blocks: batch.num_blocks,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 4,
        };
        let mut cache = PagedKvCache::new(geom, backend.kv_cache_layout(), KvDtype::F32).unwrap();
        let before = cache.clone();
        let seqs = [ScheduledSeq {
            num_computed_tokens: 3,
            num_scheduled_tokens: 5,
            block_table: &batch.tables[0],
            slot_window: None,
        }];
        let common = Arc::new(CommonAttentionMetadata::build(&seqs, 4).unwrap());
        let meta = backend.build_metadata(Arc::clone(&common));
        let err = forward_slices(
            backend.as_ref(),
            &layer,
            &meta,
            &batch.q,
            &batch.k,
            &batch.v,
            &mut cache,
        )
        .unwrap_err();
        assert!(matches!(err, AttnError::Unsupported(_)), "{err:?}");
        assert!(
            err.to_string()
                .contains("chunk_size 6 is not a multiple of block_size 4"),
            "{err}"
        );
        assert!(cache == before, "{}: the cache was written", backend.name());
        assert!(backend.build_metadata_for(common, Some(6)).is_err());
    }
}

/// The virtual batch is built once per metadata and shared by every layer of the step.
#[test]
fn virtual_batch_is_cached_per_step() {
    let table: Vec<u32> = (0..10).collect();
    let seqs = [ScheduledSeq {
        num_computed_tokens: 5,
        num_scheduled_tokens: 30,
        block_table: &table,
        slot_window: None,
    }];
    let common = Arc::new(CommonAttentionMetadata::build(&seqs, 4).unwrap());
    let backend = CpuFlashBackend::new();
    let meta = backend.build_metadata(Arc::clone(&common));
    let a = meta.local_virtual_batch(8).unwrap();
    let b = meta.local_virtual_batch(8).unwrap();
    assert!(Arc::ptr_eq(&a, &b));
    assert_eq!(
        *a,
        make_local_attention_virtual_batches(8, &common).unwrap()
    );
    // Clones share the cache; another chunk size is computed, not served stale.
    assert!(Arc::ptr_eq(
        &meta.clone().local_virtual_batch(8).unwrap(),
        &a
    ));
    assert_eq!(meta.local_virtual_batch(16).unwrap().chunk_size, 16);
    // Metadata equality ignores the cache.
    assert_eq!(meta, backend.build_metadata(common));
    let eager = backend
        .build_metadata_for(Arc::clone(&meta.common), Some(8))
        .unwrap();
    assert_eq!(*eager.local_virtual_batch(8).unwrap(), *a);
}
