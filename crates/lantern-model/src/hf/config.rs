//! `config.json` of a Hugging Face checkpoint, turned into the GGUF metadata llama.cpp's
//! `convert_hf_to_gguf.py` would write for it (plus the `lantern.*` keys of
//! [`crate::source`] for what GGUF cannot say).

use super::rope_scaling::{lift_rope_parameters, rope_scaling};
use crate::error::{ModelError, Result};
use crate::ops;
use crate::source::keys;
use candle_core::quantized::gguf_file::Value;
use serde_json::Value as Json;
use std::collections::HashMap;
use std::path::Path;

/// OPT's learned positions: position `p` is row `p + 2` of `embed_positions`.
const OPT_POSITION_OFFSET: usize = 2;

/// The `model_type`s lantern reads from a directory.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "smollm3",
    "granite",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mixtral",
    "olmoe",
    "olmo",
    "olmo2",
    "olmo3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "phi",
    "gpt_neox",
    "gpt2",
    "cohere",
    "cohere2",
    "glm4",
    "opt",
    "starcoder2",
    "gpt_oss",
];

/// What the tensor reader needs to know besides the metadata.
#[derive(Debug, Clone)]
pub struct HfConfig {
    pub model_type: String,
    /// GGUF `general.architecture`.
    pub gguf_arch: &'static str,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// RoPE scaling's per-frequency vectors, named as llama.cpp's converter writes them:
    /// Llama 3's divisors (`rope_freqs.weight`), LongRoPE's two sets.
    pub rope_tensors: Vec<(&'static str, Vec<f32>)>,
    pub metadata: HashMap<String, Value>,
}

impl HfConfig {
    /// q/k rows permuted so rotary pairs are adjacent (GGUF arch `llama`).
    pub fn permutes_qk(&self) -> bool {
        matches!(self.gguf_arch, "llama" | "smollm3" | "granite" | "olmo")
    }

    /// RMSNorm weights stored as `1 + w`.
    pub fn norms_plus_one(&self) -> bool {
        matches!(self.gguf_arch, "gemma" | "gemma2" | "gemma3")
    }

    /// `post_attention_layernorm` is GGUF's `post_attention_norm`: a norm of the
    /// attention's output (Gemma's sandwich, OLMo 2's post-norms) or, in gpt-oss, the norm
    /// before the experts that llama.cpp's converter names so; `ffn_norm` elsewhere.
    pub fn post_attention_norm(&self) -> bool {
        matches!(self.gguf_arch, "gemma2" | "gemma3" | "olmo2" | "gpt-oss")
    }

    /// Rows of `hf` left out as it is read: OPT's position table starts 2 rows in.
    pub fn skipped_rows(&self, hf: &str) -> usize {
        match self.gguf_arch == "opt" && hf.ends_with("embed_positions.weight") {
            true => OPT_POSITION_OFFSET,
            false => 0,
        }
    }

    /// GPT-2's `Conv1D` weights and gpt-oss's experts (`[experts, in, out]`) are stored
    /// with their last two axes `[in, out]`: transposed when read.
    pub fn transposes(&self, hf: &str) -> bool {
        if self.gguf_arch == "gpt-oss" {
            return hf.ends_with("mlp.experts.gate_up_proj")
                || hf.ends_with("mlp.experts.down_proj");
        }
        self.gguf_arch == "gpt2"
            && hf.ends_with(".weight")
            && [
                ".attn.c_attn.",
                ".attn.c_proj.",
                ".mlp.c_fc.",
                ".mlp.c_proj.",
            ]
            .iter()
            .any(|m| hf.contains(m))
    }

    /// gpt-oss's experts interleave gate and up outputs (gate at even positions):
    /// regrouped, gate first, when read (their weights after the transpose).
    pub fn deinterleaves_gate_up(&self, hf: &str) -> bool {
        self.gguf_arch == "gpt-oss"
            && (hf.ends_with("mlp.experts.gate_up_proj")
                || hf.ends_with("mlp.experts.gate_up_proj_bias"))
    }

