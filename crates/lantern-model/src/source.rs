//! Where a model's hyper-parameters and weights come from.
//!
//! Architectures read everything through [`WeightSource`], never through a file format, so
//! a GGUF file and a Hugging Face directory load through the same architecture code.
//!
//! # The contract
//!
//! A source presents the model **the way llama.cpp's `convert_hf_to_gguf.py` writes it**:
//!
//! * **Metadata** under llama.cpp's GGUF keys: `general.architecture` (`llama` also for
//!   Mistral and Mixtral, `qwen2`, `qwen3`, `qwen3moe`, `olmoe`, `gemma2`, `gemma3`, `phi3`),
//!   `general.name`, and
//!   `{arch}.block_count`, `.embedding_length`, `.feed_forward_length`,
//!   `.context_length`, `.attention.head_count`, `.attention.head_count_kv`,
//!   `.attention.key_length` (when head_dim != hidden / heads), `.attention.value_length`,
//!   `.attention.layer_norm_rms_epsilon`, `.rope.dimension_count` (partial rotary),
//!   `.rope.freq_base`, `.rope.freq_base_swa` (Gemma 3's local base),
//!   `.rope.scaling.type` (`none`, `linear`, `yarn`), `.rope.scaling.factor`,
//!   `.rope.scaling.original_context_length`, `.rope.scaling.yarn_beta_fast`,
//!   `.rope.scaling.yarn_beta_slow`, `.rope.scaling.yarn_attn_factor` and
//!   `.rope.scaling.attn_factor` (multipliers of YaRN's `0.1 ln(factor) + 1`, as in
//!   llama.cpp), `.attention.sliding_window`,
//!   `.attn_logit_softcapping`, `.final_logit_softcapping`.
//!   Numbers may be any integer/float GGUF type; the typed accessors convert.
//! * **Tensors** under llama.cpp's names, row-major `[out_features, in_features]`:
//!   `token_embd.weight`, `output_norm.weight`, `output.weight` (absent when tied),
//!   `rope_freqs.weight` (Llama 3 scaling: one divisor per rotary frequency), and per layer
//!   `blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_qkv (fused, Phi-3), attn_output,
//!   attn_q_norm, attn_k_norm, post_attention_norm, ffn_norm, ffn_gate, ffn_up, ffn_down,
//!   post_ffw_norm}.weight` and `blk.N.attn_{q,k,v}.bias`. Phi-3's fused `gate_up_proj`
//!   is `blk.N.ffn_up.weight` with `2 * ffn` rows, gate first (no `ffn_gate`).
//!   `attn_q_norm`/`attn_k_norm` are `head_dim` wide (per head) or as wide as the
//!   projection (OLMoE: over all of a token's heads).
//!   A mixture-of-experts layer has a router `blk.N.ffn_gate_inp.weight` (`[experts,
//!   hidden]`) and its experts either stacked, `blk.N.ffn_{gate,up,down}_exps.weight`
//!   (`[experts, rows, cols]`; gate and up may be one `ffn_gate_up_exps`, gate first),
//!   or one tensor each, `blk.N.ffn_{gate,up,down}.E.weight`;
//!   keys `{arch}.expert_count`, `.expert_used_count`, `.expert_feed_forward_length`
//!   (else `.feed_forward_length`), `.expert_weights_norm` (bool).
//!   Any tensor may have any type candle reads (F32/F16/BF16 or quantized), independently
//!   of its neighbours.
//! * **Conventions of the stored numbers**: for `general.architecture = llama` the rows of
//!   `attn_q`/`attn_k` are permuted so that each head's rotary pairs are adjacent
//!   (llama.cpp's `permute`, RoPE "normal" mode); every other architecture keeps the
//!   Hugging Face "rotate half" layout (NeoX mode). Gemma 2/3 RMSNorm weights (every
//!   `*norm.weight`, q/k norms included) are stored as `1 + w`, the multiplier itself.
//!
//! What GGUF cannot say is given under `lantern.*` keys; a GGUF file has none of them and
//! then the GGUF semantics (what llama.cpp does with the file) apply:
//!
//! * `lantern.attention.sliding_window` (integer): the window `w` of the sliding layers —
//!   a query at position `p` sees keys `p - w + 1 ..= p`. Overrides
//!   `{arch}.attention.sliding_window`. Mistral's window (GGUF arch `llama` has none).
//! * `lantern.attention.sliding_layers` (array of bool, one per layer, `true` = sliding):
//!   which layers use the window. Absent: the architecture's default — Gemma 2 the even
//!   layers, Gemma 3 `{arch}.attention.sliding_window_pattern` or every layer except each
//!   6th, every other architecture all layers (when a window is given at all).
//!   Qwen 2's `use_sliding_window: false` is expressed by giving no window.
//! * `lantern.attention.query_pre_attn_scalar` (number `s`): attention scores are scaled by
//!   `s^-0.5` instead of `head_dim^-0.5` (Gemma 2/3).
//! * `lantern.rope.scaling.attention_factor` (number): YaRN's multiplier of cos/sin itself
//!   (transformers' `attention_factor`, from `mscale`/`mscale_all_dim` or given), replacing
//!   the one the `rope.scaling.*` keys imply.
//! * `lantern.rope.scaling.yarn_truncate` (bool): `false` keeps YaRN's correction range
//!   unrounded (transformers' `truncate`); absent: rounded, as llama.cpp does.
//! * `lantern.rope.rotary_layers` (array of bool, one per layer, `false` = no RoPE): which
//!   layers rotate q and k (SmolLM3's `no_rope_layers`). Absent: the architecture's default
//!   (SmolLM3: every layer but each 4th, as llama.cpp; the others all).
//!
//! The tokenizer is not part of this contract (a GGUF file carries it in metadata, a
//! Hugging Face directory in `tokenizer.json`).

