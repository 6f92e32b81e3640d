//! Hugging Face directories (`tests/fixtures/archs/<arch>/hf`) read through `WeightSource`
//! give what llama.cpp's converter wrote into the f32 GGUF of the same model: the same
//! metadata, the same tensors with the same numbers (q/k permutation, Gemma's `1 + w`,
//! Llama 3's `rope_freqs`, tied embeddings); and their tokenizers give the references'
//! prompt ids.

use lantern_model::hf::tokenizer::{load_tokenizer, TokenizerConfig};
use lantern_model::hf::HfDirectory;
use lantern_model::{ChatMessage, ChatTemplate, GgufFile, WeightSource};
use std::path::{Path, PathBuf};

const ARCHS: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "phi3",
    "gemma3_text",
];

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn hf_dir(arch: &str) -> PathBuf {
    repo_root()
        .join("tests/fixtures/archs")
        .join(arch)
        .join("hf")
}

/// The converter's f32 GGUF: in the repo's fixtures when present, else in the shared
/// reference folder beside the repository.
fn f32_gguf(arch: &str) -> PathBuf {
    let name = format!("{arch}/gguf/{arch}.f32.gguf");
    let candidates = [
        repo_root().join("tests/fixtures/archs").join(&name),
        repo_root().join("../shared/reference/archs").join(&name),
    ];
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .unwrap_or_else(|| panic!("{name} is in neither {candidates:?}"))
}

