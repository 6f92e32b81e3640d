//! AVX-512 F/BW + VNNI kernels (see the crate docs for the layout and the arithmetic).

// The register tiles are small fixed-size arrays indexed by (panel, token); index loops
// read more clearly than iterator chains here and compile to the same unrolled code.
#![allow(clippy::needless_range_loop)]

use super::{dispatch_shapes, prefetch_ahead, Shapes, TileArgs};
use crate::act::TokenBlocks;
use crate::format::{Planes, Scales};
use crate::{QuantType, BLOCK, PANEL};
use std::arch::x86_64::*;

/// A single token takes one panel: its tile then reads a chunk's weights as one
/// sequential stream, the next panel's quants right after this one's, where 4 panels (4
/// independent dependency chains) read 4 streams a panel apart; the weights come from
/// memory, and the one stream arrives faster than the 4 chains would compute (batch-1
/// decode 1.16-1.20x at 1 thread and 1.08-1.09x at 2, SmolLM2 Q4_1 and a 1B Q4_0 on Zen 4,
/// paired in one process; 2 panels were 0.92-0.95x). Two tokens take 4 panels; larger
/// batches 2 panels x up to 4 tokens, which reuses each unpacked weight register 4 times.
pub(super) const SHAPES: Shapes = Shapes {
    panels: |tokens| match tokens {
        1 => 1,
        2 => 4,
        _ => 2,
    },
    max_tokens: 4,
};

/// SIMD activation quantization of one token's blocks (`x`: whole blocks) into
/// [`TokenBlocks`]: the same operations as [`crate::act::quantize_block_scalar`] (max of
/// |x|, a division and a reciprocal, multiply, round half to even, clamp), so the same
/// bytes. The divisions of 16 blocks run as one vector division each (IEEE division is
/// correctly rounded in any width); one at a time they held each block up.
///
/// # Safety
/// The CPU must support AVX-512 F/BW.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
pub(crate) unsafe fn quantize_token(x: &[f32], out: &mut TokenBlocks<'_>) {
    let nb = x.len() / BLOCK;
    for g in (0..nb).step_by(16) {
        let n = (nb - g).min(16);
        let block = |j: usize| x.as_ptr().add((g + j) * BLOCK);
        // The 16 blocks' amax gathered in a register: through an array on the stack, the
        // vector load waited for 16 scalar stores (no store forwarding), and so for
        // every older store, the previous blocks' outputs among them.
        let mut amax = _mm512_setzero_ps();
        for j in 0..n {
            let (x0, x1) = (_mm512_loadu_ps(block(j)), _mm512_loadu_ps(block(j).add(16)));
            let m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            amax = _mm512_mask_broadcastss_ps(amax, 1 << j, _mm_set_ss(m));
        }
        // `block_scale` for the 16: d = amax / 127, id = 1 / d where d > 0, else 0.
        let d = _mm512_div_ps(amax, _mm512_set1_ps(127.0));
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(d, _mm512_setzero_ps());
        let id = _mm512_maskz_div_ps(positive, _mm512_set1_ps(1.0), d);
        let (mut ds, mut ids) = ([0f32; 16], [0f32; 16]);
        _mm512_storeu_ps(ds.as_mut_ptr(), d);
        _mm512_storeu_ps(ids.as_mut_ptr(), id);
        let lo = _mm512_set1_ps(-127.0);
        let hi = _mm512_set1_ps(127.0);
        for j in 0..n {
            let vid = _mm512_set1_ps(ids[j]);
            let (x0, x1) = (_mm512_loadu_ps(block(j)), _mm512_loadu_ps(block(j).add(16)));
            // 0x08: round to nearest even, suppress exceptions.
            let r0 = _mm512_roundscale_ps::<0x08>(_mm512_mul_ps(x0, vid));
            let r1 = _mm512_roundscale_ps::<0x08>(_mm512_mul_ps(x1, vid));
            let i0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r0, lo), hi));
            let i1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r1, lo), hi));
            let q = out.q(g + j);
            _mm_storeu_si128(q.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(i0));
            _mm_storeu_si128(q.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(i1));
            let first_half = _mm512_reduce_add_epi32(i0);
            let sum = first_half + _mm512_reduce_add_epi32(i1);
            out.set_scalars(g + j, ds[j], [sum, first_half]);
        }
    }
}

#[inline(always)]
unsafe fn bcast4(p: *const u8) -> __m512i {
    _mm512_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// `x` shifted left by `s` bits (right by `-s`) in 16-bit lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn shift16(x: __m512i, s: i32) -> __m512i {
    if s >= 0 {
        _mm512_sll_epi16(x, _mm_cvtsi32_si128(s))
    } else {
        _mm512_srl_epi16(x, _mm_cvtsi32_si128(-s))
    }
}

/// 16 f16 at `p` (unaligned) as f32 (exact).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn f16x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
}

/// 16 u8 at `p` as f32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn u8x16(p: *const u8) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast())))
}

/// 16 i8 at `p` as f32.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn i8x16(p: *const u8) -> __m512 {
    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())))
}

