//! AVX2 + FMA + F16C kernels over the same repacked layout as the AVX-512 ones: each
//! 64-byte chunk of 16 rows is two 32-byte halves of 8 rows, and `vpdpbusd` becomes
//! `vpmaddubsw` (u8 x i8 pairs to i16) + `vpmaddwd` with ones (pairs to i32). The same
//! tiles compiled with AVX-VNNI use its 256-bit `vpdpbusd` instead (the AVX-VNNI level).
//!
//! `vpmaddubsw` saturates at ±32767: the unsigned quants of every type but `Q8_0` stay
//! below 64 and the activations within ±127, so a pair sum stays below 64·127·2 = 16256.
//! Pair sums of one lane are added in i16 before one `vpmaddwd` widens them, as many as
//! stay below 32767: 8 of 4-bit quants (8·2·15·127 = 30480: the 4 chunks of a block), 4 of
//! 5-bit ones (31496: 2 chunks), 2 of 6-bit ones (32004: 2 chunks of one `Q6_K` half). `Q8_0`'s
//! biased bytes would overflow (255·127·2), so it multiplies `|q|` by `a · sign(q)` as
//! ggml does (at most 128·127·2 = 32512) and starts from 0 instead of the offset's
//! correction: the same exact integer.

#![allow(clippy::needless_range_loop)]

use super::{dispatch_shapes, prefetch_ahead, Shapes, TileArgs};
use crate::act::TokenBlocks;
use crate::format::{Planes, Scales};
use crate::{QuantType, BLOCK, PANEL};
use std::arch::x86_64::*;

/// Half-panels of 8 rows per register; one panel a tile, x up to 3 tokens. A single
/// token took 2 panels (4 accumulator chains) until one panel, which reads a chunk's
/// weights as one sequential stream, measured 1.3-1.6x faster at decode (the products of
/// a SmolLM2 Q4_1 and a Gemma 3 Q4_K_M step, `quant_bench --decode`, Zen 4, one thread;
/// see the `avx512` level's shapes).
pub(super) const SHAPES: Shapes = Shapes {
    panels: |_| 1,
    max_tokens: 3,
};

/// SIMD activation quantization of one token's blocks with the same operations as
/// [`crate::act::quantize_block_scalar`], so the same bytes; the divisions of 8 blocks as
/// one vector division each (see the AVX-512 version).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_token(x: &[f32], out: &mut TokenBlocks<'_>) {
    let nb = x.len() / BLOCK;
    let sign = _mm256_set1_ps(-0.0);
    let abs = |v: __m256| _mm256_andnot_ps(sign, v);
    for g in (0..nb).step_by(8) {
        let n = (nb - g).min(8);
        let block = |j: usize| -> [__m256; 4] {
            std::array::from_fn(|i| _mm256_loadu_ps(x.as_ptr().add((g + j) * BLOCK + 8 * i)))
        };
        // The 8 blocks' amax gathered in a register (blended into lane j), not through an
        // array on the stack whose vector load cannot be forwarded from 8 scalar stores
        // (see the AVX-512 version).
        let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let mut amax = _mm256_setzero_ps();
        for j in 0..n {
            let v = block(j);
            let m = _mm256_max_ps(
                _mm256_max_ps(abs(v[0]), abs(v[1])),
                _mm256_max_ps(abs(v[2]), abs(v[3])),
            );
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let m = _mm_max_ss(m, _mm_shuffle_ps::<1>(m, m));
            let lane = _mm256_castsi256_ps(_mm256_cmpeq_epi32(lanes, _mm256_set1_epi32(j as i32)));
            amax = _mm256_blendv_ps(amax, _mm256_broadcastss_ps(m), lane);
        }
        // `block_scale` for the 8: d = amax / 127, id = 1 / d where d > 0, else 0.
        let d = _mm256_div_ps(amax, _mm256_set1_ps(127.0));
        let positive = _mm256_cmp_ps::<_CMP_GT_OQ>(d, _mm256_setzero_ps());
        let id = _mm256_and_ps(positive, _mm256_div_ps(_mm256_set1_ps(1.0), d));
        let (mut ds, mut ids) = ([0f32; 8], [0f32; 8]);
        _mm256_storeu_ps(ds.as_mut_ptr(), d);
        _mm256_storeu_ps(ids.as_mut_ptr(), id);
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        for j in 0..n {
            let v = block(j);
            let vid = _mm256_set1_ps(ids[j]);
            let i: [__m256i; 4] = std::array::from_fn(|k| {
                // 0x08: round to nearest even, suppress exceptions.
                let r = _mm256_round_ps::<0x08>(_mm256_mul_ps(v[k], vid));
                _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
            });
            // Values are within ±127, so the saturating packs are exact; the packs
            // interleave 128-bit lanes, which the permutation undoes.
            let p = _mm256_packs_epi16(
                _mm256_packs_epi32(i[0], i[1]),
                _mm256_packs_epi32(i[2], i[3]),
            );
            let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(out.q(g + j).as_mut_ptr().cast(), p);
            let first_half = hsum_epi32(_mm256_add_epi32(i[0], i[1]));
            let sum = first_half + hsum_epi32(_mm256_add_epi32(i[2], i[3]));
            out.set_scalars(g + j, ds[j], [sum, first_half]);
        }
    }
}

