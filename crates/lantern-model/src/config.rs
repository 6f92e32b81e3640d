//! Model hyper-parameters read from GGUF metadata.

use crate::error::{ModelError, Result};
use crate::source::WeightSource;

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
    pub fn from_gguf(gguf: &dyn WeightSource) -> Result<Self> {
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
        config.check_fits(gguf)?;
        Ok(config)
    }

    /// The sizes the metadata declares must fit the tensors the file has (each layer has
    /// tensors of its own; each matrix is at most the largest tensor), so that nothing
    /// sized by them — per-layer tables, RoPE tables — is allocated for a file that lies.
    fn check_fits(&self, source: &dyn WeightSource) -> Result<()> {
        let names = source.tensor_names();
        if self.num_layers > names.len() {
            return Err(ModelError::InvalidConfig(format!(
                "`{}.block_count` is {}, but the file has only {} tensors",
                self.architecture,
                self.num_layers,
                names.len()
            )));
        }
        let largest = names
            .iter()
            .filter_map(|n| source.tensor_info(n))
            .map(|(dims, _)| dims.iter().fold(1usize, |a, &d| a.saturating_mul(d)))
            .max()
            .unwrap_or(0);
        let h = self.hidden_size;
        let matrices = [
            (
                "vocab_size x embedding_length",
                self.vocab_size.checked_mul(h),
            ),
            (
                "head_count x key_length x embedding_length",
                self.num_heads
                    .checked_mul(self.head_dim)
                    .and_then(|q| q.checked_mul(h)),
            ),
            (
                "head_count_kv x key_length x embedding_length",
                self.num_kv_heads
                    .checked_mul(self.head_dim)
                    .and_then(|kv| kv.checked_mul(h)),
            ),
            (
                "feed_forward_length x embedding_length",
                self.intermediate_size.checked_mul(h),
            ),
        ];
        for (what, elements) in matrices {
            if elements.is_none_or(|n| n > largest) {
                return Err(ModelError::InvalidConfig(format!(
                    "{what} from the metadata exceeds the largest tensor in the file ({largest} elements)"
                )));
            }
        }
        Ok(())
    }
}

/// Hyper-parameters of a Gemma 3 text decoder (`general.architecture` = `gemma3`).
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma3Config {
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
    /// RoPE base of the global (full-attention) layers.
    pub rope_global_base: f32,
    /// RoPE base of the sliding-window layers.
    pub rope_local_base: f32,
    /// Linear RoPE scaling of the global layers (positions divided by it); local layers
    /// are never scaled.
    pub rope_global_linear_factor: f32,
    /// Multiplies `q . k`: `query_pre_attn_scalar ^ -0.5`.
    pub attention_scale: f32,
    /// `Some(w)` on the layers that see at most `w` keys, `None` on the global ones.
    pub layer_window: Vec<Option<usize>>,
    pub attn_logit_softcap: Option<f32>,
    pub final_logit_softcap: Option<f32>,
}

impl Gemma3Config {
    /// Every `GEMMA3_GLOBAL_EVERY`-th layer (5, 11, 17, …) attends to the whole context
    /// when the file does not give the pattern (the architecture's default, as llama.cpp
    /// and transformers apply it).
    pub const GLOBAL_EVERY: usize = 6;
    /// Local RoPE base when the file does not give one.
    pub const DEFAULT_LOCAL_ROPE_BASE: f32 = 10_000.0;

