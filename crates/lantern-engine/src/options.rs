//! Engine options as every front end spells them (the CLI's flags, `LLM(...)`'s keyword
//! arguments): their values parsed one way, and the model they name loaded one way —
//! weights, the chat template that may replace the model's own, the engine over them.

use crate::{Engine, EngineConfig, EngineError};
use lantern_kv::KvDtype;
use lantern_model::{ChatTemplate, GgmlDType, LoadOptions, ModelError};
use std::path::{Path, PathBuf};

/// `1073741824`, `512M`, `1G`, `64K` (powers of 1024): a positive byte count.
pub fn parse_byte_count(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let (digits, multiplier) = match text.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&text[..text.len() - 1], 1usize << 10),
        Some('M') => (&text[..text.len() - 1], 1 << 20),
        Some('G') => (&text[..text.len() - 1], 1 << 30),
        _ => (text, 1),
    };
    match digits.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok((v * multiplier as f64) as usize),
        _ => Err(format!(
            "{text:?} is not a positive byte count (a number, or like \"512M\", \"1G\")"
        )),
    }
}

/// The KV cache's element type: `f16`, `bf16` or `f32` (or their long names).
pub fn parse_kv_dtype(text: &str) -> Result<KvDtype, String> {
    Ok(match text {
        "f32" | "float32" => KvDtype::F32,
        // vLLM's default: lantern's.
        "f16" | "float16" | "auto" => KvDtype::F16,
        "bf16" | "bfloat16" => KvDtype::BF16,
        other => {
            return Err(format!(
                "{other:?} is not a KV cache dtype (f16, bf16, f32)"
            ))
        }
    })
}

/// A weight type Hugging Face directories can be quantized to at load.
pub fn parse_weight_type(text: &str) -> Result<GgmlDType, String> {
    Ok(match text.to_ascii_lowercase().as_str() {
        "q8_0" => GgmlDType::Q8_0,
        "q4_0" => GgmlDType::Q4_0,
        "q4_1" => GgmlDType::Q4_1,
        "q5_0" => GgmlDType::Q5_0,
        "q5_1" => GgmlDType::Q5_1,
        "q4_k" => GgmlDType::Q4K,
        "q5_k" => GgmlDType::Q5K,
        "q6_k" => GgmlDType::Q6K,
        "f16" => GgmlDType::F16,
        "bf16" => GgmlDType::BF16,
        "f32" => GgmlDType::F32,
        other => {
            return Err(format!(
                "{other:?} is not a weight type (q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, \
                 f16, bf16, f32)"
            ))
        }
    })
}

/// How to load a model for an engine: the weights as `lantern_model` loads them, and a
/// chat template that may replace the model's own.
#[derive(Debug, Clone, Default)]
pub struct ModelLoad {
    pub weights: LoadOptions,
    /// Where the model runs.
    pub device: crate::device::DeviceChoice,
    /// GPU only: the share of the card's memory the process may use, the KV cache sized
    /// from what the weights leave (instead of `kv_cache_memory`).
    pub gpu_memory_utilization: Option<f32>,
    /// A Jinja chat template file that replaces the model's own.
    pub chat_template: Option<PathBuf>,
    /// Whether requests get the model's recommended sampling defaults
    /// (`generation_config.json`) for the fields they leave out: vLLM's
    /// `--generation-config auto` (its default) against `vllm`.
    pub model_sampling_defaults: bool,
}

/// Why a model path (given as `field`) names nothing, with a hint when it looks like a
/// model hub's id (`org/name`), which vLLM's users are used to giving.
pub fn missing_model(path: &Path, field: &str) -> String {
    let given = path.to_string_lossy();
    let mut message = format!("{field} {given}: no such file or directory");
    let parts: Vec<&str> = given.split('/').collect();
    let hub_like = parts.len() == 2
        && parts.iter().all(|p| !p.is_empty() && !p.starts_with('.'))
        && !given.ends_with(".gguf");
    if hub_like {
        message.push_str(
            "; lantern reads local models only and does not download from a model hub: \
             give the path of a GGUF file or of a Hugging Face model directory (config.json, \
             tokenizer.json and the .safetensors files), or none for the default model",
        );
    }
    message
}

