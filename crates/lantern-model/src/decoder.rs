//! The decoder every architecture is: embeddings (optionally scaled, plus learned
//! positions where the model has them), layers of (norm) → attention → (post-norm) →
//! residual, (norm) → MLP → (post-norm) → residual (or both blocks beside each other on
//! one residual, GPT-NeoX), a final norm and the LM head with an optional final soft-cap.
//! An architecture is a [`DecoderSpec`] (see [`crate::archs`]).

use crate::blocks::{
    Activation, Attention, AttentionShape, BlockInput, Loader, Mlp, Moe, Norm, NormKind, PlainMlp,
    RmsNorm,
};
use crate::compute::{AttentionCall, Compute};
use crate::error::{ModelError, Result};
use crate::hparams::HParams;
use crate::linear::tensor_to_vec;
use crate::rope::{Rope, RopePairs, RopeScaling, LONG_FACTORS, SHORT_FACTORS};
use crate::source::WeightSource;
use crate::{
    CausalLm, ForwardBatch, LoadOptions, LoadProgress, LogitEdit, ModelInfo, RowPick, StepLogitRows,
};
use lantern_attn::{AttentionBackend, AttentionLayerSpec, AttentionTap, LayerKvCache};

/// What an architecture is, in terms of the shared blocks.
#[derive(Debug, Clone)]
pub struct DecoderSpec {
    pub params: HParams,
    /// RMSNorm, or LayerNorm with biases (GPT-2, GPT-NeoX).
    pub norm: NormKind,
    pub norm_eps: f32,
    /// Where the norms sit around each block.
    pub norm_placement: NormPlacement,
    /// Attention and MLP both read the layer's input and add to one residual
    /// (`x + attn(norm(x)) + mlp(norm'(x))`, GPT-NeoX's `use_parallel_residual`).
    pub parallel_residual: bool,
    /// How q/k rows store each head's rotary pairs.
    pub rope_pairs: RopePairs,
    pub activation: Activation,
    /// A gated MLP (`down(act(gate) * up)`); else `down(act(up))` with biases (GPT-2,
    /// GPT-NeoX).
    pub gated_mlp: bool,
    /// Per-head RMSNorm of q and k before RoPE.
    pub qk_norm: bool,
    /// Embeddings are multiplied by this (Gemma: `sqrt(hidden)`).
    pub embed_scale: Option<f32>,
    /// Multiplies `q . k`.
    pub attention_scale: f32,
    /// Multiplies each block's output before it joins the residual stream (Granite's
    /// `residual_multiplier`).
    pub residual_scale: Option<f32>,
    /// Multiplies the logits (Granite: `1 / logits_scaling`).
    pub logit_scale: Option<f32>,
    /// The name of the norm before the MLP (`blk.N.{this}.weight`): `ffn_norm`, except
    /// gpt-oss's `post_attention_norm` (as llama.cpp's converter names it).
    pub ffn_norm_tensor: &'static str,
    /// Mixture-of-experts layers (those with a router, `ffn_gate_inp`) divide the chosen
    /// experts' probabilities by their sum, unless the file says otherwise
    /// (`expert_weights_norm`).
    pub normalize_expert_weights: bool,
    /// Per layer: its window and RoPE.
    pub layers: Vec<LayerPlan>,
}

/// Where a layer's norms sit around its attention and feed-forward blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormPlacement {
    /// Before each block (Llama): `x + f(norm(x))`.
    Pre,
    /// Before and after each block (Gemma 2/3): `x + norm'(f(norm(x)))`.
    Sandwich,
    /// After each block only (OLMo 2): `x + norm(f(x))`.
    Post,
}

impl NormPlacement {
    fn before(self) -> bool {
        self != Self::Post
    }

    fn after(self) -> bool {
        self != Self::Pre
    }
}

/// How one layer differs from its neighbours.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerPlan {
    pub sliding_window: Option<usize>,
    pub rope_base: f32,
    /// Whether the file's RoPE scaling (`rope.scaling.*`, `rope_freqs.weight`) applies.
    pub rope_scaled: bool,
    /// Whether the layer rotates q and k at all (SmolLM3's NoPE layers do not).
    pub rotary: bool,
}

