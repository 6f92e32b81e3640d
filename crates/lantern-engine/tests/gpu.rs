//! The CUDA backend against the same references the CPU is held to: every tiny
//! architecture's transformers logits, greedy tokens and attention maps, in both KV cache
//! layouts, and the GPU's captures against the CPU backend's. Each test prints one line
//! and passes where no NVIDIA driver answers (CI), so the suite runs anywhere; on a GPU
//! machine `scripts/test-gpu` runs this binary.
#![cfg(feature = "cuda")]

mod common;

use common::ReferencePrompt;
use lantern_capture::{CaptureSpec, RowSelection};
use lantern_engine::device::{load_on, DeviceChoice};
use lantern_engine::{Engine, EngineConfig, SamplingParams};
use lantern_kv::KvDtype;
use lantern_model::LoadOptions;
use std::collections::HashMap;
use std::path::PathBuf;

/// Each architecture's Hugging Face directory (safetensors used as stored).
const ARCHS: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "phi3",
    "gemma3_text",
    "olmo2",
    "olmo3",
    "gpt_neox",
    "gpt2",
    "smollm3",
    "gemma",
    "granite",
    "phi",
    "cohere",
    "glm4",
    "olmo",
    "cohere2",
    "opt",
    "starcoder2",
    // RoPE scaling: YaRN's attention factor, LongRoPE's long factors (both applied in the
    // host's RoPE table the step uploads).
    "qwen2_yarn",
    "phi3_longrope",
];
const BACKENDS: &[&str] = &[lantern_cuda::CUDA, lantern_cuda::CUDA_FLASHINFER];

/// f32 weights and cache, f32 products without TF32: transformers' float32 numbers up
/// to summation order, held to the CPU's bound.
const LOGIT_TOLERANCE: f32 = 1e-3;
const ATTENTION_TOLERANCE: f32 = 1e-4;

/// The fixtures: beside the sources when built here, else under the working directory
/// (the test binary carried to a GPU machine runs from the repository's root).
fn fixture(arch: &str) -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/archs");
    let root = if built.exists() {
        built
    } else {
        PathBuf::from("tests/fixtures/archs")
    };
    root.join(arch)
}

/// Whether a GPU answers; prints why not once per test otherwise.
fn gpu_present(test: &str) -> bool {
    match lantern_cuda::Gpu::open(0) {
        Ok(_) => true,
        Err(e) => {
            eprintln!("skipped: {test}: no GPU ({e})");
            false
        }
    }
}

fn engine_on(
    device: DeviceChoice,
    arch: &str,
    backend: &str,
    f32_weights: bool,
    kv: KvDtype,
) -> Engine {
    engine_with(device, arch, backend, f32_weights, kv, false)
}

fn engine_with(
    device: DeviceChoice,
    arch: &str,
    backend: &str,
    f32_weights: bool,
    kv: KvDtype,
    enforce_eager: bool,
) -> Engine {
    let options = LoadOptions {
        progress: false,
        f32_weights,
        ..Default::default()
    };
    let config = EngineConfig {
        kv_cache_memory: 16 << 20,
        kv_cache_dtype: kv,
        attention_backend: backend.to_string(),
        enforce_eager,
        ..EngineConfig::default()
    };
    load_on(device, &fixture(arch).join("hf"), &options)
        .and_then(|placed| placed.start(config, None))
        .unwrap_or_else(|e| panic!("{arch} on {device} ({backend}): {e}"))
}

fn prompts(arch: &str) -> Vec<ReferencePrompt> {
    common::reference_prompts_in(&fixture(arch).join("ref"), "")
}

/// The logits of every position of prompt + reference continuation (teacher-forced),
/// and the row of the prompt's last position.
fn teacher_forced_logits(engine: &mut Engine, p: &ReferencePrompt) -> (Vec<f32>, usize) {
    let params = SamplingParams {
        prompt_logits: true,
        ..SamplingParams::greedy(1)
    };
    let input = p.all_ids[..p.all_ids.len() - 1].to_vec();
    let mut out = engine.generate(vec![(input, params)]).unwrap();
    (out[0].prompt_logits.take().unwrap(), p.prompt_ids.len() - 1)
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(max_tokens)
    }
}

/// Prompt logits (teacher-forced over the reference continuation) and the greedy
/// continuation, alone and with every prompt of the fixture batched together (mixed
/// prefills and decodes in one step), in both layouts.
/// Experts do not run on the GPU yet: a mixture-of-experts model is refused when it
/// loads, saying so, not in its first step.
#[test]
fn mixtures_of_experts_are_refused_on_the_gpu_with_a_message() {
    if !gpu_present("mixtures_of_experts_are_refused_on_the_gpu_with_a_message") {
        return;
    }
    for arch in ["mixtral", "qwen3_moe"] {
        let err = load_on(
            DeviceChoice::Cuda(0),
            &fixture(arch).join("hf"),
            &LoadOptions::default(),
        )
        .err()
        .unwrap_or_else(|| panic!("{arch} loaded on the GPU"))
        .to_string();
        assert!(err.contains("run on the CPU only"), "{arch}: {err}");
    }
}

#[test]
fn every_architecture_matches_transformers_on_the_gpu() {
    if !gpu_present("every_architecture_matches_transformers_on_the_gpu") {
        return;
    }
    for &arch in ARCHS {
        for &backend in BACKENDS {
            let mut engine = engine_on(DeviceChoice::Cuda(0), arch, backend, true, KvDtype::F32);
            let prompts = prompts(arch);
            for p in &prompts {
                let name = format!("{arch} {backend} {}", p.id);
                let (rows, first) = teacher_forced_logits(&mut engine, p);
                let vocab = p.last_logits.len();
                let diff = common::max_abs_diff(&rows[first * vocab..][..vocab], &p.last_logits);
                eprintln!("{name}: last logits {diff:.1e}");
                assert!(
                    diff < LOGIT_TOLERANCE,
                    "{name}: last logits differ by {diff}"
                );
            }
            let batch = prompts
                .iter()
                .map(|p| (p.prompt_ids.clone(), greedy(p.gen_ids.len()), None))
                .collect();
            let together = common::run_to_completion(&mut engine, batch);
            for (p, done) in prompts.iter().zip(&together) {
                assert_eq!(
                    done.token_ids, p.gen_ids,
                    "{arch} {backend} {}: greedy, batched",
                    p.id
                );
            }
        }
    }
}

