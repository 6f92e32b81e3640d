//! Matrix products against (quantized) weight matrices.

use crate::error::{ModelError, Result};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use lantern_quant::{PackedMatrix, QuantType};

/// A weight matrix `[out_features, in_features]` and the product `x · Wᵀ` against it.
pub struct Linear {
    name: String,
    out_features: usize,
    in_features: usize,
    dtype: GgmlDType,
    weight: Weight,
}

/// Where the product runs: lantern's repacked kernels (dispatched at run time to the
/// CPU's level) for the types they cover, candle's kernels for every other type.
enum Weight {
    Packed(PackedMatrix),
    Candle(QMatMul),
}

/// The lantern-quant type of a GGUF tensor type, where lantern's kernels take it.
pub fn packed_type(dtype: GgmlDType) -> Option<QuantType> {
    match dtype {
        GgmlDType::Q4_0 => Some(QuantType::Q4_0),
        GgmlDType::Q4_1 => Some(QuantType::Q4_1),
        GgmlDType::Q5_0 => Some(QuantType::Q5_0),
        GgmlDType::Q5_1 => Some(QuantType::Q5_1),
        GgmlDType::Q8_0 => Some(QuantType::Q8_0),
        GgmlDType::Q4K => Some(QuantType::Q4K),
        GgmlDType::Q5K => Some(QuantType::Q5K),
        GgmlDType::Q6K => Some(QuantType::Q6K),
        GgmlDType::Q3K => Some(QuantType::Q3K),
        GgmlDType::F16 => Some(QuantType::F16),
        GgmlDType::BF16 => Some(QuantType::BF16),
        GgmlDType::F32 => Some(QuantType::F32),
        _ => None,
    }
}

/// The kernels products over `dtype` weights run on: lantern's level in effect for that
/// type (`amx-bf16` or `avx512-bf16` for BF16 only, `amx` for the quantized types only,
/// `avx512`, `avx-vnni`, `avx2`, `scalar`) for the
/// types it repacks, else `candle`.
pub fn kernel_for(dtype: GgmlDType) -> &'static str {
    match packed_type(dtype) {
        Some(ty) => lantern_quant::active_kernel().for_type(ty).name(),
        None => "candle",
    }
}

impl Linear {
    /// `tensor` as a product, dequantized to f32 when `options` ask for it.
    pub fn load(options: &crate::LoadOptions, name: &str, tensor: QTensor) -> Result<Self> {
        Self::new(name, tensor)?.in_precision_of(options)
    }

    /// Several matrices of one type stacked into one product (see [`Self::stacked`]),
    /// dequantized to f32 when `options` ask for it.
    pub fn load_stacked(
        options: &crate::LoadOptions,
        name: &str,
        parts: Vec<QTensor>,
    ) -> Result<Self> {
        Self::stacked(name, parts)?.in_precision_of(options)
    }

    fn in_precision_of(self, options: &crate::LoadOptions) -> Result<Self> {
        if options.f32_weights {
            self.into_f32()
        } else {
            Ok(self)
        }
    }

    pub fn new(name: &str, tensor: QTensor) -> Result<Self> {
        let dims = tensor.shape().dims().to_vec();
        let [out_features, in_features] = dims[..] else {
            return Err(ModelError::BadShape {
                name: name.to_string(),
                actual: dims,
                expected: vec![0, 0],
            });
        };
        let dtype = tensor.dtype();
        let wrap = |source| ModelError::Tensor {
            name: name.to_string(),
            source,
        };
        let weight = match packed_type(dtype) {
            Some(ty) => {
                let bytes = tensor.data().map_err(wrap)?;
                let packed =
                    PackedMatrix::from_gguf_bytes(ty, &bytes, out_features, in_features)
                        .map_err(|e| ModelError::InvalidConfig(format!("tensor `{name}`: {e}")))?;
                Weight::Packed(packed)
            }
            None => Weight::Candle(QMatMul::from_qtensor(tensor).map_err(wrap)?),
        };
        Ok(Self {
            name: name.to_string(),
            out_features,
            in_features,
            dtype,
            weight,
        })
    }

    /// Stacks matrices that share `in_features` and a type into one, so that one product
    /// computes them all (q/k/v, gate/up): quantized rows are independent, so stacking the
    /// raw blocks of each matrix is exact.
    pub fn stacked(name: &str, parts: Vec<QTensor>) -> Result<Self> {
        let first = parts
            .first()
            .ok_or_else(|| ModelError::InvalidConfig(format!("nothing to stack for `{name}`")))?;
        let dtype = first.dtype();
        let in_features = first.shape().dims().last().copied().unwrap_or(0);
        let mut rows = 0;
        let mut bytes = Vec::new();
        for part in &parts {
            let dims = part.shape().dims();
            if part.dtype() != dtype || dims.len() != 2 || dims[1] != in_features {
                return Err(ModelError::InvalidConfig(format!(
                    "cannot stack `{name}`: parts differ in type or input size"
                )));
            }
            rows += dims[0];
            let data = part.data().map_err(|source| ModelError::Tensor {
                name: name.to_string(),
                source,
            })?;
            bytes.extend_from_slice(&data);
        }
        let tensor = qtensor_from_ggml(dtype, &bytes, vec![rows, in_features], &Device::Cpu)
            .map_err(|source| ModelError::Tensor {
                name: name.to_string(),
                source,
            })?;
        Self::new(name, tensor)
    }