use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};

/// Extra keys a source may give beyond GGUF (see the module documentation).
pub mod keys {
    pub const SLIDING_WINDOW: &str = "lantern.attention.sliding_window";
    pub const SLIDING_LAYERS: &str = "lantern.attention.sliding_layers";
    pub const QUERY_PRE_ATTN_SCALAR: &str = "lantern.attention.query_pre_attn_scalar";
    pub const ROPE_ATTENTION_FACTOR: &str = "lantern.rope.scaling.attention_factor";
    pub const ROPE_YARN_TRUNCATE: &str = "lantern.rope.scaling.yarn_truncate";
    pub const ROTARY_LAYERS: &str = "lantern.rope.rotary_layers";
}

/// Hyper-parameters and weights of one model, as llama.cpp's GGUF names them.
pub trait WeightSource {
    /// The metadata value of `key`, if the source has it.
    fn metadata(&self, key: &str) -> Option<&Value>;

    /// Row-major shape (`[rows, cols]` for a matrix) and type of a tensor, or `None`.
    fn tensor_info(&self, name: &str) -> Option<(Vec<usize>, GgmlDType)>;

    /// Names of every tensor the source holds.
    fn tensor_names(&self) -> Vec<String>;

    /// Reads one tensor (row-major shape as in [`Self::tensor_info`]).
    fn tensor(&mut self, name: &str) -> Result<QTensor>;

    fn has_tensor(&self, name: &str) -> bool {
        self.tensor_info(name).is_some()
    }

    /// Reads a tensor and checks its row-major shape.
    fn tensor_with_shape(&mut self, name: &str, expected: &[usize]) -> Result<QTensor> {
        let t = self.tensor(name)?;
        if t.shape().dims() != expected {
            return Err(ModelError::BadShape {
                name: name.to_string(),
                actual: t.shape().dims().to_vec(),
                expected: expected.to_vec(),
            });
        }
        Ok(t)
    }

    fn get_string(&self, key: &str) -> Result<&str> {
        self.opt_string(key)?.ok_or_else(|| missing(key))
    }

    fn opt_string(&self, key: &str) -> Result<Option<&str>> {
        self.metadata(key)
            .map(|v| {
                v.to_string()
                    .map(|s| s.as_str())
                    .map_err(|_| wrong_type(key, "string"))
            })
            .transpose()
    }

    fn get_usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| missing(key))
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        self.metadata(key)
            .map(|v| {
                value_to_u64(v)
                    .and_then(|v| usize::try_from(v).ok())
                    .ok_or_else(|| wrong_type(key, "unsigned integer"))
            })
            .transpose()
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        self.metadata(key)
            .map(|v| {
                value_to_f64(v)
                    .map(|v| v as f32)
                    .ok_or_else(|| wrong_type(key, "number"))
            })
            .transpose()
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        self.metadata(key)
            .map(|v| v.to_bool().map_err(|_| wrong_type(key, "bool")))
            .transpose()
    }

    fn string_array(&self, key: &str) -> Result<Vec<String>> {
        let values = self
            .metadata(key)
            .ok_or_else(|| missing(key))?
            .to_vec()
            .map_err(|_| wrong_type(key, "array of strings"))?;
        values
            .iter()
            .map(|v| {
                v.to_string()
                    .cloned()
                    .map_err(|_| wrong_type(key, "array of strings"))
            })
            .collect()
    }

    fn opt_int_array(&self, key: &str) -> Result<Option<Vec<i64>>> {
        let Some(value) = self.metadata(key) else {
            return Ok(None);
        };
        let values = value
            .to_vec()
            .map_err(|_| wrong_type(key, "array of integers"))?;
        values
            .iter()
            .map(|v| value_to_i64(v).ok_or_else(|| wrong_type(key, "array of integers")))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn opt_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>> {
        let Some(value) = self.metadata(key) else {
            return Ok(None);
        };
        let values = value
            .to_vec()
            .map_err(|_| wrong_type(key, "array of numbers"))?;
        values
            .iter()
            .map(|v| {
                value_to_f64(v)
                    .map(|x| x as f32)
                    .ok_or_else(|| wrong_type(key, "array of numbers"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn opt_bool_array(&self, key: &str) -> Result<Option<Vec<bool>>> {
        let Some(value) = self.metadata(key) else {
            return Ok(None);
        };
        let values = value
            .to_vec()
            .map_err(|_| wrong_type(key, "array of booleans"))?;
        values
            .iter()
            .map(|v| {
                v.to_bool()
                    .map_err(|_| wrong_type(key, "array of booleans"))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }
}

fn missing(key: &str) -> ModelError {
    ModelError::MissingKey {
        key: key.to_string(),
    }
}

fn wrong_type(key: &str, expected: &'static str) -> ModelError {
    ModelError::WrongType {
        key: key.to_string(),
        expected,
    }
}

fn value_to_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => *x as i64,
        Value::I8(x) => *x as i64,
        Value::U16(x) => *x as i64,
        Value::I16(x) => *x as i64,
        Value::U32(x) => *x as i64,
        Value::I32(x) => *x as i64,
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

fn value_to_u64(v: &Value) -> Option<u64> {
    value_to_i64(v).and_then(|x| u64::try_from(x).ok())
}

fn value_to_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F32(x) => Some(*x as f64),
        Value::F64(x) => Some(*x),
        other => value_to_i64(other).map(|x| x as f64),
    }
}
