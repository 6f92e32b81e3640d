//! Prometheus metrics under vLLM's names (`vllm:` prefix, `model_name` label), so that
//! vLLM's Grafana dashboards and the routers that read vLLM's metrics (the Kubernetes
//! Gateway API Inference Extension, llm-d) work unchanged. Metrics vLLM does not have
//! (KV block counts, attention captures) keep lantern's own `lantern:` prefix.
//!
//! The exposition is written by the Prometheus project's client, `prometheus-client`
//! (OpenMetrics text, [`CONTENT_TYPE`]). Its metrics live behind atomics and its
//! families behind a lock, so the engine thread does not use them: it counts into
//! plain fields (`lantern_engine::serving::metrics`), which costs a few additions per
//! step and takes no lock and no allocation. `/metrics` asks the engine for a snapshot
//! ([`EngineStats`]) and [`render`] builds a fresh registry from it, per scrape:
//! counters and gauges as prometheus-client's constant metrics, labelled ones as its
//! `Family`, and the histograms through its histogram encoding (`HistogramMetric`).

use std::borrow::Cow;

pub use lantern_engine::serving::metrics::{
    CacheConfigInfo, EngineMetrics, EngineStats, FinishedRequest, Histogram,
};

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{
    EncodeGaugeValue, EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};

/// The content type of [`render`]'s text: OpenMetrics, which prometheus-client writes
/// (Prometheus asks for it first and reads it; vLLM's routers parse it as text).
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One of the engine's histograms, as prometheus-client encodes a histogram snapshot.
#[derive(Debug)]
struct HistogramMetric(Histogram);

impl EncodeMetric for HistogramMetric {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        // Per-bucket counts; the encoder sums them up. `f64::MAX` is its `+Inf`.
        let h = &self.0;
        let buckets: Vec<(f64, u64)> = h
            .bounds()
            .iter()
            .copied()
            .chain([f64::MAX])
            .zip(h.counts().iter().copied())
            .collect();
        encoder.encode_histogram::<NoLabelSet>(h.sum(), h.count(), &buckets, None)
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
        x.register(name, help, HistogramMetric(h.clone()));
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
    x.gauge(
        "lantern:beam_searches_running",
        "Beam searches in progress (each step's requests count as running only while the step runs).",
        stats.beam_searches_running as i64,
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
    use lantern_engine::serving::metrics::{
        buckets_1_2_5, ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS,
    };

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
            beam_searches_running: 1,
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
        assert!(text.contains("lantern:beam_searches_running{model_name=\"m\\\"x\"} 1\n"));
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

    /// Series added after the exposition moved to prometheus-client.
    const NAMES_ADDED: &[&str] = &["lantern:beam_searches_running"];

    #[test]
    fn every_name_of_the_old_exposition_is_still_exposed() {
        let text = render(&stats(), "m");
        let names: std::collections::BTreeSet<&str> = text
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| l.split(['{', ' ']).next().unwrap())
            .collect();
        // ... and the series added since.
        let expected: std::collections::BTreeSet<&str> =
            NAMES_BEFORE.iter().chain(NAMES_ADDED).copied().collect();
        assert_eq!(names, expected);
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
}
