//! AVX-512 VNNI kernels (see the crate docs for the layout and the arithmetic).

// The register tiles are small fixed-size arrays indexed by (panel, token); index loops
// read more clearly than iterator chains here and compile to the same unrolled code.
#![allow(clippy::needless_range_loop)]

use crate::act::{block_scale, QuantAct};
use crate::{PackedMatrix, QuantType, BLOCK, PANEL};
use std::arch::x86_64::*;

/// Whether the CPU runs these kernels.
pub(crate) fn available() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// SIMD activation quantization: the same operations as
/// [`crate::act::quantize_block_scalar`] (max of |x|, one scalar division, one scalar
/// reciprocal, multiply, round half to even, clamp), so the same bytes.
///
/// # Safety
/// The CPU must support AVX-512 F/BW.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
pub(crate) unsafe fn quantize_block(x: &[f32; BLOCK], q: &mut [u8; BLOCK]) -> (f32, i32) {
    let x0 = _mm512_loadu_ps(x.as_ptr());
    let x1 = _mm512_loadu_ps(x.as_ptr().add(16));
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
    let (d, id) = block_scale(amax);
    let vid = _mm512_set1_ps(id);
    let lo = _mm512_set1_ps(-127.0);
    let hi = _mm512_set1_ps(127.0);
    // 0x08: round to nearest even, suppress exceptions.
    let r0 = _mm512_roundscale_ps::<0x08>(_mm512_mul_ps(x0, vid));
    let r1 = _mm512_roundscale_ps::<0x08>(_mm512_mul_ps(x1, vid));
    let i0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r0, lo), hi));
    let i1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r1, lo), hi));
    _mm_storeu_si128(q.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(i0));
    _mm_storeu_si128(q.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(i1));
    let isum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
    (d, isum)
}

/// Pointers and strides shared by the tile kernels.
#[derive(Clone, Copy)]
struct TileArgs {
    /// Quants of the first panel of the tile, block 0.
    qs: *const u8,
    /// Scales of the first panel of the tile, block 0.
    sc: *const u8,
    /// Bytes between consecutive panels' quants / scales.
    q_panel: usize,
    s_panel: usize,
    nb: usize,
    /// Activation bytes of the first token of the tile, block 0 (token stride nb·32).
    aq: *const u8,
    /// Per-(token, block) activation d, s and Q8_0 correction of the first token.
    ad: *const f32,
    as_: *const f32,
    ac: *const i32,
    /// dst element (first token, first row of the tile) and the dst row stride (n).
    out: *mut f32,
    ldo: usize,
}

#[inline(always)]
unsafe fn bcast4(p: *const u8) -> __m512i {
    _mm512_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// `Q4_1` register tile: `P` panels (16 rows each) x `T` tokens.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn tile_q4_1<const P: usize, const T: usize>(a: TileArgs, masks: [u16; P]) {
    let nb = a.nb;
    let low = _mm512_set1_epi8(0x0F);
    let mut accf = [[_mm512_setzero_ps(); T]; P];
    for b in 0..nb {
        let mut acci = [[_mm512_setzero_si512(); T]; P];
        for c in 0..4 {
            let mut wlo = [_mm512_setzero_si512(); P];
            let mut whi = [_mm512_setzero_si512(); P];
            for p in 0..P {
                let w = _mm512_load_si512(a.qs.add(p * a.q_panel + b * 256 + c * 64).cast());
                wlo[p] = _mm512_and_si512(w, low);
                whi[p] = _mm512_and_si512(_mm512_srli_epi16::<4>(w), low);
            }
            for t in 0..T {
                let ab = a.aq.add((t * nb + b) * BLOCK);
                let alo = bcast4(ab.add(4 * c));
                let ahi = bcast4(ab.add(16 + 4 * c));
                for p in 0..P {
                    acci[p][t] = _mm512_dpbusd_epi32(acci[p][t], wlo[p], alo);
                    acci[p][t] = _mm512_dpbusd_epi32(acci[p][t], whi[p], ahi);
                }
            }
        }
        for p in 0..P {
            let s = a.sc.add(p * a.s_panel + b * 64);
            let dw = _mm512_cvtph_ps(_mm256_load_si256(s.cast()));
            let mw = _mm512_cvtph_ps(_mm256_load_si256(s.add(32).cast()));
            for t in 0..T {
                let da = _mm512_set1_ps(*a.ad.add(t * nb + b));
                let sa = _mm512_set1_ps(*a.as_.add(t * nb + b));
                let dd = _mm512_mul_ps(dw, da);
                accf[p][t] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(acci[p][t]), accf[p][t]);
                accf[p][t] = _mm512_fmadd_ps(mw, sa, accf[p][t]);
            }
        }
    }
    for p in 0..P {
        for t in 0..T {
            _mm512_mask_storeu_ps(a.out.add(t * a.ldo + p * PANEL), masks[p], accf[p][t]);
        }
    }
}

