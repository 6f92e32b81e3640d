//! A request's attention output is bit-identical alone and inside any batch: the engine
//! relies on it for greedy outputs that do not depend on what else runs.

mod common;

use common::{make_batch, run_backend, Batch, Req};
use lantern_attn::{AttentionBackend, AttentionLayerSpec, CpuFlashBackend, CpuReferenceBackend};
use lantern_kv::KvDtype;

/// The batch made of request `r` of `batch` alone, same values and block table.
fn alone(batch: &Batch, r: usize, layer: &AttentionLayerSpec) -> (Batch, std::ops::Range<usize>) {
    let start: usize = batch.reqs[..r].iter().map(|q| q.query_len).sum();
    let tokens = start..start + batch.reqs[r].query_len;
    let (qrow, kvrow) = (
        layer.num_heads * layer.head_dim,
        layer.num_kv_heads * layer.head_dim,
    );
    let rows = |x: &[f32], w: usize| x[tokens.start * w..tokens.end * w].to_vec();
    let single = Batch {
        reqs: vec![batch.reqs[r]],
        block_size: batch.block_size,
        num_blocks: batch.num_blocks,
        tables: vec![batch.tables[r].clone()],
        ctx_k: vec![batch.ctx_k[r].clone()],
        ctx_v: vec![batch.ctx_v[r].clone()],
        q: rows(&batch.q, qrow),
        k: rows(&batch.k, kvrow),
        v: rows(&batch.v, kvrow),
    };
    (single, tokens)
}

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
