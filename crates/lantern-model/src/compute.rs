//! The device a model's blocks run on: the few operations the decoder is written over
//! (products, norms, element-wise passes, RoPE, the attention call), candle-style. The
//! blocks are written once over [`Compute`]; [`Cpu`] runs them on lantern-quant's kernels
//! and `lantern-attn`'s backends, and a GPU crate implements the same trait over device
//! buffers, so no architecture is ever written twice.

use crate::blocks::Activation;
use crate::error::{ModelError, Result};
use crate::linear::Linear;
use crate::pick::{apply_edits, reduce_row, LogitEdit, ReducedRow, RowReduction};
use crate::rope::{Rope, RopeTable};
use crate::{ops, LoadOptions};
use candle_core::quantized::QTensor;
use lantern_attn::{
    host_f32, tensor3, AttentionBackend, AttentionLayerSpec, AttentionMetadata, AttentionTap,
    CpuFlashBackend, LayerKvCache, RecordedRows,
};
use lantern_quant::share;

/// One attention call: the layer, its description and metadata, where it runs and reads
/// its cache, and the capture tap.
pub struct AttentionCall<'a, 't> {
    pub layer: usize,
    pub tokens: usize,
    pub spec: &'a AttentionLayerSpec,
    pub meta: &'a AttentionMetadata,
    pub backend: &'a dyn AttentionBackend,
    pub cache: &'a mut dyn LayerKvCache,
    pub tap: Option<&'a mut (dyn AttentionTap + 't)>,
}

