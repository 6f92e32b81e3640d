//! Correctness of the repacked Q4_1 / Q8_0 matrix products against plain Rust references
//! computed straight from the GGUF bytes.

use half::f16;
use lantern_quant::{kernel_level, Kernel, PackedMatrix, QuantError, QuantType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const KS: [usize; 4] = [32, 64, 576, 1536];
const NS: [usize; 6] = [1, 15, 16, 17, 192, 576];
const MS: [usize; 5] = [1, 2, 5, 9, 64];
const TYPES: [QuantType; 2] = [QuantType::Q4_1, QuantType::Q8_0];

/// Random GGUF bytes for an `n x k` matrix: valid f16 scales, random nibbles / int8.
fn random_gguf(rng: &mut StdRng, ty: QuantType, n: usize, k: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * k / 32 * ty.block_bytes());
    for _ in 0..n * k / 32 {
        match ty {
            QuantType::Q4_1 => {
                // As written by quantizers: m = block min, d = (max - min) / 15, so the
                // values are roughly centred on zero (m ~ -7.5 d), plus some skew.
                let d32 = rng.gen_range(1e-3f32..2e-2);
                let d = f16::from_f32(d32);
                let m = f16::from_f32(-d32 * rng.gen_range(5.0f32..10.0));
                out.extend_from_slice(&d.to_le_bytes());
                out.extend_from_slice(&m.to_le_bytes());
                for _ in 0..16 {
                    out.push(rng.gen());
                }
            }
            QuantType::Q8_0 => {
                let d = f16::from_f32(rng.gen_range(-2e-3f32..2e-3));
                out.extend_from_slice(&d.to_le_bytes());
                for _ in 0..32 {
                    out.push(rng.gen()); // includes -128
                }
            }
        }
    }
    out
}

/// Direct decode of one GGUF block into 32 values (the ggml definition).
fn decode_block(ty: QuantType, b: &[u8]) -> [f32; 32] {
    let mut v = [0f32; 32];
    let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
    match ty {
        QuantType::Q4_1 => {
            let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
            for j in 0..16 {
                v[j] = d * (b[4 + j] & 0x0F) as f32 + m;
                v[j + 16] = d * (b[4 + j] >> 4) as f32 + m;
            }
        }
        QuantType::Q8_0 => {
            for j in 0..32 {
                v[j] = d * (b[2 + j] as i8) as f32;
            }
        }
    }
    v
}

fn decode_matrix(ty: QuantType, bytes: &[u8], n: usize, k: usize) -> Vec<f32> {
    let bb = ty.block_bytes();
    let mut w = Vec::with_capacity(n * k);
    for i in 0..n * k / 32 {
        w.extend_from_slice(&decode_block(ty, &bytes[i * bb..(i + 1) * bb]));
    }
    w
}

