//! The Llama family (Llama 2/3, SmolLM, Mistral-style GQA) from GGUF weights.

use crate::config::LlamaConfig;
use crate::error::Result;
use crate::linear::{tensor_to_vec, Linear};
use crate::ops;
use crate::rope::{Rope, RopePairs};
use crate::source::WeightSource;
use crate::{CausalLm, ForwardBatch, LoadOptions, LoadProgress, ModelInfo};
use lantern_attn::{AttentionBackend, AttentionLayerSpec, AttentionTap, PagedKvCache};

struct LlamaLayer {
    attn_norm: Vec<f32>,
    qkv: Linear,
    attn_output: Linear,
    ffn_norm: Vec<f32>,
    gate_up: Linear,
    ffn_down: Linear,
}

pub struct Llama {
    config: LlamaConfig,
    info: ModelInfo,
    token_embd: Linear,
    layers: Vec<LlamaLayer>,
    output_norm: Vec<f32>,
    /// `None` when the output projection is tied to the token embeddings.
    output: Option<Linear>,
    rope: Rope,
}

impl Llama {
    pub fn load(
        gguf: &mut dyn WeightSource,
        progress: &LoadProgress,
        options: &LoadOptions,
    ) -> Result<Self> {
        let config = LlamaConfig::from_gguf(gguf)?;
        let c = &config;
        let (h, q_dim, kv_dim) = (
            c.hidden_size,
            c.num_heads * c.head_dim,
            c.num_kv_heads * c.head_dim,
        );
        progress.start(gguf.tensor_names().len());
        let has_output = gguf.has_tensor("output.weight");
        let has_rope_freqs = gguf.has_tensor("rope_freqs.weight");
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
            let attn_norm = tensor_to_vec(&name("attn_norm"), &tensor(&name("attn_norm"), &[h])?)?;
            let ffn_norm = tensor_to_vec(&name("ffn_norm"), &tensor(&name("ffn_norm"), &[h])?)?;
            let q = tensor(&name("attn_q"), &[q_dim, h])?;
            let k = tensor(&name("attn_k"), &[kv_dim, h])?;
            let v = tensor(&name("attn_v"), &[kv_dim, h])?;
            let gate = tensor(&name("ffn_gate"), &[c.intermediate_size, h])?;
            let up = tensor(&name("ffn_up"), &[c.intermediate_size, h])?;
            layers.push(LlamaLayer {
                attn_norm,
                qkv: Linear::load_stacked(options, &name("attn_qkv"), vec![q, k, v])?,
                attn_output: Linear::load(
                    options,
                    &name("attn_output"),
                    tensor(&name("attn_output"), &[h, q_dim])?,
                )?,
                ffn_norm,
                gate_up: Linear::load_stacked(options, &name("ffn_gate_up"), vec![gate, up])?,
                ffn_down: Linear::load(
                    options,
                    &name("ffn_down"),
                    tensor(&name("ffn_down"), &[h, c.intermediate_size])?,
                )?,
            });
        }
        let output_norm =
            tensor_to_vec("output_norm.weight", &tensor("output_norm.weight", &[h])?)?;
        let output = if has_output {
            Some(Linear::load(
                options,
                "output.weight",
                tensor("output.weight", &[c.vocab_size, h])?,
            )?)
        } else {
            None
        };
        let freq_factors = if has_rope_freqs {
            let t = tensor("rope_freqs.weight", &[c.rope_dim / 2])?;
            Some(tensor_to_vec("rope_freqs.weight", &t)?)
        } else {
            None
        };
        progress.finish();
        let rope = Rope::new(
            c.rope_dim,
            c.rope_theta,
            RopePairs::Adjacent,
            freq_factors.as_deref(),
            c.rope_linear_factor,
        );
        let layer_spec = AttentionLayerSpec {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            sliding_window: None,
            chunk_size: None,
            logits_soft_cap: None,
            sinks: None,
        };
        let info = ModelInfo {
            architecture: c.architecture.clone(),
            name: c.name.clone(),
            num_layers: c.num_layers,
            hidden_size: h,
            vocab_size: c.vocab_size,
            context_length: c.context_length,
            attention: vec![layer_spec; c.num_layers],
        };
        Ok(Self {
            config,
            info,
            token_embd,
            layers,
            output_norm,
            output,
            rope,
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }
}

impl CausalLm for Llama {
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
        let (q_dim, kv_dim) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        let rope = self.rope.table(batch.positions);
        let mut x = self.token_embd.rows(batch.token_ids)?;
        let mut attn_out = vec![0f32; tokens * q_dim];
        for (l, layer) in self.layers.iter().enumerate() {
            let h = ops::rms_norm(&x, &layer.attn_norm, c.rms_norm_eps);
            let qkv = layer.qkv.forward(&h, tokens)?;
            let (mut q, mut k, v) = ops::split3(&qkv, q_dim, kv_dim, kv_dim);
            rope.apply(&mut q, c.num_heads, c.head_dim);
            rope.apply(&mut k, c.num_kv_heads, c.head_dim);
            let meta = &batch.attention[batch.layer_group[l]];
            backend.forward(
                &self.info.attention[l],
                meta,
                &q,
                &k,
                &v,
                &mut caches[l],
                &mut attn_out,
            )?;
            if let Some(tap) = tap.as_deref_mut().filter(|t| t.wants_layer(l)) {
                tap.record(l, &q, &attn_out);
            }
            ops::add_in_place(&mut x, &layer.attn_output.forward(&attn_out, tokens)?);

            let h = ops::rms_norm(&x, &layer.ffn_norm, c.rms_norm_eps);
            let gate_up = layer.gate_up.forward(&h, tokens)?;
            let act = ops::silu_mul_stacked(&gate_up, c.intermediate_size);
            ops::add_in_place(&mut x, &layer.ffn_down.forward(&act, tokens)?);
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
        let normed = ops::rms_norm(&selected, &self.output_norm, c.rms_norm_eps);
        let output = self.output.as_ref().unwrap_or(&self.token_embd);
        output.forward(&normed, batch.logits_rows.len())
    }
}
