//! Engine behaviour on a tiny random model written on the fly: fast, and exact about
//! scheduling (chunking, preemption, prefix caching, aborts, block accounting).

use candle_core::quantized::GgmlDType;
use lantern_engine::lantern_capture::CaptureSpec;
use lantern_engine::{Engine, EngineConfig, FinishReason, SamplingParams};
use lantern_model::synthetic::TinyLlama;
use lantern_model::{load_model, LoadOptions};
use std::sync::Arc;

fn tiny_engine(config: EngineConfig) -> (Engine, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    let model = TinyLlama {
        dtype: GgmlDType::Q8_0,
        ..TinyLlama::default()
    };
    model.write(&path).unwrap();
    let loaded = load_model(&path, &LoadOptions::default()).unwrap();
    (Engine::new(loaded, config).unwrap(), dir)
}

/// Token ids in the byte range with a deterministic pattern per request.
fn prompts(count: usize) -> Vec<Vec<u32>> {
    (0..count)
        .map(|i| {
            (0..(5 + 13 * i % 70))
                .map(|j| ((i * 31 + j * 7) % 250) as u32)
                .collect()
        })
        .collect()
}

fn run(config: EngineConfig, prompts: &[Vec<u32>], max_tokens: usize) -> Vec<Vec<u32>> {
    let (mut engine, _dir) = tiny_engine(config);
    let requests = prompts
        .iter()
        .map(|p| {
            let params = SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(max_tokens)
            };
            (p.clone(), params)
        })
        .collect();
    let out = engine.generate(requests).unwrap();
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
    out.into_iter().map(|c| c.token_ids).collect()
}

/// An f32 KV cache: the pools below are sized in f32 blocks to force preemption.
fn config(kv_blocks_bytes: usize) -> EngineConfig {
    EngineConfig {
        kv_cache_memory: kv_blocks_bytes,
        block_size: 4,
        kv_cache_dtype: lantern_kv::KvDtype::F32,
        ..EngineConfig::default()
    }
}

/// Bytes of `blocks` blocks of the tiny model (2 layers, 2 KV heads of 16, f32, block 4).
fn blocks(blocks: usize) -> usize {
    blocks * 2 * (2 * 4 * 2 * 16 * 4)
}

#[test]
fn an_engine_on_the_cpu_holds_no_weights_on_a_device() {
    let (engine, _dir) = tiny_engine(config(blocks(64)));
    assert_eq!(engine.device_weight_bytes(), None);
}

#[test]
fn chunked_prefill_gives_the_same_tokens() {
    let p = prompts(6);
    let whole = run(config(blocks(512)), &p, 12);
    let chunked = run(
        EngineConfig {
            max_num_batched_tokens: 7,
            ..config(blocks(512))
        },
        &p,
        12,
    );
    assert_eq!(whole, chunked);
}

#[test]
fn preemption_gives_the_same_tokens_and_frees_every_block() {
    let p = prompts(8);
    let roomy = run(config(blocks(512)), &p, 20);
    // 40 blocks of 4 tokens cannot hold 8 requests of up to ~90 tokens at once.
    let (mut engine, _dir) = tiny_engine(config(blocks(40)));
    let ids: Vec<_> = p
        .iter()
        .map(|prompt| {
            let params = SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(20)
            };
            engine.add_request(prompt.clone(), params).unwrap()
        })
        .collect();
    while engine.has_unfinished() {
        engine.step().unwrap();
    }
    assert!(
        engine.num_preemptions() > 0,
        "the pool was large enough: no preemption"
    );
    let tight: Vec<Vec<u32>> = ids
        .into_iter()
        .map(|id| engine.take_completion(id).unwrap().token_ids)
        .collect();
    assert_eq!(roomy, tight);
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
}

#[test]
fn prefix_caching_on_and_off_give_the_same_tokens() {
    let shared: Vec<u32> = (0..40).map(|j| (j * 3 % 250) as u32).collect();
    let p: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let mut v = shared.clone();
            v.extend((0..i + 1).map(|j| (100 + i * 10 + j) as u32));
            v
        })
        .collect();
    let off = run(
        EngineConfig {
            enable_prefix_caching: false,
            ..config(blocks(512))
        },
        &p,
        10,
    );
    // One at a time, so later requests find the shared prefix cached.
    let (mut engine, _dir) = tiny_engine(config(blocks(512)));
    let mut on = Vec::new();
    let mut cached = Vec::new();
    for prompt in &p {
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(10)
        };
        let c = engine
            .generate(vec![(prompt.clone(), params)])
            .unwrap()
            .remove(0);
        cached.push(c.num_cached_prompt_tokens);
        on.push(c.token_ids);
    }
    assert_eq!(off, on);
    assert_eq!(cached[0], 0);
    assert!(
        cached[1..].iter().all(|&c| c >= 40),
        "cached tokens: {cached:?}"
    );
}

