//! The gated MLP, `down(act(gate(x)) * up(x))` with gate and up separate or fused, and
//! the plain one of GPT-2 and GPT-NeoX, `down(act(up(x) + b)) + b'`.

use super::{BlockInput, Loader, Projections};
use crate::compute::Compute;
use crate::error::{ModelError, Result};
#[cfg(test)]
use crate::ops;
use crate::LoadOptions;
use candle_core::quantized::QTensor;

/// The gate's activation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) * up`.
    Silu,
    /// PyTorch's `gelu(approximate="tanh")`: GeGLU (Gemma), GPT-2's `gelu_new`.
    GeluTanh,
    /// PyTorch's exact `gelu` (with the error function): GPT-NeoX.
    GeluErf,
    /// `max(x, 0)`: OPT.
    Relu,
    /// gpt-oss's SwiGLU: gate clamped above and up on both sides at 7, then
    /// `(up + 1) · gate · σ(1.702 · gate)` (gated MLPs only).
    SwigluOai,
}

impl Activation {
    #[cfg(test)]
    fn apply(self, gate: &[f32], up: &[f32]) -> Vec<f32> {
        let mut out = gate.to_vec();
        match self {
            Self::Silu => ops::silu_mul(&mut out, up),
            Self::GeluTanh => ops::gelu_tanh_mul(&mut out, up),
            Self::GeluErf => {
                ops::gelu_erf(&mut out);
                ops::mul_in_place(&mut out, up);
            }
            Self::Relu => {
                ops::relu(&mut out);
                ops::mul_in_place(&mut out, up);
            }
            Self::SwigluOai => ops::swiglu_oai_mul(&mut out, up),
        }
        out
    }
}

pub struct Mlp<C: Compute> {
    gate_up: Projections<C>,
    down: C::Matrix,
    /// The down projection's bias (gpt-oss's experts).
    down_bias: Option<C::Vector>,
    activation: Activation,
}

impl<C: Compute> Mlp<C> {
    /// Layer `l`'s `ffn_gate`/`ffn_up`/`ffn_down`; without `ffn_gate`, `ffn_up` holds gate
    /// and up stacked (`2 * ffn` rows, gate first: Phi-3).
    pub fn load(
        c: &C,
        loader: &mut Loader,
        l: usize,
        hidden: usize,
        ffn: usize,
        activation: Activation,
    ) -> Result<Self> {
        let name = |t: &str| format!("blk.{l}.{t}.weight");
        let read = |loader: &mut Loader, t: &str, shape: [usize; 2]| {
            loader
                .tensor(&name(t), &shape)
                .map(|tensor| (name(t), tensor))
        };
        if loader.has(&name("ffn_gate")) {
            let gate = read(loader, "ffn_gate", [ffn, hidden])?;
            let up = read(loader, "ffn_up", [ffn, hidden])?;
            let down = read(loader, "ffn_down", [hidden, ffn])?;
            Self::from_parts(c, loader.options, gate, up, down, activation)
        } else {
            let gate_up = read(loader, "ffn_up", [2 * ffn, hidden])?;
            let down = read(loader, "ffn_down", [hidden, ffn])?;
            Self::from_fused(c, loader.options, gate_up, ffn, down, activation)
        }
    }

    /// An MLP whose gate and up are one `[2 * ffn, hidden]` matrix, gate first.
    pub fn from_fused(
        c: &C,
        options: &LoadOptions,
        (gate_up_name, gate_up): (String, QTensor),
        ffn: usize,
        (down_name, down): (String, QTensor),
        activation: Activation,
    ) -> Result<Self> {
        Ok(Self {
            gate_up: Projections::fused(c, options, &gate_up_name, gate_up, vec![ffn, ffn])?,
            down: c.matrix(options, &down_name, down)?,
            down_bias: None,
            activation,
        })
    }

