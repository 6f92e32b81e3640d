//! Broken model files give errors that name the problem, never a panic.

use lantern_model::rope::{LONG_FACTORS, SHORT_FACTORS};
use lantern_model::synthetic::TinyLlama;
use lantern_model::{load_model, LoadOptions, ModelError};
use std::path::{Path, PathBuf};

fn load(path: &Path) -> Result<(), ModelError> {
    load_model(path, &LoadOptions::default()).map(|_| ())
}

fn tiny(dir: &Path, name: &str, model: &TinyLlama) -> PathBuf {
    let path = dir.join(name);
    model.write(&path).unwrap();
    path
}

#[test]
fn a_whole_tiny_model_loads() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny(dir.path(), "ok.gguf", &TinyLlama::default());
    let loaded = load_model(&path, &LoadOptions::default()).unwrap();
    assert_eq!(loaded.model.info().num_layers, 2);
    assert_eq!(
        loaded.tokenizer.encode("hi", false).unwrap(),
        vec![b'h' as u32, b'i' as u32]
    );
}

#[test]
fn longrope_files_missing_a_part_are_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let both = || vec![LONG_FACTORS.to_string(), SHORT_FACTORS.to_string()];
    let whole = TinyLlama {
        extra_vectors: both(),
        ..TinyLlama::default()
    };
    load(&tiny(dir.path(), "longrope.gguf", &whole)).unwrap();
    for (present, missing) in [(LONG_FACTORS, SHORT_FACTORS), (SHORT_FACTORS, LONG_FACTORS)] {
        let model = TinyLlama {
            extra_vectors: vec![present.to_string()],
            ..TinyLlama::default()
        };
        let err = load(&tiny(dir.path(), "half.gguf", &model))
            .unwrap_err()
            .to_string();
        assert!(err.contains(missing), "{err}");
    }
    let key = "llama.rope.scaling.original_context_length";
    let model = TinyLlama {
        extra_vectors: both(),
        omit_keys: vec![key.to_string()],
        ..TinyLlama::default()
    };
    let err = load(&tiny(dir.path(), "no_context.gguf", &model))
        .unwrap_err()
        .to_string();
    assert!(err.contains(key), "{err}");
}

#[test]
fn a_missing_file_names_the_path() {
    let err = load(Path::new("/nonexistent/model.gguf"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn a_file_that_is_not_gguf_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("notes.gguf");
    std::fs::write(&path, "this is a text file, not a model").unwrap();
    let err = load(&path).unwrap_err();
    assert!(matches!(err, ModelError::InvalidGguf { .. }), "{err}");
}

#[test]
fn a_truncated_file_names_the_tensor_it_cuts() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny(dir.path(), "whole.gguf", &TinyLlama::default());
    let bytes = std::fs::read(&path).unwrap();
    for keep in [bytes.len() - 1, bytes.len() * 3 / 4, bytes.len() / 2] {
        let cut = dir.path().join(format!("cut{keep}.gguf"));
        std::fs::write(&cut, &bytes[..keep]).unwrap();
        match load(&cut).unwrap_err() {
            ModelError::Truncated {
                tensor, file_len, ..
            } => {
                assert!(!tensor.is_empty());
                assert_eq!(file_len, keep as u64);
            }
            other => panic!("cut at {keep}: expected a truncation error, got {other}"),
        }
    }
    // Cut inside the header: still an error, not a panic.
    for keep in [3, 16, 100, 1000] {
        let cut = dir.path().join(format!("head{keep}.gguf"));
        std::fs::write(&cut, &bytes[..keep]).unwrap();
        let err = load(&cut).unwrap_err();
        assert!(
            matches!(err, ModelError::InvalidGguf { .. }),
            "cut at {keep}: {err}"
        );
    }
}

#[test]
fn corrupted_header_bytes_give_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny(dir.path(), "whole.gguf", &TinyLlama::default());
    let bytes = std::fs::read(&path).unwrap();
    // Overwrite bytes all over the header (lengths, counts, types) with 0xFF and 0x00.
    let header_end = 4096.min(bytes.len());
    let mut seen_errors = 0;
    for pos in (4..header_end).step_by(37) {
        for value in [0xFF, 0x00, 0x7F] {
            let mut broken = bytes.clone();
            broken[pos] = value;
            let p = dir.path().join("broken.gguf");
            std::fs::write(&p, &broken).unwrap();
            // Either it still loads (the byte did not matter) or it is an error; a panic
            // fails the test.
            if load(&p).is_err() {
                seen_errors += 1;
            }
        }
    }
    assert!(seen_errors > 0);
}

#[test]
fn a_missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = TinyLlama {
        omit_tensors: vec!["blk.1.attn_v.weight".into()],
        ..TinyLlama::default()
    };
    let err = load(&tiny(dir.path(), "m.gguf", &model)).unwrap_err();
    assert!(
        matches!(&err, ModelError::MissingTensor { name } if name == "blk.1.attn_v.weight"),
        "{err}"
    );
}

#[test]
fn a_missing_metadata_key_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = TinyLlama {
        omit_keys: vec!["llama.attention.head_count".into()],
        ..TinyLlama::default()
    };
    let err = load(&tiny(dir.path(), "m.gguf", &model)).unwrap_err();
    assert!(
        err.to_string().contains("llama.attention.head_count"),
        "{err}"
    );
}

#[test]
fn an_unsupported_architecture_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let model = TinyLlama {
        architecture: "mamba".into(),
        ..TinyLlama::default()
    };
    let err = load(&tiny(dir.path(), "m.gguf", &model)).unwrap_err();
    assert!(
        matches!(&err, ModelError::UnsupportedArchitecture(a) if a == "mamba"),
        "{err}"
    );
}

#[test]
fn a_tensor_of_the_wrong_shape_is_named() {
    let dir = tempfile::tempdir().unwrap();
    // Heads that do not divide the hidden size give the q projection the wrong shape.
    let model = TinyLlama {
        kv_heads: 4,
        ..TinyLlama::default()
    };
    let path = tiny(dir.path(), "m.gguf", &model);
    let bytes = std::fs::read(&path).unwrap();
    // Re-declare two KV heads in the metadata of a file whose k/v have four.
    let needle = b"llama.attention.head_count_kv";
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap()
        + needle.len();
    let mut broken = bytes.clone();
    // The value follows its type tag (u32 = 4): 4 bytes of type, then the value.
    broken[at + 4] = 2;
    let p = dir.path().join("shape.gguf");
    std::fs::write(&p, &broken).unwrap();
    let err = load(&p).unwrap_err();
    assert!(
        matches!(&err, ModelError::BadShape { name, .. } if name.contains("attn_k")),
        "{err}"
    );
}
