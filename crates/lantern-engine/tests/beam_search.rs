//! Beam search through the engine's API on the real model: each sequence's logprobs are
//! the model's (checked by scoring the whole sequence as one prompt), the sequences come
//! ranked by vLLM's score, one beam is greedy decoding, several prompts search apart,
//! and a search its client leaves gives every KV block back.

mod common;

use lantern_engine::serving::{
    EndReason, EngineBuildPanicked, EngineEvent, EngineHandle, GenerationItem, PromptInput,
};
use lantern_engine::validate::{
    generation_request, CaptureSettings, Endpoint, GenerationRequest, ModelLimits, RequestContext,
};
use lantern_engine::{Engine, EngineConfig};
use serde_json::{json, Value};
use std::sync::Arc;

fn start() -> EngineHandle {
    let (handle, _thread) = EngineHandle::start(|| -> Result<Engine, EngineBuildPanicked> {
        Ok(common::engine_with(common::f32_kv()))
    })
    .expect("the engine starts");
    handle
}

fn validate(handle: &EngineHandle, body: Value) -> GenerationRequest {
    let capture = CaptureSettings::default();
    let limits = ModelLimits {
        served_name: "m",
        aliases: &[],
    };
    let context = RequestContext::new(limits, &capture, handle.meta());
    generation_request(Endpoint::Completion, &body, &context).expect("a valid body")
}

/// One choice as the events gave it.
#[derive(Debug, Default, Clone)]
struct Choice {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    text: String,
    reason: Option<EndReason>,
}

async fn run(handle: &EngineHandle, body: Value) -> (usize, Vec<Choice>) {
    let request = validate(handle, body);
    let search = request.beam_search.expect("a beam search");
    let (accepted, mut events) = handle.beam_search(request.items, search).await.unwrap();
    let mut choices = vec![Choice::default(); accepted.len()];
    while choices.iter().any(|c| c.reason.is_none()) {
        let EngineEvent {
            index,
            text,
            token_ids,
            logprobs,
            finish,
            ..
        } = events.recv().await.expect("every choice finishes");
        let choice = &mut choices[index];
        choice.tokens.extend(token_ids);
        choice.text.push_str(&text);
        choice.logprobs.extend(logprobs.map(|l| l.logprob));
        choice.reason = finish.map(|f| f.reason);
    }
    (accepted[0].prompt_tokens, choices)
}

/// Each token of `sequence` after the first `from`, scored by the model given the
/// tokens before it: the sequence run as one prompt.
async fn teacher_forced(handle: &EngineHandle, sequence: &[u32], from: usize) -> Vec<f32> {
    let request = validate(
        handle,
        json!({"prompt": sequence, "max_tokens": 1, "prompt_logprobs": 0}),
    );
    let mut item: GenerationItem = request.items.into_iter().next().unwrap();
    item.prompt = Arc::new(PromptInput::Tokens(sequence.to_vec()));
    let (_, mut events) = handle.add(vec![item]).await.unwrap();
    loop {
        let event = events.recv().await.expect("prompt logprobs");
        if let Some(rows) = event.prompt_logprobs {
            // Row `i` scores token `i + 1`.
            return rows.rows[from - 1..].iter().map(|r| r.logprob).collect();
        }
    }
}

fn score(cumulative: f32, length: usize, penalty: f32) -> f32 {
    cumulative / (length as f32).powf(penalty)
}

#[tokio::test(flavor = "current_thread")]
async fn beams_are_the_models_own_sequences_ranked_by_their_score() {
    let handle = start();
    let eos = handle.prompter().tokenizer().stop_ids().to_vec();
    let prompt_text = "The three most important inventions in history are";
    for penalty in [1.0f32, 0.0] {
        let (prompt_len, choices) = run(
            &handle,
            json!({"prompt": prompt_text, "max_tokens": 10, "n": 3, "use_beam_search": true,
                   "length_penalty": penalty, "logprobs": 0}),
        )
        .await;
        let prompt = handle
            .prompter()
            .tokenize(PromptInput::Text(prompt_text.into()), true, "prompt")
            .await
            .unwrap();
        assert_eq!(prompt.len(), prompt_len);
        let mut scores = Vec::new();
        for c in &choices {
            assert_eq!(c.logprobs.len(), c.tokens.len());
            let sequence: Vec<u32> = prompt.iter().chain(&c.tokens).copied().collect();
            let forced = teacher_forced(&handle, &sequence, prompt.len()).await;
            for (got, want) in c.logprobs.iter().zip(&forced) {
                assert!(
                    (got - want).abs() <= 2e-3 * want.abs().max(0.05),
                    "penalty {penalty}: {got} vs {want} in {:?}",
                    c.tokens
                );
            }
            let ended_by_eos = c.reason == Some(EndReason::Stop)
                && c.tokens.last().is_some_and(|t| eos.contains(t));
            let length = prompt.len() + c.tokens.len() - usize::from(ended_by_eos);
            scores.push(score(c.logprobs.iter().sum(), length, penalty));
            let text = handle
                .prompter()
                .tokenizer()
                .decode(&c.tokens, true)
                .unwrap();
            assert_eq!(c.text, text);
        }
        assert!(
            scores.windows(2).all(|w| w[0] >= w[1] - 1e-6),
            "ranked: {scores:?}"
        );
        let distinct: std::collections::HashSet<_> = choices.iter().map(|c| &c.tokens).collect();
        assert_eq!(distinct.len(), 3, "{choices:?}");
    }
    handle.shutdown();
}

