//! Each supported architecture as a description over the shared blocks: which blocks,
//! which defaults where the metadata is silent. Tensor names and keys are llama.cpp's
//! (see [`crate::source`]); q/k/v biases, fused q/k/v or gate/up, and a layer's experts
//! (its router, `ffn_gate_inp`) are found by the tensors present, so they need no
//! mention here.

use crate::blocks::{Activation, NormKind};
use crate::decoder::{DecoderSpec, LayerPlan, NormPlacement};
use crate::error::{ModelError, Result};
use crate::hparams::HParams;
use crate::rope::RopePairs;
use crate::source::{keys, WeightSource};
use candle_core::quantized::gguf_file::Value;

/// The architectures [`describe`] knows (`general.architecture`).
pub const SUPPORTED: &[&str] = &[
    "llama",
    "smollm3",
    "granite",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "olmoe",
    "olmo2",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "gptneox",
    "gpt2",
    "phi2",
    "command-r",
    "cohere2",
    "glm4",
    "olmo",
    "opt",
    "starcoder2",
    "gpt-oss",
];

/// The decoder `source` describes.
pub fn describe(source: &dyn WeightSource) -> Result<DecoderSpec> {
    let params = HParams::read(source)?;
    match params.architecture.as_str() {
        // Llama 2/3, SmolLM, Mistral, Mixtral (GGUF writes them as llama; Mixtral's
        // layers have experts): q/k rows permuted so that rotary pairs are adjacent.
        "llama" => Ok(DecoderSpec::plain(params, RopePairs::Adjacent)),
        "smollm3" => smollm3(source, params),
        "granite" => granite(source, params),
        // Qwen 2 (q/k/v biases) and Phi-3 (fused qkv and gate_up, partial rotary).
        "qwen2" | "phi3" => Ok(DecoderSpec::plain(params, RopePairs::Halves)),
        // Qwen3-MoE: Qwen 3 whose layers have experts (or not: `mlp_only_layers`).
        "qwen3" | "qwen3moe" => Ok(DecoderSpec {
            qk_norm: true,
            ..DecoderSpec::plain(params, RopePairs::Halves)
        }),
        // OLMoE: q/k normed over the whole projection (the norms' width says so), the
        // chosen experts' probabilities used as they are.
        "olmoe" => Ok(DecoderSpec {
            qk_norm: true,
            normalize_expert_weights: false,
            ..DecoderSpec::plain(params, RopePairs::Halves)
        }),
        // OLMo 1: LayerNorms without weight or bias, q/k/v optionally clipped
        // (`attention.clamp_kqv`, read for every architecture).
        "olmo" => Ok(DecoderSpec {
            norm: NormKind::LayerWithoutParams,
            norm_eps: params.layer_norm_eps.unwrap_or(1e-5),
            ..DecoderSpec::plain(params, RopePairs::Adjacent)
        }),
        "olmo2" => olmo2(source, params),
        // Gemma 1: Gemma's block with norms before each block only (scores by the head
        // size: no layer count of Gemma 1 is special-cased, hence 0).
        "gemma" => Ok(DecoderSpec {
            norm_placement: NormPlacement::Pre,
            ..gemma(params, 0)?
        }),
        "gemma2" => gemma2(params),
        "gemma3" => gemma3(source, params),
        "gptneox" => gptneox(source, params),
        "gpt2" => learned_positions(params, Activation::GeluTanh),
        "opt" => learned_positions(params, Activation::Relu),
        // StarCoder 2: GPT-2's block (LayerNorm with biases, biases everywhere, tanh
        // GELU) with RoPE; llama.cpp's files carry no window (transformers' configs do).
        "starcoder2" => Ok(layer_norm_decoder(
            params,
            RopePairs::Halves,
            Activation::GeluTanh,
        )),
        "phi2" => phi2(params),
        "command-r" => command_r(source, params),
        "cohere2" => cohere2(source, params),
        // GLM-4 (0414): RMSNorms before and after each block, q/k/v biases, gate and up
        // fused, partial RoPE on adjacent pairs.
        "glm4" => Ok(DecoderSpec {
            norm_placement: NormPlacement::Sandwich,
            ..DecoderSpec::plain(params, RopePairs::Adjacent)
        }),
        "gpt-oss" => Ok(gpt_oss(params)),
        other => Err(ModelError::UnsupportedArchitecture(other.to_string())),
    }
}