    /// GPT-NeoX's fused q/k/v rows are grouped by head (`[heads, 3, head_dim]`): regrouped
    /// into q, k, v (as llama.cpp's converter does) when read.
    pub fn regroups_qkv(&self, hf: &str) -> bool {
        self.gguf_arch == "gptneox" && hf.contains(".attention.query_key_value.")
    }

    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let json: Json = serde_json::from_str(&text).map_err(|e| invalid(path, e.to_string()))?;
        Self::from_json(path, &json)
    }

    pub fn from_json(path: &Path, json: &Json) -> Result<Self> {
        let json = &lift_rope_parameters(path, json)?;
        let c = Keys { path, json };
        let model_type = c.req_str("model_type")?.to_string();
        let gguf_arch: &'static str = match model_type.as_str() {
            "llama" | "mistral" | "mixtral" => "llama",
            "smollm3" => "smollm3",
            "granite" => "granite",
            "qwen2" => "qwen2",
            "qwen3" => "qwen3",
            "qwen3_moe" => "qwen3moe",
            "olmoe" => "olmoe",
            "olmo" => "olmo",
            "olmo2" | "olmo3" => "olmo2",
            "gpt_neox" => "gptneox",
            "gpt2" => "gpt2",
            "gemma" => "gemma",
            "gemma2" => "gemma2",
            "gemma3_text" | "gemma3" => "gemma3",
            "phi3" => "phi3",
            "phi" => "phi2",
            "cohere" => "command-r",
            "cohere2" => "cohere2",
            "opt" => "opt",
            "starcoder2" => "starcoder2",
            "glm4" => "glm4",
            "gpt_oss" => "gpt-oss",
            other => {
                return Err(invalid(
                    path,
                    format!(
                        "model_type `{other}` is not supported (supported: {})",
                        SUPPORTED_MODEL_TYPES.join(", ")
                    ),
                ))
            }
        };
        quantization(&c, gguf_arch)?;
        // GPT-2's config has its own names.
        let gpt2 = gguf_arch == "gpt2";
        let key_of = |usual: &'static str, gpt2_name: &'static str| match gpt2 {
            true => gpt2_name,
            false => usual,
        };
        let hidden = c.req_usize(key_of("hidden_size", "n_embd"))?;
        let num_layers = c.req_usize(key_of("num_hidden_layers", "n_layer"))?;
        let num_heads = c.req_usize(key_of("num_attention_heads", "n_head"))?;
        let num_kv_heads = c.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
        if num_heads == 0 || num_kv_heads == 0 || num_layers == 0 || hidden == 0 {
            return Err(invalid(
                path,
                "layers, heads and hidden size must be positive".into(),
            ));
        }
        let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden / num_heads);
        let is_gemma = gguf_arch.starts_with("gemma");
        // transformers' defaults: tied for Gemma, GPT-2, Cohere and OPT, untied for the others.
        let tie_word_embeddings = c
            .opt_bool("tie_word_embeddings")?
            .unwrap_or(is_gemma || gpt2 || matches!(gguf_arch, "command-r" | "cohere2" | "opt"));

        let mut m = HashMap::new();
        let a = gguf_arch;
        let k = |s: &str| format!("{a}.{s}");
        let u = |v: usize| Value::U32(v as u32);
        m.insert("general.architecture".into(), Value::String(a.into()));
        let name = c
            .opt_str("_name_or_path")?
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .or_else(|| {
                path.parent()
                    .and_then(|d| d.file_name())
                    .map(|n| n.to_string_lossy().into_owned())
            })
            .unwrap_or_else(|| model_type.clone());
        m.insert("general.name".into(), Value::String(name));
        m.insert(k("block_count"), u(num_layers));
        m.insert(k("embedding_length"), u(hidden));
        let ffn = match gguf_arch {
            "gpt2" => c.opt_usize("n_inner")?.unwrap_or(4 * hidden),
            "opt" => c.req_usize("ffn_dim")?,
            _ => c.req_usize("intermediate_size")?,
        };
        m.insert(k("feed_forward_length"), u(ffn));
        let context = c
            .opt_usize(key_of("max_position_embeddings", "n_positions"))?
            .unwrap_or(2048);
        m.insert(k("context_length"), u(context));
        m.insert(k("attention.head_count"), u(num_heads));
        m.insert(k("attention.head_count_kv"), u(num_kv_heads));
        m.insert(k("attention.key_length"), u(head_dim));
        m.insert(k("attention.value_length"), u(head_dim));
        let eps = c
            .opt_f64("rms_norm_eps")?
            .unwrap_or(if is_gemma { 1e-6 } else { 1e-5 });
        m.insert(
            k("attention.layer_norm_rms_epsilon"),
            Value::F32(eps as f32),
        );
        layer_norm_keys(&c, a, &mut m)?;
        let rope_theta = match c.opt_f64("rope_theta")? {
            Some(theta) => theta,
            None => c
                .opt_f64("rotary_emb_base")?
                .unwrap_or(if gguf_arch == "gemma3" { 1e6 } else { 1e4 }),
        };
        m.insert(k("rope.freq_base"), Value::F32(rope_theta as f32));
        let partial = match c.opt_f64("partial_rotary_factor")? {
            Some(f) => Some(f),
            // Phi-2's and GLM-4's config classes default to half the head.
            None if matches!(gguf_arch, "phi2" | "glm4") => Some(0.5),
            None => c.opt_f64("rotary_pct")?,
        };
        let rotary = match partial {
            Some(f) if f > 0.0 && f <= 1.0 => (head_dim as f64 * f) as usize,
            Some(f) => {
                return Err(invalid(
                    path,
                    format!("partial_rotary_factor {f} is not in (0, 1]"),
                ))
            }
            None => head_dim,
        };
        m.insert(k("rope.dimension_count"), u(rotary));
        let rope_tensors = rope_scaling(&c, a, &mut m, rope_theta, rotary)?;
        for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
            if let Some(cap) = c.opt_f64(key)? {
                m.insert(k(key), Value::F32(cap as f32));
            }
        }
        if let Some(s) = c.opt_f64("query_pre_attn_scalar")? {
            m.insert(keys::QUERY_PRE_ATTN_SCALAR.into(), Value::F32(s as f32));
        }
        // OLMo's clipping of q/k/v after their projections, as llama.cpp's key.
        match c.opt_f64("clip_qkv")? {
            Some(clip) if clip > 0.0 && clip.is_finite() => {
                m.insert(k("attention.clamp_kqv"), Value::F32(clip as f32));
            }
            Some(clip) => {
                return Err(invalid(path, format!("`clip_qkv` {clip} is not positive")));
            }
            None => {}
        }
        if gguf_arch == "olmo" {
            // OlmoLayerNorm's fixed eps.
            m.insert(k("attention.layer_norm_epsilon"), Value::F32(1e-5));
        }
        sliding_window(&c, a, num_layers, &mut m)?;
        if gguf_arch == "granite" {
            granite_multipliers(&c, a, &mut m)?;
        }
        rotary_layers(&c, num_layers, &mut m)?;
        experts(&c, &model_type, a, &mut m)?;
        // The sliding layers' own RoPE base (Gemma 3's default 10000; OLMo 3's the global one).
        let local = c.opt_f64("rope_local_base_freq")?;
        match (gguf_arch, local) {
            ("gemma3", local) => {
                let local = local.unwrap_or(1e4);
                m.insert(k("rope.freq_base_swa"), Value::F32(local as f32));
            }
            ("olmo2", Some(local)) => {
                m.insert(k("rope.freq_base_swa"), Value::F32(local as f32));
            }
            _ => {}
        }

        Ok(Self {
            model_type,
            gguf_arch,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            tie_word_embeddings,
            bos_token_id: c.opt_ids("bos_token_id")?.first().copied(),
            eos_token_ids: c.opt_ids("eos_token_id")?,
            rope_tensors,
            metadata: m,
        })
    }
}

