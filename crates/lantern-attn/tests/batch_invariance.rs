//! A request's attention output is bit-identical alone and inside any batch: the engine
//! relies on it for greedy outputs that do not depend on what else runs.

mod common;

use common::{alone, make_batch, run_backend, Req};
use lantern_attn::{AttentionBackend, AttentionLayerSpec, CpuFlashBackend, CpuReferenceBackend};
use lantern_kv::KvDtype;

#[test]
fn output_rows_do_not_depend_on_the_batch() {
    let layer = AttentionLayerSpec::new(9, 3, 64);
    let reqs = [
        Req {
            num_computed: 1500,
            query_len: 1,
        },
        Req {
            num_computed: 40,
            query_len: 1,
        },
        Req {
            num_computed: 0,
            query_len: 600,
        },
        Req {
            num_computed: 700,
            query_len: 33,
        },
        Req {
            num_computed: 3,
            query_len: 1,
        },
    ];
    let batch = make_batch(11, &layer, 16, &reqs, 5);
    let backends: Vec<Box<dyn AttentionBackend>> = vec![
        Box::new(CpuFlashBackend::new()),
        Box::new(CpuReferenceBackend::new()),
    ];
    for backend in &backends {
        for dtype in [KvDtype::F32, KvDtype::BF16] {
            let (together, _) = run_backend(backend.as_ref(), &layer, &batch, dtype, None).unwrap();
            let row = layer.num_heads * layer.head_dim;
            for r in 0..reqs.len() {
                let (single, tokens) = alone(&batch, r, &layer);
                let (out, _) = run_backend(backend.as_ref(), &layer, &single, dtype, None).unwrap();
                let expected = &together[tokens.start * row..tokens.end * row];
                assert!(
                    out.iter()
                        .zip(expected)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{} {dtype:?}: request {r} differs alone and in the batch",
                    backend.name()
                );
            }
        }
    }
}

/// A row's output is the same bits whatever the query tile: items of one token (whose
/// rows the flash kernel takes one by one) and of many (whose rows it takes together,
/// from transposed keys) give each row the same operations, with plain, soft-capped,
/// sink and sliding-window layers, head dims on and off the 16-lane chunks, and
/// contexts short and long.
#[test]
fn output_rows_do_not_depend_on_the_query_tile() {
    use lantern_attn::FlashTuning;
    let mut plain = AttentionLayerSpec::new(9, 3, 64);
    plain.scale = 0.37;
    let mut gemma = AttentionLayerSpec::new(8, 1, 128);
    gemma.logits_soft_cap = Some(20.0);
    gemma.sinks = Some((0..8).map(|h| h as f32 * 0.4 - 1.0).collect());
    gemma.sliding_window = Some(45);
    let narrow = AttentionLayerSpec::new(4, 4, 16);
    let odd = AttentionLayerSpec::new(6, 2, 80);
    let reqs = [
        Req {
            num_computed: 0,
            query_len: 70,
        },
        Req {
            num_computed: 500,
            query_len: 33,
        },
        Req {
            num_computed: 90,
            query_len: 1,
        },
        // Past 1,024 keys: query tiles four times the tuning's.
        Req {
            num_computed: 1100,
            query_len: 40,
        },
    ];
    for (name, layer) in [
        ("plain", plain),
        ("gemma", gemma),
        ("narrow", narrow),
        ("odd", odd),
    ] {
        let batch = make_batch(23, &layer, 16, &reqs, 3);
        let mut outputs = Vec::new();
        for query_tile in [1, 2, 16, 64] {
            let tuning = FlashTuning {
                query_tile,
                ..FlashTuning::default()
            };
            let backend = CpuFlashBackend::new().with_tuning(tuning).unwrap();
            let (out, _) = run_backend(&backend, &layer, &batch, KvDtype::F16, None).unwrap();
            outputs.push((query_tile, out));
        }
        for (tile, out) in &outputs[1..] {
            let same = out
                .iter()
                .zip(&outputs[0].1)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name}: query tile {tile} differs from query tile 1");
        }
    }
}