    pub fn from_gguf(gguf: &dyn WeightSource) -> Result<Self> {
        // The shared hyper-parameters read exactly as for Llama (heads, head size, …).
        let base = LlamaConfig::from_gguf(gguf)?;
        let arch = base.architecture.clone();
        let key = |k: &str| format!("{arch}.{k}");
        if let Some(v) = gguf.opt_usize(&key("attention.value_length"))? {
            if v != base.head_dim {
                return Err(ModelError::InvalidConfig(format!(
                    "value head size {v} differs from key head size {}",
                    base.head_dim
                )));
            }
        }
        if base.rope_dim != base.head_dim {
            return Err(ModelError::InvalidConfig(format!(
                "partial rotary dimension {} of {} is not supported for Gemma 3",
                base.rope_dim, base.head_dim
            )));
        }
        let window = gguf.opt_usize(&key("attention.sliding_window"))?;
        if window == Some(0) {
            return Err(ModelError::InvalidConfig(
                "sliding window of 0 tokens".into(),
            ));
        }
        let sliding = sliding_layers(
            gguf,
            &key("attention.sliding_window_pattern"),
            base.num_layers,
        )?;
        let layer_window = sliding
            .iter()
            .map(|&s| if s { window } else { None })
            .collect();
        // transformers' `query_pre_attn_scalar`: the head size, except Gemma 3 27B (62
        // layers), which uses hidden / heads (llama.cpp does the same).
        let query_pre_attn_scalar = match gguf.opt_f32(&key("attention.query_pre_attn_scalar"))? {
            Some(s) => s,
            None if base.num_layers == 62 => (base.hidden_size / base.num_heads) as f32,
            None => base.head_dim as f32,
        };
        if !query_pre_attn_scalar.is_finite() || query_pre_attn_scalar <= 0.0 {
            return Err(ModelError::InvalidConfig(format!(
                "query_pre_attn_scalar {query_pre_attn_scalar} is not positive"
            )));
        }
        let positive = |name: &str, v: Option<f32>| match v {
            Some(v) if !v.is_finite() || v <= 0.0 => Err(ModelError::InvalidConfig(format!(
                "`{name}` is {v}, expected a positive number"
            ))),
            other => Ok(other),
        };
        Ok(Self {
            name: base.name,
            num_layers: base.num_layers,
            hidden_size: base.hidden_size,
            intermediate_size: base.intermediate_size,
            num_heads: base.num_heads,
            num_kv_heads: base.num_kv_heads,
            head_dim: base.head_dim,
            vocab_size: base.vocab_size,
            context_length: base.context_length,
            rms_norm_eps: gguf
                .opt_f32(&key("attention.layer_norm_rms_epsilon"))?
                .unwrap_or(1e-6),
            rope_global_base: base.rope_theta,
            rope_local_base: gguf
                .opt_f32(&key("rope.freq_base_swa"))?
                .unwrap_or(Self::DEFAULT_LOCAL_ROPE_BASE),
            rope_global_linear_factor: base.rope_linear_factor,
            attention_scale: query_pre_attn_scalar.powf(-0.5),
            layer_window,
            attn_logit_softcap: positive(
                "attn_logit_softcapping",
                gguf.opt_f32(&key("attn_logit_softcapping"))?,
            )?,
            final_logit_softcap: positive(
                "final_logit_softcapping",
                gguf.opt_f32(&key("final_logit_softcapping"))?,
            )?,
            architecture: arch,
        })
    }
}

/// Which layers use the sliding window: from `key` when the file has it (a period `n`:
/// every `n`-th layer is global; or one boolean per layer, true where sliding), else the
/// architecture's default period.
fn sliding_layers(gguf: &dyn WeightSource, key: &str, num_layers: usize) -> Result<Vec<bool>> {
    use candle_core::quantized::gguf_file::Value;
    let by_period = |n: usize| (0..num_layers).map(|l| (l + 1) % n != 0).collect();
    let Some(value) = gguf.metadata(key) else {
        return Ok(by_period(Gemma3Config::GLOBAL_EVERY));
    };
    let wrong = || ModelError::WrongType {
        key: key.to_string(),
        expected: "positive integer or array of booleans",
    };
    match value {
        Value::Array(items) => {
            if items.len() != num_layers {
                return Err(ModelError::InvalidConfig(format!(
                    "`{key}` has {} entries for {num_layers} layers",
                    items.len()
                )));
            }
            items
                .iter()
                .map(|v| match v {
                    Value::Bool(b) => Ok(*b),
                    _ => Err(wrong()),
                })
                .collect()
        }
        _ => match gguf.opt_usize(key) {
            Ok(Some(n)) if n > 0 => Ok(by_period(n)),
            _ => Err(wrong()),
        },
    }
}
