//! Gemma 3 270M (Q4_K_M GGUF): the file is fetched, its SentencePiece tokenizer converts
//! and tokenizes as the reference does.

use lantern_model::default_model::ensure_gemma3_270m;
use lantern_model::{GgufFile, ModelTokenizer, WeightSource};
use std::path::Path;

fn summary() -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/reference/gemma3/summary.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

#[test]
fn the_tokenizer_matches_the_reference() {
    let path = ensure_gemma3_270m().expect("Gemma 3 270M available");
    let gguf = GgufFile::open(&path).unwrap();
    assert_eq!(gguf.get_string("general.architecture").unwrap(), "gemma3");
    let tokenizer = ModelTokenizer::from_gguf(&gguf).unwrap();
    assert_eq!(tokenizer.vocab_size(), 262_144);
    assert_eq!(tokenizer.bos_token(), Some("<bos>"));
    assert_eq!(tokenizer.eos_token(), Some("<eos>"));
    for p in summary()["prompts"].as_array().unwrap() {
        let text = p["rendered_prompt"].as_str().unwrap();
        let expected: Vec<u32> = p["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let ids = tokenizer.encode(text, true).unwrap();
        assert_eq!(ids, expected);
        assert_eq!(tokenizer.decode(&ids, true).unwrap(), text);
        let gen: Vec<u32> = p["gen_ids"]
            .as_array()
            .map(|a| a.iter().map(|v| v.as_u64().unwrap() as u32).collect())
            .unwrap_or_default();
        if let Some(gen_text) = p["gen_text"].as_str() {
            assert_eq!(tokenizer.decode(&gen, false).unwrap(), gen_text);
        }
    }
    // Runs of spaces and newlines are user-defined tokens, bytes outside the vocabulary
    // fall back to byte tokens, and everything decodes back.
    for text in ["a  b\n\nc", "tab\there", "emoji 🦀 and \u{1}", "  leading"] {
        let ids = tokenizer.encode(text, false).unwrap();
        assert_eq!(tokenizer.decode(&ids, false).unwrap(), text, "{ids:?}");
    }
}

mod tiny {
    use lantern_model::synthetic::{TinyLlama, GEMMA3_TINY_WINDOW};
    use lantern_model::{load_model, LoadOptions, ModelError};

    fn tiny(layers: usize) -> TinyLlama {
        TinyLlama {
            architecture: "gemma3".into(),
            num_layers: layers,
            ..TinyLlama::default()
        }
    }

    fn load(model: &TinyLlama) -> Result<lantern_model::LoadedModel, ModelError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny-gemma3.gguf");
        model.write(&path).unwrap();
        load_model(&path, &LoadOptions::default())
    }

    #[test]
    fn every_sixth_layer_is_global_and_the_others_slide() {
        let loaded = load(&tiny(7)).unwrap();
        let info = loaded.model.info();
        assert_eq!(info.architecture, "gemma3");
        let windows: Vec<_> = info.attention.iter().map(|a| a.sliding_window).collect();
        let w = Some(GEMMA3_TINY_WINDOW);
        assert_eq!(windows, vec![w, w, w, w, w, None, w]);
        // head_dim 16: scale 16^-0.5.
        assert_eq!(info.attention[0].scale, 0.25);
    }

    #[test]
    fn a_missing_qk_norm_is_named() {
        let model = TinyLlama {
            omit_tensors: vec!["blk.1.attn_k_norm.weight".into()],
            ..tiny(2)
        };
        let err = load(&model).err().expect("refused").to_string();
        assert!(err.contains("blk.1.attn_k_norm.weight"), "{err}");
    }

    #[test]
    fn missing_hyper_parameters_are_named() {
        let model = TinyLlama {
            omit_keys: vec!["gemma3.attention.head_count".into()],
            ..tiny(2)
        };
        let err = load(&model).err().expect("refused").to_string();
        assert!(err.contains("gemma3.attention.head_count"), "{err}");
    }
}
