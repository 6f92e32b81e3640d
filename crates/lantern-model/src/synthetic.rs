//! Tiny GGUF model files with random weights, written on the fly for tests: an engine
//! test needs a real file to load, not the 100 MB default model, and a broken-file test
//! needs a file it can break in one precise way.

use crate::error::{ModelError, Result};
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::path::Path;

/// A tiny Llama and the ways a test may spoil it.
#[derive(Debug, Clone)]
pub struct TinyLlama {
    pub architecture: String,
    pub num_layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub ffn: usize,
    /// Weight type of the matrices (F32, or a quantized type whose block divides `hidden`).
    pub dtype: GgmlDType,
    /// Tensors to leave out of the file.
    pub omit_tensors: Vec<String>,
    /// Metadata keys to leave out.
    pub omit_keys: Vec<String>,
    /// Extra f32 vectors of `head_dim / 2` ones (e.g. `rope_factors_long.weight`).
    pub extra_vectors: Vec<String>,
    /// A mixture of `experts` experts (each an MLP of `ffn` units), `experts_used` per
    /// token, in every layer instead of the dense MLP; 0 for none.
    pub experts: usize,
    pub experts_used: usize,
    /// The experts' matrices stacked into `ffn_{gate,up,down}_exps` (llama.cpp's layout)
    /// rather than one tensor each (`ffn_gate.E`, older Mixtral files). The same values
    /// either way.
    pub stacked_experts: bool,
    pub seed: u64,
}

impl Default for TinyLlama {
    fn default() -> Self {
        Self {
            architecture: "llama".to_string(),
            num_layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            ffn: 128,
            dtype: GgmlDType::F32,
            omit_tensors: Vec::new(),
            omit_keys: Vec::new(),
            extra_vectors: Vec::new(),
            experts: 0,
            experts_used: 0,
            stacked_experts: true,
            seed: 1,
        }
    }
}

/// The sliding window of a tiny model written with `architecture: "gemma3"` (which also
/// gets Gemma 3's QK and sandwich norm tensors).
pub const GEMMA3_TINY_WINDOW: usize = 8;

/// Byte-level vocabulary: the 256 GPT-2 byte symbols, then two specials.
fn vocabulary() -> Vec<String> {
    let mut tokens: Vec<String> = (0u32..256)
        .map(|b| gpt2_byte_symbol(b as u8).to_string())
        .collect();
    tokens.push("<|im_start|>".to_string());
    tokens.push("<|im_end|>".to_string());
    tokens
}