#[test]
fn abort_frees_blocks_and_reports_abort() {
    let (mut engine, _dir) = tiny_engine(config(blocks(512)));
    let id = engine
        .add_request(prompts(1).remove(0), SamplingParams::greedy(50))
        .unwrap();
    engine.step().unwrap();
    assert!(engine.kv_cache().num_free_blocks() < engine.kv_cache().num_blocks());
    engine.abort(id);
    assert!(!engine.has_unfinished());
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
    assert_eq!(
        engine.take_completion(id).unwrap().finish_reason,
        FinishReason::Abort
    );
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    let (mut engine, _dir) = tiny_engine(config(blocks(8)));
    let err = |r: lantern_engine::Result<u64>| r.unwrap_err().to_string();
    assert!(err(engine.add_request(vec![], SamplingParams::greedy(4))).contains("empty"));
    assert!(
        err(engine.add_request(vec![100_000], SamplingParams::greedy(4))).contains("vocabulary")
    );
    // 8 blocks of 4 tokens can never hold 40 tokens.
    assert!(err(engine.add_request(vec![1; 30], SamplingParams::greedy(10))).contains("never fit"));
    assert!(!engine.has_unfinished());
}

/// `max_tokens: 0` runs the whole prompt and samples nothing: the capture has every
/// prompt row (none absent) and the blocks go back.
#[test]
fn max_tokens_zero_runs_the_prompt_only() {
    let (mut engine, _dir) = tiny_engine(config(blocks(64)));
    let info = engine.model_info().clone();
    let prompt = prompts(3).remove(2);
    let n = prompt.len();
    let spec = CaptureSpec::everything(info.num_layers, info.attention[0].num_heads);
    let id = engine
        .add_request_with_capture(prompt.clone(), SamplingParams::greedy(0), Some(spec))
        .unwrap();
    let plain = engine
        .add_request(prompt, SamplingParams::greedy(0))
        .unwrap();
    let mut outputs = Vec::new();
    while engine.has_unfinished() {
        outputs.extend(engine.step().unwrap());
    }
    for id in [id, plain] {
        let last = outputs.iter().rfind(|o| o.id == id).unwrap();
        assert!(last.new_token_ids.is_empty());
        assert_eq!(last.finished, Some(FinishReason::Length));
    }
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
    let done = engine.take_completion(id).unwrap();
    assert!(done.token_ids.is_empty() && done.text.is_empty());
    assert_eq!(done.finish_reason, FinishReason::Length);
    let result = done.capture.unwrap().unwrap().finalize().unwrap();
    assert_eq!(result.meta.row_positions, (0..n).collect::<Vec<_>>());
    assert_eq!(result.meta.key_positions, (0..n).collect::<Vec<_>>());
    assert!(result.meta.absent_rows.is_empty());
    for map in &result.layers {
        let keys = map.shape[2];
        for (i, row) in map.values.chunks(keys).enumerate() {
            let sum: f32 = row.iter().sum();
            assert!((sum - 1.0).abs() < 1e-4, "row {i} sums to {sum}");
        }
    }
    assert!(engine.take_completion(plain).unwrap().token_ids.is_empty());
}

#[test]
fn sampling_with_a_seed_is_reproducible() {
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(5),
        ignore_eos: true,
        max_tokens: 16,
        ..SamplingParams::default()
    };
    let once = |params: &SamplingParams| {
        let (mut engine, _dir) = tiny_engine(config(blocks(512)));
        engine
            .generate(vec![(prompts(1).remove(0), params.clone())])
            .unwrap()
            .remove(0)
            .token_ids
    };
    assert_eq!(once(&params), once(&params));
}

