//! Row-wise operations on `[rows, dim]` f32 activations, compiled per kernel level and
//! dispatched at run time like the matrix kernels (see [`lantern_quant::per_level`]).
//! A step's worth of rows is cut into chunks that the matrix products' threads share
//! ([`lantern_quant::share`]); each value is computed the same way in any chunk, so the
//! results do not depend on the thread count.

use lantern_quant::simd::{exp, fma};
use lantern_quant::{per_level, share};

const LANES: usize = 16;

/// `Σ v²` over `row`, in 16 independent lanes (a fixed order, so every level agrees).
#[inline(always)]
fn sum_squares(row: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for i in 0..LANES {
            acc[i] = fma(c[i], c[i], acc[i]);
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for v in chunks.remainder() {
        sum = fma(*v, *v, sum);
    }
    sum
}

/// `tanh(x)` from [`exp`]: `1 − 2 / (e^{2x} + 1)`, exact at the saturated ends.
#[inline(always)]
fn tanh(x: f32) -> f32 {
    1.0 - 2.0 / (exp(2.0 * x) + 1.0)
}

/// `silu(x) = x / (1 + e^−x)`.
#[inline(always)]
fn silu_of(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// gpt-oss's SwiGLU constants (transformers' `swiglu_alpha` / `swiglu_limit` defaults;
/// llama.cpp fixes the same two).
pub const SWIGLU_OAI_ALPHA: f32 = 1.702;
pub const SWIGLU_OAI_LIMIT: f32 = 7.0;

/// `(clamp(up, ±limit) + 1) · g · σ(alpha · g)` with `g = min(gate, limit)`, as
/// transformers' `GptOssExperts` (NaN kept, as PyTorch's clamp keeps it).
#[inline(always)]
fn swiglu_oai_of(gate: f32, up: f32) -> f32 {
    let g = if gate > SWIGLU_OAI_LIMIT {
        SWIGLU_OAI_LIMIT
    } else {
        gate
    };
    let u = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT);
    (u + 1.0) * (g / (1.0 + exp(-SWIGLU_OAI_ALPHA * g)))
}

/// PyTorch's `gelu(x, approximate="tanh")`.
#[inline(always)]
fn gelu_tanh_of(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    let inner = SQRT_2_OVER_PI * fma(0.044_715 * x, x * x, x);
    0.5 * x * (1.0 + tanh(inner))
}

per_level! {
    /// RMS normalization of every row of `x` into `out`, scaled by `weight`.
    fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        let dim = weight.len();
        for (row, out_row) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            let inv = 1.0 / (sum_squares(row) / dim as f32 + eps).sqrt();
            for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
                *o = v * inv * w;
            }
        }
    }

    /// `acc += x`, element-wise.
    fn add_values(acc: &mut [f32], x: &[f32]) {
        for (a, &b) in acc.iter_mut().zip(x) {
            *a += b;
        }
    }

    /// `gate[i] = silu(gate[i]) * up[i]` (SwiGLU).
    fn silu_mul_values(gate: &mut [f32], up: &[f32]) {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = silu_of(*g) * u;
        }
    }

    /// gpt-oss's clamped SwiGLU (see [`swiglu_oai_mul`]).
    fn swiglu_oai_mul_values(gate: &mut [f32], up: &[f32]) {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = swiglu_oai_of(*g, u);
        }
    }

    /// `gate[i] = gelu_tanh(gate[i]) * up[i]` (GeGLU with PyTorch's
    /// `gelu(approximate="tanh")`).
    fn gelu_tanh_mul_values(gate: &mut [f32], up: &[f32]) {
        for (g, &u) in gate.iter_mut().zip(up) {
            *g = gelu_tanh_of(*g) * u;
        }
    }

    /// LayerNorm of every row of `x` into `out`: `(v − mean) / sqrt(var + eps) · w + b`,
    /// the variance biased (over the row's length), as PyTorch's `layer_norm`.
    fn layer_norm_rows(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
        let dim = weight.len();
        for (row, out_row) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
            let mean = row.iter().sum::<f32>() / dim as f32;
            for (o, &v) in out_row.iter_mut().zip(row) {
                *o = v - mean;
            }
            let inv = 1.0 / (sum_squares(out_row) / dim as f32 + eps).sqrt();
            for ((o, &w), &b) in out_row.iter_mut().zip(weight).zip(bias) {
                *o = fma(*o * inv, w, b);
            }
        }
    }

    /// `x[i] = gelu_tanh(x[i])` (GPT-2's `gelu_new`).
    fn gelu_tanh_values(x: &mut [f32]) {
        for g in x.iter_mut() {
            *g = gelu_tanh_of(*g);
        }
    }

    /// `acc *= x`, element-wise.
    fn mul_values(acc: &mut [f32], x: &[f32]) {
        for (a, &b) in acc.iter_mut().zip(x) {
            *a *= b;
        }
    }

    /// `x[i] = gelu(x[i]) = x/2 · (1 + erf(x/√2))`, `1 + erf` from Numerical Recipes'
    /// `erfcc` (`erfc(a) = t·exp(−a² − 1.26551223 + t·P(t))`, `t = 1/(1 + a/2)`, fractional
    /// error below 1.2e-7 everywhere): one exp and a division, so it vectorizes, where a
    /// scalar `erff` call per value took most of a GPT-NeoX prefill.
    fn gelu_erf_values(x: &mut [f32]) {
        const C: [f32; 9] = [
            1.000_023_7,
            0.374_091_96,
            0.096_784_18,
            -0.186_288_06,
            0.278_868_07,
            -1.135_204,
            1.488_515_9,
            -0.822_152_23,
            0.170_872_77,
        ];
        for v in x.iter_mut() {
            let z = *v * std::f32::consts::FRAC_1_SQRT_2;
            let a = z.abs();
            let t = 1.0 / fma(0.5, a, 1.0);
            let mut p = C[8];
            for &c in C[..8].iter().rev() {
                p = fma(p, t, c);
            }
            let erfc = t * exp(fma(-a, a, fma(t, p, -1.265_512_2)));
            let one_plus_erf = if z >= 0.0 { 2.0 - erfc } else { erfc };
            *v = 0.5 * *v * one_plus_erf;
        }
    }

    /// `x[i] = silu(x[i])`.
    fn silu_values(x: &mut [f32]) {
        for g in x.iter_mut() {
            *g = silu_of(*g);
        }
    }

    /// `x[i] = cap · tanh(x[i] / cap)` (Gemma 2's logit soft-capping).
    fn soft_cap_values(x: &mut [f32], cap: f32) {
        for v in x.iter_mut() {
            *v = cap * tanh(*v / cap);
        }
    }

    /// `x *= alpha`.
    fn scale_values(x: &mut [f32], alpha: f32) {
        for v in x.iter_mut() {
            *v *= alpha;
        }
    }
}

