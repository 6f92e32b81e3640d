//! RMSNorm with a stored multiplier (Gemma's `1 + w` is stored as the sum, see
//! [`crate::source`]), and LayerNorm with a bias (or without: Cohere's).

use super::Loader;
use crate::compute::Compute;
use crate::error::Result;

pub struct RmsNorm<C: Compute> {
    weight: C::Vector,
    eps: f32,
}

impl<C: Compute> RmsNorm<C> {
    pub fn load(c: &C, loader: &mut Loader, name: &str, len: usize, eps: f32) -> Result<Self> {
        Ok(Self {
            weight: c.vector(loader.vector(name, len)?)?,
            eps,
        })
    }

    /// Normalizes every row of the weight's length (a token, or one head of a token).
    pub fn forward(&self, c: &C, x: &C::Act) -> Result<C::Act> {
        c.rms_norm(x, &self.weight, self.eps)
    }

    /// `x += delta`, then [`Self::forward`] of `x`: a residual add and the norm after it.
    pub fn add_forward(&self, c: &C, x: &mut C::Act, delta: &C::Act) -> Result<C::Act> {
        c.add_rms_norm(x, delta, &self.weight, self.eps)
    }

    /// The weight and eps, for a product that normalizes its input as it reads it.
    pub fn parts(&self) -> (&C::Vector, f32) {
        (&self.weight, self.eps)
    }
}

/// A norm of either kind: RMSNorm (most decoders) or LayerNorm with a bias (GPT-2,
/// GPT-NeoX), read as `{base}.weight` (and `{base}.bias`).
pub enum Norm<C: Compute> {
    Rms(RmsNorm<C>),
    Layer {
        weight: C::Vector,
        bias: C::Vector,
        eps: f32,
    },
}

/// Which norm a decoder's layers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    Rms,
    Layer,
    /// LayerNorm with a weight only (Command R, Aya): a bias of zeros, which adds nothing.
    LayerWithoutBias,
    /// LayerNorm with neither weight nor bias (OLMo 1): no tensors; ones and zeros, which
    /// change nothing.
    LayerWithoutParams,
}

impl NormKind {
    /// A LayerNorm, with or without a bias.
    pub fn is_layer_norm(self) -> bool {
        self != Self::Rms
    }
}

impl<C: Compute> Norm<C> {
    pub fn load(
        c: &C,
        loader: &mut Loader,
        (base, kind): (&str, NormKind),
        len: usize,
        eps: f32,
    ) -> Result<Self> {
        let weight = format!("{base}.weight");
        Ok(match kind {
            NormKind::Rms => Self::Rms(RmsNorm::load(c, loader, &weight, len, eps)?),
            NormKind::Layer => Self::Layer {
                weight: c.vector(loader.vector(&weight, len)?)?,
                bias: c.vector(loader.vector(&format!("{base}.bias"), len)?)?,
                eps,
            },
            NormKind::LayerWithoutParams => Self::Layer {
                weight: c.vector(vec![1.0; len])?,
                bias: c.vector(vec![0.0; len])?,
                eps,
            },
            NormKind::LayerWithoutBias => Self::Layer {
                weight: c.vector(loader.vector(&weight, len)?)?,
                bias: c.vector(vec![0.0; len])?,
                eps,
            },
        })
    }

    pub fn forward(&self, c: &C, x: &C::Act) -> Result<C::Act> {
        match self {
            Self::Rms(norm) => norm.forward(c, x),
            Self::Layer { weight, bias, eps } => c.layer_norm(x, weight, bias, *eps),
        }
    }

    /// `x += delta`, then [`Self::forward`] of `x`.
    pub fn add_forward(&self, c: &C, x: &mut C::Act, delta: &C::Act) -> Result<C::Act> {
        match self {
            Self::Rms(norm) => norm.add_forward(c, x, delta),
            Self::Layer { .. } => {
                c.add(x, delta)?;
                self.forward(c, x)
            }
        }
    }

    /// The RMSNorm, for a product that normalizes as it reads (only RMSNorm folds).
    pub fn as_rms(&self) -> Option<&RmsNorm<C>> {
        match self {
            Self::Rms(norm) => Some(norm),
            Self::Layer { .. } => None,
        }
    }
}

/// What a block's first product reads: rows already normed, or the residual stream with
/// the norm the product applies as it reads it ([`Compute::folds_norms`]).
pub enum BlockInput<'a, C: Compute> {
    Normed(&'a C::Act),
    Residual(&'a C::Act, &'a RmsNorm<C>),
}

impl<C: Compute> BlockInput<'_, C> {
    /// The normed rows, computed into `slot` where the norm is still to apply (for a block
    /// whose products cannot take it).
    pub fn normed<'s>(&'s self, c: &C, slot: &'s mut Option<C::Act>) -> Result<&'s C::Act> {
        match self {
            Self::Normed(h) => Ok(h),
            Self::Residual(x, norm) => Ok(slot.insert(norm.forward(c, x)?)),
        }
    }
}