/// bf16 weights and a bf16 or f16 cache (the fast path): near the float32 reference, and
/// the teacher-forced top-1 is the reference's at most steps. Measured on an H200: last
/// logits within 0.07-0.2 on the Llama/Mistral/Qwen rows, 0.7 on Gemma 2 (float32
/// safetensors rounded to bf16, its soft-capped attention); top-1 23-24 of 24. Bound: 10%
/// of the largest reference logit (a wrong mask or layout moves logits by whole units).
#[test]
fn bf16_weights_stay_near_transformers() {
    if !gpu_present("bf16_weights_stay_near_transformers") {
        return;
    }
    for &arch in ARCHS {
        for kv in [KvDtype::BF16, KvDtype::F16] {
            let mut engine = engine_on(DeviceChoice::Cuda(0), arch, lantern_cuda::CUDA, false, kv);
            for p in prompts(arch) {
                let (rows, first) = teacher_forced_logits(&mut engine, &p);
                let vocab = p.last_logits.len();
                let diff = common::max_abs_diff(&rows[first * vocab..][..vocab], &p.last_logits);
                let agree = (0..p.gen_ids.len())
                    .filter(|&s| {
                        let row = &rows[(first + s) * vocab..][..vocab];
                        lantern_engine::sampling::argmax(row) == p.gen_top_ids[s * 20]
                    })
                    .count();
                eprintln!(
                    "{arch} {kv:?} {}: bf16 weights, last logits {diff:.2e}, top-1 {agree}/{}",
                    p.id,
                    p.gen_ids.len()
                );
                let scale = p.last_logits.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(
                    diff < 0.1 * scale,
                    "{arch} {kv:?} {}: last logits differ by {diff} (largest {scale})",
                    p.id
                );
                assert!(
                    agree * 4 >= p.gen_ids.len() * 3,
                    "{arch} {kv:?} {}: top-1 {agree}",
                    p.id
                );
            }
        }
    }
}

/// Captured attention of every layer from the GPU's cache equals transformers' eager
/// attention and the CPU backend's capture; rows sum to 1, masked keys are exactly 0, and
/// P·V equals the output the GPU kernel computed.
#[test]
fn captures_on_the_gpu_equal_the_reference_and_the_cpu() {
    if !gpu_present("captures_on_the_gpu_equal_the_reference_and_the_cpu") {
        return;
    }
    for &arch in ARCHS {
        for &backend in BACKENDS {
            let mut gpu = engine_on(DeviceChoice::Cuda(0), arch, backend, true, KvDtype::F32);
            let mut cpu = engine_on(DeviceChoice::Cpu, arch, "cpu-flash", true, KvDtype::F32);
            let info = gpu.model_info().clone();
            let heads = info.attention[0].num_heads;
            for p in prompts(arch) {
                let name = format!("{arch} {backend} {}", p.id);
                let mut spec = CaptureSpec::everything(info.num_layers, heads);
                spec.rows = RowSelection::Prompt;
                spec.keep_attention_output = true;
                let request = || vec![(p.all_ids.clone(), greedy(1), Some(spec.clone()))];
                let on_gpu = common::run_to_completion(&mut gpu, request());
                let on_cpu = common::run_to_completion(&mut cpu, request());
                let pending = on_gpu[0].capture.as_ref().unwrap().as_ref().unwrap();
                assert!(
                    pending.maps_computed_by_backend(),
                    "{name}: maps on the device"
                );
                let result = pending.finalize().unwrap();
                let pv = common::check_capture_invariants(pending, &result);
                let cpu_result = on_cpu[0]
                    .capture
                    .as_ref()
                    .unwrap()
                    .as_ref()
                    .unwrap()
                    .finalize()
                    .unwrap();
                let (mut to_reference, mut to_cpu) = (0f32, 0f32);
                for (map, cpu_map) in result.layers.iter().zip(&cpu_result.layers) {
                    let reference = p.attention(map.layer_idx);
                    to_reference = to_reference.max(common::max_abs_diff(&map.values, &reference));
                    to_cpu = to_cpu.max(common::max_abs_diff(&map.values, &cpu_map.values));
                }
                eprintln!(
                    "{name}: attention vs transformers {to_reference:.1e}, vs cpu {to_cpu:.1e}, P·V {pv:.1e}"
                );
                assert!(to_reference < ATTENTION_TOLERANCE, "{name}: {to_reference}");
                assert!(to_cpu < ATTENTION_TOLERANCE, "{name}: {to_cpu}");
            }
        }
    }
}

/// `spec`'s capture of `p`'s prompt and 4 greedy tokens, its maps computed on the device.
fn capture_on_device(
    engine: &mut Engine,
    p: &ReferencePrompt,
    spec: &CaptureSpec,
    name: &str,
) -> lantern_capture::PendingCapture {
    let request = vec![(p.prompt_ids.clone(), greedy(4), Some(spec.clone()))];
    let out = common::run_to_completion(engine, request);
    let pending = out[0].capture.clone().unwrap().unwrap();
    assert!(
        pending.maps_computed_by_backend(),
        "{name}: maps on the device"
    );
    pending
}