/// Gaussian activations; with `outliers`, 1% of them are 8x larger (as in real hidden
/// states, which makes the int8 quantization of their blocks coarser).
fn random_x(rng: &mut StdRng, len: usize, outliers: bool) -> Vec<f32> {
    (0..len)
        .map(|_| {
            let u1: f32 = rng.gen_range(1e-7f32..1.0);
            let u2: f32 = rng.gen();
            let g = (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos();
            if outliers && rng.gen_ratio(1, 100) {
                g * 8.0
            } else {
                g
            }
        })
        .collect()
}

/// Reference activation quantization (ggml Q8_1 style): d = amax/127, q = round(x/d).
fn quantize_ref(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    let mut q = Vec::with_capacity(x.len());
    let mut d = Vec::with_capacity(x.len() / 32);
    for blk in x.chunks(32) {
        let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let db = amax / 127.0;
        let id = if db > 0.0 { 1.0 / db } else { 0.0 };
        for &v in blk {
            q.push((v * id).round_ties_even().clamp(-127.0, 127.0) as i8);
        }
        d.push(db);
    }
    (q, d)
}

/// Simple scalar reference with the same activation quantization and integer dot
/// products, straight from the GGUF bytes, accumulated in f64.
fn reference_quantized(ty: QuantType, bytes: &[u8], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    let m = x.len() / k;
    let nb = k / 32;
    let bb = ty.block_bytes();
    let (qa, da) = quantize_ref(x);
    let mut out = vec![0f32; m * n];
    for t in 0..m {
        for r in 0..n {
            let mut acc = 0f64;
            for b in 0..nb {
                let blk = &bytes[(r * nb + b) * bb..(r * nb + b + 1) * bb];
                let a = &qa[(t * nb + b) * 32..(t * nb + b + 1) * 32];
                let d_a = da[t * nb + b] as f64;
                let d_w = f16::from_le_bytes([blk[0], blk[1]]).to_f64();
                match ty {
                    QuantType::Q4_1 => {
                        let m_w = f16::from_le_bytes([blk[2], blk[3]]).to_f64();
                        let mut dot = 0i32;
                        for j in 0..16 {
                            dot += (blk[4 + j] & 0x0F) as i32 * a[j] as i32;
                            dot += (blk[4 + j] >> 4) as i32 * a[j + 16] as i32;
                        }
                        let sum_a: i32 = a.iter().map(|&v| v as i32).sum();
                        acc += d_w * d_a * dot as f64 + m_w * d_a * sum_a as f64;
                    }
                    QuantType::Q8_0 => {
                        let mut dot = 0i32;
                        for j in 0..32 {
                            dot += (blk[2 + j] as i8) as i32 * a[j] as i32;
                        }
                        acc += d_w * d_a * dot as f64;
                    }
                }
            }
            out[t * n + r] = acc as f32;
        }
    }
    out
}

/// Exact product of dequantized weights and unquantized activations (f64 accumulation).
fn reference_exact(w: &[f32], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    let m = x.len() / k;
    let mut out = vec![0f32; m * n];
    for t in 0..m {
        for r in 0..n {
            let mut acc = 0f64;
            for i in 0..k {
                acc += w[r * k + i] as f64 * x[t * k + i] as f64;
            }
            out[t * n + r] = acc as f32;
        }
    }
    out
}

fn norm(v: &[f32]) -> f64 {
    v.iter()
        .map(|&a| (a as f64) * (a as f64))
        .sum::<f64>()
        .sqrt()
}

fn diff_norm(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum::<f64>()
        .sqrt()
}

fn run(pm: &PackedMatrix, kernel: Kernel, x: &[f32], m: usize) -> Vec<f32> {
    let mut dst = vec![f32::NAN; m * pm.rows()];
    pm.matmul_with(kernel, x, m, &mut dst).unwrap();
    dst
}

#[test]
fn reports_kernel_level() {
    let level = kernel_level();
    assert!(level == "avx512-vnni" || level == "scalar");
    eprintln!("kernel level: {level}");
}

/// (a) kernels == same-arithmetic scalar reference (rel. err < 1e-5 of the row norm);
/// VNNI == portable scalar kernel bit for bit.
/// (b) close to the exact f32 product: the only approximation is the int8 activation
/// quantization (per element error <= amax/254 of its block, RMS about amax/440, so about
/// 0.6% of a row's norm for Gaussian activations), so the row's relative error must be
/// < 2e-2. (Measured worst: 1.5e-2 at k = 32, where a row is a single block and shares
/// one quantization error vector; at most 6.2e-3 for k >= 64.)
#[test]
fn matches_references_all_shapes() {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut worst_a = 0f64;
    let mut worst_b = 0f64;
    for ty in TYPES {
        for k in KS {
            for n in NS {
                let bytes = random_gguf(&mut rng, ty, n, k);
                let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
                assert_eq!((pm.rows(), pm.cols()), (n, k));
                let w = decode_matrix(ty, &bytes, n, k);
                for m in MS {
                    let x = random_x(&mut rng, m * k, false);
                    let got = run(&pm, Kernel::detect(), &x, m);
                    let scalar = run(&pm, Kernel::Scalar, &x, m);
                    assert!(
                        got.iter()
                            .zip(&scalar)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty:?} n={n} k={k} m={m}: kernel and scalar path differ"
                    );
                    let refq = reference_quantized(ty, &bytes, n, k, &x);
                    let exact = reference_exact(&w, n, k, &x);
                    // Rows of fewer than 15 outputs (n = 1) are pooled over all tokens so
                    // that the denominator is a norm of many outputs, never ~0 by chance.
                    let row = if n >= 15 { n } else { m * n };
                    let pooled_small = row < 8;
                    for ((g, q), e) in got.chunks(row).zip(refq.chunks(row)).zip(exact.chunks(row))
                    {
                        let ea = diff_norm(g, q) / norm(q);
                        assert!(ea < 1e-5, "{ty:?} n={n} k={k} m={m}: (a) rel err {ea}");
                        worst_a = worst_a.max(ea);
                        // (b) with fewer than 8 outputs pooled, compare with the
                        // Cauchy-Schwarz scale Σ‖w_r‖·‖x_t‖ instead of the output norm.
                        let denom = if pooled_small {
                            let xs = norm(&x[..k]);
                            (0..n).map(|r| norm(&w[r * k..(r + 1) * k]) * xs).sum()
                        } else {
                            norm(e)
                        };
                        let eb = diff_norm(g, e) / denom;
                        assert!(eb < 2e-2, "{ty:?} n={n} k={k} m={m}: (b) rel err {eb}");
                        if !pooled_small {
                            worst_b = worst_b.max(eb);
                        }
                    }
                }
            }
        }
    }
    eprintln!("worst (a) rel err {worst_a:.2e}, worst (b) rel err {worst_b:.2e}");
}

