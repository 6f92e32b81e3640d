//! Portable kernels over the repacked layout: the same integer dot products and the same
//! f32 operations, in the same order, as the SIMD kernels (see the crate docs).

use crate::act::QuantAct;
use crate::format::{decode_quants, decode_scales, BlockScales};
use crate::{Dst, PackedMatrix, BLOCK, PANEL};

/// The f32 update of one (row, token) accumulator by one block: the arithmetic every
/// level performs, in this order.
///
/// `dot` is `[Σ_{j<16} (q_j − off)·a_j, Σ_{j≥16} (q_j − off)·a_j]` when `split` (`Q6_K`,
/// whose halves have their own scales), else `[Σ_j (q_j − off)·a_j, 0]`.
#[inline(always)]
pub(crate) fn update(
    acc: f32,
    sc: &BlockScales,
    dot: [i32; 2],
    da: f32,
    sa: f32,
    split: bool,
    min: bool,
) -> f32 {
    let mut acc = (sc.dw_lo * da).mul_add(dot[0] as f32, acc);
    if split {
        acc = (sc.dw_hi * da).mul_add(dot[1] as f32, acc);
    }
    if min {
        acc = sc.mneg.mul_add(sa, acc);
    }
    acc
}

/// Computes dst for panels `p0..p1` and tokens `t0..t1`.
///
/// # Safety
/// `dst` holds rows `p0·16..` of every token in `t0..t1` and no other thread writes
/// this rectangle.
pub(crate) unsafe fn run_tile(
    mat: &PackedMatrix,
    act: &QuantAct,
    p0: usize,
    p1: usize,
    t0: usize,
    t1: usize,
    dst: Dst,
) {
    let ty = mat.ty;
    let nb = mat.nb;
    let qbp = ty.packed_quant_bytes();
    let sbp = ty.packed_scale_bytes();
    let unit = ty.scale_unit();
    let off = ty.offset();
    let split = ty.splits();
    let min = matches!(
        ty.scales(),
        crate::format::Scales::DM | crate::format::Scales::SuperDM
    );
    let aq = act.q.as_slice();
    let mut acc = vec![[0f32; PANEL]; t1 - t0];
    for p in p0..p1 {
        // SAFETY: panel p < np; the slices cover exactly this panel's records.
        let qs = unsafe { std::slice::from_raw_parts(mat.quant_ptr(p), nb * qbp) };
        let sc = unsafe { std::slice::from_raw_parts(mat.scale_ptr(p), nb / unit * sbp) };
        acc.iter_mut().for_each(|a| *a = [0.0; PANEL]);
        for b in 0..nb {
            let q = &qs[b * qbp..(b + 1) * qbp];
            let s = &sc[b / unit * sbp..(b / unit + 1) * sbp];
            for r in 0..PANEL {
                let u = decode_quants(ty, q, r);
                let scales = decode_scales(ty, s, r, b % unit);
                for (t, accr) in (t0..t1).zip(acc.iter_mut()) {
                    let i = t * nb + b;
                    let a = &aq[i * BLOCK..(i + 1) * BLOCK];
                    let mut half = [0i32; 2];
                    for (j, (&w, &x)) in u.iter().zip(a).enumerate() {
                        half[j / 16] += w as i32 * x as i8 as i32;
                    }
                    let [sum, lo] = act.isum[i];
                    let dot = if split {
                        [half[0] - off * lo, half[1] - off * (sum - lo)]
                    } else {
                        [half[0] + half[1] - off * sum, 0]
                    };
                    accr[r] = update(accr[r], &scales, dot, act.d[i], act.s[i], split, min);
                }
            }
        }
        let valid = mat.valid_rows(p);
        for (t, accr) in (t0..t1).zip(&acc) {
            // SAFETY: row t, columns p*16 .. p*16+valid are inside dst and ours.
            let out = unsafe { dst.at(t, p * PANEL) };
            for (r, &v) in accr.iter().enumerate().take(valid) {
                unsafe { out.add(r).write(v) };
            }
        }
    }
}
