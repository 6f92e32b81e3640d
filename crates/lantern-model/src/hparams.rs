//! Hyper-parameters every decoder shares, read from llama.cpp's GGUF keys (and the
//! `lantern.*` keys of [`crate::source`]) once, for every architecture.

use crate::error::{ModelError, Result};
use crate::rope::RopeScaling;
use crate::source::{keys, WeightSource};

/// What the metadata says about a decoder; architecture descriptions add their defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct HParams {
    pub architecture: String,
    pub name: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Dimensions of each head that RoPE rotates (the first `rope_dim`).
    pub rope_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    /// `None` when the file does not say (architectures differ in their default).
    pub rms_norm_eps: Option<f32>,
    /// LayerNorm's eps (GPT-2, GPT-NeoX), when the file says.
    pub layer_norm_eps: Option<f32>,
    pub rope_theta: f32,
    /// RoPE base of sliding-window layers when it differs (Gemma 3).
    pub rope_theta_swa: Option<f32>,
    pub rope_scaling: RopeScaling,
    /// The window of the layers that slide, as the file gives it (Phi-3's files write 0
    /// for none; [`Self::window`] reads it so).
    pub sliding_window: Option<usize>,
    /// Which layers slide, when the source says (`lantern.attention.sliding_layers`).
    pub sliding_layers: Option<Vec<bool>>,
    pub query_pre_attn_scalar: Option<f32>,
    pub attn_logit_softcap: Option<f32>,
    pub final_logit_softcap: Option<f32>,
    /// q, k and v clamped to `[-c, c]` after their projections (`attention.clamp_kqv`:
    /// OLMo's `clip_qkv`).
    pub clamp_kqv: Option<f32>,
    /// The mixture-of-experts layers' shape, when the model has experts.
    pub experts: Option<ExpertParams>,
}

/// A mixture-of-experts MLP: `count` experts, `used` of them per token, each a gated MLP
/// of `ffn` hidden units (`{arch}.expert_feed_forward_length`, else the dense
/// `feed_forward_length`, as Mixtral's files give it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertParams {
    pub count: usize,
    pub used: usize,
    pub ffn: usize,
    /// The chosen experts' router probabilities divided by their sum
    /// (`{arch}.expert_weights_norm`; absent, the architecture says).
    pub normalize_weights: Option<bool>,
}

/// Far above any released model (DeepSeek V3: 256, Qwen3-Next: 512): a bound on what
/// per-expert tables a file can make lantern allocate.
const MAX_EXPERTS: usize = 1 << 16;

impl ExpertParams {
    /// `None` when `{arch}.expert_count` is absent or 0.
    fn read(src: &dyn WeightSource, arch: &str, dense_ffn: usize) -> Result<Option<Self>> {
        let key = |k: &str| format!("{arch}.{k}");
        let count = match src.opt_usize(&key("expert_count"))? {
            None | Some(0) => return Ok(None),
            Some(n) if n <= MAX_EXPERTS => n,
            Some(n) => {
                return Err(ModelError::InvalidConfig(format!(
                    "`{}` is {n}, more than the {MAX_EXPERTS} lantern reads",
                    key("expert_count")
                )))
            }
        };
        let used = src.get_usize(&key("expert_used_count"))?;
        if used == 0 || used > count {
            return Err(ModelError::InvalidConfig(format!(
                "`{}` is {used}, expected 1 to `{}` ({count})",
                key("expert_used_count"),
                key("expert_count")
            )));
        }
        // Softmax routers only (llama.cpp: 1 softmax, 2 sigmoid, 3 the softmax of the
        // chosen logits, which is softmax with the chosen weights renormalized).
        let mut normalize_weights = src.opt_bool(&key("expert_weights_norm"))?;
        match src.opt_usize(&key("expert_gating_func"))? {
            None | Some(1) => {}
            Some(3) => normalize_weights = Some(true),
            Some(gating) => {
                return Err(ModelError::InvalidConfig(format!(
                    "`{}` is {gating}: only softmax routers (1, 3) are supported",
                    key("expert_gating_func")
                )))
            }
        }
        Ok(Some(Self {
            count,
            used,
            ffn: src
                .opt_usize(&key("expert_feed_forward_length"))?
                .unwrap_or(dense_ffn),
            normalize_weights,
        }))
    }
}