impl DecoderSpec {
    /// A plain pre-norm SwiGLU decoder (Llama) over `params`: every layer alike, sliding
    /// when the source gives a window, scale `query_pre_attn_scalar^-0.5` if given, else
    /// `head_dim^-0.5`.
    pub fn plain(params: HParams, rope_pairs: RopePairs) -> Self {
        let sliding = params.sliding(|_| true);
        let layers = sliding
            .iter()
            .map(|&s| LayerPlan {
                sliding_window: params.window().filter(|_| s),
                rope_base: params.rope_theta,
                rope_scaled: true,
                rotary: true,
            })
            .collect();
        let scalar = params
            .query_pre_attn_scalar
            .unwrap_or(params.head_dim as f32);
        Self {
            norm: NormKind::Rms,
            norm_eps: params.rms_norm_eps.unwrap_or(1e-5),
            norm_placement: NormPlacement::Pre,
            parallel_residual: false,
            rope_pairs,
            activation: Activation::Silu,
            gated_mlp: true,
            qk_norm: false,
            embed_scale: None,
            attention_scale: scalar.powf(-0.5),
            residual_scale: None,
            logit_scale: None,
            normalize_expert_weights: true,
            ffn_norm_tensor: "ffn_norm",
            layers,
            params,
        }
    }

    /// Each layer's attention, with its sinks (gpt-oss's `attn_sinks`) where it has them.
    fn attention_specs(&self, sinks: Vec<Option<Vec<f32>>>) -> Vec<AttentionLayerSpec> {
        let p = &self.params;
        self.layers
            .iter()
            .zip(sinks)
            .map(|(plan, sinks)| AttentionLayerSpec {
                num_heads: p.num_heads,
                num_kv_heads: p.num_kv_heads,
                head_dim: p.head_dim,
                scale: self.attention_scale,
                sliding_window: plan.sliding_window,
                chunk_size: None,
                logits_soft_cap: p.attn_logit_softcap,
                sinks,
            })
            .collect()
    }
}

struct Layer<C: Compute> {
    attn_norm: Option<Norm<C>>,
    attention: Attention<C>,
    post_attention_norm: Option<Norm<C>>,
    ffn_norm: Option<Norm<C>>,
    ffn: Ffn<C>,
    post_ffn_norm: Option<Norm<C>>,
}

/// A layer's feed-forward block.
enum Ffn<C: Compute> {
    Dense(Mlp<C>),
    Plain(PlainMlp<C>),
    Experts(Moe<C>),
}

impl<C: Compute> Ffn<C> {
    /// Layer `l`'s block: a mixture of experts where the layer has a router
    /// (`ffn_gate_inp`), else the dense MLP (models may mix them: Qwen3-MoE's
    /// `mlp_only_layers`).
    fn load(c: &C, loader: &mut Loader, spec: &DecoderSpec, l: usize) -> Result<Self> {
        let p = &spec.params;
        let (h, ffn, act) = (p.hidden_size, p.intermediate_size, spec.activation);
        if !loader.has(&format!("blk.{l}.ffn_gate_inp.weight")) {
            return Ok(match spec.gated_mlp {
                true => Self::Dense(Mlp::load(c, loader, l, h, ffn, act)?),
                false => Self::Plain(PlainMlp::load(c, loader, l, h, ffn, act)?),
            });
        }
        let Some(experts) = p.experts else {
            return Err(ModelError::InvalidConfig(format!(
                "layer {l} has an expert router (`blk.{l}.ffn_gate_inp.weight`) but \
                 `{}.expert_count` is not given",
                p.architecture
            )));
        };
        if !C::RUNS_EXPERTS {
            return Err(ModelError::InvalidConfig(
                "mixture-of-experts models run on the CPU only for now".into(),
            ));
        }
        let normalize = experts
            .normalize_weights
            .unwrap_or(spec.normalize_expert_weights);
        let moe = Moe::load(c, loader, l, h, experts, normalize, spec.activation)?;
        Ok(Self::Experts(moe))
    }

    fn forward(&self, c: &C, x: &C::Act, tokens: usize) -> Result<C::Act> {
        match self {
            Self::Dense(mlp) => mlp.forward(c, x, tokens),
            Self::Plain(mlp) => mlp.forward(c, x, tokens),
            Self::Experts(moe) => moe.forward(c, x, tokens),
        }
    }
}