fn summary(arch: &str) -> serde_json::Value {
    let path = repo_root()
        .join("tests/fixtures/archs")
        .join(arch)
        .join("ref/summary.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn as_f32(source: &mut dyn WeightSource, name: &str) -> Vec<f32> {
    let t = source.tensor(name).unwrap();
    t.dequantize(&candle_core::Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn every_gguf_tensor_and_key_is_presented_with_the_same_numbers() {
    for arch in ARCHS {
        let mut hf = HfDirectory::open(&hf_dir(arch), None).unwrap();
        let mut gguf = GgufFile::open(&f32_gguf(arch)).unwrap();
        let mut gguf_names = gguf.tensor_names();
        gguf_names.sort();
        let mut hf_names = hf.tensor_names();
        hf_names.sort();
        assert_eq!(hf_names, gguf_names, "{arch}: tensor names");
        for name in &gguf_names {
            let (shape, _) = gguf.tensor_info(name).unwrap();
            assert_eq!(hf.tensor_info(name).unwrap().0, shape, "{arch} {name}");
            let want = as_f32(&mut gguf, name);
            let got = as_f32(&mut hf, name);
            let worst = want
                .iter()
                .zip(&got)
                .map(|(a, b)| match (a - b).abs() / a.abs().max(1e-6) {
                    // A NaN counts as the largest difference (`f32::max` would drop it).
                    e if e.is_nan() => f32::INFINITY,
                    e => e,
                })
                .fold(0f32, f32::max);
            // Exact but for float32 `1 + w` norms (the converter adds in float32 too,
            // from a different rounding of w) and Llama 3's divisors (computed in f32).
            assert!(worst < 1e-6, "{arch} {name}: relative difference {worst}");
        }
        let arch_key = gguf.get_string("general.architecture").unwrap().to_string();
        assert_eq!(hf.get_string("general.architecture").unwrap(), arch_key);
        for suffix in [
            "block_count",
            "embedding_length",
            "feed_forward_length",
            "context_length",
            "attention.head_count",
            "attention.head_count_kv",
            "attention.key_length",
            "rope.dimension_count",
            "attention.sliding_window",
        ] {
            let key = format!("{arch_key}.{suffix}");
            if let Some(want) = gguf.opt_usize(&key).unwrap() {
                // phi3 writes window 0 for "none"; the directory leaves it out.
                let got = hf.opt_usize(&key).unwrap().unwrap_or(0);
                assert_eq!(got, want, "{arch} {key}");
            }
        }
        for suffix in [
            "rope.freq_base",
            "rope.freq_base_swa",
            "attention.layer_norm_rms_epsilon",
            "attn_logit_softcapping",
            "final_logit_softcapping",
        ] {
            let key = format!("{arch_key}.{suffix}");
            if let Some(want) = gguf.opt_f32(&key).unwrap() {
                assert_eq!(hf.opt_f32(&key).unwrap(), Some(want), "{arch} {key}");
            }
        }
    }
}

#[test]
fn what_gguf_cannot_say_comes_as_lantern_keys() {
    use lantern_model::source::keys;
    let open = |arch| HfDirectory::open(&hf_dir(arch), None).unwrap();
    let mistral = open("mistral");
    assert_eq!(mistral.opt_usize(keys::SLIDING_WINDOW).unwrap(), Some(16));
    let qwen2 = open("qwen2");
    assert_eq!(
        qwen2.opt_usize(keys::SLIDING_WINDOW).unwrap(),
        None,
        "use_sliding_window false"
    );
    let gemma2 = open("gemma2");
    assert_eq!(
        gemma2.opt_f32(keys::QUERY_PRE_ATTN_SCALAR).unwrap(),
        Some(24.0)
    );
    assert_eq!(
        gemma2.opt_bool_array(keys::SLIDING_LAYERS).unwrap(),
        Some(vec![true, false, true, false])
    );
    let gemma3 = open("gemma3_text");
    assert_eq!(
        gemma3.opt_bool_array(keys::SLIDING_LAYERS).unwrap(),
        Some(vec![true, true, true, true, true, false])
    );
}

#[test]
fn prompt_ids_equal_the_references() {
    for arch in ARCHS {
        let dir = hf_dir(arch);
        let hf = HfDirectory::open(&dir, None).unwrap();
        let config = TokenizerConfig::read(&dir).unwrap();
        let tokenizer = load_tokenizer(&dir, &config, &hf.config.eos_token_ids).unwrap();
        let template = ChatTemplate::new(
            config.chat_template.as_deref().unwrap(),
            tokenizer.bos_token().unwrap_or_default(),
            tokenizer.eos_token().unwrap_or_default(),
        )
        .unwrap();
        for prompt in summary(arch)["prompts"].as_array().unwrap() {
            let want: Vec<u32> = serde_json::from_value(prompt["prompt_ids"].clone()).unwrap();
            let rendered = prompt["rendered_prompt"].as_str().unwrap();
            let id = prompt["id"].as_str().unwrap();
            let text = if prompt["format"] == "chat" {
                // The one user message, recovered from the reference's rendering, rendered
                // again through the directory's own template.
                let message = user_message(arch, id);
                let ours = template
                    .render(&[ChatMessage::new("user", &message)], true)
                    .unwrap();
                assert_eq!(ours, rendered, "{arch} {id}: rendered template");
                // The server's path: template text and contents apart, BOS requested.
                let parts = template
                    .render_parts(&[ChatMessage::new("user", &message)], true, 1 << 20)
                    .unwrap();
                let segments = parts.segments.expect("the template keeps contents apart");
                let ids = tokenizer.encode_chat(&segments, true).unwrap();
                assert_eq!(ids, want, "{arch} {id}: chat prompt ids");
                ours
            } else {
                rendered.to_string()
            };
            // Chat prompts are tokenized as the server does (BOS requested): BOS once.
            let ids = tokenizer.encode(&text, true).unwrap();
            assert_eq!(ids, want, "{arch} {id}: prompt ids");
        }
        assert!(!tokenizer.stop_ids().is_empty(), "{arch}: stop ids");
    }
}

/// The user message of `chat_a`, as the references' script wrote it.
fn user_message(arch: &str, id: &str) -> String {
    let s = summary(arch);
    let prompt = s["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == id)
        .unwrap();
    let rendered = prompt["rendered_prompt"].as_str().unwrap();
    // Both template styles put the user text between a role line and an end marker.
    let (start, end) = if rendered.contains("<start_of_turn>user\n") {
        ("<start_of_turn>user\n", "<end_of_turn>")
    } else {
        ("<|im_start|>user\n", "<|im_end|>")
    };
    let after = &rendered[rendered.find(start).unwrap() + start.len()..];
    after[..after.find(end).unwrap()].to_string()
}

#[test]
fn gemma_stop_ids_come_from_generation_config() {
    let dir = hf_dir("gemma3_text");
    let hf = HfDirectory::open(&dir, None).unwrap();
    let config = TokenizerConfig::read(&dir).unwrap();
    let tokenizer = load_tokenizer(&dir, &config, &hf.config.eos_token_ids).unwrap();
    let mut stops = tokenizer.stop_ids().to_vec();
    stops.sort();
    assert_eq!(stops, vec![1, 6], "<eos> and <end_of_turn>");
}

/// A copy of a fixture directory that a test may break.
fn scratch_copy(arch: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(hf_dir(arch)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    tmp
}

fn open_error(dir: &Path) -> String {
    match lantern_model::load_model(dir, &Default::default()) {
        Ok(_) => panic!("{} loaded", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn broken_directories_give_errors_that_name_the_problem() {
    let tmp = scratch_copy("qwen3");
    let dir = tmp.path();
    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let err = open_error(dir);
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");

    let tmp = scratch_copy("qwen2");
    let dir = tmp.path();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &bytes[..bytes.len() / 2]).unwrap();
    let err = open_error(dir);
    assert!(
        err.contains("truncated") || err.contains("model.safetensors"),
        "{err}"
    );
    std::fs::write(dir.join("model.safetensors"), b"{}").unwrap();
    let err = open_error(dir);
    assert!(err.contains("model.safetensors"), "{err}");

    let tmp = scratch_copy("qwen2");
    let dir = tmp.path();
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert!(open_error(dir).contains("config.json"));
    std::fs::write(dir.join("config.json"), r#"{"model_type": "qwen2"}"#).unwrap();
    let err = open_error(dir);
    assert!(
        err.contains("config.json") && err.contains("hidden_size"),
        "{err}"
    );
    std::fs::write(dir.join("config.json"), r#"{"model_type": "bert"}"#).unwrap();
    assert!(open_error(dir).contains("bert"));
    let config = std::fs::read_to_string(hf_dir("qwen2").join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        config.replace("\"hidden_size\": 64", "\"hidden_size\": \"64\""),
    )
    .unwrap();
    let err = open_error(dir);
    assert!(err.contains("hidden_size"), "{err}");

    let tmp = scratch_copy("llama");
    let dir = tmp.path();
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    assert!(open_error(dir).contains("tokenizer.json"));

    let empty = tempfile::tempdir().unwrap();
    assert!(open_error(empty.path()).contains("config.json"));

    // A missing tensor is named as the checkpoint would hold it (renamed in the header,
    // same length, so the file stays whole).
    let tmp = scratch_copy("llama");
    let dir = tmp.path();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let (from, to) = (
        b"model.layers.0.self_attn.q_proj.weight",
        b"model.layers.0.self_attn.q_prox.weight",
    );
    let at = bytes.windows(from.len()).position(|w| w == from).unwrap();
    let mut renamed = bytes.clone();
    renamed[at..at + to.len()].copy_from_slice(to);
    std::fs::write(dir.join("model.safetensors"), renamed).unwrap();
    let err = open_error(dir);
    assert!(
        err.contains("`model.layers.0.self_attn.q_proj.weight` is missing")
            && err.contains("blk.0.attn_q.weight"),
        "{err}"
    );
}

#[test]
fn quantize_at_load_stores_matrices_in_the_asked_type() {
    use candle_core::quantized::GgmlDType;
    let mut hf = HfDirectory::open(&hf_dir("llama"), Some(GgmlDType::Q8_0)).unwrap();
    let (_, dtype) = hf.tensor_info("blk.0.attn_q.weight").unwrap();
    assert_eq!(dtype, GgmlDType::Q8_0);
    assert_eq!(
        hf.tensor("blk.0.attn_q.weight").unwrap().dtype(),
        GgmlDType::Q8_0
    );
    assert_eq!(
        hf.tensor_info("blk.0.attn_norm.weight").unwrap().1,
        GgmlDType::F32
    );
    // Relative error of q8_0 against the bf16 weights it came from.
    let mut exact = HfDirectory::open(&hf_dir("llama"), None).unwrap();
    let a = as_f32(&mut exact, "blk.0.ffn_up.weight");
    let b = as_f32(&mut hf, "blk.0.ffn_up.weight");
    let num: f32 = a.iter().zip(&b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f32 = a.iter().map(|x| x * x).sum();
    assert!(
        (num / den).sqrt() < 1e-2,
        "relative error {}",
        (num / den).sqrt()
    );
}
