//! lantern-model's blocks on the GPU: [`Compute`] over device buffers. Weights are
//! uploaded once at load (bf16, or f32 with `--f32-weights`; GGUF's quantized types stay
//! quantized, in lantern-quant's blockwise form), activations stay on the device from the
//! embedding lookup to the logits, and attention runs on [`CudaBackend`]'s paged caches.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::quantized::QTensor;
use cudarc::driver::CudaSlice;
use half::bf16;
use lantern_attn::{
    tensor3, AttentionBackend, AttentionLayerSpec, AttentionMetadata, AttentionTap, Device,
    LayerKvCache, RecordedRows, RowProbabilities,
};
use lantern_model::blocks::Activation as ModelActivation;
use lantern_model::compute::{AttentionCall, Compute};
use lantern_model::linear::packed_type;
use lantern_model::rope::{Rope, RopePairs};
use lantern_model::{
    LoadOptions, LogitEdit, ModelError, ReducedRow, Result, RowReduction, TokenChoice,
    MAX_REDUCED_TOP_LOGPROBS,
};
use lantern_quant::Blockwise;

use crate::backend::{CudaBackend, PendingProbabilities};
use crate::blocks::DeviceBlocks;
use crate::gemv::{GemvExtras, GEMV_MAX_PARTS, GEMV_MAX_ROWS};
use crate::gpu::Gpu;
use crate::kept::KeptRowsTable;
use crate::kernels::{Activation, RopeStep};
use crate::pool::{Pool, Pooled};
use crate::reduce::{edit_words, reduce_params, reduce_stride, reduced_row};
use crate::CudaError;

mod products;

/// The model's blocks on one GPU.
#[derive(Clone)]
pub struct CudaCompute {
    gpu: Arc<Gpu>,
    /// Products of a few rows with bf16 weights take the small-product kernels (gemv.rs);
    /// `LANTERN_CUDA_SMALL_PRODUCTS=off` sends them to cuBLAS (for comparing the two).
    small_products: bool,
    /// Norms and residual adds ride in the small products (`LANTERN_CUDA_FOLD_NORMS=off`
    /// launches them apart, for comparing the two).
    fold_norms: bool,
    /// GGUF weights of a quantized type stay quantized on the device (blocks.rs);
    /// `LANTERN_CUDA_QUANTIZED_WEIGHTS=off` dequantizes them to bf16 at load (no
    /// dequantization in the products past the small-product kernels' rows, 1.6-3.2x the
    /// memory).
    quantized_weights: bool,
    /// Values of a GGUF matrix dequantized at once for a product past the small-product
    /// kernels' rows (`LANTERN_CUDA_DEQUANTIZED_CHUNK_MIB`, bf16 MiB, default 64): a
    /// chunk that fits the GPU's L2 cache is read back from it by the product.
    dequantized_chunk: usize,
    /// Device bytes of the weights uploaded so far (matrices and vectors), and of the
    /// GGUF matrices among them kept quantized.
    weight_bytes: Arc<AtomicUsize>,
    quantized_bytes: Arc<AtomicUsize>,
    /// Whether any matrix was uploaded as f32 (`--f32-weights`): the small-product
    /// kernels, which fold norms and residual adds, take bf16 only.
    f32_matrices: Arc<AtomicBool>,
    /// Activations and the bf16 copies products take, reused from step to step.
    acts: Arc<Pool<f32>>,
    halves: Arc<Pool<bf16>>,
    /// Capture probabilities of this step's layers, computed on the device and handed to
    /// the tap once the layers have all run ([`Compute::finish_layers`]).
    deferred: Arc<Mutex<Vec<DeferredProbabilities>>>,
}

/// One layer's capture probabilities waiting on the device for the step's end.
struct DeferredProbabilities {
    layer: usize,
    probabilities: RowProbabilities,
    pending: PendingProbabilities,
}

/// Device bytes of probabilities a step keeps for the end of its layers: past it, an
/// eager step's are copied to the host at once (a wait for the device); graph steps are
/// only run where theirs fit.
const MAX_DEFERRED_BYTES: usize = lantern_attn::MAX_GRAPH_PROBABILITY_BYTES;