/// A decoder whose blocks run on `C` (the host CPU unless a device crate says otherwise).
pub struct Decoder<C: Compute> {
    compute: C,
    info: ModelInfo,
    token_embd: C::Matrix,
    embed_scale: Option<f32>,
    /// Learned absolute position embeddings (GPT-2), added to the tokens'.
    position_embd: Option<C::Matrix>,
    parallel_residual: bool,
    layers: Vec<Layer<C>>,
    output_norm: Norm<C>,
    /// `None` when the output projection is tied to the token embeddings.
    output: Option<C::Matrix>,
    /// The LM head's bias (Phi-2).
    output_bias: Option<C::Vector>,
    residual_scale: Option<f32>,
    logit_scale: Option<f32>,
    final_soft_cap: Option<f32>,
    /// The distinct rotary embeddings, and which one each layer uses.
    ropes: Vec<Rope>,
    layer_rope: Vec<usize>,
}

impl<C: Compute> Decoder<C> {
    /// Reads the weights `spec` names from `source` onto `compute`.
    pub fn load(
        compute: C,
        source: &mut dyn WeightSource,
        spec: DecoderSpec,
        progress: &LoadProgress,
        options: &LoadOptions,
    ) -> Result<Self> {
        let p = &spec.params;
        let (h, eps) = (p.hidden_size, spec.norm_eps);
        let c = &compute;
        if spec.norm.is_layer_norm() && !C::RUNS_LAYER_NORM_MODELS {
            return Err(ModelError::InvalidConfig(format!(
                "{} models (LayerNorm, un-gated MLPs) do not run on this device yet",
                p.architecture
            )));
        }
        let mut loader = Loader::new(source, progress, options);
        let token_embd = loader.linear(c, "token_embd.weight", p.vocab_size, h)?;
        let position_embd = match loader.shape("position_embd.weight") {
            Some(dims) => {
                let rows = dims.first().copied().unwrap_or(0);
                if rows < p.context_length {
                    return Err(ModelError::InvalidConfig(format!(
                        "`position_embd.weight` has {rows} positions for a context of {}",
                        p.context_length
                    )));
                }
                Some(loader.linear(c, "position_embd.weight", rows, h)?)
            }
            None => None,
        };
        let shape = AttentionShape {
            hidden: h,
            num_heads: p.num_heads,
            num_kv_heads: p.num_kv_heads,
            head_dim: p.head_dim,
            clamp: p.clamp_kqv,
        };
        let mut layers = Vec::with_capacity(p.num_layers);
        let mut sinks = Vec::with_capacity(p.num_layers);
        for l in 0..p.num_layers {
            let norm = |loader: &mut Loader, t: &str, present: bool| {
                let base = format!("blk.{l}.{t}");
                present
                    .then(|| Norm::load(c, loader, (&base, spec.norm), h, eps))
                    .transpose()
            };
            let (before, after) = (spec.norm_placement.before(), spec.norm_placement.after());
            // Side by side, one norm may feed both blocks (GPT-J, Phi-2).
            let ffn_norm_tensor = spec.ffn_norm_tensor;
            let ffn_norm = before
                && (!spec.parallel_residual
                    || loader.has(&format!("blk.{l}.{ffn_norm_tensor}.weight")));
            let qk_norm_eps = spec.qk_norm.then_some(eps);
            sinks.push(loader.opt_vector(&format!("blk.{l}.attn_sinks.weight"), p.num_heads)?);
            layers.push(Layer {
                attn_norm: norm(&mut loader, "attn_norm", before)?,
                attention: Attention::load(c, &mut loader, l, shape, qk_norm_eps)?,
                post_attention_norm: norm(&mut loader, "post_attention_norm", after)?,
                ffn_norm: norm(&mut loader, ffn_norm_tensor, ffn_norm)?,
                ffn: Ffn::load(c, &mut loader, &spec, l)?,
                post_ffn_norm: norm(&mut loader, "post_ffw_norm", after)?,
            });
        }
        let output_norm = Norm::load(c, &mut loader, ("output_norm", spec.norm), h, eps)?;
        let output = loader.opt_linear(c, "output.weight", p.vocab_size, h)?;
        let output_bias = loader
            .opt_vector("output.bias", p.vocab_size)?
            .map(|b| c.vector(b))
            .transpose()?;
        let freq_factors = match p.rope_scaling {
            RopeScaling::LongRope {
                original_context, ..
            } => Some(long_rope_factors(
                &mut loader,
                p,
                options.context_length.unwrap_or(p.context_length),
                original_context,
            )?),
            _ if loader.has("rope_freqs.weight") => {
                let t = loader.tensor("rope_freqs.weight", &[p.rope_dim / 2])?;
                Some(tensor_to_vec("rope_freqs.weight", &t)?)
            }
            _ => None,
        };
        loader.finish();
        let mut ropes: Vec<Rope> = Vec::new();
        let mut layer_rope = Vec::with_capacity(p.num_layers);
        for plan in &spec.layers {
            // A layer without RoPE turns no dimensions.
            let rope_dim = if plan.rotary { p.rope_dim } else { 0 };
            let rope = if plan.rope_scaled {
                Rope::new(
                    rope_dim,
                    plan.rope_base,
                    spec.rope_pairs,
                    freq_factors.as_deref(),
                    &p.rope_scaling,
                )
            } else {
                Rope::new(
                    rope_dim,
                    plan.rope_base,
                    spec.rope_pairs,
                    None,
                    &RopeScaling::None,
                )
            };
            let index = match ropes.iter().position(|r| *r == rope) {
                Some(i) => i,
                None => {
                    ropes.push(rope);
                    ropes.len() - 1
                }
            };
            layer_rope.push(index);
        }
        let info = ModelInfo {
            architecture: p.architecture.clone(),
            name: p.name.clone(),
            num_layers: p.num_layers,
            hidden_size: h,
            vocab_size: p.vocab_size,
            context_length: p.context_length,
            attention: spec.attention_specs(sinks),
        };
        Ok(Self {
            compute,
            info,
            token_embd,
            embed_scale: spec.embed_scale,
            position_embd,
            parallel_residual: spec.parallel_residual,
            layers,
            output_norm,
            output,
            output_bias,
            residual_scale: spec.residual_scale,
            logit_scale: spec.logit_scale,
            final_soft_cap: p.final_logit_softcap,
            ropes,
            layer_rope,
        })
    }
}

