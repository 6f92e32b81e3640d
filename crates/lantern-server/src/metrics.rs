//! Prometheus metrics, named like vLLM's with the prefix `lantern:`.

use std::fmt::Write;

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
/// vLLM's buckets for a request's arrival-to-finish time (seconds).
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A cumulative Prometheus histogram.
#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative); the last is `+Inf`.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
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

/// Counters and histograms kept by the engine thread.
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    /// Finished requests by finish reason (`stop`, `length`, `abort`, `error`).
    pub request_success_total: Vec<(&'static str, u64)>,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub e2e_request_latency: Histogram,
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self {
            prompt_tokens_total: 0,
            generation_tokens_total: 0,
            request_success_total: ["stop", "length", "abort", "error"]
                .iter()
                .map(|&r| (r, 0))
                .collect(),
            time_to_first_token: Histogram::new(TTFT_BUCKETS),
            inter_token_latency: Histogram::new(ITL_BUCKETS),
            e2e_request_latency: Histogram::new(E2E_BUCKETS),
        }
    }
}

impl EngineMetrics {
    pub fn count_finished(&mut self, reason: &'static str) {
        match self
            .request_success_total
            .iter_mut()
            .find(|(r, _)| *r == reason)
        {
            Some((_, n)) => *n += 1,
            None => self.request_success_total.push((reason, 1)),
        }
    }
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

/// Renders the stats in Prometheus' text exposition format (version 0.0.4).
pub fn render(stats: &EngineStats, model_name: &str) -> String {
    let label = format!("model_name=\"{}\"", escape_label(model_name));
    let mut out = String::new();
    let mut scalar = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = writeln!(out, "# HELP lantern:{name} {help}");
        let _ = writeln!(out, "# TYPE lantern:{name} {kind}");
        let _ = writeln!(out, "lantern:{name}{{{label}}} {}", format_value(value));
    };
    scalar(
        "num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        stats.num_requests_running as f64,
    );
    scalar(
        "num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        stats.num_requests_waiting as f64,
    );
    scalar(
        "kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        stats.kv_cache_usage,
    );
    scalar(
        "kv_cache_free_blocks",
        "gauge",
        "KV cache blocks free (cached prefix blocks nobody holds count as free).",
        stats.kv_cache_free_blocks as f64,
    );
    scalar(
        "kv_cache_total_blocks",
        "gauge",
        "KV cache blocks in the pool.",
        stats.kv_cache_total_blocks as f64,
    );
    scalar(
        "num_preemptions_total",
        "counter",
        "Cumulative number of preemptions from the engine.",
        stats.num_preemptions as f64,
    );
    scalar(
        "prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        stats.prefix_cache_queries as f64,
    );
    scalar(
        "prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        stats.prefix_cache_hits as f64,
    );
    let m = &stats.metrics;
    scalar(
        "prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        m.prompt_tokens_total as f64,
    );
    scalar(
        "generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        m.generation_tokens_total as f64,
    );
    let _ = writeln!(
        out,
        "# HELP lantern:request_success_total Count of finished requests by finish reason."
    );
    let _ = writeln!(out, "# TYPE lantern:request_success_total counter");
    for (reason, n) in &m.request_success_total {
        let _ = writeln!(
            out,
            "lantern:request_success_total{{{label},finished_reason=\"{reason}\"}} {n}"
        );
    }
    let mut histogram = |name: &str, help: &str, h: &Histogram| {
        let _ = writeln!(out, "# HELP lantern:{name} {help}");
        let _ = writeln!(out, "# TYPE lantern:{name} histogram");
        let mut cumulative = 0;
        for (i, n) in h.counts.iter().enumerate() {
            cumulative += n;
            let le = h.bounds.get(i).copied().unwrap_or(f64::INFINITY);
            let _ = writeln!(
                out,
                "lantern:{name}_bucket{{{label},le=\"{}\"}} {cumulative}",
                format_value(le)
            );
        }
        let _ = writeln!(out, "lantern:{name}_sum{{{label}}} {}", format_value(h.sum));
        let _ = writeln!(out, "lantern:{name}_count{{{label}}} {}", h.count);
    };
    histogram(
        "time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &m.time_to_first_token,
    );
    histogram(
        "inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &m.inter_token_latency,
    );
    histogram(
        "e2e_request_latency_seconds",
        "Histogram of end to end request latency in seconds.",
        &m.e2e_request_latency,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut stats = EngineStats {
            num_requests_running: 1,
            num_requests_waiting: 2,
            num_preemptions: 3,
            kv_cache_usage: 0.25,
            kv_cache_free_blocks: 30,
            kv_cache_total_blocks: 40,
            prefix_cache_queries: 100,
            prefix_cache_hits: 64,
            metrics: EngineMetrics::default(),
        };
        stats.metrics.time_to_first_token.observe(0.003);
        stats.metrics.time_to_first_token.observe(0.5);
        stats.metrics.time_to_first_token.observe(5000.0);
        let text = render(&stats, "m\"x");
        assert!(text.contains("lantern:num_requests_running{model_name=\"m\\\"x\"} 1\n"));
        assert!(text.contains("lantern:kv_cache_usage_perc{model_name=\"m\\\"x\"} 0.25\n"));
        assert!(text.contains(
            "lantern:time_to_first_token_seconds_bucket{model_name=\"m\\\"x\",le=\"0.001\"} 0\n"
        ));
        assert!(text.contains(
            "lantern:time_to_first_token_seconds_bucket{model_name=\"m\\\"x\",le=\"0.005\"} 1\n"
        ));
        assert!(text.contains(
            "lantern:time_to_first_token_seconds_bucket{model_name=\"m\\\"x\",le=\"0.5\"} 2\n"
        ));
        assert!(text.contains(
            "lantern:time_to_first_token_seconds_bucket{model_name=\"m\\\"x\",le=\"+Inf\"} 3\n"
        ));
        assert!(
            text.contains("lantern:time_to_first_token_seconds_count{model_name=\"m\\\"x\"} 3\n")
        );
        assert!(text.contains("# TYPE lantern:e2e_request_latency_seconds histogram\n"));
    }
}

/// Attention captures delivered, failed and stored, for `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CaptureStats {
    pub delivered: u64,
    pub failed: u64,
    /// Captures held for `GET /v1/captures/{id}` (expired ones excluded).
    pub stored: usize,
}

/// The capture metrics in Prometheus text format.
pub fn render_captures(stats: &CaptureStats, model_name: &str) -> String {
    let label = format!("model_name=\"{}\"", escape_label(model_name));
    let mut out = String::new();
    for (name, kind, help, value) in [
        (
            "attention_captures_total",
            "counter",
            "Attention captures delivered (inline, by reference or as a file).",
            stats.delivered as f64,
        ),
        (
            "attention_capture_failures_total",
            "counter",
            "Attention captures that could not be delivered (the text still was).",
            stats.failed as f64,
        ),
        (
            "attention_captures_stored",
            "gauge",
            "Attention captures stored for GET /v1/captures/{id}.",
            stats.stored as f64,
        ),
    ] {
        let _ = writeln!(out, "# HELP lantern:{name} {help}");
        let _ = writeln!(out, "# TYPE lantern:{name} {kind}");
        let _ = writeln!(out, "lantern:{name}{{{label}}} {}", format_value(value));
    }
    out
}
