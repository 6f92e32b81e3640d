//! Gemma 3 (text) from GGUF weights: sliding-window layers interleaved with global ones
//! (two KV cache groups), per-head QK norm, sandwich norms around attention and the MLP,
//! GeGLU, embeddings scaled by `sqrt(hidden)`, output tied to the embeddings.
//!
//! Norm weights: Hugging Face's Gemma RMSNorm multiplies by `1 + w`; llama.cpp's converter
//! stores `1 + w` in the GGUF file, so the file's values are the multipliers as they are.

use crate::config::Gemma3Config;
use crate::error::{ModelError, Result};
use crate::linear::{tensor_to_vec, Linear};
use crate::ops;
use crate::rope::{Rope, RopePairs};
use crate::source::WeightSource;
use crate::{CausalLm, ForwardBatch, LoadOptions, LoadProgress, ModelInfo};
use candle_core::quantized::QTensor;
use lantern_attn::{AttentionBackend, AttentionLayerSpec, AttentionTap, PagedKvCache};

struct Gemma3Layer {
    attn_norm: Vec<f32>,
    /// q, k, v (stacked where their types allow).
    qkv: Projections,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    attn_output: Linear,
    post_attention_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    /// gate, up.
    gate_up: Projections,
    ffn_down: Linear,
    post_ffw_norm: Vec<f32>,
}

pub struct Gemma3 {
    config: Gemma3Config,
    info: ModelInfo,
    token_embd: Linear,
    layers: Vec<Gemma3Layer>,
    output_norm: Vec<f32>,
    /// `None` when the output projection is tied to the token embeddings (Gemma 3's own).
    output: Option<Linear>,
    rope_global: Rope,
    rope_local: Rope,
}

impl Gemma3 {
    pub fn load(
        gguf: &mut dyn WeightSource,
        progress: &LoadProgress,
        options: &LoadOptions,
    ) -> Result<Self> {
        let config = Gemma3Config::from_gguf(gguf)?;
        let c = &config;
        let (h, d, q_dim, kv_dim, ff) = (
            c.hidden_size,
            c.head_dim,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
            c.intermediate_size,
        );
        progress.start(gguf.tensor_names().len());
        let has_output = gguf.has_tensor("output.weight");
        let mut tensor = |name: &str, shape: &[usize]| {
            let t = gguf.tensor_with_shape(name, shape);
            progress.advance();
            t
        };
        let token_embd = Linear::load(
            options,
            "token_embd.weight",
            tensor("token_embd.weight", &[c.vocab_size, h])?,
        )?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in 0..c.num_layers {
            let name = |t: &str| format!("blk.{l}.{t}.weight");
            let mut norm = |t: &str, len: usize| {
                let n = name(t);
                let values = tensor_to_vec(&n, &tensor(&n, &[len])?)?;
                finite(&n, values)
            };
            let attn_norm = norm("attn_norm", h)?;
            let q_norm = norm("attn_q_norm", d)?;
            let k_norm = norm("attn_k_norm", d)?;
            let post_attention_norm = norm("post_attention_norm", h)?;
            let ffn_norm = norm("ffn_norm", h)?;
            let post_ffw_norm = norm("post_ffw_norm", h)?;
            let q = tensor(&name("attn_q"), &[q_dim, h])?;
            let k = tensor(&name("attn_k"), &[kv_dim, h])?;
            let v = tensor(&name("attn_v"), &[kv_dim, h])?;
            let attn_output = tensor(&name("attn_output"), &[h, q_dim])?;
            let gate = tensor(&name("ffn_gate"), &[ff, h])?;
            let up = tensor(&name("ffn_up"), &[ff, h])?;
            let down = tensor(&name("ffn_down"), &[h, ff])?;
            layers.push(Gemma3Layer {
                attn_norm,
                qkv: Projections::new(
                    options,
                    vec![
                        (name("attn_q"), q),
                        (name("attn_k"), k),
                        (name("attn_v"), v),
                    ],
                )?,
                q_norm,
                k_norm,
                attn_output: Linear::load(options, &name("attn_output"), attn_output)?,
                post_attention_norm,
                ffn_norm,
                gate_up: Projections::new(
                    options,
                    vec![(name("ffn_gate"), gate), (name("ffn_up"), up)],
                )?,
                ffn_down: Linear::load(options, &name("ffn_down"), down)?,
                post_ffw_norm,
            });
        }
        let output_norm = finite(
            "output_norm.weight",
            tensor_to_vec("output_norm.weight", &tensor("output_norm.weight", &[h])?)?,
        )?;
        let output = if has_output {
            Some(Linear::load(
                options,
                "output.weight",
                tensor("output.weight", &[c.vocab_size, h])?,
            )?)
        } else {
            None
        };
        progress.finish();
        let rope_global = Rope::new(
            d,
            c.rope_global_base,
            RopePairs::Halves,
            None,
            c.rope_global_linear_factor,
        );
        let rope_local = Rope::new(d, c.rope_local_base, RopePairs::Halves, None, 1.0);
        let attention = c
            .layer_window
            .iter()
            .map(|&window| AttentionLayerSpec {
                num_heads: c.num_heads,
                num_kv_heads: c.num_kv_heads,
                head_dim: d,
                scale: c.attention_scale,
                sliding_window: window,
                chunk_size: None,
                logits_soft_cap: c.attn_logit_softcap,
                sinks: None,
            })
            .collect();
        let info = ModelInfo {
            architecture: c.architecture.clone(),
            name: c.name.clone(),
            num_layers: c.num_layers,
            hidden_size: h,
            vocab_size: c.vocab_size,
            context_length: c.context_length,
            attention,
        };
        Ok(Self {
            config,
            info,
            token_embd,
            layers,
            output_norm,
            output,
            rope_global,
            rope_local,
        })
    }