/// Every supported weight type loads, and its products (quantized activations against the
/// type's own kernel) agree with the same weights dequantized to f32 up to activation
/// quantization error.
#[test]
fn every_weight_type_computes_what_its_dequantized_weights_compute() {
    use GgmlDType::*;
    let prompt: Vec<u32> = (0..24).map(|j| (j * 11 % 250) as u32).collect();
    for dtype in [F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q8_0, Q4K, Q5K, Q6K] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        // K-quants pack 256 values per block, so every matrix dimension is a multiple.
        let model = TinyLlama {
            dtype,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            ffn: 512,
            ..TinyLlama::default()
        };
        model.write(&path).unwrap();
        let logits = |f32_weights: bool| {
            let options = LoadOptions {
                progress: false,
                f32_weights,
                ..Default::default()
            };
            let loaded = load_model(&path, &options).unwrap();
            let mut engine = Engine::new(loaded, config(blocks(512))).unwrap();
            let params = SamplingParams {
                prompt_logits: true,
                ..SamplingParams::greedy(1)
            };
            engine
                .generate(vec![(prompt.clone(), params)])
                .unwrap()
                .remove(0)
                .prompt_logits
                .unwrap()
        };
        let (fast, exact) = (logits(false), logits(true));
        let norm = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        let diff: Vec<f32> = fast.iter().zip(&exact).map(|(a, b)| a - b).collect();
        let rel = norm(&diff) / norm(&exact);
        eprintln!("{dtype:?}: relative difference to f32 weights {rel:.2e}");
        // 8-bit activation quantization over two layers: ~5e-3 measured for every
        // quantized type, exactly 0 for the float types (dequantized at load either way).
        assert!(rel < 2e-2, "{dtype:?}: relative difference {rel}");
    }
}

#[test]
fn greedy_logprobs_match_the_prompt_logits() {
    let (mut engine, _dir) = tiny_engine(config(blocks(64)));
    let prompt: Vec<u32> = (0..11).map(|j| (j * 17 % 250) as u32).collect();
    let params = SamplingParams {
        prompt_logits: true,
        logprobs: Some(3),
        ignore_eos: true,
        ..SamplingParams::greedy(1)
    };
    let id = engine.add_request(prompt.clone(), params).unwrap();
    let mut outputs = Vec::new();
    while engine.has_unfinished() {
        outputs.extend(engine.step().unwrap());
    }
    assert_eq!(outputs.len(), 1);
    let lp = outputs[0]
        .logprobs
        .clone()
        .expect("logprobs were asked for");
    let completion = engine.take_completion(id).unwrap();
    assert_eq!(lp.token_id, completion.token_ids[0]);
    let all = completion.prompt_logits.unwrap();
    let vocab = all.len() / prompt.len();
    let last = &all[(prompt.len() - 1) * vocab..];
    // log_softmax computed here, in f64.
    let max = last.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let log_sum = max
        + last
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let expected = last[lp.token_id as usize] as f64 - log_sum;
    assert!(
        (lp.logprob as f64 - expected).abs() < 1e-4,
        "{} vs {expected}",
        lp.logprob
    );
    assert!(lp.logprob <= 0.0);
    assert_eq!(lp.top.len(), 3);
    // Greedy: the chosen token is the most likely one.
    assert_eq!(lp.top[0].0, lp.token_id);
    assert_eq!(lp.top[0].1, lp.logprob);
    assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    for &(t, l) in &lp.top {
        let e = last[t as usize] as f64 - log_sum;
        assert!((l as f64 - e).abs() < 1e-4);
    }
}

#[test]
fn penalties_change_greedy_decoding() {
    let (mut engine, _dir) = tiny_engine(config(blocks(64)));
    let prompt: Vec<u32> = (0..9).map(|j| (j * 13 % 250) as u32).collect();
    let run = |engine: &mut Engine, params: SamplingParams| {
        engine
            .generate(vec![(prompt.clone(), params)])
            .unwrap()
            .remove(0)
            .token_ids
    };
    let greedy = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(24)
    };
    let penalized = run(
        &mut engine,
        SamplingParams {
            frequency_penalty: 2.0,
            presence_penalty: 2.0,
            ..greedy.clone()
        },
    );
    let repetition = run(
        &mut engine,
        SamplingParams {
            repetition_penalty: 50.0,
            ..greedy.clone()
        },
    );
    let plain = run(&mut engine, greedy);
    let distinct = |t: &[u32]| t.iter().collect::<std::collections::HashSet<_>>().len();
    // The tiny random model repeats one token greedily; penalties break the loop.
    assert_eq!(distinct(&plain), 1, "{plain:?}");
    assert!(distinct(&penalized) > 1, "{penalized:?}");
    assert!(distinct(&repetition) > 1, "{repetition:?}");
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
}