/// A capture's query rows kept on the device between steps (the default where the
/// capture does not check the attention output) give the maps of rows copied to the
/// host at every step and uploaded again when the request finishes (a capture that keeps
/// the output, whose rows stay on the host), bit for bit: prompt and generated rows,
/// every head and a few, both layouts, every architecture.
#[test]
fn query_rows_kept_on_the_gpu_give_the_maps_of_rows_kept_on_the_host() {
    if !gpu_present("query_rows_kept_on_the_gpu_give_the_maps_of_rows_kept_on_the_host") {
        return;
    }
    for &arch in ARCHS {
        for &backend in BACKENDS {
            let mut gpu = engine_on(DeviceChoice::Cuda(0), arch, backend, true, KvDtype::F32);
            let info = gpu.model_info().clone();
            let heads = info.attention[0].num_heads;
            let p = &prompts(arch)[0];
            let mut every = CaptureSpec::everything(info.num_layers, heads);
            every.rows = RowSelection::All;
            let mut few = every.clone();
            few.heads = (0..heads).rev().step_by(2).collect();
            for spec in [every, few] {
                let name = format!("{arch} {backend} {} heads {:?}", p.id, spec.heads);
                let checked = CaptureSpec {
                    keep_attention_output: true,
                    ..spec.clone()
                };
                let capture = |engine: &mut Engine, spec: &CaptureSpec| {
                    let pending = capture_on_device(engine, p, spec, &name);
                    pending.into_result(1, || {}).unwrap()
                };
                let (kept, host) = (capture(&mut gpu, &spec), capture(&mut gpu, &checked));
                assert_eq!(kept.meta, host.meta, "{name}");
                assert!(!kept.layers.is_empty(), "{name}");
                for (k, h) in kept.layers.iter().zip(&host.layers) {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(k.shape, h.shape, "{name} layer {}", k.layer_idx);
                    assert_eq!(
                        bits(&k.values),
                        bits(&h.values),
                        "{name} layer {}",
                        k.layer_idx
                    );
                }
                eprintln!("{name}: maps of rows kept on the GPU equal those of host rows");
            }
        }
    }
}

/// Maps computed on the device with heads combined, top-k kept and a few heads asked
/// equal lantern-attn's host definitions applied to the device's own full maps, bit for
/// bit; no keys are copied for them; both layouts, every architecture.
#[test]
fn reduced_and_top_k_maps_on_the_gpu_follow_the_host_definitions() {
    use lantern_attn::{combine_heads, top_k};
    use lantern_capture::HeadReduce;
    if !gpu_present("reduced_and_top_k_maps_on_the_gpu_follow_the_host_definitions") {
        return;
    }
    for &arch in ARCHS {
        for &backend in BACKENDS {
            let mut gpu = engine_on(DeviceChoice::Cuda(0), arch, backend, true, KvDtype::F32);
            let info = gpu.model_info().clone();
            let heads = info.attention[0].num_heads;
            let p = &prompts(arch)[0];
            let name = format!("{arch} {backend} {}", p.id);
            let mut full = CaptureSpec::everything(info.num_layers, heads);
            full.heads = (0..heads).rev().step_by(2).collect();
            let capture = |engine: &mut Engine, spec: &CaptureSpec| {
                let pending = capture_on_device(engine, p, spec, &name);
                assert!(!pending.holds_keys(), "{name}: keys copied");
                pending.into_result(1, || {}).unwrap()
            };
            let whole = capture(&mut gpu, &full);
            for (reduce, k) in [
                (HeadReduce::MeanHeads, None),
                (HeadReduce::MaxHeads, Some(5)),
                (HeadReduce::None, Some(3)),
            ] {
                let spec = CaptureSpec {
                    reduce,
                    top_k: k,
                    ..full.clone()
                };
                let got = capture(&mut gpu, &spec);
                for (map, w) in got.layers.iter().zip(&whole.layers) {
                    let [rows, h, keys] = w.shape;
                    let mut combined = Vec::new();
                    combine_heads(&w.values, h, keys, reduce.into(), &mut combined);
                    let (values, indices) = match k {
                        None => (combined, None),
                        Some(k) => {
                            let (mut v, mut i) = (Vec::new(), Vec::new());
                            top_k(&combined, keys, k.min(keys), &mut v, &mut i);
                            (v, Some(i))
                        }
                    };
                    let what = format!("{name} layer {} {reduce:?} top {k:?}", map.layer_idx);
                    assert_eq!(map.shape[0], rows, "{what}");
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&map.values), bits(&values), "{what}");
                    assert_eq!(map.indices, indices, "{what}");
                }
            }
            eprintln!("{name}: combined and top-k maps on the GPU follow the host definitions");
        }
    }
}

/// Key statistics, span masses and streamed rows on the GPU are summed as the rows run,
/// from probabilities the device computes after each layer's attention (no keys copied
/// for them when the request finishes), and match the maps finalized from the keys on
/// the host: prefill rows and decodes, every architecture (windows, soft-cap, sinks,
/// chunks), both layouts.
#[test]
fn capture_figures_on_the_gpu_are_summed_as_the_rows_run() {
    if !gpu_present("capture_figures_on_the_gpu_are_summed_as_the_rows_run") {
        return;
    }
    for &arch in ARCHS {
        for &backend in BACKENDS {
            let mut gpu = engine_on(DeviceChoice::Cuda(0), arch, backend, true, KvDtype::F32);
            let info = gpu.model_info().clone();
            let heads = info.attention[0].num_heads;
            let p = &prompts(arch)[0];
            let name = format!("{arch} {backend} {}", p.id);
            let mut spec = common::with_every_stat(CaptureSpec::everything(info.num_layers, heads));
            spec.top_k = None;
            spec.stream_rows = true;
            let mut alone = spec.clone();
            alone.maps = false;
            let out = common::run_to_completion(
                &mut gpu,
                vec![
                    (p.prompt_ids.clone(), greedy(6), Some(spec)),
                    (p.prompt_ids.clone(), greedy(6), Some(alone)),
                ],
            );
            let pending = out[0].capture.as_ref().unwrap().as_ref().unwrap();
            assert!(pending.stats_summed_live(), "{name}: statistics");
            assert!(pending.span_masses_summed_live(), "{name}: span masses");
            let result = pending.finalize().unwrap();
            common::check_stats_match_the_maps(&result, 1e-4);
            let figures_only = out[1].capture.as_ref().unwrap().as_ref().unwrap();
            assert!(
                !figures_only.holds_keys(),
                "{name}: keys copied for figures alone"
            );
            let figures = figures_only.finalize().unwrap();
            assert_eq!(figures.stats, result.stats, "{name}");
            assert_eq!(figures.span_mass, result.span_mass, "{name}");
            eprintln!("{name}: statistics and span masses summed on the GPU match the maps");
        }
    }
}

