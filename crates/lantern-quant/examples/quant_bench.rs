//! Throughput of the repacked matrix products of every weight type at every kernel level
//! this CPU runs, in one run.
//!
//! `cargo run -p lantern-quant --release --example quant_bench [-- --quick] [-- --decode [--batch N]]`
//! (threads: `RAYON_NUM_THREADS`, default all cores).
//!
//! `--decode` measures only decode: the matmuls of one SmolLM2-135M (Q4_1, and as BF16)
//! and one Gemma 3 270M step (layers, then the output matrix) at every level, called from
//! the main thread as the engine calls them, weights streamed from memory as in a real
//! step; `--batch N` makes it a step of N tokens (default 1; from 32 the `amx` level runs
//! the products on its tiles).
//!
//! Prints GFLOP/s (2·m·n·k per call) and GB/s (repacked weight bytes per call / time) for
//! m = 1 and m = 128 at n x k = 1536 x 1024 for every type, then the matmuls of a whole
//! SmolLM2-135M forward pass (30 layers of Q4_1 + the Q8_0 output matrix): decode
//! tokens/s at m = 1 and prefill tokens/s at m = 512.

use half::f16;
use lantern_quant::{kernel_level, Kernel, PackedMatrix, QuantType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::{Duration, Instant};

fn random_matrix(rng: &mut StdRng, ty: QuantType, n: usize, k: usize) -> PackedMatrix {
    if ty.is_dense() {
        let bytes: Vec<u8> = (0..n * k)
            .flat_map(|_| {
                let v = rng.gen_range(-0.1f32..0.1);
                match ty {
                    QuantType::F16 => f16::from_f32(v).to_le_bytes().to_vec(),
                    QuantType::BF16 => half::bf16::from_f32(v).to_le_bytes().to_vec(),
                    _ => v.to_le_bytes().to_vec(),
                }
            })
            .collect();
        return PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
    }
    let blocks = n * k / ty.block_values();
    let mut bytes: Vec<u8> = (0..blocks * ty.block_bytes()).map(|_| rng.gen()).collect();
    // Valid, quantizer-like f16 scales where each type keeps them.
    let scale_at: &[usize] = match ty {
        QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => &[0],
        QuantType::Q6K => &[208],
        QuantType::Q3K => &[108],
        _ => &[0, 2],
    };
    for block in bytes.chunks_mut(ty.block_bytes()) {
        let d = rng.gen_range(1e-3f32..2e-2);
        for &at in scale_at {
            block[at..at + 2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
        }
    }
    PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap()
}

/// Runs `f` repeatedly for about `budget`; returns (median, best) seconds per call.
fn time<F: FnMut()>(budget: Duration, mut f: F) -> (f64, f64) {
    f(); // warm-up
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 3 || (start.elapsed() < budget && times.len() < 10_000) {
        let t = Instant::now();
        f();
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (times[times.len() / 2], times[0])
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let budget = Duration::from_millis(if quick { 200 } else { 1000 });
    let mut rng = StdRng::seed_from_u64(1);
    println!(
        "kernel level: {}, rayon threads: {}",
        kernel_level(),
        rayon::current_num_threads()
    );
    let kernels: Vec<Kernel> = Kernel::ALL
        .into_iter()
        .rev()
        .filter(|k| k.available())
        .collect();
    if std::env::args().any(|a| a == "--decode") {
        let args: Vec<String> = std::env::args().collect();
        let batch = args
            .iter()
            .position(|a| a == "--batch")
            .map(|i| {
                args.get(i + 1)
                    .and_then(|v| v.parse().ok())
                    .expect("--batch N")
            })
            .unwrap_or(1);
        decode_passes(&mut rng, &kernels, budget, batch);
        return;
    }
    println!(
        "{:<5} {:>6} {:>5} {:>4} {:<12} {:>10} {:>10} {:>9} {:>9}",
        "type", "n", "k", "m", "kernel", "median us", "best us", "GFLOP/s", "GB/s"
    );
    for ty in QuantType::ALL {
        for (n, k) in [(1536, 1024)] {
            let w = random_matrix(&mut rng, ty, n, k);
            for m in [1usize, 128] {
                let x: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1f32..1.0)).collect();
                let mut dst = vec![0f32; m * n];
                for &kernel in &kernels {
                    let b = if kernel == Kernel::Scalar && m > 1 {
                        budget / 4
                    } else {
                        budget
                    };
                    let (med, best) = time(b, || w.matmul_with(kernel, &x, m, &mut dst).unwrap());
                    let flops = 2.0 * (m * n * k) as f64;
                    println!(
                        "{:<5} {:>6} {:>5} {:>4} {:<12} {:>10.1} {:>10.1} {:>9.1} {:>9.1}",
                        ty.name(),
                        n,
                        k,
                        m,
                        kernel.name(),
                        med * 1e6,
                        best * 1e6,
                        flops / med / 1e9,
                        w.packed_bytes() as f64 / med / 1e9,
                    );
                }
            }
        }
    }

    // SmolLM2-135M: 30 layers x (q, k, v, o, gate, up, down) in Q4_1 + Q8_0 output.
    let (hidden, kv, inter, vocab, layers) = (576, 192, 1536, 49152, 30);
    let mut mats = Vec::new();
    for _ in 0..layers {
        for (n, k) in [
            (hidden, hidden),
            (kv, hidden),
            (kv, hidden),
            (hidden, hidden),
            (inter, hidden),
            (inter, hidden),
            (hidden, inter),
        ] {
            mats.push(random_matrix(&mut rng, QuantType::Q4_1, n, k));
        }
    }
    let output = random_matrix(&mut rng, QuantType::Q8_0, vocab, hidden);
    let bytes: usize = mats.iter().map(|w| w.packed_bytes()).sum::<usize>() + output.packed_bytes();
    println!(
        "\nSmolLM2-135M matmuls only ({} Q4_1 matrices + Q8_0 output, {:.1} MB repacked)",
        mats.len(),
        bytes as f64 / 1e6
    );
    let max_elems = 512 * vocab;
    let x: Vec<f32> = (0..512 * inter)
        .map(|_| rng.gen_range(-1f32..1.0))
        .collect();
    let mut dst = vec![0f32; max_elems];
    for &kernel in &kernels {
        for m in [1usize, 512] {
            if kernel == Kernel::Scalar && m > 1 && quick {
                continue;
            }
            // Prefill computes the logits of the last token only (as an engine does).
            let pass = |dst: &mut [f32]| {
                for w in &mats {
                    let (n, k) = (w.rows(), w.cols());
                    w.matmul_with(kernel, &x[..m * k], m, &mut dst[..m * n])
                        .unwrap();
                }
                output
                    .matmul_with(kernel, &x[..hidden], 1, &mut dst[..vocab])
                    .unwrap();
            };
            // Called from the main thread (rayon injects each matmul into its pool) and
            // from inside a rayon worker (as an engine running its step in the pool).
            for in_pool in [false, true] {
                let (med, best) = if in_pool {
                    rayon::scope(|_| time(budget, || pass(&mut dst)))
                } else {
                    time(budget, || pass(&mut dst))
                };
                println!(
                    "{:<12} m = {m:>3} {:<11}: {:>8.2} ms/pass (best {:>7.2}), {:>8.1} tokens/s{}",
                    kernel.name(),
                    if in_pool { "(in pool)" } else { "(main)" },
                    med * 1e3,
                    best * 1e3,
                    m as f64 / med,
                    if m == 1 {
                        format!(", {:.1} GB/s", bytes as f64 / med / 1e9)
                    } else {
                        String::new()
                    }
                );
            }
        }
    }
}

/// One decode token's matrices of a model: (type, n, k) per layer, layers, and the
/// output matrix.
struct DecodeShape {
    name: &'static str,
    layer: &'static [(QuantType, usize, usize)],
    layers: usize,
    output: (QuantType, usize, usize),
}

const DECODE_SHAPES: [DecodeShape; 3] = [
    DecodeShape {
        name: "SmolLM2-135M Q4_1",
        layer: &[
            (QuantType::Q4_1, 576, 576),
            (QuantType::Q4_1, 192, 576),
            (QuantType::Q4_1, 192, 576),
            (QuantType::Q4_1, 576, 576),
            (QuantType::Q4_1, 1536, 576),
            (QuantType::Q4_1, 1536, 576),
            (QuantType::Q4_1, 576, 1536),
        ],
        layers: 30,
        output: (QuantType::Q8_0, 49152, 576),
    },
    // Gemma 3 270M Q4_K_M: half the layers have a Q8_0 value and a Q6_K down matrix.
    DecodeShape {
        name: "Gemma 3 270M Q4_K_M",
        layer: &[
            (QuantType::Q5_0, 1024, 640),
            (QuantType::Q5_0, 256, 640),
            (QuantType::Q8_0, 256, 640),
            (QuantType::Q4K, 640, 1024),
            (QuantType::Q5_0, 2048, 640),
            (QuantType::Q5_0, 2048, 640),
            (QuantType::Q6K, 640, 2048),
            (QuantType::Q5_0, 1024, 640),
            (QuantType::Q5_0, 256, 640),
            (QuantType::Q5_0, 256, 640),
            (QuantType::Q4K, 640, 1024),
            (QuantType::Q5_0, 2048, 640),
            (QuantType::Q5_0, 2048, 640),
            (QuantType::Q4K, 640, 2048),
        ],
        layers: 9,
        output: (QuantType::Q8_0, 262144, 640),
    },
    // SmolLM2-135M as a BF16 file (a Hugging Face checkpoint's type).
    DecodeShape {
        name: "SmolLM2-135M BF16",
        layer: &[
            (QuantType::BF16, 576, 576),
            (QuantType::BF16, 192, 576),
            (QuantType::BF16, 192, 576),
            (QuantType::BF16, 576, 576),
            (QuantType::BF16, 1536, 576),
            (QuantType::BF16, 1536, 576),
            (QuantType::BF16, 576, 1536),
        ],
        layers: 30,
        output: (QuantType::BF16, 49152, 576),
    },
];

/// ms per decode token of each model's layer matrices and output matrix, per level.
fn decode_passes(rng: &mut StdRng, kernels: &[Kernel], budget: Duration, m: usize) {
    for shape in &DECODE_SHAPES {
        let mut mats = Vec::new();
        for _ in 0..shape.layers {
            for &(ty, n, k) in shape.layer {
                mats.push(random_matrix(rng, ty, n, k));
            }
        }
        let (ty, n, k) = shape.output;
        let output = random_matrix(rng, ty, n, k);
        let layer_bytes: usize = mats.iter().map(|w| w.packed_bytes()).sum();
        println!(
            "\n{}: {} layer matrices {:.1} MB, output {:.1} MB (repacked)",
            shape.name,
            mats.len(),
            layer_bytes as f64 / 1e6,
            output.packed_bytes() as f64 / 1e6
        );
        let x: Vec<f32> = (0..m * 4096).map(|_| rng.gen_range(-1f32..1.0)).collect();
        let mut dst = vec![0f32; m * n];
        let kernels: Vec<Kernel> = kernels
            .iter()
            .copied()
            .filter(|k| *k != Kernel::Scalar)
            .collect();
        // Each product is timed alone and its median over many whole steps taken: a
        // shared machine preempts few of the short calls, so the sum of medians stays
        // close to an undisturbed step (one timed whole step would not). The levels take
        // turns step by step, so that the machine's drift falls on all of them alike.
        let mut times = vec![vec![Vec::new(); mats.len() + 1]; kernels.len()];
        let start = Instant::now();
        let budget = budget * kernels.len() as u32;
        while times[0][0].len() < 5 || (start.elapsed() < budget && times[0][0].len() < 1000) {
            for (&kernel, times) in kernels.iter().zip(&mut times) {
                for (w, t) in mats.iter().chain([&output]).zip(times) {
                    let (n, k) = (w.rows(), w.cols());
                    let t0 = Instant::now();
                    w.matmul_with(kernel, &x[..m * k], m, &mut dst[..m * n])
                        .unwrap();
                    t.push(t0.elapsed().as_secs_f64());
                }
            }
        }
        for (kernel, times) in kernels.iter().zip(&mut times) {
            let median = |t: &mut Vec<f64>| {
                t.sort_by(|a, b| a.partial_cmp(b).unwrap());
                t[t.len() / 2]
            };
            let out = median(times.last_mut().unwrap());
            let layers: f64 = times[..mats.len()].iter_mut().map(median).sum();
            let token = layers + out;
            println!(
                "{:<10} layers {:>6.2} ms ({:>5.1} GB/s), output {:>6.2} ms ({:>5.1} GB/s), step {:>6.2} ms = {:>7.1} tokens/s",
                kernel.name(),
                layers * 1e3,
                layer_bytes as f64 / layers / 1e9,
                out * 1e3,
                output.packed_bytes() as f64 / out / 1e9,
                token * 1e3,
                m as f64 / token
            );
        }
    }
}
