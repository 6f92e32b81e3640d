//! `max_waiting_requests`: a request whose sequences would take the waiting queue past
//! the limit gets a 429 with `Retry-After` before any work; one that fits runs.

mod common;

use lantern_engine::{Engine, EngineConfig};
use lantern_model::synthetic::TinyLlama;
use serde_json::{json, Value};

/// A server on the tiny synthetic model whose queue holds at most `limit` waiting
/// sequences; returns its address.
fn start_server(limit: usize) -> String {
    let path = std::env::temp_dir().join(format!("lantern-waiting-{}.gguf", std::process::id()));
    TinyLlama::default().write(&path).unwrap();
    common::spawn_server(
        move || {
            let loaded = lantern_model::load_model(&path, &Default::default());
            // Loaded (or not): the file is not needed again, and is not left behind.
            let _ = std::fs::remove_file(&path);
            let loaded = loaded?;
            let config = EngineConfig {
                kv_cache_memory: 16 << 20,
                max_waiting_requests: limit,
                ..EngineConfig::default()
            };
            Ok(Engine::new(loaded, config)?)
        },
        1,
    )
}

#[test]
fn more_waiting_sequences_than_the_limit_get_429_with_retry_after() {
    let base = start_server(3);
    let client = reqwest::blocking::Client::new();
    let post = |n: usize| {
        client
            .post(format!("{base}/v1/completions"))
            .json(&json!({"model": "tiny-llama", "prompt": "hello", "max_tokens": 2, "n": n}))
            .send()
            .unwrap()
    };
    // Four samples can never be waiting together under a limit of three.
    let refused = post(4);
    assert_eq!(refused.status(), 429);
    let retry_after = refused.headers().get("retry-after").cloned();
    let body: Value = refused.json().unwrap();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("--max-waiting-requests"), "{body}");
    assert!(retry_after.is_some(), "no Retry-After on a 429");
    // Three fit, and run.
    let ok = post(3);
    assert_eq!(ok.status(), 200);
    let body: Value = ok.json().unwrap();
    assert_eq!(body["choices"].as_array().map(Vec::len), Some(3), "{body}");
}
