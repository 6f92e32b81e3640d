//! The engine thread only steps: a 15 MiB prompt and a chat template that loops
//! forever (as a malicious model file could carry) are handled on request tasks and
//! refused there, while a running stream keeps its pace and a 1-token request is served.
//! Bounds are generous (seconds against steps of milliseconds): before, either prompt
//! held the engine thread for seconds, the template for ever.

mod common;

use lantern_engine::{Engine, EngineConfig};
use lantern_model::ChatTemplate;
use reqwest::blocking::Client;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::time::{Duration, Instant};

/// Renders nothing, for ever (10^12 iterations); only its fuel stops it.
const ENDLESS_TEMPLATE: &str =
    "{% for a in range(10000) %}{% for b in range(10000) %}{% for c in range(10000) %}{% endfor %}{% endfor %}{% endfor %}";

fn start() -> String {
    let path = lantern_model::default_model::ensure_default_model().unwrap();
    common::spawn_server(
        move || {
            let mut loaded =
                lantern_model::load_model(&path, &lantern_model::LoadOptions::default())?;
            loaded.chat_template = Some(ChatTemplate::new(ENDLESS_TEMPLATE, "", "")?);
            let config = EngineConfig {
                kv_cache_memory: 64 << 20,
                ..EngineConfig::default()
            };
            Ok(Engine::new(loaded, config)?)
        },
        2,
    )
}

fn client() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap()
}

#[test]
fn huge_prompts_and_endless_templates_do_not_stall_other_requests() {
    let base = start();
    // A stream whose token arrival times show whether the engine kept stepping.
    let stream_base = base.clone();
    let (times_tx, times_rx) = std::sync::mpsc::channel::<Instant>();
    let streamer = std::thread::spawn(move || {
        let r = client()
            .post(format!("{stream_base}/v1/completions"))
            .json(
                &json!({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": true,
                           "temperature": 0, "stream": true}),
            )
            .send()
            .unwrap();
        assert_eq!(r.status(), 200);
        for line in BufReader::new(r).lines() {
            let line = line.unwrap();
            if line == "data: [DONE]" {
                break;
            }
            if line.starts_with("data: ") {
                times_tx.send(Instant::now()).unwrap();
            }
        }
    });
    let mut times = Vec::new();
    while times.len() < 20 {
        times.push(times_rx.recv().unwrap());
    }
    let hostile_start = Instant::now();
    let huge_base = base.clone();
    let huge = std::thread::spawn(move || {
        let prompt = "lorem ipsum ".repeat((15 << 20) / 12);
        let r = client()
            .post(format!("{huge_base}/v1/completions"))
            .json(&json!({"prompt": prompt, "max_tokens": 1}))
            .send()
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().unwrap())
    });
    let chat_base = base.clone();
    let chat = std::thread::spawn(move || {
        let r = client()
            .post(format!("{chat_base}/v1/chat/completions"))
            .json(&json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}))
            .send()
            .unwrap();
        (r.status().as_u16(), r.json::<Value>().unwrap())
    });
    // A 1-token request in the middle of it all.
    let one_started = Instant::now();
    let one: Value = client()
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": "The sky is", "max_tokens": 1}))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let one_took = one_started.elapsed();
    assert_eq!(one["usage"]["completion_tokens"], 1, "{one}");
    let (status, body) = huge.join().unwrap();
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "prompt", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("context"),
        "{body}"
    );
    let (status, body) = chat.join().unwrap();
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "messages", "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("chat template"),
        "{body}"
    );
    let hostile_end = Instant::now();
    streamer.join().unwrap();
    times.extend(times_rx.try_iter());
    let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
    let mut before: Vec<Duration> = gaps[..19].to_vec();
    before.sort();
    let step = before[before.len() / 2];
    // The largest gap between two tokens while the hostile requests were in flight.
    let worst = times
        .windows(2)
        .filter(|w| w[1] >= hostile_start && w[0] <= hostile_end)
        .map(|w| w[1] - w[0])
        .max()
        .unwrap_or_default();
    let bound = Duration::from_secs(3).max(step * 30);
    assert!(
        worst < bound,
        "the stream stalled for {worst:?} (a step takes about {step:?})"
    );
    assert!(one_took < bound, "the 1-token request took {one_took:?}");
    eprintln!(
        "step ≈ {step:?}; worst gap while hostile {worst:?}; 1-token request {one_took:?}; hostile phase {:?}",
        hostile_end - hostile_start
    );
}