/// gpt-oss: q/k/v/o biases and attention sinks (found by their tensors), sliding layers
/// alternating with global ones (sliding first), one RoPE (YaRN) for all; experts with
/// biases, the softmax of the chosen router logits, the clamped SwiGLU; the norm before
/// the experts stored as `post_attention_norm`.
fn gpt_oss(mut params: HParams) -> DecoderSpec {
    // llama.cpp routes gpt-oss so whatever the file's `expert_weights_norm` says.
    if let Some(experts) = params.experts.as_mut() {
        experts.normalize_weights = Some(true);
    }
    let sliding = params.sliding(|l| l % 2 == 0);
    let mut spec = DecoderSpec {
        activation: Activation::SwigluOai,
        ffn_norm_tensor: "post_attention_norm",
        ..DecoderSpec::plain(params, RopePairs::Halves)
    };
    for (plan, s) in spec.layers.iter_mut().zip(sliding) {
        plan.sliding_window = spec.params.window().filter(|_| s);
    }
    spec
}

/// Gemma's common shape: sandwich norms, GeGLU, embeddings scaled by `sqrt(hidden)`,
/// eps 1e-6, scale `query_pre_attn_scalar^-0.5` (default: the head size, except the one
/// size llama.cpp special-cases, whose scalar is hidden / heads). A window of 0 is an
/// error here: Gemma's sliding layers need one.
fn gemma(params: HParams, special_layers: usize) -> Result<DecoderSpec> {
    if params.sliding_window == Some(0) {
        return Err(ModelError::InvalidConfig(
            "sliding window of 0 tokens".into(),
        ));
    }
    let scalar = match params.query_pre_attn_scalar {
        Some(s) => s,
        None if params.num_layers == special_layers => {
            (params.hidden_size / params.num_heads) as f32
        }
        None => params.head_dim as f32,
    };
    Ok(DecoderSpec {
        norm_eps: params.rms_norm_eps.unwrap_or(1e-6),
        activation: Activation::GeluTanh,
        norm_placement: NormPlacement::Sandwich,
        embed_scale: Some((params.hidden_size as f32).sqrt()),
        attention_scale: scalar.powf(-0.5),
        ..DecoderSpec::plain(params, RopePairs::Halves)
    })
}

/// Gemma 2: even layers slide, attention-logit and final-logit soft-caps (from the keys).
fn gemma2(params: HParams) -> Result<DecoderSpec> {
    let sliding = params.sliding(|l| l % 2 == 0);
    let mut spec = gemma(params, 46)?;
    for (plan, s) in spec.layers.iter_mut().zip(sliding) {
        plan.sliding_window = spec.params.window().filter(|_| s);
    }
    Ok(spec)
}

/// Gemma 3: sliding layers with their own RoPE base (never scaled), every 6th layer
/// global unless the file gives the pattern; per-head QK-norm.
fn gemma3(source: &dyn WeightSource, params: HParams) -> Result<DecoderSpec> {
    let local_base = params.rope_theta_swa.unwrap_or(10_000.0);
    let layers = sliding_and_global_layers(source, &params, 6, local_base)?;
    Ok(DecoderSpec {
        qk_norm: true,
        layers,
        ..gemma(params, 62)?
    })
}

/// OLMo 2 and 3: RMSNorm after each block only, q/k normed over the whole projection.
/// OLMo 3's sliding layers (every 4th layer global unless the file gives the pattern) use
/// RoPE unscaled, as llama.cpp does.
fn olmo2(source: &dyn WeightSource, params: HParams) -> Result<DecoderSpec> {
    let local_base = params.rope_theta_swa.unwrap_or(params.rope_theta);
    let layers = sliding_and_global_layers(source, &params, 4, local_base)?;
    Ok(DecoderSpec {
        qk_norm: true,
        norm_placement: NormPlacement::Post,
        layers,
        ..DecoderSpec::plain(params, RopePairs::Halves)
    })
}