/// Prompt logits survive chunked prefill and preemption: the same rows as a roomy run.
#[test]
fn prompt_logits_are_whole_under_chunking_and_preemption() {
    let p = prompts(8);
    let collect = |config: EngineConfig| {
        let (mut engine, _dir) = tiny_engine(config);
        let requests = p
            .iter()
            .map(|prompt| {
                let params = SamplingParams {
                    prompt_logits: true,
                    ignore_eos: true,
                    ..SamplingParams::greedy(20)
                };
                (prompt.clone(), params)
            })
            .collect();
        let out = engine.generate(requests).unwrap();
        (
            engine.num_preemptions(),
            out.into_iter()
                .map(|c| c.prompt_logits.unwrap())
                .collect::<Vec<_>>(),
        )
    };
    let (_, roomy) = collect(config(blocks(512)));
    let (preemptions, tight) = collect(EngineConfig {
        max_num_batched_tokens: 9,
        ..config(blocks(40))
    });
    assert!(preemptions > 0);
    for (i, (a, b)) in roomy.iter().zip(&tight).enumerate() {
        assert_eq!(
            a.len(),
            p[i].len() * 258,
            "request {i}: one row per prompt token"
        );
        assert_eq!(a, b, "request {i}");
    }
}

/// Prompt logits taken with the first token are the whole rows; the request then runs on
/// without them, through chunking and preemption, to the same tokens.
#[test]
fn prompt_logits_can_be_taken_with_the_first_token() {
    let p = prompts(8);
    let params = SamplingParams {
        prompt_logits: true,
        ignore_eos: true,
        ..SamplingParams::greedy(20)
    };
    let (mut roomy, _dir) = tiny_engine(config(blocks(512)));
    let reference = roomy
        .generate(p.iter().map(|x| (x.clone(), params.clone())).collect())
        .unwrap();
    let (mut engine, _dir2) = tiny_engine(EngineConfig {
        max_num_batched_tokens: 9,
        ..config(blocks(40))
    });
    let ids: Vec<_> = p
        .iter()
        .map(|x| engine.add_request(x.clone(), params.clone()).unwrap())
        .collect();
    for &id in &ids {
        assert!(engine.take_prompt_logits(id).is_none(), "not computed yet");
    }
    let mut taken: Vec<Option<Vec<f32>>> = vec![None; ids.len()];
    while engine.has_unfinished() {
        for out in engine.step().unwrap() {
            let i = ids.iter().position(|&id| id == out.id).unwrap();
            if taken[i].is_none() {
                let logits = engine.take_prompt_logits(out.id);
                taken[i] = Some(logits.expect("complete with the first token"));
                assert!(engine.take_prompt_logits(out.id).is_none(), "taken once");
            }
        }
    }
    assert!(engine.num_preemptions() > 0);
    for (i, &id) in ids.iter().enumerate() {
        let completion = engine.take_completion(id).unwrap();
        assert!(completion.prompt_logits.is_none(), "request {i}");
        assert_eq!(completion.token_ids, reference[i].token_ids, "request {i}");
        assert_eq!(
            taken[i].as_ref(),
            reference[i].prompt_logits.as_ref(),
            "request {i}"
        );
    }
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
}

