//! lantern-model's blocks on the GPU: [`Compute`] over device buffers. Weights are
//! uploaded once at load (bf16, or f32 with `--f32-weights`; GGUF's quantized types are
//! dequantized on the way), activations stay on the device from the embedding lookup to
//! the logits, and attention runs on [`CudaBackend`]'s paged caches.

use std::sync::Arc;

use candle_core::quantized::QTensor;
use cudarc::driver::CudaSlice;
use half::bf16;
use lantern_attn::{tensor3, AttentionBackend, Device};
use lantern_model::blocks::Activation as ModelActivation;
use lantern_model::compute::{AttentionCall, Compute};
use lantern_model::rope::{Rope, RopePairs};
use lantern_model::{LoadOptions, ModelError, Result};

use crate::backend::CudaBackend;
use crate::gpu::Gpu;
use crate::kernels::Activation;
use crate::pool::{Pool, Pooled};
use crate::CudaError;

/// The model's blocks on one GPU.
#[derive(Clone)]
pub struct CudaCompute {
    gpu: Arc<Gpu>,
    /// Activations and the bf16 copies products take, reused from step to step.
    acts: Arc<Pool<f32>>,
    halves: Arc<Pool<bf16>>,
}

/// `[rows, width]` activations on the device.
pub type GpuAct = Pooled<f32>;

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
}

/// One step's RoPE cos/sin on the device.
pub struct GpuRopeTable {
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
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

impl CudaCompute {
    pub fn new(gpu: Arc<Gpu>) -> Self {
        Self {
            acts: Pool::new(Arc::clone(&gpu)),
            halves: Pool::new(Arc::clone(&gpu)),
            gpu,
        }
    }

