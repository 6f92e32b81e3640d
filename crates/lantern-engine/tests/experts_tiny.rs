//! Mixture-of-experts models on tiny random files written on the fly: both layouts of
//! the experts' tensors read the same, a token's output does not depend on which other
//! tokens share its experts in a step, every block comes back, and broken files are
//! named. (Against transformers: the `qwen3_moe` and `mixtral` rows of `archs.rs`.)

use candle_core::quantized::GgmlDType;
use lantern_engine::{Completion, Engine, EngineConfig, SamplingParams};
use lantern_model::synthetic::TinyLlama;
use lantern_model::{load_model, LoadOptions};

fn tiny_moe() -> TinyLlama {
    TinyLlama {
        dtype: GgmlDType::Q8_0,
        experts: 8,
        experts_used: 2,
        ..TinyLlama::default()
    }
}

fn engine(model: &TinyLlama) -> (Engine, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-moe.gguf");
    model.write(&path).unwrap();
    let loaded = load_model(&path, &LoadOptions::default()).unwrap();
    let config = EngineConfig {
        kv_cache_memory: 4 << 20,
        block_size: 4,
        ..EngineConfig::default()
    };
    (Engine::new(loaded, config).unwrap(), dir)
}

fn prompts() -> Vec<Vec<u32>> {
    (0..5)
        .map(|i| {
            (0..(7 + 11 * i))
                .map(|j| ((i * 37 + j * 13) % 250) as u32)
                .collect()
        })
        .collect()
}

/// Greedy continuations with the prompt's logits, every block given back.
fn run(engine: &mut Engine, prompts: &[Vec<u32>]) -> Vec<Completion> {
    let params = SamplingParams {
        ignore_eos: true,
        prompt_logits: true,
        ..SamplingParams::greedy(12)
    };
    let requests = prompts
        .iter()
        .map(|p| (p.clone(), params.clone()))
        .collect();
    let out = engine.generate(requests).unwrap();
    let kv = engine.kv_cache();
    assert_eq!(kv.num_free_blocks(), kv.num_blocks());
    out
}

#[test]
fn stacked_and_per_expert_tensors_give_the_same_bits() {
    let (mut stacked, _a) = engine(&tiny_moe());
    let per_expert = TinyLlama {
        stacked_experts: false,
        ..tiny_moe()
    };
    let (mut separate, _b) = engine(&per_expert);
    let p = prompts();
    let (x, y) = (run(&mut stacked, &p), run(&mut separate, &p));
    for (x, y) in x.iter().zip(&y) {
        assert_eq!(x.token_ids, y.token_ids);
        assert_eq!(x.prompt_logits, y.prompt_logits);
    }
}

#[test]
fn each_prompt_alone_equals_the_batch() {
    let (mut engine, _dir) = engine(&tiny_moe());
    let p = prompts();
    let together = run(&mut engine, &p);
    // The tokens choose different experts (else this would test nothing): the tiny
    // router's scale spreads them.
    let distinct: std::collections::HashSet<u32> =
        together.iter().flat_map(|c| c.token_ids.clone()).collect();
    assert!(distinct.len() > 3, "{distinct:?}");
    for (prompt, batched) in p.iter().zip(&together) {
        let alone = run(&mut engine, std::slice::from_ref(prompt));
        assert_eq!(alone[0].token_ids, batched.token_ids);
        assert_eq!(alone[0].prompt_logits, batched.prompt_logits);
    }
}

#[test]
fn broken_expert_files_are_named() {
    let load = |model: TinyLlama| {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("broken.gguf");
        model.write(&path).unwrap();
        load_model(&path, &LoadOptions::default())
            .err()
            .expect("refused")
            .to_string()
    };
    let err = load(TinyLlama {
        experts_used: 9,
        ..tiny_moe()
    });
    assert!(err.contains("llama.expert_used_count"), "{err}");
    let err = load(TinyLlama {
        omit_tensors: vec!["blk.1.ffn_up_exps.weight".into()],
        ..tiny_moe()
    });
    assert!(
        err.contains("`blk.1.ffn_up_exps.weight` or `blk.1.ffn_up.0.weight`"),
        "{err}"
    );
    let err = load(TinyLlama {
        omit_keys: vec!["llama.expert_count".into()],
        ..tiny_moe()
    });
    assert!(err.contains("llama.expert_count"), "{err}");
}