/// The sum of the 8 lanes.
#[inline(always)]
unsafe fn hsum_epi32(s: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

#[inline(always)]
unsafe fn bcast4(p: *const u8) -> __m256i {
    _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
}

/// `x` shifted left by `s` bits (right by `-s`) in 16-bit lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn shift16(x: __m256i, s: i32) -> __m256i {
    if s >= 0 {
        _mm256_sll_epi16(x, _mm_cvtsi32_si128(s))
    } else {
        _mm256_srl_epi16(x, _mm_cvtsi32_si128(-s))
    }
}

/// 8 f16 at `p` as f32 (exact).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p.cast()))
}

/// 8 u8 at `p` as f32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn u8x8(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast())))
}

/// 8 i8 at `p` as f32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn i8x8(p: *const u8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast())))
}

/// Σ of pairs of u8 x i8 products, then of pairs of those: 8 i32 lanes (4 products each).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot4(u: __m256i, a: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1))
}

/// `acc` + Σ of 4 u8 x i8 products per i32 lane: `vpdpbusd` with AVX-VNNI (`V`), else
/// [`dot4`] (the same integer: no pair of products here saturates i16, see above).
#[inline(always)]
unsafe fn dot4_acc<const V: bool>(acc: __m256i, u: __m256i, a: __m256i) -> __m256i {
    if V {
        _mm256_dpbusd_avx_epi32(acc, u, a)
    } else {
        _mm256_add_epi32(acc, dot4(u, a))
    }
}

/// The AVX2 register tile.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_avx2<const F: u8, const P: usize, const T: usize>(a: TileArgs) {
    tile::<F, P, T, false>(a)
}

/// The AVX-VNNI register tile: the AVX2 one with `vpdpbusd`.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn tile_vnni<const F: u8, const P: usize, const T: usize>(a: TileArgs) {
    tile::<F, P, T, true>(a)
}

