//! Portable kernels over the repacked layout: the same integer dot products and the same
//! f32 operations, in the same order, as the AVX-512 VNNI kernels.

use crate::act::QuantAct;
use crate::{PackedMatrix, QuantType, BLOCK, PANEL};
use half::f16;

#[inline]
fn f16_at(s: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([s[2 * i], s[2 * i + 1]]).to_f32()
}

/// Computes dst for panels `p0..p1` and tokens `t0..t1`.
///
/// # Safety
/// `dst` points to an `m x n` f32 buffer and no other thread writes this rectangle.
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
    let qbp = mat.ty.packed_quant_bytes();
    let sbp = mat.ty.packed_scale_bytes();
    let aq = act.q.as_slice();
    for p in p0..p1 {
        // SAFETY: panel p < np; the slices cover exactly this panel's records.
        let qs = unsafe { std::slice::from_raw_parts(mat.quant_ptr(p), nb * qbp) };
        let sc = unsafe { std::slice::from_raw_parts(mat.scale_ptr(p), nb * sbp) };
        let valid = mat.valid_rows(p);
        for t in t0..t1 {
            let mut acc = [0f32; PANEL];
            for b in 0..nb {
                let q = &qs[b * qbp..(b + 1) * qbp];
                let s = &sc[b * sbp..(b + 1) * sbp];
                let a = &aq[(t * nb + b) * BLOCK..][..BLOCK];
                let a = |i: usize| a[i] as i8 as i32;
                let da = act.d[t * nb + b];
                match mat.ty {
                    QuantType::Q4_1 => {
                        let sa = act.s[t * nb + b];
                        for (r, accr) in acc.iter_mut().enumerate() {
                            let mut dot = 0i32;
                            for c in 0..4 {
                                for j in 0..4 {
                                    let w = q[c * 64 + 4 * r + j] as i32;
                                    dot += (w & 0x0F) * a(4 * c + j);
                                    dot += (w >> 4) * a(16 + 4 * c + j);
                                }
                            }
                            let dd = f16_at(s, r) * da;
                            *accr = dd.mul_add(dot as f32, *accr);
                            *accr = f16_at(s, 16 + r).mul_add(sa, *accr);
                        }
                    }
                    QuantType::Q8_0 => {
                        let corr = act.corr[t * nb + b];
                        for (r, accr) in acc.iter_mut().enumerate() {
                            let mut dot = corr;
                            for c in 0..8 {
                                for j in 0..4 {
                                    dot += q[c * 64 + 4 * r + j] as i32 * a(4 * c + j);
                                }
                            }
                            let dd = f16_at(s, r) * da;
                            *accr = dd.mul_add(dot as f32, *accr);
                        }
                    }
                }
            }
            // SAFETY: row t, columns p*16 .. p*16+valid are inside dst and ours.
            let out = unsafe { dst.add(t * mat.n + p * PANEL) };
            for (r, &v) in acc.iter().enumerate().take(valid) {
                unsafe { out.add(r).write(v) };
            }
        }
    }
}