/// RMS normalization of every row of `x`, scaled by `weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let chunk = share::chunk_len(x.len(), weight.len());
    share::fresh_chunks(x.len(), chunk, &|c, out| {
        rms_norm_rows(&x[c * chunk..][..out.len()], weight, eps, out)
    })
}

/// `acc += delta`, then the RMS normalization of every row of `acc`, scaled by
/// `weight`, in one pass over row chunks: the same values as [`add_in_place`] then
/// [`rms_norm`], with one sharing of the step's threads instead of two.
pub fn add_rms_norm(acc: &mut [f32], delta: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let (len, chunk) = (acc.len(), share::chunk_len(acc.len(), weight.len()));
    let acc = share::SharedMut::new(acc);
    share::fresh_chunks(len, chunk, &|c, out| {
        // SAFETY: chunks are disjoint rows.
        let acc = unsafe { acc.range(c * chunk, out.len()) };
        add_values(acc, &delta[c * chunk..][..out.len()]);
        rms_norm_rows(acc, weight, eps, out)
    })
}

/// `op(out, input)` over matching chunks of the two, on the helpers when large.
fn zip_chunks(out: &mut [f32], input: &[f32], op: fn(&mut [f32], &[f32])) {
    let chunk = share::chunk_len(out.len(), 1);
    share::for_each_chunk(out, chunk, &|c, out| {
        op(out, &input[c * chunk..][..out.len()])
    });
}

