//! Prometheus metrics under vLLM's names (`vllm:` prefix, `model_name` label), so that
//! vLLM's Grafana dashboards and the routers that read vLLM's metrics (the Kubernetes
//! Gateway API Inference Extension, llm-d) work unchanged. Metrics vLLM does not have
//! (KV block counts, attention captures) keep lantern's own `lantern:` prefix.
//!
//! The exposition is written by the Prometheus project's client, `prometheus-client`
//! (OpenMetrics text, [`CONTENT_TYPE`]). Its metrics live behind atomics and its
//! families behind a lock, so the engine thread does not use them: it counts into
//! plain fields ([`EngineMetrics`], a [`Histogram`] is a bucket array), which costs a
//! few additions per step and takes no lock and no allocation. `/metrics` asks the
//! engine for a snapshot ([`EngineStats`]) and [`render`] builds a fresh registry from
//! it, per scrape: counters and gauges as prometheus-client's constant metrics,
//! labelled ones as its `Family`, and the histograms through its histogram encoding
//! (`EncodeMetric` for [`Histogram`]).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{
    EncodeGaugeValue, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};

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

/// The content type of [`render`]'s text: OpenMetrics, which prometheus-client writes
/// (Prometheus asks for it first and reads it; vLLM's routers parse it as text).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The engine's metrics, cumulative, as a histogram snapshot encodes them.
impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // Per-bucket counts; the encoder sums them up. `f64::MAX` is its `+Inf`.
        let buckets: Vec<(f64, u64)> = self
            .bounds
            .iter()
            .copied()
            .chain([f64::MAX])
            .zip(self.counts.iter().copied())
            .collect();
        encoder.encode_histogram::<NoLabelSet>(self.sum, self.count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FinishedReasonLabels {
    finished_reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheConfigLabels {
    block_size: usize,
    num_gpu_blocks: usize,
    num_cpu_blocks: usize,
    cache_dtype: &'static str,
    enable_prefix_caching: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LoraLabels {
    max_lora: usize,
    running_lora_adapters: &'static str,
    waiting_lora_adapters: &'static str,
}

/// A label value as the text format wants it (prometheus-client writes const label
/// values as they are).
fn escape_label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Registers metrics under their exposed names: the registry appends `_total` to a
/// counter's name and a full stop to every help text, so both are taken off here.
struct Metrics(Registry);

impl Metrics {
    fn new(model_name: &str) -> Self {
        Self(Registry::with_labels(std::iter::once((
            Cow::Borrowed("model_name"),
            Cow::Owned(escape_label(model_name)),
        ))))
    }

    fn register(&mut self, name: &str, help: &str, metric: impl Metric) {
        self.0
            .register(name, help.strip_suffix('.').unwrap_or(help), metric);
    }

    fn gauge<N>(&mut self, name: &str, help: &str, value: N)
    where
        N: EncodeGaugeValue + Send + Sync + std::fmt::Debug + 'static,
    {
        self.register(name, help, ConstGauge::new(value));
    }

    fn counter(&mut self, name: &str, help: &str, value: u64) {
        let family = name
            .strip_suffix("_total")
            .expect("a counter's name ends in _total");
        self.register(family, help, ConstCounter::new(value));
    }
}

/// Registers the engine's stats: vLLM's metrics, then lantern's KV block counts.
fn register_engine(x: &mut Metrics, stats: &EngineStats) {
    x.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        stats.num_requests_running as i64,
    );
    x.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        stats.num_requests_waiting as i64,
    );
    x.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        stats.kv_cache_usage,
    );
    let c = &stats.cache_config;
    let info = Family::<CacheConfigLabels, Gauge>::default();
    info.get_or_create(&CacheConfigLabels {
        block_size: c.block_size,
        num_gpu_blocks: c.num_gpu_blocks,
        num_cpu_blocks: 0,
        cache_dtype: c.cache_dtype,
        enable_prefix_caching: if c.enable_prefix_caching {
            "True"
        } else {
            "False"
        },
    })
    .set(1);
    x.register(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig.",
        info,
    );
    // No LoRA adapters: routers that look for adapters find none loaded.
    let lora = Family::<LoraLabels, Gauge>::default();
    lora.get_or_create(&LoraLabels {
        max_lora: 0,
        running_lora_adapters: "",
        waiting_lora_adapters: "",
    })
    .set(1);
    x.register(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        lora,
    );
    x.counter(
        "vllm:num_preemptions_total",
        "Cumulative number of preemptions from the engine.",
        stats.num_preemptions,
    );
    x.counter(
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        stats.prefix_cache_queries,
    );
    x.counter(
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        stats.prefix_cache_hits,
    );
    let m = &stats.metrics;
    x.counter(
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        m.prompt_tokens_total,
    );
    x.counter(
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        m.generation_tokens_total,
    );
    let success = Family::<FinishedReasonLabels, Counter>::default();
    for &(finished_reason, n) in &m.request_success_total {
        success
            .get_or_create(&FinishedReasonLabels { finished_reason })
            .inc_by(n);
    }
    x.register(
        "vllm:request_success",
        "Count of successfully processed requests.",
        success,
    );
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
        x.register(name, help, h.clone());
    }
    x.gauge(
        "lantern:kv_cache_free_blocks",
        "KV cache blocks free (cached prefix blocks nobody holds count as free).",
        stats.kv_cache_free_blocks as i64,
    );
    x.gauge(
        "lantern:kv_cache_total_blocks",
        "KV cache blocks in the pool.",
        stats.kv_cache_total_blocks as i64,
    );
    x.counter(
        "lantern:engine_faults_total",
        "Panics on the engine thread, contained: each failed the requests in flight and restarted the engine.",
        stats.engine_faults,
    );
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

