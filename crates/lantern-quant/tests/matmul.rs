//! Correctness of the repacked matrix products, for every weight type at every kernel
//! level this CPU runs, against plain Rust references computed straight from the GGUF
//! bytes; and bit-identical results across levels.

use half::f16;
use lantern_quant::{Blockwise, Kernel, PackedMatrix, QuantError, QuantType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The levels this CPU runs; the others are named once on stderr (skipped, not failed).
fn levels() -> Vec<Kernel> {
    let (have, lack): (Vec<Kernel>, Vec<Kernel>) =
        Kernel::ALL.into_iter().partition(|k| k.available());
    if !lack.is_empty() {
        eprintln!("note: this CPU lacks kernel levels {lack:?}; their checks are skipped");
    }
    have
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

/// Random GGUF bytes for an `n x k` matrix: random quants and valid scales of the
/// magnitudes quantizers write.
fn random_gguf(rng: &mut StdRng, ty: QuantType, n: usize, k: usize) -> Vec<u8> {
    let blocks = n * k / ty.block_values();
    let mut out = Vec::with_capacity(blocks * ty.block_bytes());
    for _ in 0..blocks {
        let start = out.len();
        let d = rng.gen_range(1e-3f32..2e-2);
        match ty {
            QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => {
                let sign = if rng.gen() { 1.0 } else { -1.0 };
                out.extend_from_slice(&f16_bytes(sign * d));
            }
            QuantType::Q4_1 | QuantType::Q5_1 => {
                // m = block min, roughly centring the values on zero, plus some skew.
                let levels = if ty == QuantType::Q4_1 { 7.5 } else { 15.5 };
                out.extend_from_slice(&f16_bytes(d));
                out.extend_from_slice(&f16_bytes(-d * levels * rng.gen_range(0.7f32..1.3)));
            }
            QuantType::Q4K | QuantType::Q5K => {
                out.extend_from_slice(&f16_bytes(d / 32.0));
                out.extend_from_slice(&f16_bytes(d / 4.0));
            }
            QuantType::Q6K | QuantType::Q3K => {}
            QuantType::F16 | QuantType::BF16 | QuantType::F32 => {
                unreachable!("dense: random_dense")
            }
        }
        while out.len() < start + ty.block_bytes() {
            out.push(rng.gen());
        }
        if matches!(ty, QuantType::Q6K | QuantType::Q3K) {
            let at = start + ty.block_bytes() - 2;
            out[at..at + 2].copy_from_slice(&f16_bytes(d / 64.0));
        }
    }
    out
}

/// 32 values of a GGUF block: `w_j = d[j / 16] · q_j (+ m)`, as ggml defines them.
struct Part {
    q: [i32; 32],
    d: [f32; 2],
    m: Option<f32>,
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Straight decode of one GGUF block (ggml's dequantize_row_* definitions).
fn parts(ty: QuantType, b: &[u8]) -> Vec<Part> {
    let simple = |d: f32, m: Option<f32>, q: [i32; 32]| Part { q, d: [d, d], m };
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1 => {
            let with_m = matches!(ty, QuantType::Q4_1 | QuantType::Q5_1);
            let five = matches!(ty, QuantType::Q5_0 | QuantType::Q5_1);
            let mut at = if with_m { 4 } else { 2 };
            let qh = if five {
                at += 4;
                u32::from_le_bytes(b[at - 4..at].try_into().unwrap())
            } else {
                0
            };
            let offset = match ty {
                QuantType::Q4_0 => 8,
                QuantType::Q5_0 => 16,
                _ => 0,
            };
            let q = std::array::from_fn(|j| {
                let nib = if j < 16 {
                    b[at + j] & 15
                } else {
                    b[at + j - 16] >> 4
                };
                (nib as i32 | ((qh >> j & 1) as i32) << 4) - offset
            });
            let m = with_m.then(|| f16_at(b, 2));
            vec![simple(f16_at(b, 0), m, q)]
        }
        QuantType::Q8_0 => vec![simple(
            f16_at(b, 0),
            None,
            std::array::from_fn(|j| b[2 + j] as i8 as i32),
        )],
        QuantType::Q4K | QuantType::Q5K => {
            let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
            let sc = &b[4..16];
            let (qh, qs) = if ty == QuantType::Q5K {
                (Some(&b[16..48]), &b[48..176])
            } else {
                (None, &b[16..144])
            };
            (0..8)
                .map(|j| {
                    let (s, m) = if j < 4 {
                        (sc[j] & 63, sc[j + 4] & 63)
                    } else {
                        (
                            (sc[j + 4] & 15) | (sc[j - 4] >> 6) << 4,
                            (sc[j + 4] >> 4) | (sc[j] >> 6) << 4,
                        )
                    };
                    let q = std::array::from_fn(|l| {
                        let byte = qs[32 * (j / 2) + l];
                        let nib = if j % 2 == 0 { byte & 15 } else { byte >> 4 };
                        let h = qh.map_or(0, |qh| qh[l] >> j & 1);
                        (nib | h << 4) as i32
                    });
                    simple(d * s as f32, Some(-(dmin * m as f32)), q)
                })
                .collect()
        }
        QuantType::F16 | QuantType::BF16 | QuantType::F32 => unreachable!("not quantized"),
        QuantType::Q3K => {
            // ggml's dequantize_row_q3_K, its scale unpacking on u32 words included.
            let (hm, qs, d) = (&b[0..32], &b[32..96], f16_at(b, 108));
            let word =
                |i: usize| u32::from_le_bytes(b[96 + 4 * i..100 + 4 * i].try_into().unwrap());
            let (a0, a1, tmp) = (word(0), word(1), word(2));
            let (k1, k2) = (0x0303_0303u32, 0x0f0f_0f0fu32);
            let aux = [
                (a0 & k2) | ((tmp & k1) << 4),
                (a1 & k2) | (((tmp >> 2) & k1) << 4),
                ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
                ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4),
            ];
            let scales: Vec<i32> = aux
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .map(|s| s as i8 as i32 - 32)
                .collect();
            let mut all = [0i32; 256];
            let mut m = 1u8;
            for n in 0..2 {
                for j in 0..4 {
                    for l in 0..32 {
                        let low = (qs[32 * n + l] >> (2 * j) & 3) as i32;
                        all[128 * n + 32 * j + l] = low - if hm[l] & m != 0 { 0 } else { 4 };
                    }
                    m <<= 1;
                }
            }
            (0..8)
                .map(|j| Part {
                    q: all[32 * j..32 * j + 32].try_into().unwrap(),
                    d: [d * scales[2 * j] as f32, d * scales[2 * j + 1] as f32],
                    m: None,
                })
                .collect()
        }
        QuantType::Q6K => {
            let (ql, qh, sc, d) = (&b[0..128], &b[128..192], &b[192..208], f16_at(b, 208));
            let mut all = [0i32; 256];
            for n in 0..2 {
                for l in 0..32 {
                    let (ql, qh) = (&ql[64 * n..], qh[32 * n + l] as i32);
                    let base = 128 * n + l;
                    all[base] = ((ql[l] & 15) as i32 | (qh & 3) << 4) - 32;
                    all[base + 32] = ((ql[l + 32] & 15) as i32 | (qh >> 2 & 3) << 4) - 32;
                    all[base + 64] = ((ql[l] >> 4) as i32 | (qh >> 4 & 3) << 4) - 32;
                    all[base + 96] = ((ql[l + 32] >> 4) as i32 | (qh >> 6 & 3) << 4) - 32;
                }
            }
            (0..8)
                .map(|j| Part {
                    q: all[32 * j..32 * j + 32].try_into().unwrap(),
                    d: [d * sc[2 * j] as i8 as f32, d * sc[2 * j + 1] as i8 as f32],
                    m: None,
                })
                .collect()
        }
    }
}

/// All 32-value parts of an `n x k` matrix, row-major.
fn matrix_parts(ty: QuantType, bytes: &[u8]) -> Vec<Part> {
    bytes
        .chunks(ty.block_bytes())
        .flat_map(|b| parts(ty, b))
        .collect()
}

fn dequantize(parts: &[Part]) -> Vec<f32> {
    parts
        .iter()
        .flat_map(|p| {
            (0..32).map(move |j| {
                let w = p.d[j / 16] * p.q[j] as f32;
                p.m.map_or(w, |m| w + m)
            })
        })
        .collect()
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

/// The same activation quantization and weights as the kernels, accumulated in f64.
fn reference_quantized(parts: &[Part], n: usize, k: usize, x: &[f32]) -> Vec<f32> {
    let (m, nb) = (x.len() / k, k / 32);
    let (qa, da) = quantize_ref(x);
    let mut out = vec![0f32; m * n];
    for t in 0..m {
        for r in 0..n {
            let mut acc = 0f64;
            for b in 0..nb {
                let p = &parts[r * nb + b];
                let a = &qa[(t * nb + b) * 32..][..32];
                let d_a = da[t * nb + b] as f64;
                for (j, (&q, &a)) in p.q.iter().zip(a).enumerate() {
                    let w = p.d[j / 16] as f64 * q as f64 + p.m.unwrap_or(0.0) as f64;
                    acc += w * a as f64 * d_a;
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
            let acc: f64 = (0..k)
                .map(|i| w[r * k + i] as f64 * x[t * k + i] as f64)
                .sum();
            out[t * n + r] = acc as f32;
        }
    }
    out
}

fn norm(v: &[f32]) -> f64 {
    v.iter().map(|&a| (a as f64).powi(2)).sum::<f64>().sqrt()
}

fn diff_norm(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum::<f64>()
        .sqrt()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

fn run(pm: &PackedMatrix, kernel: Kernel, x: &[f32], m: usize) -> Vec<f32> {
    let mut dst = vec![f32::NAN; m * pm.rows()];
    pm.matmul_with(kernel, x, m, &mut dst).unwrap();
    dst
}

/// Column counts per type: not multiples of a panel's 64 bytes of a row's nibbles, and
/// several super-blocks for the K-quants.
fn ks(ty: QuantType) -> &'static [usize] {
    if ty.block_values() == 256 {
        &[256, 768]
    } else {
        &[32, 96, 576]
    }
}

const NS: [usize; 5] = [1, 15, 17, 33, 50];
const MS: [usize; 5] = [1, 2, 3, 5, 9];

/// (a) every level == the same-arithmetic f64 reference (rel. err < 1e-5 of the row
/// norm), and every level == the scalar level bit for bit;
/// (b) close to the exact f32 product: the only approximation is the int8 activation
/// quantization (per element error <= amax/254 of its block, RMS about amax/440, so about
/// 0.6% of a row's norm for Gaussian activations), so a row's relative error must be
/// < 2e-2 (measured worst about 1.5e-2 at k = 32, where a row is one block).
#[test]
fn every_level_matches_the_references() {
    let levels = levels();
    let mut rng = StdRng::seed_from_u64(0x5eed);
    for ty in QuantType::QUANTIZED {
        let (mut worst_a, mut worst_b) = (0f64, 0f64);
        for &k in ks(ty) {
            for n in NS {
                let bytes = random_gguf(&mut rng, ty, n, k);
                let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
                assert_eq!((pm.rows(), pm.cols(), pm.quant_type()), (n, k, ty));
                let parts = matrix_parts(ty, &bytes);
                let w = dequantize(&parts);
                for m in MS {
                    let x = random_x(&mut rng, m * k, false);
                    let scalar = run(&pm, Kernel::Scalar, &x, m);
                    for &level in &levels[1..] {
                        let got = run(&pm, level, &x, m);
                        assert!(
                            same_bits(&got, &scalar),
                            "{ty} n={n} k={k} m={m}: {level} and scalar differ"
                        );
                    }
                    let refq = reference_quantized(&parts, n, k, &x);
                    let exact = reference_exact(&w, n, k, &x);
                    // With fewer than 15 outputs per row (n = 1) all tokens are pooled,
                    // so that the denominator is a norm of many outputs, never ~0 by chance.
                    let row = if n >= 15 { n } else { m * n };
                    for ((g, q), e) in scalar
                        .chunks(row)
                        .zip(refq.chunks(row))
                        .zip(exact.chunks(row))
                    {
                        let ea = diff_norm(g, q) / norm(q);
                        assert!(ea < 1e-5, "{ty} n={n} k={k} m={m}: (a) rel err {ea}");
                        worst_a = worst_a.max(ea);
                        if row >= 8 {
                            let eb = diff_norm(g, e) / norm(e);
                            assert!(eb < 2e-2, "{ty} n={n} k={k} m={m}: (b) rel err {eb}");
                            worst_b = worst_b.max(eb);
                        }
                    }
                }
            }
        }
        eprintln!("{ty}: worst (a) rel err {worst_a:.2e}, worst (b) rel err {worst_b:.2e}");
    }
}

/// Products big enough to be split over threads, with the widest activations: all levels
/// still agree bit for bit and match the reference.
#[test]
fn large_products_agree_across_levels() {
    let levels = levels();
    let mut rng = StdRng::seed_from_u64(3);
    for ty in QuantType::QUANTIZED {
        let (n, k, m) = (300, 1024, 12);
        let bytes = random_gguf(&mut rng, ty, n, k);
        let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
        let x = random_x(&mut rng, m * k, true);
        let scalar = run(&pm, Kernel::Scalar, &x, m);
        for &level in &levels[1..] {
            assert!(same_bits(&run(&pm, level, &x, m), &scalar), "{ty}: {level}");
        }
        let refq = reference_quantized(&matrix_parts(ty, &bytes), n, k, &x);
        let e = diff_norm(&scalar, &refq) / norm(&refq);
        assert!(e < 1e-5, "{ty}: rel err {e}");
    }
}

/// Batches of 32 tokens and more, where the `amx` level runs its tile products (groups
/// of 16 tokens, the last filled up with zeros): every level equals the scalar level bit
/// for bit, for every type, with partial last panels and groups, one-block rows and the
/// extreme quants.
#[test]
fn tile_sized_batches_agree_across_levels() {
    let levels = levels();
    if !Kernel::Amx.available() {
        eprintln!("skipped: no AMX here; the tile-sized batches run at the other levels");
    }
    let mut rng = StdRng::seed_from_u64(0xa3c);
    for ty in QuantType::QUANTIZED {
        for &k in ks(ty) {
            for n in [15, 33, 50] {
                let mut bytes = random_gguf(&mut rng, ty, n, k);
                if n == 50 {
                    // Every quant at its largest (the widest unpacked bytes).
                    let bb = ty.block_bytes();
                    let quants = match ty {
                        QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => 2..bb,
                        QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4K | QuantType::Q5K => {
                            4..bb
                        }
                        _ => 0..bb - 2,
                    };
                    let fill = if ty == QuantType::Q8_0 { 0x80 } else { 0xFF };
                    for block in bytes.chunks_mut(bb) {
                        block[quants.clone()].fill(fill);
                    }
                }
                let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
                for m in [32, 37, 48, 67, 300] {
                    let x = random_x(&mut rng, m * k, m == 37);
                    let scalar = run(&pm, Kernel::Scalar, &x, m);
                    for &level in &levels[1..] {
                        assert!(
                            same_bits(&run(&pm, level, &x, m), &scalar),
                            "{ty} n={n} k={k} m={m}: {level} and scalar differ"
                        );
                    }
                }
            }
        }
    }
}

/// The largest quants against activations that quantize to ±127 everywhere (the worst
/// case for the AVX2 kernels' 16-bit intermediate sums): every level still equals the
/// scalar level and the reference.
#[test]
fn extreme_quants_and_activations_do_not_saturate() {
    let levels = levels();
    let mut rng = StdRng::seed_from_u64(17);
    for ty in QuantType::QUANTIZED {
        let (n, k) = (33, 512);
        let mut bytes = random_gguf(&mut rng, ty, n, k);
        // Every quant at its extreme: all bits set (4-8 bit unsigned), or -128 for Q8_0.
        let bb = ty.block_bytes();
        let quants = match ty {
            QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => 2..bb,
            QuantType::Q4_1 | QuantType::Q5_1 | QuantType::Q4K | QuantType::Q5K => 4..bb,
            _ => 0..bb - 2,
        };
        let fill = if ty == QuantType::Q8_0 { 0x80 } else { 0xFF };
        for block in bytes.chunks_mut(bb) {
            block[quants.clone()].fill(fill);
        }
        let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
        let parts = matrix_parts(ty, &bytes);
        for sign in [1.0f32, -1.0] {
            let x: Vec<f32> = (0..k).map(|i| sign * (1.0 + i as f32 / k as f32)).collect();
            let scalar = run(&pm, Kernel::Scalar, &x, 1);
            for &level in &levels[1..] {
                assert!(
                    same_bits(&run(&pm, level, &x, 1), &scalar),
                    "{ty} sign {sign}: {level} and scalar differ"
                );
            }
            let refq = reference_quantized(&parts, n, k, &x);
            let e = diff_norm(&scalar, &refq) / norm(&refq);
            assert!(e < 1e-5, "{ty} sign {sign}: rel err {e}");
        }
    }
}

#[test]
fn dequantize_row_is_exact() {
    let mut rng = StdRng::seed_from_u64(7);
    for ty in QuantType::QUANTIZED {
        let k = 3 * ty.block_values();
        for n in [1, 17, 40] {
            let bytes = random_gguf(&mut rng, ty, n, k);
            let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
            let w = dequantize(&matrix_parts(ty, &bytes));
            let mut out = vec![0f32; k];
            for r in 0..n {
                pm.dequantize_row(r, &mut out).unwrap();
                assert!(same_bits(&out, &w[r * k..(r + 1) * k]), "{ty} row {r}");
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
    for ty in QuantType::QUANTIZED {
        let (bb, bv) = (ty.block_bytes(), ty.block_values());
        let k = 2 * bv;
        let good = vec![0u8; 3 * 2 * bb];
        assert!(PackedMatrix::from_gguf_bytes(ty, &good, 3, k).is_ok());
        // Wrong byte lengths.
        assert!(matches!(
            PackedMatrix::from_gguf_bytes(ty, &good[1..], 3, k),
            Err(QuantError::Length { .. })
        ));
        assert!(PackedMatrix::from_gguf_bytes(ty, &good, 2, k).is_err());
        assert!(PackedMatrix::from_gguf_bytes(ty, &good, 3, 3 * bv).is_err());
        // k not a multiple of the block, or zero; no rows.
        assert!(matches!(
            PackedMatrix::from_gguf_bytes(ty, &good, 3, bv + 16),
            Err(QuantError::BadCols { .. })
        ));
        assert!(PackedMatrix::from_gguf_bytes(ty, &[], 3, 0).is_err());
        assert!(matches!(
            PackedMatrix::from_gguf_bytes(ty, &[], 0, k),
            Err(QuantError::NoRows)
        ));
        // Overflowing shapes error instead of panicking.
        assert!(PackedMatrix::from_gguf_bytes(ty, &good, usize::MAX / 2, k).is_err());
        // Wrong x / dst lengths.
        let pm = PackedMatrix::from_gguf_bytes(ty, &good, 3, k).unwrap();
        let mut dst = vec![0f32; 2 * 3];
        assert!(pm.matmul(&vec![0.0; 2 * k], 2, &mut dst).is_ok());
        assert!(pm.matmul(&vec![0.0; 2 * k - 1], 2, &mut dst).is_err());
        assert!(pm.matmul(&vec![0.0; 2 * k], 1, &mut dst).is_err());
        assert!(pm.matmul(&vec![0.0; 2 * k], 2, &mut dst[..5]).is_err());
        assert!(pm.matmul(&[], 0, &mut []).is_ok());
    }
}

/// One rayon pool per thread count.
fn thread_pools(threads: &[usize]) -> Vec<rayon::ThreadPool> {
    threads
        .iter()
        .map(|&t| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(t)
                .build()
                .unwrap()
        })
        .collect()
}

/// A token's output is bit-identical alone (m = 1) or inside any batch, with any thread
/// count, at every level: the accumulation order of a (row, token) never depends on the
/// tiling.
#[test]
fn batch_invariance() {
    let levels = levels();
    let mut rng = StdRng::seed_from_u64(99);
    // 16 threads: small matrices' decode batches are cut along the tokens too.
    let pools = thread_pools(&[1, 3, 16]);
    for ty in QuantType::QUANTIZED {
        for (n, k) in [(17, 256), (1000, 512), (2100, 768)] {
            let bytes = random_gguf(&mut rng, ty, n, k);
            let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
            let x = random_x(&mut rng, 70 * k, true);
            for &kernel in &levels {
                let full = run(&pm, kernel, &x, 70);
                let batch9 = run(&pm, kernel, &x[..9 * k], 9);
                for t in [0, 4, 8] {
                    let single = run(&pm, kernel, &x[t * k..(t + 1) * k], 1);
                    assert!(
                        same_bits(&single, &batch9[t * n..(t + 1) * n]),
                        "{ty} {n}x{k} {kernel}: token {t} alone != in batch of 9"
                    );
                    assert!(
                        same_bits(&single, &full[t * n..(t + 1) * n]),
                        "{ty} {n}x{k} {kernel}: token {t} alone != in batch of 70"
                    );
                }
                for pool in &pools {
                    let other = pool.install(|| run(&pm, kernel, &x, 70));
                    assert!(
                        same_bits(&other, &full),
                        "{ty} {n}x{k} {kernel}: result depends on the thread count"
                    );
                    let other9 = pool.install(|| run(&pm, kernel, &x[..9 * k], 9));
                    assert!(
                        same_bits(&other9, &batch9),
                        "{ty} {n}x{k} {kernel}: a decode batch depends on the thread count"
                    );
                }
            }
        }
    }
}

/// Single-token products large enough to be shared between the caller and rayon helpers
/// (called from outside any pool, and from inside pools of 2, 3 and 16 threads, where the
/// chunks are single panels) are bit-identical to the same product on one thread at the
/// scalar level, at every level, with row counts that leave the last panel partial.
#[test]
fn shared_single_token_products_match_one_thread() {
    let levels = levels();
    let mut rng = StdRng::seed_from_u64(11);
    let pools = thread_pools(&[1, 2, 3, 16]);
    for ty in QuantType::QUANTIZED {
        for (n, k) in [(1001, 512), (333, 768), (4099, 256)] {
            let bytes = random_gguf(&mut rng, ty, n, k);
            let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
            let x = random_x(&mut rng, k, true);
            let serial = pools[0].install(|| run(&pm, Kernel::Scalar, &x, 1));
            for &kernel in &levels {
                let outside = run(&pm, kernel, &x, 1);
                assert!(
                    same_bits(&outside, &serial),
                    "{ty} {n}x{k} {kernel}: shared from outside the pool != one thread"
                );
                for pool in &pools[1..] {
                    for _ in 0..3 {
                        let inside = pool.install(|| run(&pm, kernel, &x, 1));
                        assert!(
                            same_bits(&inside, &serial),
                            "{ty} {n}x{k} {kernel}: shared inside a pool != one thread"
                        );
                    }
                }
            }
        }
    }
}

/// Products with the computing threads limited to one (`share::limit_threads`, what
/// `lantern bench --thread-speedup` switches step by step) are the same bits as with
/// every thread, single-token (shared) and batched (split for one thread) alike.
#[test]
fn limiting_the_threads_changes_no_bit() {
    use lantern_quant::share;
    let mut rng = StdRng::seed_from_u64(21);
    let pool = &thread_pools(&[3])[0];
    for ty in [QuantType::Q4_0, QuantType::Q4_1, QuantType::Q6K] {
        let (n, k) = (1001, 512);
        let bytes = random_gguf(&mut rng, ty, n, k);
        let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
        for m in [1, 32, 70] {
            let x = random_x(&mut rng, m * k, true);
            for &kernel in &levels() {
                let all = pool.install(|| run(&pm, kernel, &x, m));
                share::limit_threads(Some(1));
                let one = pool.install(|| run(&pm, kernel, &x, m));
                share::limit_threads(None);
                assert!(
                    same_bits(&one, &all),
                    "{ty} {n}x{k} m={m} {kernel}: limited to one thread != every thread"
                );
            }
        }
    }
}

/// `force_kernel` caps at the CPU and `matmul` then runs at the forced level.
#[test]
fn forced_level_is_capped_and_used() {
    let mut rng = StdRng::seed_from_u64(5);
    let bytes = random_gguf(&mut rng, QuantType::Q4_1, 40, 64);
    let pm = PackedMatrix::from_gguf_bytes(QuantType::Q4_1, &bytes, 40, 64).unwrap();
    let x = random_x(&mut rng, 3 * 64, false);
    for level in Kernel::ALL {
        let now = lantern_quant::force_kernel(Some(level));
        assert_eq!(now, level.capped());
        assert!(now.available() && now <= level);
        let mut dst = vec![0f32; 3 * 40];
        pm.matmul(&x, 3, &mut dst).unwrap();
        assert!(same_bits(&dst, &run(&pm, Kernel::Scalar, &x, 3)));
    }
    assert_eq!(
        lantern_quant::force_kernel(None),
        lantern_quant::active_kernel()
    );
}

/// Random dense weights as GGUF stores them, and their exact f32 values.
fn random_dense(rng: &mut StdRng, ty: QuantType, len: usize) -> (Vec<u8>, Vec<f32>) {
    let mut bytes = Vec::with_capacity(len * ty.block_bytes());
    let mut values = Vec::with_capacity(len);
    for _ in 0..len {
        let v = rng.gen_range(-0.1f32..0.1);
        let v = match ty {
            QuantType::F16 => {
                let h = f16::from_f32(v);
                bytes.extend_from_slice(&h.to_le_bytes());
                h.to_f32()
            }
            QuantType::BF16 => {
                let h = half::bf16::from_f32(v);
                bytes.extend_from_slice(&h.to_le_bytes());
                h.to_f32()
            }
            _ => {
                bytes.extend_from_slice(&v.to_le_bytes());
                v
            }
        };
        values.push(v);
    }
    (bytes, values)
}

/// Dense weights: every exact level == scalar bit for bit, close to the exact product
/// (the activations are not quantized: only f32 rounding, rel. err < 1e-5), every tile
/// shape of every level (1 to 7 and 12 tokens), odd shapes, k not a multiple of
/// anything, and rows read back exactly.
#[test]
fn dense_types_match_the_exact_product_at_every_level() {
    let levels = levels();
    let mut rng = StdRng::seed_from_u64(11);
    for ty in [QuantType::F16, QuantType::BF16, QuantType::F32] {
        assert!(ty.is_dense());
        for (n, k) in [(1, 7), (17, 37), (50, 96), (300, 1000)] {
            let (bytes, w) = random_dense(&mut rng, ty, n * k);
            let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
            let mut row = vec![0f32; k];
            for r in 0..n {
                pm.dequantize_row(r, &mut row).unwrap();
                assert!(same_bits(&row, &w[r * k..(r + 1) * k]), "{ty} row {r}");
            }
            for m in [1, 2, 3, 4, 5, 7, 12] {
                let x = random_x(&mut rng, m * k, true);
                let scalar = run(&pm, Kernel::Scalar, &x, m);
                let exact_levels = levels[1..].iter().filter(|l| l.for_type(ty).is_exact());
                for &level in exact_levels {
                    let got = run(&pm, level, &x, m);
                    assert!(same_bits(&got, &scalar), "{ty} {n}x{k} m={m}: {level}");
                }
                let exact = reference_exact(&w, n, k, &x);
                let e = diff_norm(&scalar, &exact) / norm(&exact);
                assert!(e < 1e-5, "{ty} {n}x{k} m={m}: rel err {e}");
                let single = run(&pm, Kernel::detect(), &x[..k], 1);
                assert!(
                    same_bits(&single, &scalar[..n]),
                    "{ty} {n}x{k}: batch variance"
                );
            }
        }
        assert!(PackedMatrix::from_gguf_bytes(ty, &[0; 6], 2, 2).is_err());
    }
}

/// BF16 weights at the opt-in BF16 levels (`vdpbf16ps` at avx512-bf16, `tdpbf16ps` on
/// AMX tiles at amx-bf16): the exact product of the weights and the activations rounded
/// to bf16, up to f32 summation (rel. err < 1e-5), so within bf16 rounding of the
/// unrounded product; batch invariant (each token alone, and a batch of many tokens cut
/// into tasks on the helper threads) and the same bits on 1, 3 and 16 threads; every tile
/// shape (19 panels: tiles of 4, 2 and 1; 1 to 4 tokens; groups of 16 tokens, whole and
/// partial) and odd k. Other weight types at those levels are the best exact level's, bit
/// for bit.
#[test]
fn bf16_weights_at_the_bf16_levels_match_the_rounded_product() {
    for level in [Kernel::Avx512Bf16, Kernel::AmxBf16] {
        if !level.available() {
            eprintln!("note: this CPU does not run {level}; its checks are skipped");
            continue;
        }
        bf16_level_matches_the_rounded_product(level);
    }
}

fn bf16_level_matches_the_rounded_product(level: Kernel) {
    let mut rng = StdRng::seed_from_u64(12);
    let pools = thread_pools(&[1, 3, 16]);
    for (n, k) in [(1, 7), (17, 37), (50, 96), (300, 1000), (64, 1)] {
        let (bytes, w) = random_dense(&mut rng, QuantType::BF16, n * k);
        let pm = PackedMatrix::from_gguf_bytes(QuantType::BF16, &bytes, n, k).unwrap();
        for m in [1, 2, 3, 5, 12, 16, 37, 80] {
            let x = random_x(&mut rng, m * k, true);
            let got = run(&pm, level, &x, m);
            let rounded: Vec<f32> = x
                .iter()
                .map(|&v| half::bf16::from_f32(v).to_f32())
                .collect();
            let want = reference_exact(&w, n, k, &rounded);
            let e = diff_norm(&got, &want) / norm(&want);
            assert!(
                e < 1e-5,
                "{level} {n}x{k} m={m}: rel err {e} to the rounded product"
            );
            let unrounded = reference_exact(&w, n, k, &x);
            let e = diff_norm(&got, &unrounded) / norm(&unrounded);
            assert!(
                e < 4e-3,
                "{level} {n}x{k} m={m}: rel err {e} to the exact product"
            );
            for t in 0..m {
                let single = run(&pm, level, &x[t * k..(t + 1) * k], 1);
                assert!(
                    same_bits(&single, &got[t * n..(t + 1) * n]),
                    "{level} {n}x{k} m={m}: token {t} alone differs"
                );
            }
            for pool in &pools {
                let other = pool.install(|| run(&pm, level, &x, m));
                assert!(
                    same_bits(&other, &got),
                    "{level} {n}x{k} m={m}: result depends on the thread count"
                );
            }
        }
    }
    for ty in [
        QuantType::Q4_1,
        QuantType::Q6K,
        QuantType::F16,
        QuantType::F32,
    ] {
        let (n, k) = (40, 256);
        let pm = if ty.is_dense() {
            PackedMatrix::from_gguf_bytes(ty, &random_dense(&mut rng, ty, n * k).0, n, k)
        } else {
            PackedMatrix::from_gguf_bytes(ty, &random_gguf(&mut rng, ty, n, k), n, k)
        }
        .unwrap();
        for m in [3, 40] {
            let x = random_x(&mut rng, m * k, true);
            let (got, want) = (run(&pm, level, &x, m), run(&pm, Kernel::detect(), &x, m));
            assert!(same_bits(&got, &want), "{ty} at {level}, m={m}");
        }
    }
}

#[test]
fn packed_matrix_is_send_sync() {
    fn check<T: Send + Sync>() {}
    check::<PackedMatrix>();
}

/// A product split by output rows (a stacked q/k/v or gate/up) gives, bit for bit, the
/// columns of the whole product: widths of whole panels (written in place) and not
/// (computed whole and split), a partial last panel, one token (shared between
/// threads), a few (calling thread) and many (tasks), quantized and dense types.
#[test]
fn split_products_equal_the_whole_products_columns() {
    let mut rng = StdRng::seed_from_u64(23);
    let types =
        QuantType::QUANTIZED
            .into_iter()
            .chain([QuantType::F16, QuantType::BF16, QuantType::F32]);
    for ty in types {
        let (n, k) = (1000, 512);
        let bytes = if ty.is_dense() {
            random_dense(&mut rng, ty, n * k).0
        } else {
            random_gguf(&mut rng, ty, n, k)
        };
        let pm = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
        for widths in [
            vec![n],
            vec![576, 192, 232],
            vec![16, 984],
            vec![10, 500, 490],
        ] {
            for m in [1, 3, 70] {
                let x = random_x(&mut rng, m * k, true);
                let mut whole = vec![0f32; m * n];
                pm.matmul(&x, m, &mut whole).unwrap();
                let parts = pm.matmul_parts(&x, m, &widths).unwrap();
                assert_eq!(parts.len(), widths.len());
                let mut at = 0;
                for (part, &w) in parts.iter().zip(&widths) {
                    assert_eq!(part.len(), m * w, "{ty} {widths:?} m={m}");
                    for t in 0..m {
                        let expected = &whole[t * n + at..t * n + at + w];
                        assert!(
                            same_bits(&part[t * w..(t + 1) * w], expected),
                            "{ty} {widths:?} m={m}: token {t}, rows {at}..{}",
                            at + w
                        );
                    }
                    at += w;
                }
            }
        }
        let x = random_x(&mut rng, k, false);
        for bad in [vec![999], vec![500, 0, 500], vec![600, 600]] {
            assert_eq!(
                pm.matmul_parts(&x, 1, &bad).unwrap_err(),
                QuantError::Widths {
                    widths: bad,
                    rows: n
                }
            );
        }
    }
}

/// The blockwise form (plain quants, f32 scales per 16 values, mins per 32) gives every
/// type's values bit for bit as the GGUF bytes define them, and refuses what is not a
/// quantized matrix of the stated shape.
#[test]
fn blockwise_form_gives_the_gguf_values_exactly() {
    let mut rng = StdRng::seed_from_u64(11);
    for ty in QuantType::QUANTIZED {
        let k = 2 * ty.block_values();
        for n in [1, 3] {
            let bytes = random_gguf(&mut rng, ty, n, k);
            let form = Blockwise::from_gguf_bytes(ty, &bytes, n, k).unwrap();
            let want = dequantize(&matrix_parts(ty, &bytes));
            let got: Vec<f32> = (0..n * k).map(|i| form.value(i)).collect();
            assert!(same_bits(&got, &want), "{ty} {n} x {k}");
            let mut row = vec![0f32; k];
            form.dequantize_row(n - 1, &mut row).unwrap();
            assert!(same_bits(&row, &want[(n - 1) * k..]), "{ty} last row");
            let per_byte = if form.bits() == 4 { 2 } else { 1 };
            assert_eq!(form.quants().len() * per_byte, n * k, "{ty} quants");
            assert_eq!(
                form.scales().len() * form.scale_group(),
                n * k,
                "{ty} scales"
            );
            assert!(form.mins().is_empty() || form.mins().len() == n * k / 32);
        }
        let bytes = random_gguf(&mut rng, ty, 2, ty.block_values());
        assert!(Blockwise::from_gguf_bytes(ty, &bytes[1..], 2, ty.block_values()).is_err());
        assert!(Blockwise::from_gguf_bytes(ty, &bytes, 2, ty.block_values() + 8).is_err());
        assert!(Blockwise::from_gguf_bytes(ty, &bytes, 0, ty.block_values()).is_err());
    }
    assert!(matches!(
        Blockwise::from_gguf_bytes(QuantType::F16, &[0; 64], 1, 32),
        Err(QuantError::NotQuantized { .. })
    ));
}