/// Two engines of `arch` on the GPU, f32 weights and cache: one replaying decode steps
/// from CUDA graphs, one running every step eagerly.
fn graphed_and_eager(arch: &str, backend: &str) -> (Engine, Engine) {
    let run = |eager: bool| {
        let f32_kv = KvDtype::F32;
        engine_with(DeviceChoice::Cuda(0), arch, backend, true, f32_kv, eager)
    };
    (run(false), run(true))
}

/// Each request's tokens and, where it asked, the log-probabilities of its tokens and of
/// its top 3 alternatives, step by step.
fn run_logged(
    engine: &mut Engine,
    requests: &[(Vec<u32>, SamplingParams)],
) -> Vec<(Vec<u32>, Vec<f32>)> {
    let ids: Vec<_> = requests
        .iter()
        .map(|(p, s)| engine.add_request(p.clone(), s.clone()).unwrap())
        .collect();
    let mut out: HashMap<_, (Vec<u32>, Vec<f32>)> = HashMap::new();
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            let entry = out.entry(o.id).or_default();
            entry.0.extend(&o.new_token_ids);
            if let Some(lp) = o.logprobs {
                entry.1.push(lp.logprob);
                entry.1.extend(lp.top.iter().map(|&(_, l)| l));
            }
        }
    }
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks(),
        "every block is free once the requests are done"
    );
    ids.into_iter().map(|id| out.remove(&id).unwrap()).collect()
}

/// The same tokens request by request, and log-probabilities within f32 summation noise
/// (graph steps against eager ones).
fn assert_same_runs(
    name: &str,
    on_graphs: &[(Vec<u32>, Vec<f32>)],
    eagerly: &[(Vec<u32>, Vec<f32>)],
) {
    for (r, (g, e)) in on_graphs.iter().zip(eagerly).enumerate() {
        assert_eq!(g.0, e.0, "{name}: request {r}'s tokens");
        let diff = common::max_abs_diff(&g.1, &e.1);
        assert!(
            diff < 1e-4,
            "{name}: request {r}'s logprobs differ by {diff}"
        );
    }
}

/// Decode steps replayed from CUDA graphs compute what eager steps compute: the same
/// greedy tokens and log-probabilities within f32 summation noise, for batches padded to a
/// graph's size (3 to 4, 5 to 8), contexts long enough for split-K attention, greedy-only
/// batches (argmax graphs), batches with requests for 3 logprobs (their rows reduced on the
/// device, in the same graphs; with a repetition penalty, edited there first) or for 21
/// (whole-logits graphs), in both layouts,
/// sliding-window and two-group models included. Each shape is recorded once and
/// replayed after.
#[test]
fn graph_steps_equal_eager_steps() {
    if !gpu_present("graph_steps_equal_eager_steps") {
        return;
    }
    for arch in ["llama", "gemma2", "gemma3_text", "qwen3"] {
        for &backend in BACKENDS {
            let (mut graphed, mut eager) = graphed_and_eager(arch, backend);
            let mut prompts: Vec<Vec<u32>> =
                prompts(arch).into_iter().map(|p| p.prompt_ids).collect();
            // A context of 300+ tokens: its table is 32 blocks wide, split-K territory.
            let long: Vec<u32> = prompts
                .iter()
                .flatten()
                .copied()
                .cycle()
                .take(310)
                .collect();
            prompts.push(long);
            for batch in [1, 3, 5] {
                // Argmax graphs, graphs of rows reduced with their logprobs (and edited
                // by a repetition penalty first), and whole-logits graphs (more
                // alternatives than a reduced row gives).
                for (asked, penalty) in
                    [(None, 1.0), (Some(3), 1.0), (Some(3), 1.3), (Some(21), 1.0)]
                {
                    let requests: Vec<_> = (0..batch)
                        .map(|i| {
                            let logprobs = asked.filter(|_| i % 2 == 0);
                            let params = SamplingParams {
                                logprobs,
                                repetition_penalty: if i % 2 == 1 { 1.0 } else { penalty },
                                ..greedy(12)
                            };
                            (prompts[(i + batch) % prompts.len()].clone(), params)
                        })
                        .collect();
                    let name =
                        format!("{arch} {backend} batch {batch} logprobs {asked:?} {penalty}");
                    let on_graphs = run_logged(&mut graphed, &requests);
                    let eagerly = run_logged(&mut eager, &requests);
                    assert_same_runs(&name, &on_graphs, &eagerly);
                }
            }
            let stats = graphed
                .graph_stats()
                .expect("the cuda backend records graphs");
            eprintln!("{arch} {backend}: graphs {stats:?}");
            assert!(
                stats.captured > 0 && stats.replayed > stats.captured,
                "{arch}: {stats:?}"
            );
            assert_eq!(stats.failed, 0, "{arch}: {stats:?}");
            assert!(
                eager.graph_stats().is_none(),
                "enforce_eager records nothing"
            );
        }
    }
}

