//! The real Gemma 3 270M (Q4_K_M GGUF) against Hugging Face transformers' numbers
//! (`tests/fixtures/reference/gemma3`, float32 on the dequantized GGUF weights). A hybrid
//! model: sliding-window layers (window 512) and global ones (5, 11, 17), so two KV cache
//! groups; the reference prompt (661 tokens) is longer than the window, so the window's
//! mask, the local RoPE base and the per-group metadata all show in its logits.
//!
//! The fixture's npz is the reference's without most of the attention maps: it keeps the
//! last 8 prompt rows of layers 0 (sliding) and 5 (global), prompt keys only.

mod common;

use common::{reference_prompts, ReferencePrompt};
use lantern_capture::{CaptureSpec, RowSelection};
use lantern_engine::{Completion, Engine, EngineConfig, SamplingParams};
use lantern_model::LoadOptions;

/// Logit tolerances, absolute, for the two ways lantern multiplies by quantized weights.
///
/// With `f32_weights` the arithmetic is the reference's (dequantized weights, f32
/// activations): measured, the largest difference over all 262,144 last-position logits
/// is 2.2e-5 and over the top-20 of every teacher-forced step 2.5e-5, the reference's own
/// trust level (~5e-5). 2e-3 still catches any real error (a wrong norm offset, RoPE base
/// or pair layout, window or scale moves logits by whole units).
const F32_TOLERANCE: f32 = 2e-3;
/// The default path quantizes activations to 8 bits per block (Q8_0 for the Q5_0/Q8_0
/// weights, Q8_K for Q4_K/Q6_K, as llama.cpp does) before each product. Gemma 3's
/// activations have large outlier channels (norm weights reach ~280), so the rounding
/// costs more than on SmolLM2: measured, the largest last-position difference is 1.35
/// with logits up to ~24, and the top-20 logits of the teacher-forced steps differ by at
/// most 3.1 (at a step decided by a margin of 10), 0.1-0.75 elsewhere. With the layers'
/// products in f32 and only the output projection quantized the difference drops to
/// 0.21, so it is the layers' activation rounding, not an error. The f32 test is the
/// strict one.
const QUANTIZED_TOLERANCE: f32 = 2.0;

fn tolerance(f32_weights: bool) -> f32 {
    if f32_weights {
        F32_TOLERANCE
    } else {
        QUANTIZED_TOLERANCE
    }
}