#[tokio::test(flavor = "current_thread")]
async fn one_beam_is_greedy_decoding() {
    let handle = start();
    let prompt = "Once upon a time, in a small village,";
    let (_, beams) = run(
        &handle,
        json!({"prompt": prompt, "max_tokens": 12, "use_beam_search": true}),
    )
    .await;
    let request = validate(
        &handle,
        json!({"prompt": prompt, "max_tokens": 12, "temperature": 0}),
    );
    let (_, mut events) = handle.add(request.items).await.unwrap();
    let mut greedy = Vec::new();
    loop {
        let event = events.recv().await.unwrap();
        greedy.extend(event.token_ids);
        if event.finish.is_some() {
            break;
        }
    }
    assert_eq!(beams[0].tokens, greedy);
    handle.shutdown();
}

#[tokio::test(flavor = "current_thread")]
async fn prompts_search_apart_and_stop_strings_cut_the_text() {
    let handle = start();
    let prompts = ["The capital of France is", "My favourite colour is"];
    let body = |prompt: Value| json!({"prompt": prompt, "max_tokens": 8, "n": 2, "use_beam_search": true, "stop": ["."]});
    let (_, together) = run(&handle, body(json!(prompts))).await;
    assert_eq!(together.len(), 4);
    for (p, prompt) in prompts.iter().enumerate() {
        let (_, alone) = run(&handle, body(json!(prompt))).await;
        for (a, b) in alone.iter().zip(&together[2 * p..]) {
            assert_eq!(a.tokens, b.tokens, "{prompt}");
            assert_eq!(a.text, b.text);
        }
    }
    for c in &together {
        assert!(!c.text.contains('.'), "{:?}", c.text);
    }
    handle.shutdown();
}

#[tokio::test(flavor = "current_thread")]
async fn a_search_its_client_leaves_gives_every_block_back() {
    let handle = start();
    let request = validate(
        &handle,
        json!({"prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 400, "n": 4,
               "use_beam_search": true, "ignore_eos": true}),
    );
    let search = request.beam_search.unwrap();
    let (_, events) = handle.beam_search(request.items, search).await.unwrap();
    // Far from its end (400 steps of 4 beams), the client goes.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    drop(events);
    // The search stops within a step and aborts it.
    for _ in 0..100 {
        let idle = handle.stats().await.unwrap();
        if idle.num_requests_running == 0 && idle.num_requests_waiting == 0 {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            let idle = handle.stats().await.unwrap();
            assert_eq!(idle.num_requests_running + idle.num_requests_waiting, 0);
            assert_eq!(idle.kv_cache_free_blocks, idle.kv_cache_total_blocks);
            handle.shutdown();
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    panic!("the search went on after its client left");
}

/// Each step's beams take their parent step's partial last block whole: after the
/// first step, a beam computes only its new token.
#[tokio::test(flavor = "current_thread")]
async fn each_step_computes_only_the_new_tokens() {
    let handle = start();
    let prompt = "A quiet morning in the mountains, the air still cold,";
    let before = handle.stats().await.unwrap();
    let (prompt_len, beams) = run(
        &handle,
        json!({"prompt": prompt, "max_tokens": 20, "use_beam_search": true, "ignore_eos": true}),
    )
    .await;
    assert_eq!(beams[0].tokens.len(), 20);
    let after = handle.stats().await.unwrap();
    let queried = after.prefix_cache_queries - before.prefix_cache_queries;
    let hit = after.prefix_cache_hits - before.prefix_cache_hits;
    // The prompt once (a fresh cache), then one token per step after the first.
    assert_eq!(queried - hit, (prompt_len + 19) as u64);
    handle.shutdown();
}

/// On a model with a sliding-window group (a tiny Gemma 3, window 8, blocks of 4), the
/// kept tails give the same beams as computing every step's prompt again.
#[tokio::test(flavor = "current_thread")]
async fn kept_tails_give_the_beams_of_recomputing_on_a_sliding_window_model() {
    let beams_with = |prefix_caching: bool| async move {
        let (handle, _thread) =
            EngineHandle::start(move || -> Result<Engine, EngineBuildPanicked> {
                let config = EngineConfig {
                    block_size: 4,
                    enable_prefix_caching: prefix_caching,
                    ..common::f32_kv()
                };
                let (engine, dir) =
                    common::tiny_gemma3(2, candle_core::quantized::GgmlDType::F32, config);
                // The model is read: its file may go.
                drop(dir);
                Ok(engine)
            })
            .expect("the engine starts");
        let prompt: Vec<u32> = (0..11).map(|i| 40 + 7 * i).collect();
        let (_, beams) = run(
            &handle,
            json!({"prompt": prompt, "max_tokens": 24, "n": 3, "use_beam_search": true,
                   "ignore_eos": true, "logprobs": 0}),
        )
        .await;
        let stats = handle.stats().await.unwrap();
        assert_eq!(stats.kv_cache_free_blocks, stats.kv_cache_total_blocks);
        handle.shutdown();
        beams
    };
    let kept = beams_with(true).await;
    let recomputed = beams_with(false).await;
    for (a, b) in kept.iter().zip(&recomputed) {
        assert_eq!(a.tokens, b.tokens);
        let (sa, sb): (f32, f32) = (a.logprobs.iter().sum(), b.logprobs.iter().sum());
        assert!((sa - sb).abs() <= 1e-5 * sb.abs().max(1.0), "{sa} vs {sb}");
    }
}
