//! Rows reduced by the model (what a GPU model does for greedy requests and for requests
//! sampling at a temperature, whole or cut by top-k/top-p/min-p, with their logprobs and
//! prompt logprobs, so that a few numbers per row cross to the host) give the tokens and
//! logprobs the host gives, and leave every other kind of request to the sampler: a batch
//! mixing plain greedy, greedy with logprobs, penalties, `min_tokens`, prompt logits,
//! seeded sampling of the whole row and with top-p (picked with the draw taken ahead of
//! the step) and with logprobs runs identically with reducing on and off.

mod common;

use lantern_engine::{Engine, EngineConfig, SamplingParams};
use lantern_kv::KvDtype;
use lantern_model::LoadOptions;
use std::path::Path;

fn engine() -> Engine {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/archs/llama/hf");
    let loaded = lantern_model::load_model(&path, &LoadOptions::default()).unwrap();
    let config = EngineConfig {
        kv_cache_memory: 16 << 20,
        kv_cache_dtype: KvDtype::F32,
        ..EngineConfig::default()
    };
    Engine::new(loaded, config).unwrap()
}

fn requests() -> Vec<(
    Vec<u32>,
    SamplingParams,
    Option<lantern_capture::CaptureSpec>,
)> {
    let greedy = |n| SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(n)
    };
    let prompt = |seed: u32, len: u32| -> Vec<u32> {
        (0..len)
            .map(|i| 300 + (seed * 37 + i * 11) % 1500)
            .collect()
    };
    vec![
        (prompt(1, 9), greedy(12), None),
        (prompt(2, 23), greedy(7), None),
        (
            prompt(3, 5),
            SamplingParams {
                logprobs: Some(3),
                ..greedy(6)
            },
            None,
        ),
        (
            prompt(4, 14),
            SamplingParams {
                repetition_penalty: 1.3,
                ..greedy(9)
            },
            None,
        ),
        (
            prompt(5, 6),
            SamplingParams {
                min_tokens: 4,
                ignore_eos: false,
                ..SamplingParams::greedy(8)
            },
            None,
        ),
        (
            prompt(6, 11),
            SamplingParams {
                prompt_logits: true,
                ..greedy(5)
            },
            None,
        ),
        (
            prompt(7, 8),
            SamplingParams {
                temperature: 0.8,
                seed: Some(7),
                ..greedy(10)
            },
            None,
        ),
        (
            prompt(8, 12),
            SamplingParams {
                temperature: 1.0,
                seed: Some(8),
                ..greedy(24)
            },
            None,
        ),
        (
            prompt(9, 7),
            SamplingParams {
                temperature: 1.5,
                seed: Some(9),
                ..greedy(24)
            },
            None,
        ),
        (
            prompt(10, 10),
            SamplingParams {
                temperature: 1.0,
                top_p: 0.9,
                seed: Some(10),
                ..greedy(12)
            },
            None,
        ),
        (
            prompt(11, 9),
            SamplingParams {
                temperature: 1.0,
                logprobs: Some(2),
                seed: Some(11),
                ..greedy(12)
            },
            None,
        ),
    ]
}

#[test]
fn picked_rows_give_the_samplers_tokens_and_leave_the_rest_alone() {
    let mut plain = engine();
    let mut picking = engine();
    picking.set_pick_on_host(true);
    let expected = common::run_to_completion(&mut plain, requests());
    let got = common::run_to_completion(&mut picking, requests());
    for (i, (a, b)) in expected.iter().zip(&got).enumerate() {
        assert_eq!(a.token_ids, b.token_ids, "request {i}: tokens");
        assert_eq!(
            a.prompt_logits, b.prompt_logits,
            "request {i}: prompt logits"
        );
        assert_eq!(a.finish_reason, b.finish_reason, "request {i}: finish");
    }
    assert!(expected.iter().all(|c| !c.token_ids.is_empty()));
}

/// Prompt logits change no row but send the sampling row through `append_token`, the
/// sampler one row at a time (such a request's rows are not read alone).
fn one_by_one(params: SamplingParams) -> SamplingParams {
    SamplingParams {
        prompt_logits: true,
        ..params
    }
}

/// Runs `requests` as they are and sent through the sampler one by one, and asserts the
/// same `tokens` tokens and the same logprobs; returns the first run.
fn same_together_as_alone(requests: &[(Vec<u32>, SamplingParams)], tokens: usize) -> Vec<Logged> {
    let sampler: Vec<_> = requests
        .iter()
        .map(|(p, s)| (p.clone(), one_by_one(s.clone())))
        .collect();
    let together = run_logged(&mut engine(), requests);
    let alone = run_logged(&mut engine(), &sampler);
    for (i, (a, b)) in together.iter().zip(&alone).enumerate() {
        assert_eq!(a.0.len(), tokens, "request {i}");
        assert_eq!(a, b, "request {i}: tokens and logprobs");
    }
    together
}