/// The operations the shared blocks are written over. Activations are `[rows, width]`
/// f32 values wherever they live; every operation checks its sizes and returns an error
/// rather than panicking.
pub trait Compute: Send + Sync + Sized + 'static {
    /// `[rows, width]` activations.
    type Act: Send + Sync;
    /// A weight matrix `[out, in]` (possibly several stacked) ready for products.
    type Matrix: Send + Sync;
    /// A vector of f32 values: a norm's weight, a bias.
    type Vector: Send + Sync;
    /// One step's RoPE cos/sin.
    type RopeTable: Send + Sync;

    /// `tensor` (`[out, in]`) as a product.
    fn matrix(&self, options: &LoadOptions, name: &str, tensor: QTensor) -> Result<Self::Matrix>;
    /// Matrices of one type and input width stacked into one product.
    fn stacked_matrix(
        &self,
        options: &LoadOptions,
        name: &str,
        parts: Vec<QTensor>,
    ) -> Result<Self::Matrix>;
    fn vector(&self, values: Vec<f32>) -> Result<Self::Vector>;
    fn rope_table(&self, rope: &Rope, positions: &[usize]) -> Result<Self::RopeTable>;

    /// Rows `ids` of `table` (an embedding lookup), times `scale` when given.
    fn embed(&self, table: &Self::Matrix, ids: &[u32], scale: Option<f32>) -> Result<Self::Act>;
    /// `x · Wᵀ` for `x` of `rows` rows, its output split by `widths` (one product for a
    /// stacked q/k/v or gate/up).
    fn matmul_parts(
        &self,
        w: &Self::Matrix,
        x: &Self::Act,
        rows: usize,
        widths: &[usize],
    ) -> Result<Vec<Self::Act>>;
    /// Output rows of `w`.
    fn out_features(&self, w: &Self::Matrix) -> usize;

    /// `x · Wᵀ` for `x` of `rows` rows.
    fn matmul(&self, w: &Self::Matrix, x: &Self::Act, rows: usize) -> Result<Self::Act> {
        let mut out = self.matmul_parts(w, x, rows, &[self.out_features(w)])?;
        out.pop()
            .ok_or_else(|| ModelError::Compute("a product gave no output".into()))
    }

    /// RMS norm of every row of `weight.len()` values.
    fn rms_norm(&self, x: &Self::Act, weight: &Self::Vector, eps: f32) -> Result<Self::Act>;
    /// `x += delta`, then the RMS norm of `x` (a residual add and the next block's norm:
    /// one pass where a device fuses them).
    fn add_rms_norm(
        &self,
        x: &mut Self::Act,
        delta: &Self::Act,
        weight: &Self::Vector,
        eps: f32,
    ) -> Result<Self::Act> {
        self.add(x, delta)?;
        self.rms_norm(x, weight, eps)
    }
    /// `act(gate) * up` for a product `w` whose outputs are `[gate | up]`, `width` each
    /// (a gated MLP's stacked gate and up).
    fn matmul_gated(
        &self,
        w: &Self::Matrix,
        x: &Self::Act,
        rows: usize,
        width: usize,
        act: Activation,
    ) -> Result<Self::Act> {
        let mut parts = self.matmul_parts(w, x, rows, &[width, width])?;
        let (Some(up), Some(mut gate)) = (parts.pop(), parts.pop()) else {
            return Err(ModelError::Compute("a gated product gave no output".into()));
        };
        self.act_mul(act, &mut gate, &up)?;
        Ok(gate)
    }

    /// Whether a step of `rows` rows should hand its blocks' first products the residual
    /// stream un-normed ([`Compute::normed_matmul_parts`],
    /// [`Compute::normed_matmul_gated`]) and let the last ones add into it
    /// ([`Compute::matmul_add`]): where a device does the norm and the add inside the
    /// products' launches. The defaults below do them apart, so it is false by default.
    fn folds_norms(&self, _rows: usize) -> bool {
        false
    }
    /// [`Compute::matmul_parts`] of the RMS norm of `x` (`norm`: weight and eps).
    fn normed_matmul_parts(
        &self,
        w: &Self::Matrix,
        (x, norm): (&Self::Act, (&Self::Vector, f32)),
        rows: usize,
        widths: &[usize],
    ) -> Result<Vec<Self::Act>> {
        let h = self.rms_norm(x, norm.0, norm.1)?;
        self.matmul_parts(w, &h, rows, widths)
    }
    /// [`Compute::matmul_gated`] of the RMS norm of `x` (`norm`: weight and eps).
    fn normed_matmul_gated(
        &self,
        w: &Self::Matrix,
        (x, norm): (&Self::Act, (&Self::Vector, f32)),
        rows: usize,
        width: usize,
        act: Activation,
    ) -> Result<Self::Act> {
        let h = self.rms_norm(x, norm.0, norm.1)?;
        self.matmul_gated(w, &h, rows, width, act)
    }
    /// `acc += x · Wᵀ` (a block's last product added into the residual stream).
    fn matmul_add(
        &self,
        w: &Self::Matrix,
        x: &Self::Act,
        rows: usize,
        acc: &mut Self::Act,
    ) -> Result<()> {
        let y = self.matmul(w, x, rows)?;
        self.add(acc, &y)
    }

    /// `acc += x`.
    fn add(&self, acc: &mut Self::Act, x: &Self::Act) -> Result<()>;
    /// Adds `bias` to every row.
    fn add_bias(&self, x: &mut Self::Act, bias: &Self::Vector) -> Result<()>;
    /// `gate = act(gate) * up`.
    fn act_mul(&self, act: Activation, gate: &mut Self::Act, up: &Self::Act) -> Result<()>;
    /// `x = cap · tanh(x / cap)`.
    fn soft_cap(&self, x: &mut Self::Act, cap: f32) -> Result<()>;
    /// `x *= factor` (Granite's residual and logit multipliers).
    fn scale(&self, x: &mut Self::Act, factor: f32) -> Result<()>;
    /// `x = min(max(x, -limit), limit)` (OLMo's `clip_qkv`).
    fn clamp(&self, x: &mut Self::Act, limit: f32) -> Result<()>;
    /// Rotates `x` (`[tokens, heads, head_dim]`) by the step's table.
    fn rope(
        &self,
        table: &Self::RopeTable,
        x: &mut Self::Act,
        heads: usize,
        head_dim: usize,
    ) -> Result<()>;
    /// Rotates a step's queries and keys (`q_heads` and `k_heads` heads of `head_dim`).
    fn rope_qk(
        &self,
        table: &Self::RopeTable,
        (q, q_heads): (&mut Self::Act, usize),
        (k, k_heads): (&mut Self::Act, usize),
        head_dim: usize,
    ) -> Result<()> {
        self.rope(table, q, q_heads, head_dim)?;
        self.rope(table, k, k_heads, head_dim)
    }
    /// The rows `rows` of `x` (rows of `width` values).
    fn select_rows(&self, x: &Self::Act, rows: &[usize], width: usize) -> Result<Self::Act>;

    /// Whether [`Compute::layer_norm`] and [`Compute::activate`], which GPT-2 and
    /// GPT-NeoX style layers need (LayerNorm, un-gated MLPs), are implemented.
    const RUNS_LAYER_NORM_MODELS: bool = false;
    /// LayerNorm of every row (rows of the weight's length): `(x − mean) / sqrt(var +
    /// eps) · weight + bias`.
    fn layer_norm(
        &self,
        _x: &Self::Act,
        _weight: &Self::Vector,
        _bias: &Self::Vector,
        _eps: f32,
    ) -> Result<Self::Act> {
        Err(no_layer_norm())
    }
    /// `x = act(x)`, element-wise (an un-gated MLP's activation).
    fn activate(&self, _act: Activation, _x: &mut Self::Act) -> Result<()> {
        Err(no_layer_norm())
    }

    /// Whether [`Compute::zeros`] and [`Compute::add_rows_scaled`], which
    /// mixture-of-experts layers need, are implemented.
    const RUNS_EXPERTS: bool = false;
    /// `rows` rows of `width` zeros.
    fn zeros(&self, _rows: usize, _width: usize) -> Result<Self::Act> {
        Err(no_experts())
    }
    /// `acc[rows[i]] += weights[i] · x[i]` for every row `i` of `x`, in order.
    fn add_rows_scaled(
        &self,
        _acc: &mut Self::Act,
        _x: &Self::Act,
        _rows: &[usize],
        _weights: &[f32],
        _width: usize,
    ) -> Result<()> {
        Err(no_experts())
    }

    /// Attention over rotated `q` and this step's `k`/`v` (`[tokens, heads, head_dim]`):
    /// writes K/V into the cache, hands the tap what it asks for, returns the output.
    fn attention(
        &self,
        call: AttentionCall<'_, '_>,
        q: Self::Act,
        k: Self::Act,
        v: Self::Act,
    ) -> Result<Self::Act>;

    /// [`Compute::rope_qk`] of `q` and `k`, then [`Compute::attention`]: one call, so that a
    /// device may turn the keys as it writes them into the cache (one pass fewer).
    #[allow(clippy::too_many_arguments)]
    fn rope_attention(
        &self,
        call: AttentionCall<'_, '_>,
        table: &Self::RopeTable,
        (mut q, q_heads): (Self::Act, usize),
        (mut k, k_heads): (Self::Act, usize),
        v: Self::Act,
        head_dim: usize,
    ) -> Result<Self::Act> {
        self.rope_qk(table, (&mut q, q_heads), (&mut k, k_heads), head_dim)?;
        self.attention(call, q, k, v)
    }

    /// The values on the host.
    fn to_host(&self, x: Self::Act) -> Result<Vec<f32>>;

    /// After the step's layers: hands `tap` the probabilities a device computed for it
    /// as the layers ran and kept there until now (one wait for the device a step, not
    /// one a layer). `None`: the step failed; they are dropped.
    fn finish_layers(&self, _tap: Option<&mut (dyn AttentionTap + '_)>) -> Result<()> {
        Ok(())
    }

    /// Whether rows reduced here save a copy to the host.
    const PICKS_ON_DEVICE: bool = false;

    /// Applies `edits` to the rows of `width` in `x` (held to
    /// [`crate::pick::apply_edits`]; an edit whose row is `u32::MAX` does nothing: a graph
    /// step's padding).
    fn edit_logits(&self, x: &mut Self::Act, width: usize, edits: &[LogitEdit]) -> Result<()>;

    /// Each row of `width` reduced as `wants` says (held to [`crate::pick::reduce_row`]).
    fn reduce_rows(
        &self,
        x: &Self::Act,
        width: usize,
        wants: &[RowReduction],
    ) -> Result<Vec<ReducedRow>>;
}