/// SmolLM3's `no_rope_layers` (1 where a layer uses RoPE, 0 where not), one per layer.
fn rotary_layers(c: &Keys, layers: usize, m: &mut HashMap<String, Value>) -> Result<()> {
    let Some(list) = c.json.get("no_rope_layers").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let flags = list
        .as_array()
        .filter(|l| l.len() == layers)
        .and_then(|l| {
            l.iter()
                .map(|v| v.as_u64().filter(|&f| f <= 1).map(|f| f == 1))
                .collect::<Option<Vec<bool>>>()
        })
        .ok_or_else(|| {
            invalid(
                c.path,
                format!("`no_rope_layers` must be {layers} values of 0 or 1, one per layer"),
            )
        })?;
    m.insert(
        keys::ROTARY_LAYERS.into(),
        Value::Array(flags.into_iter().map(Value::Bool).collect()),
    );
    Ok(())
}

/// The LayerNorm families' eps (GPT-2, GPT-NeoX, Phi-2, Command R, OPT, StarCoder 2) and
/// what else of their blocks the config says: the activation (only the ones each was
/// released with are implemented), GPT-NeoX's parallel residual, Command R's logit scale;
/// options lantern does not implement (GPT-2's attention scalings, Phi-2's q/k LayerNorm,
/// Command R+'s q/k norms, OPT-350m's shape) are refused.
fn layer_norm_keys(c: &Keys, a: &str, m: &mut HashMap<String, Value>) -> Result<()> {
    let (eps_key, act_key, acts): (_, _, &[&str]) = match a {
        "gptneox" => ("layer_norm_eps", "hidden_act", &["gelu"]),
        "phi2" => (
            "layer_norm_eps",
            "hidden_act",
            &["gelu_new", "gelu_pytorch_tanh"],
        ),
        "command-r" | "cohere2" => ("layer_norm_eps", "hidden_act", &["silu"]),
        "opt" => ("layer_norm_eps", "activation_function", &["relu"]),
        "starcoder2" => (
            "norm_epsilon",
            "hidden_act",
            &["gelu_pytorch_tanh", "gelu_new"],
        ),
        "gpt2" => (
            "layer_norm_epsilon",
            "activation_function",
            &["gelu_new", "gelu_pytorch_tanh"],
        ),
        _ => return Ok(()),
    };
    let eps = c.opt_f64(eps_key)?.unwrap_or(1e-5);
    m.insert(
        format!("{a}.attention.layer_norm_epsilon"),
        Value::F32(eps as f32),
    );
    let act = c.opt_str(act_key)?.unwrap_or(acts[0]);
    if !acts.contains(&act) {
        return Err(invalid(
            c.path,
            format!("`{act_key}` `{act}` is not supported for {a} (supported: {acts:?})"),
        ));
    }
    if a == "gptneox" {
        let parallel = c.opt_bool("use_parallel_residual")?.unwrap_or(true);
        m.insert(format!("{a}.use_parallel_residual"), Value::Bool(parallel));
    }
    if matches!(a, "command-r" | "cohere2") {
        if c.opt_bool("use_qk_norm")? == Some(true) {
            return Err(invalid(
                c.path,
                "`use_qk_norm` true (Command R+'s per-head q/k LayerNorms) is not supported".into(),
            ));
        }
        let scale = c.opt_f64("logit_scale")?.unwrap_or(0.0625);
        m.insert(format!("{a}.logit_scale"), Value::F32(scale as f32));
    }
    if a == "opt" {
        let hidden = c.req_usize("hidden_size")?;
        // OPT-350m's shape: norms after each block, embeddings projected in and out.
        for (key, fine) in [
            (
                "do_layer_norm_before",
                c.opt_bool("do_layer_norm_before")? != Some(false),
            ),
            (
                "word_embed_proj_dim",
                c.opt_usize("word_embed_proj_dim")?
                    .is_none_or(|d| d == hidden),
            ),
            (
                "layer_norm_elementwise_affine",
                c.opt_bool("layer_norm_elementwise_affine")? != Some(false),
            ),
            (
                "_remove_final_layer_norm",
                c.opt_bool("_remove_final_layer_norm")? != Some(true),
            ),
        ] {
            if !fine {
                return Err(invalid(
                    c.path,
                    format!("OPT with this `{key}` (OPT-350m's shape) is not supported"),
                ));
            }
        }
    }
    if a == "phi2" && c.opt_bool("qk_layernorm")? == Some(true) {
        return Err(invalid(
            c.path,
            "`qk_layernorm` true is not supported for phi".into(),
        ));
    }
    // GPT-2's ways of scaling attention other than 1/sqrt(head_dim).
    for (key, unsupported) in [
        ("scale_attn_by_inverse_layer_idx", true),
        ("scale_attn_weights", false),
    ] {
        if c.opt_bool(key)? == Some(unsupported) {
            return Err(invalid(
                c.path,
                format!("`{key}` {unsupported} is not supported"),
            ));
        }
    }
    Ok(())
}