/// Decode steps carrying a capturing request whose rows stay on the device are replayed
/// from CUDA graphs too (each layer's copies into the kept rows recorded as one launch,
/// with the step's destinations uploaded beside its metadata), and give what eager
/// steps give: the same tokens for every request and the same maps within f32
/// summation noise, for every head or a few, every layer or some, beside requests that
/// do not capture, in both layouts.
#[test]
fn capturing_decode_steps_replay_graphs_and_keep_the_eager_maps() {
    let test = "capturing_decode_steps_replay_graphs_and_keep_the_eager_maps";
    with_graphed_and_eager(test, |arch, graphed, eager, (layers, heads), prompts| {
        let mut every = CaptureSpec::everything(layers, heads);
        every.rows = RowSelection::All;
        let mut some = every.clone();
        some.heads = (0..heads).rev().step_by(2).collect();
        some.layers = (0..layers).step_by(2).collect();
        for (what, spec) in [("every head and layer", every), ("some", some)] {
            let name = format!("{arch} {what}");
            let captures = [None, Some(spec.clone()), None];
            let (on_graphs, eagerly, after) =
                graphed_beside_eager(graphed, eager, prompts, captures, &name);
            let result = |c: &lantern_engine::Completion| {
                let pending = c.capture.clone().unwrap().unwrap();
                assert!(
                    pending.maps_computed_by_backend(),
                    "{name}: maps on the device"
                );
                pending.into_result(1, || {}).unwrap()
            };
            let (g, e) = (result(&on_graphs[1]), result(&eagerly[1]));
            assert_eq!(g.meta, e.meta, "{name}");
            assert!(!g.layers.is_empty(), "{name}");
            for (gm, em) in g.layers.iter().zip(&e.layers) {
                assert_eq!(gm.shape, em.shape, "{name} layer {}", gm.layer_idx);
                let diff = common::max_abs_diff(&gm.values, &em.values);
                assert!(
                    diff < ATTENTION_TOLERANCE,
                    "{name} layer {}: maps differ by {diff}",
                    gm.layer_idx
                );
            }
            eprintln!("{name}: {after:?}, maps as eager steps give them");
        }
    });
}

/// `check(name, graphed, eager, (layers, heads), prompts)` for two engines of every
/// architecture the graph tests run (one replaying decode steps from graphs, one
/// running them eagerly; [`graphed_and_eager`]) in both layouts, where a GPU answers.
fn with_graphed_and_eager(
    test: &str,
    mut check: impl FnMut(&str, &mut Engine, &mut Engine, (usize, usize), &[ReferencePrompt]),
) {
    if !gpu_present(test) {
        return;
    }
    for arch in ["llama", "gemma2", "qwen3"] {
        for &backend in BACKENDS {
            let (mut graphed, mut eager) = graphed_and_eager(arch, backend);
            let info = graphed.model_info().clone();
            let shape = (info.num_layers, info.attention[0].num_heads);
            let name = format!("{arch} {backend}");
            check(&name, &mut graphed, &mut eager, shape, &prompts(arch));
        }
    }
}

/// Three requests of 12 greedy tokens (capturing as `captures` say) run to completion
/// on `graphed` and on `eager`: their completions and `graphed`'s graph statistics
/// after, once checked that at least 8 of its steps replayed a graph, none failed, and
/// the tokens are the eager ones.
fn graphed_beside_eager(
    graphed: &mut Engine,
    eager: &mut Engine,
    prompts: &[ReferencePrompt],
    captures: [Option<CaptureSpec>; 3],
    name: &str,
) -> (
    Vec<lantern_engine::Completion>,
    Vec<lantern_engine::Completion>,
    lantern_attn::GraphStats,
) {
    let requests = || {
        (captures.iter().enumerate())
            .map(|(i, capture)| {
                let p = &prompts[i % prompts.len()];
                (p.prompt_ids.clone(), greedy(12), capture.clone())
            })
            .collect::<Vec<_>>()
    };
    let before = graphed.graph_stats().expect("graphs are recorded");
    let on_graphs = common::run_to_completion(graphed, requests());
    let after = graphed.graph_stats().expect("graphs are recorded");
    let eagerly = common::run_to_completion(eager, requests());
    assert!(
        after.replayed >= before.replayed + 8 && after.failed == 0,
        "{name}: the capturing steps were not replayed ({before:?} -> {after:?})"
    );
    for (r, (g, e)) in on_graphs.iter().zip(&eagerly).enumerate() {
        assert_eq!(g.token_ids, e.token_ids, "{name}: request {r}'s tokens");
    }
    (on_graphs, eagerly, after)
}

/// Decode steps with a request whose key statistics, span masses and streamed rows are
/// summed as its rows run (their probabilities computed on the device after each layer
/// and read after the step) replay graphs too, and sum and stream what eager steps do,
/// bit for bit: the other requests of the batch keep their graphs.
#[test]
fn live_summing_decode_steps_replay_graphs_and_sum_as_eager_ones() {
    let test = "live_summing_decode_steps_replay_graphs_and_sum_as_eager_ones";
    with_graphed_and_eager(test, |name, graphed, eager, (layers, heads), prompts| {
        let mut figures = common::with_every_stat(CaptureSpec::everything(layers, heads));
        figures.maps = false;
        figures.top_k = None;
        figures.rows = RowSelection::Generated;
        let mut some = figures.clone();
        some.layers = (0..layers).step_by(2).collect();
        some.heads = (0..heads).rev().step_by(2).collect();
        some.rows = RowSelection::All;
        // Streamed rows' top-k keys are taken from the same probabilities.
        some.stream_rows = true;
        some.top_k = Some(3);
        let captures = [None, Some(figures), Some(some.clone())];
        let (on_graphs, eagerly, after) =
            graphed_beside_eager(graphed, eager, prompts, captures, name);
        // The rows streamed as they run, alone in their steps: as eager steps give them.
        let streamed = |engine: &mut Engine| {
            let prompt = prompts[0].prompt_ids.clone();
            let capture = Some(some.clone());
            let id = engine
                .add_request_with_capture(prompt, greedy(12), capture)
                .unwrap();
            let mut rows = Vec::new();
            while engine.has_unfinished() {
                let outputs = engine.step().unwrap();
                rows.extend(outputs.into_iter().filter_map(|o| o.capture_row));
            }
            engine.take_completion(id).unwrap();
            rows
        };
        let before = graphed.graph_stats().expect("graphs are recorded");
        let (g, e) = (streamed(graphed), streamed(eager));
        let replayed = graphed.graph_stats().expect("graphs are recorded").replayed;
        assert!(
            replayed >= before.replayed + 8,
            "{name}: streamed steps replayed"
        );
        assert_eq!(g.len(), 12, "{name}: a row streamed with every token");
        assert_eq!(g, e, "{name}: streamed rows");
        for r in [1, 2] {
            let pending = |c: &lantern_engine::Completion| c.capture.clone().unwrap().unwrap();
            let (g, e) = (pending(&on_graphs[r]), pending(&eagerly[r]));
            assert!(
                g.stats_summed_live(),
                "{name} request {r}: statistics summed live"
            );
            assert!(
                g.span_masses_summed_live(),
                "{name} request {r}: span masses"
            );
            let (g, e) = (
                g.into_result(1, || {}).unwrap(),
                e.into_result(1, || {}).unwrap(),
            );
            assert!(!g.stats.is_empty(), "{name} request {r}");
            assert_eq!(g.stats, e.stats, "{name} request {r}: statistics");
            assert_eq!(g.span_mass, e.span_mass, "{name} request {r}: span masses");
        }
        eprintln!("{name}: {after:?}, figures as eager steps sum them");
    });
}

