//! Products of a few rows with bf16 weights (`kernels/gemv.cu`): a decode step's `x · Wᵀ`
//! from f32 activations, without the cast cuBLAS's bf16 GEMM needs, its output split into
//! parts or gated (a gated MLP's `act(gate) * up`) in the same launch.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use crate::error::{ensure, Result};
use crate::gpu::Gpu;
use crate::kernels::{u32_of, Activation};

/// Most rows of x a small product takes (gemv.cu's GEMV_MAX_M): past it, every weight
/// loaded is read against more staged rows than shared memory serves at the weights' pace,
/// and cuBLAS's GEMM does better.
pub const GEMV_MAX_ROWS: usize = 4;
/// Most outputs [`Gpu::gemv_bf16`] splits into.
pub const GEMV_MAX_PARTS: usize = 3;
const GEMV_WARPS: usize = 8;
/// f32 values of x a block stages at once: 47 KiB, leaving the kernels' static shared
/// memory (block sums, row scales) room under the 48 KiB a block has without an opt-in.
const GEMV_STAGED: usize = 12 * 1024 - 256;

/// Whether a product of `rows` rows over `k` inputs takes the small-product kernels (its
/// 16-byte weight loads need rows of a multiple of 8 values).
pub fn gemv_fits(rows: usize, k: usize) -> bool {
    (1..=GEMV_MAX_ROWS).contains(&rows) && k > 0 && k.is_multiple_of(8)
}

/// Columns of x staged per tile: all of k where it fits, else the most that does (a
/// multiple of 8, as the loads need).
fn tile(rows: usize, k: usize) -> usize {
    k.min(GEMV_STAGED / rows.max(1) / 8 * 8)
}

/// What a small product does besides `x · Wᵀ`.
#[derive(Clone, Copy, Debug, Default)]
pub struct GemvExtras<'a> {
    /// RMS-normalizes each row of x as it is read: `x / sqrt(mean(x²) + eps) * weight`
    /// (weight `[k]`), the norm that would otherwise be a launch of its own.
    pub norm: Option<(&'a CudaSlice<f32>, f32)>,
    /// Adds the product to the outputs instead of writing them (a residual add).
    pub accumulate: bool,
}

impl GemvExtras<'_> {
    fn check(&self, k: usize) -> Result<()> {
        if let Some((w, _)) = self.norm {
            ensure(w.len() == k, || {
                format!("gemv: a norm of {} values for rows of {k}", w.len())
            })?;
        }
        Ok(())
    }
}

fn cfg(columns: usize, rows: usize, tile: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (columns.div_ceil(GEMV_WARPS) as u32, 1, 1),
        block_dim: (32 * GEMV_WARPS as u32, 1, 1),
        shared_mem_bytes: (rows * tile * 4) as u32,
    }
}

