//! The products of a step's activations with the model's matrices: the small-product
//! kernels (gemv.rs) for a few rows of bf16 or GGUF-quantized weights, with a norm and a
//! residual add folded in where the decoder asks
//! ([`lantern_model::compute::Compute::folds_norms`]); cuBLAS otherwise, from a bf16 copy
//! of the activations for bf16 weights and for GGUF weights, whose rows it reads
//! dequantized to bf16 for the product.

use cudarc::driver::CudaSlice;
use half::bf16;
use lantern_model::blocks::Activation as ModelActivation;
use lantern_model::{ModelError, Result};

use super::{activation, model_error, CudaCompute, GpuAct, GpuMatrix, Weight};
use crate::blocks::DeviceBlocks;
use crate::fused::MAX_SPLIT_PARTS;
use crate::gemv::{gemv_fits, GemvExtras, GemvWeights, GEMV_MAX_PARTS};
use crate::pool::Pooled;

/// A product's bf16 input: the activation's own copy, or a cast made for the product.
enum Bf16Input<'a> {
    Copy(&'a Pooled<bf16>),
    Cast(Pooled<bf16>),
}

impl std::ops::Deref for Bf16Input<'_> {
    type Target = Pooled<bf16>;

    fn deref(&self) -> &Pooled<bf16> {
        match self {
            Self::Copy(h) => h,
            Self::Cast(h) => h,
        }
    }
}

