//! Several matrices applied to the same input (q/k/v, gate/up), with optional biases.

use super::BlockInput;
use crate::compute::Compute;
use crate::error::{ModelError, Result};
use crate::LoadOptions;
use candle_core::quantized::QTensor;

/// Matrices applied to one input, each giving one output buffer. Neighbours of one type
/// are stacked into one product; real files mix types inside a layer (Q4_K_M: q, k in
/// Q4_K, v in Q6_K; Gemma: q, k in Q5_0, v in Q8_0), so a single stack is not always
/// possible. A fused tensor (Phi-3's `attn_qkv`) is one product split by widths.
pub struct Projections<C: Compute> {
    /// Each product and the output widths of the matrices it stacks.
    stacks: Vec<(C::Matrix, Vec<usize>)>,
    /// One optional bias per output, in order.
    biases: Vec<Option<C::Vector>>,
}

impl<C: Compute> Projections<C> {
    /// `parts`: each matrix with its tensor name (errors name the tensors involved).
    pub fn separate(c: &C, options: &LoadOptions, parts: Vec<(String, QTensor)>) -> Result<Self> {
        let mut runs: Vec<Vec<(String, QTensor)>> = Vec::new();
        for part in parts {
            match runs.last_mut() {
                Some(run) if run.last().is_some_and(|(_, t)| t.dtype() == part.1.dtype()) => {
                    run.push(part)
                }
                _ => runs.push(vec![part]),
            }
        }
        let stacks = runs
            .into_iter()
            .map(|run| {
                let widths: Vec<usize> = run.iter().map(|(_, t)| t.shape().dims()[0]).collect();
                let name = run
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(" + ");
                let mut tensors: Vec<QTensor> = run.into_iter().map(|(_, t)| t).collect();
                let product = match tensors.len() {
                    1 => c.matrix(options, &name, tensors.remove(0))?,
                    _ => c.stacked_matrix(options, &name, tensors)?,
                };
                Ok((product, widths))
            })
            .collect::<Result<Vec<_>>>()?;
        let outputs = stacks.iter().map(|(_, w)| w.len()).sum();
        Ok(Self {
            stacks,
            biases: (0..outputs).map(|_| None).collect(),
        })
    }

    /// One stored matrix whose rows are several outputs of `widths` rows each.
    pub fn fused(
        c: &C,
        options: &LoadOptions,
        name: &str,
        tensor: QTensor,
        widths: Vec<usize>,
    ) -> Result<Self> {
        let rows = tensor.shape().dims().first().copied().unwrap_or(0);
        let total: usize = widths.iter().sum();
        if rows != total {
            return Err(ModelError::BadShape {
                name: name.to_string(),
                actual: tensor.shape().dims().to_vec(),
                expected: vec![total, tensor.shape().dims().last().copied().unwrap_or(0)],
            });
        }
        let outputs = widths.len();
        Ok(Self {
            stacks: vec![(c.matrix(options, name, tensor)?, widths)],
            biases: (0..outputs).map(|_| None).collect(),
        })
    }

    /// Adds a bias to output `index` (its length must be that output's width).
    pub fn set_bias(&mut self, c: &C, index: usize, name: &str, bias: Vec<f32>) -> Result<()> {
        let width = self.widths().nth(index).ok_or_else(|| {
            ModelError::InvalidConfig(format!("bias `{name}` has no projection to add to"))
        })?;
        if bias.len() != width {
            return Err(ModelError::BadShape {
                name: name.to_string(),
                actual: vec![bias.len()],
                expected: vec![width],
            });
        }
        self.biases[index] = Some(c.vector(bias)?);
        Ok(())
    }