    /// The same matrix dequantized to f32 (products then take activations unquantized).
    pub fn into_f32(self) -> Result<Self> {
        let wrap = |source| ModelError::Tensor {
            name: self.name.clone(),
            source,
        };
        let values = match &self.weight {
            Weight::Packed(p) if p.quant_type() == QuantType::F32 => return Ok(self),
            Weight::Packed(p) => {
                let mut values = vec![0f32; self.out_features * self.in_features];
                for (r, row) in values.chunks_exact_mut(self.in_features).enumerate() {
                    p.dequantize_row(r, row)
                        .map_err(|e| ModelError::Compute(format!("`{}`: {e}", self.name)))?;
                }
                values
            }
            Weight::Candle(w) => {
                let dense = match w {
                    QMatMul::QTensor(t) => t.dequantize(&Device::Cpu),
                    QMatMul::Tensor(t) => Ok(t.clone()),
                    QMatMul::TensorF16(t) => t.to_dtype(candle_core::DType::F32),
                };
                dense
                    .and_then(|t| t.flatten_all())
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(wrap)?
            }
        };
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        drop(values);
        let packed = PackedMatrix::from_gguf_bytes(
            QuantType::F32,
            &bytes,
            self.out_features,
            self.in_features,
        )
        .map_err(|e| ModelError::InvalidConfig(format!("tensor `{}`: {e}", self.name)))?;
        Ok(Self {
            dtype: GgmlDType::F32,
            weight: Weight::Packed(packed),
            ..self
        })
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn in_features(&self) -> usize {
        self.in_features
    }

    pub fn dtype(&self) -> GgmlDType {
        self.dtype
    }

    /// `x` is `[rows, in_features]` row-major; returns `[rows, out_features]`.
    pub fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let mut parts = self.forward_parts(x, rows, &[self.out_features])?;
        Ok(parts.pop().unwrap_or_default())
    }

    /// [`forward`](Self::forward) with the output rows split by `widths` (a stacked
    /// q/k/v or gate/up): one `[rows, width]` buffer each, filled directly where the
    /// kernels can.
    pub fn forward_parts(&self, x: &[f32], rows: usize, widths: &[usize]) -> Result<Vec<Vec<f32>>> {
        self.check_input(x, rows)?;
        let w = match &self.weight {
            Weight::Packed(p) => {
                return p
                    .matmul_parts(x, rows, widths)
                    .map_err(|e| ModelError::Compute(format!("`{}`: {e}", self.name)))
            }
            Weight::Candle(w) => w,
        };
        let whole = self.candle_forward(w, x, rows)?;
        let total: usize = widths.iter().sum();
        if total != self.out_features {
            return Err(ModelError::Compute(format!(
                "`{}`: output widths {widths:?} do not add up to its {} rows",
                self.name, self.out_features
            )));
        }
        Ok(lantern_quant::split_columns(&whole, widths))
    }

    fn check_input(&self, x: &[f32], rows: usize) -> Result<()> {
        if x.len() != rows * self.in_features {
            return Err(ModelError::Compute(format!(
                "`{}`: input has {} values, expected {} rows of {}",
                self.name,
                x.len(),
                rows,
                self.in_features
            )));
        }
        Ok(())
    }

    /// The product through candle (the types lantern-quant does not pack).
    fn candle_forward(&self, w: &QMatMul, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        let wrap = |source| ModelError::Tensor {
            name: self.name.clone(),
            source,
        };
        // candle's x86 kernels take their repacked path for Q6_K only when there is more
        // than one row, and the two paths round differently: a lone row goes in twice so
        // that a request decoding alone gets the bits it gets in a batch.
        let pad = rows == 1 && self.dtype == GgmlDType::Q6K && matches!(w, QMatMul::QTensor(_));
        let input = if pad {
            Tensor::from_iter(x.iter().chain(x).copied(), &Device::Cpu)
                .and_then(|t| t.reshape((2, self.in_features)))
        } else {
            Tensor::from_slice(x, (rows, self.in_features), &Device::Cpu)
        }
        .map_err(wrap)?;
        let output = w.forward(&input).map_err(wrap)?;
        let mut values = output
            .flatten_all()
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(wrap)?;
        values.truncate(rows * self.out_features);
        Ok(values)
    }

    /// Rows of the matrix selected by `ids`, dequantized (an embedding lookup).
    pub fn rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.out_features) {
            return Err(ModelError::Compute(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                self.out_features
            )));
        }
        let wrap = |source| ModelError::Tensor {
            name: self.name.clone(),
            source,
        };
        match &self.weight {
            Weight::Packed(p) => {
                let mut out = vec![0f32; ids.len() * self.in_features];
                for (&id, row) in ids.iter().zip(out.chunks_exact_mut(self.in_features)) {
                    p.dequantize_row(id as usize, row)
                        .map_err(|e| ModelError::Compute(format!("`{}`: {e}", self.name)))?;
                }
                Ok(out)
            }
            Weight::Candle(w) => {
                let ids = Tensor::from_slice(ids, ids.len(), &Device::Cpu).map_err(wrap)?;
                let rows = w.embedding(&ids).map_err(wrap)?;
                rows.flatten_all()
                    .and_then(|t| t.to_vec1::<f32>())
                    .map_err(wrap)
            }
        }
    }
}

/// Converts a small tensor (norm weights) to f32 values.
pub fn tensor_to_vec(name: &str, tensor: &QTensor) -> Result<Vec<f32>> {
    tensor
        .dequantize(&Device::Cpu)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f32>())
        .map_err(|source| ModelError::Tensor {
            name: name.to_string(),
            source,
        })
}
