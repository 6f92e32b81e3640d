//! Dense weights (`F16`, `BF16`, `F32`): products against unquantized f32 activations.
//!
//! Layout: per panel of 16 rows, k-major, in the file's own encoding (the repacked bytes
//! replace the file's bytes, same size but for one padding column when a BF16 row has an
//! odd length):
//! - `F16`, `F32`: the 16 rows' values of column `i` are one record of `16 · e` bytes
//!   (`e` = 2 or 4) at `(p · k + i) · 16 · e`;
//! - `BF16`: columns go in pairs: the record of pair `j` is 16 dwords (64 bytes), dword
//!   `r` holding row `r`'s values of columns `2j` (low half) and `2j + 1` (high half), as
//!   AVX-512 BF16's `vdpbf16ps` multiplies them; the exact kernels widen the two halves
//!   with one shift and one mask. An odd `k` gets a zero column `k`.
//!
//! Every level computes, per (row, token), `acc = fma(w_i, x_i, acc)` for `i = 0, 1, ...`
//! in order from 0, with `w_i` widened exactly to f32, so all levels agree bit for bit.
//! The one exception is the opt-in level [`Kernel::Avx512Bf16`](crate::Kernel): for BF16
//! weights it rounds the activations to bf16 and sums pairs with `vdpbf16ps` (see
//! `x86::bf16dot`).

use crate::{Dst, PackedMatrix, QuantType, PANEL};
use half::{bf16, f16};

/// Bytes of one value.
pub(crate) const fn elem_bytes(ty: QuantType) -> usize {
    match ty {
        QuantType::F32 => 4,
        _ => 2,
    }
}

/// The value at byte offset `at` of the repacked buffer, widened to f32 (exact).
#[inline]
pub(crate) fn value_at(ty: QuantType, buf: &[u8], at: usize) -> f32 {
    match ty {
        QuantType::F16 => f16::from_le_bytes([buf[at], buf[at + 1]]).to_f32(),
        QuantType::BF16 => bf16::from_le_bytes([buf[at], buf[at + 1]]).to_f32(),
        _ => f32::from_le_bytes(buf[at..at + 4].try_into().unwrap_or([0; 4])),
    }
}

/// Columns a panel holds: `k`, rounded up to a whole pair for BF16.
pub(crate) const fn stored_cols(ty: QuantType, k: usize) -> usize {
    match ty {
        QuantType::BF16 => k.next_multiple_of(2),
        _ => k,
    }
}

/// Bytes of one repacked panel.
pub(crate) const fn panel_bytes(ty: QuantType, k: usize) -> usize {
    stored_cols(ty, k) * PANEL * elem_bytes(ty)
}

/// Byte offset of (lane `r`, column `i`) inside its panel.
#[inline]
pub(crate) const fn offset(ty: QuantType, r: usize, i: usize) -> usize {
    match ty {
        QuantType::BF16 => ((i / 2) * PANEL + r) * 4 + (i % 2) * 2,
        _ => (i * PANEL + r) * elem_bytes(ty),
    }
}

/// Copies row `row` (k values, the file's bytes) into lane `r` of its panel.
pub(crate) fn pack_row(ty: QuantType, src: &[u8], panel: &mut [u8], r: usize, k: usize) {
    let e = elem_bytes(ty);
    for i in 0..k {
        let at = offset(ty, r, i);
        panel[at..at + e].copy_from_slice(&src[i * e..(i + 1) * e]);
    }
}

/// Computes dst for panels `p0..p1` and tokens `t0..t1` from the f32 activations `x`.
///
/// # Safety
/// `dst` holds rows `p0·16..` of every token in `t0..t1` and no other thread writes
/// this rectangle.
pub(crate) unsafe fn run_tile_scalar(
    mat: &PackedMatrix,
    x: &[f32],
    p0: usize,
    p1: usize,
    t0: usize,
    t1: usize,
    dst: Dst,
) {
    let (ty, k) = (mat.ty, mat.k);
    for p in p0..p1 {
        // SAFETY: panel p < np; the slice covers exactly this panel.
        let w = unsafe { std::slice::from_raw_parts(mat.quant_ptr(p), panel_bytes(ty, k)) };
        for t in t0..t1 {
            let xt = &x[t * k..(t + 1) * k];
            let mut acc = [0f32; PANEL];
            for (i, &xi) in xt.iter().enumerate() {
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = value_at(ty, w, offset(ty, r, i)).mul_add(xi, *a);
                }
            }
            // SAFETY: row t, columns p*16 .. p*16+valid are inside dst and ours.
            let out = unsafe { dst.at(t, p * PANEL) };
            for (r, &v) in acc.iter().enumerate().take(mat.valid_rows(p)) {
                unsafe { out.add(r).write(v) };
            }
        }
    }
}