impl<C: Compute> Layer<C> {
    /// The pre-norms (RMSNorm) and dense gated MLP of a Llama-shaped layer, whose norms a
    /// device can fold into the blocks' products; `None` for any other layer.
    fn foldable(&self) -> Option<(&RmsNorm<C>, &RmsNorm<C>, &Mlp<C>)> {
        if self.post_attention_norm.is_some() || self.post_ffn_norm.is_some() {
            return None;
        }
        let attn_norm = self.attn_norm.as_ref()?.as_rms()?;
        let ffn_norm = self.ffn_norm.as_ref()?.as_rms()?;
        match &self.ffn {
            Ffn::Dense(mlp) => Some((attn_norm, ffn_norm, mlp)),
            _ => None,
        }
    }
}

impl<C: Compute> Decoder<C> {
    /// A block's output scaled as it joins the residual stream, where the model says so.
    fn scale_residual(&self, c: &C, delta: &mut C::Act) -> Result<()> {
        match self.residual_scale {
            Some(s) => c.scale(delta, s),
            None => Ok(()),
        }
    }

    /// The logits of `batch.logits_rows`, where the blocks run.
    fn logits(
        &self,
        batch: &ForwardBatch,
        backend: &dyn AttentionBackend,
        caches: &mut [Box<dyn LayerKvCache>],
        mut tap: Option<&mut dyn AttentionTap>,
    ) -> Result<C::Act> {
        batch.validate(&self.info, caches.len())?;
        let c = &self.compute;
        // Whatever a failed step left on the device for its tap is dropped.
        c.finish_layers(None)?;
        let tokens = batch.token_ids.len();
        let tables = self
            .ropes
            .iter()
            .map(|r| c.rope_table(r, batch.positions))
            .collect::<Result<Vec<_>>>()?;
        let mut x = c.embed(&self.token_embd, batch.token_ids, self.embed_scale)?;
        if let Some(table) = &self.position_embd {
            let positions = batch
                .positions
                .iter()
                .map(|&p| u32::try_from(p))
                .collect::<std::result::Result<Vec<u32>, _>>()
                .map_err(|_| ModelError::Compute("a position past u32".into()))?;
            c.add(&mut x, &c.embed(table, &positions, None)?)?;
        }
        // Each block's output waits to be added to `x` by the next norm, which adds and
        // normalizes in one pass where the device fuses them; where it folds norms into
        // products (a decode step on a GPU), the products read and add to `x` instead.
        let mut pending: Option<C::Act> = None;
        let folds =
            c.folds_norms(tokens) && !self.parallel_residual && self.residual_scale.is_none();
        for (l, layer) in self.layers.iter().enumerate() {
            let call = AttentionCall {
                layer: l,
                tokens,
                spec: &self.info.attention[l],
                meta: &batch.attention[batch.layer_group[l]],
                backend,
                cache: caches[l].as_mut(),
                tap: tap.as_deref_mut(),
            };
            let rope = &tables[self.layer_rope[l]];
            if let (true, Some((attn_norm, ffn_norm, mlp))) = (folds, layer.foldable()) {
                // The device normalizes as the blocks' first products read the residual
                // stream, and their last products add into it: no launch of their own.
                if let Some(delta) = pending.take() {
                    c.add(&mut x, &delta)?;
                }
                let input = BlockInput::Residual(&x, attn_norm);
                let o = layer.attention.attend(c, &input, rope, call)?;
                layer.attention.add_output(c, &o, tokens, &mut x)?;
                let input = BlockInput::Residual(&x, ffn_norm);
                let m = mlp.hidden(c, &input, tokens)?;
                mlp.add_down(c, &m, tokens, &mut x)?;
                continue;
            }
            let normed;
            let h = match (&layer.attn_norm, pending.take()) {
                (Some(norm), Some(delta)) => {
                    normed = norm.add_forward(c, &mut x, &delta)?;
                    &normed
                }
                (Some(norm), None) => {
                    normed = norm.forward(c, &x)?;
                    &normed
                }
                (None, delta) => {
                    if let Some(delta) = delta {
                        c.add(&mut x, &delta)?;
                    }
                    &x
                }
            };
            let o = layer.attention.forward(c, h, rope, call)?;
            let mut o = match &layer.post_attention_norm {
                Some(norm) => norm.forward(c, &o)?,
                None => o,
            };
            let m = if self.parallel_residual {
                // The MLP reads the layer's input too (through its own norm, or the
                // attention's where the layer has one norm); both outputs join the residual.
                let m = match &layer.ffn_norm {
                    Some(norm) => layer.ffn.forward(c, &norm.forward(c, &x)?, tokens)?,
                    None => layer.ffn.forward(c, h, tokens)?,
                };
                c.add(&mut o, &m)?;
                o
            } else {
                self.scale_residual(c, &mut o)?;
                let normed;
                let h = match &layer.ffn_norm {
                    Some(norm) => {
                        normed = norm.add_forward(c, &mut x, &o)?;
                        &normed
                    }
                    None => {
                        c.add(&mut x, &o)?;
                        &x
                    }
                };
                layer.ffn.forward(c, h, tokens)?
            };
            let mut delta = match &layer.post_ffn_norm {
                Some(norm) => norm.forward(c, &m)?,
                None => m,
            };
            // Side by side, `delta` holds both blocks' outputs.
            self.scale_residual(c, &mut delta)?;
            pending = Some(delta);
        }
        if let Some(delta) = pending {
            c.add(&mut x, &delta)?;
        }
        // Decode steps want every row: no copy of the hidden states then.
        let selected = if every_row(batch.logits_rows, batch.token_ids.len()) {
            x
        } else {
            c.select_rows(&x, batch.logits_rows, self.info.hidden_size)?
        };
        let output = self.output.as_ref().unwrap_or(&self.token_embd);
        let rows = batch.logits_rows.len();
        let folded_norm = self.output_norm.as_rms().filter(|_| c.folds_norms(rows));
        let mut logits = if let Some(norm) = folded_norm {
            let widths = [c.out_features(output)];
            let input = (&selected, norm.parts());
            let mut logits = c.normed_matmul_parts(output, input, rows, &widths)?;
            logits
                .pop()
                .ok_or_else(|| ModelError::Compute("the LM head gave no output".into()))?
        } else {
            let normed = self.output_norm.forward(c, &selected)?;
            c.matmul(output, &normed, rows)?
        };
        if let Some(bias) = &self.output_bias {
            c.add_bias(&mut logits, bias)?;
        }
        if let Some(scale) = self.logit_scale {
            c.scale(&mut logits, scale)?;
        }
        if let Some(cap) = self.final_soft_cap {
            c.soft_cap(&mut logits, cap)?;
        }
        c.finish_layers(tap)?;
        Ok(logits)
    }
}

