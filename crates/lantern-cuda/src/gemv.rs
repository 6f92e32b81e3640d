//! Products of a few rows with bf16 or blockwise-quantized weights ([`GemvWeights`],
//! `kernels/gemv.cu`): a decode step's `x · Wᵀ` from f32 activations, without the cast
//! cuBLAS's bf16 GEMM needs (or, for GGUF weights, their dequantization), its output split into
//! parts or gated (a gated MLP's `act(gate) * up`) in the same launch, x RMS-normalized as
//! it is read and the output added to where asked ([`GemvExtras`]), each column shared
//! among 1, 2 or 4 warps ([`gemv_splits`]).

use std::sync::OnceLock;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};
use half::bf16;

use crate::blocks::{BlockArgs, BlockGuards, DeviceBlocks};
use crate::error::{ensure, Result};
use crate::gpu::Gpu;
use crate::kernels::{u32_of, Activation};
use crate::launch::Launch;

/// Most rows of x a small product takes (gemv.cu's GEMV_MAX_M): past it, every weight
/// loaded is read against more staged rows than shared memory serves at the weights' pace,
/// and cuBLAS's GEMM does better.
pub const GEMV_MAX_ROWS: usize = 4;
/// Most outputs [`Gpu::gemv`] splits into.
pub const GEMV_MAX_PARTS: usize = 3;
/// Output columns a block computes (gemv.cu's GEMV_COLUMNS), each by `splits` warps.
const GEMV_COLUMNS: usize = 8;
/// Most warps sharing one column (a block of at most 1,024 threads).
pub const GEMV_MAX_SPLITS: usize = 4;
/// Warps a multiprocessor holds at once (compute capability 8.0 and later).
const WARPS_PER_SM: usize = 64;
/// Fewest weights a split reads per column (two 16-byte loads a lane).
const MIN_SPLIT_LEN: usize = 512;
/// f32 values of x a block stages at once: 47 KiB, leaving the kernels' static shared
/// memory (block sums, row scales) room under the 48 KiB a block has without an opt-in.
const GEMV_STAGED: usize = 12 * 1024 - 256;

/// The weights `[n, k]` of a small product.
#[derive(Clone, Copy)]
pub enum GemvWeights<'a> {
    /// bf16, row-major.
    Bf16(&'a CudaSlice<bf16>),
    /// A GGUF matrix in lantern-quant's blockwise form.
    Blocks(&'a DeviceBlocks),
}

impl GemvWeights<'_> {
    fn len(&self) -> usize {
        match self {
            Self::Bf16(w) => w.len(),
            Self::Blocks(w) => w.rows() * w.cols(),
        }
    }

    /// Whether rows of `k` values are the matrix's own (blocks know their width).
    fn has_rows_of(&self, k: usize) -> bool {
        match self {
            Self::Bf16(_) => true,
            Self::Blocks(w) => w.cols() == k,
        }
    }

    /// The kernels for these weights: the plain product and the gated one.
    fn kernels(&self) -> (&'static str, &'static str) {
        match self {
            Self::Bf16(_) => ("gemv_bf16", "gemv_gated_bf16"),
            Self::Blocks(_) => ("gemv_blocks", "gemv_gated_blocks"),
        }
    }
}

/// A [`GemvWeights`]' kernel arguments: the bf16 rows' pointer, or the blocks'.
enum WeightArgs {
    Bf16(u64),
    Blocks(BlockArgs),
}

impl WeightArgs {
    fn push<'a>(&'a self, b: &mut Launch<'a>) {
        match self {
            Self::Bf16(p) => {
                b.arg(p);
            }
            Self::Blocks(a) => a.push(b),
        }
    }
}

/// Whether a product of `rows` rows over `k` inputs takes the small-product kernels (its
/// 8-value weight loads need rows of a multiple of 8 values).
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
    /// Warps per output column (1, 2 or 4); `None`: [`gemv_splits`] for the device.
    pub splits: Option<usize>,
}

