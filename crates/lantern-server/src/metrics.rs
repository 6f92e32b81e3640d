//! Prometheus metrics under vLLM's names (`vllm:` prefix, `model_name` label), so that
//! vLLM's Grafana dashboards and the routers that read vLLM's metrics (the Kubernetes
//! Gateway API Inference Extension, llm-d) work unchanged. Metrics vLLM does not have
//! (KV block counts, attention captures) keep lantern's own `lantern:` prefix.

use std::fmt::Write;
use std::sync::Arc;
use std::time::Duration;

/// vLLM's buckets for time to first token (seconds).
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for the time between two tokens of one request (seconds).
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's buckets for a request's phases: end to end, queue, prefill, decode, inference
/// (seconds).
pub const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's buckets for the tokens of one engine step, cut at the step's token budget.
const ITERATION_TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];

/// vLLM's 1-2-5 buckets up to `max` (token counts per request): 1, 2, 5, 10, 20, 50, ...
pub fn buckets_1_2_5(max: usize) -> Vec<f64> {
    let mut buckets = Vec::new();
    let mut exponent = 1usize;
    'outer: loop {
        for m in [1, 2, 5] {
            let value = m * exponent;
            if value > max {
                break 'outer;
            }
            buckets.push(value as f64);
        }
        exponent = match exponent.checked_mul(10) {
            Some(e) => e,
            None => break,
        };
    }
    buckets
}

/// A cumulative Prometheus histogram.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: Arc<[f64]>,
    /// Observations per bucket (not cumulative); the last is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &[f64]) -> Self {
        Self {
            bounds: bounds.into(),
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, value: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += value;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }
}

/// One finished sequence, as the metrics and the request log see it.
#[derive(Debug, Clone)]
pub struct FinishedRequest {
    pub id: u64,
    /// `stop`, `length`, `abort` or `error`.
    pub reason: &'static str,
    pub prompt_tokens: usize,
    pub generation_tokens: usize,
    /// The request's `max_tokens` as settled against the context.
    pub max_tokens: usize,
    /// Arrival to first scheduled.
    pub queue: Duration,
    /// Arrival to first token (`None`: it produced none).
    pub ttft: Option<Duration>,
    /// First scheduled to first token.
    pub prefill: Duration,
    /// First token to finish.
    pub decode: Duration,
    /// Arrival to finish.
    pub total: Duration,
}

/// Counters and histograms kept by the engine thread.
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Finished requests by finish reason (`stop`, `length`, `abort`, `error`).
    pub request_success_total: Vec<(&'static str, u64)>,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub time_per_output_token: Histogram,
    pub e2e_request_latency: Histogram,
    pub queue_time: Histogram,
    pub prefill_time: Histogram,
    pub decode_time: Histogram,
    pub inference_time: Histogram,
    pub prompt_tokens: Histogram,
    pub generation_tokens: Histogram,
    pub max_num_generation_tokens: Histogram,
    pub params_max_tokens: Histogram,
    pub iteration_tokens: Histogram,
}

impl EngineMetrics {
    /// Token histograms reach `max_model_len` (per request) and `max_num_batched_tokens`
    /// (per step), as vLLM's do.
    pub fn new(max_model_len: usize, max_num_batched_tokens: usize) -> Self {
        let per_request = buckets_1_2_5(max_model_len.max(1));
        let per_step: Vec<f64> = ITERATION_TOKEN_BUCKETS
            .iter()
            .copied()
            .filter(|&b| b <= max_num_batched_tokens.max(1) as f64)
            .collect();
        Self {
            prompt_tokens_total: 0,
            generation_tokens_total: 0,
            request_success_total: ["stop", "length", "abort", "error"]
                .iter()
                .map(|&r| (r, 0))
                .collect(),
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            inter_token_latency: Histogram::new(ITL_BUCKETS),
            time_per_output_token: Histogram::new(ITL_BUCKETS),
            e2e_request_latency: Histogram::new(REQUEST_LATENCY_BUCKETS),
            queue_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            prefill_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            decode_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            inference_time: Histogram::new(REQUEST_LATENCY_BUCKETS),
            prompt_tokens: Histogram::new(&per_request),
            generation_tokens: Histogram::new(&per_request),
            max_num_generation_tokens: Histogram::new(&per_request),
            params_max_tokens: Histogram::new(&per_request),
            iteration_tokens: Histogram::new(&per_step),
        }
    }

