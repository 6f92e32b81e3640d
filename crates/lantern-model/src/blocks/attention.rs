//! The attention layer: q/k/v projections (separate or fused, optional biases, optionally
//! clamped: OLMo's `clip_qkv`), optional per-head QK-norm, RoPE, the backend call, the
//! capture tap, the output projection (and its optional bias).

use super::{BlockInput, Loader, Projections, RmsNorm};
use crate::compute::{AttentionCall, Compute};
use crate::error::{ModelError, Result};

/// Sizes of one attention layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionShape {
    pub hidden: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// q, k and v clamped to `[-c, c]` after their projections (OLMo's `clip_qkv`).
    pub clamp: Option<f32>,
}

impl AttentionShape {
    fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

pub struct Attention<C: Compute> {
    shape: AttentionShape,
    /// q, k, v.
    qkv: Projections<C>,
    /// RMSNorm of q and k before RoPE, per head (Qwen 3, Gemma 3) or over the whole
    /// projection (OLMoE).
    qk_norm: Option<(RmsNorm<C>, RmsNorm<C>)>,
    output: C::Matrix,
    /// The output projection's bias (GPT-2, GPT-NeoX).
    output_bias: Option<C::Vector>,
}

impl<C: Compute> Attention<C> {
    /// Layer `l`'s `attn_q`/`attn_k`/`attn_v` (or fused `attn_qkv`), their biases when the
    /// source has them, `attn_q_norm`/`attn_k_norm` when `qk_norm_eps` is given, and
    /// `attn_output`.
    pub fn load(
        c: &C,
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
                Projections::fused(c, loader.options, &name("attn_qkv"), fused, widths.to_vec())?;
            if let Some(b) = loader.opt_vector(&bias("attn_qkv"), q_dim + 2 * kv_dim)? {
                let (q, rest) = b.split_at(q_dim);
                let (k, v) = rest.split_at(kv_dim);
                for (i, part) in [q, k, v].into_iter().enumerate() {
                    p.set_bias(c, i, &bias("attn_qkv"), part.to_vec())?;
                }
            }
            p
        } else {
            let mut parts = Vec::with_capacity(3);
            for (t, rows) in ["attn_q", "attn_k", "attn_v"].into_iter().zip(widths) {
                parts.push((name(t), loader.tensor(&name(t), &[rows, h])?));
            }
            Projections::separate(c, loader.options, parts)?
        };
        for (i, (t, width)) in ["attn_q", "attn_k", "attn_v"]
            .into_iter()
            .zip(widths)
            .enumerate()
        {
            if let Some(b) = loader.opt_vector(&bias(t), width)? {
                qkv.set_bias(c, i, &bias(t), b)?;
            }
        }
        // Per head (a weight of `head_dim`), or over all of a token's heads at once
        // (OLMoE: a weight as wide as the projection); the norm's width says which.
        let norm_width = |loader: &Loader, t: &str, whole: usize| match loader.shape(&name(t)) {
            Some(dims) if dims == [whole] => whole,
            _ => shape.head_dim,
        };
        let qk_norm = match qk_norm_eps {
            Some(eps) => {
                let q = norm_width(loader, "attn_q_norm", q_dim);
                let k = norm_width(loader, "attn_k_norm", kv_dim);
                Some((
                    RmsNorm::load(c, loader, &name("attn_q_norm"), q, eps)?,
                    RmsNorm::load(c, loader, &name("attn_k_norm"), k, eps)?,
                ))
            }
            None => None,
        };
        let output_bias = loader
            .opt_vector(&bias("attn_output"), h)?
            .map(|b| c.vector(b))
            .transpose()?;
        Ok(Self {
            shape,
            qkv,
            qk_norm,
            output: loader.linear(c, &name("attn_output"), h, q_dim)?,
            output_bias,
        })
    }

    /// Attention over the normed input `x` (`[tokens, hidden]`): hands the rotated
    /// queries and this step's K/V to the device's attention (which writes K/V into the
    /// cache and feeds the tap), and returns the output projection.
    pub fn forward(
        &self,
        c: &C,
        x: &C::Act,
        rope: &C::RopeTable,
        call: AttentionCall<'_, '_>,
    ) -> Result<C::Act> {
        let tokens = call.tokens;
        let out = self.attend(c, &BlockInput::Normed(x), rope, call)?;
        let mut projected = c.matmul(&self.output, &out, tokens)?;
        if let Some(b) = &self.output_bias {
            c.add_bias(&mut projected, b)?;
        }
        Ok(projected)
    }

    /// `residual += out · Woᵀ`: the output projection of [`Self::attend`]'s `out` added
    /// into the residual stream.
    pub fn add_output(
        &self,
        c: &C,
        out: &C::Act,
        tokens: usize,
        residual: &mut C::Act,
    ) -> Result<()> {
        c.matmul_add(&self.output, out, tokens, residual)?;
        match &self.output_bias {
            Some(b) => c.add_bias(residual, b),
            None => Ok(()),
        }
    }

    /// The attention output before its projection (`[tokens, heads * head_dim]`), from
    /// `input` (normed rows, or the residual stream with the norm its product applies).
    pub fn attend(
        &self,
        c: &C,
        input: &BlockInput<'_, C>,
        rope: &C::RopeTable,
        call: AttentionCall<'_, '_>,
    ) -> Result<C::Act> {
        let s = &self.shape;
        let tokens = call.tokens;
        let mut qkv = self.qkv.forward_input(c, input, tokens)?.into_iter();
        let (Some(mut q), Some(mut k), Some(mut v)) = (qkv.next(), qkv.next(), qkv.next()) else {
            return Err(ModelError::Compute(
                "q/k/v projections are incomplete".into(),
            ));
        };
        if let Some(limit) = s.clamp {
            for x in [&mut q, &mut k, &mut v] {
                c.clamp(x, limit)?;
            }
        }
        let (q, k) = match &self.qk_norm {
            // Rows of `head_dim`: one norm per head.
            Some((q_norm, k_norm)) => (q_norm.forward(c, &q)?, k_norm.forward(c, &k)?),
            None => (q, k),
        };
        c.rope_attention(
            call,
            rope,
            (q, s.num_heads),
            (k, s.num_kv_heads),
            v,
            s.head_dim,
        )
    }
}