/// The host CPU: lantern-quant's kernels for products, the chunked passes of [`ops`],
/// and any [`AttentionBackend`] for attention.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cpu;

fn no_layer_norm() -> ModelError {
    ModelError::Compute("LayerNorm models (GPT-2, GPT-NeoX) do not run on this device".into())
}

fn no_experts() -> ModelError {
    ModelError::Compute("mixture-of-experts layers do not run on this device".into())
}

fn same_len(what: &str, a: usize, b: usize) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(ModelError::Compute(format!(
            "{what}: {a} values against {b}"
        )))
    }
}

fn whole_rows(what: &str, len: usize, width: usize) -> Result<()> {
    if width > 0 && len.is_multiple_of(width) {
        Ok(())
    } else {
        Err(ModelError::Compute(format!(
            "{what}: {len} values are not rows of {width}"
        )))
    }
}

impl Compute for Cpu {
    type Act = Vec<f32>;
    type Matrix = Linear;
    type Vector = Vec<f32>;
    type RopeTable = RopeTable;

    fn matrix(&self, options: &LoadOptions, name: &str, tensor: QTensor) -> Result<Linear> {
        Linear::load(options, name, tensor)
    }

    fn stacked_matrix(
        &self,
        options: &LoadOptions,
        name: &str,
        parts: Vec<QTensor>,
    ) -> Result<Linear> {
        Linear::load_stacked(options, name, parts)
    }

