//! The real SmolLM2 model against Hugging Face transformers' numbers
//! (`tests/fixtures/reference/smollm2`, float32 on the dequantized GGUF weights).

mod common;

use common::{engine_with, engine_with_options, reference_prompts, ReferencePrompt};
use lantern_engine::{EngineConfig, SamplingParams};
use lantern_model::{ChatMessage, LoadOptions};

/// Logit tolerances, absolute, for the two ways lantern multiplies by quantized weights.
///
/// With `f32_weights` the weights are dequantized to f32 and activations enter the
/// products unchanged, which is exactly the reference's arithmetic: the only differences
/// left are f32 summation order (the reference is trusted to ~5e-5; measured here ~1e-4
/// over 30 layers). 2e-3 still catches any real error (a wrong RoPE pair layout, mask,
/// scale or norm moves logits by whole units).
const F32_TOLERANCE: f32 = 2e-3;
/// The default (fast) path quantizes activations to 8 bits per 32-value block (Q8_1, as
/// llama.cpp and candle do) before each product with a Q4_1/Q8_0 weight. That rounding,
/// a relative step of ~1/127 of each block's largest value, compounds through 30 layers;
/// measured on the reference prompts the largest last-position difference is 0.4-1.5
/// with logits spanning ~[-10, 25], while the same engine with `f32_weights` is within
/// 1e-4, so the gap is that rounding alone. It is chaotic: reordering a softmax sum (a
/// 1e-7 change) moved one prompt's figure from 1.29 to 1.50 and another's from 1.11 to
/// 0.88. 2.0 leaves room for that; the f32 test above is the strict one.
const QUANTIZED_TOLERANCE: f32 = 2.0;

/// The teacher-forced check's margin with quantized activations: steps whose reference
/// top-1/top-2 margin is below it may flip. At 1.5 about half of the steps are outside it.
const QUANTIZED_MARGIN: f32 = 1.5;

fn tolerance(f32_weights: bool) -> f32 {
    if f32_weights {
        F32_TOLERANCE
    } else {
        QUANTIZED_TOLERANCE
    }
}

fn prompt_logits(prompts: &[Vec<u32>], f32_weights: bool) -> Vec<Vec<f32>> {
    let options = LoadOptions {
        progress: false,
        f32_weights,
        ..Default::default()
    };
    let mut engine = engine_with_options(common::f32_kv(), &options);
    let requests = prompts
        .iter()
        .map(|p| {
            let params = SamplingParams {
                prompt_logits: true,
                ..SamplingParams::greedy(1)
            };
            (p.clone(), params)
        })
        .collect();
    engine
        .generate(requests)
        .unwrap()
        .into_iter()
        .map(|c| c.prompt_logits.unwrap())
        .collect()
}

fn user_message_of(rendered: &str) -> &str {
    let start = rendered.find("<|im_start|>user\n").unwrap() + "<|im_start|>user\n".len();
    let end = start + rendered[start..].find("<|im_end|>").unwrap();
    &rendered[start..end]
}

#[test]
fn prompt_token_ids_equal_the_reference() {
    let engine = engine_with(EngineConfig {
        kv_cache_memory: 16 << 20,
        ..common::f32_kv()
    });
    for p in reference_prompts("smollm2") {
        let text = if p.format == "chat" {
            let message = ChatMessage::new("user", user_message_of(&p.rendered_prompt));
            let rendered = engine.apply_chat_template(&[message]).unwrap();
            assert_eq!(rendered, p.rendered_prompt, "{}: chat template", p.id);
            rendered
        } else {
            p.rendered_prompt.clone()
        };
        let ids = engine.tokenizer().encode(&text, true).unwrap();
        assert_eq!(ids, p.prompt_ids, "{}: token ids", p.id);
        let decoded = engine.tokenizer().decode(&ids, false).unwrap();
        assert_eq!(decoded, text, "{}: decode(encode(text))", p.id);
    }
}

#[test]
fn last_position_logits_match_the_reference_with_f32_weights() {
    check_last_position_logits(true);
}

#[test]
fn last_position_logits_match_the_reference() {
    check_last_position_logits(false);
}