    fn count_finished(&mut self, reason: &'static str) {
        match self
            .request_success_total
            .iter_mut()
            .find(|(r, _)| *r == reason)
        {
            Some((_, n)) => *n += 1,
            None => self.request_success_total.push((reason, 1)),
        }
    }

    /// Counts a finished sequence into the per-request histograms.
    pub fn observe_finished(&mut self, r: &FinishedRequest) {
        self.count_finished(r.reason);
        self.e2e_request_latency.observe(r.total.as_secs_f64());
        self.queue_time.observe(r.queue.as_secs_f64());
        self.prefill_time.observe(r.prefill.as_secs_f64());
        self.decode_time.observe(r.decode.as_secs_f64());
        self.inference_time
            .observe((r.prefill + r.decode).as_secs_f64());
        self.prompt_tokens.observe(r.prompt_tokens as f64);
        self.generation_tokens.observe(r.generation_tokens as f64);
        self.max_num_generation_tokens
            .observe(r.generation_tokens as f64);
        self.params_max_tokens.observe(r.max_tokens as f64);
        if r.generation_tokens > 1 {
            // vLLM: decode time over the tokens after the first.
            self.time_per_output_token
                .observe(r.decode.as_secs_f64() / (r.generation_tokens - 1) as f64);
        }
    }
}

/// How the KV cache is set up: vLLM's `cache_config_info`, whose `block_size` and
/// `num_gpu_blocks` labels routers read to know an engine's capacity.
#[derive(Debug, Clone, Default)]
pub struct CacheConfigInfo {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub cache_dtype: &'static str,
    pub enable_prefix_caching: bool,
}

/// A consistent view of the engine, taken between two steps.
#[derive(Debug, Clone)]
pub struct EngineStats {
    pub num_requests_running: usize,
    pub num_requests_waiting: usize,
    pub num_preemptions: u64,
    pub kv_cache_usage: f64,
    pub kv_cache_free_blocks: usize,
    pub kv_cache_total_blocks: usize,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Panics the engine thread contained.
    pub engine_faults: u64,
    pub cache_config: CacheConfigInfo,
    pub metrics: EngineMetrics,
}

fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn format_value(v: f64) -> String {
    if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.to_string()
    } else {
        format!("{v}")
    }
}

/// Writes metrics in Prometheus' text exposition format (version 0.0.4), every series
/// labelled with the model's name.
struct Exposition {
    out: String,
    model_label: String,
}

impl Exposition {
    fn new(model_name: &str) -> Self {
        Self {
            out: String::new(),
            model_label: format!("model_name=\"{}\"", escape_label(model_name)),
        }
    }

    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}");
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn series(&mut self, name: &str, extra: &[(&str, String)], value: f64) {
        let mut labels = self.model_label.clone();
        for (key, v) in extra {
            let _ = write!(labels, ",{key}=\"{}\"", escape_label(v));
        }
        let _ = writeln!(self.out, "{name}{{{labels}}} {}", format_value(value));
    }

    fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.header(name, "gauge", help);
        self.series(name, &[], value);
    }

    fn counter(&mut self, name: &str, help: &str, value: f64) {
        self.header(name, "counter", help);
        self.series(name, &[], value);
    }

    fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, "histogram", help);
        let mut cumulative = 0;
        for (i, n) in h.counts.iter().enumerate() {
            cumulative += n;
            let le = h.bounds.get(i).copied().unwrap_or(f64::INFINITY);
            self.series(
                &format!("{name}_bucket"),
                &[("le", format_value(le))],
                cumulative as f64,
            );
        }
        self.series(&format!("{name}_sum"), &[], h.sum);
        self.series(&format!("{name}_count"), &[], h.count as f64);
    }
}