/// A layer as its capture probabilities are computed: its index, spec, metadata, cache.
type LayerAt<'a> = (
    usize,
    &'a AttentionLayerSpec,
    &'a AttentionMetadata,
    &'a dyn LayerKvCache,
);

/// `[rows, width]` f32 activations on the device, with their bf16 copy when the kernel
/// that made them wrote one: the input of the next product, which then needs no cast.
/// Changing the values (through `DerefMut`) drops the copy.
pub struct GpuAct {
    values: Pooled<f32>,
    bf16: Option<Pooled<bf16>>,
}

impl GpuAct {
    fn new(values: Pooled<f32>) -> Self {
        Self { values, bf16: None }
    }

    fn with_bf16(values: Pooled<f32>, bf16: Pooled<bf16>) -> Self {
        Self {
            values,
            bf16: Some(bf16),
        }
    }
}

impl std::ops::Deref for GpuAct {
    type Target = CudaSlice<f32>;

    fn deref(&self) -> &CudaSlice<f32> {
        &self.values
    }
}

impl std::ops::DerefMut for GpuAct {
    fn deref_mut(&mut self) -> &mut CudaSlice<f32> {
        self.bf16 = None;
        &mut self.values
    }
}

/// A weight matrix `[out, in]` on the device.
pub struct GpuMatrix {
    name: String,
    out_features: usize,
    in_features: usize,
    weight: Weight,
}

enum Weight {
    Bf16(CudaSlice<bf16>),
    F32(CudaSlice<f32>),
    /// A GGUF matrix kept quantized (blocks.rs).
    Blocks(DeviceBlocks),
}

/// One step's RoPE cos/sin on the device.
pub struct GpuRopeTable {
    cos: Pooled<f32>,
    sin: Pooled<f32>,
    half: usize,
    adjacent: bool,
}

fn model_error(e: CudaError) -> ModelError {
    ModelError::Compute(format!("cuda: {e}"))
}

fn tensor_error(name: &str) -> impl Fn(candle_core::Error) -> ModelError + '_ {
    move |source| ModelError::Tensor {
        name: name.to_string(),
        source,
    }
}

/// Whether the switch `name` (on unless set to off, 0 or false) is on.
fn switched_on(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| !matches!(v.trim(), "off" | "0" | "false"))
}

/// What the products over weights of GGUF type `dtype` run as on the GPU: `cuda-gguf`
/// (kept quantized, [`crate::blocks`]), `cuda-f32` (`--f32-weights`) or `cuda-bf16`.
pub fn product_kernel(dtype: candle_core::quantized::GgmlDType, f32_weights: bool) -> &'static str {
    let quantized = packed_type(dtype).is_some_and(|ty| !ty.is_dense());
    if f32_weights {
        "cuda-f32"
    } else if quantized && switched_on("LANTERN_CUDA_QUANTIZED_WEIGHTS") {
        "cuda-gguf"
    } else {
        "cuda-bf16"
    }
}

impl CudaCompute {
    pub fn new(gpu: Arc<Gpu>) -> Self {
        let small_products = switched_on("LANTERN_CUDA_SMALL_PRODUCTS");
        let fold_norms = switched_on("LANTERN_CUDA_FOLD_NORMS");
        let quantized_weights = switched_on("LANTERN_CUDA_QUANTIZED_WEIGHTS");
        let dequantized_chunk = products::dequantized_chunk(
            std::env::var("LANTERN_CUDA_DEQUANTIZED_CHUNK_MIB")
                .ok()
                .as_deref(),
        );
        Self {
            quantized_weights,
            dequantized_chunk,
            weight_bytes: Arc::default(),
            quantized_bytes: Arc::default(),
            acts: Pool::new(Arc::clone(&gpu)),
            halves: Pool::new(Arc::clone(&gpu)),
            gpu,
            small_products,
            fold_norms,
            f32_matrices: Arc::new(AtomicBool::new(false)),
            deferred: Arc::default(),
        }
    }