/// Sliding layers (the source's list or `{arch}.attention.sliding_window_pattern`, else
/// all but every `global_every`-th) with their RoPE base `local_base`, unscaled; global
/// layers with the model's base and its scaling. No window: every layer global.
fn sliding_and_global_layers(
    source: &dyn WeightSource,
    params: &HParams,
    global_every: usize,
    local_base: f32,
) -> Result<Vec<LayerPlan>> {
    let pattern = sliding_pattern(
        source,
        &format!("{}.attention.sliding_window_pattern", params.architecture),
        params.num_layers,
    )?;
    let sliding = params.sliding(|l| match &pattern {
        Some(Pattern::Layers(layers)) => layers[l],
        Some(Pattern::Period(n)) => (l + 1) % n != 0,
        None => (l + 1) % global_every != 0,
    });
    let window = params.window();
    Ok(sliding
        .into_iter()
        .map(|s| match window.filter(|_| s) {
            Some(w) => LayerPlan {
                sliding_window: Some(w),
                rope_base: local_base,
                rope_scaled: false,
                rotary: true,
            },
            None => LayerPlan {
                sliding_window: None,
                rope_base: params.rope_theta,
                rope_scaled: true,
                rotary: true,
            },
        })
        .collect())
}

/// SmolLM3: Llama whose every 4th layer has no RoPE (NoPE, llama.cpp's fixed step),
/// unless the source lists which layers rotate (`lantern.rope.rotary_layers`, from
/// config.json's `no_rope_layers`).
fn smollm3(source: &dyn WeightSource, params: HParams) -> Result<DecoderSpec> {
    const NO_ROPE_EVERY: usize = 4;
    let layers = params.num_layers;
    let rotary = match source.opt_bool_array(keys::ROTARY_LAYERS)? {
        Some(list) if list.len() == layers => list,
        Some(list) => {
            return Err(ModelError::InvalidConfig(format!(
                "`{}` has {} entries for {layers} layers",
                keys::ROTARY_LAYERS,
                list.len()
            )))
        }
        None => (0..layers).map(|l| (l + 1) % NO_ROPE_EVERY != 0).collect(),
    };
    let mut spec = DecoderSpec::plain(params, RopePairs::Adjacent);
    for (plan, rotary) in spec.layers.iter_mut().zip(rotary) {
        plan.rotary = rotary;
    }
    Ok(spec)
}

/// LayerNorm with biases (eps `{arch}.attention.layer_norm_epsilon`, default 1e-5) and
/// an un-gated MLP: GPT-2 and GPT-NeoX.
fn layer_norm_decoder(params: HParams, rope_pairs: RopePairs, act: Activation) -> DecoderSpec {
    DecoderSpec {
        norm: NormKind::Layer,
        norm_eps: params.layer_norm_eps.unwrap_or(1e-5),
        activation: act,
        gated_mlp: false,
        ..DecoderSpec::plain(params, rope_pairs)
    }
}

/// GPT-NeoX (Pythia): fused q/k/v with biases, partial NeoX-style RoPE, exact GELU, and
/// (`{arch}.use_parallel_residual`, default true) attention and MLP side by side.
fn gptneox(source: &dyn WeightSource, params: HParams) -> Result<DecoderSpec> {
    let key = format!("{}.use_parallel_residual", params.architecture);
    let parallel = source.opt_bool(&key)?.unwrap_or(true);
    Ok(DecoderSpec {
        parallel_residual: parallel,
        ..layer_norm_decoder(params, RopePairs::Halves, Activation::GeluErf)
    })
}

/// Phi-2: one LayerNorm feeding attention and MLP side by side, partial NeoX-style RoPE,
/// biases on every projection and on the LM head, tanh GELU.
fn phi2(params: HParams) -> Result<DecoderSpec> {
    Ok(DecoderSpec {
        parallel_residual: true,
        ..layer_norm_decoder(params, RopePairs::Halves, Activation::GeluTanh)
    })
}

