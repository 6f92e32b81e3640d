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

/// The fixture checkpoint `arch/hf` (one tensor per expert) rewritten in transformers 5's
/// own layout (`save_original_format=False`): each layer's experts' gate and up stacked
/// into `mlp.experts.gate_up_proj` (gate first), the downs into `mlp.experts.down_proj`,
/// the router as `mlp.gate.weight`. The same bytes, moved.
fn fused_checkpoint(arch: &str, out: &std::path::Path) {
    use safetensors::tensor::TensorView;
    use safetensors::SafeTensors;
    use std::collections::BTreeMap;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/archs")
        .join(arch)
        .join("hf");
    for file in std::fs::read_dir(&dir).unwrap() {
        let path = file.unwrap().path();
        if path.extension().is_some_and(|e| e != "safetensors") {
            std::fs::copy(&path, out.join(path.file_name().unwrap())).unwrap();
        }
    }
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    // (layer, expert) -> gate, up, down views.
    let mut experts: BTreeMap<(usize, usize), [Option<TensorView>; 3]> = BTreeMap::new();
    let mut kept: Vec<(String, TensorView)> = Vec::new();
    for (name, view) in st.tensors() {
        let parts: Vec<&str> = name.split('.').collect();
        let expert = match parts.as_slice() {
            ["model", "layers", l, "mlp" | "block_sparse_moe", "experts", e, m, "weight"] => {
                let slot = match *m {
                    "gate_proj" | "w1" => 0,
                    "up_proj" | "w3" => 1,
                    "down_proj" | "w2" => 2,
                    other => panic!("unknown expert matrix {other}"),
                };
                Some((l.parse().unwrap(), e.parse().unwrap(), slot))
            }
            _ => None,
        };
        match expert {
            Some((l, e, slot)) => experts.entry((l, e)).or_default()[slot] = Some(view),
            None => kept.push((name.replace(".block_sparse_moe.gate.", ".mlp.gate."), view)),
        }
    }
    assert!(!experts.is_empty(), "{arch}: no experts in the fixture");
    let mut fused: BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)> = BTreeMap::new();
    for ((l, _), [gate, up, down]) in &experts {
        let (gate, up, down) = (
            gate.as_ref().unwrap(),
            up.as_ref().unwrap(),
            down.as_ref().unwrap(),
        );
        let mut push = |name: String, rows: usize, cols: usize, data: &[&[u8]]| {
            let entry = fused
                .entry(name)
                .or_insert_with(|| (gate.dtype(), vec![0, rows, cols], Vec::new()));
            entry.1[0] += 1;
            for d in data {
                entry.2.extend_from_slice(d);
            }
        };
        let (ffn, hidden) = (gate.shape()[0], gate.shape()[1]);
        push(
            format!("model.layers.{l}.mlp.experts.gate_up_proj"),
            2 * ffn,
            hidden,
            &[gate.data(), up.data()],
        );
        push(
            format!("model.layers.{l}.mlp.experts.down_proj"),
            hidden,
            ffn,
            &[down.data()],
        );
    }
    let fused_views: Vec<(String, TensorView)> = fused
        .iter()
        .map(|(n, (dtype, shape, data))| {
            (
                n.clone(),
                TensorView::new(*dtype, shape.clone(), data).unwrap(),
            )
        })
        .collect();
    kept.extend(fused_views);
    safetensors::serialize_to_file(kept, None, &out.join("model.safetensors")).unwrap();
}

#[test]
fn transformers_5_fused_experts_read_as_released_checkpoints() {
    for arch in ["qwen3_moe", "mixtral", "olmoe"] {
        let dir = tempfile::tempdir().unwrap();
        fused_checkpoint(arch, dir.path());
        let released = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/archs")
            .join(arch)
            .join("hf");
        let logits = |path: &std::path::Path| {
            let loaded = load_model(path, &LoadOptions::default()).unwrap();
            let mut engine = Engine::new(loaded, EngineConfig::default()).unwrap();
            run(&mut engine, &prompts())
        };
        for (x, y) in logits(&released).iter().zip(&logits(dir.path())) {
            assert_eq!(x.prompt_logits, y.prompt_logits, "{arch}");
            assert_eq!(x.token_ids, y.token_ids, "{arch}");
        }
    }
}
