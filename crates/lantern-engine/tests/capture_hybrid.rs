//! Attention capture on a hybrid model: a tiny random Gemma 3 (window 8, every 6th
//! layer global, blocks of 4), with sequences many windows long. Sliding layers show
//! exactly 0 outside the window, global layers the full causal map, and every
//! invariant of capture holds: rows sum to 1, P·V is the attention output, and the
//! capture is the same in a batch, on a prefix-cache hit and after preemption.

mod common;

use candle_core::quantized::GgmlDType;
use lantern_capture::{CaptureSpec, PendingCapture};
use lantern_engine::{Completion, Engine, EngineConfig, SamplingParams};
use lantern_model::synthetic::GEMMA3_TINY_WINDOW;

const LAYERS: usize = 7;

fn engine(config: EngineConfig) -> (Engine, tempfile::TempDir) {
    // Q8_0 weights go through lantern's repacked kernels, whose results do not depend
    // on how many rows share a product (batch invariance is what is compared here).
    common::tiny_gemma3(LAYERS, GgmlDType::Q8_0, config)
}

fn config() -> EngineConfig {
    EngineConfig {
        kv_cache_memory: 4 << 20,
        block_size: 4,
        ..common::f32_kv()
    }
}

fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((salt * 17 + j * 11) % 250) as u32)
        .collect()
}

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

/// Every layer and head of the tiny model (4 query heads).
fn spec() -> CaptureSpec {
    let mut spec = CaptureSpec::everything(LAYERS, 4);
    spec.keep_attention_output = true;
    spec
}

fn run(
    engine: &mut Engine,
    requests: Vec<(Vec<u32>, SamplingParams, Option<CaptureSpec>)>,
) -> Vec<Completion> {
    common::run_to_completion(engine, requests)
}

fn pending(c: &Completion) -> &PendingCapture {
    c.capture.as_ref().unwrap().as_ref().unwrap()
}

#[test]
fn sliding_layers_are_zero_outside_the_window_and_every_invariant_holds() {
    let (mut engine, _dir) = engine(EngineConfig {
        max_num_batched_tokens: 7,
        ..config()
    });
    let spec = common::with_every_stat(spec());
    let out = run(&mut engine, vec![(prompt(30, 1), params(12), Some(spec))]);
    let pending = pending(&out[0]);
    let result = pending.finalize().unwrap();
    common::check_capture_invariants(pending, &result);
    // Key statistics over sliding and global layers are the maps' reductions (summed
    // from the kernel's probabilities as the rows ran).
    assert!(pending.stats_summed_live());
    assert!(pending.span_masses_summed_live());
    common::check_stats_equal_the_maps(&result);
    assert_eq!(result.meta.block_size, Some(4));
    let info = engine.model_info();
    let keys = result.meta.key_positions.len();
    assert_eq!(keys, 41);
    for map in &result.layers {
        let window = info.attention[map.layer_idx].sliding_window;
        let heads = map.shape[1];
        let last = result.meta.row_positions.len() - 1;
        let row = &map.values[last * heads * keys..(last * heads + 1) * keys];
        let seen = row.iter().filter(|&&p| p > 0.0).count();
        match window {
            // The last row sees exactly its window...
            Some(w) => {
                assert_eq!(w, GEMMA3_TINY_WINDOW);
                assert_eq!(seen, w, "layer {}", map.layer_idx);
            }
            // ...or, on a global layer, every key.
            None => assert_eq!(seen, keys, "layer {}", map.layer_idx),
        }
    }
}

#[test]
fn batch_prefix_cache_and_preemption_leave_the_capture_unchanged() {
    let (mut alone_engine, _d0) = engine(config());
    let p = prompt(33, 2);
    let other = prompt(21, 3);
    let alone = run(
        &mut alone_engine,
        vec![(p.clone(), params(10), Some(spec()))],
    );
    let reference = pending(&alone[0]).finalize().unwrap();

    // In a batch with a request that does not capture.
    let (mut e, _d1) = engine(config());
    let plain = run(&mut e, vec![(other.clone(), params(10), None)]);
    let batch = run(
        &mut e,
        vec![
            (other.clone(), params(10), None),
            (p.clone(), params(10), Some(spec())),
        ],
    );
    assert_eq!(batch[0].token_ids, plain[0].token_ids);
    common::assert_same_capture(&pending(&batch[1]).finalize().unwrap(), &reference);

    // With the prompt in the prefix cache.
    let warm = run(&mut e, vec![(p.clone(), params(10), None)]);
    let again = run(&mut e, vec![(p.clone(), params(10), None)]);
    assert!(again[0].num_cached_prompt_tokens > 0);
    assert_eq!(warm[0].token_ids, alone[0].token_ids);
    let hit = run(&mut e, vec![(p.clone(), params(10), Some(spec()))]);
    common::assert_same_capture(&pending(&hit[0]).finalize().unwrap(), &reference);

    // Preempted and resumed: a pool too small for four requests at once.
    let (mut tight, _d2) = engine(EngineConfig {
        kv_cache_memory: 2 * LAYERS * 2 * 4 * 16 * 4 * 24,
        max_num_batched_tokens: 9,
        ..config()
    });
    let mut requests: Vec<_> = (0..3)
        .map(|i| (prompt(30, 10 + i), params(10), None))
        .collect();
    requests.push((p.clone(), params(10), Some(common::with_every_stat(spec()))));
    let out = run(&mut tight, requests);
    assert!(tight.num_preemptions() > 0, "no preemption happened");
    assert!(
        out[3].num_preemptions > 0,
        "the capturing request was not preempted"
    );
    let preempted = pending(&out[3]);
    let resumed = preempted.finalize().unwrap();
    // The same maps (its meta names the statistics too).
    assert_eq!(resumed.meta.row_positions, reference.meta.row_positions);
    assert_eq!(resumed.layers, reference.layers);
    // Rows run again after the preemption: the key statistics were not summed as the
    // rows ran but computed from the keys, and are the same bits as the live sums of the
    // uninterrupted request.
    assert!(!preempted.stats_summed_live());
    assert!(!preempted.span_masses_summed_live());
    common::check_stats_equal_the_maps(&resumed);
    let (mut e, _d3) = engine(config());
    let live = run(
        &mut e,
        vec![(p.clone(), params(10), Some(common::with_every_stat(spec())))],
    );
    assert!(pending(&live[0]).stats_summed_live());
    assert!(pending(&live[0]).span_masses_summed_live());
    let live = pending(&live[0]).finalize().unwrap();
    assert_eq!(live.stats, resumed.stats);
    assert_eq!(live.span_mass, resumed.span_mass);
}