/// Greedy rows left on the host are reduced on the step's threads
/// (`Engine::tokens_on_threads`), with their penalties and logprobs where asked: a batch
/// of greedy requests (some asking for 0 to 20 logprobs, some penalized) gives the tokens
/// and logprobs of the same requests sent through the sampler one by one.
#[test]
fn greedy_rows_reduced_together_give_the_samplers_tokens() {
    let requests: Vec<(Vec<u32>, SamplingParams)> = (0..9u32)
        .map(|s| {
            let prompt = (0..5 + 3 * s)
                .map(|i| 200 + (s * 53 + i * 29) % 1700)
                .collect();
            let params = SamplingParams {
                ignore_eos: true,
                logprobs: [None, Some(0), Some(3), Some(20)][s as usize % 4],
                // Penalties and bias, edited into a copy of the row on the thread.
                repetition_penalty: [1.0, 1.0, 1.3][s as usize % 3],
                presence_penalty: [0.0, 0.8][s as usize % 2],
                logit_bias: if s == 4 { vec![(300, 5.0)] } else { vec![] },
                ..SamplingParams::greedy(10)
            };
            (prompt, params)
        })
        .collect();
    same_together_as_alone(&requests, 10);
}

/// Sampled rows are reduced on the step's threads too, each with the draw its request's
/// stream gave before the step, with their penalties and logprobs where asked: a batch of
/// seeded requests at several temperatures, with and without top-k, top-p, min-p,
/// penalties and `min_tokens`, gives the
/// tokens and logprobs of the same requests sent through the sampler one by one (taking
/// the same draws from the same streams).
#[test]
fn sampled_rows_reduced_together_give_the_samplers_tokens() {
    let requests: Vec<(Vec<u32>, SamplingParams)> = (0..12u32)
        .map(|s| {
            let prompt = (0..4 + 2 * s)
                .map(|i| 200 + (s * 41 + i * 23) % 1700)
                .collect();
            let (top_k, top_p, min_p) =
                [(0, 1.0, 0.0), (0, 0.9, 0.0), (20, 1.0, 0.0), (0, 1.0, 0.05)][s as usize % 4];
            let params = SamplingParams {
                ignore_eos: true,
                temperature: [0.6, 1.0, 1.4][s as usize % 3],
                top_k,
                top_p,
                min_p,
                seed: Some(u64::from(s) + 40),
                logprobs: (s % 5 == 0).then_some(2),
                frequency_penalty: [0.0, 0.5][s as usize % 2],
                min_tokens: if s % 3 == 0 { 6 } else { 0 },
                stop_token_ids: vec![250, 900].into(),
                ..SamplingParams::greedy(12)
            };
            (prompt, params)
        })
        .collect();
    let together = same_together_as_alone(&requests, 12);
    let distinct: std::collections::HashSet<&Vec<u32>> = together.iter().map(|c| &c.0).collect();
    assert!(distinct.len() > 1, "the requests sampled different tokens");
}

/// Per request: its tokens, each token's (id, logprob, top) where it asked for logprobs,
/// and its prompt logprobs (logprob, rank, top) where it asked for those.
type Logged = (
    Vec<u32>,
    Vec<(u32, f32, Vec<(u32, f32)>)>,
    Vec<(f32, usize, Vec<(u32, f32)>)>,
);

fn run_logged(engine: &mut Engine, requests: &[(Vec<u32>, SamplingParams)]) -> Vec<Logged> {
    let ids: Vec<_> = requests
        .iter()
        .map(|(p, s)| engine.add_request(p.clone(), s.clone()).unwrap())
        .collect();
    let mut logged: Vec<Logged> = vec![Default::default(); ids.len()];
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            let i = ids.iter().position(|&id| id == o.id).unwrap();
            logged[i].0.extend(&o.new_token_ids);
            if let Some(lp) = o.logprobs {
                logged[i].1.push((lp.token_id, lp.logprob, lp.top));
            }
            if let Some(rows) = engine.take_prompt_logprobs(o.id) {
                logged[i].2 = rows
                    .into_iter()
                    .map(|r| (r.logprob, r.rank, r.top))
                    .collect();
            }
        }
    }
    assert_eq!(
        engine.kv_cache().num_free_blocks(),
        engine.kv_cache().num_blocks()
    );
    logged
}

