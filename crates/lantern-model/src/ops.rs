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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_constant_row_is_weight() {
        let out = rms_norm(&[2.0, 2.0, -2.0, -2.0], &[1.0, 0.5, 1.0, 2.0], 0.0);
        assert_eq!(out, vec![1.0, 0.5, -1.0, -2.0]);
    }
}