/// Requests sampling at a temperature, from the whole softmax or cut by top-k, top-p and
/// min-p, are sampled on the GPU with the draw the engine takes ahead from their seeded
/// streams (one id per row crosses to the host): the tokens the host sampler picks from
/// the same logits with the same draws
/// (the same requests asking for more logprobs than a row reduced on the device gives,
/// whose rows are copied to the host), at three temperatures, batched, eager and from
/// graphs, in both layouts.
#[test]
fn sampled_rows_on_the_gpu_give_the_host_samplers_tokens() {
    if !gpu_present("sampled_rows_on_the_gpu_give_the_host_samplers_tokens") {
        return;
    }
    for arch in ["llama", "gemma2"] {
        for &backend in BACKENDS {
            let (mut graphed, mut eager) = graphed_and_eager(arch, backend);
            let prompts = prompts(arch);
            let requests = |logprobs: Option<usize>| -> Vec<(Vec<u32>, SamplingParams)> {
                (0..4)
                    .map(|i| {
                        let params = SamplingParams {
                            temperature: [1.0, 0.7, 1.3, 1.0][i],
                            top_p: [1.0, 0.9, 1.0, 0.95][i],
                            top_k: [0, 0, 40, 0][i],
                            min_p: [0.0, 0.0, 0.0, 0.02][i],
                            seed: Some(100 + i as u64),
                            logprobs,
                            ..greedy(16)
                        };
                        (prompts[i % prompts.len()].prompt_ids.clone(), params)
                    })
                    .collect()
            };
            for (how, engine) in [("graphs", &mut graphed), ("eager", &mut eager)] {
                let name = format!("{arch} {backend} {how}");
                let on_device = run_logged(engine, &requests(None));
                let on_host = run_logged(engine, &requests(Some(21)));
                for (r, (d, h)) in on_device.iter().zip(&on_host).enumerate() {
                    assert_eq!(d.0.len(), 16, "{name}: request {r}");
                    assert_eq!(d.0, h.0, "{name}: request {r}'s sampled tokens");
                }
                eprintln!("{name}: sampled on the device as on the host");
            }
        }
    }
}

