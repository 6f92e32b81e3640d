//! Model hyper-parameters read from GGUF metadata.

use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;

/// Hyper-parameters of a Llama-family decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub architecture: String,
    pub name: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_dim: usize,
    /// Linear RoPE scaling: positions are divided by this factor.
    pub rope_linear_factor: f32,
}

impl LlamaConfig {
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let arch = gguf.get_string("general.architecture")?.to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let hidden_size = gguf.get_usize(&key("embedding_length"))?;
        let num_heads = gguf.get_usize(&key("attention.head_count"))?;
        let num_kv_heads = gguf
            .opt_usize(&key("attention.head_count_kv"))?
            .unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(ModelError::InvalidConfig(format!(
                "{num_heads} attention heads cannot share {num_kv_heads} KV heads"
            )));
        }
        let head_dim = match gguf.opt_usize(&key("attention.key_length"))? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(ModelError::InvalidConfig(format!(
                    "hidden size {hidden_size} is not a multiple of {num_heads} heads"
                )))
            }
        };
        let rope_dim = gguf
            .opt_usize(&key("rope.dimension_count"))?
            .unwrap_or(head_dim);
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(ModelError::InvalidConfig(format!(
                "rotary dimension {rope_dim} does not fit head dimension {head_dim}"
            )));
        }
        let rope_linear_factor = match gguf.opt_string(&key("rope.scaling.type"))? {
            None | Some("none") => 1.0,
            Some("linear") => gguf.opt_f32(&key("rope.scaling.factor"))?.unwrap_or(1.0),
            Some(other) => {
                return Err(ModelError::InvalidConfig(format!(
                    "RoPE scaling `{other}` is not supported (supported: none, linear)"
                )))
            }
        };
        let vocab_size = match gguf.opt_usize(&key("vocab_size"))? {
            Some(v) => v,
            None => gguf.string_array("tokenizer.ggml.tokens")?.len(),
        };
        let config = Self {
            name: gguf
                .opt_string("general.name")?
                .unwrap_or(&arch)
                .to_string(),
            num_layers: gguf.get_usize(&key("block_count"))?,
            intermediate_size: gguf.get_usize(&key("feed_forward_length"))?,
            context_length: gguf.opt_usize(&key("context_length"))?.unwrap_or(2048),
            rms_norm_eps: gguf
                .opt_f32(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-5),
            rope_theta: gguf.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            architecture: arch,
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            rope_dim,
            rope_linear_factor,
        };
        if config.num_layers == 0 || config.hidden_size == 0 || config.vocab_size == 0 {
            return Err(ModelError::InvalidConfig(
                "layers, hidden size and vocabulary must be non-zero".into(),
            ));
        }
        Ok(config)
    }
}