    pub fn config(&self) -> &Gemma3Config {
        &self.config
    }
}

fn finite(name: &str, values: Vec<f32>) -> Result<Vec<f32>> {
    if values.iter().all(|v| v.is_finite()) {
        Ok(values)
    } else {
        Err(ModelError::InvalidConfig(format!(
            "tensor `{name}` holds values that are not finite"
        )))
    }
}

/// Several matrices applied to the same input (q/k/v, gate/up). Neighbours of one type are
/// stacked into one product; Gemma's GGUF files mix types (q, k in Q5_0, v in Q8_0), so a
/// single stack is not always possible.
struct Projections {
    /// Each product and the output widths of the matrices it stacks.
    stacks: Vec<(Linear, Vec<usize>)>,
}

impl Projections {
    /// `parts`: each matrix with its tensor name (errors name the tensors involved).
    fn new(options: &LoadOptions, parts: Vec<(String, QTensor)>) -> Result<Self> {
        let mut runs: Vec<Vec<(String, QTensor)>> = Vec::new();
        for part in parts {
            match runs.last_mut() {
                Some(run) if run.last().is_some_and(|(_, t)| t.dtype() == part.1.dtype()) => {
                    run.push(part)
                }
                _ => runs.push(vec![part]),
            }
        }
        let stacks = runs
            .into_iter()
            .map(|run| {
                let widths = run.iter().map(|(_, t)| t.shape().dims()[0]).collect();
                let name = run
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(" + ");
                let mut tensors: Vec<QTensor> = run.into_iter().map(|(_, t)| t).collect();
                let product = match tensors.len() {
                    1 => Linear::load(options, &name, tensors.remove(0))?,
                    _ => Linear::load_stacked(options, &name, tensors)?,
                };
                Ok((product, widths))
            })
            .collect::<Result<_>>()?;
        Ok(Self { stacks })
    }

    /// `[rows, in]` → one `[rows, width]` buffer per matrix, in the order given.
    fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<Vec<f32>>> {
        let mut outputs = Vec::new();
        for (product, widths) in &self.stacks {
            let y = product.forward(x, rows)?;
            if widths.len() == 1 {
                outputs.push(y);
                continue;
            }
            let total: usize = widths.iter().sum();
            let mut parts: Vec<Vec<f32>> = widths
                .iter()
                .map(|w| Vec::with_capacity(rows * w))
                .collect();
            for row in y.chunks_exact(total) {
                let mut at = 0;
                for (part, &w) in parts.iter_mut().zip(widths) {
                    part.extend_from_slice(&row[at..at + w]);
                    at += w;
                }
            }
            outputs.extend(parts);
        }
        Ok(outputs)
    }
}