    fn act(&self, n: usize) -> Result<GpuAct> {
        self.acts.output(n).map_err(model_error)
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
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

    fn upload_matrix(
        &self,
        options: &LoadOptions,
        name: &str,
        tensors: &[QTensor],
    ) -> Result<GpuMatrix> {
        let (values, rows, cols) = Self::dequantized(name, tensors)?;
        let weight = if options.f32_weights {
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
        self.gpu.upload(&values).map_err(model_error)
    }

    fn rope_table(&self, rope: &Rope, positions: &[usize]) -> Result<GpuRopeTable> {
        let table = rope.table(positions);
        Ok(GpuRopeTable {
            cos: self.gpu.upload(table.cos()).map_err(model_error)?,
            sin: self.gpu.upload(table.sin()).map_err(model_error)?,
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
        let ids_dev = self.gpu.upload(ids).map_err(model_error)?;
        let mut out = self.act(ids.len() * hidden)?;
        let scale = scale.unwrap_or(1.0);
        match &table.weight {
            Weight::Bf16(w) => self.gpu.embed(w, &ids_dev, &mut *out, hidden, scale),
            Weight::F32(w) => self.gpu.embed(w, &ids_dev, &mut *out, hidden, scale),
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
        let k = w.in_features;
        Self::expect_len(&format!("`{}` input", w.name), x, rows * k)?;
        if widths.iter().sum::<usize>() != w.out_features {
            return Err(ModelError::Compute(format!(
                "`{}`: output widths {widths:?} do not add up to its {} rows",
                w.name, w.out_features
            )));
        }
        // Each part's rows of W are contiguous: one product per part, no split copy.
        let mut outputs = Vec::with_capacity(widths.len());
        let x_bf16 = match &w.weight {
            Weight::Bf16(_) => {
                let mut h = self.halves.output(x.len()).map_err(model_error)?;
                self.gpu
                    .cast_f32_to_bf16(&**x, &mut *h)
                    .map_err(model_error)?;
                Some(h)
            }
            Weight::F32(_) => None,
        };
        let mut row0 = 0;
        for &n in widths {
            let mut y = self.act(rows * n)?;
            let part = row0 * k..(row0 + n) * k;
            match (&w.weight, &x_bf16) {
                (Weight::Bf16(wb), Some(xb)) => {
                    self.gpu
                        .gemm_bf16(&**xb, &wb.slice(part), &mut *y, rows, n, k)
                }
                (Weight::F32(wf), _) => {
                    self.gpu
                        .gemm_f32(&**x, &wf.slice(part), &mut *y, rows, n, k)
                }
                (Weight::Bf16(_), None) => {
                    return Err(ModelError::Compute(format!(
                        "`{}`: bf16 weights without a bf16 input",
                        w.name
                    )))
                }
            }
            .map_err(model_error)?;
            outputs.push(y);
            row0 += n;
        }
        Ok(outputs)
    }

    fn out_features(&self, w: &GpuMatrix) -> usize {
        w.out_features
    }

    fn rms_norm(&self, x: &GpuAct, weight: &CudaSlice<f32>, eps: f32) -> Result<GpuAct> {
        let mut out = self.act(x.len())?;
        self.gpu
            .rms_norm(&**x, weight, &mut *out, eps)
            .map_err(model_error)?;
        Ok(out)
    }

    fn add(&self, acc: &mut GpuAct, x: &GpuAct) -> Result<()> {
        self.gpu.add_in_place(&mut **acc, &**x).map_err(model_error)
    }

    fn add_bias(&self, x: &mut GpuAct, bias: &CudaSlice<f32>) -> Result<()> {
        self.gpu.add_bias(&mut **x, bias).map_err(model_error)
    }

    fn act_mul(&self, act: ModelActivation, gate: &mut GpuAct, up: &GpuAct) -> Result<()> {
        let act = match act {
            ModelActivation::Silu => Activation::Silu,
            ModelActivation::GeluTanh => Activation::GeluTanh,
        };
        self.gpu
            .act_mul(&mut **gate, &**up, act)
            .map_err(model_error)
    }

    fn soft_cap(&self, x: &mut GpuAct, cap: f32) -> Result<()> {
        self.gpu.soft_cap(&mut **x, cap).map_err(model_error)
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
                &table.cos,
                &table.sin,
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
        let idx = self.gpu.upload(&idx).map_err(model_error)?;
        let mut out = self.act(rows.len() * width)?;
        self.gpu
            .gather_rows(&**x, &idx, &mut *out, width)
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
        let backend: &CudaBackend = as_cuda(call.backend)?;
        let out = backend.attend(call.spec, call.meta, &q, &k, &v, call.cache)?;
        let out = self.acts.adopt(out);
        // Capture: only a tap that wants this layer costs a copy to the host.
        if let Some(tap) = call.tap.filter(|t| t.wants_layer(call.layer)) {
            let (spec, tokens) = (call.spec, call.tokens);
            let dims = [tokens, spec.num_heads, spec.head_dim];
            let host = |b: &GpuAct| -> Result<lantern_attn::Tensor> {
                let values = self.gpu.download(&**b).map_err(model_error)?;
                Ok(tensor3(values, dims, &Device::Cpu)?)
            };
            tap.record(call.layer, &host(&q)?, &host(&out)?)?;
        }
        Ok(out)
    }

    fn to_host(&self, x: GpuAct) -> Result<Vec<f32>> {
        self.gpu.download(&*x).map_err(model_error)
    }

    /// Greedy rows are reduced here: one id per row crosses to the host, not the row.
    const PICKS_ON_DEVICE: bool = true;

    fn argmax_rows(&self, x: &GpuAct, width: usize) -> Result<Vec<u32>> {
        if width == 0 || !x.len().is_multiple_of(width) {
            return Err(ModelError::Compute(format!(
                "argmax_rows: {} values are not rows of {width}",
                x.len()
            )));
        }
        let mut ids = self
            .gpu
            .output::<u32>(x.len() / width)
            .map_err(model_error)?;
        self.gpu.argmax_rows(&**x, &mut ids).map_err(model_error)?;
        self.gpu.download(&ids).map_err(model_error)
    }
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