impl<C: Compute> CausalLm for Decoder<C> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn forward(
        &self,
        batch: &ForwardBatch,
        backend: &dyn AttentionBackend,
        caches: &mut [Box<dyn LayerKvCache>],
        tap: Option<&mut dyn AttentionTap>,
    ) -> Result<Vec<f32>> {
        let logits = self.logits(batch, backend, caches, tap)?;
        self.compute.to_host(logits)
    }

    fn picks_on_device(&self) -> bool {
        C::PICKS_ON_DEVICE
    }

    /// Reduced rows go through [`Compute::edit_logits`] and [`Compute::reduce_rows`] where
    /// the logits are; only the other rows (and what the reduced rows give) are copied to
    /// the host.
    fn forward_picking(
        &self,
        batch: &ForwardBatch,
        backend: &dyn AttentionBackend,
        caches: &mut [Box<dyn LayerKvCache>],
        tap: Option<&mut dyn AttentionTap>,
        pick: &[RowPick],
        edits: &[LogitEdit],
    ) -> Result<StepLogitRows> {
        if pick.len() != batch.logits_rows.len() {
            return Err(crate::ModelError::Compute(format!(
                "{} picks for {} logits rows",
                pick.len(),
                batch.logits_rows.len()
            )));
        }
        let c = &self.compute;
        let vocab = self.info.vocab_size;
        // Whole rows are the caller's to edit: an edit may name a reduced row or none
        // (a graph step's padding).
        if let Some(e) = edits
            .iter()
            .find(|e| pick.get(e.row as usize) == Some(&RowPick::Whole))
        {
            return Err(crate::ModelError::Compute(format!(
                "an edit of logits row {}, which is wanted whole",
                e.row
            )));
        }
        let mut logits = self.logits(batch, backend, caches, tap)?;
        let mut wants = Vec::new();
        let mut reduced_rows = Vec::new();
        let mut whole_rows = Vec::new();
        for (row, p) in pick.iter().enumerate() {
            match p {
                RowPick::Reduced(want) => {
                    wants.push(*want);
                    reduced_rows.push(row);
                }
                RowPick::Whole => whole_rows.push(row),
            }
        }
        if reduced_rows.is_empty() {
            return Ok(StepLogitRows::all(c.to_host(logits)?));
        }
        if !edits.is_empty() {
            c.edit_logits(&mut logits, vocab, edits)?;
        }
        let mut reduced = if whole_rows.is_empty() {
            // Every row reduced (a batch of greedy or sampled requests): no copy of the
            // logits.
            c.reduce_rows(&logits, vocab, &wants)?
        } else {
            let selected = c.select_rows(&logits, &reduced_rows, vocab)?;
            c.reduce_rows(&selected, vocab, &wants)?
        }
        .into_iter();
        let whole = if whole_rows.is_empty() {
            Vec::new()
        } else {
            c.to_host(c.select_rows(&logits, &whole_rows, vocab)?)?
        };
        let picked = pick
            .iter()
            .map(|p| if p.is_picked() { reduced.next() } else { None })
            .collect();
        Ok(StepLogitRows {
            logits: whole,
            picked,
        })
    }
}