/// `gelu_tanh(gate) * up` on a `[rows, hidden]` pair (GeGLU with the tanh approximation,
/// PyTorch's `gelu(approximate="tanh")`).
fn gelu_tanh_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| {
            let inner = SQRT_2_OVER_PI * (g + 0.044_715 * g * g * g);
            0.5 * g * (1.0 + inner.tanh()) * u
        })
        .collect()
}

impl CausalLm for Gemma3 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn forward(
        &self,
        batch: &ForwardBatch,
        backend: &dyn AttentionBackend,
        caches: &mut [PagedKvCache],
        mut tap: Option<&mut dyn AttentionTap>,
    ) -> Result<Vec<f32>> {
        batch.validate(&self.info, caches.len())?;
        let c = &self.config;
        let tokens = batch.token_ids.len();
        let (d, eps) = (c.head_dim, c.rms_norm_eps);
        let rope_global = self.rope_global.table(batch.positions);
        let rope_local = self.rope_local.table(batch.positions);
        let mut x = self.token_embd.rows(batch.token_ids)?;
        let embed_scale = (c.hidden_size as f32).sqrt();
        x.iter_mut().for_each(|v| *v *= embed_scale);
        let mut attn_out = vec![0f32; tokens * c.num_heads * d];
        for (l, layer) in self.layers.iter().enumerate() {
            let spec = &self.info.attention[l];
            let h = ops::rms_norm(&x, &layer.attn_norm, eps);
            let mut qkv = layer.qkv.forward(&h, tokens)?.into_iter();
            let (Some(q), Some(k), Some(v)) = (qkv.next(), qkv.next(), qkv.next()) else {
                return Err(ModelError::Compute(
                    "q/k/v projections are incomplete".into(),
                ));
            };
            // Per-head RMS norm of q and k (rows of `head_dim`), then RoPE.
            let mut q = ops::rms_norm(&q, &layer.q_norm, eps);
            let mut k = ops::rms_norm(&k, &layer.k_norm, eps);
            let rope = if spec.sliding_window.is_some() {
                &rope_local
            } else {
                &rope_global
            };
            rope.apply(&mut q, c.num_heads, d);
            rope.apply(&mut k, c.num_kv_heads, d);
            let meta = &batch.attention[batch.layer_group[l]];
            backend.forward(spec, meta, &q, &k, &v, &mut caches[l], &mut attn_out)?;
            if let Some(tap) = tap.as_deref_mut().filter(|t| t.wants_layer(l)) {
                tap.record(l, &q, &attn_out);
            }
            let o = layer.attn_output.forward(&attn_out, tokens)?;
            ops::add_in_place(&mut x, &ops::rms_norm(&o, &layer.post_attention_norm, eps));

            let h = ops::rms_norm(&x, &layer.ffn_norm, eps);
            let mut gate_up = layer.gate_up.forward(&h, tokens)?.into_iter();
            let (Some(gate), Some(up)) = (gate_up.next(), gate_up.next()) else {
                return Err(ModelError::Compute(
                    "gate/up projections are incomplete".into(),
                ));
            };
            let down = layer.ffn_down.forward(&gelu_tanh_mul(&gate, &up), tokens)?;
            ops::add_in_place(&mut x, &ops::rms_norm(&down, &layer.post_ffw_norm, eps));
        }
        let selected: Vec<f32> = batch
            .logits_rows
            .iter()
            .flat_map(|&r| {
                x[r * c.hidden_size..(r + 1) * c.hidden_size]
                    .iter()
                    .copied()
            })
            .collect();
        let normed = ops::rms_norm(&selected, &self.output_norm, eps);
        let output = self.output.as_ref().unwrap_or(&self.token_embd);
        let mut logits = output.forward(&normed, batch.logits_rows.len())?;
        if let Some(cap) = c.final_logit_softcap {
            logits.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
        Ok(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_tanh_matches_known_values() {
        // PyTorch: gelu(x, approximate="tanh") at 1.0 and -2.0.
        let out = gelu_tanh_mul(&[1.0, -2.0, 0.0], &[1.0, 2.0, 5.0]);
        assert!((out[0] - 0.841_192).abs() < 1e-5, "{}", out[0]);
        assert!((out[1] - 2.0 * -0.045_402_3).abs() < 1e-5, "{}", out[1]);
        assert_eq!(out[2], 0.0);
    }
}