/// Renders the engine's stats: vLLM's metrics, then lantern's KV block counts.
pub fn render(stats: &EngineStats, model_name: &str) -> String {
    let mut x = Exposition::new(model_name);
    x.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        stats.num_requests_running as f64,
    );
    x.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        stats.num_requests_waiting as f64,
    );
    x.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        stats.kv_cache_usage,
    );
    let c = &stats.cache_config;
    x.header(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig.",
    );
    x.series(
        "vllm:cache_config_info",
        &[
            ("block_size", c.block_size.to_string()),
            ("num_gpu_blocks", c.num_gpu_blocks.to_string()),
            ("num_cpu_blocks", "0".to_string()),
            ("cache_dtype", c.cache_dtype.to_string()),
            (
                "enable_prefix_caching",
                if c.enable_prefix_caching {
                    "True"
                } else {
                    "False"
                }
                .to_string(),
            ),
        ],
        1.0,
    );
    // No LoRA adapters: routers that look for adapters find none loaded.
    x.header(
        "vllm:lora_requests_info",
        "gauge",
        "Running stats on lora requests.",
    );
    x.series(
        "vllm:lora_requests_info",
        &[
            ("max_lora", "0".to_string()),
            ("running_lora_adapters", String::new()),
            ("waiting_lora_adapters", String::new()),
        ],
        1.0,
    );
    x.counter(
        "vllm:num_preemptions_total",
        "Cumulative number of preemptions from the engine.",
        stats.num_preemptions as f64,
    );
    x.counter(
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        stats.prefix_cache_queries as f64,
    );
    x.counter(
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        stats.prefix_cache_hits as f64,
    );
    let m = &stats.metrics;
    x.counter(
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        m.prompt_tokens_total as f64,
    );
    x.counter(
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        m.generation_tokens_total as f64,
    );
    x.header(
        "vllm:request_success_total",
        "counter",
        "Count of successfully processed requests.",
    );
    for (reason, n) in &m.request_success_total {
        x.series(
            "vllm:request_success_total",
            &[("finished_reason", reason.to_string())],
            *n as f64,
        );
    }
    for (name, help, h) in [
        (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            &m.time_to_first_token,
        ),
        (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            &m.inter_token_latency,
        ),
        (
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (same as inter_token_latency_seconds).",
            &m.inter_token_latency,
        ),
        (
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            &m.time_per_output_token,
        ),
        (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            &m.e2e_request_latency,
        ),
        (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            &m.queue_time,
        ),
        (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            &m.inference_time,
        ),
        (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            &m.prefill_time,
        ),
        (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            &m.decode_time,
        ),
        (
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            &m.prompt_tokens,
        ),
        (
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            &m.generation_tokens,
        ),
        (
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            &m.max_num_generation_tokens,
        ),
        (
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            &m.params_max_tokens,
        ),
        (
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            &m.iteration_tokens,
        ),
    ] {
        x.histogram(name, help, h);
    }
    x.gauge(
        "lantern:kv_cache_free_blocks",
        "KV cache blocks free (cached prefix blocks nobody holds count as free).",
        stats.kv_cache_free_blocks as f64,
    );
    x.gauge(
        "lantern:kv_cache_total_blocks",
        "KV cache blocks in the pool.",
        stats.kv_cache_total_blocks as f64,
    );
    x.counter(
        "lantern:engine_faults_total",
        "Panics on the engine thread, contained: each failed the requests in flight and restarted the engine.",
        stats.engine_faults as f64,
    );
    x.out
}

/// Attention captures delivered, failed and stored, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CaptureStats {
    pub delivered: u64,
    pub failed: u64,
    /// Failed captures whose finalizing panicked on the capture worker (contained).
    pub panicked: u64,
    /// Captures held for `GET /v1/captures/{id}` (expired ones excluded).
    pub stored: usize,
}