impl GemvExtras<'_> {
    fn check(&self, k: usize) -> Result<()> {
        if let Some((w, _)) = self.norm {
            ensure(w.len() == k, || {
                format!("gemv: a norm of {} values for rows of {k}", w.len())
            })?;
        }
        ensure(
            self.splits
                .is_none_or(|s| s.is_power_of_two() && s <= GEMV_MAX_SPLITS),
            || format!("gemv: {:?} splits (1, 2 or 4)", self.splits),
        )
    }

    /// The splits to launch with for `columns` columns over `k` inputs.
    fn splits_for(&self, gpu: &Gpu, columns: usize, k: usize) -> usize {
        match self.splits {
            Some(s) => s,
            None if splits_switched_off() => 1,
            None => gemv_splits(columns, k, gpu.sm_count()),
        }
    }
}

/// Warps per output column for a product of `columns` columns over `k` inputs on a device
/// of `sms` multiprocessors: doubled (up to 4) while the warps still fit on the device at
/// once and each split still reads MIN_SPLIT_LEN weights, so that a product of few, long
/// columns keeps more loads in flight. `LANTERN_CUDA_GEMV_SPLITS=off` keeps one.
pub fn gemv_splits(columns: usize, k: usize, sms: usize) -> usize {
    let mut splits = 1;
    while splits < GEMV_MAX_SPLITS
        && columns * splits * 2 <= sms * WARPS_PER_SM
        && k / (2 * splits) >= MIN_SPLIT_LEN
    {
        splits *= 2;
    }
    splits
}

fn splits_switched_off() -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    *OFF.get_or_init(|| {
        std::env::var("LANTERN_CUDA_GEMV_SPLITS")
            .is_ok_and(|v| matches!(v.trim(), "off" | "0" | "false"))
    })
}

fn cfg(columns: usize, rows: usize, tile: usize, splits: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (columns.div_ceil(GEMV_COLUMNS) as u32, 1, 1),
        block_dim: ((32 * GEMV_COLUMNS * splits) as u32, 1, 1),
        shared_mem_bytes: (rows * tile * 4) as u32,
    }
}

