//! The attention layer: q/k/v projections (separate or fused, optional biases), optional
//! per-head QK-norm, RoPE, the backend call, the capture tap, the output projection.

use super::{Loader, Projections, RmsNorm};
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::rope::RopeTable;
use lantern_attn::{
    host_f32, tensor3, AttentionBackend, AttentionLayerSpec, AttentionMetadata, AttentionTap,
    LayerKvCache,
};

/// Sizes of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionShape {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionShape {
    fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

pub struct Attention {
    shape: AttentionShape,
    /// q, k, v.
    qkv: Projections,
    /// Per-head RMSNorm of q and k, before RoPE (Qwen 3, Gemma 3).
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    output: Linear,
}

impl Attention {
    /// Layer `l`'s `attn_q`/`attn_k`/`attn_v` (or fused `attn_qkv`), their biases when the
    /// source has them, `attn_q_norm`/`attn_k_norm` when `qk_norm_eps` is given, and
    /// `attn_output`.
    pub fn load(
        loader: &mut Loader,
        l: usize,
        shape: AttentionShape,
        qk_norm_eps: Option<f32>,
    ) -> Result<Self> {
        let name = |t: &str| format!("blk.{l}.{t}.weight");
        let bias = |t: &str| format!("blk.{l}.{t}.bias");
        let (h, q_dim, kv_dim) = (shape.hidden, shape.q_dim(), shape.kv_dim());
        let widths = [q_dim, kv_dim, kv_dim];
        let mut qkv = if loader.has(&name("attn_qkv")) {
            let fused = loader.tensor(&name("attn_qkv"), &[q_dim + 2 * kv_dim, h])?;
            let mut p =
                Projections::fused(loader.options, &name("attn_qkv"), fused, widths.to_vec())?;
            if let Some(b) = loader.opt_vector(&bias("attn_qkv"), q_dim + 2 * kv_dim)? {
                let (q, rest) = b.split_at(q_dim);
                let (k, v) = rest.split_at(kv_dim);
                for (i, part) in [q, k, v].into_iter().enumerate() {
                    p.set_bias(i, &bias("attn_qkv"), part.to_vec())?;
                }
            }
            p
        } else {
            let mut parts = Vec::with_capacity(3);
            for (t, rows) in ["attn_q", "attn_k", "attn_v"].into_iter().zip(widths) {
                parts.push((name(t), loader.tensor(&name(t), &[rows, h])?));
            }
            Projections::separate(loader.options, parts)?
        };
        for (i, (t, width)) in ["attn_q", "attn_k", "attn_v"]
            .into_iter()
            .zip(widths)
            .enumerate()
        {
            if let Some(b) = loader.opt_vector(&bias(t), width)? {
                qkv.set_bias(i, &bias(t), b)?;
            }
        }
        let qk_norm = match qk_norm_eps {
            Some(eps) => Some((
                RmsNorm::load(loader, &name("attn_q_norm"), shape.head_dim, eps)?,
                RmsNorm::load(loader, &name("attn_k_norm"), shape.head_dim, eps)?,
            )),
            None => None,
        };
        Ok(Self {
            shape,
            qkv,
            qk_norm,
            output: loader.linear(&name("attn_output"), h, q_dim)?,
        })
    }

    /// Attention of layer `layer` over the normed input `x` (`[tokens, hidden]`): hands
    /// the rotated queries and this step's K/V to the backend as tensors on its device
    /// (the backend writes K/V into `cache`), hands the tap (if it wants the layer) the
    /// queries and the attention output, and returns the output projection.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<'t>(
        &self,
        layer: usize,
        x: &[f32],
        tokens: usize,
        rope: &RopeTable,
        spec: &AttentionLayerSpec,
        meta: &AttentionMetadata,
        backend: &dyn AttentionBackend,
        cache: &mut dyn LayerKvCache,
        tap: Option<&mut (dyn AttentionTap + 't)>,
    ) -> Result<Vec<f32>> {
        let s = &self.shape;
        let mut qkv = self.qkv.forward(x, tokens)?.into_iter();
        let (Some(q), Some(k), Some(v)) = (qkv.next(), qkv.next(), qkv.next()) else {
            return Err(ModelError::Compute(
                "q/k/v projections are incomplete".into(),
            ));
        };
        let (mut q, mut k) = match &self.qk_norm {
            // Rows of `head_dim`: one norm per head.
            Some((q_norm, k_norm)) => (q_norm.forward(&q), k_norm.forward(&k)),
            None => (q, k),
        };
        rope.apply(&mut q, s.num_heads, s.head_dim);
        rope.apply(&mut k, s.num_kv_heads, s.head_dim);
        let device = backend.device();
        let q = tensor3(q, [tokens, s.num_heads, s.head_dim], &device)?;
        let k = tensor3(k, [tokens, s.num_kv_heads, s.head_dim], &device)?;
        let v = tensor3(v, [tokens, s.num_kv_heads, s.head_dim], &device)?;
        let out = backend.forward(spec, meta, &q, &k, &v, cache)?;
        if let Some(tap) = tap.filter(|t| t.wants_layer(layer)) {
            tap.record(layer, &q, &out)?;
        }
        let out = host_f32(&out)?;
        self.output.forward(&out, tokens)
    }
}