/// The f32 scales of one block of a panel's 16 rows: `dw_lo`, `dw_hi` (the second
/// half's, `Q6_K`), `m` (the minimum's, or zero), and how `m` enters.
pub(super) struct BlockScales16 {
    dw_lo: __m512,
    dw_hi: __m512,
    m: __m512,
    kind: Scales,
}

/// The scales of block `j` of its scale record at `s` (a panel's record of the block,
/// or of its super-block).
#[inline(always)]
pub(super) unsafe fn block_scales(kind: Scales, s: *const u8, j: usize) -> BlockScales16 {
    let zero = _mm512_setzero_ps();
    let (dw_lo, dw_hi, m) = match kind {
        Scales::D => {
            let d = f16x16(s);
            (d, d, zero)
        }
        Scales::DM => {
            let d = f16x16(s);
            (d, d, f16x16(s.add(32)))
        }
        Scales::SuperDM => {
            let d = _mm512_mul_ps(f16x16(s), u8x16(s.add(64 + j * PANEL)));
            let m = _mm512_mul_ps(f16x16(s.add(32)), u8x16(s.add(64 + (8 + j) * PANEL)));
            (d, d, m)
        }
        Scales::SuperHalves => {
            let d = f16x16(s);
            let lo = _mm512_mul_ps(d, i8x16(s.add(32 + 2 * j * PANEL)));
            let hi = _mm512_mul_ps(d, i8x16(s.add(32 + (2 * j + 1) * PANEL)));
            (lo, hi, zero)
        }
    };
    BlockScales16 {
        dw_lo,
        dw_hi,
        m,
        kind,
    }
}

/// One block's update of the accumulators of 16 rows for one token (`scalar::update`,
/// in its order): the integer dots `lo` (and `hi`, `Q6_K`'s second half), the token's
/// block scale `da` and `sa = da · Σ q_a`.
#[inline(always)]
pub(super) unsafe fn scale_block(
    acc: &mut __m512,
    sc: &BlockScales16,
    lo: __m512i,
    hi: __m512i,
    da: f32,
    sa: f32,
) {
    scale_block_with(acc, sc, lo, hi, _mm512_set1_ps(da), sa)
}

/// [`scale_block`] for the types without a minimum, `da` already in every lane.
#[inline(always)]
pub(super) unsafe fn scale_block_lanes(
    acc: &mut __m512,
    sc: &BlockScales16,
    lo: __m512i,
    hi: __m512i,
    da: __m512,
) {
    debug_assert!(matches!(sc.kind, Scales::D | Scales::SuperHalves));
    scale_block_with(acc, sc, lo, hi, da, 0.0)
}

#[inline(always)]
unsafe fn scale_block_with(
    acc: &mut __m512,
    sc: &BlockScales16,
    lo: __m512i,
    hi: __m512i,
    da: __m512,
    sa: f32,
) {
    *acc = _mm512_fmadd_ps(_mm512_mul_ps(sc.dw_lo, da), _mm512_cvtepi32_ps(lo), *acc);
    match sc.kind {
        Scales::SuperHalves => {
            *acc = _mm512_fmadd_ps(_mm512_mul_ps(sc.dw_hi, da), _mm512_cvtepi32_ps(hi), *acc);
        }
        Scales::DM => *acc = _mm512_fmadd_ps(sc.m, _mm512_set1_ps(sa), *acc),
        // fnmadd(m, sa, acc) = fma(−m, sa, acc) exactly (negation is exact).
        Scales::SuperDM => *acc = _mm512_fnmadd_ps(sc.m, _mm512_set1_ps(sa), *acc),
        Scales::D => {}
    }
}