impl CudaCompute {
    /// What `w`'s cuBLAS product reads besides `x`: its bf16 copy for bf16 and GGUF
    /// weights.
    fn product_input<'a>(&self, w: &GpuMatrix, x: &'a GpuAct) -> Result<Option<Bf16Input<'a>>> {
        match &w.weight {
            Weight::Bf16(_) | Weight::Blocks(_) => Ok(Some(self.bf16_input(x)?)),
            Weight::F32(_) => Ok(None),
        }
    }

    /// `x` as a product's bf16 input: its copy when it has one, else a cast.
    fn bf16_input<'a>(&self, x: &'a GpuAct) -> Result<Bf16Input<'a>> {
        if let Some(h) = &x.bf16 {
            return Ok(Bf16Input::Copy(h));
        }
        let mut h = self.halves.output(x.len()).map_err(model_error)?;
        self.gpu
            .cast_f32_to_bf16(&**x, &mut *h)
            .map_err(model_error)?;
        Ok(Bf16Input::Cast(h))
    }

    /// `y = x · Wᵀ` for the rows `out_rows` of W (`n` of them).
    fn product(
        &self,
        w: &GpuMatrix,
        x: &GpuAct,
        x_bf16: Option<&Pooled<bf16>>,
        rows: usize,
        out_rows: std::ops::Range<usize>,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let (k, n) = (w.in_features, out_rows.len());
        let part = out_rows.start * k..out_rows.end * k;
        match (&w.weight, x_bf16) {
            (Weight::Bf16(wb), Some(xb)) => {
                self.gpu.gemm_bf16(&**xb, &wb.slice(part), y, rows, n, k)
            }
            (Weight::Blocks(wq), Some(xb)) => self.blocks_product(wq, xb, rows, out_rows, y),
            (Weight::F32(wf), _) => self.gpu.gemm_f32(&**x, &wf.slice(part), y, rows, n, k),
            (Weight::Bf16(_) | Weight::Blocks(_), None) => {
                return Err(ModelError::Compute(format!(
                    "`{}`: bf16 or GGUF weights without a bf16 input",
                    w.name
                )))
            }
        }
        .map_err(model_error)
    }

    /// `y = x · Wᵀ` for the rows `out_rows` of a GGUF matrix, from x's bf16 copy: the rows
    /// dequantized for this product only (the weights stay quantized), a bounded chunk
    /// of them at a time, each chunk's product written into its columns of y.
    fn blocks_product(
        &self,
        w: &DeviceBlocks,
        x_bf16: &Pooled<bf16>,
        rows: usize,
        out_rows: std::ops::Range<usize>,
        y: &mut CudaSlice<f32>,
    ) -> crate::Result<()> {
        let (k, n) = (w.cols(), out_rows.len());
        for chunk in row_chunks(out_rows.clone(), k, self.dequantized_chunk) {
            let mut wb = self.halves.output(chunk.len() * k)?;
            let columns = (chunk.start - out_rows.start, chunk.len(), n);
            self.gpu.dequantize_blocks_bf16(w, chunk, &mut *wb)?;
            self.gpu
                .gemm_bf16_columns(&**x_bf16, &*wb, y, rows, columns, k)?;
        }
        Ok(())
    }

    /// `w`'s weights as the small-product kernels (gemv.rs) read them, where its product
    /// of `rows` rows takes them.
    pub(super) fn small_product<'a>(
        &self,
        w: &'a GpuMatrix,
        rows: usize,
    ) -> Option<GemvWeights<'a>> {
        if !self.small_products || !gemv_fits(rows, w.in_features) {
            return None;
        }
        match &w.weight {
            Weight::Bf16(wb) => Some(GemvWeights::Bf16(wb)),
            Weight::Blocks(wq) => Some(GemvWeights::Blocks(wq)),
            Weight::F32(_) => None,
        }
    }

    /// Whether `w`'s product of `rows` rows takes the small-product kernels.
    pub(super) fn takes_small_product(&self, w: &GpuMatrix, rows: usize) -> bool {
        self.small_product(w, rows).is_some()
    }

    /// [`Compute::matmul_parts`], x normalized as the small product reads it where
    /// `norm` is given (which only that product takes).
    pub(super) fn products(
        &self,
        w: &GpuMatrix,
        x: &GpuAct,
        rows: usize,
        widths: &[usize],
        norm: Option<(&CudaSlice<f32>, f32)>,
    ) -> Result<Vec<GpuAct>> {
        let k = w.in_features;
        Self::expect_len(&format!("`{}` input", w.name), x, rows * k)?;
        if widths.iter().sum::<usize>() != w.out_features {
            return Err(ModelError::Compute(format!(
                "`{}`: output widths {widths:?} do not add up to its {} rows",
                w.name, w.out_features
            )));
        }
        let mut outputs = widths
            .iter()
            .map(|&n| self.act(rows * n))
            .collect::<Result<Vec<_>>>()?;
        if let Some(weights) = self.small_product(w, rows) {
            if widths.len() <= GEMV_MAX_PARTS {
                // A decode step's few rows: one launch from f32, split as it writes.
                let mut parts: Vec<&mut CudaSlice<f32>> =
                    outputs.iter_mut().map(|o| &mut **o).collect();
                let extras = GemvExtras {
                    norm,
                    ..GemvExtras::default()
                };
                self.gpu
                    .gemv(&**x, weights, rows, k, &mut parts, extras)
                    .map_err(model_error)?;
                return Ok(outputs);
            }
        }
        refuse_folded_norm(w, norm)?;
        let x_bf16 = self.product_input(w, x)?;
        let x_bf16 = x_bf16.as_deref();
        if let [y] = outputs.as_mut_slice() {
            self.product(w, x, x_bf16, rows, 0..w.out_features, y)?;
        } else if widths.len() <= MAX_SPLIT_PARTS && rows > 0 {
            // One product over every part (a larger, faster GEMM than one per part),
            // then one launch that splits its rows' columns into the parts.
            let mut whole = self.act(rows * w.out_features)?;
            self.product(w, x, x_bf16, rows, 0..w.out_features, &mut whole)?;
            let mut parts: Vec<&mut CudaSlice<f32>> =
                outputs.iter_mut().map(|o| &mut **o).collect();
            self.gpu
                .split_columns(&whole, rows, &mut parts)
                .map_err(model_error)?;
        } else {
            // Each part's rows of W are contiguous: one product per part.
            let mut row0 = 0;
            for (y, &n) in outputs.iter_mut().zip(widths) {
                self.product(w, x, x_bf16, rows, row0..row0 + n, y)?;
                row0 += n;
            }
        }
        Ok(outputs)
    }

    /// [`Compute::matmul_gated`], x normalized as the small product reads it where `norm`
    /// is given (which only that product takes).
    pub(super) fn gated(
        &self,
        w: &GpuMatrix,
        x: &GpuAct,
        rows: usize,
        width: usize,
        act: ModelActivation,
        norm: Option<(&CudaSlice<f32>, f32)>,
    ) -> Result<GpuAct> {
        let k = w.in_features;
        Self::expect_len(&format!("`{}` input", w.name), x, rows * k)?;
        if w.out_features != 2 * width {
            return Err(ModelError::Compute(format!(
                "`{}`: {} rows are not gate and up of {width}",
                w.name, w.out_features
            )));
        }
        if let Some(weights) = self.small_product(w, rows) {
            let mut out = self.act(rows * width)?;
            let extras = GemvExtras {
                norm,
                ..GemvExtras::default()
            };
            self.gpu
                .gemv_gated(&**x, weights, rows, k, &mut out, activation(act)?, extras)
                .map_err(model_error)?;
            return Ok(out);
        }
        refuse_folded_norm(w, norm)?;
        let x_bf16 = self.product_input(w, x)?;
        let mut gate_up = self.act(rows * 2 * width)?;
        self.product(w, x, x_bf16.as_deref(), rows, 0..2 * width, &mut gate_up)?;
        let (mut out, mut half) = self.twin(rows * width)?;
        self.gpu
            .act_mul_split(&gate_up, &mut out, &mut half, width, activation(act)?)
            .map_err(model_error)?;
        Ok(GpuAct::with_bf16(out, half))
    }
}

