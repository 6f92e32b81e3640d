//! Row-wise operations on `[rows, dim]` f32 activations.

/// RMS normalization of every row of `x`, scaled by `weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let dim = weight.len();
    let mut out = vec![0f32; x.len()];
    for (row, out_row) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let mean_sq = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (mean_sq + eps).sqrt();
        for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = v * inv * w;
        }
    }
    out
}

/// `acc += x`, element-wise.
pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// SwiGLU on a stacked `[rows, 2 * hidden]` gate/up product: `silu(gate) * up`.
pub fn silu_mul_stacked(gate_up: &[f32], hidden: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(gate_up.len() / 2);
    for row in gate_up.chunks_exact(2 * hidden) {
        let (gate, up) = row.split_at(hidden);
        out.extend(
            gate.iter()
                .zip(up)
                .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u),
        );
    }
    out
}

/// Splits stacked `[rows, a + b + c]` projections into three `[rows, a]`, `[rows, b]`,
/// `[rows, c]` buffers.
pub fn split3(x: &[f32], a: usize, b: usize, c: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let rows = x.len() / (a + b + c);
    let (mut xa, mut xb, mut xc) = (
        Vec::with_capacity(rows * a),
        Vec::with_capacity(rows * b),
        Vec::with_capacity(rows * c),
    );
    for row in x.chunks_exact(a + b + c) {
        xa.extend_from_slice(&row[..a]);
        xb.extend_from_slice(&row[a..a + b]);
        xc.extend_from_slice(&row[a + b..]);
    }
    (xa, xb, xc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_constant_row_is_weight() {
        let out = rms_norm(&[2.0, 2.0, -2.0, -2.0], &[1.0, 0.5, 1.0, 2.0], 0.0);
        assert_eq!(out, vec![1.0, 0.5, -1.0, -2.0]);
    }

    #[test]
    fn split3_splits_rows() {
        let x = [1., 2., 3., 4., 5., 6., 7., 8.];
        let (a, b, c) = split3(&x, 2, 1, 1);
        assert_eq!(a, vec![1., 2., 5., 6.]);
        assert_eq!(b, vec![3., 7.]);
        assert_eq!(c, vec![4., 8.]);
    }

    #[test]
    fn silu_mul_matches_formula() {
        let out = silu_mul_stacked(&[1.0, -2.0, 3.0, 4.0], 2);
        let silu = |g: f32| g / (1.0 + (-g).exp());
        assert!((out[0] - silu(1.0) * 3.0).abs() < 1e-6);
        assert!((out[1] - silu(-2.0) * 4.0).abs() < 1e-6);
    }
}