    fn vector(&self, values: Vec<f32>) -> Result<Vec<f32>> {
        Ok(values)
    }

    fn rope_table(&self, rope: &Rope, positions: &[usize]) -> Result<RopeTable> {
        Ok(rope.table(positions))
    }

    fn embed(&self, table: &Linear, ids: &[u32], scale: Option<f32>) -> Result<Vec<f32>> {
        let mut x = table.rows(ids)?;
        if let Some(s) = scale {
            ops::scale(&mut x, s);
        }
        Ok(x)
    }

    fn matmul_parts(
        &self,
        w: &Linear,
        x: &Vec<f32>,
        rows: usize,
        widths: &[usize],
    ) -> Result<Vec<Vec<f32>>> {
        w.forward_parts(x, rows, widths)
    }

    fn out_features(&self, w: &Linear) -> usize {
        w.out_features()
    }

    fn rms_norm(&self, x: &Vec<f32>, weight: &Vec<f32>, eps: f32) -> Result<Vec<f32>> {
        whole_rows("rms_norm", x.len(), weight.len())?;
        Ok(ops::rms_norm(x, weight, eps))
    }

    fn add_rms_norm(
        &self,
        x: &mut Vec<f32>,
        delta: &Vec<f32>,
        weight: &Vec<f32>,
        eps: f32,
    ) -> Result<Vec<f32>> {
        same_len("add_rms_norm", x.len(), delta.len())?;
        whole_rows("add_rms_norm", x.len(), weight.len())?;
        Ok(ops::add_rms_norm(x, delta, weight, eps))
    }

