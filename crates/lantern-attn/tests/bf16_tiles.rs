//! The flash kernel on AMX-BF16 tiles (the opt-in `amx-bf16` level): near the dense f64
//! oracle (q, keys, probabilities and values rounded to bf16), every row the same bits
//! alone and in any batch or query tile, and a capture's probabilities (computed from the
//! keys) the same bits as the kernel's. Every test forces the level (this binary runs
//! nothing at another one) and skips with one line where the CPU has no AMX-BF16.

mod common;

use common::{alone, dense_attention, make_batch, max_rel_error, run_backend, Batch, Req};
use lantern_attn::{
    round_to_dtype, AttentionBackend, AttentionLayerSpec, AttentionMetadata, CpuFlashBackend,
    FlashTuning, RowProbabilities, RowScorer,
};
use lantern_kv::KvDtype;
use lantern_quant::{force_kernel, Kernel};

fn on_tiles() -> bool {
    if force_kernel(Some(Kernel::AmxBf16)) == Kernel::AmxBf16 {
        return true;
    }
    eprintln!("skipped: this CPU has no usable AMX-BF16");
    false
}

/// Plain, soft-capped with sinks and a sliding window, and head dims off the tiles' 32.
fn layers() -> Vec<(&'static str, AttentionLayerSpec)> {
    let mut plain = AttentionLayerSpec::new(9, 3, 64);
    plain.scale = 0.37;
    let mut gemma = AttentionLayerSpec::new(8, 1, 256);
    gemma.logits_soft_cap = Some(20.0);
    gemma.sinks = Some((0..8).map(|h| h as f32 * 0.4 - 1.0).collect());
    gemma.sliding_window = Some(45);
    let narrow = AttentionLayerSpec::new(4, 4, 16);
    let odd = AttentionLayerSpec::new(6, 2, 80);
    vec![
        ("plain", plain),
        ("gemma", gemma),
        ("narrow", narrow),
        ("odd", odd),
    ]
}

fn reqs() -> Vec<Req> {
    let req = |num_computed, query_len| Req {
        num_computed,
        query_len,
    };
    // A prefill, a chunk after a context, decodes short and long (split over pieces), a
    // chunk past 1,024 keys (longer query tiles).
    vec![
        req(0, 70),
        req(500, 33),
        req(90, 1),
        req(1500, 1),
        req(1100, 40),
    ]
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Within bf16's rounding of the oracle (bf16 keeps 8 bits: 0.4% a value, and the scores
/// of random unit vectors move the probabilities by about that much again).
#[test]
fn tile_attention_stays_near_the_dense_oracle() {
    if !on_tiles() {
        return;
    }
    let seed: u64 = rand::random();
    for (name, layer) in layers() {
        let name = format!("seed {seed} {name}");
        let batch = make_batch(seed, &layer, 16, &reqs(), 4);
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16] {
            let (out, _) =
                run_backend(&CpuFlashBackend::new(), &layer, &batch, dtype, None).unwrap();
            let err = max_rel_error(
                &out,
                &dense_attention(&layer, &batch, dtype),
                layer.head_dim,
            );
            // Above the exact kernel's f32 error (`common::tolerance`, 2e-5): the tiles ran.
            assert!(
                err < 1e-2 && err > 1e-4,
                "{name} {dtype:?}: relative error {err}"
            );
        }
    }
}

/// Each request alone gives the same bits as in the batch, and every query tile (one
/// token, two, 16, 64: different first keys and groups) the same bits as the default.
#[test]
fn tile_attention_rows_do_not_depend_on_the_batch_or_the_query_tile() {
    if !on_tiles() {
        return;
    }
    let seed: u64 = rand::random();
    for (name, layer) in layers() {
        let name = format!("seed {seed} {name}");
        let batch = make_batch(seed, &layer, 16, &reqs(), 3);
        let dtype = KvDtype::F16;
        let flash = CpuFlashBackend::new();
        let (together, _) = run_backend(&flash, &layer, &batch, dtype, None).unwrap();
        let row = layer.num_heads * layer.head_dim;
        for r in 0..batch.reqs.len() {
            let (single, tokens) = alone(&batch, r, &layer);
            let (out, _) = run_backend(&flash, &layer, &single, dtype, None).unwrap();
            let expected = &together[tokens.start * row..tokens.end * row];
            assert!(
                same_bits(&out, expected),
                "{name}: request {r} differs alone"
            );
        }
        for query_tile in [1, 2, 64] {
            let tuning = FlashTuning {
                query_tile,
                ..FlashTuning::default()
            };
            let backend = CpuFlashBackend::new().with_tuning(tuning).unwrap();
            let (out, _) = run_backend(&backend, &layer, &batch, dtype, None).unwrap();
            assert!(
                same_bits(&out, &together),
                "{name}: query tile {query_tile} differs"
            );
        }
    }
}