/// Granite's multipliers as llama.cpp's keys, each written with transformers' default of 1
/// where the config lacks it (llama.cpp's converter writes only those present, and a
/// GGUF without `attention.scale` scores with `1/sqrt(head_dim)`, where transformers uses
/// the multiplier's 1).
fn granite_multipliers(c: &Keys, a: &str, m: &mut HashMap<String, Value>) -> Result<()> {
    for (hf, gguf) in [
        ("embedding_multiplier", "embedding_scale"),
        ("attention_multiplier", "attention.scale"),
        ("residual_multiplier", "residual_scale"),
        ("logits_scaling", "logit_scale"),
    ] {
        let value = c.opt_f64(hf)?.unwrap_or(1.0);
        m.insert(format!("{a}.{gguf}"), Value::F32(value as f32));
    }
    Ok(())
}

/// Checkpoints quantized for another runtime (GPTQ, AWQ, FP8, bitsandbytes, ...) are
/// refused by name; gpt-oss's MXFP4 experts are read (see `mxfp4.rs`).
fn quantization(c: &Keys, gguf_arch: &str) -> Result<()> {
    let Some(q) = c.json.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(());
    };
    let method = q
        .get("quant_method")
        .and_then(Json::as_str)
        .unwrap_or("unnamed");
    match (method, gguf_arch) {
        ("mxfp4", "gpt-oss") => Ok(()),
        _ => Err(invalid(
            c.path,
            format!(
                "`quantization_config` says `{method}`, which lantern does not read (it reads \
                 gpt-oss's mxfp4 experts; an unquantized checkpoint or a GGUF file of the \
                 model works, and `--quantize` quantizes at load)"
            ),
        )),
    }
}