/// LongRoPE's divisors for a model served with `context` tokens: the long set beyond the
/// original context, else the short one (llama.cpp's choice; transformers instead switches
/// per forward by the sequence's length, which a cache of already-rotated keys cannot
/// follow). Both sets are read, so a file missing either is refused whatever the context.
fn long_rope_factors(
    loader: &mut Loader,
    p: &HParams,
    context: usize,
    original_context: usize,
) -> Result<Vec<f32>> {
    let mut read = |name: &str| -> Result<Vec<f32>> {
        if !loader.has(name) {
            return Err(ModelError::MissingTensor { name: name.into() });
        }
        let t = loader.tensor(name, &[p.rope_dim / 2])?;
        let factors = tensor_to_vec(name, &t)?;
        // Divisors of the frequencies: a zero or a NaN would rotate by infinities.
        match factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
            Some(bad) => Err(ModelError::InvalidConfig(format!(
                "tensor `{name}` holds {bad}; LongRoPE's factors must be positive"
            ))),
            None => Ok(factors),
        }
    };
    let (long, short) = (read(LONG_FACTORS)?, read(SHORT_FACTORS)?);
    let use_long = context > original_context;
    tracing::info!(
        context,
        original_context,
        "LongRoPE: the {} factors",
        if use_long { "long" } else { "short" }
    );
    Ok(if use_long { long } else { short })
}

/// Whether `rows` are `0..total` in order (the selection would copy everything).
fn every_row(rows: &[usize], total: usize) -> bool {
    rows.len() == total && rows.iter().enumerate().all(|(i, &r)| i == r)
}