#[test]
fn dequantize_row_is_exact() {
    let mut rng = StdRng::seed_from_u64(7);
    for ty in TYPES {
        for (n, k) in [(1, 32), (17, 64), (40, 576)] {
            let bytes = random_gguf(&mut rng, ty, n, k);
            let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
            let w = decode_matrix(ty, &bytes, n, k);
            let mut out = vec![0f32; k];
            for r in 0..n {
                pm.dequantize_row(r, &mut out).unwrap();
                for (a, b) in out.iter().zip(&w[r * k..(r + 1) * k]) {
                    assert_eq!(a.to_bits(), b.to_bits(), "{ty:?} row {r}");
                }
            }
            assert!(matches!(
                pm.dequantize_row(n, &mut out),
                Err(QuantError::RowOutOfRange { .. })
            ));
            let mut short = vec![0f32; k - 1];
            assert!(pm.dequantize_row(0, &mut short).is_err());
        }
    }
}

#[test]
fn error_cases() {
    for ty in TYPES {
        let bb = ty.block_bytes();
        let good = vec![0u8; 3 * 2 * bb];
        assert!(PackedMatrix::from_gguf_bytes(ty, &good, 3, 64).is_ok());
        // Wrong byte lengths.
        assert!(matches!(
            PackedMatrix::from_gguf_bytes(ty, &good[1..], 3, 64),
            Err(QuantError::Length { .. })
        ));
        assert!(PackedMatrix::from_gguf_bytes(ty, &good, 2, 64).is_err());
        assert!(PackedMatrix::from_gguf_bytes(ty, &good, 3, 96).is_err());
        // k not a multiple of 32, or zero; no rows.
        assert!(matches!(
            PackedMatrix::from_gguf_bytes(ty, &good, 3, 48),
            Err(QuantError::BadCols { k: 48 })
        ));
        assert!(PackedMatrix::from_gguf_bytes(ty, &[], 3, 0).is_err());
        assert!(matches!(
            PackedMatrix::from_gguf_bytes(ty, &[], 0, 64),
            Err(QuantError::NoRows)
        ));
        // Overflowing shapes error instead of panicking.
        assert!(PackedMatrix::from_gguf_bytes(ty, &good, usize::MAX / 2, 64).is_err());
        // Wrong x / dst lengths.
        let pm = PackedMatrix::from_gguf_bytes(ty, &good, 3, 64).unwrap();
        let mut dst = vec![0f32; 2 * 3];
        assert!(pm.matmul(&[0.0; 2 * 64], 2, &mut dst).is_ok());
        assert!(pm.matmul(&[0.0; 2 * 64 - 1], 2, &mut dst).is_err());
        assert!(pm.matmul(&[0.0; 2 * 64], 1, &mut dst).is_err());
        assert!(pm.matmul(&[0.0; 2 * 64], 2, &mut dst[..5]).is_err());
        assert!(pm.matmul(&[], 0, &mut []).is_ok());
    }
}

/// A token's output is bit-identical alone (m = 1) or inside any batch, with any thread
/// count: the accumulation order of a (row, token) never depends on the tiling.
#[test]
fn batch_invariance() {
    let mut rng = StdRng::seed_from_u64(99);
    let pools: Vec<rayon::ThreadPool> = [1, 2, 3]
        .iter()
        .map(|&t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap()
        })
        .collect();
    for ty in TYPES {
        for (n, k) in [(17, 64), (576, 576), (1536, 576), (576, 1536), (4000, 576)] {
            let bytes = random_gguf(&mut rng, ty, n, k);
            let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
            let x = random_x(&mut rng, 70 * k, true);
            for kernel in [Kernel::detect(), Kernel::Scalar] {
                let full = run(&pm, kernel, &x, 70);
                let batch9 = run(&pm, kernel, &x[..9 * k], 9);
                for t in 0..9 {
                    let single = run(&pm, kernel, &x[t * k..(t + 1) * k], 1);
                    let same = |a: &[f32], b: &[f32]| {
                        a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
                    };
                    assert!(
                        same(&single, &batch9[t * n..(t + 1) * n]),
                        "{ty:?} {n}x{k} {kernel:?}: token {t} alone != in batch of 9"
                    );
                    assert!(
                        same(&single, &full[t * n..(t + 1) * n]),
                        "{ty:?} {n}x{k} {kernel:?}: token {t} alone != in batch of 70"
                    );
                }
                for pool in &pools {
                    let other = pool.install(|| run(&pm, kernel, &x, 70));
                    assert!(
                        other
                            .iter()
                            .zip(&full)
                            .all(|(p, q)| p.to_bits() == q.to_bits()),
                        "{ty:?} {n}x{k}: result depends on the thread count"
                    );
                }
            }
        }
    }
}

#[test]
fn packed_matrix_is_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<PackedMatrix>();
}