/// One register tile: `P` panels (16 rows each) x `T` tokens, weight type `F`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn tile<const F: u8, const P: usize, const T: usize>(a: TileArgs) {
    let ty = QuantType::from_id(F);
    let planes = ty.planes();
    let scales = ty.scales();
    let split = ty.splits();
    let qbp = ty.packed_quant_bytes();
    let sbp = ty.packed_scale_bytes();
    let unit = ty.scale_unit();
    let off = ty.offset();
    let nb = a.nb;
    let nib = _mm512_set1_epi8(0x0F);
    let bit4 = _mm512_set1_epi8(0x10);
    let bits45 = _mm512_set1_epi8(0x30);
    let mut accf = [[_mm512_setzero_ps(); T]; P];
    if T > 1 {
        prefetch_output::<P, T>(&a);
    }
    for b in 0..nb {
        // Integer dot products, starting from the offsets' exact corrections.
        let mut lo = [[_mm512_setzero_si512(); T]; P];
        let mut hi = [[_mm512_setzero_si512(); T]; P];
        for t in 0..T {
            let [sum, sum_lo] = *a.isum.add(t * nb + b);
            let (c0, c1) = if split {
                (-off * sum_lo, -off * (sum - sum_lo))
            } else {
                (-off * sum, 0)
            };
            for p in 0..P {
                lo[p][t] = _mm512_set1_epi32(c0);
                hi[p][t] = _mm512_set1_epi32(c1);
            }
        }
        let rec = |p: usize| a.qs.add(p * a.q_panel + b * qbp);
        if T == 1 {
            prefetch_ahead(&a, P, b, qbp);
        }
        if planes == Planes::Bytes {
            for c in 0..8 {
                let mut w = [_mm512_setzero_si512(); P];
                for p in 0..P {
                    w[p] = _mm512_load_si512(rec(p).add(c * 64).cast());
                }
                for t in 0..T {
                    let av = bcast4(a.aq.add((t * nb + b) * BLOCK + 4 * c));
                    for p in 0..P {
                        lo[p][t] = _mm512_dpbusd_epi32(lo[p][t], w[p], av);
                    }
                }
            }
        } else {
            let mut h0 = [_mm512_setzero_si512(); P];
            let mut h1 = [_mm512_setzero_si512(); P];
            for p in 0..P {
                if planes != Planes::Nibbles {
                    h0[p] = _mm512_load_si512(rec(p).add(256).cast());
                }
                if planes == Planes::Nibbles2 {
                    h1[p] = _mm512_load_si512(rec(p).add(320).cast());
                }
            }
            for c in 0..4 {
                let mut ulo = [_mm512_setzero_si512(); P];
                let mut uhi = [_mm512_setzero_si512(); P];
                for p in 0..P {
                    let w = _mm512_load_si512(rec(p).add(c * 64).cast());
                    ulo[p] = _mm512_and_si512(w, nib);
                    uhi[p] = _mm512_and_si512(_mm512_srli_epi16::<4>(w), nib);
                    let ci = c as i32;
                    if planes == Planes::Nibbles1 {
                        let l = _mm512_and_si512(shift16(h0[p], 4 - ci), bit4);
                        let h = _mm512_and_si512(shift16(h0[p], -ci), bit4);
                        ulo[p] = _mm512_or_si512(ulo[p], l);
                        uhi[p] = _mm512_or_si512(uhi[p], h);
                    } else if planes == Planes::Nibbles2 {
                        let l = _mm512_and_si512(shift16(h0[p], 4 - 2 * ci), bits45);
                        let h = _mm512_and_si512(shift16(h1[p], 4 - 2 * ci), bits45);
                        ulo[p] = _mm512_or_si512(ulo[p], l);
                        uhi[p] = _mm512_or_si512(uhi[p], h);
                    }
                }
                for t in 0..T {
                    let ab = a.aq.add((t * nb + b) * BLOCK);
                    let alo = bcast4(ab.add(4 * c));
                    let ahi = bcast4(ab.add(16 + 4 * c));
                    for p in 0..P {
                        lo[p][t] = _mm512_dpbusd_epi32(lo[p][t], ulo[p], alo);
                        if split {
                            hi[p][t] = _mm512_dpbusd_epi32(hi[p][t], uhi[p], ahi);
                        } else {
                            lo[p][t] = _mm512_dpbusd_epi32(lo[p][t], uhi[p], ahi);
                        }
                    }
                }
            }
        }
        // Per-block scaling, in the order of `scalar::update`.
        for p in 0..P {
            let s = a.sc.add(p * a.s_panel + b / unit * sbp);
            let scales = block_scales(scales, s, b % unit);
            for t in 0..T {
                let i = t * nb + b;
                let (da, sa) = (*a.ad.add(i), *a.as_.add(i));
                scale_block(&mut accf[p][t], &scales, lo[p][t], hi[p][t], da, sa);
            }
        }
    }
    for p in 0..P {
        let mask = ((1u32 << a.valid[p]) - 1) as u16;
        for t in 0..T {
            _mm512_mask_storeu_ps(a.out.add(t * a.ldo + p * PANEL), mask, accf[p][t]);
        }
    }
}

/// Asks for the lines of a many-token tile's outputs (each token's 16 rows of each panel:
/// one or two lines) in L1 before its work, so that its stores at the end find them.
/// Stores leave the core in order, so one whose line is in no cache holds back every
/// later store until the line arrives; a product whose output outgrows the caches (a
/// vocabulary's logits for many tokens: SmolLM2's for 512 are 100 MB) misses on almost
/// every line. Measured: such products 1.08-1.15x faster (2-core Xeon with AMX,
/// `quant_bench --decode --batch 512`), the rest unchanged. A single token's outputs are
/// a few lines; the AVX2 tiles gained nothing measurable from the same prefetches.
#[inline(always)]
unsafe fn prefetch_output<const P: usize, const T: usize>(a: &TileArgs) {
    for p in 0..P {
        for t in 0..T {
            let at = a.out.add(t * a.ldo + p * PANEL);
            _mm_prefetch::<_MM_HINT_T0>(at.cast());
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(PANEL - 1).cast());
        }
    }
}

/// Runs the tile of shape `pc` x `tc` for `ty`.
///
/// # Safety
/// The CPU supports the level; `args` describe a tile inside the matrix and dst.
pub(super) unsafe fn dispatch(ty: QuantType, pc: usize, tc: usize, args: TileArgs) {
    dispatch_shapes!(tile, ty, pc, tc, args;
        (1, 1), (1, 2), (1, 3), (1, 4),
        (2, 1), (2, 2), (2, 3), (2, 4),
        (4, 1), (4, 2));
}
