//! Decode-step graphs (src/graph.rs) against eager runs of the same work: a key's steps
//! are recorded, captured and replayed with new inputs each time, bit-equal to eager
//! runs; a step that changes shape under its key fails without running, and the key
//! runs eagerly after. Skips (one printed line) where no GPU can be opened.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use lantern_attn::GraphKey;
use lantern_cuda::{CudaCompute, CudaError, Gpu};
use lantern_model::blocks::Activation;
use lantern_model::compute::Compute;
use lantern_model::rope::{Rope, RopePairs, RopeScaling};
use lantern_model::{LoadOptions, ReducedRow, RowReduction, SampleDraw, TokenChoice};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const VOCAB: usize = 96;
const HIDDEN: usize = 64;
const FFN: usize = 160;
const HEADS: usize = 4;

struct Weights {
    embed: <CudaCompute as Compute>::Matrix,
    up: <CudaCompute as Compute>::Matrix,
    down: <CudaCompute as Compute>::Matrix,
    norm: <CudaCompute as Compute>::Vector,
    rope: Rope,
}

fn matrix(
    c: &CudaCompute,
    r: &mut StdRng,
    rows: usize,
    cols: usize,
    name: &str,
) -> <CudaCompute as Compute>::Matrix {
    let values: Vec<f32> = (0..rows * cols)
        .map(|_| r.gen_range(-0.5f32..0.5))
        .collect();
    let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, GgmlDType::F32).unwrap();
    c.matrix(&LoadOptions::default(), name, q).unwrap()
}

fn weights(c: &CudaCompute) -> Weights {
    let mut r = StdRng::seed_from_u64(7);
    Weights {
        embed: matrix(c, &mut r, VOCAB, HIDDEN, "embed"),
        up: matrix(c, &mut r, 2 * FFN, HIDDEN, "up"),
        down: matrix(c, &mut r, VOCAB, FFN, "down"),
        norm: c
            .vector((0..HIDDEN).map(|i| 1.0 + i as f32 / 128.0).collect())
            .unwrap(),
        rope: Rope::new(
            HIDDEN / HEADS,
            10_000.0,
            RopePairs::Halves,
            None,
            &RopeScaling::None,
        ),
    }
}

/// One "decode step" of the kinds of work a model step does: uploads (ids, the RoPE
/// table, row indices), products, element-wise kernels, a gather, rows reduced (argmax,
/// sampled, scored) and a copy back. Returns (the reduced rows, the rows).
fn step(
    c: &CudaCompute,
    w: &Weights,
    ids: &[u32],
    positions: &[usize],
) -> lantern_model::Result<(Vec<ReducedRow>, Vec<f32>)> {
    let n = ids.len();
    let table = c.rope_table(&w.rope, positions)?;
    let mut x = c.embed(&w.embed, ids, Some(0.5))?;
    c.rope(&table, &mut x, HEADS, HIDDEN / HEADS)?;
    let h = c.rms_norm(&x, &w.norm, 1e-6)?;
    let mut parts = c.matmul_parts(&w.up, &h, n, &[FFN, FFN])?;
    let up = parts.pop().unwrap();
    let mut gate = parts.pop().unwrap();
    c.act_mul(Activation::Silu, &mut gate, &up)?;
    let logits = c.matmul(&w.down, &gate, n)?;
    let rows: Vec<usize> = (0..n).rev().collect();
    let reversed = c.select_rows(&logits, &rows, VOCAB)?;
    // Odd rows sampled with a draw that changes with the step's inputs, even rows greedy,
    // every third row scored with logprobs, every fifth given a token to score.
    let wants: Vec<RowReduction> = (0..n)
        .map(|i| {
            let draw = (ids[i] % 97) as f32 / 97.0;
            let token = if i % 5 == 4 {
                TokenChoice::Given(ids[i])
            } else if i % 2 == 1 {
                // Every other sampled row cut by top-k and top-p.
                TokenChoice::Sample(SampleDraw {
                    top_k: if i % 4 == 1 { 20 } else { 0 },
                    top_p: if i % 4 == 1 { 0.8 } else { 1.0 },
                    ..SampleDraw::whole(draw, 0.7)
                })
            } else {
                TokenChoice::Argmax
            };
            RowReduction {
                token,
                logprobs: (i % 3 == 0 || i % 5 == 4).then_some(i % 7),
            }
        })
        .collect();
    let picked = c.reduce_rows(&reversed, VOCAB, &wants)?;
    Ok((picked, c.to_host(reversed)?))
}