    /// An MLP of separate gate, up and down matrices (`(name, tensor)` each), as a
    /// mixture-of-experts layer's experts are.
    pub fn from_parts(
        c: &C,
        options: &LoadOptions,
        gate: (String, QTensor),
        up: (String, QTensor),
        (down_name, down): (String, QTensor),
        activation: Activation,
    ) -> Result<Self> {
        Ok(Self {
            gate_up: Projections::separate(c, options, vec![gate, up])?,
            down: c.matrix(options, &down_name, down)?,
            down_bias: None,
            activation,
        })
    }

    /// Biases of gate and up (added before the activation) and of down, each where given
    /// (`name`: the tensor named in errors).
    pub fn set_biases(
        &mut self,
        c: &C,
        name: &str,
        gate_up: Option<(Vec<f32>, Vec<f32>)>,
        down: Option<Vec<f32>>,
    ) -> Result<()> {
        if let Some((gate, up)) = gate_up {
            self.gate_up.set_bias(c, 0, name, gate)?;
            self.gate_up.set_bias(c, 1, name, up)?;
        }
        self.down_bias = down.map(|b| c.vector(b)).transpose()?;
        Ok(())
    }

    pub fn forward(&self, c: &C, x: &C::Act, tokens: usize) -> Result<C::Act> {
        let hidden = self.hidden(c, &BlockInput::Normed(x), tokens)?;
        let mut out = c.matmul(&self.down, &hidden, tokens)?;
        if let Some(b) = &self.down_bias {
            c.add_bias(&mut out, b)?;
        }
        Ok(out)
    }

    /// `residual += hidden · Wdownᵀ (+ b)`: the down projection of [`Self::hidden`]'s
    /// output added into the residual stream.
    pub fn add_down(
        &self,
        c: &C,
        hidden: &C::Act,
        tokens: usize,
        residual: &mut C::Act,
    ) -> Result<()> {
        match &self.down_bias {
            None => c.matmul_add(&self.down, hidden, tokens, residual),
            Some(b) => {
                let mut out = c.matmul(&self.down, hidden, tokens)?;
                c.add_bias(&mut out, b)?;
                c.add(residual, &out)
            }
        }
    }

    /// `act(gate(x)) * up(x)` from `input` (see [`BlockInput`]).
    pub fn hidden(&self, c: &C, input: &BlockInput<'_, C>, tokens: usize) -> Result<C::Act> {
        // Gate and up in one product: the activation can take them from its output.
        if let Some((w, &[gate, up])) = self.gate_up.single_product() {
            if gate == up {
                return match input {
                    BlockInput::Normed(x) => c.matmul_gated(w, x, tokens, gate, self.activation),
                    BlockInput::Residual(x, norm) => {
                        c.normed_matmul_gated(w, (x, norm.parts()), tokens, gate, self.activation)
                    }
                };
            }
        }
        let mut gate_up = self.gate_up.forward_input(c, input, tokens)?.into_iter();
        let (Some(mut gate), Some(up)) = (gate_up.next(), gate_up.next()) else {
            return Err(ModelError::Compute(
                "gate/up projections are incomplete".into(),
            ));
        };
        c.act_mul(self.activation, &mut gate, &up)?;
        Ok(gate)
    }
}

/// The un-gated MLP of GPT-2 and GPT-NeoX: `down(act(up(x) + b_up)) + b_down`, the
/// biases where the source has them (`ffn_up.bias`, `ffn_down.bias`).
pub struct PlainMlp<C: Compute> {
    up: C::Matrix,
    up_bias: Option<C::Vector>,
    down: C::Matrix,
    down_bias: Option<C::Vector>,
    activation: Activation,
}

impl<C: Compute> PlainMlp<C> {
    pub fn load(
        c: &C,
        loader: &mut Loader,
        l: usize,
        hidden: usize,
        ffn: usize,
        activation: Activation,
    ) -> Result<Self> {
        let name = |t: &str, kind: &str| format!("blk.{l}.{t}.{kind}");
        let mut bias = |t: &str, len: usize| {
            loader
                .opt_vector(&name(t, "bias"), len)?
                .map(|b| c.vector(b))
                .transpose()
        };
        let up_bias = bias("ffn_up", ffn)?;
        let down_bias = bias("ffn_down", hidden)?;
        Ok(Self {
            up: loader.linear(c, &name("ffn_up", "weight"), ffn, hidden)?,
            up_bias,
            down: loader.linear(c, &name("ffn_down", "weight"), hidden, ffn)?,
            down_bias,
            activation,
        })
    }

