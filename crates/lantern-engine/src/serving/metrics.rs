//! The engine's metrics as plain counters and bucket arrays: the engine thread counts
//! into them each step (a few additions, no lock, no allocation), and a front end asks
//! for a snapshot ([`EngineStats`]) and exposes it (the server as Prometheus text under
//! vLLM's names and buckets). vLLM's bucket bounds are kept here so that every front end
//! reports the same histograms.

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
pub const ITERATION_TOKEN_BUCKETS: &[f64] = &[
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

    /// The sum of every observed value.
    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// The buckets' upper bounds, without `+Inf`.
    pub fn bounds(&self) -> &[f64] {
        &self.bounds
    }

    /// Observations per bucket, not cumulative; the last is the `+Inf` bucket.
    pub fn counts(&self) -> &[u64] {
        &self.counts
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
    /// Beam searches in progress (between two of its steps, a search has no request
    /// running).
    pub beam_searches_running: usize,
    pub cache_config: CacheConfigInfo,
    pub metrics: EngineMetrics,
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!((m.time_per_output_token.sum() - 0.02).abs() < 1e-9);
        assert!((m.inference_time.sum() - 0.12).abs() < 1e-9);
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
        assert_eq!(m.iteration_tokens.bounds().last(), Some(&512.0));
    }
}
