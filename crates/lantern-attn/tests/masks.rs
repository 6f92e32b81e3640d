//! Sliding window, chunked-local attention, soft-cap and sinks, each checked for both
//! backends against a brute-force masked dense reference (tests/common), on batches
//! that mix decodes, fresh prompts and continuing chunked prefills.

mod common;

use common::*;
use lantern_attn::{
    AttentionBackend, AttentionLayerSpec, CpuFlashBackend, CpuReferenceBackend, FlashTuning,
};
use lantern_kv::KvDtype;

fn reqs() -> Vec<Req> {
    let r = |num_computed, query_len| Req {
        num_computed,
        query_len,
    };
    vec![r(40, 1), r(7, 1), r(0, 37), r(23, 19), r(64, 9)]
}

fn backends() -> Vec<Box<dyn AttentionBackend>> {
    let small_tiles = FlashTuning {
        query_tile: 3,
        split_keys: 4,
    };
    vec![
        Box::new(CpuReferenceBackend::new()),
        Box::new(CpuFlashBackend::new()),
        Box::new(CpuFlashBackend::new().with_tuning(small_tiles).unwrap()),
    ]
}

/// Runs every backend on `layer` for several block sizes and cache types and compares
/// with the dense masked reference. A chunked-local layer runs through virtual batches,
/// which need the chunk to be a multiple of the block size: other block sizes are
/// skipped (their error is tested in tests/chunked_local.rs).
fn check_layer(layer: &AttentionLayerSpec, slot_window: Option<usize>) {
    let block_sizes = [(1u64, 4usize), (2, 5), (3, 16), (4, 1), (5, 2)];
    let usable = block_sizes.into_iter().filter(|&(_, bs)| {
        layer
            .chunk_size
            .is_none_or(|c| c.checked_rem(bs) == Some(0))
    });
    for (seed, block_size) in usable {
        let batch = make_batch(seed, layer, block_size, &reqs(), 4);
        for dtype in [KvDtype::F32, KvDtype::BF16] {
            let expected = dense_attention(layer, &batch, dtype);
            for backend in backends() {
                let (out, _) =
                    run_backend(backend.as_ref(), layer, &batch, dtype, slot_window).unwrap();
                let err = max_rel_error(&out, &expected, layer.head_dim);
                assert!(
                    err < tolerance(dtype),
                    "{} bs={block_size} {dtype:?} {layer:?}: rel err {err}",
                    backend.name()
                );
            }
        }
    }
}

fn base() -> AttentionLayerSpec {
    AttentionLayerSpec::new(6, 2, 24)
}

#[test]
fn sliding_window() {
    for w in [1, 3, 8, 17] {
        let layer = AttentionLayerSpec {
            sliding_window: Some(w),
            ..base()
        };
        check_layer(&layer, None);
        // With the slot mapping padding tokens outside the last query's window, the
        // backends must take those tokens' K/V from the step's inputs.
        check_layer(&layer, Some(w));
    }
}

#[test]
fn chunked_local() {
    for c in [1, 4, 10, 32] {
        let layer = AttentionLayerSpec {
            chunk_size: Some(c),
            ..base()
        };
        check_layer(&layer, None);
    }
}

#[test]
fn soft_cap() {
    for cap in [0.5f32, 5.0, 30.0] {
        let layer = AttentionLayerSpec {
            logits_soft_cap: Some(cap),
            scale: 1.5,
            ..base()
        };
        check_layer(&layer, None);
    }
}

#[test]
fn sinks() {
    let layer = AttentionLayerSpec {
        sinks: Some(vec![-2.0, 0.0, 0.5, 3.0, 8.0, -1.0]),
        ..base()
    };
    check_layer(&layer, None);
}

#[test]
fn everything_at_once() {
    let layer = AttentionLayerSpec {
        sliding_window: Some(12),
        chunk_size: Some(16),
        logits_soft_cap: Some(2.0),
        sinks: Some(vec![1.0, -1.0, 0.0, 2.0, 0.3, -0.7]),
        scale: 0.9,
        ..base()
    };
    check_layer(&layer, Some(12));
}

/// Sink logits far above every score leave almost nothing for the keys: the output is
/// scaled down, not renormalized.
#[test]
fn dominant_sink_shrinks_output() {
    let layer = AttentionLayerSpec {
        sinks: Some(vec![40.0; 6]),
        ..base()
    };
    let batch = make_batch(9, &layer, 8, &reqs(), 0);
    for backend in backends() {
        let (out, _) = run_backend(backend.as_ref(), &layer, &batch, KvDtype::F32, None).unwrap();
        assert!(out.iter().all(|x| x.abs() < 1e-12), "{}", backend.name());
    }
}