/// The probabilities the kernel keeps for capture are the same bits as
/// `row_probabilities` gives from the row's q and the keys the cache holds (what a
/// capture computes at finish), and the output is the plain forward's.
#[test]
fn kept_probabilities_on_tiles_equal_those_from_the_keys() {
    if !on_tiles() {
        return;
    }
    let seed: u64 = rand::random();
    for (name, layer) in layers() {
        let name = format!("seed {seed} {name}");
        let batch = make_batch(seed, &layer, 16, &reqs(), 2);
        let dtype = KvDtype::F16;
        let backend = CpuFlashBackend::new();
        let (plain, _) = run_backend(&backend, &layer, &batch, dtype, None).unwrap();
        let tokens = batch.q.len() / (layer.num_heads * layer.head_dim);
        let asked: Vec<usize> = (0..tokens).filter(|t| t % 3 != 1).collect();
        let mut probs = RowProbabilities::default();
        probs.ask(asked.iter().copied());
        let kept_out = run_with_probabilities(&backend, &layer, &batch, dtype, &mut probs).unwrap();
        assert!(same_bits(&kept_out, &plain), "{name}: the output changed");
        assert!(probs.is_filled(), "{name}: no probabilities kept");
        let (d, group) = (layer.head_dim, layer.group_size());
        let kv_row = layer.num_kv_heads * d;
        let mut t0 = 0;
        let mut checked = 0;
        for (r, req) in batch.reqs.iter().enumerate() {
            let mut keys = batch.ctx_k[r].clone();
            keys.extend_from_slice(&batch.k[t0 * kv_row..(t0 + req.query_len) * kv_row]);
            round_to_dtype(&mut keys, dtype);
            for t in t0..t0 + req.query_len {
                let Some(i) = asked.iter().position(|&a| a == t) else {
                    continue;
                };
                let visible = layer.visible_key_range(req.num_computed + t - t0);
                assert_eq!(probs.keys(i), visible);
                for h in 0..layer.num_heads {
                    let g = h / group;
                    let head_keys: Vec<f32> = visible
                        .clone()
                        .flat_map(|j| keys[(j * layer.num_kv_heads + g) * d..][..d].to_vec())
                        .collect();
                    let q = &batch.q[(t * layer.num_heads + h) * d..][..d];
                    let mut want = vec![f32::NAN; visible.len()];
                    lantern_attn::row_probabilities(&layer, h, q, &head_keys, &mut want);
                    assert!(
                        same_bits(probs.head(i, h), &want),
                        "{name}: row {t} head {h} differs from the keys' probabilities"
                    );
                    checked += 1;
                }
            }
            t0 += req.query_len;
        }
        assert!(checked > 0);
    }
}

/// [`common::run_backend`], then the same step again through `forward_with_probabilities`
/// (writing the step's keys again changes nothing).
/// A capture's rows scored two at a time (finalizing's `RowScorer`) are the bits of
/// `row_probabilities` row by row on the tiles too.
#[test]
fn rows_scored_in_pairs_equal_row_probabilities_on_tiles() {
    if !on_tiles() {
        return;
    }
    let wave = |i: usize| ((i as f32) * 0.61).sin() * 2.0;
    for (name, layer) in layers() {
        let (n, d) = (75, layer.head_dim);
        let keys: Vec<f32> = (0..n * d).map(|i| wave(i + 3)).collect();
        let q: Vec<Vec<f32>> = (0..2)
            .map(|r| (0..d).map(|i| wave(i * 7 + r * 101)).collect())
            .collect();
        let visible = [3..60, 17..75];
        let mut got = visible.clone().map(|v| vec![0f32; v.len()]);
        let [g0, g1] = &mut got;
        let mut scorer = RowScorer::new(&keys, d);
        scorer.probabilities(&layer, 1, [&q[0], &q[1]], visible.clone(), [g0, g1]);
        for r in 0..2 {
            let v = visible[r].clone();
            let mut want = vec![0f32; v.len()];
            lantern_attn::row_probabilities(
                &layer,
                1,
                &q[r],
                &keys[v.start * d..v.end * d],
                &mut want,
            );
            assert!(same_bits(&got[r], &want), "{name} row {r}");
        }
    }
}

fn run_with_probabilities(
    backend: &CpuFlashBackend,
    layer: &AttentionLayerSpec,
    batch: &Batch,
    dtype: KvDtype,
    probs: &mut RowProbabilities,
) -> Result<Vec<f32>, lantern_attn::AttnError> {
    let mut meta: Option<AttentionMetadata> = None;
    let (_, mut cache) = common::run_backend_with(backend, layer, batch, dtype, None, |common| {
        let m = backend.build_metadata(common);
        meta = Some(m.clone());
        Ok(m)
    })?;
    let meta = meta.expect("metadata built");
    let d = layer.head_dim;
    let out = backend.forward_with_probabilities(
        layer,
        &meta,
        &common::rows_tensor(&batch.q, layer.num_heads, d),
        &common::rows_tensor(&batch.k, layer.num_kv_heads, d),
        &common::rows_tensor(&batch.v, layer.num_kv_heads, d),
        &mut cache,
        probs,
    )?;
    Ok(out.flatten_all().unwrap().to_vec1().unwrap())
}