/// GPT-2's printable stand-in for a byte.
fn gpt2_byte_symbol(b: u8) -> char {
    let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
    if printable {
        return b as char;
    }
    // Non-printable bytes map, in order, to code points from 256 on.
    let rank = (0..b)
        .filter(|&x| !((b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || x >= 0xAE))
        .count() as u32;
    char::from_u32(256 + rank).unwrap_or('?')
}

impl TinyLlama {
    pub fn vocab_size(&self) -> usize {
        vocabulary().len()
    }

    /// Writes the model file.
    pub fn write(&self, path: &Path) -> Result<()> {
        let err =
            |e: candle_core::Error| ModelError::InvalidConfig(format!("writing tiny model: {e}"));
        let tokens = vocabulary();
        let vocab = tokens.len();
        let head_dim = self.hidden / self.heads;
        let arch = self.architecture.as_str();
        let key = |k: &str| format!("{arch}.{k}");
        let mut metadata: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::String(arch.into())),
            ("general.name".into(), Value::String("tiny-llama".into())),
            (key("block_count"), Value::U32(self.num_layers as u32)),
            (key("context_length"), Value::U32(256)),
            (key("embedding_length"), Value::U32(self.hidden as u32)),
            (key("feed_forward_length"), Value::U32(self.ffn as u32)),
            (key("attention.head_count"), Value::U32(self.heads as u32)),
            (key("attention.head_count_kv"), Value::U32(self.kv_heads as u32)),
            (key("attention.layer_norm_rms_epsilon"), Value::F32(1e-5)),
            (key("rope.freq_base"), Value::F32(10000.0)),
            ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
            ("tokenizer.ggml.pre".into(), Value::String("gpt2".into())),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(tokens.iter().map(|t| Value::String(t.clone())).collect()),
            ),
            ("tokenizer.ggml.merges".into(), Value::Array(Vec::new())),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(
                    (0..vocab)
                        .map(|i| Value::I32(if i >= 256 { 3 } else { 1 }))
                        .collect(),
                ),
            ),
            ("tokenizer.ggml.bos_token_id".into(), Value::U32(256)),
            ("tokenizer.ggml.eos_token_id".into(), Value::U32(257)),
            (
                "tokenizer.chat_template".into(),
                Value::String(
                    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}".into(),
                ),
            ),
        ];
        if arch == "gemma3" {
            // Gemma 3: every 6th layer global, the others see `GEMMA3_TINY_WINDOW` keys.
            metadata.push((
                key("attention.sliding_window"),
                Value::U32(GEMMA3_TINY_WINDOW as u32),
            ));
            metadata.push((key("attention.key_length"), Value::U32(head_dim as u32)));
        }
        if self.experts > 0 {
            metadata.push((key("expert_count"), Value::U32(self.experts as u32)));
            metadata.push((
                key("expert_used_count"),
                Value::U32(self.experts_used as u32),
            ));
        }
        if self
            .extra_vectors
            .iter()
            .any(|v| v.starts_with("rope_factors_"))
        {
            // LongRoPE's factors come with the context they were trained for.
            metadata.push((key("rope.scaling.original_context_length"), Value::U32(64)));
        }
        metadata.retain(|(k, _)| !self.omit_keys.contains(k));

        let mut seed = self.seed;
        let mut random = |rows: usize, cols: usize, scale: f32| -> candle_core::Result<Tensor> {
            // A small xorshift keeps the file reproducible without a random-number crate.
            let values: Vec<f32> = (0..rows * cols)
                .map(|_| {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
                })
                .collect();
            Tensor::from_vec(values, (rows, cols), &Device::Cpu)
        };
        let (h, kv) = (self.hidden, self.kv_heads * head_dim);
        let matrix_dtype = self.dtype;
        let mut tensors: Vec<(String, QTensor)> = Vec::new();
        let mut add = |name: String, t: Tensor, dtype: GgmlDType| -> candle_core::Result<()> {
            tensors.push((name, QTensor::quantize(&t, dtype)?));
            Ok(())
        };
        add(
            "token_embd.weight".into(),
            random(vocab, h, 1.0).map_err(err)?,
            matrix_dtype,
        )
        .map_err(err)?;
        for l in 0..self.num_layers {
            let n = |t: &str| format!("blk.{l}.{t}.weight");
            let ones = Tensor::ones(h, candle_core::DType::F32, &Device::Cpu).map_err(err)?;
            add(n("attn_norm"), ones.clone(), GgmlDType::F32).map_err(err)?;
            add(n("ffn_norm"), ones.clone(), GgmlDType::F32).map_err(err)?;
            if arch == "gemma3" {
                let head_ones =
                    Tensor::ones(head_dim, candle_core::DType::F32, &Device::Cpu).map_err(err)?;
                add(n("attn_q_norm"), head_ones.clone(), GgmlDType::F32).map_err(err)?;
                add(n("attn_k_norm"), head_ones, GgmlDType::F32).map_err(err)?;
                add(n("post_attention_norm"), ones.clone(), GgmlDType::F32).map_err(err)?;
                add(n("post_ffw_norm"), ones, GgmlDType::F32).map_err(err)?;
            }
            let s = 1.0 / (h as f32).sqrt();
            add(n("attn_q"), random(h, h, s).map_err(err)?, matrix_dtype).map_err(err)?;
            add(n("attn_k"), random(kv, h, s).map_err(err)?, matrix_dtype).map_err(err)?;
            add(n("attn_v"), random(kv, h, s).map_err(err)?, matrix_dtype).map_err(err)?;
            add(
                n("attn_output"),
                random(h, h, s).map_err(err)?,
                matrix_dtype,
            )
            .map_err(err)?;
            let s2 = 1.0 / (self.ffn as f32).sqrt();
            if self.experts == 0 {
                add(
                    n("ffn_gate"),
                    random(self.ffn, h, s).map_err(err)?,
                    matrix_dtype,
                )
                .map_err(err)?;
                add(
                    n("ffn_up"),
                    random(self.ffn, h, s).map_err(err)?,
                    matrix_dtype,
                )
                .map_err(err)?;
                add(
                    n("ffn_down"),
                    random(h, self.ffn, s2).map_err(err)?,
                    matrix_dtype,
                )
                .map_err(err)?;
                continue;
            }
            // A router scaled up so that tokens choose clearly different experts.
            let router = random(self.experts, h, 4.0 * s).map_err(err)?;
            add(n("ffn_gate_inp"), router, GgmlDType::F32).map_err(err)?;
            for (part, rows, cols, scale) in [
                ("ffn_gate", self.ffn, h, s),
                ("ffn_up", self.ffn, h, s),
                ("ffn_down", h, self.ffn, s2),
            ] {
                let experts = (0..self.experts)
                    .map(|_| random(rows, cols, scale))
                    .collect::<candle_core::Result<Vec<_>>>()
                    .map_err(err)?;
                if self.stacked_experts {
                    let stacked = Tensor::stack(&experts, 0).map_err(err)?;
                    add(format!("blk.{l}.{part}_exps.weight"), stacked, matrix_dtype)
                        .map_err(err)?;
                } else {
                    for (e, t) in experts.into_iter().enumerate() {
                        add(format!("blk.{l}.{part}.{e}.weight"), t, matrix_dtype).map_err(err)?;
                    }
                }
            }
        }
        let ones = Tensor::ones(h, candle_core::DType::F32, &Device::Cpu).map_err(err)?;
        add("output_norm.weight".into(), ones, GgmlDType::F32).map_err(err)?;
        for name in &self.extra_vectors {
            let ones =
                Tensor::ones(head_dim / 2, candle_core::DType::F32, &Device::Cpu).map_err(err)?;
            add(name.clone(), ones, GgmlDType::F32).map_err(err)?;
        }
        tensors.retain(|(name, _)| !self.omit_tensors.contains(name));

        let mut file = std::fs::File::create(path).map_err(|source| ModelError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let metadata_refs: Vec<(&str, &Value)> =
            metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let tensor_refs: Vec<(&str, &QTensor)> =
            tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
        gguf_file::write(&mut file, &metadata_refs, &tensor_refs).map_err(err)
    }
}