/// `acc += x`, element-wise.
pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    zip_chunks(acc, x, add_values);
}

/// `gate[i] = silu(gate[i]) * up[i]` (SwiGLU).
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    zip_chunks(gate, up, silu_mul_values);
}

/// gpt-oss's clamped SwiGLU: `gate[i] = (clamp(up[i], ±7) + 1) · g · σ(1.702 g)` with
/// `g = min(gate[i], 7)`.
pub fn swiglu_oai_mul(gate: &mut [f32], up: &[f32]) {
    zip_chunks(gate, up, swiglu_oai_mul_values);
}

/// `gate[i] = gelu_tanh(gate[i]) * up[i]` (GeGLU with PyTorch's
/// `gelu(approximate="tanh")`).
pub fn gelu_tanh_mul(gate: &mut [f32], up: &[f32]) {
    zip_chunks(gate, up, gelu_tanh_mul_values);
}

/// LayerNorm of every row of `x` (rows of the weight's length), scaled by `weight` and
/// shifted by `bias`.
pub fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32) -> Vec<f32> {
    let chunk = share::chunk_len(x.len(), weight.len());
    share::fresh_chunks(x.len(), chunk, &|c, out| {
        layer_norm_rows(&x[c * chunk..][..out.len()], weight, bias, eps, out)
    })
}

/// `acc[i] *= x[i]`.
pub fn mul_in_place(acc: &mut [f32], x: &[f32]) {
    zip_chunks(acc, x, mul_values);
}

/// `x[i] = gelu_tanh(x[i])`.
pub fn gelu_tanh(x: &mut [f32]) {
    let chunk = share::chunk_len(x.len(), 1);
    share::for_each_chunk(x, chunk, &|_, x| gelu_tanh_values(x));
}

/// `x[i] = gelu(x[i])` with the error function (PyTorch's default `gelu`, GPT-NeoX's).
pub fn gelu_erf(x: &mut [f32]) {
    let chunk = share::chunk_len(x.len(), 1);
    share::for_each_chunk(x, chunk, &|_, x| gelu_erf_values(x));
}

/// `x[i] = max(x[i], 0)`, NaN kept as PyTorch's `relu` keeps it (OPT's MLP).
pub fn relu(x: &mut [f32]) {
    let chunk = share::chunk_len(x.len(), 1);
    share::for_each_chunk(x, chunk, &|_, x| {
        for v in x {
            if *v < 0.0 {
                *v = 0.0;
            }
        }
    });
}

/// `x[i] = silu(x[i])`.
pub fn silu(x: &mut [f32]) {
    let chunk = share::chunk_len(x.len(), 1);
    share::for_each_chunk(x, chunk, &|_, x| silu_values(x));
}

/// `x[i] = cap · tanh(x[i] / cap)` (Gemma 2's logit soft-capping).
pub fn soft_cap(x: &mut [f32], cap: f32) {
    let chunk = share::chunk_len(x.len(), 1);
    share::for_each_chunk(x, chunk, &|_, x| soft_cap_values(x, cap));
}

/// `x = min(max(x, -limit), limit)`: q/k/v clipped (OLMo); NaN stays NaN.
pub fn clamp(x: &mut [f32], limit: f32) {
    let chunk = share::chunk_len(x.len(), 1);
    share::for_each_chunk(x, chunk, &|_, x| {
        for v in x {
            *v = v.clamp(-limit, limit);
        }
    });
}

/// `x *= alpha`.
pub fn scale(x: &mut [f32], alpha: f32) {
    let chunk = share::chunk_len(x.len(), 1);
    share::for_each_chunk(x, chunk, &|_, x| scale_values(x, alpha));
}

#[cfg(test)]
mod tests {
    use super::*;
    use lantern_quant::{force_kernel, Kernel};

    #[test]
    fn rms_norm_of_constant_row_is_weight() {
        let out = rms_norm(&[2.0, 2.0, -2.0, -2.0], &[1.0, 0.5, 1.0, 2.0], 0.0);
        assert_eq!(out, vec![1.0, 0.5, -1.0, -2.0]);
    }