/// The mixture-of-experts keys (`expert_count`, `expert_used_count`,
/// `expert_feed_forward_length`, `expert_weights_norm`) of Mixtral and gpt-oss
/// (`num_local_experts`) and Qwen3-MoE (`num_experts`, `moe_intermediate_size`,
/// `norm_topk_prob`). gpt-oss's SwiGLU constants are llama.cpp's fixed ones: others are
/// refused.
fn experts(c: &Keys, model_type: &str, a: &str, m: &mut HashMap<String, Value>) -> Result<()> {
    let (count_key, normalize) = match model_type {
        // gpt-oss: the softmax of the chosen logits, the same weights.
        "mixtral" | "gpt_oss" => ("num_local_experts", Some(true)),
        // transformers' default for a config that does not say is false.
        "qwen3_moe" | "olmoe" => (
            "num_experts",
            Some(c.opt_bool("norm_topk_prob")?.unwrap_or(false)),
        ),
        _ => return Ok(()),
    };
    if model_type == "gpt_oss" {
        for (key, fixed) in [
            ("swiglu_limit", ops::SWIGLU_OAI_LIMIT),
            ("swiglu_alpha", ops::SWIGLU_OAI_ALPHA),
        ] {
            if let Some(v) = c.opt_f64(key)?.filter(|&v| v as f32 != fixed) {
                return Err(invalid(
                    c.path,
                    format!("`{key}` is {v}: lantern runs gpt-oss's {fixed} only"),
                ));
            }
        }
    }
    let count = c.req_usize(count_key)?;
    let used = c.req_usize("num_experts_per_tok")?;
    let u = |v: usize| Value::U32(v as u32);
    m.insert(format!("{a}.expert_count"), u(count));
    m.insert(format!("{a}.expert_used_count"), u(used));
    if let Some(ffn) = c.opt_usize("moe_intermediate_size")? {
        m.insert(format!("{a}.expert_feed_forward_length"), u(ffn));
    }
    if let Some(normalize) = normalize {
        m.insert(format!("{a}.expert_weights_norm"), Value::Bool(normalize));
    }
    Ok(())
}

