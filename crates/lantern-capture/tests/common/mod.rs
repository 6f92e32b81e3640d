//! The capture tests' shared fixture: a finished request's capture over four layers of
//! every kind a kernel runs (plain causal, sliding window, soft-capped, with sinks) with
//! random queries and keys, and the maps' rows reduced to the statistics' head groups.
#![allow(dead_code)]

use lantern_attn::AttentionLayerSpec;
use lantern_capture::{
    CaptureResult, CaptureSpec, KeySnapshot, PendingCapture, QueryRowBuffer, TokenInfo,
};
use rand::{rngs::StdRng, Rng, SeedableRng};

pub const HEADS: usize = 6;
pub const KV_HEADS: usize = 2;
pub const HEAD_DIM: usize = 8;
pub const PROMPT: usize = 21;
pub const GENERATED: usize = 6;
pub const TOKENS: usize = PROMPT + GENERATED;
pub const BLOCK: usize = 4;

pub fn layers() -> Vec<AttentionLayerSpec> {
    let plain = AttentionLayerSpec::new(HEADS, KV_HEADS, HEAD_DIM);
    vec![
        plain.clone(),
        AttentionLayerSpec {
            sliding_window: Some(5),
            ..plain.clone()
        },
        AttentionLayerSpec {
            logits_soft_cap: Some(2.0),
            ..plain.clone()
        },
        AttentionLayerSpec {
            sinks: Some(vec![0.5, -1.0, 2.0, 0.0, 1.0, -0.5]),
            ..plain
        },
    ]
}

/// A finished request's capture of `spec` over random queries and keys (`seed`).
pub fn pending(spec: CaptureSpec, seed: u64) -> PendingCapture {
    let mut rng = StdRng::seed_from_u64(seed);
    let layers = layers();
    let mut buffer = QueryRowBuffer::new(
        spec.clone(),
        layers.len(),
        HEADS,
        HEAD_DIM,
        PROMPT,
        GENERATED,
    );
    // The last generated token is never run: rows up to TOKENS - 1.
    let run = TOKENS - 1;
    let q: Vec<Vec<f32>> = (0..layers.len())
        .map(|_| {
            (0..run * spec.heads.len() * HEAD_DIM)
                .map(|_| rng.gen_range(-2.0..2.0))
                .collect()
        })
        .collect();
    for (layer, q) in q.iter().enumerate() {
        buffer.record(layer, 0, q, &[]);
    }
    PendingCapture {
        buffer,
        computed_maps: Vec::new(),
        layers: layers
            .into_iter()
            .map(|layer| {
                let keys = KeySnapshot {
                    first_key: 0,
                    num_keys: run,
                    num_kv_heads: KV_HEADS,
                    head_dim: HEAD_DIM,
                    keys: (0..run * KV_HEADS * HEAD_DIM)
                        .map(|_| rng.gen_range(-2.0..2.0))
                        .collect(),
                    values: None,
                };
                (layer, keys)
            })
            .collect(),
        prompt_len: PROMPT,
        max_len: TOKENS,
        block_size: BLOCK,
        tokens: (0..TOKENS)
            .map(|i| TokenInfo {
                id: i as u32,
                text: String::new(),
            })
            .collect(),
        num_computed: run,
        finalize_threads: 1,
    }
}

/// The per-group row values of a full map (`[rows, heads, keys]`), reduced as the
/// statistics define their groups: the mean of the group's heads, summed in head order.
pub fn group_rows(result: &CaptureResult, layer: usize, groups: &[Vec<usize>]) -> Vec<Vec<f32>> {
    let map = &result.layers[layer];
    let [rows, heads, keys] = map.shape;
    (0..rows)
        .map(|r| {
            groups
                .iter()
                .flat_map(|members| {
                    (0..keys).map(move |k| {
                        let sum = members
                            .iter()
                            .fold(0f32, |s, &h| s + map.values[(r * heads + h) * keys + k]);
                        if members.len() > 1 {
                            sum * (1.0 / members.len() as f32)
                        } else {
                            sum
                        }
                    })
                })
                .collect()
        })
        .collect()
}
