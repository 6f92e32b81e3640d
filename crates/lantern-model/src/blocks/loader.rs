//! Reading a model's tensors from a [`WeightSource`] with their expected shapes.

use crate::compute::Compute;
use crate::error::{ModelError, Result};
use crate::linear::tensor_to_vec;
use crate::source::WeightSource;
use crate::{LoadOptions, LoadProgress};
use candle_core::quantized::{QStorage, QTensor};
use candle_core::Device;
use std::borrow::Cow;

/// The source, the progress bar and the load options, for the blocks' `load` functions.
pub struct Loader<'a> {
    source: &'a mut dyn WeightSource,
    progress: &'a LoadProgress,
    pub options: &'a LoadOptions,
}

impl<'a> Loader<'a> {
    pub fn new(
        source: &'a mut dyn WeightSource,
        progress: &'a LoadProgress,
        options: &'a LoadOptions,
    ) -> Self {
        progress.start(source.tensor_names().len());
        Self {
            source,
            progress,
            options,
        }
    }

    pub fn has(&self, name: &str) -> bool {
        self.source.has_tensor(name)
    }

    /// A tensor's row-major shape, if the source has it.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.source.tensor_info(name).map(|(dims, _)| dims)
    }

    /// A tensor of the given row-major shape.
    pub fn tensor(&mut self, name: &str, shape: &[usize]) -> Result<QTensor> {
        let t = self.source.tensor_with_shape(name, shape);
        self.progress.advance();
        t
    }

    /// The `count` experts' `[rows, cols]` matrices of `base` (`blk.N.ffn_gate`, named
    /// `{base}.{e}` in errors), read from the stacked `{base}_exps.weight`
    /// (`[count, rows, cols]`, llama.cpp's layout) or, where there is none, from one
    /// tensor per expert, `{base}.{e}.weight` (older Mixtral files; Hugging Face
    /// checkpoints as [`crate::hf`] names them).
    pub fn experts(
        &mut self,
        base: &str,
        count: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Vec<(String, QTensor)>> {
        let stacked = format!("{base}_exps.weight");
        if !self.has(&stacked) {
            return (0..count)
                .map(|e| {
                    let name = format!("{base}.{e}.weight");
                    match self.tensor(&name, &[rows, cols]) {
                        Ok(t) => Ok((name, t)),
                        // Neither layout: name both (a checkpoint's own names stay).
                        Err(ModelError::MissingTensor { .. }) if e == 0 => {
                            Err(ModelError::MissingTensor {
                                name: format!("{stacked}` or `{name}"),
                            })
                        }
                        Err(other) => Err(other),
                    }
                })
                .collect();
        }
        let all = self.tensor(&stacked, &[count, rows, cols])?;
        let wrap = |source| ModelError::Tensor {
            name: stacked.clone(),
            source,
        };
        let dtype = all.dtype();
        let bytes = all.data().map_err(wrap)?;
        // Each expert's rows are whole blocks of the type (checked when the file was
        // read), so the experts are equal byte ranges.
        let per_expert = bytes.len() / count;
        (0..count)
            .map(|e| {
                let part = bytes[e * per_expert..(e + 1) * per_expert].to_vec();
                let storage =
                    QStorage::from_data(Cow::Owned(part), &Device::Cpu, dtype).map_err(wrap)?;
                let tensor = QTensor::new(storage, (rows, cols)).map_err(wrap)?;
                Ok((format!("{base}.{e}"), tensor))
            })
            .collect()
    }

    /// Each of the `count` experts' bias of `len` values for `base` (`blk.N.ffn_gate`),
    /// from the stacked `{base}_exps.bias` (`[count, len]`), if the source has it.
    pub fn expert_biases(
        &mut self,
        base: &str,
        count: usize,
        len: usize,
    ) -> Result<Option<Vec<Vec<f32>>>> {
        let name = format!("{base}_exps.bias");
        if !self.has(&name) {
            return Ok(None);
        }
        let values = tensor_to_vec(&name, &self.tensor(&name, &[count, len])?)?;
        if !values.iter().all(|v| v.is_finite()) {
            return Err(ModelError::InvalidConfig(format!(
                "tensor `{name}` holds values that are not finite"
            )));
        }
        Ok(Some(values.chunks(len).map(<[f32]>::to_vec).collect()))
    }

    /// A weight matrix `[out, in]` as a product on `c`.
    pub fn linear<C: Compute>(
        &mut self,
        c: &C,
        name: &str,
        out: usize,
        input: usize,
    ) -> Result<C::Matrix> {
        let t = self.tensor(name, &[out, input])?;
        c.matrix(self.options, name, t)
    }

    /// The matrix if the source has it.
    pub fn opt_linear<C: Compute>(
        &mut self,
        c: &C,
        name: &str,
        out: usize,
        input: usize,
    ) -> Result<Option<C::Matrix>> {
        if self.has(name) {
            self.linear(c, name, out, input).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A vector (norm weight, bias) of `len` finite values.
    pub fn vector(&mut self, name: &str, len: usize) -> Result<Vec<f32>> {
        let values = tensor_to_vec(name, &self.tensor(name, &[len])?)?;
        if values.iter().all(|v| v.is_finite()) {
            Ok(values)
        } else {
            Err(ModelError::InvalidConfig(format!(
                "tensor `{name}` holds values that are not finite"
            )))
        }
    }

    /// The vector if the source has it.
    pub fn opt_vector(&mut self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        if self.has(name) {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }

    pub fn finish(&self) {
        self.progress.finish();
    }
}