impl Gpu {
    /// `x · Wᵀ` for x `[m, k]` f32 (`m` in 1..=4, `k` a multiple of 8) and W `[n, k]`,
    /// into `outs` by columns: the first takes columns `[0, w0)` (`[m, w0]`), the next the
    /// following ones, up to three, their widths adding up to `n`; with `extras`' norm
    /// and accumulation.
    pub fn gemv(
        &self,
        x: &impl DevicePtr<f32>,
        w: GemvWeights<'_>,
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
        ensure(w.len() == n * k && w.has_rows_of(k), || {
            format!("gemv: w of {} values for {n} rows of {k}", w.len())
        })?;
        extras.check(k)?;
        let (m32, n32, k32) = (m as u32, u32_of("n", n)?, u32_of("k", k)?);
        let tile = tile(m, k);
        let tile32 = tile as u32;
        let f = self.function(w.kernels().0)?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wa, _gw) = self.weight_args(w);
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
        b.arg(&xp);
        wa.push(&mut b);
        b.arg(&m32).arg(&n32).arg(&k32).arg(&tile32);
        for (p, wd) in ptrs.iter().zip(&widths) {
            b.arg(p).arg(wd);
        }
        let norm = extras
            .norm
            .map(|(nw, eps)| (nw.device_ptr(&self.stream), eps));
        let (norm_ptr, eps) = norm.as_ref().map_or((0, 0.0), |((p, _), e)| (*p, *e));
        let accumulate = extras.accumulate as u32;
        let splits = extras.splits_for(self, n, k);
        let splits32 = splits as u32;
        b.arg(&norm_ptr).arg(&eps).arg(&accumulate).arg(&splits32);
        // SAFETY: argument types and lengths match the kernel's signature; W's rows start
        // aligned for its 8-value loads (k a multiple of 8, device buffers 256-byte
        // aligned).
        unsafe { b.launch(cfg(n, m, tile, splits)) }?;
        drop(guards);
        Ok(())
    }

    /// A gated MLP's `act(gate) * up` for x `[m, k]` f32 and W `[2 * width, k]` (gate
    /// rows, then up rows), into out `[m, width]`, with `extras`' norm and splits (it
    /// cannot accumulate).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_gated(
        &self,
        x: &impl DevicePtr<f32>,
        w: GemvWeights<'_>,
        m: usize,
        k: usize,
        out: &mut CudaSlice<f32>,
        act: Activation,
        extras: GemvExtras<'_>,
    ) -> Result<()> {
        ensure(gemv_fits(m, k) && x.len() == m * k, || {
            format!("gemv_gated: x of {} values as {m} rows of {k}", x.len())
        })?;
        let width = out.len() / m;
        ensure(
            out.len() == m * width && w.len() == 2 * width * k && w.has_rows_of(k),
            || {
                format!(
                    "gemv_gated: w of {} values and out of {} for {m} rows of {k}",
                    w.len(),
                    out.len()
                )
            },
        )?;
        extras.check(k)?;
        ensure(!extras.accumulate, || {
            "gemv_gated: accumulating into a gated output".into()
        })?;
        let (m32, f32_, k32) = (m as u32, u32_of("width", width)?, u32_of("k", k)?);
        let tile = tile(m, k);
        let tile32 = tile as u32;
        let act32: u32 = act.code();
        let f = self.function(w.kernels().1)?;
        let (xp, _gx) = x.device_ptr(&self.stream);
        let (wa, _gw) = self.weight_args(w);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&xp);
        wa.push(&mut b);
        b.arg(&m32)
            .arg(&f32_)
            .arg(&k32)
            .arg(&tile32)
            .arg(&op)
            .arg(&act32);
        let norm = extras
            .norm
            .map(|(nw, eps)| (nw.device_ptr(&self.stream), eps));
        let (norm_ptr, eps) = norm.as_ref().map_or((0, 0.0), |((p, _), e)| (*p, *e));
        let splits = extras.splits_for(self, width, k);
        let splits32 = splits as u32;
        b.arg(&norm_ptr).arg(&eps).arg(&splits32);
        // SAFETY: as above.
        unsafe { b.launch(cfg(width, m, tile, splits)) }?;
        Ok(())
    }
}

/// What keeps a [`GemvWeights`]' buffers in stream order until its launch.
enum WeightGuards<'a> {
    Bf16 {
        _guard: cudarc::driver::SyncOnDrop<'a>,
    },
    Blocks {
        _guards: BlockGuards<'a>,
    },
}

impl Gpu {
    fn weight_args<'a>(&'a self, w: GemvWeights<'a>) -> (WeightArgs, WeightGuards<'a>) {
        match w {
            GemvWeights::Bf16(w) => {
                let (p, _guard) = w.device_ptr(&self.stream);
                (WeightArgs::Bf16(p), WeightGuards::Bf16 { _guard })
            }
            GemvWeights::Blocks(w) => {
                let (a, _guards) = w.args(self);
                (WeightArgs::Blocks(a), WeightGuards::Blocks { _guards })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_with_few_columns_split_them_over_more_warps() {
        // An H200's 132 multiprocessors: a 1B model's narrow, long products split...
        assert_eq!(gemv_splits(2048, 8192, 132), 4, "down");
        assert_eq!(gemv_splits(3072, 2048, 132), 2, "q/k/v");
        // ...wide ones, short rows and the LM head do not.
        assert_eq!(gemv_splits(8192, 2048, 132), 1, "gate/up");
        assert_eq!(
            gemv_splits(960, 576, 132),
            1,
            "SmolLM2's q/k/v: rows too short"
        );
        assert_eq!(gemv_splits(49152, 2048, 132), 1, "LM head");
        for (columns, k) in [(1, 1 << 20), (33, 8192), (4096, 4096)] {
            let s = gemv_splits(columns, k, 132);
            assert!(
                s.is_power_of_two() && s <= GEMV_MAX_SPLITS,
                "{columns} x {k}: {s}"
            );
            assert!(s == 1 || k / s >= MIN_SPLIT_LEN, "{columns} x {k}: {s}");
        }
    }

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
