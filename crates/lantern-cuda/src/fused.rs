//! Launchers of the fused kernels (`kernels/fused.cu`): a residual add with the RMS norm
//! after it, the gated activation read from one gate/up product, one product's output
//! split into its parts, and RoPE of queries and keys in one launch. Each checks its
//! buffers' lengths and answers [`crate::CudaError::Shape`] instead of launching.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;

use crate::error::{ensure, Result};
use crate::gpu::Gpu;
use crate::kernels::{elementwise_cfg, row_cfg, u32_of, Activation};

/// Most outputs [`Gpu::split_columns`] takes.
pub const MAX_SPLIT_PARTS: usize = 4;

impl Gpu {
    /// `out = x / sqrt(mean(x²) + eps) * weight` over rows of `weight.len()` values, and
    /// `out_bf16 = bf16(out)` when given (the next product's input, without a cast launch).
    pub fn rms_norm_twin(
        &self,
        x: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        out_bf16: Option<&mut CudaSlice<bf16>>,
        eps: f32,
    ) -> Result<()> {
        let (xp, _gx) = x.device_ptr(&self.stream);
        self.rms_norm_fused(xp, x.len(), None, weight, out, out_bf16, eps)
    }

    /// `x += delta`, then [`Gpu::rms_norm_twin`] of `x`: a residual add and the norm after
    /// it in one launch.
    pub fn add_rms_norm(
        &self,
        x: &mut CudaSlice<f32>,
        delta: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        out_bf16: Option<&mut CudaSlice<bf16>>,
        eps: f32,
    ) -> Result<()> {
        ensure(delta.len() == x.len(), || {
            format!(
                "add_rms_norm: x has {} values, delta {}",
                x.len(),
                delta.len()
            )
        })?;
        let n = x.len();
        let (xp, _gx) = x.device_ptr_mut(&self.stream);
        self.rms_norm_fused(xp, n, Some(delta), weight, out, out_bf16, eps)
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_norm_fused(
        &self,
        xp: u64,
        n: usize,
        delta: Option<&CudaSlice<f32>>,
        weight: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        out_bf16: Option<&mut CudaSlice<bf16>>,
        eps: f32,
    ) -> Result<()> {
        let width = weight.len();
        ensure(width > 0 && n.is_multiple_of(width), || {
            format!("rms_norm: {n} values are not rows of {width}")
        })?;
        ensure(out.len() == n, || {
            format!("rms_norm: x has {n} values, out {}", out.len())
        })?;
        ensure(out_bf16.as_ref().is_none_or(|o| o.len() == n), || {
            format!("rms_norm: x has {n} values, out_bf16 a different count")
        })?;
        let rows = n / width;
        if rows == 0 {
            return Ok(());
        }
        u32_of("rows", rows)?;
        let width32 = u32_of("width", width)?;
        let f = self.function("rms_norm_fused")?;
        let delta_ptr = delta.map(|d| d.device_ptr(&self.stream));
        let dp: u64 = delta_ptr.as_ref().map_or(0, |(p, _)| *p);
        let (wp, _gw) = weight.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let half_ptr = out_bf16.map(|o| o.device_ptr_mut(&self.stream));
        let hp: u64 = half_ptr.as_ref().map_or(0, |(p, _)| *p);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp)
            .arg(&dp)
            .arg(&wp)
            .arg(&op)
            .arg(&hp)
            .arg(&width32)
            .arg(&eps);
        // SAFETY: argument types and lengths match the kernel's signature; out is a buffer
        // of its own (a `&mut` distinct from x); x is written only when delta is given,
        // and then the caller holds it mutably.
        unsafe { b.launch(row_cfg(rows, width)) }?;
        Ok(())
    }

    /// `out = act(gate) * up` and `out_bf16 = bf16(out)`, where `gate_up` holds, per row,
    /// `width` gate values then `width` up values (one product of a stacked gate/up).
    pub fn act_mul_split(
        &self,
        gate_up: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        out_bf16: &mut CudaSlice<bf16>,
        width: usize,
        act: Activation,
    ) -> Result<()> {
        let n = out.len();
        ensure(
            width > 0 && n.is_multiple_of(width) && gate_up.len() == 2 * n && out_bf16.len() == n,
            || {
                format!(
                    "act_mul_split: gate_up {}, out {n}, out_bf16 {} values for rows of {width}",
                    gate_up.len(),
                    out_bf16.len()
                )
            },
        )?;
        if n == 0 {
            return Ok(());
        }
        let rows = (n / width) as u64;
        let width32 = u32_of("width", width)?;
        let act32: u32 = act.code();
        let f = self.function("act_mul_split")?;
        let (gp, _gg) = gate_up.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let (hp, _gh) = out_bf16.device_ptr_mut(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&gp)
            .arg(&op)
            .arg(&hp)
            .arg(&rows)
            .arg(&width32)
            .arg(&act32);
        // SAFETY: as above.
        unsafe { b.launch(elementwise_cfg(n)) }?;
        Ok(())
    }