/// The window and which layers use it, from `sliding_window`, `use_sliding_window`,
/// `layer_types` and `sliding_window_pattern`.
fn sliding_window(c: &Keys, a: &str, layers: usize, m: &mut HashMap<String, Value>) -> Result<()> {
    let window = c.opt_usize("sliding_window")?.filter(|&w| w > 0);
    let enabled = c.opt_bool("use_sliding_window")?.unwrap_or(true);
    let Some(window) = window.filter(|_| enabled) else {
        return Ok(());
    };
    let sliding: Option<Vec<bool>> =
        if let Some(types) = c.json.get("layer_types").filter(|v| !v.is_null()) {
            let types = types
                .as_array()
                .ok_or_else(|| invalid(c.path, "`layer_types` is not an array".into()))?;
            if types.len() != layers {
                return Err(invalid(
                    c.path,
                    format!(
                        "`layer_types` has {} entries for {layers} layers",
                        types.len()
                    ),
                ));
            }
            Some(
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => Ok(true),
                        Some("full_attention") => Ok(false),
                        _ => Err(invalid(
                            c.path,
                            format!("unknown layer type {t} in `layer_types`"),
                        )),
                    })
                    .collect::<Result<_>>()?,
            )
        } else if matches!(a, "gemma3" | "cohere2") {
            let default = if a == "gemma3" { 6 } else { 4 };
            let pattern = c
                .opt_usize("sliding_window_pattern")?
                .unwrap_or(default)
                .max(1);
            Some((0..layers).map(|i| (i + 1) % pattern != 0).collect())
        } else if a == "gemma2" {
            Some((0..layers).map(|i| i % 2 == 0).collect())
        } else {
            None
        };
    if matches!(
        a,
        "llama" | "smollm3" | "qwen2" | "qwen3" | "qwen3moe" | "olmoe" | "phi3"
    ) {
        m.insert(keys::SLIDING_WINDOW.into(), Value::U32(window as u32));
    } else {
        m.insert(
            format!("{a}.attention.sliding_window"),
            Value::U32(window as u32),
        );
    }
    if let Some(sliding) = sliding {
        m.insert(
            keys::SLIDING_LAYERS.into(),
            Value::Array(sliding.into_iter().map(Value::Bool).collect()),
        );
    }
    Ok(())
}

pub(super) fn invalid(path: &Path, reason: String) -> ModelError {
    ModelError::InvalidHf {
        path: path.to_path_buf(),
        reason,
    }
}

/// Typed reads of config keys; a present key of the wrong type is an error naming it.
pub(super) struct Keys<'a> {
    pub(super) path: &'a Path,
    pub(super) json: &'a Json,
}

impl Keys<'_> {
    fn get(&self, key: &str) -> Option<&Json> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    fn wrong(&self, key: &str, what: &str) -> ModelError {
        invalid(self.path, format!("key `{key}` is not {what}"))
    }

    fn missing(&self, key: &str) -> ModelError {
        invalid(self.path, format!("key `{key}` is missing"))
    }

    pub(super) fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        self.get(key)
            .map(|v| v.as_str().ok_or_else(|| self.wrong(key, "a string")))
            .transpose()
    }

    fn req_str(&self, key: &str) -> Result<&str> {
        self.opt_str(key)?.ok_or_else(|| self.missing(key))
    }

    pub(super) fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .filter(|&x| x <= u32::MAX as usize)
                    .ok_or_else(|| self.wrong(key, "an unsigned integer"))
            })
            .transpose()
    }

    fn req_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key))
    }

    pub(super) fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        self.get(key)
            .map(|v| v.as_f64().ok_or_else(|| self.wrong(key, "a number")))
            .transpose()
    }

    pub(super) fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.wrong(key, "a boolean")))
            .transpose()
    }

    /// A token id or a list of them.
    fn opt_ids(&self, key: &str) -> Result<Vec<u32>> {
        token_ids(self.get(key)).ok_or_else(|| self.wrong(key, "a token id or a list of them"))
    }
}