/// Logprobs and prompt logprobs reduced on the GPU (a few numbers per row cross to the
/// host) equal those the host computes from the same rows copied whole: requests for 0 to
/// 20 alternatives (greedy and seeded sampled, with penalties, bias and `min_tokens`
/// edited into the row there) against the same requests for 21 (more than a reduced row
/// gives: whole rows), prompt logprobs against the same with prompt logits (whole rows),
/// eager and from graphs. The same tokens, ranks and top ids; logprobs up to
/// the order of f32 sums.
#[test]
fn logprobs_reduced_on_the_gpu_equal_the_hosts() {
    if !gpu_present("logprobs_reduced_on_the_gpu_equal_the_hosts") {
        return;
    }
    type Logged = (Vec<u32>, Vec<lantern_engine::sampling::TokenLogprobs>);
    type Prompted = Vec<lantern_engine::sampling::PromptTokenLogprob>;
    let run = |engine: &mut Engine, requests: &[(Vec<u32>, SamplingParams)]| {
        let ids: Vec<_> = requests
            .iter()
            .map(|(p, s)| engine.add_request(p.clone(), s.clone()).unwrap())
            .collect();
        let mut logged: Vec<(Logged, Prompted)> = vec![Default::default(); ids.len()];
        while engine.has_unfinished() {
            for o in engine.step().unwrap() {
                let i = ids.iter().position(|&id| id == o.id).unwrap();
                logged[i].0 .0.extend(&o.new_token_ids);
                logged[i].0 .1.extend(o.logprobs);
                if let Some(rows) = engine.take_prompt_logprobs(o.id) {
                    logged[i].1 = rows;
                }
            }
        }
        assert_eq!(
            engine.kv_cache().num_free_blocks(),
            engine.kv_cache().num_blocks()
        );
        logged
    };
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 + 1e-5 * b.abs();
    // `reduced`'s top entries are the first of `whole`'s.
    let same_top = |what: &str, reduced: &[(u32, f32)], whole: &[(u32, f32)]| {
        assert!(reduced.len() <= whole.len(), "{what}: top");
        for (a, b) in reduced.iter().zip(whole) {
            assert_eq!(a.0, b.0, "{what}: top ids");
            assert!(close(a.1, b.1), "{what}: top {a:?} against {b:?}");
        }
    };
    for arch in ["llama", "gemma2"] {
        let (mut graphed, mut eager) = graphed_and_eager(arch, lantern_cuda::CUDA);
        let prompts = prompts(arch);
        let requests = |whole: bool| -> Vec<(Vec<u32>, SamplingParams)> {
            (0..4)
                .map(|i| {
                    let params = SamplingParams {
                        temperature: [0.0, 0.0, 0.8, 0.0][i],
                        seed: Some(7 + i as u64),
                        logprobs: Some(if whole { 21 } else { [0, 5, 20, 2][i] }),
                        prompt_logprobs: (i % 2 == 1).then_some(3),
                        prompt_logits: whole && i % 2 == 1,
                        // Penalties, bias and min_tokens: edits of the row on the device.
                        repetition_penalty: [1.3, 1.0, 1.0, 1.0][i],
                        presence_penalty: [0.0, 0.0, 0.6, 0.0][i],
                        frequency_penalty: [0.0, 0.0, 0.4, 0.0][i],
                        logit_bias: if i == 0 {
                            vec![(3, 4.0), (60, -2.0)]
                        } else {
                            vec![]
                        },
                        min_tokens: [0, 0, 5, 0][i],
                        stop_token_ids: vec![1, 2].into(),
                        ..greedy(8)
                    };
                    (prompts[i % prompts.len()].prompt_ids.clone(), params)
                })
                .collect()
        };
        for (how, engine) in [("graphs", &mut graphed), ("eager", &mut eager)] {
            let reduced = run(engine, &requests(false));
            let whole = run(engine, &requests(true));
            for (r, (d, h)) in reduced.iter().zip(&whole).enumerate() {
                let name = format!("{arch} {how} request {r}");
                assert_eq!(d.0 .0, h.0 .0, "{name}: tokens");
                assert_eq!(d.0 .1.len(), 8, "{name}: a logprob a token");
                for (s, (a, b)) in d.0 .1.iter().zip(&h.0 .1).enumerate() {
                    let what = format!("{name} token {s}");
                    assert_eq!(a.token_id, b.token_id, "{what}");
                    assert!(close(a.logprob, b.logprob), "{what}: {a:?} against {b:?}");
                    same_top(&what, &a.top, &b.top);
                }
                assert_eq!(d.1.len(), h.1.len(), "{name}: prompt logprobs");
                for (pos, (a, b)) in d.1.iter().zip(&h.1).enumerate() {
                    let what = format!("{name} prompt position {pos}");
                    assert_eq!(a.rank, b.rank, "{what}: rank");
                    assert!(close(a.logprob, b.logprob), "{what}: {a:?} against {b:?}");
                    same_top(&what, &a.top, &b.top);
                }
            }
            eprintln!("{arch} {how}: logprobs reduced on the device as on the host");
        }
    }
}

/// With bf16 weights, a decode step's products take the small-product kernels (up to 4
/// rows, f32 activations) or cuBLAS (more rows, bf16 activations), a prefill's always
/// cuBLAS. The log-probability each decode step gave its token is held against the one a
/// prefill over the whole sequence gives at that position: equal where both took cuBLAS
/// (batch 6), and within what the prefill's bf16 rounding of activations moves (the
/// small-product kernels keep them f32) where they did not (batches 1 and 3; observed on an
/// H200: up to 0.049 for llama, 0.076 for gemma2, whose activations are larger). A wrong
/// row or column of a product moves a log-probability by whole units.
#[test]
fn bf16_decode_steps_agree_with_a_prefill_of_the_same_tokens() {
    if !gpu_present("bf16_decode_steps_agree_with_a_prefill_of_the_same_tokens") {
        return;
    }
    for arch in ["llama", "gemma2", "qwen3", "phi3"] {
        let mut engine = engine_on(
            DeviceChoice::Cuda(0),
            arch,
            lantern_cuda::CUDA,
            false,
            KvDtype::BF16,
        );
        let prompts: Vec<Vec<u32>> = prompts(arch).into_iter().map(|p| p.prompt_ids).collect();
        for (batch, bound) in [(1usize, 0.25f32), (3, 0.25), (6, 1e-3)] {
            let requests: Vec<_> = (0..batch)
                .map(|i| {
                    let params = SamplingParams {
                        logprobs: Some(0),
                        ..greedy(10)
                    };
                    (prompts[i % prompts.len()].clone(), params)
                })
                .collect();
            let decoded = run_logged(&mut engine, &requests);
            let mut worst = 0f32;
            for ((prompt, _), (tokens, logprobs)) in requests.iter().zip(&decoded) {
                let mut all = prompt.clone();
                all.extend(&tokens[..tokens.len() - 1]);
                let params = SamplingParams {
                    prompt_logits: true,
                    ..SamplingParams::greedy(1)
                };
                let out = engine.generate(vec![(all, params)]).unwrap();
                let rows = out[0].prompt_logits.as_ref().unwrap();
                let vocab = rows.len() / (prompt.len() + tokens.len() - 1);
                for (s, (&token, &lp)) in tokens.iter().zip(logprobs).enumerate() {
                    let row = &rows[(prompt.len() - 1 + s) * vocab..][..vocab];
                    let want = lantern_engine::sampling::log_softmax(row)[token as usize];
                    worst = worst.max((want - lp).abs());
                }
            }
            eprintln!("{arch} bf16 batch {batch}: decode vs prefill logprobs {worst:.2e}");
            assert!(
                worst <= bound,
                "{arch} batch {batch}: logprobs differ by {worst} (bound {bound})"
            );
        }
    }
}

/// Each architecture's GGUF files of quantized types, with the flavour of their
/// dequantized-weights reference.
const QUANTIZED_FILES: &[(&str, &str, &str)] = &[
    ("llama", "llama.q8_0.gguf", ".q8_0"),
    ("llama", "llama.Q4_K_M.gguf", ".Q4_K_M"),
    ("mistral", "mistral.q8_0.gguf", ".q8_0"),
    ("qwen2", "qwen2.q8_0.gguf", ".q8_0"),
    ("qwen3", "qwen3.q8_0.gguf", ".q8_0"),
    ("gemma2", "gemma2.q8_0.gguf", ".q8_0"),
    ("phi3", "phi3.q8_0.gguf", ".q8_0"),
    ("gemma3_text", "gemma3_text.q8_0.gguf", ".q8_0"),
];