fn gpu() -> Option<std::sync::Arc<Gpu>> {
    match Gpu::open(0) {
        Ok(g) => Some(g),
        Err(
            e @ (CudaError::LibraryMissing { .. }
            | CudaError::NoDevice { .. }
            | CudaError::Driver(_)),
        ) => {
            println!("skipped: no GPU ({e})");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn inputs(r: &mut StdRng, n: usize) -> (Vec<u32>, Vec<usize>) {
    let ids = (0..n).map(|_| r.gen_range(0..VOCAB as u32)).collect();
    let positions = (0..n).map(|_| r.gen_range(0..4096)).collect();
    (ids, positions)
}

#[test]
fn replayed_steps_equal_eager_steps_with_new_inputs_each_time() {
    let Some(gpu) = gpu() else { return };
    let c = CudaCompute::new(gpu.clone());
    let w = weights(&c);
    let mut r = StdRng::seed_from_u64(11);
    for n in [1usize, 5, 32] {
        let key = GraphKey {
            num_reqs: n,
            table_width: 16,
            whole_logits: false,
            capturing: false,
            probabilities: 0,
            edit_capacity: 0,
        };
        for round in 0..6 {
            let (ids, positions) = inputs(&mut r, n);
            let eager = step(&c, &w, &ids, &positions).unwrap();
            assert!(
                gpu.begin_graph_step(key).unwrap(),
                "n {n} round {round}: graphed"
            );
            let graphed = step(&c, &w, &ids, &positions);
            gpu.end_graph_step(graphed.is_ok()).unwrap();
            let graphed = graphed.unwrap();
            assert_eq!(graphed.0, eager.0, "n {n} round {round}: reduced rows");
            assert_eq!(graphed.1, eager.1, "n {n} round {round}: rows, bit for bit");
            assert!(eager.1.iter().any(|&v| v != 0.0), "not all zeros");
        }
    }
    let stats = gpu.graph_stats();
    eprintln!("graphs: {stats:?}");
    // Per size: one recording, one capture, four replays.
    assert_eq!(
        (stats.recorded, stats.captured, stats.replayed, stats.failed),
        (3, 3, 12, 0)
    );
    assert!(stats.arena_bytes > 0);
}

#[test]
fn a_step_that_changes_shape_under_its_key_fails_without_running() {
    let Some(gpu) = gpu() else { return };
    let c = CudaCompute::new(gpu.clone());
    let w = weights(&c);
    let mut r = StdRng::seed_from_u64(12);
    let key = GraphKey {
        num_reqs: 3,
        table_width: 64,
        whole_logits: true,
        capturing: false,
        probabilities: 0,
        edit_capacity: 0,
    };
    for _ in 0..2 {
        let (ids, positions) = inputs(&mut r, 3);
        assert!(gpu.begin_graph_step(key).unwrap());
        let out = step(&c, &w, &ids, &positions);
        gpu.end_graph_step(out.is_ok()).unwrap();
        out.unwrap();
    }
    // Four rows under a key captured for three: refused before anything is launched.
    let (ids, positions) = inputs(&mut r, 4);
    assert!(gpu.begin_graph_step(key).unwrap());
    let out = step(&c, &w, &ids, &positions);
    let err = out.expect_err("a diverging replay fails");
    assert!(err.to_string().contains("diverged"), "{err}");
    gpu.end_graph_step(false).unwrap();
    // The key is given up on; the step runs eagerly and right.
    assert!(!gpu.begin_graph_step(key).unwrap());
    let eager = step(&c, &w, &ids, &positions).unwrap();
    assert_eq!(eager.0.len(), 4);
    assert!(gpu.graph_stats().failed >= 1);
}