fn check_last_position_logits(f32_weights: bool) {
    let prompts = reference_prompts("smollm2");
    let inputs: Vec<Vec<u32>> = prompts.iter().map(|p| p.prompt_ids.clone()).collect();
    let logits = prompt_logits(&inputs, f32_weights);
    for (p, rows) in prompts.iter().zip(&logits) {
        let vocab = p.last_logits.len();
        let last = &rows[rows.len() - vocab..];
        let diff = common::max_abs_diff(last, &p.last_logits);
        eprintln!(
            "{} (f32 weights: {f32_weights}): max |logit - reference| = {diff:.5}",
            p.id
        );
        assert!(
            diff < tolerance(f32_weights),
            "{}: logits differ by {diff}",
            p.id
        );
        let argmax = lantern_engine::sampling::argmax(last);
        assert_eq!(
            argmax,
            lantern_engine::sampling::argmax(&p.last_logits),
            "{}: top-1",
            p.id
        );
    }
}

/// Teacher-forced on the reference continuation: the engine's top-1 at each generated step
/// equals the reference's, except where the reference's top-1/top-2 margin is within the
/// tolerance (there, activation rounding may legitimately flip the order).
#[test]
fn teacher_forced_top1_matches_the_reference() {
    for f32_weights in [false, true] {
        let prompts = reference_prompts("smollm2");
        let inputs: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| p.all_ids[..p.all_ids.len() - 1].to_vec())
            .collect();
        let logits = prompt_logits(&inputs, f32_weights);
        let mut checked = 0;
        for (p, rows) in prompts.iter().zip(&logits) {
            let margin = if f32_weights {
                F32_TOLERANCE
            } else {
                QUANTIZED_MARGIN
            };
            checked += check_teacher_forced(p, rows, margin);
        }
        let total = prompts.len() * 32;
        eprintln!("f32 weights {f32_weights}: {checked} of {total} steps outside the margin");
        // With f32 weights every step has a margin above the tolerance; with quantized
        // activations about half of the steps are decided by more than its tolerance.
        let minimum = if f32_weights { total } else { total / 2 };
        assert!(checked >= minimum, "only {checked} steps were checked");
    }
}

fn check_teacher_forced(p: &ReferencePrompt, rows: &[f32], tolerance: f32) -> usize {
    let vocab = p.last_logits.len();
    let steps = p.gen_ids.len();
    let first = p.prompt_ids.len() - 1;
    let mut checked = 0;
    for step in 0..steps {
        let row = &rows[(first + step) * vocab..(first + step + 1) * vocab];
        let top = &p.gen_top_ids[step * 20..(step + 1) * 20];
        let vals = &p.gen_top_vals[step * 20..(step + 1) * 20];
        let ours = lantern_engine::sampling::argmax(row);
        let margin = vals[0] - vals[1];
        if margin < tolerance {
            // A near tie: any token the reference scores within the tolerance of its best
            // is a legitimate pick.
            let ours_in_reference = top.iter().position(|&t| t == ours).map(|i| vals[i]);
            assert!(
                ours_in_reference.is_some_and(|v| vals[0] - v < tolerance),
                "{} step {step}: {ours} is not within {tolerance} of the reference's best {top:?} {vals:?}",
                p.id
            );
            continue;
        }
        assert_eq!(
            ours, top[0],
            "{} step {step}: top-1 (margin {margin})",
            p.id
        );
        checked += 1;
    }
    checked
}

/// Greedy generation gives the same tokens for a prompt alone and inside a batch of all.
#[test]
fn batch_invariance() {
    let prompts: Vec<Vec<u32>> = reference_prompts("smollm2")
        .into_iter()
        .map(|p| p.prompt_ids)
        .collect();
    let greedy = |batch: &[Vec<u32>]| {
        let mut engine = engine_with(common::f32_kv());
        let requests = batch
            .iter()
            .map(|p| {
                let params = SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(24)
                };
                (p.clone(), params)
            })
            .collect();
        engine
            .generate(requests)
            .unwrap()
            .into_iter()
            .map(|c| c.token_ids)
            .collect::<Vec<_>>()
    };
    let together = greedy(&prompts);
    for (i, p) in prompts.iter().enumerate() {
        let alone = greedy(std::slice::from_ref(p));
        assert_eq!(alone[0], together[i], "prompt {i} alone vs in the batch");
    }
}