/// Samples of one prompt (n > 1) share its full blocks by reference count: the first
/// computes the prompt, the others take it from the prefix cache, and every sample
/// generates what it would alone.
#[test]
fn siblings_share_the_prompt_blocks() {
    let prompt: Vec<u32> = (0..42).map(|j| (j * 5 % 250) as u32).collect();
    let params = |seed: u64| SamplingParams {
        ignore_eos: true,
        temperature: 1.0,
        seed: Some(seed),
        ..SamplingParams::greedy(10)
    };
    let alone: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let (mut engine, _dir) = tiny_engine(config(blocks(512)));
            engine.generate(vec![(prompt.clone(), params(i))]).unwrap()[0]
                .token_ids
                .clone()
        })
        .collect();
    let (mut engine, _dir) = tiny_engine(config(blocks(512)));
    let leader = engine.add_request(prompt.clone(), params(0)).unwrap();
    let siblings: Vec<_> = (1..4)
        .map(|i| {
            engine
                .add_sibling_request(leader, prompt.clone(), params(i))
                .unwrap()
        })
        .collect();
    let mut most_blocks_in_use = 0;
    while engine.has_unfinished() {
        engine.step().unwrap();
        let kv = engine.kv_cache();
        most_blocks_in_use = most_blocks_in_use.max(kv.num_blocks() - kv.num_free_blocks());
    }
    let first = engine.take_completion(leader).unwrap();
    assert_eq!(first.token_ids, alone[0]);
    let full_blocks = (prompt.len() - 1) / 4 * 4;
    for (i, id) in siblings.into_iter().enumerate() {
        let c = engine.take_completion(id).unwrap();
        assert_eq!(c.token_ids, alone[i + 1], "sample {}", i + 1);
        assert_eq!(c.num_cached_prompt_tokens, full_blocks, "sample {}", i + 1);
    }
    // Four private copies would need 4 x 13 blocks for 52 tokens each; sharing the
    // prompt's 10 full blocks leaves 10 + 4 x 3.
    eprintln!("most blocks in use: {most_blocks_in_use}");
    assert!(most_blocks_in_use <= 10 + 4 * 3, "{most_blocks_in_use}");
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
}

/// The samples of one request hold one copy of its prompt ids, however many they are:
/// the engine keeps the caller's `Arc`, and completions hand the same one back.
#[test]
fn samples_share_one_copy_of_the_prompt_ids() {
    let prompt: Arc<[u32]> = (0..40).map(|j| (j * 3 % 250) as u32).collect();
    let n = 256;
    let (mut engine, _dir) = tiny_engine(config(blocks(2048)));
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(2)
    };
    let leader = engine.add_request(prompt.clone(), params.clone()).unwrap();
    let mut ids = vec![leader];
    for _ in 1..n {
        let id = engine
            .add_sibling_request(leader, prompt.clone(), params.clone())
            .unwrap();
        ids.push(id);
    }
    // Ours plus one per sample: no sample copied the ids.
    assert_eq!(Arc::strong_count(&prompt), 1 + n);
    while engine.has_unfinished() {
        engine.step().unwrap();
    }
    let completions: Vec<_> = ids
        .into_iter()
        .map(|id| engine.take_completion(id).unwrap())
        .collect();
    assert!(completions
        .iter()
        .all(|c| Arc::ptr_eq(&c.prompt_token_ids, &prompt) && c.token_ids.len() == 2));
    drop(completions);
    assert_eq!(Arc::strong_count(&prompt), 1, "a sample kept the prompt");
}

#[test]
fn a_step_that_panics_leaves_a_reset_that_frees_every_block_and_runs_as_new() {
    let p = prompts(4);
    let expected = run(config(blocks(512)), &p, 6);
    let (mut engine, _dir) = tiny_engine(config(blocks(512)));
    engine.set_fault_plan("panic-at-step:3".parse().unwrap());
    for prompt in &p {
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(6)
        };
        engine.add_request(prompt.clone(), params).unwrap();
    }
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        while engine.has_unfinished() {
            engine.step().unwrap();
        }
    }));
    assert!(panicked.is_err(), "the injected fault did not fire");
    // The panic hit after the scheduler took blocks for the step.
    assert!(engine.kv_cache().num_free_blocks() < engine.kv_cache().num_blocks());
    let queries_before = engine.prefix_cache_stats().queries;
    engine.reset();
    assert!(!engine.has_unfinished());
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
    assert_eq!(engine.prefix_cache_stats().queries, queries_before);
    // The same requests again give what a fresh engine gives.
    let again = engine
        .generate(
            p.iter()
                .map(|prompt| {
                    let params = SamplingParams {
                        ignore_eos: true,
                        ..SamplingParams::greedy(6)
                    };
                    (prompt.clone(), params)
                })
                .collect(),
        )
        .unwrap();
    let again: Vec<Vec<u32>> = again.into_iter().map(|c| c.token_ids).collect();
    assert_eq!(again, expected);
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
}

