//! A panic on the engine thread is contained: the requests in flight end with a 500 (a
//! stream with an error event) that says an internal engine fault occurred, the engine
//! starts over with every KV block free, `/health` says `degraded`, and later requests
//! run as on a fresh engine. Faults are raised through the engine's test-only fault plan.

mod common;

use lantern_engine::{Engine, EngineConfig};
use lantern_model::synthetic::TinyLlama;
use reqwest::blocking::Client;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};

/// A server on the tiny synthetic model that panics where `faults` says.
fn start(faults: &str) -> String {
    let path = std::env::temp_dir().join(format!(
        "lantern-faults-{}-{}.gguf",
        std::process::id(),
        faults.replace([':', ','], "-")
    ));
    TinyLlama::default().write(&path).unwrap();
    let plan = faults.parse().unwrap();
    common::spawn_server(
        move || {
            let loaded = lantern_model::load_model(&path, &Default::default());
            // Loaded (or not): the file is not needed again, and is not left behind.
            let _ = std::fs::remove_file(&path);
            let loaded = loaded?;
            let config = EngineConfig {
                kv_cache_memory: 16 << 20,
                ..EngineConfig::default()
            };
            let mut engine = Engine::new(loaded, config)?;
            engine.set_fault_plan(plan);
            Ok(engine)
        },
        2,
    )
}

fn greedy(max_tokens: usize) -> Value {
    json!({"model": "tiny-llama", "prompt": "hello there", "max_tokens": max_tokens,
           "temperature": 0, "ignore_eos": true})
}

fn post(client: &Client, base: &str, body: &Value) -> (u16, Value) {
    let r = client
        .post(format!("{base}/v1/completions"))
        .json(body)
        .send()
        .unwrap();
    (r.status().as_u16(), r.json().unwrap())
}

/// `(running, waiting, kv usage)` from `/metrics`.
fn engine_load(client: &Client, base: &str) -> (f64, f64, f64) {
    let text = client
        .get(format!("{base}/metrics"))
        .send()
        .unwrap()
        .text()
        .unwrap();
    let value = |name: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(&format!("{name}{{")))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics:\n{text}"))
    };
    (
        value("vllm:num_requests_running"),
        value("vllm:num_requests_waiting"),
        value("vllm:kv_cache_usage_perc"),
    )
}

fn health(client: &Client, base: &str) -> (u16, Value) {
    let r = client.get(format!("{base}/health")).send().unwrap();
    (r.status().as_u16(), r.json().unwrap())
}

#[test]
fn a_panicking_step_fails_the_requests_in_flight_and_the_engine_restarts_clean() {
    // Steps 1-2: the first request; steps 3-4: the stream's first tokens; step 5 panics.
    let base = start("panic-at-step:5");
    let client = Client::new();
    let (status, before) = post(&client, &base, &greedy(2));
    assert_eq!(status, 200, "{before}");
    assert_eq!(health(&client, &base), (200, json!({"status": "ok"})));

    let mut stream_body = greedy(20);
    stream_body["stream"] = json!(true);
    let r = client
        .post(format!("{base}/v1/completions"))
        .json(&stream_body)
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let events: Vec<Value> = BufReader::new(r)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .take_while(|d| d != "[DONE]")
        .map(|d| serde_json::from_str(&d).unwrap())
        .collect();
    let last = events.last().expect("the stream sent nothing");
    assert_eq!(last["error"]["code"], "engine_fault", "{events:?}");
    assert_eq!(last["error"]["type"], "server_error");
    assert!(
        last["error"]["message"]
            .as_str()
            .unwrap()
            .contains("internal engine fault"),
        "{last}"
    );
    assert!(
        events.iter().any(|e| e.get("choices").is_some()),
        "the fault came before any token: {events:?}"
    );

    // Nothing runs and no block is held; health says what happened.
    assert_eq!(engine_load(&client, &base), (0.0, 0.0, 0.0));
    let (status, body) = health(&client, &base);
    assert_eq!(status, 200);
    assert_eq!(body["status"], "degraded", "{body}");
    assert_eq!(body["engine_faults"], 1);
    assert!(body["last_engine_fault"]
        .as_str()
        .unwrap()
        .contains("injected fault"));

    // The engine serves on, and gives what it gave before the fault.
    let (status, after) = post(&client, &base, &greedy(2));
    assert_eq!(status, 200, "{after}");
    assert_eq!(after["choices"][0]["text"], before["choices"][0]["text"]);
    assert_eq!(engine_load(&client, &base), (0.0, 0.0, 0.0));
}

#[test]
fn a_panic_while_admitting_is_a_500_for_that_request_only() {
    let base = start("panic-at-admission:2");
    let client = Client::new();
    let (status, first) = post(&client, &base, &greedy(3));
    assert_eq!(status, 200, "{first}");
    let (status, body) = post(&client, &base, &greedy(3));
    assert_eq!(status, 500, "{body}");
    assert_eq!(body["error"]["code"], "engine_fault");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("internal engine fault"));
    let (status, third) = post(&client, &base, &greedy(3));
    assert_eq!(status, 200, "{third}");
    assert_eq!(third["choices"][0]["text"], first["choices"][0]["text"]);
    assert_eq!(engine_load(&client, &base), (0.0, 0.0, 0.0));
    assert_eq!(health(&client, &base).1["engine_faults"], 1);
}

#[test]
fn a_panic_while_restarting_stops_the_engine_and_everything_answers_503() {
    let base = start("panic-at-step:3,panic-at-reset:1");
    let client = Client::new();
    let (status, body) = post(&client, &base, &greedy(20));
    assert_eq!(status, 500, "{body}");
    assert_eq!(body["error"]["code"], "engine_fault");
    assert_eq!(body["error"]["type"], "server_error");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("could not restart"),
        "{body}"
    );

    let (status, body) = health(&client, &base);
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "engine_stopped");

    // Later requests, whole or streamed, get the same 503 at once rather than hang.
    let started = std::time::Instant::now();
    let mut stream_body = greedy(4);
    stream_body["stream"] = json!(true);
    for request in [greedy(4), stream_body] {
        let (status, body) = post(&client, &base, &request);
        assert_eq!(status, 503, "{body}");
        assert_eq!(body["error"]["code"], "engine_stopped");
        assert!(body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("restart the server"));
    }
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    let metrics = client.get(format!("{base}/metrics")).send().unwrap();
    assert_eq!(metrics.status().as_u16(), 503);
}
