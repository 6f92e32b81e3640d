//! AVX-512 and AVX2 kernels for dense weights (see `crate::dense` for the layout and the
//! arithmetic: one fma per (row, token, column), in column order, at every exact level),
//! and the driver that also runs `bf16dot`'s tiles at the AVX-512 BF16 level.

#![allow(clippy::needless_range_loop)]

use super::bf16dot;
use crate::dense::{elem_bytes, panel_bytes};
use crate::{Dst, Kernel, PackedMatrix, QuantType, PANEL};
use std::arch::x86_64::*;

/// Pointers and strides of one register tile (panels `P` x tokens `T`).
#[derive(Clone, Copy)]
pub(super) struct Args {
    /// First panel of the tile; panels are `q_panel` bytes apart.
    pub w: *const u8,
    pub q_panel: usize,
    pub k: usize,
    /// First token's activations (f32, or bf16 pairs for `bf16dot`); tokens are `ldx`
    /// bytes apart.
    pub x: *const u8,
    pub ldx: usize,
    /// dst element (first token, first row of the tile), row stride `ldo`.
    pub out: *mut f32,
    pub ldo: usize,
    pub valid: [usize; 4],
}

impl Args {
    /// Activation `i` (f32) of token `t`.
    #[inline(always)]
    unsafe fn x(&self, t: usize, i: usize) -> f32 {
        *self.x.add(t * self.ldx).cast::<f32>().add(i)
    }

    /// For a single token (which streams the weights from memory, see
    /// `super::PREFETCH_BYTES`), prefetches the line `PREFETCH_BYTES` ahead of byte `at`
    /// of each of the tile's `P` panels.
    #[inline(always)]
    pub(super) fn prefetch<const P: usize, const T: usize>(&self, at: usize) {
        if T == 1 {
            for p in 0..P {
                let line = self
                    .w
                    .wrapping_add(p * self.q_panel + at + super::PREFETCH_BYTES);
                // SAFETY: a prefetch never faults, whatever the address.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(line.cast()) };
            }
        }
    }
}

/// `acc[p][t] += w[p] · x[t][i]` for the tile's tokens.
#[inline(always)]
unsafe fn fma_column512<const P: usize, const T: usize>(
    acc: &mut [[__m512; T]; P],
    w: &[__m512; P],
    a: &Args,
    i: usize,
) {
    for t in 0..T {
        let x = _mm512_set1_ps(a.x(t, i));
        for p in 0..P {
            acc[p][t] = _mm512_fmadd_ps(w[p], x, acc[p][t]);
        }
    }
}