/// `Q8_0` register tile: `P` panels (16 rows each) x `T` tokens.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn tile_q8_0<const P: usize, const T: usize>(a: TileArgs, masks: [u16; P]) {
    let nb = a.nb;
    let mut accf = [[_mm512_setzero_ps(); T]; P];
    for b in 0..nb {
        let mut acci = [[_mm512_setzero_si512(); T]; P];
        for t in 0..T {
            let corr = _mm512_set1_epi32(*a.ac.add(t * nb + b));
            for p in 0..P {
                acci[p][t] = corr;
            }
        }
        for c in 0..8 {
            let mut w = [_mm512_setzero_si512(); P];
            for p in 0..P {
                w[p] = _mm512_load_si512(a.qs.add(p * a.q_panel + b * 512 + c * 64).cast());
            }
            for t in 0..T {
                let av = bcast4(a.aq.add((t * nb + b) * BLOCK + 4 * c));
                for p in 0..P {
                    acci[p][t] = _mm512_dpbusd_epi32(acci[p][t], w[p], av);
                }
            }
        }
        for p in 0..P {
            let s = a.sc.add(p * a.s_panel + b * 32);
            let dw = _mm512_cvtph_ps(_mm256_load_si256(s.cast()));
            for t in 0..T {
                let da = _mm512_set1_ps(*a.ad.add(t * nb + b));
                let dd = _mm512_mul_ps(dw, da);
                accf[p][t] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(acci[p][t]), accf[p][t]);
            }
        }
    }
    for p in 0..P {
        for t in 0..T {
            _mm512_mask_storeu_ps(a.out.add(t * a.ldo + p * PANEL), masks[p], accf[p][t]);
        }
    }
}

/// Register tile shape for a task with `tokens` tokens: panels per tile (decode and tiny
/// batches take more panels for independent dependency chains; larger batches take
/// fewer panels and up to 4 tokens, which reuses each weight register 4 times).
///
/// Only (4, 1..=2) tiles are used with 4 panels (see the `dispatch` arms).
fn panels_per_tile(tokens: usize) -> usize {
    if tokens <= 2 {
        4
    } else {
        2
    }
}

const MAX_T: usize = 4;

/// Computes dst for panels `p0..p1` and tokens `t0..t1`.
///
/// # Safety
/// The CPU supports the kernels ([`available`]); `dst` points to an `m x n` f32 buffer and
/// no other thread writes this rectangle.
pub(crate) unsafe fn run_tile(
    mat: &PackedMatrix,
    act: &QuantAct,
    p0: usize,
    p1: usize,
    t0: usize,
    t1: usize,
    dst: *mut f32,
) {
    let nb = mat.nb;
    let pw = panels_per_tile(t1 - t0);
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
        let mut masks = [0u16; 4];
        for (i, mask) in masks.iter_mut().enumerate().take(pc) {
            *mask = ((1u32 << mat.valid_rows(p + i)) - 1) as u16;
        }
        let mut t = t0;
        while t < t1 {
            let tc = (t1 - t).min(MAX_T);
            let args = TileArgs {
                qs: mat.quant_ptr(p),
                sc: mat.scale_ptr(p),
                q_panel: nb * mat.ty.packed_quant_bytes(),
                s_panel: nb * mat.ty.packed_scale_bytes(),
                nb,
                aq: act.q.as_ptr().add(t * nb * BLOCK),
                ad: act.d.as_ptr().add(t * nb),
                as_: act.s.as_ptr().add(t * nb),
                ac: act.corr.as_ptr().add(t * nb),
                out: dst.add(t * mat.n + p * PANEL),
                ldo: mat.n,
            };
            dispatch(mat.ty, pc, tc, args, masks);
            t += tc;
        }
        p += pc;
    }
}

macro_rules! dispatch_arms {
    ($ty:expr, $pc:expr, $tc:expr, $args:expr, $m:expr; $(($p:literal, $t:literal)),*) => {
        match ($ty, $pc, $tc) {
            $(
                (QuantType::Q4_1, $p, $t) => tile_q4_1::<$p, $t>($args, $m[..$p].try_into().unwrap()),
                (QuantType::Q8_0, $p, $t) => tile_q8_0::<$p, $t>($args, $m[..$p].try_into().unwrap()),
            )*
            _ => unreachable!("tile shape {}x{}", $pc, $tc),
        }
    };
}

#[inline]
unsafe fn dispatch(ty: QuantType, pc: usize, tc: usize, args: TileArgs, masks: [u16; 4]) {
    dispatch_arms!(ty, pc, tc, args, masks;
        (1, 1), (1, 2), (1, 3), (1, 4),
        (2, 1), (2, 2), (2, 3), (2, 4),
        (4, 1), (4, 2));
}
