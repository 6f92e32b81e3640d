//! RMSNorm with a stored multiplier (Gemma's `1 + w` is stored as the sum, see
//! [`crate::source`]).

use super::Loader;
use crate::error::Result;
use crate::ops;

pub struct RmsNorm {
    weight: Vec<f32>,
    eps: f32,
}

impl RmsNorm {
    pub fn load(loader: &mut Loader, name: &str, len: usize, eps: f32) -> Result<Self> {
        Ok(Self {
            weight: loader.vector(name, len)?,
            eps,
        })
    }

    /// Normalizes every row of `weight.len()` values (a token, or one head of a token).
    pub fn forward(&self, x: &[f32]) -> Vec<f32> {
        ops::rms_norm(x, &self.weight, self.eps)
    }
}