/// `eos_token_id` as written in config.json / generation_config.json: one id or a list.
pub fn token_ids(value: Option<&Json>) -> Option<Vec<u32>> {
    let id = |v: &Json| v.as_u64().and_then(|x| u32::try_from(x).ok());
    match value {
        None | Some(Json::Null) => Some(Vec::new()),
        Some(Json::Array(items)) => items.iter().map(id).collect(),
        Some(v) => id(v).map(|x| vec![x]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config(model_type: &str, extra: Json) -> Result<HfConfig> {
        let mut config = json!({
            "model_type": model_type, "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 4, "intermediate_size": 128,
        });
        config
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        HfConfig::from_json(Path::new("config.json"), &config)
    }

    #[test]
    fn quantized_checkpoints_are_refused_by_method_except_gpt_oss_mxfp4() {
        let gptq = json!({"quantization_config": {"quant_method": "gptq", "bits": 4}});
        let err = config("llama", gptq).unwrap_err().to_string();
        assert!(err.contains("`gptq`"), "{err}");
        let mxfp4 = json!({"quantization_config": {"quant_method": "mxfp4"},
                           "num_local_experts": 4, "num_experts_per_tok": 2});
        assert!(config("gpt_oss", mxfp4.clone()).is_ok());
        assert!(config("mixtral", mxfp4).is_err());
        assert!(config("llama", json!({"quantization_config": null})).is_ok());
    }

    #[test]
    fn gpt_oss_routes_by_the_chosen_logits_and_refuses_other_swiglu_constants() {
        let experts = json!({"num_local_experts": 4, "num_experts_per_tok": 2});
        let c = config("gpt_oss", experts.clone()).unwrap();
        assert_eq!(c.gguf_arch, "gpt-oss");
        assert_eq!(number(&c, "gpt-oss.expert_count"), 4.0);
        assert!(matches!(
            c.metadata.get("gpt-oss.expert_weights_norm"),
            Some(Value::Bool(true))
        ));
        assert!(c.post_attention_norm());
        assert!(c.transposes("model.layers.0.mlp.experts.down_proj"));
        assert!(!c.transposes("model.layers.0.mlp.experts.down_proj_bias"));
        assert!(c.deinterleaves_gate_up("model.layers.0.mlp.experts.gate_up_proj_bias"));
        let mut given = experts.clone();
        given["swiglu_limit"] = json!(7.0);
        given["swiglu_alpha"] = json!(1.702);
        assert!(config("gpt_oss", given).is_ok());
        let mut other = experts;
        other["swiglu_limit"] = json!(10.0);
        let err = config("gpt_oss", other).unwrap_err().to_string();
        assert!(err.contains("swiglu_limit") && err.contains("10"), "{err}");
    }

    fn number(c: &HfConfig, key: &str) -> f64 {
        match &c.metadata[key] {
            Value::F32(f) => *f as f64,
            Value::U32(u) => *u as f64,
            other => panic!("{key}: {other:?}"),
        }
    }

    #[test]
    fn granite_multipliers_default_to_transformers_ones() {
        let c = config("granite", json!({"embedding_multiplier": 12.0})).unwrap();
        assert_eq!(number(&c, "granite.embedding_scale"), 12.0);
        // transformers scores with the multiplier itself: 1 when absent, not 1/sqrt(16).
        assert_eq!(number(&c, "granite.attention.scale"), 1.0);
        assert_eq!(number(&c, "granite.residual_scale"), 1.0);
        assert_eq!(number(&c, "granite.logit_scale"), 1.0);
        assert!(c.permutes_qk());
    }

    #[test]
    fn phi_rotates_half_the_head_by_default_and_refuses_what_it_lacks() {
        let c = config("phi", json!({})).unwrap();
        assert_eq!(c.gguf_arch, "phi2");
        assert_eq!(number(&c, "phi2.rope.dimension_count"), 8.0);
        let c = config("phi", json!({"partial_rotary_factor": 0.25})).unwrap();
        assert_eq!(number(&c, "phi2.rope.dimension_count"), 4.0);
        for (extra, key) in [
            (json!({"qk_layernorm": true}), "qk_layernorm"),
            (json!({"hidden_act": "relu"}), "hidden_act"),
        ] {
            let err = config("phi", extra).unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
    }

    #[test]
    fn cohere_reads_its_logit_scale_and_refuses_per_head_qk_norms() {
        let c = config("cohere", json!({})).unwrap();
        assert_eq!(c.gguf_arch, "command-r");
        assert!(c.tie_word_embeddings && !c.permutes_qk());
        // CohereConfig's default, and a given one.
        assert_eq!(number(&c, "command-r.logit_scale"), 0.0625);
        let c = config("cohere", json!({"logit_scale": 0.125})).unwrap();
        assert_eq!(number(&c, "command-r.logit_scale"), 0.125);
        let err = config("cohere", json!({"use_qk_norm": true}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("use_qk_norm"), "{err}");
    }

    #[test]
    fn cohere2_slides_three_layers_of_four_by_default() {
        let c = config(
            "cohere2",
            json!({"sliding_window": 8, "num_hidden_layers": 8}),
        )
        .unwrap();
        let Value::Array(sliding) = &c.metadata[keys::SLIDING_LAYERS] else {
            panic!("no sliding layers");
        };
        let sliding: Vec<bool> = sliding
            .iter()
            .map(|v| matches!(v, Value::Bool(true)))
            .collect();
        assert_eq!(sliding, [true, true, true, false, true, true, true, false]);
        assert_eq!(number(&c, "cohere2.attention.sliding_window"), 8.0);
        assert_eq!(number(&c, "cohere2.logit_scale"), 0.0625);
    }

    #[test]
    fn opt_reads_ffn_dim_and_refuses_opt_350m_s_shape() {
        let c = config("opt", json!({"ffn_dim": 256})).unwrap();
        assert_eq!(number(&c, "opt.feed_forward_length"), 256.0);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.skipped_rows("model.decoder.embed_positions.weight"), 2);
        assert_eq!(c.skipped_rows("model.decoder.embed_tokens.weight"), 0);
        for (extra, key) in [
            (
                json!({"ffn_dim": 256, "do_layer_norm_before": false}),
                "do_layer_norm_before",
            ),
            (
                json!({"ffn_dim": 256, "word_embed_proj_dim": 32}),
                "word_embed_proj_dim",
            ),
            (
                json!({"ffn_dim": 256, "activation_function": "gelu"}),
                "activation_function",
            ),
        ] {
            let err = config("opt", extra).unwrap_err().to_string();
            assert!(err.contains(key), "{err}");
        }
    }

    #[test]
    fn clip_qkv_becomes_llama_cpp_s_clamp_key() {
        let c = config("olmo", json!({"clip_qkv": 8.0})).unwrap();
        assert_eq!(number(&c, "olmo.attention.clamp_kqv"), 8.0);
        assert_eq!(
            number(&c, "olmo.attention.layer_norm_epsilon"),
            1e-5f32 as f64
        );
        assert!(c.permutes_qk());
        let c = config("olmo", json!({"clip_qkv": null})).unwrap();
        assert!(!c.metadata.contains_key("olmo.attention.clamp_kqv"));
        let err = config("olmo", json!({"clip_qkv": -1.0}))
            .unwrap_err()
            .to_string();
        assert!(err.contains("clip_qkv"), "{err}");
    }

    #[test]
    fn gemma_norms_are_stored_plus_one_without_post_attention_norm() {
        let c = config("gemma", json!({})).unwrap();
        assert!(c.norms_plus_one() && !c.post_attention_norm() && c.tie_word_embeddings);
        let c = config("gemma2", json!({})).unwrap();
        assert!(c.norms_plus_one() && c.post_attention_norm());
    }
}