    fn add(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> Result<()> {
        same_len("add", acc.len(), x.len())?;
        ops::add_in_place(acc, x);
        Ok(())
    }

    fn add_bias(&self, x: &mut Vec<f32>, bias: &Vec<f32>) -> Result<()> {
        whole_rows("add_bias", x.len(), bias.len())?;
        for row in x.chunks_exact_mut(bias.len()) {
            ops::add_in_place(row, bias);
        }
        Ok(())
    }

    fn act_mul(&self, act: Activation, gate: &mut Vec<f32>, up: &Vec<f32>) -> Result<()> {
        same_len("act_mul", gate.len(), up.len())?;
        match act {
            Activation::Silu => ops::silu_mul(gate, up),
            Activation::GeluTanh => ops::gelu_tanh_mul(gate, up),
            Activation::GeluErf => {
                ops::gelu_erf(gate);
                ops::mul_in_place(gate, up);
            }
            Activation::Relu => {
                ops::relu(gate);
                ops::mul_in_place(gate, up);
            }
            Activation::SwigluOai => ops::swiglu_oai_mul(gate, up),
        }
        Ok(())
    }

    fn soft_cap(&self, x: &mut Vec<f32>, cap: f32) -> Result<()> {
        ops::soft_cap(x, cap);
        Ok(())
    }

    fn scale(&self, x: &mut Vec<f32>, factor: f32) -> Result<()> {
        ops::scale(x, factor);
        Ok(())
    }

    fn clamp(&self, x: &mut Vec<f32>, limit: f32) -> Result<()> {
        ops::clamp(x, limit);
        Ok(())
    }

    fn rope(
        &self,
        table: &RopeTable,
        x: &mut Vec<f32>,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        whole_rows("rope", x.len(), heads * head_dim)?;
        table.apply(x, heads, head_dim);
        Ok(())
    }

    fn rope_qk(
        &self,
        table: &RopeTable,
        (q, q_heads): (&mut Vec<f32>, usize),
        (k, k_heads): (&mut Vec<f32>, usize),
        head_dim: usize,
    ) -> Result<()> {
        whole_rows("rope_qk", q.len(), q_heads * head_dim)?;
        whole_rows("rope_qk", k.len(), k_heads * head_dim)?;
        same_len(
            "rope_qk (tokens)",
            q.len() / (q_heads * head_dim).max(1),
            k.len() / (k_heads * head_dim).max(1),
        )?;
        table.apply_qk((q, q_heads), (k, k_heads), head_dim);
        Ok(())
    }

    fn select_rows(&self, x: &Vec<f32>, rows: &[usize], width: usize) -> Result<Vec<f32>> {
        whole_rows("select_rows", x.len(), width)?;
        let available = x.len() / width;
        if let Some(&bad) = rows.iter().find(|&&r| r >= available) {
            return Err(ModelError::Compute(format!(
                "row {bad} of {available} selected"
            )));
        }
        let mut out = Vec::with_capacity(rows.len() * width);
        for &r in rows {
            out.extend_from_slice(&x[r * width..(r + 1) * width]);
        }
        Ok(out)
    }

    const RUNS_EXPERTS: bool = true;
    const RUNS_LAYER_NORM_MODELS: bool = true;

    fn layer_norm(
        &self,
        x: &Vec<f32>,
        weight: &Vec<f32>,
        bias: &Vec<f32>,
        eps: f32,
    ) -> Result<Vec<f32>> {
        whole_rows("layer_norm", x.len(), weight.len())?;
        same_len("layer_norm (bias)", bias.len(), weight.len())?;
        Ok(ops::layer_norm(x, weight, bias, eps))
    }

    fn activate(&self, act: Activation, x: &mut Vec<f32>) -> Result<()> {
        match act {
            Activation::Silu => ops::silu(x),
            Activation::GeluTanh => ops::gelu_tanh(x),
            Activation::GeluErf => ops::gelu_erf(x),
            Activation::Relu => ops::relu(x),
            Activation::SwigluOai => {
                return Err(ModelError::Compute(
                    "gpt-oss's SwiGLU needs a gate: it is not an un-gated activation".into(),
                ))
            }
        }
        Ok(())
    }

    fn zeros(&self, rows: usize, width: usize) -> Result<Vec<f32>> {
        let len = rows
            .checked_mul(width)
            .ok_or_else(|| ModelError::Compute(format!("{rows} rows of {width} overflow")))?;
        Ok(vec![0.0; len])
    }

    fn add_rows_scaled(
        &self,
        acc: &mut Vec<f32>,
        x: &Vec<f32>,
        rows: &[usize],
        weights: &[f32],
        width: usize,
    ) -> Result<()> {
        whole_rows("add_rows_scaled", acc.len(), width)?;
        same_len("add_rows_scaled (rows)", x.len(), rows.len() * width)?;
        same_len("add_rows_scaled (weights)", rows.len(), weights.len())?;
        let available = acc.len() / width;
        if let Some(&bad) = rows.iter().find(|&&r| r >= available) {
            return Err(ModelError::Compute(format!(
                "row {bad} of {available} added to"
            )));
        }
        for ((&r, &w), src) in rows.iter().zip(weights).zip(x.chunks_exact(width)) {
            for (a, &v) in acc[r * width..(r + 1) * width].iter_mut().zip(src) {
                *a += w * v;
            }
        }
        Ok(())
    }

    fn attention(
        &self,
        call: AttentionCall<'_, '_>,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
    ) -> Result<Vec<f32>> {
        let (spec, tokens) = (call.spec, call.tokens);
        let device = call.backend.device();
        let q = tensor3(q, [tokens, spec.num_heads, spec.head_dim], &device)?;
        let k = tensor3(k, [tokens, spec.num_kv_heads, spec.head_dim], &device)?;
        let v = tensor3(v, [tokens, spec.num_kv_heads, spec.head_dim], &device)?;
        let mut tap = call.tap.filter(|t| t.wants_layer(call.layer));
        // A tap may take some rows' probabilities from the flash backend as it runs them
        // (looked for only where a tap wants this layer).
        let kept = tap.as_mut().and_then(|tap| {
            let flash = call.backend.as_any()?.downcast_ref::<CpuFlashBackend>()?;
            Some((flash, tap.probability_rows(call.layer)?))
        });
        let out = match kept {
            Some((flash, mut probabilities)) => {
                let out = flash.forward_with_probabilities(
                    spec,
                    call.meta,
                    &q,
                    &k,
                    &v,
                    call.cache,
                    &mut probabilities,
                )?;
                if let Some(tap) = &mut tap {
                    tap.record_probabilities(call.layer, probabilities);
                }
                out
            }
            None => call
                .backend
                .forward(spec, call.meta, &q, &k, &v, call.cache)?,
        };
        if let Some(tap) = tap {
            // Requests whose rows a backend keeps on its device copy them from the
            // tensor it took; the others' are recorded on the host.
            if tap.keeps_on_device(call.layer) {
                tap.record_kept(call.layer, &q as &dyn std::any::Any)?;
            }
            tap.record(call.layer, RecordedRows::All, &q, Some(&out))?;
        }
        let values = share::copied(&host_f32(&out)?);
        Ok(values)
    }

    fn to_host(&self, x: Vec<f32>) -> Result<Vec<f32>> {
        Ok(x)
    }

    fn edit_logits(&self, x: &mut Vec<f32>, width: usize, edits: &[LogitEdit]) -> Result<()> {
        whole_rows("edit_logits", x.len(), width)?;
        apply_edits(x, width, edits);
        Ok(())
    }

    fn reduce_rows(
        &self,
        x: &Vec<f32>,
        width: usize,
        wants: &[RowReduction],
    ) -> Result<Vec<ReducedRow>> {
        whole_rows("reduce_rows", x.len(), width)?;
        same_len("reduce_rows: wants", wants.len(), x.len() / width)?;
        Ok(x.chunks_exact(width)
            .zip(wants)
            .map(|(row, want)| reduce_row(row, *want))
            .collect())
    }
}
