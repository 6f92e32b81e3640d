//! The decoder's folded path (a device that normalizes as its products read the residual
//! stream and adds their outputs into it: `Compute::folds_norms`, what the CUDA backend does
//! for steps of 1-4 rows) gives the same tokens and logprobs, bit for bit, as the usual
//! path, when the folded operations are the trait's defaults (a norm, then the product;
//! the product, then an add) over the CPU's kernels: the decoder hands every block the
//! same arithmetic either way. Architectures with one q/k/v product, biases, fused q/k/v
//! and gate/up, norms after the blocks (which never fold), and expert layers beside
//! dense ones.

use candle_core::quantized::QTensor;
use lantern_engine::{Engine, EngineConfig, SamplingParams};
use lantern_kv::KvDtype;
use lantern_model::blocks::Activation;
use lantern_model::compute::{AttentionCall, Compute, Cpu};
use lantern_model::pick::{LogitEdit, ReducedRow, RowReduction};
use lantern_model::rope::Rope;
use lantern_model::{LoadOptions, Result};
use std::path::Path;

/// The CPU, with steps of 1-4 rows taking the decoder's folded path.
#[derive(Clone, Copy)]
struct Folding;

impl Compute for Folding {
    type Act = <Cpu as Compute>::Act;
    type Matrix = <Cpu as Compute>::Matrix;
    type Vector = <Cpu as Compute>::Vector;
    type RopeTable = <Cpu as Compute>::RopeTable;

    fn folds_norms(&self, rows: usize) -> bool {
        (1..=4).contains(&rows)
    }

    fn matrix(&self, options: &LoadOptions, name: &str, tensor: QTensor) -> Result<Self::Matrix> {
        Cpu.matrix(options, name, tensor)
    }
    fn stacked_matrix(
        &self,
        options: &LoadOptions,
        name: &str,
        parts: Vec<QTensor>,
    ) -> Result<Self::Matrix> {
        Cpu.stacked_matrix(options, name, parts)
    }
    fn vector(&self, values: Vec<f32>) -> Result<Self::Vector> {
        Cpu.vector(values)
    }
    fn rope_table(&self, rope: &Rope, positions: &[usize]) -> Result<Self::RopeTable> {
        Cpu.rope_table(rope, positions)
    }
    fn embed(&self, table: &Self::Matrix, ids: &[u32], scale: Option<f32>) -> Result<Self::Act> {
        Cpu.embed(table, ids, scale)
    }
    fn matmul_parts(
        &self,
        w: &Self::Matrix,
        x: &Self::Act,
        rows: usize,
        widths: &[usize],
    ) -> Result<Vec<Self::Act>> {
        Cpu.matmul_parts(w, x, rows, widths)
    }
    fn out_features(&self, w: &Self::Matrix) -> usize {
        Cpu.out_features(w)
    }
    fn rms_norm(&self, x: &Self::Act, weight: &Self::Vector, eps: f32) -> Result<Self::Act> {
        Cpu.rms_norm(x, weight, eps)
    }
    fn add_rms_norm(
        &self,
        x: &mut Self::Act,
        delta: &Self::Act,
        weight: &Self::Vector,
        eps: f32,
    ) -> Result<Self::Act> {
        Cpu.add_rms_norm(x, delta, weight, eps)
    }
    fn add(&self, acc: &mut Self::Act, x: &Self::Act) -> Result<()> {
        Cpu.add(acc, x)
    }
    fn add_bias(&self, x: &mut Self::Act, bias: &Self::Vector) -> Result<()> {
        Cpu.add_bias(x, bias)
    }
    fn act_mul(&self, act: Activation, gate: &mut Self::Act, up: &Self::Act) -> Result<()> {
        Cpu.act_mul(act, gate, up)
    }
    fn soft_cap(&self, x: &mut Self::Act, cap: f32) -> Result<()> {
        Cpu.soft_cap(x, cap)
    }
    fn scale(&self, x: &mut Self::Act, factor: f32) -> Result<()> {
        Cpu.scale(x, factor)
    }
    fn clamp(&self, x: &mut Self::Act, limit: f32) -> Result<()> {
        Cpu.clamp(x, limit)
    }
    fn rope(
        &self,
        table: &Self::RopeTable,
        x: &mut Self::Act,
        heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        Cpu.rope(table, x, heads, head_dim)
    }
    fn rope_qk(
        &self,
        table: &Self::RopeTable,
        q: (&mut Self::Act, usize),
        k: (&mut Self::Act, usize),
        head_dim: usize,
    ) -> Result<()> {
        Cpu.rope_qk(table, q, k, head_dim)
    }
    fn select_rows(&self, x: &Self::Act, rows: &[usize], width: usize) -> Result<Self::Act> {
        Cpu.select_rows(x, rows, width)
    }
    const RUNS_EXPERTS: bool = true;
    fn zeros(&self, rows: usize, width: usize) -> Result<Self::Act> {
        Cpu.zeros(rows, width)
    }
    fn add_rows_scaled(
        &self,
        acc: &mut Self::Act,
        x: &Self::Act,
        rows: &[usize],
        weights: &[f32],
        width: usize,
    ) -> Result<()> {
        Cpu.add_rows_scaled(acc, x, rows, weights, width)
    }
    fn attention(
        &self,
        call: AttentionCall<'_, '_>,
        q: Self::Act,
        k: Self::Act,
        v: Self::Act,
    ) -> Result<Self::Act> {
        Cpu.attention(call, q, k, v)
    }
    fn to_host(&self, x: Self::Act) -> Result<Vec<f32>> {
        Cpu.to_host(x)
    }
    fn edit_logits(&self, x: &mut Self::Act, width: usize, edits: &[LogitEdit]) -> Result<()> {
        Cpu.edit_logits(x, width, edits)
    }
    fn reduce_rows(
        &self,
        x: &Self::Act,
        width: usize,
        wants: &[RowReduction],
    ) -> Result<Vec<ReducedRow>> {
        Cpu.reduce_rows(x, width, wants)
    }
}