/// Span masses alone (no maps, no statistics): summed as the rows run, so no keys are
/// copied at finish, and equal to the span masses of a capture that also has the maps
/// (which `check_spans_equal_the_maps` checks against the maps, bit for bit).
#[test]
fn span_masses_alone_are_summed_live_and_equal_those_beside_the_maps() {
    let with_maps = common::with_every_stat(spec());
    let mut alone = with_maps.clone();
    alone.maps = false;
    alone.stats.clear();
    alone.keep_attention_output = false;
    let p = prompt(30, 4);
    let (mut e, _dir) = engine(EngineConfig {
        max_num_batched_tokens: 7,
        ..config()
    });
    let out = run(
        &mut e,
        vec![
            (p.clone(), params(8), Some(with_maps)),
            (p.clone(), params(8), Some(alone)),
        ],
    );
    let reference = pending(&out[0]).finalize().unwrap();
    common::check_spans_equal_the_maps(&reference);
    let spans_only = pending(&out[1]);
    assert!(spans_only.span_masses_summed_live());
    assert!(!spans_only.holds_keys(), "no keys copied");
    assert!(pending(&out[0]).holds_keys());
    let result = spans_only.finalize().unwrap();
    assert!(result.layers.is_empty() && result.stats.is_empty());
    assert_eq!(result.span_mass, reference.span_mass);
}

/// A streamed capture's live rows (span masses and top-k keys per KV head, sent with
/// each token) come from what the live sums kept of each row — the attention kernel's
/// probabilities, on sliding and global layers — and are the same bits as computing
/// them from the row's query and keys; and they equal the finished capture's span
/// masses.
#[test]
fn streamed_rows_come_from_the_live_sums_and_equal_the_keys_path() {
    use lantern_capture::{row_capture, row_capture_from_sums, CaptureSpan};
    let mut spec = spec();
    spec.keep_attention_output = false;
    spec.spans = vec![
        CaptureSpan::tokens("a", 2..5),
        CaptureSpan::tokens("b", 5..9),
    ];
    spec.top_k = Some(3);
    spec.stream_rows = true;
    let (mut e, _dir) = engine(EngineConfig {
        max_num_batched_tokens: 7,
        ..config()
    });
    let max_tokens = 8;
    let id = e
        .add_request_with_capture(prompt(30, 5), params(max_tokens), Some(spec))
        .unwrap();
    let mut rows = Vec::new();
    while e.has_unfinished() {
        rows.extend(e.step().unwrap().into_iter().filter_map(|o| o.capture_row));
    }
    let completion = e.take_completion(id).unwrap();
    let pending = completion.capture.unwrap().unwrap();
    assert_eq!(rows.len(), max_tokens, "one live row per token");
    let last = rows.last().unwrap();
    assert_eq!(
        row_capture_from_sums(&pending.buffer, last.position).as_ref(),
        Some(&**last),
        "the last row is still what the sums kept"
    );
    let result = pending.finalize().unwrap();
    for row in &rows {
        let from_keys = row_capture(&pending.buffer, row.position, &pending.layers).unwrap();
        assert_eq!(**row, from_keys, "row {}", row.position);
        let r = result
            .meta
            .row_positions
            .iter()
            .position(|&p| p == row.position)
            .unwrap();
        for (layer, mass) in row.layers.iter().zip(&result.span_mass) {
            let [_, groups, width] = mass.shape;
            let live: Vec<f32> = layer.span_mass.as_ref().unwrap().concat();
            assert_eq!(live, mass.values[r * groups * width..][..groups * width]);
        }
    }
}
