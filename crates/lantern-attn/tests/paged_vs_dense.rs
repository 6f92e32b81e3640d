//! Paged attention through every backend and layout equals dense causal attention
//! computed directly, on random batches: mixed decodes and (chunked) prefills, block
//! sizes 1..=32, GQA ratios including MQA, shuffled block tables, f32/f16/bf16 caches.

mod common;

use common::*;
use lantern_attn::{
    AttentionBackend, AttentionLayerSpec, CpuFlashBackend, CpuReferenceBackend, FlashTuning,
    KvCacheLayout,
};
use lantern_kv::KvDtype;
use proptest::prelude::*;

#[derive(Debug, Clone)]
struct Params {
    num_kv_heads: usize,
    group: usize,
    head_dim: usize,
    block_size: usize,
    reqs: Vec<Req>,
    extra_blocks: usize,
    seed: u64,
    tuning: FlashTuning,
}

fn req_strategy() -> impl Strategy<Value = Req> {
    let decode = (0usize..=60).prop_map(|c| Req {
        num_computed: c,
        query_len: 1,
    });
    let prefill = (0usize..=1).prop_flat_map(|fresh| {
        let computed = if fresh == 0 { 0..=0usize } else { 1..=40usize };
        (computed, 2usize..=30).prop_map(|(c, q)| Req {
            num_computed: c,
            query_len: q,
        })
    });
    prop_oneof![decode, prefill]
}

fn params() -> impl Strategy<Value = Params> {
    (
        1usize..=3,
        prop_oneof![Just(1usize), Just(2), Just(3), Just(4)],
        prop_oneof![
            Just(1usize),
            Just(4),
            Just(16),
            Just(20),
            Just(33),
            Just(64)
        ],
        1usize..=32,
        prop::collection::vec(req_strategy(), 1..=4),
        0usize..=8,
        any::<u64>(),
        (1usize..=8, 1usize..=16),
    )
        .prop_map(
            |(num_kv_heads, group, head_dim, block_size, reqs, extra_blocks, seed, t)| Params {
                num_kv_heads,
                group,
                head_dim,
                block_size,
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
    let layer = AttentionLayerSpec::new(p.num_kv_heads * p.group, p.num_kv_heads, p.head_dim);
    let batch = make_batch(p.seed, &layer, p.block_size, &p.reqs, p.extra_blocks);
    let expected_f32 = dense_attention(&layer, &batch, KvDtype::F32);
    // f32 through every layout (incl. a random stride order); the defaults are in there.
    for layout in layouts(&[random_order(p.seed)]) {
        for backend in backends_for(layout, p.tuning) {
            let (out, _) =
                run_backend(backend.as_ref(), &layer, &batch, KvDtype::F32, None).unwrap();
            let err = max_rel_error(&out, &expected_f32, p.head_dim);
            prop_assert!(
                err < tolerance(KvDtype::F32),
                "{} {layout:?}: rel err {err}",
                backend.name()
            );
        }
    }
    // Half-precision caches against dense attention on the rounded values, through one
    // packed (HND) and one strided (identity) layout.
    for dtype in [KvDtype::F16, KvDtype::BF16] {
        let expected = dense_attention(&layer, &batch, dtype);
        for layout in [
            KvCacheLayout::hnd(lantern_attn::KvCacheShape::BlocksFirst),
            KvCacheLayout::contiguous(lantern_attn::KvCacheShape::KvFirst),
        ] {
            for backend in backends_for(layout, p.tuning) {
                let (out, _) = run_backend(backend.as_ref(), &layer, &batch, dtype, None).unwrap();
                let err = max_rel_error(&out, &expected, p.head_dim);
                prop_assert!(
                    err < tolerance(dtype),
                    "{} {dtype:?} {layout:?}: rel err {err}",
                    backend.name()
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn paged_attention_equals_dense(p in params()) {
        check(&p)?;
    }
}

/// One decode over a long context: few work items, so the flash backend splits the key
/// range with its default tuning and merges partial softmax states.
#[test]
fn long_context_decode_splits_keys() {
    for (kv_heads, group) in [(1, 8), (2, 2)] {
        let layer = AttentionLayerSpec::new(kv_heads * group, kv_heads, 64);
        let reqs = [Req {
            num_computed: 3000,
            query_len: 1,
        }];
        let batch = make_batch(7, &layer, 16, &reqs, 5);
        let expected = dense_attention(&layer, &batch, KvDtype::F32);
        for backend in [
            Box::new(CpuFlashBackend::new()) as Box<dyn AttentionBackend>,
            Box::new(CpuReferenceBackend::new()),
        ] {
            let (out, _) =
                run_backend(backend.as_ref(), &layer, &batch, KvDtype::F32, None).unwrap();
            let err = max_rel_error(&out, &expected, 64);
            assert!(err < 1e-5, "{}: {err}", backend.name());
        }
    }
}

/// A long prompt: many query tiles spread over threads.
#[test]
fn long_prefill_matches_dense() {
    let layer = AttentionLayerSpec::new(4, 2, 32);
    let reqs = [
        Req {
            num_computed: 0,
            query_len: 300,
        },
        Req {
            num_computed: 200,
            query_len: 1,
        },
    ];
    let batch = make_batch(11, &layer, 16, &reqs, 3);
    let expected = dense_attention(&layer, &batch, KvDtype::F32);
    let (out, _) =
        run_backend(&CpuFlashBackend::new(), &layer, &batch, KvDtype::F32, None).unwrap();
    assert!(max_rel_error(&out, &expected, 32) < 1e-5);
}