fn gguf_engine(
    arch: &str,
    file: &str,
    f32_weights: bool,
    enforce_eager: bool,
) -> (Engine, Option<usize>) {
    let options = LoadOptions {
        progress: false,
        f32_weights,
        ..Default::default()
    };
    let config = EngineConfig {
        kv_cache_memory: 16 << 20,
        kv_cache_dtype: KvDtype::F32,
        enforce_eager,
        ..EngineConfig::default()
    };
    let placed = load_on(
        DeviceChoice::Cuda(0),
        &fixture(arch).join("gguf").join(file),
        &options,
    )
    .unwrap_or_else(|e| panic!("{file}: {e}"));
    let bytes = placed.device_weight_bytes();
    (placed.start(config, None).unwrap(), bytes)
}

/// GGUF weights kept quantized on the GPU (Q8_0; Q4_K_M mixing Q4_K and Q6_K in a
/// layer): steps of at most 4 rows read them as stored in the small products (f32
/// activations, the exact dequantized values), so their logits equal those of the same
/// file dequantized to f32 at load up to summation order; longer prompts read them
/// dequantized to bf16 and stay near the dequantized-weights reference as bf16 weights
/// do. Decode steps replayed from graphs give the eager steps' tokens and log-probabilities,
/// at batch 1 (small products) and 5 (rows dequantized for cuBLAS). On the device they
/// take less than the bf16 copy of the same model.
#[test]
fn gguf_weights_kept_quantized_match_their_dequantized_values() {
    if !gpu_present("gguf_weights_kept_quantized_match_their_dequantized_values") {
        return;
    }
    for &(arch, file, flavour) in QUANTIZED_FILES {
        let (mut kept, kept_bytes) = gguf_engine(arch, file, false, false);
        assert_eq!(
            kept.device_weight_bytes(),
            kept_bytes,
            "the engine tells its weights"
        );
        let (mut exact, _) = gguf_engine(arch, file, true, false);
        let prompts = common::reference_prompts_in(&fixture(arch).join("ref"), flavour);
        for p in &prompts {
            for len in 1..=4.min(p.all_ids.len()) {
                let params = SamplingParams {
                    prompt_logits: true,
                    ..SamplingParams::greedy(1)
                };
                let prefix = p.all_ids[..len].to_vec();
                let rows = |e: &mut Engine| {
                    let mut out = e.generate(vec![(prefix.clone(), params.clone())]).unwrap();
                    out[0].prompt_logits.take().unwrap()
                };
                let (got, want) = (rows(&mut kept), rows(&mut exact));
                let diff = common::max_abs_diff(&got, &want);
                assert!(
                    diff < LOGIT_TOLERANCE,
                    "{file} {} first {len} tokens: logits differ by {diff}",
                    p.id
                );
            }
            // The whole prompt at once: products past the small ones' 4 rows read their
            // rows dequantized to bf16 (in chunks for large matrices) and the activations
            // as bf16, so within bf16's rounding, not 1e-3 (up to 12% of the largest
            // logit for these tiny random models, Gemma 2's).
            let params = SamplingParams {
                prompt_logits: true,
                ..SamplingParams::greedy(1)
            };
            let whole = |e: &mut Engine| {
                let mut out = e
                    .generate(vec![(p.all_ids.clone(), params.clone())])
                    .unwrap();
                out[0].prompt_logits.take().unwrap()
            };
            let (got, want) = (whole(&mut kept), whole(&mut exact));
            let diff = common::max_abs_diff(&got, &want);
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(
                got.len() == want.len() && diff < 0.15 * scale,
                "{file} {}: the whole prompt's logits differ by {diff} (largest {scale})",
                p.id
            );
            let (rows, first) = teacher_forced_logits(&mut kept, p);
            let vocab = p.last_logits.len();
            let diff = common::max_abs_diff(&rows[first * vocab..][..vocab], &p.last_logits);
            let scale = p.last_logits.iter().fold(0f32, |m, v| m.max(v.abs()));
            eprintln!("{file} {}: kept quantized, last logits {diff:.2e}", p.id);
            assert!(
                diff < 0.1 * scale,
                "{file} {}: last logits differ by {diff} (largest {scale})",
                p.id
            );
        }
        // The same history on both engines: the requests' steps then hold the same rows
        // (a prompt the prefix cache holds on one engine alone would batch differently,
        // and rows past the small products' 4 round to bf16).
        kept.reset();
        let (mut eager, _) = gguf_engine(arch, file, false, true);
        for batch in [1, 5] {
            let requests: Vec<_> = (0..batch)
                .map(|i| {
                    let params = SamplingParams {
                        logprobs: Some(3),
                        ..greedy(10)
                    };
                    (prompts[i % prompts.len()].prompt_ids.clone(), params)
                })
                .collect();
            let on_graphs = run_logged(&mut kept, &requests);
            let eagerly = run_logged(&mut eager, &requests);
            assert_same_runs(&format!("{file} batch {batch}"), &on_graphs, &eagerly);
        }
        let stats = kept.graph_stats().expect("graphs");
        assert!(stats.replayed > 0 && stats.failed == 0, "{file}: {stats:?}");
        let hf_bytes = load_on(
            DeviceChoice::Cuda(0),
            &fixture(arch).join("hf"),
            &LoadOptions::default(),
        )
        .unwrap()
        .device_weight_bytes();
        let (kept_bytes, hf_bytes) = (kept_bytes.unwrap(), hf_bytes.unwrap());
        eprintln!("{file}: {kept_bytes} bytes on the device, bf16: {hf_bytes}");
        assert!(
            kept_bytes * 4 < hf_bytes * 3,
            "{file}: {kept_bytes} bytes on the device, the bf16 copy {hf_bytes}"
        );
    }
}