/// Prompt logprobs reduced row by row (top-k only, at most 128 prompt rows a step) equal
/// what the whole prompt-logits table gives, through chunking and preemption.
#[test]
fn prompt_logprobs_row_by_row_equal_the_whole_table() {
    use lantern_engine::sampling::prompt_token_logprob;
    let p = prompts(8);
    let (mut roomy, _dir) = tiny_engine(config(blocks(512)));
    let tables = roomy
        .generate(
            p.iter()
                .map(|x| {
                    let params = SamplingParams {
                        prompt_logits: true,
                        ignore_eos: true,
                        ..SamplingParams::greedy(4)
                    };
                    (x.clone(), params)
                })
                .collect(),
        )
        .unwrap();
    let (mut engine, _dir2) = tiny_engine(EngineConfig {
        max_num_batched_tokens: 9,
        ..config(blocks(40))
    });
    let params = SamplingParams {
        prompt_logprobs: Some(3),
        ignore_eos: true,
        ..SamplingParams::greedy(20)
    };
    let ids: Vec<_> = p
        .iter()
        .map(|x| engine.add_request(x.clone(), params.clone()).unwrap())
        .collect();
    let mut taken = vec![None; ids.len()];
    while engine.has_unfinished() {
        for out in engine.step().unwrap() {
            if let Some(rows) = engine.take_prompt_logprobs(out.id) {
                let i = ids.iter().position(|&id| id == out.id).unwrap();
                assert!(taken[i].is_none(), "taken once");
                taken[i] = Some(rows);
            }
        }
    }
    assert!(engine.num_preemptions() > 0);
    for (i, (table, rows)) in tables.iter().zip(taken).enumerate() {
        let rows = rows.expect("prompt logprobs came with the first token");
        let table = table.prompt_logits.as_ref().unwrap();
        assert_eq!(rows.len(), p[i].len() - 1, "request {i}");
        for (pos, row) in rows.iter().enumerate() {
            let logits = &table[pos * 258..(pos + 1) * 258];
            let expected = prompt_token_logprob(logits, p[i][pos + 1], 3).unwrap();
            assert_eq!(*row, expected, "request {i}, position {pos}");
            assert_eq!(row.top.len(), 3);
        }
    }
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
}

/// Runs `prompts` one at a time (so each finds the earlier ones cached), each asking for
/// `top` prompt logprobs: each request's rows and cached prompt tokens.
fn scored_one_by_one(
    engine: &mut Engine,
    prompts: &[(Vec<u32>, usize)],
) -> Vec<(Vec<lantern_engine::sampling::PromptTokenLogprob>, usize)> {
    prompts
        .iter()
        .map(|(prompt, top)| {
            let params = SamplingParams {
                prompt_logprobs: Some(*top),
                ignore_eos: true,
                ..SamplingParams::greedy(3)
            };
            let id = engine.add_request(prompt.clone(), params).unwrap();
            let mut rows = None;
            while engine.has_unfinished() {
                engine.step().unwrap();
                if rows.is_none() {
                    rows = engine.take_prompt_logprobs(id);
                }
            }
            let done = engine.take_completion(id).unwrap();
            let rows = rows.expect("prompt logprobs came with the first token");
            assert_eq!(rows.len(), prompt.len() - 1);
            (rows, done.num_cached_prompt_tokens)
        })
        .collect()
}

/// A request asking for prompt logprobs takes a prefix-cache hit as far as the rows of
/// the cached prefix are kept, and its rows equal those computed without any cache:
/// also in chunks (a 9-token budget) from a small pool, for more alternatives (computed
/// anew) and fewer (the first of those kept), and after a reset (records forgotten).
#[test]
fn prompt_logprobs_take_prefix_hits_and_give_the_same_rows() {
    let shared: Vec<u32> = (0..41).map(|j| (j * 5 % 250) as u32).collect();
    let mut prompts: Vec<(Vec<u32>, usize)> = (0..5)
        .map(|i| {
            let mut p = shared.clone();
            p.extend((0..2 + i * 3).map(|j| (60 + i * 17 + j) as u32));
            (p, 2)
        })
        .collect();
    // The same prompt again, one asking for more alternatives (it computes its prompt,
    // and its records replace those of 2), then fewer (served by the records of 3).
    prompts.push(prompts[1].clone());
    prompts.push((prompts[2].0.clone(), 3));
    prompts.push((prompts[3].0.clone(), 1));
    prompts.push((prompts[4].0.clone(), 0));
    let (mut cold, _dir) = tiny_engine(EngineConfig {
        enable_prefix_caching: false,
        ..config(blocks(512))
    });
    let expected = scored_one_by_one(&mut cold, &prompts);
    for small in [false, true] {
        let engine_config = if small {
            EngineConfig {
                max_num_batched_tokens: 9,
                ..config(blocks(24))
            }
        } else {
            config(blocks(512))
        };
        let (mut engine, _dir) = tiny_engine(engine_config);
        let got = scored_one_by_one(&mut engine, &prompts);
        for (i, ((rows, cached), (want, _))) in got.iter().zip(&expected).enumerate() {
            assert_eq!(rows, want, "request {i} (small pool: {small})");
            let hit = match i {
                0 | 6 => 0,
                // The shared 41 tokens hold 10 full blocks of 4; the last of them is
                // computed again, as its row scores the first token after the hit.
                _ => 36,
            };
            assert!(
                *cached >= hit && (hit > 0 || *cached == 0),
                "request {i}: {cached} cached tokens (small pool: {small})"
            );
        }
        assert_eq!(
            engine.kv_cache().num_free_blocks(),
            engine.kv_cache().num_blocks()
        );
        engine.reset();
        let again = scored_one_by_one(&mut engine, &prompts[1..2]);
        assert_eq!(again[0].0, expected[1].0);
        assert_eq!(again[0].1, 0, "records were forgotten at the reset");
    }
}

