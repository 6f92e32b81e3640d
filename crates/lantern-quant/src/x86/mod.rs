//! x86-64 kernels: one module per level, sharing the register-tile driver.

pub(crate) mod amx;
pub(crate) mod amx_bf16;
pub(crate) mod avx2;
pub(crate) mod avx512;
pub mod bf16_tiles;
pub(crate) mod bf16dot;
pub(crate) mod dense;

use crate::act::QuantAct;
use crate::{Dst, Kernel, PackedMatrix, BLOCK, PANEL};

/// Whether the CPU runs the AVX2 level.
pub(crate) fn avx2_available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Whether the CPU runs the AVX-VNNI level.
pub(crate) fn avx_vnni_available() -> bool {
    avx2_available() && is_x86_feature_detected!("avxvnni")
}

/// Whether the CPU runs the AVX-512 level.
pub(crate) fn avx512_available() -> bool {
    avx2_available()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// Whether the CPU runs the AVX-512 BF16 level.
pub(crate) fn avx512_bf16_available() -> bool {
    avx512_available() && is_x86_feature_detected!("avx512bf16")
}

/// Pointers and strides of one register tile (panels `P` x tokens `T`).
#[derive(Clone, Copy)]
pub(crate) struct TileArgs {
    /// Quants of the first panel of the tile, block 0.
    pub qs: *const u8,
    /// Scales of the first panel of the tile, block 0.
    pub sc: *const u8,
    /// Bytes between consecutive panels' quants / scales.
    pub q_panel: usize,
    pub s_panel: usize,
    pub nb: usize,
    /// Activation bytes of the first token of the tile, block 0 (token stride nb·32).
    pub aq: *const u8,
    /// Per-(token, block) activation d, s and integer sums of the first token.
    pub ad: *const f32,
    pub as_: *const f32,
    pub isum: *const [i32; 2],
    /// dst element (first token, first row of the tile) and the dst row stride (n).
    pub out: *mut f32,
    pub ldo: usize,
    /// Rows of each panel of the tile that exist (the rest are padding, never stored).
    pub valid: [usize; 4],
}

/// How far ahead of a decode tile's current block its weights are prefetched, in bytes
/// per panel. A single token uses every weight byte once, so the products stream the
/// matrices from memory; the hardware prefetchers lose each panel's stream at the page
/// ends, and prefetching ~2 KB ahead measured 15-20% faster layer products at m = 1
/// (`quant_bench --decode`, Zen 5).
pub(crate) const PREFETCH_BYTES: usize = 2048;

/// Prefetches the quants `PREFETCH_BYTES` ahead of block `b` of each of the tile's `panels`
/// panels (record `qbp` bytes) into L2 (`T1`); past a panel's end that is the next panel's
/// start, which the next tile reads. Into L1 (`T0`) the same prefetches made batch-1
/// decode 14-21% slower on Zen 4 (paired in one process, SmolLM2 Q4_1 and a 1B Q4_0, 1
/// and 2 threads, decode tiles of 4 panels then), slower than none at all.
#[inline(always)]
pub(crate) fn prefetch_ahead(a: &TileArgs, panels: usize, b: usize, qbp: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    let ahead = (PREFETCH_BYTES / qbp).max(1) * qbp;
    for p in 0..panels {
        // `wrapping_add` keeps an address past the matrix's end (the last blocks'
        // targets) free of pointer-arithmetic UB.
        let at = a.qs.wrapping_add(p * a.q_panel + b * qbp + ahead);
        for l in 0..qbp / 64 {
            // SAFETY: a prefetch never faults, whatever the address; SSE is baseline x86-64.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(at.wrapping_add(64 * l).cast()) };
        }
    }
}

/// Register tile shapes of a level: panels per tile for a task of `tokens` tokens, and
/// the most tokens per tile.
struct Shapes {
    panels: fn(usize) -> usize,
    max_tokens: usize,
}

/// Panels of `mat`'s register tile for a single token at `level` (a SIMD level): the
/// fewest a single-token chunk holds so that its tiles are whole.
pub(crate) fn single_token_tile_panels(level: Kernel, mat: &PackedMatrix) -> usize {
    if mat.ty.is_dense() {
        return dense::tile_shape(level, mat.ty, 1).0;
    }
    match level.vectors() {
        Kernel::Avx512 => (avx512::SHAPES.panels)(1),
        _ => (avx2::SHAPES.panels)(1),
    }
}

/// Computes dst for panels `p0..p1` and tokens `t0..t1` at `level` (a SIMD level).
///
/// # Safety
/// The CPU supports `level`; `dst` holds rows `p0·16..` of every token in `t0..t1` and
/// no other thread writes this rectangle.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run_tile(
    level: Kernel,
    mat: &PackedMatrix,
    act: &QuantAct,
    p0: usize,
    p1: usize,
    t0: usize,
    t1: usize,
    dst: Dst,
) {
    debug_assert_eq!(
        act.layout,
        crate::act::Layout::Tokens,
        "the vector tiles read tokens"
    );
    let shapes = match level.vectors() {
        Kernel::Avx512 => avx512::SHAPES,
        _ => avx2::SHAPES,
    };
    let nb = mat.nb;
    let pw = (shapes.panels)(t1 - t0);
    let mut p = p0;
    while p < p1 {
        let left = p1 - p;
        let pc = if left >= pw {
            pw
        } else if left >= 2 {
            2
        } else {
            1
        };
        let mut valid = [0usize; 4];
        for (i, v) in valid.iter_mut().enumerate().take(pc) {
            *v = mat.valid_rows(p + i);
        }
        let mut t = t0;
        while t < t1 {
            let tc = (t1 - t).min(shapes.max_tokens);
            let args = TileArgs {
                qs: mat.quant_ptr(p),
                sc: mat.scale_ptr(p),
                q_panel: nb * mat.ty.packed_quant_bytes(),
                s_panel: nb / mat.ty.scale_unit() * mat.ty.packed_scale_bytes(),
                nb,
                aq: act.q.as_ptr().add(t * nb * BLOCK),
                ad: act.d.as_ptr().add(t * nb),
                as_: act.s.as_ptr().add(t * nb),
                isum: act.isum.as_ptr().add(t * nb),
                out: dst.at(t, p * PANEL),
                ldo: dst.ldo,
                valid,
            };
            match level.vectors() {
                Kernel::Avx512 => avx512::dispatch(mat.ty, pc, tc, args),
                Kernel::AvxVnni => avx2::dispatch_vnni(mat.ty, pc, tc, args),
                _ => avx2::dispatch(mat.ty, pc, tc, args),
            }
            t += tc;
        }
        p += pc;
    }
}

