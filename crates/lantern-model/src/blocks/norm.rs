//! RMSNorm with a stored multiplier (Gemma's `1 + w` is stored as the sum, see
//! [`crate::source`]).

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