    pub fn forward(&self, c: &C, x: &C::Act, tokens: usize) -> Result<C::Act> {
        let mut hidden = c.matmul(&self.up, x, tokens)?;
        if let Some(b) = &self.up_bias {
            c.add_bias(&mut hidden, b)?;
        }
        c.activate(self.activation, &mut hidden)?;
        let mut out = c.matmul(&self.down, &hidden, tokens)?;
        if let Some(b) = &self.down_bias {
            c.add_bias(&mut out, b)?;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_tanh_matches_known_values() {
        // PyTorch: gelu(x, approximate="tanh") at 1.0 and -2.0.
        let out = Activation::GeluTanh.apply(&[1.0, -2.0, 0.0], &[1.0, 2.0, 5.0]);
        assert!((out[0] - 0.841_192).abs() < 1e-5, "{}", out[0]);
        assert!((out[1] - 2.0 * -0.045_402_3).abs() < 1e-5, "{}", out[1]);
        assert_eq!(out[2], 0.0);
    }

    #[test]
    fn gelu_erf_matches_known_values() {
        // PyTorch: gelu(x) at 1.0, -2.0 and 0.5 (exact, with erf).
        let relu = Activation::Relu.apply(&[1.5, -2.0, f32::NAN], &[2.0, 3.0, 1.0]);
        assert_eq!(relu[..2], [3.0, 0.0]);
        assert!(relu[2].is_nan(), "relu keeps NaN as PyTorch does");
        let out = Activation::GeluErf.apply(&[1.0, -2.0, 0.5], &[1.0, 2.0, 1.0]);
        assert!((out[0] - 0.841_344_7).abs() < 1e-6, "{}", out[0]);
        assert!((out[1] - 2.0 * -0.045_500_26).abs() < 1e-6, "{}", out[1]);
        assert!((out[2] - 0.345_731_1).abs() < 1e-6, "{}", out[2]);
    }

    #[test]
    fn swiglu_oai_matches_transformers_formula_and_clamps() {
        // transformers' GptOssExperts._apply_gate in f64, on values inside and beyond ±7.
        let reference = |g: f64, u: f64| {
            let g = g.min(7.0);
            let u = u.clamp(-7.0, 7.0);
            (u + 1.0) * g / (1.0 + (-1.702 * g).exp())
        };
        let mut state = 0x9e37_79b9_u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 11) as f64 / (1u64 << 53) as f64 * 24.0 - 12.0
        };
        let gate: Vec<f32> = (0..257).map(|_| next() as f32).collect();
        let up: Vec<f32> = (0..257).map(|_| next() as f32).collect();
        let clamped = gate.iter().chain(&up).filter(|v| v.abs() > 7.0).count();
        assert!(clamped > 50, "{clamped} values beyond the limit");
        let out = Activation::SwigluOai.apply(&gate, &up);
        for ((&o, &g), &u) in out.iter().zip(&gate).zip(&up) {
            let want = reference(g as f64, u as f64);
            assert!(
                (o as f64 - want).abs() <= 1e-5 * want.abs().max(1.0),
                "gate {g} up {u}: {o} vs {want}"
            );
        }
        let nan = Activation::SwigluOai.apply(&[f32::NAN], &[1.0]);
        assert!(nan[0].is_nan(), "NaN kept, as PyTorch's clamp keeps it");
    }

    #[test]
    fn silu_mul_matches_formula() {
        let out = Activation::Silu.apply(&[1.0, -2.0], &[3.0, 4.0]);
        let silu = |g: f32| g / (1.0 + (-g).exp());
        assert!((out[0] - silu(1.0) * 3.0).abs() < 1e-6);
        assert!((out[1] - silu(-2.0) * 4.0).abs() < 1e-6);
    }
}