/// 16 values of type `F` at `p` (32- or 64-byte aligned) as f32 (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn load16<const F: u8>(p: *const u8) -> __m512 {
    match QuantType::from_id(F) {
        QuantType::F16 => _mm512_cvtph_ps(_mm256_load_si256(p.cast())),
        _ => _mm512_load_ps(p.cast()),
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn tile512<const F: u8, const P: usize, const T: usize>(a: Args) {
    let mut acc = [[_mm512_setzero_ps(); T]; P];
    if QuantType::from_id(F) == QuantType::BF16 {
        // Pair j: one load per panel, the even column by a shift, the odd by a mask.
        let odd = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        for j in 0..a.k.div_ceil(2) {
            a.prefetch::<P, T>(j * 64);
            let (mut even_w, mut odd_w) = ([_mm512_setzero_ps(); P], [_mm512_setzero_ps(); P]);
            for p in 0..P {
                let v = _mm512_load_si512(a.w.add(p * a.q_panel + j * 64).cast());
                even_w[p] = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                odd_w[p] = _mm512_castsi512_ps(_mm512_and_si512(v, odd));
            }
            fma_column512(&mut acc, &even_w, &a, 2 * j);
            if 2 * j + 1 < a.k {
                fma_column512(&mut acc, &odd_w, &a, 2 * j + 1);
            }
        }
    } else {
        let e = elem_bytes(QuantType::from_id(F));
        for i in 0..a.k {
            a.prefetch::<P, T>(i * PANEL * e);
            let mut w = [_mm512_setzero_ps(); P];
            for p in 0..P {
                w[p] = load16::<F>(a.w.add(p * a.q_panel + i * PANEL * e));
            }
            fma_column512(&mut acc, &w, &a, i);
        }
    }
    store512(&a, &acc);
}

/// Stores a tile's accumulators (the rows that exist).
#[inline(always)]
pub(super) unsafe fn store512<const P: usize, const T: usize>(a: &Args, acc: &[[__m512; T]; P]) {
    for p in 0..P {
        let mask = ((1u32 << a.valid[p]) - 1) as u16;
        for t in 0..T {
            _mm512_mask_storeu_ps(a.out.add(t * a.ldo + p * PANEL), mask, acc[p][t]);
        }
    }
}

/// `acc[p][h][t] += w[p][h] · x[t][i]` for the tile's tokens.
#[inline(always)]
unsafe fn fma_column256<const P: usize, const T: usize>(
    acc: &mut [[[__m256; T]; 2]; P],
    w: &[[__m256; 2]; P],
    a: &Args,
    i: usize,
) {
    for t in 0..T {
        let x = _mm256_set1_ps(a.x(t, i));
        for p in 0..P {
            for h in 0..2 {
                acc[p][h][t] = _mm256_fmadd_ps(w[p][h], x, acc[p][h][t]);
            }
        }
    }
}

/// 8 values of type `F` at `p` (16- or 32-byte aligned) as f32 (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const F: u8>(p: *const u8) -> __m256 {
    match QuantType::from_id(F) {
        QuantType::F16 => _mm256_cvtph_ps(_mm_load_si128(p.cast())),
        _ => _mm256_load_ps(p.cast()),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile256<const F: u8, const P: usize, const T: usize>(a: Args) {
    let mut acc = [[[_mm256_setzero_ps(); T]; 2]; P];
    if QuantType::from_id(F) == QuantType::BF16 {
        // Pair j: each 8-row half one load, the even column by a shift, the odd by a mask.
        let odd = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
        for j in 0..a.k.div_ceil(2) {
            a.prefetch::<P, T>(j * 64);
            let mut even_w = [[_mm256_setzero_ps(); 2]; P];
            let mut odd_w = [[_mm256_setzero_ps(); 2]; P];
            for p in 0..P {
                for h in 0..2 {
                    let v = _mm256_load_si256(a.w.add(p * a.q_panel + j * 64 + 32 * h).cast());
                    even_w[p][h] = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
                    odd_w[p][h] = _mm256_castsi256_ps(_mm256_and_si256(v, odd));
                }
            }
            fma_column256(&mut acc, &even_w, &a, 2 * j);
            if 2 * j + 1 < a.k {
                fma_column256(&mut acc, &odd_w, &a, 2 * j + 1);
            }
        }
    } else {
        let e = elem_bytes(QuantType::from_id(F));
        for i in 0..a.k {
            a.prefetch::<P, T>(i * PANEL * e);
            let mut w = [[_mm256_setzero_ps(); 2]; P];
            for p in 0..P {
                for h in 0..2 {
                    w[p][h] = load8::<F>(a.w.add(p * a.q_panel + (i * PANEL + 8 * h) * e));
                }
            }
            fma_column256(&mut acc, &w, &a, i);
        }
    }
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for p in 0..P {
        for h in 0..2 {
            let rows = a.valid[p].saturating_sub(8 * h).min(8);
            for t in 0..T {
                let out = a.out.add(t * a.ldo + p * PANEL + 8 * h);
                if rows == 8 {
                    _mm256_storeu_ps(out, acc[p][h][t]);
                } else if rows > 0 {
                    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(rows as i32), lanes);
                    _mm256_maskstore_ps(out, mask, acc[p][h][t]);
                }
            }
        }
    }
}

macro_rules! by_type {
    ($tile:ident, $ty:expr, $p:literal, $t:literal, $args:expr) => {
        match $ty {
            QuantType::F16 => $tile::<{ QuantType::F16 as u8 }, $p, $t>($args),
            QuantType::BF16 => $tile::<{ QuantType::BF16 as u8 }, $p, $t>($args),
            _ => $tile::<{ QuantType::F32 as u8 }, $p, $t>($args),
        }
    };
}

/// Expands to a `match` over the tile shapes (panels, tokens) calling `by_type!`.
macro_rules! dense_tiles {
    ($tile:ident, $ty:expr, $pc:expr, $tc:expr, $args:expr; $(($p:literal, $t:literal)),*) => {
        match ($pc, $tc) {
            $(($p, $t) => by_type!($tile, $ty, $p, $t, $args),)*
            _ => unreachable!("dense tile {}x{}", $pc, $tc),
        }
    };
}

/// Register tile of a task of `tokens` tokens at `level` for dense type `ty`: (panels,
/// most tokens). Decode takes more panels (independent chains); batches reuse each
/// weight register over tokens, with enough accumulators to cover the fma latency (8
/// chains were 10-40% slower than 12-16, quant_bench, Zen 5); BF16's pairs hold one
/// more register of weights, so at AVX2 (16 registers) one token fewer.
pub(crate) fn tile_shape(level: Kernel, ty: QuantType, tokens: usize) -> (usize, usize) {
    match (level, tokens) {
        (Kernel::Avx512Bf16, _) => bf16dot::SHAPE,
        (Kernel::Avx512, 1) => (4, 1),
        (Kernel::Avx512, _) => (4, 4),
        (_, 1) => (2, 1),
        (_, _) if ty == QuantType::BF16 => (1, 5),
        (_, _) => (1, 6),
    }
}

/// Computes dst for panels `p0..p1` and tokens `t0..t1` at `level` (a SIMD level) from
/// the activations at `x`, `ldx` bytes per token: f32, or at `Avx512Bf16` the bf16 pairs
/// `bf16dot::round_pairs` made.
///
/// # Safety
/// The CPU supports `level`; `x` holds the matrix's `m` tokens of activations; `dst`
/// holds rows `p0·16..` of every token in `t0..t1` and no other thread writes this
/// rectangle.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run_tile(
    level: Kernel,
    mat: &PackedMatrix,
    x: *const u8,
    ldx: usize,
    p0: usize,
    p1: usize,
    t0: usize,
    t1: usize,
    dst: Dst,
) {
    let (ty, k) = (mat.ty, mat.k);
    let (pw, max_t) = tile_shape(level, ty, t1 - t0);
    let mut p = p0;
    while p < p1 {
        let pc = if p1 - p >= pw {
            pw
        } else if p1 - p >= 2 {
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
            let tc = (t1 - t).min(max_t);
            let args = Args {
                w: mat.quant_ptr(p),
                q_panel: panel_bytes(ty, k),
                k,
                x: x.add(t * ldx),
                ldx,
                out: dst.at(t, p * PANEL),
                ldo: dst.ldo,
                valid,
            };
            match level {
                Kernel::Avx512Bf16 => bf16dot::dispatch(pc, tc, args),
                Kernel::Avx512 => {
                    dense_tiles!(tile512, ty, pc, tc, args;
                        (4, 1), (4, 2), (4, 3), (4, 4), (2, 1), (2, 2), (2, 3), (2, 4),
                        (1, 1), (1, 2), (1, 3), (1, 4))
                }
                _ => {
                    dense_tiles!(tile256, ty, pc, tc, args;
                        (2, 1), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (1, 6))
                }
            }
            t += tc;
        }
        p += pc;
    }
}