impl Gpu {
    /// `x · Wᵀ` for x `[m, k]` f32 (`m` in 1..=4, `k` a multiple of 8) and W `[n, k]` bf16,
    /// into `outs` by columns: the first takes columns `[0, w0)` (`[m, w0]`), the next the
    /// following ones, up to three, their widths adding up to `n`; with `extras`' norm
    /// and accumulation.
    pub fn gemv_bf16(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<bf16>,
        m: usize,
        k: usize,
        outs: &mut [&mut CudaSlice<f32>],
        extras: GemvExtras<'_>,
    ) -> Result<()> {
        ensure(gemv_fits(m, k) && x.len() == m * k, || {
            format!("gemv: x of {} values as {m} rows of {k}", x.len())
        })?;
        ensure(!outs.is_empty() && outs.len() <= GEMV_MAX_PARTS, || {
            format!("gemv: {} outputs (1 to {GEMV_MAX_PARTS})", outs.len())
        })?;
        let mut widths = [0u32; GEMV_MAX_PARTS];
        for (wd, o) in widths.iter_mut().zip(outs.iter()) {
            ensure(o.len().is_multiple_of(m), || {
                format!("gemv: an output of {} values for {m} rows", o.len())
            })?;
            *wd = u32_of("width", o.len() / m)?;
        }
        let n: usize = widths.iter().map(|&wd| wd as usize).sum();
        ensure(w.len() == n * k, || {
            format!("gemv: w of {} values for {n} rows of {k}", w.len())
        })?;
        extras.check(k)?;
        let (m32, n32, k32) = (m as u32, u32_of("n", n)?, u32_of("k", k)?);
        let tile = tile(m, k);
        let tile32 = tile as u32;
        let f = self.function("gemv_bf16")?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = w.device_ptr(&self.stream);
        let mut guards = Vec::with_capacity(outs.len());
        let mut ptrs = [0u64; GEMV_MAX_PARTS];
        for (p, o) in ptrs.iter_mut().zip(outs.iter_mut()) {
            let (ptr, guard) = o.device_ptr_mut(&self.stream);
            *p = ptr;
            guards.push(guard);
        }
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp)
            .arg(&wp)
            .arg(&m32)
            .arg(&n32)
            .arg(&k32)
            .arg(&tile32);
        for (p, wd) in ptrs.iter().zip(&widths) {
            b.arg(p).arg(wd);
        }
        let norm = extras
            .norm
            .map(|(nw, eps)| (nw.device_ptr(&self.stream), eps));
        let (norm_ptr, eps) = norm.as_ref().map_or((0, 0.0), |((p, _), e)| (*p, *e));
        let accumulate = extras.accumulate as u32;
        b.arg(&norm_ptr).arg(&eps).arg(&accumulate);
        // SAFETY: argument types and lengths match the kernel's signature; W's rows start
        // 16-byte aligned (k a multiple of 8, device buffers 256-byte aligned).
        unsafe { b.launch(cfg(n, m, tile)) }?;
        drop(guards);
        Ok(())
    }

    /// A gated MLP's `act(gate) * up` for x `[m, k]` f32 and W `[2 * width, k]` bf16 (gate
    /// rows, then up rows), into out `[m, width]`; x normalized as it is read where `norm`
    /// (weight `[k]`, eps) is given ([`GemvExtras::norm`]).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_gated_bf16(
        &self,
        x: &impl DevicePtr<f32>,
        w: &impl DevicePtr<bf16>,
        m: usize,
        k: usize,
        out: &mut CudaSlice<f32>,
        act: Activation,
        norm: Option<(&CudaSlice<f32>, f32)>,
    ) -> Result<()> {
        ensure(gemv_fits(m, k) && x.len() == m * k, || {
            format!("gemv_gated: x of {} values as {m} rows of {k}", x.len())
        })?;
        let width = out.len() / m;
        ensure(out.len() == m * width && w.len() == 2 * width * k, || {
            format!(
                "gemv_gated: w of {} values and out of {} for {m} rows of {k}",
                w.len(),
                out.len()
            )
        })?;
        GemvExtras {
            norm,
            accumulate: false,
        }
        .check(k)?;
        let (m32, f32_, k32) = (m as u32, u32_of("width", width)?, u32_of("k", k)?);
        let tile = tile(m, k);
        let tile32 = tile as u32;
        let act32: u32 = act.code();
        let f = self.function("gemv_gated_bf16")?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wp, _gw) = w.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp)
            .arg(&wp)
            .arg(&m32)
            .arg(&f32_)
            .arg(&k32)
            .arg(&tile32)
            .arg(&op)
            .arg(&act32);
        let norm = norm.map(|(nw, eps)| (nw.device_ptr(&self.stream), eps));
        let (norm_ptr, eps) = norm.as_ref().map_or((0, 0.0), |((p, _), e)| (*p, *e));
        b.arg(&norm_ptr).arg(&eps);
        // SAFETY: as above.
        unsafe { b.launch(cfg(width, m, tile)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_48k_and_keep_the_loads_aligned() {
        for rows in 1..=GEMV_MAX_ROWS {
            for k in [8, 576, 2048, 8192, 12288, 20000, 65536] {
                let t = tile(rows, k);
                assert!(
                    t > 0 && t <= k && t.is_multiple_of(8) || t == k,
                    "rows {rows} k {k}: {t}"
                );
                assert!(rows * t * 4 <= 48 * 1024, "rows {rows} k {k}: {t}");
            }
        }
        assert_eq!(
            tile(1, 8192),
            8192,
            "one tile for a 1B model's widest input"
        );
    }
}