impl HParams {
    pub fn read(src: &dyn WeightSource) -> Result<Self> {
        let arch = src.get_string("general.architecture")?.to_string();
        let key = |k: &str| format!("{arch}.{k}");
        let hidden_size = src.get_usize(&key("embedding_length"))?;
        let num_heads = src.get_usize(&key("attention.head_count"))?;
        let num_kv_heads = src
            .opt_usize(&key("attention.head_count_kv"))?
            .unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(ModelError::InvalidConfig(format!(
                "{num_heads} attention heads cannot share {num_kv_heads} KV heads"
            )));
        }
        let head_dim = match src.opt_usize(&key("attention.key_length"))? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(ModelError::InvalidConfig(format!(
                    "hidden size {hidden_size} is not a multiple of {num_heads} heads"
                )))
            }
        };
        let rope_dim = src
            .opt_usize(&key("rope.dimension_count"))?
            .unwrap_or(head_dim);
        if rope_dim > head_dim || rope_dim % 2 != 0 {
            return Err(ModelError::InvalidConfig(format!(
                "rotary dimension {rope_dim} does not fit head dimension {head_dim}"
            )));
        }
        let vocab_size = match src.opt_usize(&key("vocab_size"))? {
            Some(v) => v,
            None => match src.tensor_info("token_embd.weight") {
                Some((dims, _)) if dims.len() == 2 => dims[0],
                _ => src.string_array("tokenizer.ggml.tokens")?.len(),
            },
        };
        let window = match src.opt_usize(keys::SLIDING_WINDOW)? {
            Some(w) => Some(w),
            None => src.opt_usize(&key("attention.sliding_window"))?,
        };
        let positive = |name: &str, v: Option<f32>| match v {
            Some(v) if !v.is_finite() || v <= 0.0 => Err(ModelError::InvalidConfig(format!(
                "`{name}` is {v}, expected a positive number"
            ))),
            other => Ok(other),
        };
        let num_layers = src.get_usize(&key("block_count"))?;
        let intermediate_size = src.get_usize(&key("feed_forward_length"))?;
        let experts = ExpertParams::read(src, &arch, intermediate_size)?;
        let sliding_layers = src.opt_bool_array(keys::SLIDING_LAYERS)?;
        if let Some(layers) = &sliding_layers {
            if layers.len() != num_layers {
                return Err(ModelError::InvalidConfig(format!(
                    "`{}` has {} entries for {num_layers} layers",
                    keys::SLIDING_LAYERS,
                    layers.len()
                )));
            }
        }
        let params = Self {
            name: src.opt_string("general.name")?.unwrap_or(&arch).to_string(),
            num_layers,
            intermediate_size,
            experts,
            context_length: src.opt_usize(&key("context_length"))?.unwrap_or(2048),
            rms_norm_eps: src.opt_f32(&key("attention.layer_norm_rms_epsilon"))?,
            layer_norm_eps: src.opt_f32(&key("attention.layer_norm_epsilon"))?,
            rope_theta: src.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
            rope_theta_swa: src.opt_f32(&key("rope.freq_base_swa"))?,
            rope_scaling: RopeScaling::read(src, &arch)?,
            sliding_window: window,
            sliding_layers,
            query_pre_attn_scalar: positive(
                keys::QUERY_PRE_ATTN_SCALAR,
                match src.opt_f32(keys::QUERY_PRE_ATTN_SCALAR)? {
                    Some(s) => Some(s),
                    None => src.opt_f32(&key("attention.query_pre_attn_scalar"))?,
                },
            )?,
            attn_logit_softcap: positive(
                "attn_logit_softcapping",
                src.opt_f32(&key("attn_logit_softcapping"))?,
            )?,
            final_logit_softcap: positive(
                "final_logit_softcapping",
                src.opt_f32(&key("final_logit_softcapping"))?,
            )?,
            clamp_kqv: positive(
                "attention.clamp_kqv",
                src.opt_f32(&key("attention.clamp_kqv"))?,
            )?,
            architecture: arch,
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            rope_dim,
            vocab_size,
        };
        if params.num_layers == 0 || params.hidden_size == 0 || params.vocab_size == 0 {
            return Err(ModelError::InvalidConfig(
                "layers, hidden size and vocabulary must be non-zero".into(),
            ));
        }
        params.check_fits(src)?;
        let value_key = format!("{}.attention.value_length", params.architecture);
        if let Some(v) = src.opt_usize(&value_key)? {
            if v != head_dim {
                return Err(ModelError::InvalidConfig(format!(
                    "value head size {v} differs from key head size {head_dim}"
                )));
            }
        }
        Ok(params)
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
        let expert = self.experts.map(|e| {
            (
                "expert_feed_forward_length x embedding_length",
                e.ffn.checked_mul(h),
            )
        });
        for (what, elements) in matrices.into_iter().chain(expert) {
            if elements.is_none_or(|n| n > largest) {
                return Err(ModelError::InvalidConfig(format!(
                    "{what} from the metadata exceeds the largest tensor in the file ({largest} elements)"
                )));
            }
        }
        Ok(())
    }

    /// The sliding window, 0 read as none.
    pub fn window(&self) -> Option<usize> {
        self.sliding_window.filter(|&w| w > 0)
    }

    /// Which layers slide: the source's list, else `default(layer)` (only when there is a
    /// window at all).
    pub fn sliding(&self, default: impl Fn(usize) -> bool) -> Vec<bool> {
        match (&self.sliding_layers, self.window()) {
            (_, None) => vec![false; self.num_layers],
            (Some(layers), Some(_)) => layers.clone(),
            (None, Some(_)) => (0..self.num_layers).map(default).collect(),
        }
    }
}