fn engine(config: EngineConfig, f32_weights: bool) -> Engine {
    let path = lantern_model::default_model::ensure_gemma3_270m().expect("Gemma 3 270M available");
    let options = LoadOptions {
        progress: false,
        f32_weights,
        ..Default::default()
    };
    let loaded = lantern_model::load_model(&path, &options).expect("model loads");
    Engine::new(loaded, config).expect("engine starts")
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

fn run(engine: &mut Engine, requests: Vec<(Vec<u32>, SamplingParams)>) -> Vec<Completion> {
    let ids: Vec<_> = requests
        .into_iter()
        .map(|(p, s)| engine.add_request(p, s).unwrap())
        .collect();
    while engine.has_unfinished() {
        engine.step().unwrap();
    }
    ids.into_iter()
        .map(|id| engine.take_completion(id).unwrap())
        .collect()
}

fn the_prompt() -> ReferencePrompt {
    reference_prompts("gemma3")
        .into_iter()
        .find(|p| p.id == "gemma_window")
        .expect("the gemma_window reference prompt")
}

#[test]
fn the_model_is_hybrid_as_the_reference_says() {
    let engine = engine(
        EngineConfig {
            kv_cache_memory: 64 << 20,
            ..common::f32_kv()
        },
        false,
    );
    let info = engine.model_info();
    assert_eq!(info.architecture, "gemma3");
    assert_eq!(info.num_layers, 18);
    for (l, a) in info.attention.iter().enumerate() {
        let global = l % 6 == 5;
        assert_eq!(a.sliding_window, (!global).then_some(512), "layer {l}");
        assert_eq!((a.num_heads, a.num_kv_heads, a.head_dim), (4, 1, 256));
        assert_eq!(a.scale, 1.0 / 16.0);
        assert_eq!(a.logits_soft_cap, None);
    }
    assert_eq!(engine.kv_cache().num_groups(), 2);
}

#[test]
fn prompt_token_ids_equal_the_reference() {
    let engine = engine(
        EngineConfig {
            kv_cache_memory: 64 << 20,
            ..common::f32_kv()
        },
        false,
    );
    for p in reference_prompts("gemma3") {
        assert_eq!(p.format, "text");
        // BOS is added: the file asks for it.
        let ids = engine.tokenizer().encode(&p.rendered_prompt, true).unwrap();
        assert_eq!(ids, p.prompt_ids, "{}: token ids", p.id);
        assert_eq!(ids[0], 2);
        let decoded = engine.tokenizer().decode(&ids, true).unwrap();
        assert_eq!(decoded, p.rendered_prompt, "{}: decode(encode(text))", p.id);
    }
}

/// One forward over the prompt and the reference continuation (teacher-forced), with
/// logits for every position.
fn teacher_forced_logits(p: &ReferencePrompt, f32_weights: bool) -> Vec<f32> {
    let mut engine = engine(common::f32_kv(), f32_weights);
    let params = SamplingParams {
        prompt_logits: true,
        ..SamplingParams::greedy(1)
    };
    let input = p.all_ids[..p.all_ids.len() - 1].to_vec();
    let mut out = engine.generate(vec![(input, params)]).unwrap();
    out.remove(0).prompt_logits.unwrap()
}

/// Last-position logits within the tolerance, and at each generated step (teacher-forced)
/// the engine's top-1 equals the reference's, except where the reference's top-1/top-2
/// margin is within the tolerance (there any token the reference scores within the
/// tolerance of its best is a legitimate pick).
fn check_against_the_reference(f32_weights: bool) {
    let p = the_prompt();
    let tol = tolerance(f32_weights);
    let rows = teacher_forced_logits(&p, f32_weights);
    let vocab = p.last_logits.len();
    let first = p.prompt_ids.len() - 1;
    let last = &rows[first * vocab..(first + 1) * vocab];
    let diff = common::max_abs_diff(last, &p.last_logits);
    eprintln!("f32 weights {f32_weights}: max |last logit - reference| = {diff:.2e}");
    assert!(diff < tol, "last-position logits differ by {diff}");
    assert_eq!(
        lantern_engine::sampling::argmax(last),
        lantern_engine::sampling::argmax(&p.last_logits),
        "last-position top-1"
    );
    let mut checked = 0;
    for step in 0..p.gen_ids.len() {
        let row = &rows[(first + step) * vocab..(first + step + 1) * vocab];
        let top = &p.gen_top_ids[step * 20..(step + 1) * 20];
        let vals = &p.gen_top_vals[step * 20..(step + 1) * 20];
        let ours = lantern_engine::sampling::argmax(row);
        let margin = vals[0] - vals[1];
        if margin < tol {
            let ours_in_reference = top.iter().position(|&t| t == ours).map(|i| vals[i]);
            assert!(
                ours_in_reference.is_some_and(|v| vals[0] - v < tol),
                "step {step}: {ours} is not within {tol} of the reference's best {top:?} {vals:?}"
            );
            continue;
        }
        assert_eq!(ours, top[0], "step {step}: top-1 (margin {margin})");
        checked += 1;
    }
    eprintln!("f32 weights {f32_weights}: {checked} of 32 steps outside the margin");
    // With f32 weights every step's margin (the smallest is 0.02) is above the tolerance;
    // with quantized activations 8 steps are decided by more than 2.0.
    let minimum = if f32_weights { 32 } else { 8 };
    assert!(checked >= minimum, "only {checked} steps were checked");
}

#[test]
fn logits_and_teacher_forced_top1_match_the_reference_with_f32_weights() {
    check_against_the_reference(true);
}

#[test]
fn logits_and_teacher_forced_top1_match_the_reference() {
    check_against_the_reference(false);
}

/// The 661-token prompt (longer than the window) through chunked prefill (chunks of 256
/// cross the window's edge), with prefix caching on: the greedy continuation is the
/// reference's token for token (f32 weights: every margin is far above the arithmetic's
/// difference), the same again when the prompt comes from the prefix cache, and the
/// captured attention of the last prompt rows of a sliding and a global layer is
/// transformers'.
#[test]
fn the_long_prompt_is_served_exactly_with_prefix_caching() {
    let p = the_prompt();
    let mut engine = engine(
        EngineConfig {
            max_num_batched_tokens: 256,
            enable_prefix_caching: true,
            ..common::f32_kv()
        },
        true,
    );
    let first = run(&mut engine, vec![(p.prompt_ids.clone(), greedy(32))]).remove(0);
    assert_eq!(first.token_ids, p.gen_ids, "greedy continuation");
    let second = run(&mut engine, vec![(p.prompt_ids.clone(), greedy(32))]).remove(0);
    assert!(
        second.num_cached_prompt_tokens > 0,
        "the second request hits the prefix cache"
    );
    eprintln!(
        "prefix cache: {} of {} prompt tokens",
        second.num_cached_prompt_tokens,
        p.prompt_ids.len()
    );
    assert_eq!(
        second.token_ids, p.gen_ids,
        "greedy continuation from the cache"
    );

    // Capture: the last 8 prompt rows of layers 0 (sliding) and 5 (global).
    let n = p.prompt_ids.len();
    let info = engine.model_info().clone();
    let heads = info.attention[0].num_heads;
    let mut spec = CaptureSpec::everything(info.num_layers, heads);
    spec.layers = vec![0, 5];
    spec.rows = RowSelection::Range {
        start: n - 8,
        end: n,
    };
    spec.keep_attention_output = true;
    let id = engine
        .add_request_with_capture(p.prompt_ids.clone(), greedy(1), Some(spec))
        .unwrap();
    while engine.has_unfinished() {
        engine.step().unwrap();
    }
    let done = engine.take_completion(id).unwrap();
    let pending = done.capture.expect("asked for a capture").unwrap();
    let result = pending.finalize().unwrap();
    // Rows sum to 1, keys outside the window are exactly 0, P·V is the layer's output.
    let worst_rel = common::check_capture_invariants(&pending, &result);
    eprintln!("capture: worst relative error of P·V {worst_rel:.2e}");
    assert_eq!(result.meta.row_positions, (n - 8..n).collect::<Vec<_>>());
    assert_eq!(result.meta.key_positions.len(), n);
    let mut archive = npyz::npz::NpzArchive::open(&p.npz).unwrap();
    for map in &result.layers {
        let name = format!("attn_L{}_tail", map.layer_idx);
        let reference: Vec<f32> = archive
            .by_name(&name)
            .unwrap()
            .unwrap()
            .into_vec::<half::f16>()
            .unwrap()
            .into_iter()
            .map(f32::from)
            .collect();
        let window = info.attention[map.layer_idx].sliding_window;
        let mut worst = 0f32;
        for r in 0..8 {
            let q = n - 8 + r;
            for h in 0..heads {
                for k in 0..n {
                    let i = (r * heads + h) * n + k;
                    let (ours, theirs) = (map.values[i], reference[i]);
                    let masked = k > q || window.is_some_and(|w| q - k >= w);
                    if masked {
                        assert_eq!(ours, 0.0, "layer {} row {q} key {k}", map.layer_idx);
                        assert_eq!(theirs, 0.0);
                    } else {
                        worst = worst.max((ours - theirs).abs());
                    }
                }
            }
        }
        // float16 storage of the reference (2^-12 on a probability <= 1) plus f32 order.
        eprintln!("layer {}: max |p - reference| = {worst:.2e}", map.layer_idx);
        assert!(worst < 1e-3, "layer {}: {worst}", map.layer_idx);
    }
}

/// Greedy generation gives the same tokens for a prompt alone and inside a batch of
/// prompts of other lengths (one shorter than the window, one a prefix of it).
#[test]
fn batch_invariance() {
    let p = the_prompt();
    let mut engine = engine(common::f32_kv(), false);
    let story = engine
        .tokenizer()
        .encode("The tide came in slowly over the flat grey sand,", true)
        .unwrap();
    let prompts = [p.prompt_ids.clone(), story, p.prompt_ids[..540].to_vec()];
    let batch: Vec<_> = prompts.iter().map(|x| (x.clone(), greedy(12))).collect();
    let together = run(&mut engine, batch);
    // Alone, one after the other; without prefix caching each prompt is computed whole.
    let mut alone_engine = self::engine(
        EngineConfig {
            enable_prefix_caching: false,
            ..common::f32_kv()
        },
        false,
    );
    for (i, prompt) in prompts.iter().enumerate() {
        let alone = run(&mut alone_engine, vec![(prompt.clone(), greedy(12))]).remove(0);
        assert_eq!(alone.token_ids, together[i].token_ids, "prompt {i}");
    }
}
