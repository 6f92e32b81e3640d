//! The engine's API as a front end drives it, with no server: a body validated once
//! into a typed request, submitted to the engine thread, its events read back, an abort
//! that gives every KV block back, and refusals that name their field.

mod common;

use lantern_engine::serving::{
    EndReason, EngineBuildPanicked, EngineEvent, EngineHandle, ServeError,
};
use lantern_engine::validate::{
    generation_request, CaptureSettings, Endpoint, GenerationRequest, InvalidRequest, ModelLimits,
    RequestContext,
};
use lantern_engine::{Engine, EngineConfig};
use serde_json::{json, Value};

fn start() -> EngineHandle {
    let (handle, _thread) = EngineHandle::start(|| -> Result<Engine, EngineBuildPanicked> {
        Ok(common::engine_with(EngineConfig::default()))
    })
    .expect("the engine starts");
    handle
}

/// Validates a completion body against the engine's model, capture enabled or not.
fn check(
    handle: &EngineHandle,
    capture_enabled: bool,
    body: &Value,
) -> Result<GenerationRequest, InvalidRequest> {
    let capture = CaptureSettings {
        enabled: capture_enabled,
        ..CaptureSettings::default()
    };
    let limits = ModelLimits {
        served_name: "m",
        aliases: &[],
    };
    let context = RequestContext::new(limits, &capture, handle.meta());
    generation_request(Endpoint::Completion, body, &context)
}

fn validate(handle: &EngineHandle, body: Value) -> GenerationRequest {
    check(handle, true, &body).expect("a valid body")
}

/// Every event of one request, until its finish (or the channel's end).
async fn drain(
    mut events: tokio::sync::mpsc::UnboundedReceiver<EngineEvent>,
) -> (Vec<u32>, Option<EndReason>) {
    let mut tokens = Vec::new();
    while let Some(event) = events.recv().await {
        tokens.extend(&event.token_ids);
        if let Some(finish) = event.finish {
            return (tokens, Some(finish.reason));
        }
    }
    (tokens, None)
}

/// The token ids of a validated request's first prompt.
async fn prompt_ids(handle: &EngineHandle, request: &GenerationRequest) -> Vec<u32> {
    handle
        .prompter()
        .tokenize((*request.items[0].prompt).clone(), true, "prompt")
        .await
        .unwrap()
}

/// The same greedy request run on an engine directly, step by step.
fn direct_greedy(prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let mut engine = common::engine_with(EngineConfig::default());
    let params = lantern_engine::SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..Default::default()
    };
    let id = engine.add_request(prompt.to_vec(), params).unwrap();
    while engine.has_unfinished() {
        engine.step().unwrap();
    }
    engine.take_completion(id).unwrap().token_ids
}

#[tokio::test(flavor = "current_thread")]
async fn a_validated_request_runs_as_on_the_engine_itself() {
    let handle = start();
    let request = validate(
        &handle,
        json!({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}),
    );
    assert!(request.capture.is_none());
    let prompt = prompt_ids(&handle, &request).await;
    let (accepted, events) = handle.add(request.items).await.unwrap();
    assert_eq!(accepted[0].prompt_tokens, prompt.len());
    let (tokens, reason) = drain(events).await;
    assert_eq!(reason, Some(EndReason::Length));
    assert_eq!(tokens, direct_greedy(&prompt, 8));
    handle.shutdown();
}

/// vLLM's `truncate_prompt_tokens`: the request runs on its prompt's last tokens, as a
/// request sending only those would; a capture (whose positions are the prompt's as
/// sent) refuses it.
#[tokio::test(flavor = "current_thread")]
async fn a_truncated_prompt_runs_as_its_last_tokens() {
    let handle = start();
    let text = "One, two, three, four, five, six, seven, eight, nine, ten";
    let prompt = handle
        .prompter()
        .tokenize(
            lantern_engine::serving::PromptInput::Text(text.into()),
            true,
            "prompt",
        )
        .await
        .unwrap();
    assert!(prompt.len() > 6);
    let request = validate(
        &handle,
        json!({"prompt": text, "max_tokens": 5, "temperature": 0, "truncate_prompt_tokens": 6, "echo": true}),
    );
    let (accepted, events) = handle.add(request.items).await.unwrap();
    assert_eq!(accepted[0].prompt_tokens, 6);
    let kept = &prompt[prompt.len() - 6..];
    let echoed = handle.prompter().detokenize(kept.to_vec()).await.unwrap();
    assert_eq!(accepted[0].prompt_text.as_deref(), Some(echoed.as_str()));
    let (tokens, _) = drain(events).await;
    assert_eq!(tokens, direct_greedy(kept, 5));
    let body = json!({"prompt": text, "truncate_prompt_tokens": 6, "attn_capture": true});
    let e = check(&handle, true, &body).unwrap_err();
    assert_eq!(e.field(), Some("truncate_prompt_tokens"));
    handle.shutdown();
}

