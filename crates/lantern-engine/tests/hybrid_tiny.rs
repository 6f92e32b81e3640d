//! A tiny random Gemma 3 (sliding-window layers with window 8, every 6th layer global)
//! through the engine: two KV cache groups with their own block tables and metadata,
//! prompts several windows long, small blocks.

mod common;

use candle_core::quantized::GgmlDType;
use lantern_engine::{Engine, EngineConfig, SamplingParams};
use lantern_model::synthetic::GEMMA3_TINY_WINDOW;

fn engine(layers: usize, config: EngineConfig) -> (Engine, tempfile::TempDir) {
    common::tiny_gemma3(layers, GgmlDType::F32, config)
}

fn config() -> EngineConfig {
    EngineConfig {
        kv_cache_memory: 4 << 20,
        block_size: 4,
        ..common::f32_kv()
    }
}

fn prompt(len: usize, salt: usize) -> Vec<u32> {
    (0..len)
        .map(|j| ((salt * 31 + j * 7) % 250) as u32)
        .collect()
}

/// Logits of every prompt position, one request after the other.
fn prompt_logits(engine: &mut Engine, prompts: &[Vec<u32>]) -> Vec<Vec<f32>> {
    let requests = prompts
        .iter()
        .map(|p| {
            let params = SamplingParams {
                prompt_logits: true,
                ..SamplingParams::greedy(1)
            };
            (p.clone(), params)
        })
        .collect();
    let out = engine.generate(requests).unwrap();
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks(),
        "every block is free once the requests are done"
    );
    out.into_iter().map(|c| c.prompt_logits.unwrap()).collect()
}

#[test]
fn the_engine_makes_one_group_per_kind() {
    let (engine, _dir) = engine(7, config());
    assert_eq!(engine.kv_cache().num_groups(), 2);
}

/// With only sliding layers (5 layers of window 8), the last position sees back
/// 5 * 7 = 35 positions: tokens before that cannot change its logits at all.
#[test]
fn tokens_outside_the_receptive_field_do_not_matter() {
    let (mut engine, _dir) = engine(5, config());
    let a = prompt(60, 1);
    let mut b = a.clone();
    for t in b.iter_mut().take(60 - 5 * (GEMMA3_TINY_WINDOW - 1) - 1) {
        *t = (*t + 101) % 250;
    }
    let logits = prompt_logits(&mut engine, &[a, b]);
    let vocab = logits[0].len() / 60;
    let (la, lb) = (&logits[0][59 * vocab..], &logits[1][59 * vocab..]);
    assert_eq!(common::max_abs_diff(la, lb), 0.0);
    // ... while a token just inside it does.
    let mut c = prompt(60, 1);
    c[60 - 5 * (GEMMA3_TINY_WINDOW - 1)] += 1;
    let lc = prompt_logits(&mut engine, &[c]).remove(0);
    assert!(common::max_abs_diff(la, &lc[59 * vocab..]) > 1e-6);
}

/// Whole prefill, chunked prefill (chunks of 5 and 3 cross window and block edges),
/// another backend, and a prefix-cache hit all give the same logits.
#[test]
fn chunking_backends_and_prefix_hits_agree() {
    let prompts = [prompt(45, 2), prompt(23, 3), prompt(9, 4)];
    let (mut base, _d0) = engine(7, config());
    let whole = prompt_logits(&mut base, &prompts);
    let variants = [
        EngineConfig {
            max_num_batched_tokens: 5,
            ..config()
        },
        EngineConfig {
            max_num_batched_tokens: 3,
            attention_backend: "cpu-reference".into(),
            ..config()
        },
    ];
    for variant in variants {
        let label = format!("{variant:?}");
        let (mut e, _d) = engine(7, variant);
        for (w, o) in whole.iter().zip(prompt_logits(&mut e, &prompts)) {
            let diff = common::max_abs_diff(w, &o);
            assert!(diff < 1e-4, "{label}: {diff}");
        }
    }
    // Greedy continuations: the second run of the same prompt starts from the prefix
    // cache and still produces the same tokens.
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(20)
    };
    let first = base
        .generate(vec![(prompts[0].clone(), params.clone())])
        .unwrap()
        .remove(0);
    let second = base
        .generate(vec![(prompts[0].clone(), params)])
        .unwrap()
        .remove(0);
    assert!(second.num_cached_prompt_tokens > 0);
    assert_eq!(first.token_ids, second.token_ids);
}

/// A long request holds, in its sliding-window group, only the blocks the window still
/// reaches (window 8 over blocks of 4: at most 3), while the global group holds them
/// all; the generated tokens are those of an engine that keeps every block (a
/// capturing request keeps its blocks, so capturing it gives the reference).
#[test]
fn sliding_window_memory_stays_bounded_and_tokens_unchanged() {
    use lantern_engine::lantern_capture::CaptureSpec;
    use lantern_kv::AttentionKind;
    let (mut engine, _dir) = engine(7, config());
    let sliding = (0..engine.kv_cache().num_groups())
        .find(|&g| {
            matches!(
                engine.kv_cache().group_spec(g).unwrap().kind,
                AttentionKind::SlidingWindow { .. }
            )
        })
        .unwrap();
    let global = 1 - sliding;
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(150)
    };
    let p = prompt(30, 9);
    let id = engine.add_request(p.clone(), params.clone()).unwrap();
    let mut steps = 0;
    let mut most_sliding = 0;
    while engine.has_unfinished() {
        engine.step().unwrap();
        steps += 1;
        if !engine.has_unfinished() {
            break;
        }
        let kv = engine.kv_cache();
        let held = kv.num_held_blocks(id, sliding);
        most_sliding = most_sliding.max(held);
        assert!(
            held <= GEMMA3_TINY_WINDOW / 4 + 1,
            "step {steps}: {held} sliding blocks"
        );
        assert_eq!(
            kv.block_table(id, global).len(),
            kv.num_held_blocks(id, global)
        );
    }
    eprintln!("sliding group: at most {most_sliding} blocks over {steps} steps (180 tokens)");
    let bounded = engine.take_completion(id).unwrap().token_ids;
    // The same request, keeping every block because it captures.
    let spec = CaptureSpec::everything(7, engine.model_info().attention[0].num_heads);
    let id = engine
        .add_request_with_capture(p, params, Some(spec))
        .unwrap();
    while engine.has_unfinished() {
        engine.step().unwrap();
    }
    assert_eq!(engine.take_completion(id).unwrap().token_ids, bounded);
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
}
