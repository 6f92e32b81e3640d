//! Hugging Face checkpoint directories (`config.json`, safetensors, `tokenizer.json`),
//! presented through [`WeightSource`] the way llama.cpp's `convert_hf_to_gguf.py` would
//! write them: GGUF tensor names, q/k rows permuted for GGUF arch `llama`, Gemma norms as
//! `1 + w`, Llama 3 scaling as `rope_freqs.weight` and LongRoPE's as
//! `rope_factors_long/short.weight`, tied embeddings without `output.weight`,
//! GPT-2's `Conv1D` weights transposed, GPT-NeoX's q/k/v rows grouped q, k, v, OPT's
//! position table read from its third row, gpt-oss's experts transposed with gate rows
//! first (MXFP4 checkpoints' experts widened to Q8_0).

pub mod config;
pub mod generation_config;
mod mxfp4;
pub mod names;
mod rope_scaling;
pub mod tokenizer;
pub mod weights;

use crate::error::{ModelError, Result};
use crate::source::WeightSource;
use candle_core::quantized::gguf_file::Value;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use config::HfConfig;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use weights::SafetensorsWeights;

/// Whether `path` looks like a Hugging Face directory (rather than a GGUF file).
pub fn is_hf_directory(path: &Path) -> bool {
    path.is_dir()
}

/// An opened Hugging Face directory.
pub struct HfDirectory {
    dir: PathBuf,
    pub config: HfConfig,
    weights: SafetensorsWeights,
    /// GGUF name → Hugging Face name.
    by_gguf_name: HashMap<String, String>,
    quantize: Option<GgmlDType>,
}

impl HfDirectory {
    /// A RoPE scaling vector the config implies (no such tensor is stored).
    fn rope_tensor(&self, name: &str) -> Option<&[f32]> {
        let (_, values) = self.config.rope_tensors.iter().find(|(n, _)| *n == name)?;
        Some(values)
    }

