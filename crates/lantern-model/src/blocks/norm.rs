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
}