/// Expands to a `match` over (panels, tokens, type) calling `$tile::<TYPE, P, T>(args)`.
macro_rules! dispatch_shapes {
    ($tile:ident, $ty:expr, $pc:expr, $tc:expr, $args:expr; $(($p:literal, $t:literal)),*) => {{
        use $crate::QuantType as Q;
        match ($pc, $tc) {
            $(
                ($p, $t) => match $ty {
                    Q::Q4_0 => $tile::<{ Q::Q4_0 as u8 }, $p, $t>($args),
                    Q::Q4_1 => $tile::<{ Q::Q4_1 as u8 }, $p, $t>($args),
                    Q::Q5_0 => $tile::<{ Q::Q5_0 as u8 }, $p, $t>($args),
                    Q::Q5_1 => $tile::<{ Q::Q5_1 as u8 }, $p, $t>($args),
                    Q::Q8_0 => $tile::<{ Q::Q8_0 as u8 }, $p, $t>($args),
                    Q::Q4K => $tile::<{ Q::Q4K as u8 }, $p, $t>($args),
                    Q::Q5K => $tile::<{ Q::Q5K as u8 }, $p, $t>($args),
                    Q::Q6K => $tile::<{ Q::Q6K as u8 }, $p, $t>($args),
                    Q::Q3K => $tile::<{ Q::Q3K as u8 }, $p, $t>($args),
                    Q::F16 | Q::BF16 | Q::F32 => unreachable!("dense types run in x86::dense"),
                },
            )*
            _ => unreachable!("tile shape {}x{}", $pc, $tc),
        }
    }};
}
pub(crate) use dispatch_shapes;