/// The capture metrics (lantern's own, so `lantern:`).
pub fn render_captures(stats: &CaptureStats, model_name: &str) -> String {
    let mut x = Exposition::new(model_name);
    x.counter(
        "lantern:attention_captures_total",
        "Attention captures delivered (inline, by reference or as a file).",
        stats.delivered as f64,
    );
    x.counter(
        "lantern:attention_capture_failures_total",
        "Attention captures that could not be delivered (the text still was).",
        stats.failed as f64,
    );
    x.gauge(
        "lantern:attention_captures_stored",
        "Attention captures stored for GET /v1/captures/{id}.",
        stats.stored as f64,
    );
    x.counter(
        "lantern:capture_worker_faults_total",
        "Panics on the capture worker, contained: each failed its capture only.",
        stats.panicked as f64,
    );
    x.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats() -> EngineStats {
        EngineStats {
            num_requests_running: 1,
            num_requests_waiting: 2,
            num_preemptions: 3,
            kv_cache_usage: 0.25,
            kv_cache_free_blocks: 30,
            kv_cache_total_blocks: 40,
            prefix_cache_queries: 100,
            prefix_cache_hits: 64,
            engine_faults: 2,
            cache_config: CacheConfigInfo {
                block_size: 16,
                num_gpu_blocks: 40,
                cache_dtype: "float32",
                enable_prefix_caching: true,
            },
            metrics: EngineMetrics::new(2048, 512),
        }
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut stats = stats();
        stats.metrics.time_to_first_token.observe(0.003);
        stats.metrics.time_to_first_token.observe(0.5);
        stats.metrics.time_to_first_token.observe(5000.0);
        let text = render(&stats, "m\"x");
        assert!(text.contains("vllm:num_requests_running{model_name=\"m\\\"x\"} 1\n"));
        assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"m\\\"x\"} 0.25\n"));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\\\"x\",le=\"0.001\"} 0\n"
        ));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\\\"x\",le=\"0.005\"} 1\n"
        ));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\\\"x\",le=\"0.5\"} 2\n"
        ));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_bucket{model_name=\"m\\\"x\",le=\"+Inf\"} 3\n"
        ));
        assert!(text.contains("vllm:time_to_first_token_seconds_count{model_name=\"m\\\"x\"} 3\n"));
        assert!(text.contains("# TYPE vllm:e2e_request_latency_seconds histogram\n"));
        assert!(text.contains("lantern:kv_cache_total_blocks{model_name=\"m\\\"x\"} 40\n"));
        assert!(text.contains("# TYPE lantern:engine_faults_total counter\n"));
        assert!(text.contains("lantern:engine_faults_total{model_name=\"m\\\"x\"} 2\n"));
    }

    #[test]
    fn cache_config_info_carries_the_labels_routers_read() {
        let text = render(&stats(), "m");
        let line = text
            .lines()
            .find(|l| l.starts_with("vllm:cache_config_info{"))
            .expect("cache_config_info");
        for label in [
            "block_size=\"16\"",
            "num_gpu_blocks=\"40\"",
            "cache_dtype=\"float32\"",
            "enable_prefix_caching=\"True\"",
        ] {
            assert!(line.contains(label), "{line}");
        }
        assert!(line.ends_with("} 1"), "{line}");
    }

    #[test]
    fn a_finished_request_moves_every_request_histogram() {
        let mut m = EngineMetrics::new(2048, 512);
        m.observe_finished(&FinishedRequest {
            id: 7,
            reason: "length",
            prompt_tokens: 12,
            generation_tokens: 5,
            max_tokens: 5,
            queue: Duration::from_millis(10),
            ttft: Some(Duration::from_millis(50)),
            prefill: Duration::from_millis(40),
            decode: Duration::from_millis(80),
            total: Duration::from_millis(130),
        });
        for h in [
            &m.e2e_request_latency,
            &m.queue_time,
            &m.prefill_time,
            &m.decode_time,
            &m.inference_time,
            &m.prompt_tokens,
            &m.generation_tokens,
            &m.params_max_tokens,
            &m.time_per_output_token,
        ] {
            assert_eq!(h.count(), 1);
        }
        assert!((m.time_per_output_token.sum - 0.02).abs() < 1e-9);
        assert!((m.inference_time.sum - 0.12).abs() < 1e-9);
        assert_eq!(
            m.request_success_total
                .iter()
                .find(|(r, _)| *r == "length")
                .map(|r| r.1),
            Some(1)
        );
    }

    #[test]
    fn token_buckets_follow_vllm() {
        assert_eq!(
            buckets_1_2_5(100),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]
        );
        assert_eq!(buckets_1_2_5(1), vec![1.0]);
        let m = EngineMetrics::new(8192, 512);
        assert_eq!(m.iteration_tokens.bounds.last(), Some(&512.0));
    }
}