    fn widths(&self) -> impl Iterator<Item = usize> + '_ {
        self.stacks.iter().flat_map(|(_, w)| w.iter().copied())
    }

    /// `[rows, in]` → one `[rows, width]` buffer per matrix, in the order given.
    /// The one product of these projections and its output widths, when there is one
    /// product and no bias.
    pub fn single_product(&self) -> Option<(&C::Matrix, &[usize])> {
        match self.stacks.as_slice() {
            [(product, widths)] if self.biases.iter().all(Option::is_none) => {
                Some((product, widths))
            }
            _ => None,
        }
    }

    /// [`Self::forward`] of a block's input: one product normalizes the residual stream
    /// as it reads it; several read the norm computed once.
    pub fn forward_input(
        &self,
        c: &C,
        input: &BlockInput<'_, C>,
        rows: usize,
    ) -> Result<Vec<C::Act>> {
        if let (BlockInput::Residual(x, norm), [(product, widths)]) =
            (input, self.stacks.as_slice())
        {
            let mut outputs = c.normed_matmul_parts(product, (x, norm.parts()), rows, widths)?;
            self.add_biases(c, &mut outputs)?;
            return Ok(outputs);
        }
        let mut slot = None;
        self.forward(c, input.normed(c, &mut slot)?, rows)
    }

    pub fn forward(&self, c: &C, x: &C::Act, rows: usize) -> Result<Vec<C::Act>> {
        let mut outputs = Vec::with_capacity(self.biases.len());
        for (product, widths) in &self.stacks {
            outputs.extend(c.matmul_parts(product, x, rows, widths)?);
        }
        self.add_biases(c, &mut outputs)?;
        Ok(outputs)
    }

    fn add_biases(&self, c: &C, outputs: &mut [C::Act]) -> Result<()> {
        for (out, bias) in outputs.iter_mut().zip(&self.biases) {
            if let Some(bias) = bias {
                c.add_bias(out, bias)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compute::Cpu;
    use crate::linear::Linear;
    use candle_core::quantized::GgmlDType;
    use candle_core::{Device, Tensor};

    fn random(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
        // A small LCG: fresh, reproducible values in [-1, 1).
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        (0..rows * cols)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn matrix(rows: usize, cols: usize, dtype: GgmlDType, seed: u64) -> QTensor {
        let t = Tensor::from_vec(random(rows, cols, seed), (rows, cols), &Device::Cpu).unwrap();
        QTensor::quantize(&t, dtype).unwrap()
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
        a.iter()
            .zip(b)
            .map(|(x, y)| match (x - y).abs() / scale {
                // A NaN counts as the largest error (`f32::max` would drop it).
                e if e.is_nan() => f32::INFINITY,
                e => e,
            })
            .fold(0.0, f32::max)
    }

    /// Mixed types (two stacks) with biases give what each matrix's own product plus its
    /// bias gives.
    #[test]
    fn mixed_types_and_biases_equal_separate_products() {
        let (input, rows) = (64, 3);
        let types = [GgmlDType::Q8_0, GgmlDType::Q8_0, GgmlDType::F32];
        let widths = [64, 32, 32];
        let parts: Vec<(String, QTensor)> = types
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (&t, w))| (format!("m{i}"), matrix(w, input, t, i as u64)))
            .collect();
        let singles: Vec<Linear> = types
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(i, (&t, w))| Linear::new("single", matrix(w, input, t, i as u64)).unwrap())
            .collect();
        let options = LoadOptions::default();
        let mut p = Projections::separate(&Cpu, &options, parts).unwrap();
        assert_eq!(
            p.stacks.len(),
            2,
            "the Q8_0 pair stacks, the F32 one stands alone"
        );
        let biases: Vec<Vec<f32>> = widths
            .iter()
            .enumerate()
            .map(|(i, &w)| random(1, w, 10 + i as u64))
            .collect();
        for (i, b) in biases.iter().enumerate() {
            p.set_bias(&Cpu, i, "bias", b.clone()).unwrap();
        }
        let x = random(rows, input, 99);
        let outputs = p.forward(&Cpu, &x, rows).unwrap();
        for ((out, single), bias) in outputs.iter().zip(&singles).zip(&biases) {
            let mut expected = single.forward(&x, rows).unwrap();
            for row in expected.chunks_exact_mut(bias.len()) {
                crate::ops::add_in_place(row, bias);
            }
            assert!(max_rel(out, &expected) < 1e-6);
        }
        assert!(
            p.set_bias(&Cpu, 0, "bias", vec![0.0; 3]).is_err(),
            "wrong width"
        );
    }

    /// A fused matrix splits into the products of its row blocks.
    #[test]
    fn fused_rows_split_by_width() {
        let (input, rows) = (32, 2);
        let fused = random(48, input, 5);
        let tensor = |v: &[f32], r: usize| {
            QTensor::quantize(
                &Tensor::from_slice(v, (r, input), &Device::Cpu).unwrap(),
                GgmlDType::F32,
            )
            .unwrap()
        };
        let options = LoadOptions::default();
        let p = Projections::fused(&Cpu, &options, "f", tensor(&fused, 48), vec![16, 32]).unwrap();
        let x = random(rows, input, 6);
        let outputs = p.forward(&Cpu, &x, rows).unwrap();
        let first = Linear::new("a", tensor(&fused[..16 * input], 16)).unwrap();
        let second = Linear::new("b", tensor(&fused[16 * input..], 32)).unwrap();
        assert!(max_rel(&outputs[0], &first.forward(&x, rows).unwrap()) < 1e-6);
        assert!(max_rel(&outputs[1], &second.forward(&x, rows).unwrap()) < 1e-6);
        assert!(Projections::fused(&Cpu, &options, "f", tensor(&fused, 48), vec![16, 16]).is_err());
    }
}
