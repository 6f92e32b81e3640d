//! Which kernels run the products of each weight type of a model file.

use anyhow::{Context, Result};
use lantern_model::{GgufFile, WeightSource};
use std::collections::BTreeMap;
use std::path::Path;

/// The matrices of one weight type and the kernels their products run on.
pub struct WeightKernels {
    /// GGUF type name (`Q4_1`, `Q6_K`, `F16`, ...).
    pub dtype: String,
    /// Matrices (2-D tensors) of this type in the file.
    pub matrices: usize,
    /// lantern's level (`avx512`, `avx-vnni`, `avx2`, `scalar`), `candle`, or `candle-f32` when the
    /// weights are dequantized to f32 at load.
    pub kernel: &'static str,
}

/// Per weight type of the GGUF file at `path`, in type-name order.
pub fn weight_kernels(path: &Path, f32_weights: bool) -> Result<Vec<WeightKernels>> {
    let file = GgufFile::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut counts = BTreeMap::new();
    for name in file.tensor_names() {
        if let Some((dims, dtype)) = file.tensor_info(&name) {
            if dims.len() == 2 {
                counts.entry(type_name(dtype)).or_insert((0, dtype)).0 += 1;
            }
        }
    }
    Ok(counts
        .into_iter()
        .map(|(name, (matrices, dtype))| WeightKernels {
            dtype: name,
            matrices,
            kernel: if f32_weights {
                "candle-f32"
            } else {
                lantern_model::linear::kernel_for(dtype)
            },
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

/// `Q4_1: avx512 (210 matrices), Q8_0: avx512 (1 matrices)`.
pub fn summary(kernels: &[WeightKernels]) -> String {
    kernels
        .iter()
        .map(|k| format!("{}: {} ({} matrices)", k.dtype, k.kernel, k.matrices))
        .collect::<Vec<_>>()
        .join(", ")
}