#[tokio::test(flavor = "current_thread")]
async fn an_aborted_request_gives_every_kv_block_back() {
    let handle = start();
    let request = validate(
        &handle,
        json!({"prompt": "Count to one thousand: 1, 2, 3,", "max_tokens": 500, "ignore_eos": true}),
    );
    let (accepted, mut events) = handle.add(request.items).await.unwrap();
    let first = events.recv().await.expect("a first token");
    assert!(first.finish.is_none());
    let busy = handle.stats().await.unwrap();
    assert!(busy.kv_cache_free_blocks < busy.kv_cache_total_blocks);
    handle.abort(accepted.iter().map(|a| a.id).collect());
    // The engine drops the request's channel: no finish, and nothing after it.
    let (_, reason) = drain(events).await;
    assert_eq!(reason, None);
    let idle = handle.stats().await.unwrap();
    assert_eq!(idle.num_requests_running, 0);
    assert_eq!(idle.kv_cache_free_blocks, idle.kv_cache_total_blocks);
    handle.shutdown();
}

#[tokio::test(flavor = "current_thread")]
async fn refusals_name_their_field() {
    let handle = start();
    let refused = |body: Value| {
        check(&handle, false, &body)
            .expect_err("refused")
            .field()
            .map(str::to_string)
    };
    assert_eq!(
        refused(json!({"prompt": "x", "temperature": -1})).as_deref(),
        Some("temperature")
    );
    // Capture on an engine whose front end did not enable it.
    assert_eq!(
        refused(json!({"prompt": "x", "attn_capture": true})).as_deref(),
        Some("attn_capture")
    );
    // The prompt only, without a capture or echo, yields nothing.
    assert_eq!(
        refused(json!({"prompt": "x", "max_tokens": 0})).as_deref(),
        Some("max_tokens")
    );
    // A prompt longer than the context is refused by the engine, naming the prompt.
    let long = vec![1u32; handle.meta().context_length + 1];
    let request = validate(&handle, json!({"prompt": long, "max_tokens": 1}));
    match handle.add(request.items).await {
        Err(ServeError::Invalid(e)) => assert_eq!(e.field(), Some("prompt"), "{e}"),
        Err(other) => panic!("{other:?}"),
        Ok(_) => panic!("a prompt over the context was taken"),
    }
    handle.shutdown();
}

/// A reasoning model's structured output waits for its thinking to end: the grammar
/// applies from the token after the end tag, and an output whose prompt closed its
/// thinking is constrained from its first token. The end "tag" here is the token the
/// model writes first, so that the unconstrained thinking ends at once.
#[tokio::test(flavor = "current_thread")]
async fn structured_output_starts_after_thinking_ends() {
    use lantern_engine::reasoning::{ReasoningParser, ThinkTags};
    let handle = start();
    let prompt_text = "The capital of France is";
    let plain = validate(
        &handle,
        json!({"prompt": prompt_text, "max_tokens": 1, "temperature": 0}),
    );
    let (_, events) = handle.add(plain.items).await.unwrap();
    let first = drain(events).await.0[0];
    // A prompt that ends with neither tag: with deepseek_r1 the output begins thinking.
    let tags = ThinkTags::new(ReasoningParser::DeepseekR1, vec![first]);
    // A request for `prompt` guided by the regex `xyz`, read with `tags`.
    let run = |prompt: &'static str, tags: ThinkTags| {
        let handle = &handle;
        async move {
            let mut request = validate(
                handle,
                json!({"prompt": prompt, "max_tokens": 12, "temperature": 0, "guided_regex": "xyz"}),
            );
            let guide = request.guide.take().expect("a guide");
            let constraint =
                lantern_engine::validate::structured::compile(&handle.meta().guided, guide).await;
            request.items[0].constraint = Some(constraint.unwrap());
            request.items[0].reasoning = Some(std::sync::Arc::new(tags));
            let (accepted, events) = handle.add(request.items).await.unwrap();
            let (tokens, reason) = drain(events).await;
            (accepted[0].thinking, tokens, reason)
        }
    };
    let detokenize = |tokens: &[u32]| handle.prompter().detokenize(tokens.to_vec());

    let (thinking, tokens, reason) = run(prompt_text, tags.clone()).await;
    assert!(thinking);
    assert_eq!(tokens[0], first, "thinking is not constrained");
    assert_eq!(detokenize(&tokens[1..]).await.unwrap(), "xyz");
    assert_eq!(reason, Some(EndReason::Stop));

    // A prompt that ends by closing thinking: the grammar holds from the first token.
    let (thinking, tokens, _) = run("The capital of France is</think>\n", tags).await;
    assert!(!thinking);
    assert_eq!(detokenize(&tokens).await.unwrap(), "xyz");
    handle.shutdown();
}