/// Tokens and logprob bits (with the top alternatives') of three greedy requests (one
/// repetition-penalized), decoded together: their decode steps have 1-3 rows.
fn run(arch: &str, device: Option<Folding>) -> Vec<(Vec<u32>, Vec<u32>)> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/archs")
        .join(arch)
        .join("hf");
    let options = LoadOptions::default();
    let loaded = match device {
        Some(d) => lantern_model::load_model_on(&path, &options, &d),
        None => lantern_model::load_model(&path, &options),
    }
    .unwrap_or_else(|e| panic!("{arch}: {e}"));
    let config = EngineConfig {
        kv_cache_memory: 16 << 20,
        kv_cache_dtype: KvDtype::F32,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(loaded, config).unwrap();
    let greedy = |n| SamplingParams {
        ignore_eos: true,
        logprobs: Some(2),
        ..SamplingParams::greedy(n)
    };
    let requests = [
        (
            (0..9).map(|i| 300 + i * 13).collect::<Vec<u32>>(),
            greedy(10),
        ),
        (
            (0..5).map(|i| 700 + i * 29).collect(),
            SamplingParams {
                repetition_penalty: 1.2,
                ..greedy(8)
            },
        ),
        ((0..14).map(|i| 90 + i * 7).collect(), greedy(6)),
    ];
    let ids: Vec<_> = requests
        .iter()
        .map(|(p, s)| engine.add_request(p.clone(), s.clone()).unwrap())
        .collect();
    let mut logged: Vec<(Vec<u32>, Vec<u32>)> = vec![Default::default(); ids.len()];
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            let i = ids.iter().position(|&id| id == o.id).unwrap();
            logged[i].0.extend(&o.new_token_ids);
            if let Some(lp) = o.logprobs {
                logged[i].1.push(lp.logprob.to_bits());
                logged[i].1.extend(lp.top.iter().map(|(_, l)| l.to_bits()));
            }
        }
    }
    logged
}

#[test]
fn the_folded_path_gives_the_usual_bits() {
    // qwen3_moe: expert layers (which never fold) around a dense one (which does).
    for arch in ["llama", "qwen2", "phi3", "gemma2", "qwen3_moe"] {
        let usual = run(arch, None);
        let folded = run(arch, Some(Folding));
        assert!(
            usual
                .iter()
                .all(|(t, l)| !t.is_empty() && l.len() >= t.len()),
            "{arch}: tokens with their logprobs"
        );
        assert_eq!(folded, usual, "{arch}: tokens and logprob bits");
    }
}