/// Registers the capture metrics (lantern's own, so `lantern:`).
fn register_captures(x: &mut Metrics, stats: &CaptureStats) {
    x.counter(
        "lantern:attention_captures_total",
        "Attention captures delivered (inline, by reference or as a file).",
        stats.delivered,
    );
    x.counter(
        "lantern:attention_capture_failures_total",
        "Attention captures that could not be delivered (the text still was).",
        stats.failed,
    );
    x.gauge(
        "lantern:attention_captures_stored",
        "Attention captures stored for GET /v1/captures/{id}.",
        stats.stored as i64,
    );
    x.counter(
        "lantern:capture_worker_faults_total",
        "Panics on the capture worker, contained: each failed its capture only.",
        stats.panicked,
    );
}

/// `/metrics`: the engine's stats and the capture counts, every series labelled with
/// the model's name, in the OpenMetrics text format ([`CONTENT_TYPE`]).
pub fn render(stats: &EngineStats, captures: &CaptureStats, model_name: &str) -> String {
    let mut x = Metrics::new(model_name);
    register_engine(&mut x, stats);
    register_captures(&mut x, captures);
    let mut out = String::new();
    encode(&mut out, &x.0).expect("writing to a String does not fail");
    out
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

    fn render(stats: &EngineStats, model_name: &str) -> String {
        super::render(stats, &CaptureStats::default(), model_name)
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
        // OpenMetrics names a counter's family without `_total`; its series keep it.
        assert!(text.contains("# TYPE lantern:engine_faults counter\n"));
        assert!(text.contains("lantern:engine_faults_total{model_name=\"m\\\"x\"} 2\n"));
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn histograms_keep_vllms_buckets() {
        let text = render(&stats(), "m");
        let bounds = |name: &str| -> Vec<f64> {
            let prefix = format!("{name}_bucket{{");
            text.lines()
                .filter(|l| l.starts_with(&prefix))
                .map(|l| {
                    let le = l.split("le=\"").nth(1).unwrap().split('"').next().unwrap();
                    if le == "+Inf" {
                        f64::INFINITY
                    } else {
                        le.parse().unwrap()
                    }
                })
                .collect()
        };
        let with_inf =
            |b: &[f64]| -> Vec<f64> { b.iter().copied().chain([f64::INFINITY]).collect() };
        assert_eq!(
            bounds("vllm:time_to_first_token_seconds"),
            with_inf(TTFT_BUCKETS)
        );
        assert_eq!(
            bounds("vllm:inter_token_latency_seconds"),
            with_inf(ITL_BUCKETS)
        );
        assert_eq!(
            bounds("vllm:e2e_request_latency_seconds"),
            with_inf(REQUEST_LATENCY_BUCKETS)
        );
        assert_eq!(
            bounds("vllm:request_prompt_tokens"),
            with_inf(&buckets_1_2_5(2048))
        );
        assert_eq!(
            bounds("vllm:iteration_tokens_total"),
            with_inf(&[1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0])
        );
    }

    /// Every series name the hand-written exposition had (taken from a running server's
    /// `/metrics` before prometheus-client wrote it).
    const NAMES_BEFORE: &[&str] = &[
        "lantern:attention_capture_failures_total",
        "lantern:attention_captures_stored",
        "lantern:attention_captures_total",
        "lantern:capture_worker_faults_total",
        "lantern:engine_faults_total",
        "lantern:kv_cache_free_blocks",
        "lantern:kv_cache_total_blocks",
        "vllm:cache_config_info",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_sum",
        "vllm:generation_tokens_total",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:inter_token_latency_seconds_count",
        "vllm:inter_token_latency_seconds_sum",
        "vllm:iteration_tokens_total_bucket",
        "vllm:iteration_tokens_total_count",
        "vllm:iteration_tokens_total_sum",
        "vllm:kv_cache_usage_perc",
        "vllm:lora_requests_info",
        "vllm:num_preemptions_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prompt_tokens_total",
        "vllm:request_decode_time_seconds_bucket",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_decode_time_seconds_sum",
        "vllm:request_generation_tokens_bucket",
        "vllm:request_generation_tokens_count",
        "vllm:request_generation_tokens_sum",
        "vllm:request_inference_time_seconds_bucket",
        "vllm:request_inference_time_seconds_count",
        "vllm:request_inference_time_seconds_sum",
        "vllm:request_max_num_generation_tokens_bucket",
        "vllm:request_max_num_generation_tokens_count",
        "vllm:request_max_num_generation_tokens_sum",
        "vllm:request_params_max_tokens_bucket",
        "vllm:request_params_max_tokens_count",
        "vllm:request_params_max_tokens_sum",
        "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_prompt_tokens_bucket",
        "vllm:request_prompt_tokens_count",
        "vllm:request_prompt_tokens_sum",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:request_queue_time_seconds_count",
        "vllm:request_queue_time_seconds_sum",
        "vllm:request_success_total",
        "vllm:request_time_per_output_token_seconds_bucket",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:request_time_per_output_token_seconds_sum",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_count",
        "vllm:time_per_output_token_seconds_sum",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_to_first_token_seconds_sum",
    ];

    #[test]
    fn every_name_of_the_old_exposition_is_still_exposed() {
        let text = render(&stats(), "m");
        let names: std::collections::BTreeSet<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split(['{', ' ']).next().unwrap())
            .collect();
        let before: std::collections::BTreeSet<&str> = NAMES_BEFORE.iter().copied().collect();
        assert_eq!(names, before);
        // Each series carries the model's name, `request_success_total` every reason.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            assert!(line.contains("{model_name=\"m\""), "{line}");
        }
        for reason in ["stop", "length", "abort", "error"] {
            assert!(text.contains(&format!(
                "vllm:request_success_total{{model_name=\"m\",finished_reason=\"{reason}\"}} 0\n"
            )));
        }
        assert!(text.contains(
            "vllm:lora_requests_info{model_name=\"m\",max_lora=\"0\",running_lora_adapters=\"\",waiting_lora_adapters=\"\"} 1\n"
        ));
        assert!(text
            .contains("# HELP vllm:request_success Count of successfully processed requests.\n"));
        assert!(text.contains(
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
        ));
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