/// Logprobs and prompt logprobs reduced where the logits are (what a GPU model does, so
/// that a few numbers per row cross to the host instead of the row) equal the host's: a
/// batch of greedy and seeded sampled requests asking for 0 to 20 alternatives, prompt
/// logprobs of 0 to 20 alternatives over prompts computed in several steps, and the kinds
/// the host keeps (more than 20 alternatives, prompt logprobs beside prompt logits)
/// gives the same tokens, ranks and top ids, and logprobs up to the order of f32 sums.
#[test]
fn reduced_rows_give_the_hosts_logprobs() {
    let prompt = |seed: u32, len: u32| -> Vec<u32> {
        (0..len)
            .map(|i| 100 + (seed * 43 + i * 17) % 1800)
            .collect()
    };
    let base = |n| SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(n)
    };
    let requests: Vec<(Vec<u32>, SamplingParams)> = vec![
        (
            prompt(1, 6),
            SamplingParams {
                logprobs: Some(0),
                ..base(5)
            },
        ),
        (
            prompt(2, 9),
            SamplingParams {
                logprobs: Some(3),
                ..base(7)
            },
        ),
        (
            prompt(3, 4),
            SamplingParams {
                logprobs: Some(20),
                ..base(6)
            },
        ),
        (
            prompt(4, 8),
            SamplingParams {
                logprobs: Some(25),
                ..base(4)
            },
        ),
        (
            prompt(5, 7),
            SamplingParams {
                temperature: 0.9,
                seed: Some(5),
                logprobs: Some(4),
                ..base(9)
            },
        ),
        (
            prompt(6, 30),
            SamplingParams {
                prompt_logprobs: Some(0),
                ..base(3)
            },
        ),
        (
            prompt(7, 21),
            SamplingParams {
                prompt_logprobs: Some(20),
                logprobs: Some(2),
                ..base(4)
            },
        ),
        (
            prompt(8, 12),
            SamplingParams {
                prompt_logprobs: Some(21),
                ..base(2)
            },
        ),
        (
            prompt(9, 10),
            SamplingParams {
                prompt_logprobs: Some(3),
                prompt_logits: true,
                ..base(2)
            },
        ),
        // Penalties and min_tokens: edits of the row before it is reduced.
        (
            prompt(10, 9),
            SamplingParams {
                repetition_penalty: 1.4,
                frequency_penalty: 0.7,
                presence_penalty: -0.3,
                logit_bias: vec![(301, 2.5), (17, -100.0), (999_999, 1.0)],
                logprobs: Some(5),
                ..base(12)
            },
        ),
        (
            prompt(11, 5),
            SamplingParams {
                temperature: 1.1,
                top_p: 0.9,
                seed: Some(11),
                presence_penalty: 1.5,
                min_tokens: 6,
                ignore_eos: false,
                stop_token_ids: vec![400, 1200].into(),
                logprobs: Some(3),
                ..SamplingParams::greedy(10)
            },
        ),
    ];
    let chunked = |pick: bool| {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/archs/llama/hf");
        let loaded = lantern_model::load_model(&path, &LoadOptions::default()).unwrap();
        let config = EngineConfig {
            kv_cache_memory: 16 << 20,
            kv_cache_dtype: KvDtype::F32,
            max_num_batched_tokens: 24,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(loaded, config).unwrap();
        e.set_pick_on_host(pick);
        e
    };
    let host = run_logged(&mut chunked(false), &requests);
    let reduced = run_logged(&mut chunked(true), &requests);
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 + 1e-5 * b.abs();
    let same_top = |what: &str, a: &[(u32, f32)], b: &[(u32, f32)]| {
        let ids = |t: &[(u32, f32)]| t.iter().map(|e| e.0).collect::<Vec<_>>();
        assert_eq!(ids(a), ids(b), "{what}: top ids");
        for (x, y) in a.iter().zip(b) {
            assert!(close(x.1, y.1), "{what}: top {x:?} against {y:?}");
        }
    };
    for (i, (h, r)) in host.iter().zip(&reduced).enumerate() {
        let params = &requests[i].1;
        assert_eq!(h.0, r.0, "request {i}: tokens");
        assert_eq!(h.1.len(), r.1.len(), "request {i}: logprobs");
        assert_eq!(h.1.len(), params.logprobs.map_or(0, |_| h.0.len()));
        for (s, (a, b)) in h.1.iter().zip(&r.1).enumerate() {
            let what = format!("request {i} token {s}");
            assert_eq!(a.0, b.0, "{what}: id");
            assert!(close(a.1, b.1), "{what}: logprob {} against {}", a.1, b.1);
            assert_eq!(a.2.len(), params.logprobs.unwrap());
            same_top(&what, &a.2, &b.2);
        }
        let prompt_rows = params
            .prompt_logprobs
            .map_or(0, |_| requests[i].0.len() - 1);
        assert_eq!(h.2.len(), prompt_rows, "request {i}: prompt logprobs");
        assert_eq!(r.2.len(), prompt_rows, "request {i}: prompt logprobs");
        for (pos, (a, b)) in h.2.iter().zip(&r.2).enumerate() {
            let what = format!("request {i} prompt position {pos}");
            assert!(close(a.0, b.0), "{what}: logprob {} against {}", a.0, b.0);
            assert_eq!(a.1, b.1, "{what}: rank");
            same_top(&what, &a.2, &b.2);
        }
    }
}