/// Requests added together whose prompts start with the same blocks compute them once:
/// the first computes the shared prefix, the others wait a step and take it from the
/// prefix cache (prompt logprobs too, when they ask for them with as many alternatives
/// as the first keeps, or fewer); their tokens and rows are those computed without a
/// cache.
#[test]
fn requests_arriving_together_compute_a_shared_prefix_once() {
    let shared: Vec<u32> = (0..41).map(|j| (j * 11 % 250) as u32).collect();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| {
            let mut p = shared.clone();
            p.extend((0..3 + i).map(|j| (70 + i * 13 + j) as u32));
            p
        })
        .collect();
    for scored in [None, Some(2)] {
        let params = SamplingParams {
            prompt_logprobs: scored,
            ignore_eos: true,
            ..SamplingParams::greedy(4)
        };
        let run = |prefix_caching: bool| {
            let (mut engine, _dir) = tiny_engine(EngineConfig {
                enable_prefix_caching: prefix_caching,
                ..config(blocks(512))
            });
            let ids: Vec<_> = prompts
                .iter()
                .map(|p| engine.add_request(p.clone(), params.clone()).unwrap())
                .collect();
            let mut rows = vec![None; ids.len()];
            while engine.has_unfinished() {
                engine.step().unwrap();
                for (i, &id) in ids.iter().enumerate() {
                    if rows[i].is_none() {
                        rows[i] = engine.take_prompt_logprobs(id);
                    }
                }
            }
            let done: Vec<_> = ids
                .iter()
                .map(|&id| engine.take_completion(id).unwrap())
                .collect();
            assert_eq!(
                engine.kv_cache().num_free_blocks(),
                engine.kv_cache().num_blocks()
            );
            (done, rows)
        };
        let (cold, cold_rows) = run(false);
        let (warm, warm_rows) = run(true);
        for (i, (a, b)) in cold.iter().zip(&warm).enumerate() {
            assert_eq!(a.token_ids, b.token_ids, "request {i} ({scored:?})");
            let cached = if i == 0 { 0 } else { 36 };
            assert!(
                b.num_cached_prompt_tokens >= cached && (i > 0 || b.num_cached_prompt_tokens == 0),
                "request {i}: {} cached ({scored:?})",
                b.num_cached_prompt_tokens
            );
        }
        assert_eq!(cold_rows, warm_rows);
    }
}

/// Sizes of zero would leave the scheduler unable to run anything: refused when the
/// engine is built, naming the flag.
#[test]
fn zero_sizes_are_refused_naming_their_flag() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    TinyLlama::default().write(&path).unwrap();
    let cases = [
        (
            EngineConfig {
                block_size: 0,
                ..config(blocks(64))
            },
            "--block-size",
        ),
        (
            EngineConfig {
                max_num_seqs: 0,
                ..config(blocks(64))
            },
            "--max-num-seqs",
        ),
        (
            EngineConfig {
                max_num_batched_tokens: 0,
                ..config(blocks(64))
            },
            "--max-num-batched-tokens",
        ),
    ];
    for (bad, flag) in cases {
        let loaded = load_model(&path, &LoadOptions::default()).unwrap();
        let error = Engine::new(loaded, bad).err().expect("refused").to_string();
        assert!(error.contains(flag), "{error}");
    }
}
