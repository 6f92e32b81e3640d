//! Hugging Face checkpoints of one model as different tools save them read to the same
//! bits: GPT-2 with and without the `transformer.` prefix, with the causal-mask buffers
//! older checkpoints keep (bool and f32 tensors lantern never reads); GPT-NeoX with its
//! mask and rotary buffers; config.json with transformers 5's `rope_parameters` instead
//! of the top-level `rope_theta`, `rotary_pct` / `partial_rotary_factor` (also per layer
//! type: OLMo 3). A tensor the model needs in a type lantern does not read is named.
//! (Against transformers: the rows of `archs.rs`.)

use lantern_engine::{Completion, Engine, EngineConfig, SamplingParams};
use lantern_model::{load_model, LoadOptions};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

fn fixture(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/archs")
        .join(arch)
        .join("hf")
}

fn prompts() -> Vec<Vec<u32>> {
    (0..3)
        .map(|i| {
            (0..(9 + 13 * i))
                .map(|j| ((i * 37 + j * 13) % 2000) as u32)
                .collect()
        })
        .collect()
}

/// Greedy continuations of [`prompts`] with their prompts' logits.
fn run(dir: &Path) -> Vec<Completion> {
    let loaded = load_model(dir, &LoadOptions::default())
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    let mut engine = Engine::new(loaded, EngineConfig::default()).unwrap();
    let params = SamplingParams {
        ignore_eos: true,
        prompt_logits: true,
        ..SamplingParams::greedy(8)
    };
    let requests = prompts().into_iter().map(|p| (p, params.clone())).collect();
    engine.generate(requests).unwrap()
}

fn assert_same(arch: &str, variant: &Path) {
    for (x, y) in run(&fixture(arch)).iter().zip(&run(variant)) {
        assert_eq!(x.prompt_logits, y.prompt_logits, "{arch}");
        assert_eq!(x.token_ids, y.token_ids, "{arch}");
    }
}

/// A copy of the fixture `arch/hf` whose safetensors are `rename`d (`None` drops a
/// tensor) plus `extra` tensors, and whose config.json is `edit`ed.
fn variant(
    arch: &str,
    out: &Path,
    rename: impl Fn(&str) -> Option<String>,
    extra: &[(&str, Dtype, Vec<usize>, Vec<u8>)],
    edit: impl Fn(&mut serde_json::Value),
) {
    let dir = fixture(arch);
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        std::fs::copy(dir.join(file), out.join(file)).unwrap();
    }
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    edit(&mut config);
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .filter_map(|(name, view)| rename(&name).map(|n| (n, view)))
        .collect();
    for (name, dtype, shape, data) in extra {
        tensors.push((
            name.to_string(),
            TensorView::new(*dtype, shape.clone(), data).unwrap(),
        ));
    }
    safetensors::serialize_to_file(tensors, None, &out.join("model.safetensors")).unwrap();
}

/// A `[1, 1, n, n]` lower-triangular mask, as GPT-2's and GPT-NeoX's `attn.bias` buffers.
fn mask(n: usize, dtype: Dtype) -> (Dtype, Vec<usize>, Vec<u8>) {
    let bytes = (0..n * n).flat_map(|i| {
        let one = i % n <= i / n;
        match dtype {
            Dtype::BOOL => vec![u8::from(one)],
            _ => f32::from(u8::from(one)).to_le_bytes().to_vec(),
        }
    });
    (dtype, vec![1, 1, n, n], bytes.collect())
}

#[test]
fn gpt2_without_prefix_and_with_mask_buffers_reads_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let (bool_ty, bool_shape, bool_bytes) = mask(8, Dtype::BOOL);
    let (f32_ty, f32_shape, f32_bytes) = mask(8, Dtype::F32);
    variant(
        "gpt2",
        dir.path(),
        |name| {
            Some(
                name.strip_prefix("transformer.")
                    .unwrap_or(name)
                    .to_string(),
            )
        },
        &[
            (
                "h.0.attn.bias",
                bool_ty,
                bool_shape.clone(),
                bool_bytes.clone(),
            ),
            ("h.1.attn.bias", f32_ty, f32_shape, f32_bytes),
            (
                "h.0.attn.masked_bias",
                Dtype::F32,
                vec![],
                (-1e4f32).to_le_bytes().to_vec(),
            ),
        ],
        |_| {},
    );
    assert_same("gpt2", dir.path());
}

#[test]
fn gpt_neox_with_buffers_and_rope_parameters_reads_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let (bool_ty, bool_shape, bool_bytes) = mask(8, Dtype::BOOL);
    let inv_freq: Vec<u8> = [1.0f32, 0.01]
        .iter()
        .flat_map(|f| f.to_le_bytes())
        .collect();
    variant(
        "gpt_neox",
        dir.path(),
        |name| Some(name.to_string()),
        &[
            (
                "gpt_neox.layers.0.attention.bias",
                bool_ty,
                bool_shape,
                bool_bytes,
            ),
            (
                "gpt_neox.layers.0.attention.rotary_emb.inv_freq",
                Dtype::F32,
                vec![2],
                inv_freq,
            ),
        ],
        // As transformers 5 saves a GPT-NeoX config.
        |config| {
            let c = config.as_object_mut().unwrap();
            let theta = c.remove("rotary_emb_base").unwrap();
            let pct = c.remove("rotary_pct").unwrap();
            c.insert(
                "rope_parameters".into(),
                serde_json::json!({"rope_theta": theta, "partial_rotary_factor": pct,
                                   "rope_type": "default"}),
            );
        },
    );
    assert_same("gpt_neox", dir.path());
}

#[test]
fn olmo3_per_layer_type_rope_parameters_read_the_same() {
    let dir = tempfile::tempdir().unwrap();
    variant(
        "olmo3",
        dir.path(),
        |name| Some(name.to_string()),
        &[],
        |config| {
            let c = config.as_object_mut().unwrap();
            let theta = c.remove("rope_theta").unwrap();
            c.insert(
                "rope_parameters".into(),
                serde_json::json!({
                    "full_attention": {"rope_theta": theta, "rope_type": "default"},
                    "sliding_attention": {"rope_theta": theta, "rope_type": "default"}}),
            );
        },
    );
    assert_same("olmo3", dir.path());
}

#[test]
fn a_needed_tensor_of_an_unread_type_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let name = "transformer.h.0.mlp.c_fc.bias";
    // The fixture's bias (128 values) as 128 int8 values.
    variant(
        "gpt2",
        dir.path(),
        |n| (n != name).then(|| n.to_string()),
        &[(name, Dtype::I8, vec![128], vec![1; 128])],
        |_| {},
    );
    let err = load_model(dir.path(), &LoadOptions::default())
        .err()
        .expect("an int8 bias loaded")
        .to_string();
    assert!(err.contains(name) && err.contains("I8"), "{err}");
}
