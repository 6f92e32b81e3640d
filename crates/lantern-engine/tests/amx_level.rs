//! The `amx` kernel level on the real models (SmolLM2 Q4_1/Q8_0, Gemma 3 Q4_K/Q6_K/Q5_0/
//! Q8_0): every prompt logit and every token the same bits as at the `avx512` level, for
//! prompts long enough to run on the tiles (32 tokens and more, with a partial last group
//! of 16) and for a decode batch of 40 requests, whose steps run on them too. Skipped
//! with one line on CPUs without usable AMX.
//!
//! The level is forced process-wide, so this binary holds this one test and nothing runs
//! beside it.

mod common;

use common::reference_prompts;
use lantern_engine::{Completion, Engine, EngineConfig, SamplingParams};
use lantern_quant::{force_kernel, Kernel};

fn params(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        prompt_logits: true,
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

/// The prompts one at a time, then all of them in one batch, at `level`.
fn run_at(engine: &mut Engine, prompts: &[Vec<u32>], level: Kernel) -> Vec<Completion> {
    assert_eq!(force_kernel(Some(level)), level);
    let q4_1 = lantern_model::linear::kernel_for(lantern_model::GgmlDType::Q4_1);
    assert_eq!(q4_1, level.name(), "the products run at the forced level");
    let mut done: Vec<Completion> = prompts
        .iter()
        .map(|p| common::run_to_completion(engine, vec![(p.clone(), params(6), None)]).remove(0))
        .collect();
    let batch = prompts
        .iter()
        .map(|p| (p.clone(), params(6), None))
        .collect();
    done.extend(common::run_to_completion(engine, batch));
    force_kernel(None);
    done
}

/// Deterministic token ids above the first 256 (specials and bytes).
fn synthetic(len: usize, salt: u32, vocab: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| 256 + (i.wrapping_mul(2_654_435_761) ^ salt.wrapping_mul(40_503)) % (vocab - 256))
        .collect()
}

fn check_model(name: &str, mut engine: Engine, mut prompts: Vec<Vec<u32>>) {
    let vocab = engine.model_info().vocab_size as u32;
    // Long prompts whose last tile group is partial, and enough short ones that the
    // batch's decode steps hold 40 tokens (products of 40 rows: on the tiles).
    prompts.extend(
        [45, 131, 300]
            .iter()
            .map(|&n| synthetic(n, n as u32, vocab)),
    );
    while prompts.len() < 40 {
        prompts.push(synthetic(
            5 + prompts.len() % 7,
            prompts.len() as u32,
            vocab,
        ));
    }
    let vectors = run_at(&mut engine, &prompts, Kernel::Avx512);
    let tiles = run_at(&mut engine, &prompts, Kernel::Amx);
    for (i, (v, t)) in vectors.iter().zip(&tiles).enumerate() {
        let what = if i < prompts.len() {
            "alone"
        } else {
            "in the batch"
        };
        let prompt = i % prompts.len();
        assert_eq!(
            v.token_ids, t.token_ids,
            "{name} prompt {prompt} {what}: tokens"
        );
        let (a, b) = (
            v.prompt_logits.as_ref().unwrap(),
            t.prompt_logits.as_ref().unwrap(),
        );
        let same = a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(same, "{name} prompt {prompt} {what}: prompt logits differ");
    }
    eprintln!(
        "{name}: {} prompts of up to {} tokens, alone and batched: amx == avx512 bit for bit",
        prompts.len(),
        prompts.iter().map(Vec::len).max().unwrap_or(0)
    );
}

#[test]
fn amx_level_equals_avx512_bit_for_bit_on_the_real_models() {
    if !Kernel::Amx.available() {
        eprintln!("skipped: this CPU has no usable AMX; the amx level is not checked");
        return;
    }
    let smollm2 = common::engine_with(EngineConfig::default());
    let prompts = reference_prompts("smollm2")
        .into_iter()
        .map(|r| r.prompt_ids)
        .collect();
    check_model("SmolLM2", smollm2, prompts);

    let path = lantern_model::default_model::ensure_gemma3_270m().expect("Gemma 3 270M available");
    let loaded = lantern_model::load_model(&path, &Default::default()).expect("model loads");
    let gemma = Engine::new(loaded, EngineConfig::default()).expect("engine starts");
    let prompts = reference_prompts("gemma3")
        .into_iter()
        .map(|r| r.prompt_ids)
        .collect();
    check_model("Gemma 3", gemma, prompts);
}