/// Why a model could not be loaded into an engine; each names the file at fault.
#[derive(Debug, thiserror::Error)]
pub enum LoadEngineError {
    #[error("loading {path}: {source}")]
    Model {
        path: PathBuf,
        source: Box<ModelError>,
    },
    #[error("reading chat template {path}: {source}")]
    ReadChatTemplate {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("chat template {path}: {message}")]
    ChatTemplate { path: PathBuf, message: String },
    #[error(transparent)]
    Engine(#[from] Box<EngineError>),
}

/// A `--chat-template` that is the template's text rather than a file's path (vLLM
/// takes both): no such file, and Jinja's braces or a line break in it.
fn inline_template(given: &Path) -> Option<&str> {
    let text = given.to_str()?;
    let jinja = text.contains(['{', '}', '\n']);
    (jinja && !given.exists()).then_some(text)
}

/// Loads the model at `path` as `load` says and starts an engine over it.
pub fn load_engine(
    path: &Path,
    load: &ModelLoad,
    config: EngineConfig,
) -> Result<Engine, LoadEngineError> {
    if load.weights.quantize.is_some() && !lantern_model::hf::is_hf_directory(path) {
        return Err(Box::new(EngineError::InvalidConfig(format!(
            "--quantize converts a Hugging Face directory's weights at load; {} is a GGUF file, whose weights keep the types it stores (convert it with llama.cpp's llama-quantize)",
            path.display()
        )))
        .into());
    }
    // The model sees the context it will serve (LongRoPE picks its factors by it).
    let weights = lantern_model::LoadOptions {
        context_length: config.max_model_len,
        ..load.weights
    };
    let mut placed = crate::device::load_on(load.device, path, &weights).map_err(|e| match e {
        EngineError::Model(source) => LoadEngineError::Model {
            path: path.to_path_buf(),
            source: Box::new(source),
        },
        other => Box::new(other).into(),
    })?;
    let loaded = &mut placed.loaded;
    if !load.model_sampling_defaults {
        loaded.sampling_defaults = Default::default();
    }
    if let Some(file) = &load.chat_template {
        let inline = inline_template(file);
        let source = match inline {
            Some(text) => text.to_string(),
            None => std::fs::read_to_string(file).map_err(|source| {
                LoadEngineError::ReadChatTemplate {
                    path: file.clone(),
                    source,
                }
            })?,
        };
        let template = ChatTemplate::new(
            &source,
            loaded.tokenizer.bos_token().unwrap_or_default(),
            loaded.tokenizer.eos_token().unwrap_or_default(),
        )
        .map_err(|e| LoadEngineError::ChatTemplate {
            path: match inline {
                Some(_) => PathBuf::from("(given as text)"),
                None => file.clone(),
            },
            message: e.to_string(),
        })?;
        loaded.chat_template = Some(template);
    }
    placed
        .start(config, load.gpu_memory_utilization)
        .map_err(|e| Box::new(e).into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_model_that_looks_like_a_hub_id_gets_the_hint() {
        let hint = "does not download from a model hub";
        for hub in ["Qwen/Qwen2.5-0.5B", "HuggingFaceTB/SmolLM2-135M-Instruct"] {
            let m = missing_model(Path::new(hub), "--model");
            assert!(
                m.starts_with(&format!("--model {hub}: no such file")),
                "{m}"
            );
            assert!(m.contains(hint), "{m}");
        }
        for path in [
            "nope.gguf",
            "./models/x",
            "/abs/path",
            "org/model.gguf",
            "a/b/c",
        ] {
            let m = missing_model(Path::new(path), "model");
            assert_eq!(m, format!("model {path}: no such file or directory"));
        }
    }

    #[test]
    fn byte_counts_take_binary_suffixes_and_refuse_the_rest() {
        assert_eq!(parse_byte_count("1073741824"), Ok(1 << 30));
        assert_eq!(parse_byte_count("512M"), Ok(512 << 20));
        assert_eq!(parse_byte_count(" 1g "), Ok(1 << 30));
        assert_eq!(parse_byte_count("64K"), Ok(64 << 10));
        assert_eq!(parse_byte_count("1.5K"), Ok(1536));
        for bad in ["", "0", "-1G", "lots", "NaN", "1T"] {
            let e = parse_byte_count(bad).unwrap_err();
            assert!(e.contains("not a positive byte count"), "{bad}: {e}");
        }
    }

    #[test]
    fn dtypes_and_weight_types_by_name() {
        assert_eq!(parse_kv_dtype("bfloat16"), Ok(KvDtype::BF16));
        assert!(parse_kv_dtype("f8").unwrap_err().contains("f16, bf16, f32"));
        assert_eq!(parse_weight_type("Q4_K"), Ok(GgmlDType::Q4K));
        assert_eq!(parse_weight_type("q4_1"), Ok(GgmlDType::Q4_1));
        assert_eq!(parse_weight_type("Q5_K"), Ok(GgmlDType::Q5K));
        assert!(parse_weight_type("q3_k").unwrap_err().contains("q8_0"));
    }

    #[test]
    fn a_missing_model_or_template_names_the_file() {
        let e = load_engine(
            Path::new("/nonexistent/model.gguf"),
            &ModelLoad::default(),
            EngineConfig::default(),
        )
        .err()
        .expect("no such model");
        assert!(e.to_string().contains("/nonexistent/model.gguf"), "{e}");
    }
}
