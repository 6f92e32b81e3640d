//! AVX-512 and AVX2 kernels for dense weights (see `crate::dense` for the layout and the
//! arithmetic: one fma per (row, token, column), in column order, at every level).

#![allow(clippy::needless_range_loop)]

use crate::dense::elem_bytes;
use crate::{Kernel, PackedMatrix, QuantType, PANEL};
use std::arch::x86_64::*;

#[derive(Clone, Copy)]
struct Args {
    /// First panel of the tile; panels are `q_panel` bytes apart.
    w: *const u8,
    q_panel: usize,
    k: usize,
    /// First token of the tile (token stride k).
    x: *const f32,
    /// dst element (first token, first row of the tile), row stride `ldo`.
    out: *mut f32,
    ldo: usize,
    valid: [usize; 4],
}

/// 16 values of type `F` at `p` (32- or 64-byte aligned) as f32 (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn load16<const F: u8>(p: *const u8) -> __m512 {
    match QuantType::from_id(F) {
        QuantType::F16 => _mm512_cvtph_ps(_mm256_load_si256(p.cast())),
        QuantType::BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
            _mm256_load_si256(p.cast()),
        ))),
        _ => _mm512_load_ps(p.cast()),
    }
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn tile512<const F: u8, const P: usize, const T: usize>(a: Args) {
    let e = elem_bytes(QuantType::from_id(F));
    let mut acc = [[_mm512_setzero_ps(); T]; P];
    for i in 0..a.k {
        let mut w = [_mm512_setzero_ps(); P];
        for p in 0..P {
            w[p] = load16::<F>(a.w.add(p * a.q_panel + i * PANEL * e));
        }
        for t in 0..T {
            let x = _mm512_set1_ps(*a.x.add(t * a.k + i));
            for p in 0..P {
                acc[p][t] = _mm512_fmadd_ps(w[p], x, acc[p][t]);
            }
        }
    }
    for p in 0..P {
        let mask = ((1u32 << a.valid[p]) - 1) as u16;
        for t in 0..T {
            _mm512_mask_storeu_ps(a.out.add(t * a.ldo + p * PANEL), mask, acc[p][t]);
        }
    }
}

/// 8 values of type `F` at `p` (16- or 32-byte aligned) as f32 (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const F: u8>(p: *const u8) -> __m256 {
    match QuantType::from_id(F) {
        QuantType::F16 => _mm256_cvtph_ps(_mm_load_si128(p.cast())),
        QuantType::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
            _mm_load_si128(p.cast()),
        ))),
        _ => _mm256_load_ps(p.cast()),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile256<const F: u8, const P: usize, const T: usize>(a: Args) {
    let e = elem_bytes(QuantType::from_id(F));
    let mut acc = [[[_mm256_setzero_ps(); T]; 2]; P];
    for i in 0..a.k {
        let mut w = [[_mm256_setzero_ps(); 2]; P];
        for p in 0..P {
            for h in 0..2 {
                w[p][h] = load8::<F>(a.w.add(p * a.q_panel + (i * PANEL + 8 * h) * e));
            }
        }
        for t in 0..T {
            let x = _mm256_set1_ps(*a.x.add(t * a.k + i));
            for p in 0..P {
                for h in 0..2 {
                    acc[p][h][t] = _mm256_fmadd_ps(w[p][h], x, acc[p][h][t]);
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

/// Computes dst for panels `p0..p1` and tokens `t0..t1` at `level` (Avx2 or Avx512).
///
/// # Safety
/// The CPU supports `level`; `x` holds the matrix's `m x k` activations; `dst` points to
/// an `m x n` f32 buffer and no other thread writes this rectangle.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn run_tile(
    level: Kernel,
    mat: &PackedMatrix,
    x: &[f32],
    p0: usize,
    p1: usize,
    t0: usize,
    t1: usize,
    dst: *mut f32,
) {
    let (ty, k) = (mat.ty, mat.k);
    let wide = level == Kernel::Avx512;
    // Decode takes more panels (independent fma chains); batches reuse weights over tokens.
    let (pw, max_t) = match (wide, t1 - t0) {
        (true, 1) => (4, 1),
        (true, _) => (2, 4),
        (false, 1) => (2, 1),
        (false, _) => (1, 3),
    };
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
                q_panel: k * PANEL * elem_bytes(ty),
                k,
                x: x.as_ptr().add(t * k),
                out: dst.add(t * mat.n + p * PANEL),
                ldo: mat.n,
                valid,
            };
            match (wide, pc, tc) {
                (true, 4, _) => by_type!(tile512, ty, 4, 1, args),
                (true, 2, 1) => by_type!(tile512, ty, 2, 1, args),
                (true, 2, 2) => by_type!(tile512, ty, 2, 2, args),
                (true, 2, 3) => by_type!(tile512, ty, 2, 3, args),
                (true, 2, _) => by_type!(tile512, ty, 2, 4, args),
                (true, _, 1) => by_type!(tile512, ty, 1, 1, args),
                (true, _, 2) => by_type!(tile512, ty, 1, 2, args),
                (true, _, 3) => by_type!(tile512, ty, 1, 3, args),
                (true, _, _) => by_type!(tile512, ty, 1, 4, args),
                (false, 2, _) => by_type!(tile256, ty, 2, 1, args),
                (false, _, 1) => by_type!(tile256, ty, 1, 1, args),
                (false, _, 2) => by_type!(tile256, ty, 1, 2, args),
                (false, _, _) => by_type!(tile256, ty, 1, 3, args),
            }
            t += tc;
        }
        p += pc;
    }
}