    /// `x` (`[rows, Σ widths]`) split by columns into `outs` (`[rows, width]` each, at most
    /// [`MAX_SPLIT_PARTS`]), in order.
    pub fn split_columns(
        &self,
        x: &CudaSlice<f32>,
        rows: usize,
        outs: &mut [&mut CudaSlice<f32>],
    ) -> Result<()> {
        ensure(
            !outs.is_empty() && outs.len() <= MAX_SPLIT_PARTS && rows > 0,
            || {
                format!(
                    "split_columns: {} outputs of {rows} rows (1 to {MAX_SPLIT_PARTS})",
                    outs.len()
                )
            },
        )?;
        let mut widths = [0u32; MAX_SPLIT_PARTS];
        for (w, o) in widths.iter_mut().zip(outs.iter()) {
            ensure(o.len().is_multiple_of(rows), || {
                format!(
                    "split_columns: an output of {} values for {rows} rows",
                    o.len()
                )
            })?;
            *w = u32_of("width", o.len() / rows)?;
        }
        let total: usize = outs.iter().map(|o| o.len()).sum();
        ensure(x.len() == total, || {
            format!(
                "split_columns: x has {} values, the outputs {total}",
                x.len()
            )
        })?;
        let f = self.function("split_columns")?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let mut guards = Vec::with_capacity(outs.len());
        let mut ptrs = [0u64; MAX_SPLIT_PARTS];
        for (p, o) in ptrs.iter_mut().zip(outs.iter_mut()) {
            let (ptr, guard) = o.device_ptr_mut(&self.stream);
            *p = ptr;
            guards.push(guard);
        }
        let rows64 = rows as u64;
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp).arg(&rows64);
        for (p, w) in ptrs.iter().zip(&widths) {
            b.arg(p).arg(w);
        }
        // SAFETY: as above; an output of width 0 is never written.
        unsafe { b.launch(elementwise_cfg(total)) }?;
        drop(guards);
        Ok(())
    }

    /// Rotary embedding of queries `q` (`[tokens, q_heads, head_dim]`) and keys `k` (`[tokens,
    /// k_heads, head_dim]`) in one launch, as [`Gpu::rope`] does each.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_qk(
        &self,
        (q, q_heads): (&mut CudaSlice<f32>, usize),
        (k, k_heads): (&mut CudaSlice<f32>, usize),
        cos: &CudaSlice<f32>,
        sin: &CudaSlice<f32>,
        head_dim: usize,
        half: usize,
        adjacent: bool,
    ) -> Result<()> {
        ensure(2 * half <= head_dim, || {
            format!("rope_qk: half {half} does not fit head_dim {head_dim}")
        })?;
        if half == 0 {
            // No rotary dimensions (GPT-2's learned positions): nothing to turn.
            return Ok(());
        }
        ensure(q_heads > 0 && k_heads > 0, || "rope_qk: no heads".into())?;
        let tokens = q.len() / (q_heads * head_dim);
        ensure(
            q.len() == tokens * q_heads * head_dim
                && k.len() == tokens * k_heads * head_dim
                && cos.len() == tokens * half
                && sin.len() == tokens * half,
            || {
                format!(
                    "rope_qk: q {}, k {}, cos {}, sin {} values for {q_heads}/{k_heads} heads of {head_dim}",
                    q.len(),
                    k.len(),
                    cos.len(),
                    sin.len()
                )
            },
        )?;
        if tokens == 0 {
            return Ok(());
        }
        u32_of("tokens", tokens)?;
        let f = self.function("rope_qk")?;
        let (qp, _gq) = q.device_ptr_mut(&self.stream);
        let (kp, _gk) = k.device_ptr_mut(&self.stream);
        let (cp, _gc) = cos.device_ptr(&self.stream);
        let (sp, _gs) = sin.device_ptr(&self.stream);
        let (qh, kh) = (u32_of("q_heads", q_heads)?, u32_of("k_heads", k_heads)?);
        let (d32, half32) = (u32_of("head_dim", head_dim)?, u32_of("half", half)?);
        let adj = adjacent as u32;
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&qp).arg(&qh).arg(&kp).arg(&kh);
        b.arg(&cp).arg(&sp).arg(&d32).arg(&half32).arg(&adj);
        // SAFETY: as above.
        unsafe { b.launch(row_cfg(tokens, (q_heads + k_heads) * half)) }?;
        Ok(())
    }
}
