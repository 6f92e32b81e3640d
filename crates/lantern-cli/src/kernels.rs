//! Which kernels run the products of each weight type of a model file.

use anyhow::{Context, Result};
use lantern_engine::device::{product_kernel, DeviceChoice};
use lantern_model::hf::HfDirectory;
use lantern_model::{GgmlDType, GgufFile, WeightSource};
use std::collections::BTreeMap;
use std::path::Path;

/// The matrices of one weight type and the kernels their products run on.
pub struct WeightKernels {
    /// GGUF type name (`Q4_1`, `Q6_K`, `F16`, ...).
    pub dtype: String,
    /// Matrices (2-D tensors, and each expert's of a stacked 3-D one) of this type in
    /// the file.
    pub matrices: usize,
    /// lantern's level for this type (a [`lantern_quant::Kernel::name`]), `candle`, or
    /// `candle-f32` when the weights are dequantized to f32 at load; on a GPU
    /// `cuda-gguf`, `cuda-bf16` or `cuda-f32` ([`lantern_engine::device::product_kernel`]).
    pub kernel: &'static str,
}

/// Per weight type of the model at `path` (a GGUF file, or a Hugging Face directory whose
/// matrices `quantize` converts at load), in type-name order, on `device`.
pub fn weight_kernels(
    path: &Path,
    f32_weights: bool,
    quantize: Option<GgmlDType>,
    device: DeviceChoice,
) -> Result<Vec<WeightKernels>> {
    let what = || format!("reading {}", path.display());
    let source: Box<dyn WeightSource> = if lantern_model::hf::is_hf_directory(path) {
        Box::new(HfDirectory::open(path, quantize).with_context(what)?)
    } else {
        Box::new(GgufFile::open(path).with_context(what)?)
    };
    let mut counts = BTreeMap::new();
    for name in source.tensor_names() {
        if let Some((dims, dtype)) = source.tensor_info(&name) {
            // A 3-D tensor is a mixture of experts' matrices, stacked.
            let matrices = match dims.len() {
                2 => 1,
                3 => dims[0],
                _ => continue,
            };
            counts.entry(type_name(dtype)).or_insert((0, dtype)).0 += matrices;
        }
    }
    Ok(counts
        .into_iter()
        .map(|(name, (matrices, dtype))| WeightKernels {
            dtype: name,
            matrices,
            kernel: product_kernel(device, dtype, f32_weights),
        })
        .collect())
}

/// The type's name as GGUF tools write it (candle writes the K-quants `Q4K`).
fn type_name(dtype: impl std::fmt::Debug) -> String {
    let name = format!("{dtype:?}");
    match name.strip_suffix('K') {
        Some(stem) if stem.starts_with('Q') && !stem.contains('_') => format!("{stem}_K"),
        _ => name,
    }
}

/// `Q4_1: avx512 (210 matrices), Q8_0: avx512 (1 matrix)`.
pub fn summary(kernels: &[WeightKernels]) -> String {
    kernels
        .iter()
        .map(|k| {
            let noun = if k.matrices == 1 {
                "matrix"
            } else {
                "matrices"
            };
            format!("{}: {} ({} {noun})", k.dtype, k.kernel, k.matrices)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_says_one_matrix_and_several_matrices() {
        let kernels = [("Q4_1", 210), ("Q8_0", 1)].map(|(dtype, matrices)| WeightKernels {
            dtype: dtype.to_string(),
            matrices,
            kernel: "avx512",
        });
        assert_eq!(
            summary(&kernels),
            "Q4_1: avx512 (210 matrices), Q8_0: avx512 (1 matrix)"
        );
    }
}