    fn deferred(&self) -> std::sync::MutexGuard<'_, Vec<DeferredProbabilities>> {
        self.deferred.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The rows whose probabilities the tap sums as they run (key statistics, span
    /// masses, streamed rows), computed on the device right after the layer's attention
    /// and kept there for the end of the step's layers: the layers then run without a
    /// wait for the device each (past [`MAX_DEFERRED_BYTES`] they are copied at once).
    fn probabilities_for(
        &self,
        tap: &mut (dyn AttentionTap + '_),
        (layer, spec, meta, cache): LayerAt<'_>,
        backend: &CudaBackend,
        q: &CudaSlice<f32>,
    ) -> Result<()> {
        let Some(mut probabilities) = tap.probability_rows(layer) else {
            return Ok(());
        };
        let launched =
            backend.launch_row_probabilities(spec, meta, q, cache, &mut probabilities)?;
        let Some(pending) = launched else {
            tap.record_probabilities(layer, probabilities);
            return Ok(());
        };
        let mut deferred = self.deferred();
        let held: usize = deferred.iter().map(|d| d.pending.size_bytes()).sum();
        if held + pending.size_bytes() > MAX_DEFERRED_BYTES {
            drop(deferred);
            if self.gpu.in_graph_step() {
                // A copy now would end the graph step before its last layer (the runner
                // graphs only steps whose probabilities fit): left unfilled, as in every
                // replay of the step, and the capture computes these figures when it
                // finishes.
                probabilities.clear_filled();
            } else {
                pending.fill(&self.gpu, &mut probabilities)?;
            }
            tap.record_probabilities(layer, probabilities);
        } else {
            deferred.push(DeferredProbabilities {
                layer,
                probabilities,
                pending,
            });
        }
        Ok(())
    }

    fn act(&self, n: usize) -> Result<GpuAct> {
        Ok(GpuAct::new(self.acts.output(n).map_err(model_error)?))
    }

    /// An output and its bf16 copy, for a kernel that writes both.
    fn twin(&self, n: usize) -> Result<(Pooled<f32>, Pooled<bf16>)> {
        Ok((
            self.acts.output(n).map_err(model_error)?,
            self.halves.output(n).map_err(model_error)?,
        ))
    }

    /// A norm's output over rows of `width`, with a bf16 copy where the next product
    /// will want one (more rows than the small-product kernels take, which read f32).
    fn norm_output(&self, n: usize, width: usize) -> Result<(Pooled<f32>, Option<Pooled<bf16>>)> {
        let values = self.acts.output(n).map_err(model_error)?;
        let copy = if n / width.max(1) > GEMV_MAX_ROWS || !self.small_products {
            Some(self.halves.output(n).map_err(model_error)?)
        } else {
            None
        };
        Ok((values, copy))
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Device bytes the model's weights take (what has been loaded so far).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes.load(Ordering::Relaxed)
    }

    /// Of [`Self::weight_bytes`], those of GGUF matrices kept quantized.
    pub fn quantized_weight_bytes(&self) -> usize {
        self.quantized_bytes.load(Ordering::Relaxed)
    }

    fn count_weight_bytes(&self, bytes: usize) {
        self.weight_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// `[rows, cols]` f32 values of `tensors` stacked by rows.
    fn dequantized(name: &str, tensors: &[QTensor]) -> Result<(Vec<f32>, usize, usize)> {
        let mut values = Vec::new();
        let (mut rows, mut cols) = (0, None);
        for t in tensors {
            let dims = t.shape().dims();
            let (r, c) = match dims {
                [r, c] => (*r, *c),
                _ => {
                    return Err(ModelError::Compute(format!(
                        "`{name}`: a matrix of shape {dims:?}"
                    )))
                }
            };
            if cols.is_some_and(|cc| cc != c) {
                return Err(ModelError::Compute(format!(
                    "`{name}`: stacked matrices of different widths"
                )));
            }
            cols = Some(c);
            rows += r;
            let dense = t
                .dequantize(&candle_core::Device::Cpu)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(tensor_error(name))?;
            values.extend_from_slice(&dense);
        }
        Ok((values, rows, cols.unwrap_or(0)))
    }

    /// `tensors` stacked by rows in the blockwise form, where they are of one quantized
    /// type lantern-quant reads (`None` for the dense types and the ones it does not).
    fn blockwise(name: &str, tensors: &[QTensor]) -> Result<Option<Blockwise>> {
        let Some(first) = tensors.first() else {
            return Ok(None);
        };
        let dtype = first.dtype();
        let Some(ty) = packed_type(dtype).filter(|ty| !ty.is_dense()) else {
            return Ok(None);
        };
        let cols = first.shape().dims().last().copied().unwrap_or(0);
        let (mut rows, mut bytes) = (0, Vec::new());
        for t in tensors {
            let dims = t.shape().dims();
            if t.dtype() != dtype || dims.len() != 2 || dims[1] != cols {
                return Err(ModelError::Compute(format!(
                    "`{name}`: stacked matrices differ in type or width"
                )));
            }
            rows += dims[0];
            bytes.extend_from_slice(&t.data().map_err(tensor_error(name))?);
        }
        Blockwise::from_gguf_bytes(ty, &bytes, rows, cols)
            .map(Some)
            .map_err(|e| ModelError::InvalidConfig(format!("tensor `{name}`: {e}")))
    }

    fn upload_matrix(
        &self,
        options: &LoadOptions,
        name: &str,
        tensors: &[QTensor],
    ) -> Result<GpuMatrix> {
        if self.quantized_weights && !options.f32_weights {
            if let Some(form) = Self::blockwise(name, tensors)? {
                let blocks = self.gpu.upload_blocks(&form).map_err(model_error)?;
                self.count_weight_bytes(blocks.size_bytes());
                self.quantized_bytes
                    .fetch_add(blocks.size_bytes(), Ordering::Relaxed);
                return Ok(GpuMatrix {
                    name: name.to_string(),
                    out_features: form.rows(),
                    in_features: form.cols(),
                    weight: Weight::Blocks(blocks),
                });
            }
        }
        let (values, rows, cols) = Self::dequantized(name, tensors)?;
        let per_value = if options.f32_weights { 4 } else { 2 };
        self.count_weight_bytes(values.len() * per_value);
        let weight = if options.f32_weights {
            self.f32_matrices.store(true, Ordering::Relaxed);
            Weight::F32(self.gpu.upload(&values).map_err(model_error)?)
        } else {
            let halves: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
            Weight::Bf16(self.gpu.upload(&halves).map_err(model_error)?)
        };
        Ok(GpuMatrix {
            name: name.to_string(),
            out_features: rows,
            in_features: cols,
            weight,
        })
    }

    fn expect_len(what: &str, buf: &GpuAct, len: usize) -> Result<()> {
        if buf.len() == len {
            Ok(())
        } else {
            Err(ModelError::Compute(format!(
                "{what}: {} values, expected {len}",
                buf.len()
            )))
        }
    }

    /// Requests that keep their rows on the device copy them there from `q`: none of
    /// theirs crosses to the host. A graph step of capturing requests copies them in one
    /// launch on every layer, captured or not, so that every step of its graph is the
    /// same; the tap (`None` where this layer is not captured) fills its table.
    /// `step_captures`: the step has a tap at all (a step without one does nothing here).
    fn keep_rows(
        &self,
        (tap, step_captures): (Option<&mut (dyn AttentionTap + '_)>, bool),
        layer: usize,
        q: &CudaSlice<f32>,
        head_dim: usize,
    ) -> Result<()> {
        let table = (step_captures && self.gpu.in_capturing_graph_step())
            .then(|| KeptRowsTable::new(q.len(), head_dim));
        if let Some(tap) = tap.filter(|t| t.keeps_on_device(layer)) {
            let handed: &dyn Any = match &table {
                Some(table) => table,
                None => q,
            };
            tap.record_kept(layer, handed)?;
        }
        match table {
            Some(table) => table.scatter(&self.gpu, q, head_dim).map_err(model_error),
            None => Ok(()),
        }
    }

    /// The query rows (and, where a capture checks P·V, the output rows) of capturing
    /// requests that keep theirs on the host, copied there: gathered on the device
    /// where they are not the whole step.
    fn record_on_host(
        &self,
        tap: &mut (dyn AttentionTap + '_),
        (layer, spec, tokens): (usize, &AttentionLayerSpec, usize),
        q: &GpuAct,
        out: &GpuAct,
    ) -> Result<()> {
        let width = spec.num_heads * spec.head_dim;
        let rows: Vec<usize> = tap.rows_read(layer).into_iter().flatten().collect();
        if rows.is_empty() {
            return Ok(());
        }
        let whole_step = rows.iter().copied().eq(0..tokens);
        let recorded = if whole_step {
            RecordedRows::All
        } else {
            RecordedRows::Read
        };
        let host = |b: &GpuAct| -> Result<lantern_attn::Tensor> {
            let values = if whole_step {
                self.gpu.download(&**b)
            } else {
                self.gpu.download(&*self.select_rows(b, &rows, width)?)
            };
            let dims = [rows.len(), spec.num_heads, spec.head_dim];
            Ok(tensor3(values.map_err(model_error)?, dims, &Device::Cpu)?)
        };
        let out_host = if tap.wants_output(layer) {
            Some(host(out)?)
        } else {
            None
        };
        tap.record(layer, recorded, &host(q)?, out_host.as_ref())?;
        Ok(())
    }
}

impl Compute for CudaCompute {
    type Act = GpuAct;
    type Matrix = GpuMatrix;
    type Vector = CudaSlice<f32>;
    type RopeTable = GpuRopeTable;

    fn matrix(&self, options: &LoadOptions, name: &str, tensor: QTensor) -> Result<GpuMatrix> {
        self.upload_matrix(options, name, &[tensor])
    }

    fn stacked_matrix(
        &self,
        options: &LoadOptions,
        name: &str,
        parts: Vec<QTensor>,
    ) -> Result<GpuMatrix> {
        self.upload_matrix(options, name, &parts)
    }

    fn vector(&self, values: Vec<f32>) -> Result<CudaSlice<f32>> {
        self.count_weight_bytes(4 * values.len());
        self.gpu.upload(&values).map_err(model_error)
    }

    fn rope_table(&self, rope: &Rope, positions: &[usize]) -> Result<GpuRopeTable> {
        let table = rope.table(positions);
        Ok(GpuRopeTable {
            cos: self.gpu.step_upload(table.cos()).map_err(model_error)?,
            sin: self.gpu.step_upload(table.sin()).map_err(model_error)?,
            half: table.half(),
            adjacent: table.pairs() == RopePairs::Adjacent,
        })
    }

    fn embed(&self, table: &GpuMatrix, ids: &[u32], scale: Option<f32>) -> Result<GpuAct> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= table.out_features) {
            return Err(ModelError::Compute(format!(
                "token id {bad} is outside the vocabulary of {} tokens",
                table.out_features
            )));
        }
        let hidden = table.in_features;
        let ids_dev = self.gpu.step_upload(ids).map_err(model_error)?;
        let mut out = self.act(ids.len() * hidden)?;
        let scale = scale.unwrap_or(1.0);
        match &table.weight {
            Weight::Bf16(w) => self.gpu.embed(w, &*ids_dev, &mut *out, hidden, scale),
            Weight::F32(w) => self.gpu.embed(w, &*ids_dev, &mut *out, hidden, scale),
            Weight::Blocks(w) => self.gpu.embed_blocks(w, &*ids_dev, &mut *out, scale),
        }
        .map_err(model_error)?;
        Ok(out)
    }

    fn matmul_parts(
        &self,
        w: &GpuMatrix,
        x: &GpuAct,
        rows: usize,
        widths: &[usize],
    ) -> Result<Vec<GpuAct>> {
        self.products(w, x, rows, widths, None)
    }

    fn folds_norms(&self, rows: usize) -> bool {
        self.small_products
            && self.fold_norms
            && (1..=GEMV_MAX_ROWS).contains(&rows)
            && !self.f32_matrices.load(Ordering::Relaxed)
    }

    /// The norm in the small product's staging of x (gemv.cu), where it takes the product.
    fn normed_matmul_parts(
        &self,
        w: &GpuMatrix,
        (x, norm): (&GpuAct, (&CudaSlice<f32>, f32)),
        rows: usize,
        widths: &[usize],
    ) -> Result<Vec<GpuAct>> {
        if self.takes_small_product(w, rows) && widths.len() <= GEMV_MAX_PARTS {
            return self.products(w, x, rows, widths, Some(norm));
        }
        let h = self.rms_norm(x, norm.0, norm.1)?;
        self.matmul_parts(w, &h, rows, widths)
    }

    fn normed_matmul_gated(
        &self,
        w: &GpuMatrix,
        (x, norm): (&GpuAct, (&CudaSlice<f32>, f32)),
        rows: usize,
        width: usize,
        act: ModelActivation,
    ) -> Result<GpuAct> {
        if self.takes_small_product(w, rows) {
            return self.gated(w, x, rows, width, act, Some(norm));
        }
        let h = self.rms_norm(x, norm.0, norm.1)?;
        self.matmul_gated(w, &h, rows, width, act)
    }

    /// The residual add in the small product's output (gemv.cu), where it takes the
    /// product.
    fn matmul_add(&self, w: &GpuMatrix, x: &GpuAct, rows: usize, acc: &mut GpuAct) -> Result<()> {
        let k = w.in_features;
        match self.small_product(w, rows) {
            Some(weights) => {
                Self::expect_len(&format!("`{}` input", w.name), x, rows * k)?;
                Self::expect_len(
                    &format!("`{}` residual", w.name),
                    acc,
                    rows * w.out_features,
                )?;
                let extras = GemvExtras {
                    accumulate: true,
                    ..GemvExtras::default()
                };
                self.gpu
                    .gemv(&**x, weights, rows, k, &mut [&mut **acc], extras)
                    .map_err(model_error)
            }
            None => {
                let y = self.matmul(w, x, rows)?;
                self.add(acc, &y)
            }
        }
    }

    fn out_features(&self, w: &GpuMatrix) -> usize {
        w.out_features
    }

    fn rms_norm(&self, x: &GpuAct, weight: &CudaSlice<f32>, eps: f32) -> Result<GpuAct> {
        let (mut out, mut half) = self.norm_output(x.len(), weight.len())?;
        self.gpu
            .rms_norm_twin(x, weight, &mut out, half.as_deref_mut(), eps)
            .map_err(model_error)?;
        Ok(GpuAct {
            values: out,
            bf16: half,
        })
    }

    fn add_rms_norm(
        &self,
        x: &mut GpuAct,
        delta: &GpuAct,
        weight: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<GpuAct> {
        let (mut out, mut half) = self.norm_output(x.len(), weight.len())?;
        self.gpu
            .add_rms_norm(x, delta, weight, &mut out, half.as_deref_mut(), eps)
            .map_err(model_error)?;
        Ok(GpuAct {
            values: out,
            bf16: half,
        })
    }

    fn matmul_gated(
        &self,
        w: &GpuMatrix,
        x: &GpuAct,
        rows: usize,
        width: usize,
        act: ModelActivation,
    ) -> Result<GpuAct> {
        self.gated(w, x, rows, width, act, None)
    }

    fn add(&self, acc: &mut GpuAct, x: &GpuAct) -> Result<()> {
        self.gpu.add_in_place(&mut **acc, &**x).map_err(model_error)
    }

    fn add_bias(&self, x: &mut GpuAct, bias: &CudaSlice<f32>) -> Result<()> {
        self.gpu.add_bias(&mut **x, bias).map_err(model_error)
    }

    const RUNS_LAYER_NORM_MODELS: bool = true;

    fn layer_norm(
        &self,
        x: &GpuAct,
        weight: &CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<GpuAct> {
        let mut out = self.act(x.len())?;
        self.gpu
            .layer_norm(&**x, (weight, bias), &mut *out, eps)
            .map_err(model_error)?;
        Ok(out)
    }

    fn activate(&self, act: ModelActivation, x: &mut GpuAct) -> Result<()> {
        self.gpu
            .activate(&mut **x, activation(act)?)
            .map_err(model_error)
    }

    fn act_mul(&self, act: ModelActivation, gate: &mut GpuAct, up: &GpuAct) -> Result<()> {
        self.gpu
            .act_mul(&mut **gate, &**up, activation(act)?)
            .map_err(model_error)
    }

    fn soft_cap(&self, x: &mut GpuAct, cap: f32) -> Result<()> {
        self.gpu.soft_cap(&mut **x, cap).map_err(model_error)
    }

    fn scale(&self, x: &mut GpuAct, factor: f32) -> Result<()> {
        self.gpu.scale(&mut **x, factor).map_err(model_error)
    }

    fn clamp(&self, x: &mut GpuAct, limit: f32) -> Result<()> {
        self.gpu.clamp(&mut **x, limit).map_err(model_error)
    }

    fn rope(
        &self,
        table: &GpuRopeTable,
        x: &mut GpuAct,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        self.gpu
            .rope(
                &mut **x,
                &*table.cos,
                &*table.sin,
                heads,
                head_dim,
                table.half,
                table.adjacent,
            )
            .map_err(model_error)
    }

    fn select_rows(&self, x: &GpuAct, rows: &[usize], width: usize) -> Result<GpuAct> {
        let available = x.len() / width.max(1);
        if let Some(&bad) = rows.iter().find(|&&r| r >= available) {
            return Err(ModelError::Compute(format!(
                "row {bad} of {available} selected"
            )));
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let idx = self.gpu.step_upload(&idx).map_err(model_error)?;
        let mut out = self.act(rows.len() * width)?;
        self.gpu
            .gather_rows(&**x, &*idx, &mut *out, width)
            .map_err(model_error)?;
        Ok(out)
    }

    fn attention(
        &self,
        call: AttentionCall<'_, '_>,
        q: GpuAct,
        k: GpuAct,
        v: GpuAct,
    ) -> Result<GpuAct> {
        self.attend_layer(call, q, k, v, None)
    }

    /// RoPE in the cache write's launch ([`lantern_cuda::Gpu::rope_kv_write`]): one
    /// launch a layer fewer than `rope_qk` and then `attention`, the same bits.
    fn rope_attention(
        &self,
        call: AttentionCall<'_, '_>,
        table: &GpuRopeTable,
        (q, q_heads): (GpuAct, usize),
        (k, k_heads): (GpuAct, usize),
        v: GpuAct,
        head_dim: usize,
    ) -> Result<GpuAct> {
        let spec = call.spec;
        if (q_heads, k_heads, head_dim) != (spec.num_heads, spec.num_kv_heads, spec.head_dim) {
            return Err(ModelError::Compute(format!(
                "rope_attention: {q_heads}/{k_heads} heads of {head_dim} for a layer of {}/{} of {}",
                spec.num_heads, spec.num_kv_heads, spec.head_dim
            )));
        }
        self.attend_layer(call, q, k, v, Some(table))
    }

    /// Hands the tap the probabilities the layers left on the device: one wait for the
    /// device, then a copy of each (none of them while the layers ran).
    fn finish_layers(&self, tap: Option<&mut (dyn AttentionTap + '_)>) -> Result<()> {
        let deferred = std::mem::take(&mut *self.deferred());
        let Some(tap) = tap else {
            return Ok(());
        };
        for d in deferred {
            let mut probabilities = d.probabilities;
            d.pending.fill(&self.gpu, &mut probabilities)?;
            tap.record_probabilities(d.layer, probabilities);
        }
        Ok(())
    }

    fn rope_qk(
        &self,
        table: &GpuRopeTable,
        (q, q_heads): (&mut GpuAct, usize),
        (k, k_heads): (&mut GpuAct, usize),
        head_dim: usize,
    ) -> Result<()> {
        self.gpu
            .rope_qk(
                (&mut **q, q_heads),
                (&mut **k, k_heads),
                &table.cos,
                &table.sin,
                head_dim,
                table.half,
                table.adjacent,
            )
            .map_err(model_error)
    }

    fn to_host(&self, x: GpuAct) -> Result<Vec<f32>> {
        self.gpu.download(&*x).map_err(model_error)
    }

    /// Greedy and sampled rows (cut by top-k, top-p and min-p, edited by penalties), with
    /// their logprobs, and prompt rows scored for their logprobs are reduced here: a few
    /// numbers per row cross to the host, not the row.
    const PICKS_ON_DEVICE: bool = true;

    fn edit_logits(&self, x: &mut GpuAct, width: usize, edits: &[LogitEdit]) -> Result<()> {
        // Uploaded with the step: a graph of edited steps replays the launch with the
        // step's own edits (padded by the engine to the graph's count).
        let words = self
            .gpu
            .step_upload(&edit_words(edits))
            .map_err(model_error)?;
        self.gpu
            .edit_logits(&mut **x, width, &*words)
            .map_err(model_error)
    }

    fn reduce_rows(
        &self,
        x: &GpuAct,
        width: usize,
        wants: &[RowReduction],
    ) -> Result<Vec<ReducedRow>> {
        let rows = x.len() / width.max(1);
        if width == 0 || !x.len().is_multiple_of(width) || wants.len() != rows {
            return Err(ModelError::Compute(format!(
                "reduce_rows: {} values are not {} rows of {width}",
                x.len(),
                wants.len()
            )));
        }
        if let Some(k) = wants
            .iter()
            .filter_map(|w| w.logprobs)
            .find(|&k| k > MAX_REDUCED_TOP_LOGPROBS)
        {
            return Err(ModelError::Compute(format!(
                "reduce_rows: {k} top logprobs asked, at most {MAX_REDUCED_TOP_LOGPROBS}"
            )));
        }
        if let Some(t) = wants.iter().find_map(|w| match w.token {
            TokenChoice::Given(t) if t as usize >= width => Some(t),
            _ => None,
        }) {
            return Err(ModelError::Compute(format!(
                "reduce_rows: token {t} outside rows of {width}"
            )));
        }
        // One kernel for every kind of row, its parameters uploaded with the step and its
        // output of one size: a graph replays it whichever rows sample or score.
        let params: Vec<u32> = wants.iter().flat_map(reduce_params).collect();
        let params = self.gpu.step_upload(&params).map_err(model_error)?;
        let stride = reduce_stride(MAX_REDUCED_TOP_LOGPROBS);
        let mut words = self
            .gpu
            .step_output::<u32>(rows * stride)
            .map_err(model_error)?;
        self.gpu
            .reduce_rows(&**x, &*params, &mut *words, MAX_REDUCED_TOP_LOGPROBS)
            .map_err(model_error)?;
        let words = self.gpu.download(&*words).map_err(model_error)?;
        Ok(words
            .chunks_exact(stride)
            .zip(wants)
            .map(|(w, want)| reduced_row(w, want))
            .collect())
    }
}

impl CudaCompute {
    /// A layer's attention on the device, RoPE fused into the cache write when `rope` is
    /// given; then what a capture asks of the layer.
    fn attend_layer(
        &self,
        call: AttentionCall<'_, '_>,
        mut q: GpuAct,
        k: GpuAct,
        v: GpuAct,
        rope: Option<&GpuRopeTable>,
    ) -> Result<GpuAct> {
        let AttentionCall {
            layer,
            tokens,
            spec,
            meta,
            backend,
            cache,
            tap,
        } = call;
        let backend: &CudaBackend = as_cuda(backend)?;
        let rope = rope.map(|t| RopeStep {
            cos: &t.cos,
            sin: &t.sin,
            half: t.half,
            adjacent: t.adjacent,
        });
        let out =
            GpuAct::new(backend.attend(spec, meta, &mut q, &k, &v, rope.as_ref(), &mut *cache)?);
        let step_captures = tap.is_some();
        let mut tap = tap.filter(|t| t.wants_layer(layer));
        if let Some(tap) = tap.as_deref_mut() {
            self.probabilities_for(tap, (layer, spec, meta, &*cache), backend, &q)?;
        }
        self.keep_rows(
            (tap.as_deref_mut(), step_captures),
            layer,
            &q,
            spec.head_dim,
        )?;
        // Capture: only a tap that wants this layer costs a copy to the host.
        if let Some(tap) = tap {
            self.record_on_host(tap, (layer, spec, tokens), &q, &out)?;
        }
        Ok(out)
    }
}

/// The kernels' code for `act`; gpt-oss's clamped SwiGLU (experts only, which the GPU
/// does not run yet) has none.
pub(crate) fn activation(act: ModelActivation) -> Result<Activation> {
    Ok(match act {
        ModelActivation::Silu => Activation::Silu,
        ModelActivation::GeluTanh => Activation::GeluTanh,
        ModelActivation::GeluErf => Activation::GeluErf,
        ModelActivation::Relu => Activation::Relu,
        ModelActivation::SwigluOai => {
            return Err(ModelError::Compute(
                "gpt-oss's clamped SwiGLU does not run on the GPU yet".into(),
            ))
        }
    })
}

/// The backend as the CUDA one: the GPU model attends on no other.
fn as_cuda(backend: &dyn AttentionBackend) -> Result<&CudaBackend> {
    backend
        .as_any()
        .and_then(|b| b.downcast_ref())
        .ok_or_else(|| {
            ModelError::Compute(format!(
                "a model on the GPU needs the cuda attention backend, not `{}`",
                backend.name()
            ))
        })
}
