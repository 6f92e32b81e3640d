//! GGUF weights kept quantized on the device, in lantern-quant's blockwise form
//! ([`lantern_quant::Blockwise`]: plain quants, f32 scales per 32 values (16 for Q6_K),
//! mins per 32):
//! the small products read them as they are (gemv.cu's `BlockWeights`), larger products
//! take their rows dequantized to bf16 for cuBLAS, embeddings read their rows. A
//! dequantized value has the bits the CPU dequantizes it to.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;
use lantern_quant::{Blockwise, QuantType};

use crate::error::{ensure, Result};
use crate::gpu::Gpu;
use crate::kernels::{elementwise_cfg, u32_of};
use crate::launch::Launch;

/// A `[rows, cols]` matrix of a quantized GGUF type on the device.
pub struct DeviceBlocks {
    ty: QuantType,
    rows: usize,
    cols: usize,
    bits: u32,
    offset: i32,
    /// log2 of the values sharing a scale.
    scale_shift: u32,
    quants: CudaSlice<u8>,
    scales: CudaSlice<f32>,
    /// `None` for the types without mins (the kernels then add nothing).
    mins: Option<CudaSlice<f32>>,
}

impl DeviceBlocks {
    pub fn quant_type(&self) -> QuantType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Device bytes the matrix takes.
    pub fn size_bytes(&self) -> usize {
        self.quants.len() + 4 * (self.scales.len() + self.mins.as_ref().map_or(0, |m| m.len()))
    }

    /// The kernels' weight arguments (`q, scales, mins, offset, bits`), and the guards
    /// that keep the buffers' stream order until the launch.
    pub(crate) fn args<'a>(&'a self, gpu: &'a Gpu) -> (BlockArgs, BlockGuards<'a>) {
        let (q, gq) = self.quants.device_ptr(&gpu.stream);
        let (scales, gs) = self.scales.device_ptr(&gpu.stream);
        let mins = self.mins.as_ref().map(|m| m.device_ptr(&gpu.stream));
        let args = BlockArgs {
            q,
            scales,
            mins: mins.as_ref().map_or(0, |(p, _)| *p),
            offset: self.offset,
            bits: self.bits,
            scale_shift: self.scale_shift,
        };
        (args, (gq, gs, mins.map(|(_, g)| g)))
    }
}

/// A [`DeviceBlocks`]' kernel arguments.
pub(crate) struct BlockArgs {
    q: u64,
    scales: u64,
    mins: u64,
    offset: i32,
    bits: u32,
    scale_shift: u32,
}

impl BlockArgs {
    pub(crate) fn push<'a>(&'a self, b: &mut Launch<'a>) {
        b.arg(&self.q)
            .arg(&self.scales)
            .arg(&self.mins)
            .arg(&self.offset)
            .arg(&self.bits)
            .arg(&self.scale_shift);
    }
}

type Guard<'a> = cudarc::driver::SyncOnDrop<'a>;

pub(crate) type BlockGuards<'a> = (Guard<'a>, Guard<'a>, Option<Guard<'a>>);

impl Gpu {
    /// Copies a blockwise matrix to the device.
    pub fn upload_blocks(&self, form: &Blockwise) -> Result<DeviceBlocks> {
        let mins = if form.mins().is_empty() {
            None
        } else {
            Some(self.upload(form.mins())?)
        };
        Ok(DeviceBlocks {
            ty: form.quant_type(),
            rows: form.rows(),
            cols: form.cols(),
            bits: form.bits(),
            offset: form.offset(),
            scale_shift: form.scale_group().trailing_zeros(),
            quants: self.upload(form.quants())?,
            scales: self.upload(form.scales())?,
            mins,
        })
    }

    /// Rows `rows` of `w` as bf16 into `out` (`rows.len() · cols` values), for a product
    /// cuBLAS computes.
    pub fn dequantize_blocks_bf16(
        &self,
        w: &DeviceBlocks,
        rows: std::ops::Range<usize>,
        out: &mut impl DevicePtrMut<bf16>,
    ) -> Result<()> {
        ensure(rows.start <= rows.end && rows.end <= w.rows, || {
            format!("dequantize: rows {rows:?} of a matrix of {}", w.rows)
        })?;
        let n = rows.len() * w.cols;
        ensure(out.len() == n, || {
            format!("dequantize: out of {} values for {n}", out.len())
        })?;
        if n == 0 {
            return Ok(());
        }
        let (k, row0, count) = (
            u32_of("cols", w.cols)?,
            u32_of("row", rows.start)?,
            u32_of("rows", rows.len())?,
        );
        let f = self.function("dequantize_blocks_bf16")?;
        let (wa, _gw) = w.args(self);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        wa.push(&mut b);
        b.arg(&k).arg(&row0).arg(&count).arg(&op);
        // SAFETY: argument types match the kernel's signature; rows are whole multiples of
        // 8 values (cols is a multiple of 32), so the 4- and 8-byte quant loads are aligned.
        unsafe { b.launch(eighths_cfg(n)) }?;
        Ok(())
    }

    /// `out[t] = w[ids[t]] · scale` (a row of NaN for an id past the table; callers
    /// check ids first).
    pub fn embed_blocks(
        &self,
        w: &DeviceBlocks,
        ids: &impl DevicePtr<u32>,
        out: &mut impl DevicePtrMut<f32>,
        scale: f32,
    ) -> Result<()> {
        let n = ids.len() * w.cols;
        ensure(out.len() == n, || {
            format!(
                "embed: out has {} values, want {} x {}",
                out.len(),
                ids.len(),
                w.cols
            )
        })?;
        if n == 0 {
            return Ok(());
        }
        let (hidden, vocab, tokens) = (
            u32_of("hidden", w.cols)?,
            u32_of("vocab", w.rows)?,
            u32_of("tokens", ids.len())?,
        );
        let f = self.function("embed_blocks")?;
        let (wa, _gw) = w.args(self);
        let (ip, _gi) = ids.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        wa.push(&mut b);
        b.arg(&hidden)
            .arg(&vocab)
            .arg(&ip)
            .arg(&tokens)
            .arg(&scale)
            .arg(&op);
        // SAFETY: as above.
        unsafe { b.launch(eighths_cfg(n)) }?;
        Ok(())
    }
}

/// A grid-stride launch with one thread per 8 of `n` values.
fn eighths_cfg(n: usize) -> LaunchConfig {
    elementwise_cfg(n.div_ceil(8))
}