/// One register tile: `P` panels (two halves of 8 rows each) x `T` tokens, type `F`,
/// with AVX-VNNI when `V`. Inlined into [`tile_avx2`] and [`tile_vnni`], which compile
/// it for their features.
#[inline(always)]
unsafe fn tile<const F: u8, const P: usize, const T: usize, const V: bool>(a: TileArgs) {
    let ty = QuantType::from_id(F);
    let planes = ty.planes();
    let scales = ty.scales();
    let split = ty.splits();
    let qbp = ty.packed_quant_bytes();
    let sbp = ty.packed_scale_bytes();
    let unit = ty.scale_unit();
    // Q8_0 at AVX2 multiplies signed quants directly (no offset to correct); with
    // AVX-VNNI its biased bytes go straight into `vpdpbusd`, as at AVX-512.
    let off = if planes == Planes::Bytes && !V {
        0
    } else {
        ty.offset()
    };
    let nb = a.nb;
    let nib = _mm256_set1_epi8(0x0F);
    let bit4 = _mm256_set1_epi8(0x10);
    let bits45 = _mm256_set1_epi8(0x30);
    let flip = _mm256_set1_epi8(-128);
    let mut accf = [[[_mm256_setzero_ps(); T]; 2]; P];
    for b in 0..nb {
        let mut lo = [[[_mm256_setzero_si256(); T]; 2]; P];
        let mut hi = [[[_mm256_setzero_si256(); T]; 2]; P];
        for t in 0..T {
            let [sum, sum_lo] = *a.isum.add(t * nb + b);
            let (c0, c1) = if split {
                (-off * sum_lo, -off * (sum - sum_lo))
            } else {
                (-off * sum, 0)
            };
            for p in 0..P {
                for h in 0..2 {
                    lo[p][h][t] = _mm256_set1_epi32(c0);
                    hi[p][h][t] = _mm256_set1_epi32(c1);
                }
            }
        }
        let rec = |p: usize, h: usize| a.qs.add(p * a.q_panel + b * qbp + 32 * h);
        if T == 1 {
            prefetch_ahead(&a, P, b, qbp);
        }
        if planes == Planes::Bytes {
            for c in 0..8 {
                let mut w = [[_mm256_setzero_si256(); 2]; P];
                for p in 0..P {
                    for h in 0..2 {
                        let v = _mm256_load_si256(rec(p, h).add(c * 64).cast());
                        w[p][h] = if V { v } else { _mm256_xor_si256(v, flip) };
                    }
                }
                for t in 0..T {
                    let av = bcast4(a.aq.add((t * nb + b) * BLOCK + 4 * c));
                    for p in 0..P {
                        for h in 0..2 {
                            lo[p][h][t] = if V {
                                _mm256_dpbusd_avx_epi32(lo[p][h][t], w[p][h], av)
                            } else {
                                let wabs = _mm256_abs_epi8(w[p][h]);
                                let asgn = _mm256_sign_epi8(av, w[p][h]);
                                _mm256_add_epi32(lo[p][h][t], dot4(wabs, asgn))
                            };
                        }
                    }
                }
            }
        } else {
            let mut h0 = [[_mm256_setzero_si256(); 2]; P];
            let mut h1 = [[_mm256_setzero_si256(); 2]; P];
            for p in 0..P {
                for h in 0..2 {
                    if planes != Planes::Nibbles {
                        h0[p][h] = _mm256_load_si256(rec(p, h).add(256).cast());
                    }
                    if planes == Planes::Nibbles2 {
                        h1[p][h] = _mm256_load_si256(rec(p, h).add(320).cast());
                    }
                }
            }
            // Without VNNI, `vpmaddubsw` results are summed in i16 over `group` chunks
            // before one `vpmaddwd` widens them (bounds in the module docs).
            let group = match planes {
                Planes::Nibbles => 4,
                _ if split => 2,
                Planes::Nibbles1 => 2,
                _ => 1,
            };
            let mut s16lo = [[[_mm256_setzero_si256(); T]; 2]; P];
            let mut s16hi = [[[_mm256_setzero_si256(); T]; 2]; P];
            for c in 0..4 {
                let mut ulo = [[_mm256_setzero_si256(); 2]; P];
                let mut uhi = [[_mm256_setzero_si256(); 2]; P];
                let ci = c as i32;
                for p in 0..P {
                    for h in 0..2 {
                        let w = _mm256_load_si256(rec(p, h).add(c * 64).cast());
                        let mut l = _mm256_and_si256(w, nib);
                        let mut u = _mm256_and_si256(_mm256_srli_epi16::<4>(w), nib);
                        if planes == Planes::Nibbles1 {
                            let x = h0[p][h];
                            l = _mm256_or_si256(l, _mm256_and_si256(shift16(x, 4 - ci), bit4));
                            u = _mm256_or_si256(u, _mm256_and_si256(shift16(x, -ci), bit4));
                        } else if planes == Planes::Nibbles2 {
                            let s = 4 - 2 * ci;
                            l = _mm256_or_si256(l, _mm256_and_si256(shift16(h0[p][h], s), bits45));
                            u = _mm256_or_si256(u, _mm256_and_si256(shift16(h1[p][h], s), bits45));
                        }
                        ulo[p][h] = l;
                        uhi[p][h] = u;
                    }
                }
                for t in 0..T {
                    let ab = a.aq.add((t * nb + b) * BLOCK);
                    let alo = bcast4(ab.add(4 * c));
                    let ahi = bcast4(ab.add(16 + 4 * c));
                    for p in 0..P {
                        for h in 0..2 {
                            let (ul, uh) = (ulo[p][h], uhi[p][h]);
                            if V {
                                if split {
                                    lo[p][h][t] = dot4_acc::<V>(lo[p][h][t], ul, alo);
                                    hi[p][h][t] = dot4_acc::<V>(hi[p][h][t], uh, ahi);
                                } else {
                                    let d = dot4_acc::<V>(lo[p][h][t], ul, alo);
                                    lo[p][h][t] = dot4_acc::<V>(d, uh, ahi);
                                }
                                continue;
                            }
                            let pl = _mm256_maddubs_epi16(ul, alo);
                            let ph = _mm256_maddubs_epi16(uh, ahi);
                            let one = _mm256_set1_epi16(1);
                            let (sl, sh) = (&mut s16lo[p][h][t], &mut s16hi[p][h][t]);
                            if split {
                                *sl = _mm256_add_epi16(*sl, pl);
                                *sh = _mm256_add_epi16(*sh, ph);
                            } else {
                                *sl = _mm256_add_epi16(*sl, _mm256_add_epi16(pl, ph));
                            }
                            if c % group == group - 1 {
                                lo[p][h][t] =
                                    _mm256_add_epi32(lo[p][h][t], _mm256_madd_epi16(*sl, one));
                                *sl = _mm256_setzero_si256();
                                if split {
                                    hi[p][h][t] =
                                        _mm256_add_epi32(hi[p][h][t], _mm256_madd_epi16(*sh, one));
                                    *sh = _mm256_setzero_si256();
                                }
                            }
                        }
                    }
                }
            }
        }
        // Per-block scaling, in the order of `scalar::update`.
        let j = b % unit;
        for p in 0..P {
            let s = a.sc.add(p * a.s_panel + b / unit * sbp);
            for h in 0..2 {
                let zero = _mm256_setzero_ps();
                let (dw_lo, dw_hi, m) = match scales {
                    Scales::D => {
                        let d = f16x8(s.add(16 * h));
                        (d, d, zero)
                    }
                    Scales::DM => {
                        let d = f16x8(s.add(16 * h));
                        (d, d, f16x8(s.add(32 + 16 * h)))
                    }
                    Scales::SuperDM => {
                        let d = _mm256_mul_ps(
                            f16x8(s.add(16 * h)),
                            u8x8(s.add(64 + j * PANEL + 8 * h)),
                        );
                        let m = _mm256_mul_ps(
                            f16x8(s.add(32 + 16 * h)),
                            u8x8(s.add(64 + (8 + j) * PANEL + 8 * h)),
                        );
                        (d, d, m)
                    }
                    Scales::SuperHalves => {
                        let d = f16x8(s.add(16 * h));
                        let lo = _mm256_mul_ps(d, i8x8(s.add(32 + 2 * j * PANEL + 8 * h)));
                        let hi = _mm256_mul_ps(d, i8x8(s.add(32 + (2 * j + 1) * PANEL + 8 * h)));
                        (lo, hi, zero)
                    }
                };
                for t in 0..T {
                    let da = _mm256_set1_ps(*a.ad.add(t * nb + b));
                    let acc = &mut accf[p][h][t];
                    *acc = _mm256_fmadd_ps(
                        _mm256_mul_ps(dw_lo, da),
                        _mm256_cvtepi32_ps(lo[p][h][t]),
                        *acc,
                    );
                    if split {
                        *acc = _mm256_fmadd_ps(
                            _mm256_mul_ps(dw_hi, da),
                            _mm256_cvtepi32_ps(hi[p][h][t]),
                            *acc,
                        );
                    }
                    match scales {
                        Scales::DM => {
                            *acc = _mm256_fmadd_ps(m, _mm256_set1_ps(*a.as_.add(t * nb + b)), *acc);
                        }
                        // fnmadd(m, sa, acc) = fma(−m, sa, acc) exactly.
                        Scales::SuperDM => {
                            *acc =
                                _mm256_fnmadd_ps(m, _mm256_set1_ps(*a.as_.add(t * nb + b)), *acc);
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for p in 0..P {
        for h in 0..2 {
            let rows = a.valid[p].saturating_sub(8 * h).min(8);
            for t in 0..T {
                let out = a.out.add(t * a.ldo + p * PANEL + 8 * h);
                if rows == 8 {
                    _mm256_storeu_ps(out, accf[p][h][t]);
                } else if rows > 0 {
                    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows as i32), lanes);
                    _mm256_maskstore_ps(out, mask, accf[p][h][t]);
                }
            }
        }
    }
}

/// Runs the tile of shape `pc` x `tc` for `ty`.
///
/// # Safety
/// The CPU supports the level; `args` describe a tile inside the matrix and dst.
pub(super) unsafe fn dispatch(ty: QuantType, pc: usize, tc: usize, args: TileArgs) {
    dispatch_shapes!(tile_avx2, ty, pc, tc, args;
        (1, 1), (1, 2), (1, 3));
}

/// [`dispatch`] at the AVX-VNNI level.
///
/// # Safety
/// As [`dispatch`], and the CPU supports AVX-VNNI.
pub(super) unsafe fn dispatch_vnni(ty: QuantType, pc: usize, tc: usize, args: TileArgs) {
    dispatch_shapes!(tile_vnni, ty, pc, tc, args;
        (1, 1), (1, 2), (1, 3));
}