    /// Reads `config.json` and the safetensors headers. `quantize`: store every 2-D weight
    /// in this type (rows that are not a multiple of its block stay as they are).
    pub fn open(dir: &Path, quantize: Option<GgmlDType>) -> Result<Self> {
        let config_path = dir.join("config.json");
        if !config_path.is_file() {
            return Err(ModelError::InvalidHf {
                path: dir.to_path_buf(),
                reason: "config.json is missing (a model directory needs config.json, \
                         model.safetensors or model.safetensors.index.json, and tokenizer.json)"
                    .into(),
            });
        }
        let config = HfConfig::read(&config_path)?;
        let weights = SafetensorsWeights::open(dir)?;
        // A tensor the model uses must be of a type lantern reads; other buffers are
        // left alone.
        for (hf, dtype) in weights.unreadable() {
            if names::gguf_name(hf, config.post_attention_norm()).is_some() {
                return Err(ModelError::UnsupportedTensorType {
                    name: hf.clone(),
                    dtype: dtype.clone(),
                });
            }
        }
        // Bytes are read as MXFP4 codes only.
        for hf in weights.names() {
            let stored = &weights.get(hf).expect("listed").dtype;
            if *stored == DType::U8
                && !hf.ends_with("_scales")
                && !Self::mxfp4_codes(hf, &config)
                && names::gguf_name(hf, config.post_attention_norm()).is_some()
            {
                return Err(ModelError::UnsupportedTensorType {
                    name: hf.clone(),
                    dtype: "U8".into(),
                });
            }
        }
        let mut by_gguf_name = HashMap::new();
        for hf in weights.names() {
            let Some(gguf) = names::gguf_name(hf, config.post_attention_norm()) else {
                continue;
            };
            if gguf == "output.weight" && config.tie_word_embeddings {
                continue;
            }
            by_gguf_name.insert(gguf, hf.clone());
        }
        if !by_gguf_name.contains_key("token_embd.weight") {
            let held = names::hf_names("token_embd.weight", config.gguf_arch, false);
            return Err(ModelError::InvalidHf {
                path: dir.to_path_buf(),
                reason: format!(
                    "tensor `{}` is missing from the safetensors",
                    held.join("` or `")
                ),
            });
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            weights,
            by_gguf_name,
            quantize,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// An MXFP4 checkpoint's packed expert codes (gpt-oss's `mlp.experts.*_blocks`).
    fn mxfp4_codes(hf: &str, config: &HfConfig) -> bool {
        config.gguf_arch == "gpt-oss" && hf.ends_with("_blocks")
    }

    /// The Q8_0 tensor of MXFP4 codes `hf` and their `_scales`.
    fn widened_mxfp4(&self, hf: &str) -> candle_core::Result<QTensor> {
        let msg = |e: ModelError| candle_core::Error::Msg(e.to_string());
        let scales_name = format!("{}_scales", hf.trim_end_matches("_blocks"));
        let (codes, scales) = (
            self.weights.bytes(hf).map_err(msg)?,
            self.weights.bytes(&scales_name).map_err(msg)?,
        );
        let shape = |n: &str| {
            self.weights
                .get(n)
                .map(|t| t.shape.clone())
                .unwrap_or_default()
        };
        let scales_type = self.weights.get(&scales_name).map(|t| t.dtype);
        if scales_type != Some(DType::U8) {
            candle_core::bail!("`{scales_name}` must be bytes (U8), found {scales_type:?}");
        }
        let gate_first = hf.ends_with("gate_up_proj_blocks");
        mxfp4::widen(codes, &shape(hf), scales, &shape(&scales_name), gate_first)
    }

    fn stored_type(&self, gguf: &str, dtype: DType, shape: &[usize]) -> GgmlDType {
        // Vectors, and biases stacked per expert (gpt-oss), stay exact.
        if shape.len() < 2 || gguf.ends_with(".bias") {
            return GgmlDType::F32;
        }
        // As llama.cpp's quantizer: an expert router stays as it is (its few rows choose
        // the experts; rounding there changes which run).
        let quantize = self
            .quantize
            .filter(|_| !gguf.ends_with("ffn_gate_inp.weight"));
        if let Some(q) = quantize.and_then(|q| quantized_type_for(q, shape)) {
            return q;
        }
        match dtype {
            DType::F16 => GgmlDType::F16,
            DType::BF16 => GgmlDType::BF16,
            _ => GgmlDType::F32,
        }
    }

    /// The stored tensor with llama.cpp's conventions applied (still in its own dtype for
    /// matrices, f32 for vectors).
    fn converted(&self, gguf: &str, hf: &str) -> candle_core::Result<Tensor> {
        let mut t = self
            .weights
            .load(hf)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let permute_heads = if self.config.permutes_qk() {
            if gguf.contains(".attn_q.") {
                Some(self.config.num_heads)
            } else if gguf.contains(".attn_k.") {
                Some(self.config.num_kv_heads)
            } else {
                None
            }
        } else {
            None
        };
        if let Some(heads) = permute_heads {
            t = permute_rotary_pairs(&t, heads)?;
        }
        if self.config.transposes(hf) {
            t = t.t()?.contiguous()?;
        }
        if self.config.deinterleaves_gate_up(hf) {
            t = gate_first(&t)?;
        }
        let skipped = self.config.skipped_rows(hf);
        if skipped > 0 {
            let rows = t.dim(0)?;
            t = t.narrow(0, skipped.min(rows), rows.saturating_sub(skipped))?;
        }
        if self.config.regroups_qkv(hf) {
            t = group_qkv(&t, self.config.num_heads)?;
        }
        if t.rank() < 2 || gguf.ends_with(".bias") {
            t = t.to_dtype(DType::F32)?;
            if self.config.norms_plus_one() && gguf.ends_with("norm.weight") {
                t = (t + 1.0)?;
            }
        }
        Ok(t)
    }
}

/// The type `--quantize q` stores a matrix of `shape` in: `q` when its rows are whole blocks
/// of it, else llama.cpp's fallback for a k-quant (rows not whole 256-element super-blocks:
/// Gemma 3 270M's 640 columns, for one) when its rows are whole blocks of that, else none
/// (the matrix keeps its own type).
fn quantized_type_for(q: GgmlDType, shape: &[usize]) -> Option<GgmlDType> {
    let fits = |t: GgmlDType| shape.last().is_some_and(|&cols| cols % t.block_size() == 0);
    let fallback = match q {
        GgmlDType::Q4K => Some(GgmlDType::Q5_0),
        GgmlDType::Q5K => Some(GgmlDType::Q5_1),
        GgmlDType::Q6K => Some(GgmlDType::Q8_0),
        _ => None,
    };
    std::iter::once(q).chain(fallback).find(|&t| fits(t))
}

/// gpt-oss's experts' gate/up outputs on axis 1 (`[experts, 2 * ffn, ...]`, gate and
/// up alternating) as every gate output, then every up output.
fn gate_first(t: &Tensor) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let (experts, rows) = match dims.as_slice() {
        [e, r, ..] if r % 2 == 0 => (*e, *r),
        _ => candle_core::bail!("{dims:?} has no even gate/up axis to regroup"),
    };
    let rest: usize = dims[2..].iter().product();
    t.reshape((experts, rows / 2, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// GPT-NeoX's fused rows (weight or bias), `[heads, 3, head_dim, ...]`, as
/// `[3, heads, head_dim, ...]`: every head's q rows, then k, then v.
fn group_qkv(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let Some(&rows) = dims.first() else {
        candle_core::bail!("a scalar has no q/k/v rows");
    };
    if heads == 0 || !rows.is_multiple_of(heads * 3) {
        candle_core::bail!("{rows} rows cannot be split into {heads} heads of q, k and v");
    }
    let rest: usize = dims[1..].iter().product();
    t.reshape((heads, 3, rows / heads / 3, rest))?
        .transpose(0, 1)?
        .contiguous()?
        .reshape(dims)
}

/// llama.cpp's `permute`: within each head, the rows of the two rotary halves interleaved,
/// so that rotary pairs are adjacent rows.
fn permute_rotary_pairs(t: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let Some(&rows) = dims.first() else {
        candle_core::bail!("a scalar has no rows to permute");
    };
    if heads == 0 || !rows.is_multiple_of(heads * 2) {
        candle_core::bail!("{rows} rows cannot be split into {heads} heads of rotary pairs");
    }
    let rest: usize = dims[1..].iter().product();
    t.reshape((heads, 2, rows / heads / 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

impl WeightSource for HfDirectory {
    fn metadata(&self, key: &str) -> Option<&Value> {
        self.config.metadata.get(key)
    }

    fn tensor_info(&self, name: &str) -> Option<(Vec<usize>, GgmlDType)> {
        if let Some(values) = self.rope_tensor(name) {
            return Some((vec![values.len()], GgmlDType::F32));
        }
        let hf = self.by_gguf_name.get(name)?;
        let stored = self.weights.get(hf)?;
        if Self::mxfp4_codes(hf, &self.config) {
            return mxfp4::unpacked_shape(&stored.shape).map(|shape| (shape, GgmlDType::Q8_0));
        }
        let mut shape = stored.shape.clone();
        if self.config.transposes(hf) {
            if let [.., a, b] = shape.as_mut_slice() {
                std::mem::swap(a, b);
            }
        }
        if let Some(rows) = shape.first_mut() {
            *rows = rows.saturating_sub(self.config.skipped_rows(hf));
        }
        let dtype = self.stored_type(name, stored.dtype, &shape);
        Some((shape, dtype))
    }

    fn tensor_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.by_gguf_name.keys().cloned().collect();
        names.extend(self.config.rope_tensors.iter().map(|(n, _)| n.to_string()));
        names
    }

    fn tensor(&mut self, name: &str) -> Result<QTensor> {
        let wrap = |source| ModelError::Tensor {
            name: name.to_string(),
            source,
        };
        if let Some(values) = self.rope_tensor(name) {
            let t = Tensor::from_slice(values, values.len(), &Device::Cpu).map_err(wrap)?;
            return QTensor::quantize(&t, GgmlDType::F32).map_err(wrap);
        }
        let (_, target) = self.tensor_info(name).ok_or_else(|| {
            // Named as the checkpoint would hold it.
            let held = names::hf_names(
                name,
                self.config.gguf_arch,
                self.config.post_attention_norm(),
            );
            match held.is_empty() {
                true => ModelError::MissingTensor {
                    name: name.to_string(),
                },
                false => ModelError::MissingHfTensor {
                    hf: held.join("` or `"),
                    gguf: name.to_string(),
                },
            }
        })?;
        let hf = &self.by_gguf_name[name];
        if Self::mxfp4_codes(hf, &self.config) {
            return self.widened_mxfp4(hf).map_err(wrap);
        }
        let t = self.converted(name, hf).map_err(wrap)?;
        QTensor::quantize(&t, target).map_err(wrap)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_first_regroups_gpt_oss_interleaved_outputs() {
        // 2 experts, 3 gate/up pairs, 2 columns: row r of expert e holds 100e + r.
        let values: Vec<f32> = (0..2)
            .flat_map(|e| (0..6).flat_map(move |r| [(100 * e + r) as f32; 2]))
            .collect();
        let t = Tensor::from_vec(values, (2, 6, 2), &Device::Cpu).unwrap();
        let rows: Vec<Vec<Vec<f32>>> = gate_first(&t).unwrap().to_vec3().unwrap();
        let firsts: Vec<Vec<f32>> = rows
            .iter()
            .map(|e| e.iter().map(|r| r[0]).collect())
            .collect();
        assert_eq!(firsts[0], [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]);
        assert_eq!(firsts[1], [100.0, 102.0, 104.0, 101.0, 103.0, 105.0]);
        let bias = Tensor::from_vec(vec![0f32, 1., 2., 3.], (1, 4), &Device::Cpu).unwrap();
        let bias: Vec<Vec<f32>> = gate_first(&bias).unwrap().to_vec2().unwrap();
        assert_eq!(bias, [[0.0, 2.0, 1.0, 3.0]]);
        assert!(gate_first(&Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap()).is_err());
    }

    #[test]
    fn k_quants_fall_back_as_llama_cpp_where_rows_are_not_whole_super_blocks() {
        use GgmlDType::*;
        let gemma_up = [2048, 640];
        assert_eq!(quantized_type_for(Q4K, &gemma_up), Some(Q5_0));
        assert_eq!(quantized_type_for(Q5K, &gemma_up), Some(Q5_1));
        assert_eq!(quantized_type_for(Q6K, &gemma_up), Some(Q8_0));
        assert_eq!(quantized_type_for(Q4K, &[640, 2048]), Some(Q4K));
        assert_eq!(quantized_type_for(Q4_0, &gemma_up), Some(Q4_0));
        // Rows of 48: whole blocks of neither a k-quant nor its fallback, nor of Q4_0.
        assert_eq!(quantized_type_for(Q4K, &[8, 48]), None);
        assert_eq!(quantized_type_for(Q4_0, &[8, 48]), None);
        assert_eq!(quantized_type_for(F16, &[8, 48]), Some(F16));
    }

    #[test]
    fn permute_matches_llama_cpp_on_one_head() {
        // One head of 4 rows [r0 r1 | r2 r3] (halves) becomes [r0 r2 r1 r3].
        let t = Tensor::from_vec(
            (0..8).map(|x| x as f32).collect::<Vec<_>>(),
            (4, 2),
            &Device::Cpu,
        )
        .unwrap();
        let p = permute_rotary_pairs(&t, 1).unwrap();
        let rows: Vec<Vec<f32>> = p.to_vec2().unwrap();
        assert_eq!(
            rows,
            vec![vec![0., 1.], vec![4., 5.], vec![2., 3.], vec![6., 7.]]
        );
    }
}