    fn random(n: usize, seed: u64) -> Vec<f32> {
        // A small LCG: fresh values per seed, no zeros.
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0 + 1e-3
            })
            .collect()
    }

    fn rel(a: f32, b: f64) -> f64 {
        (a as f64 - b).abs() / b.abs().max(1e-6)
    }

    /// Every level against an f64 reference, and the levels against each other bit for
    /// bit. (Forcing the level is process-wide; these tests only compare values computed
    /// inside one test, so a concurrent test at another level cannot change them.)
    #[test]
    fn every_level_matches_the_f64_reference_and_each_other() {
        let (rows, dim) = (3, 67);
        let x = random(rows * dim, 1);
        let w = random(dim, 2);
        let up = random(rows * dim, 3);
        let mut results = Vec::new();
        for level in Kernel::ALL
            .into_iter()
            .filter(|k| k.available() && k.is_exact())
        {
            force_kernel(Some(level));
            let norm = rms_norm(&x, &w, 1e-5);
            let (mut silu, mut gelu, mut capped) = (x.clone(), x.clone(), x.clone());
            silu_mul(&mut silu, &up);
            gelu_tanh_mul(&mut gelu, &up);
            soft_cap(&mut capped, 3.0);
            force_kernel(None);
            for r in 0..rows {
                let row = &x[r * dim..(r + 1) * dim];
                let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / dim as f64;
                for i in 0..dim {
                    let e = row[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
                    assert!(rel(norm[r * dim + i], e) < 1e-5, "{level} rms_norm");
                }
            }
            for i in 0..x.len() {
                let (g, u) = (x[i] as f64, up[i] as f64);
                let s = g / (1.0 + (-g).exp()) * u;
                assert!(rel(silu[i], s) < 1e-5, "{level} silu {g}");
                let inner = 0.797_884_560_8 * (g + 0.044_715 * g * g * g);
                let e = 0.5 * g * (1.0 + inner.tanh()) * u;
                assert!(
                    (gelu[i] as f64 - e).abs() < 1e-5 * (1.0 + e.abs()),
                    "{level} gelu {g}"
                );
                let c = 3.0 * (g / 3.0).tanh();
                assert!(
                    (capped[i] as f64 - c).abs() < 1e-6 * 3.0,
                    "{level} soft_cap {g}"
                );
            }
            results.push((level, norm, silu, gelu, capped));
        }
        for pair in results.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            assert!(
                a.1 == b.1 && a.2 == b.2 && a.3 == b.3 && a.4 == b.4,
                "{} vs {}",
                a.0,
                b.0
            );
        }
    }

    /// LayerNorm and the un-gated activations (GPT-2, GPT-NeoX) at every level against
    /// f64 references (erf from libm), and the levels against each other bit for bit.
    #[test]
    fn layer_norm_and_activations_match_f64_at_every_level() {
        let (rows, dim) = (4, 99);
        // Rows far from zero mean: the variance is of the centred values.
        let x: Vec<f32> = random(rows * dim, 5).iter().map(|v| v + 9.0).collect();
        let (w, b) = (random(dim, 6), random(dim, 7));
        let acts = random(4000, 8);
        let mut results = Vec::new();
        for level in Kernel::ALL
            .into_iter()
            .filter(|k| k.available() && k.is_exact())
        {
            force_kernel(Some(level));
            let norm = layer_norm(&x, &w, &b, 1e-5);
            let (mut erf, mut tanh, mut sl) = (acts.clone(), acts.clone(), acts.clone());
            gelu_erf(&mut erf);
            gelu_tanh(&mut tanh);
            silu(&mut sl);
            force_kernel(None);
            for (r, row) in x.chunks(dim).enumerate() {
                let mean = row.iter().map(|&v| v as f64).sum::<f64>() / dim as f64;
                let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / dim as f64;
                for i in 0..dim {
                    let e =
                        (row[i] as f64 - mean) / (var + 1e-5).sqrt() * w[i] as f64 + b[i] as f64;
                    let got = norm[r * dim + i] as f64;
                    assert!(
                        (got - e).abs() < 1e-5 * (1.0 + e.abs()),
                        "{level} layer_norm"
                    );
                }
            }
            for (i, &v) in acts.iter().enumerate() {
                let g = v as f64;
                let e = 0.5 * g * (1.0 + libm::erf(g / std::f64::consts::SQRT_2));
                // Relative where GELU is not near 0; absolute (of |x|) on the far left.
                assert!(
                    (erf[i] as f64 - e).abs() < 1e-6 * (e.abs() + 1e-3 * g.abs()),
                    "{level} gelu_erf {g}: {} vs {e}",
                    erf[i]
                );
                let t = 0.5 * g * (1.0 + (0.797_884_560_8 * (g + 0.044_715 * g * g * g)).tanh());
                assert!(
                    (tanh[i] as f64 - t).abs() < 1e-5 * (1.0 + t.abs()),
                    "{level} gelu_tanh"
                );
                assert!(
                    rel(sl[i], g / (1.0 + (-g).exp())) < 1e-5,
                    "{level} silu {g}"
                );
            }
            results.push((level, norm, erf, tanh, sl));
        }
        for pair in results.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            assert!(
                a.1 == b.1 && a.2 == b.2 && a.3 == b.3 && a.4 == b.4,
                "{} vs {}",
                a.0,
                b.0
            );
        }
    }

    /// Many rows, cut into chunks on several threads, give each row the bits it gets
    /// alone (the chunks' offsets line every input up with its output).
    #[test]
    fn chunked_passes_equal_row_by_row() {
        let (rows, dim) = (300, 576);
        let x = random(rows * dim, 4);
        let y = random(rows * dim, 5);
        let w = random(dim, 6);
        let norm = rms_norm(&x, &w, 1e-6);
        let (mut add, mut silu, mut gelu, mut capped, mut scaled) =
            (x.clone(), x.clone(), x.clone(), x.clone(), x.clone());
        add_in_place(&mut add, &y);
        silu_mul(&mut silu, &y);
        gelu_tanh_mul(&mut gelu, &y);
        soft_cap(&mut capped, 2.5);
        scale(&mut scaled, 0.3);
        for r in 0..rows {
            let at = r * dim..(r + 1) * dim;
            let (xr, yr) = (&x[at.clone()], &y[at.clone()]);
            assert_eq!(rms_norm(xr, &w, 1e-6), norm[at.clone()], "row {r}");
            let (mut a, mut s, mut g, mut c, mut k) = (
                xr.to_vec(),
                xr.to_vec(),
                xr.to_vec(),
                xr.to_vec(),
                xr.to_vec(),
            );
            add_in_place(&mut a, yr);
            silu_mul(&mut s, yr);
            gelu_tanh_mul(&mut g, yr);
            soft_cap(&mut c, 2.5);
            scale(&mut k, 0.3);
            assert_eq!(a, add[at.clone()], "add, row {r}");
            assert_eq!(s, silu[at.clone()], "silu, row {r}");
            assert_eq!(g, gelu[at.clone()], "gelu, row {r}");
            assert_eq!(c, capped[at.clone()], "soft cap, row {r}");
            assert_eq!(k, scaled[at], "scale, row {r}");
        }
    }

    /// The fused residual add and norm (chunked on several threads) gives the bits of
    /// the add, then the norm, at every level.
    #[test]
    fn add_rms_norm_equals_the_add_then_the_norm() {
        let (rows, dim) = (300, 576);
        let x = random(rows * dim, 7);
        let delta = random(rows * dim, 8);
        let w = random(dim, 9);
        for level in Kernel::ALL
            .into_iter()
            .filter(|k| k.available() && k.is_exact())
        {
            force_kernel(Some(level));
            let mut added = x.clone();
            add_in_place(&mut added, &delta);
            let norm = rms_norm(&added, &w, 1e-6);
            let mut fused_acc = x.clone();
            let fused = add_rms_norm(&mut fused_acc, &delta, &w, 1e-6);
            force_kernel(None);
            assert_eq!(fused_acc, added, "{level}: the sum");
            assert_eq!(fused, norm, "{level}: the norm");
        }
    }
}