/// Command R and Aya (Cohere): one LayerNorm without bias feeding attention and a gated
/// SiLU MLP side by side, RoPE on adjacent pairs, tied embeddings, logits times the file's
/// `logit_scale`. Per-head q/k norms (Command R+) are not read: refused.
fn command_r(source: &dyn WeightSource, params: HParams) -> Result<DecoderSpec> {
    if source.has_tensor("blk.0.attn_q_norm.weight") {
        return Err(ModelError::InvalidConfig(
            "Command R+'s per-head q/k LayerNorms are not supported".into(),
        ));
    }
    let logit_scale = positive(source, &format!("{}.logit_scale", params.architecture))?;
    Ok(DecoderSpec {
        norm: NormKind::LayerWithoutBias,
        norm_eps: params.layer_norm_eps.unwrap_or(1e-5),
        parallel_residual: true,
        logit_scale,
        ..DecoderSpec::plain(params, RopePairs::Adjacent)
    })
}

/// Command R7B (Cohere 2): Command R's block whose layers slide, every 4th global unless
/// the file gives the pattern; only the sliding layers rotate (the global ones use no
/// position encoding), as llama.cpp and transformers have it.
fn cohere2(source: &dyn WeightSource, params: HParams) -> Result<DecoderSpec> {
    if params.window().is_none() {
        return Err(ModelError::InvalidConfig(
            "Command R7B's layers need a sliding window (`attention.sliding_window`)".into(),
        ));
    }
    let base = params.rope_theta_swa.unwrap_or(params.rope_theta);
    let mut layers = sliding_and_global_layers(source, &params, 4, base)?;
    for plan in &mut layers {
        plan.rotary = plan.sliding_window.is_some();
    }
    Ok(DecoderSpec {
        layers,
        ..command_r(source, params)?
    })
}

/// A multiplier the file may give, which must be positive and finite.
fn positive(source: &dyn WeightSource, key: &str) -> Result<Option<f32>> {
    match source.opt_f32(key)? {
        Some(v) if !(v.is_finite() && v > 0.0) => Err(ModelError::InvalidConfig(format!(
            "`{key}` is {v}; it must be positive"
        ))),
        v => Ok(v),
    }
}

/// Granite (IBM Granite 3): Llama's block with four multipliers from the file: the
/// embeddings', the attention scores' (in place of `1/sqrt(head_dim)`), each block's
/// output as it joins the residual, and the logits' divisor.
fn granite(source: &dyn WeightSource, params: HParams) -> Result<DecoderSpec> {
    let multiplier = |k: &str| positive(source, &format!("{}.{k}", params.architecture));
    let embed_scale = multiplier("embedding_scale")?;
    let attention_scale = multiplier("attention.scale")?;
    let residual_scale = multiplier("residual_scale")?;
    let logit_scale = multiplier("logit_scale")?.map(|s| 1.0 / s);
    let plain = DecoderSpec::plain(params, RopePairs::Adjacent);
    Ok(DecoderSpec {
        embed_scale,
        attention_scale: attention_scale.unwrap_or(plain.attention_scale),
        residual_scale,
        logit_scale,
        ..plain
    })
}

/// GPT-2 (tanh GELU) and OPT (ReLU; read from Hugging Face directories only, llama.cpp
/// has no OPT, its position table's first two rows, OPT's offset, left out as it is read):
/// learned absolute positions (`position_embd`) instead of RoPE.
fn learned_positions(mut params: HParams, act: Activation) -> Result<DecoderSpec> {
    params.rope_dim = 0;
    Ok(layer_norm_decoder(params, RopePairs::Halves, act))
}

enum Pattern {
    Period(usize),
    Layers(Vec<bool>),
}

/// `key` as a period `n` (every `n`-th layer is global) or one boolean per layer (true
/// where sliding).
fn sliding_pattern(
    source: &dyn WeightSource,
    key: &str,
    num_layers: usize,
) -> Result<Option<Pattern>> {
    let wrong = || ModelError::WrongType {
        key: key.to_string(),
        expected: "positive integer or array of booleans",
    };
    match source.metadata(key) {
        None => Ok(None),
        Some(Value::Array(_)) => {
            let layers = source.opt_bool_array(key)?.ok_or_else(wrong)?;
            if layers.len() != num_layers {
                return Err(ModelError::InvalidConfig(format!(
                    "`{key}` has {} entries for {num_layers} layers",
                    layers.len()
                )));
            }
            Ok(Some(Pattern::Layers(layers)))
        }
        Some(_) => match source.opt_usize(key) {
            Ok(Some(n)) if n > 0 => Ok(Some(Pattern::Period(n))),
            _ => Err(wrong()),
        },
    }
}