/// Most values of a GGUF matrix dequantized to bf16 at once for a product, unless
/// `LANTERN_CUDA_DEQUANTIZED_CHUNK_MIB` says otherwise (64 MiB): a larger matrix (a large
/// vocabulary's LM head, a 70B model's MLP) is dequantized and multiplied a chunk of rows
/// at a time.
const DEQUANTIZED_CHUNK: usize = 32 << 20;

/// The chunk `LANTERN_CUDA_DEQUANTIZED_CHUNK_MIB` (`mib`: MiB of bf16, a whole number
/// of at least 1) sets, in values; [`DEQUANTIZED_CHUNK`] when unset, or with a warning
/// when not understood.
pub(super) fn dequantized_chunk(mib: Option<&str>) -> usize {
    let Some(text) = mib.map(str::trim).filter(|t| !t.is_empty()) else {
        return DEQUANTIZED_CHUNK;
    };
    match text.parse::<usize>() {
        Ok(mib @ 1..=65_536) => (mib << 20) / size_of::<bf16>(),
        _ => {
            tracing::warn!(
                "LANTERN_CUDA_DEQUANTIZED_CHUNK_MIB={text:?} is not a whole number of MiB \
                 from 1 to 65536; dequantizing 64 MiB at a time"
            );
            DEQUANTIZED_CHUNK
        }
    }
}

/// `rows` cut into consecutive chunks of at most `max_values / k` rows (at least one).
fn row_chunks(
    rows: std::ops::Range<usize>,
    k: usize,
    max_values: usize,
) -> impl Iterator<Item = std::ops::Range<usize>> {
    let step = (max_values / k.max(1)).max(1);
    rows.clone()
        .step_by(step)
        .map(move |start| start..(start + step).min(rows.end))
}

/// A norm folded into a product (`normed_matmul_*`) is for the small-product kernels only;
/// their callers send any other product the normed rows instead.
fn refuse_folded_norm(w: &GpuMatrix, norm: Option<(&CudaSlice<f32>, f32)>) -> Result<()> {
    match norm {
        Some(_) => Err(ModelError::Compute(format!(
            "`{}`: a norm folded into a product the small-product kernels do not take",
            w.name
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_matrices_are_dequantized_a_bounded_chunk_of_rows_at_a_time() {
        let chunks: Vec<_> = row_chunks(10..35, 4, 40).collect();
        assert_eq!(chunks, vec![10..20, 20..30, 30..35]);
        // A 262k-token LM head over 640 inputs: 6 chunks of at most 64 MiB of bf16.
        let head: Vec<_> = row_chunks(0..262_144, 640, DEQUANTIZED_CHUNK).collect();
        assert_eq!(head.len(), 6);
        assert!(head.iter().all(|c| c.len() * 640 <= DEQUANTIZED_CHUNK));
        assert_eq!(head.last().unwrap().end, 262_144);
        // A matrix that fits is one chunk; rows longer than the bound take one row each.
        assert_eq!(row_chunks(0..2048, 8192, DEQUANTIZED_CHUNK).count(), 1);
        // The variable's MiB of bf16, in values; the default where unset or not a size.
        assert_eq!(dequantized_chunk(None), DEQUANTIZED_CHUNK);
        assert_eq!(dequantized_chunk(Some("64")), DEQUANTIZED_CHUNK);
        assert_eq!(dequantized_chunk(Some(" 16 ")), 8 << 20);
        for bad in ["", "0", "-4", "1.5", "lots", "100000"] {
            let want = DEQUANTIZED_CHUNK;
            assert_eq!(dequantized_chunk(Some(bad)), want, "{bad:?}");
        }
        assert_eq!(
            row_chunks(0..3, 100, 10).collect::<Vec<_>>(),
            vec![0..1, 1..2, 2..3]
        );
        assert_eq!(row_chunks(5..5, 64, 640).count(), 0);
    }
}
