//! What the engine thread says about its work, as vLLM does: one line per finished
//! request (target `lantern::requests`) and, while busy, a periodic stats line with
//! throughput, queue and KV cache use (target `lantern::stats`). Both at `info`.

use crate::serving::metrics::{EngineStats, FinishedRequest};
use std::time::{Duration, Instant};

/// Default time between two stats lines (vLLM's).
pub const DEFAULT_STATS_INTERVAL: Duration = Duration::from_secs(10);

/// Which lines the engine thread writes.
#[derive(Debug, Clone, Copy, Default)]
pub struct EngineLogging {
    /// One line per finished request.
    pub requests: bool,
    /// A stats line this often while there is work; `None`: never.
    pub stats_interval: Option<Duration>,
}

/// Logs one finished sequence. `id` is the response's id when the server gave one.
pub fn log_finished(id: Option<&str>, choice: usize, r: &FinishedRequest, cached: usize) {
    let secs = |d: Duration| format!("{:.3}", d.as_secs_f64());
    let ttft = r.ttft.map_or_else(|| "-".to_string(), secs);
    tracing::info!(
        target: "lantern::requests",
        "finished request {} choice {choice}: {}, prompt {} tokens ({cached} cached), generated {} tokens, queue {} s, ttft {ttft} s, total {} s",
        id.unwrap_or("-"),
        r.reason,
        r.prompt_tokens,
        r.generation_tokens,
        secs(r.queue),
        secs(r.total),
    );
}

/// The counters at the last stats line, to turn into rates at the next.
#[derive(Debug)]
pub struct StatsLog {
    interval: Duration,
    last: Instant,
    prompt_tokens: u64,
    generation_tokens: u64,
    prefix_queries: u64,
    prefix_hits: u64,
}

impl StatsLog {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            last: Instant::now(),
            prompt_tokens: 0,
            generation_tokens: 0,
            prefix_queries: 0,
            prefix_hits: 0,
        }
    }

    /// Time left before the next line is due.
    pub fn due_in(&self) -> Duration {
        self.interval.saturating_sub(self.last.elapsed())
    }

    /// Whether tokens were counted since the last line (so a line is owed).
    pub fn has_unlogged_work(&self, prompt_tokens: u64, generation_tokens: u64) -> bool {
        prompt_tokens != self.prompt_tokens || generation_tokens != self.generation_tokens
    }

    /// Writes a line when one is due and there was work since the last.
    pub fn maybe_log(&mut self, stats: impl FnOnce() -> EngineStats) {
        let elapsed = self.last.elapsed();
        if elapsed < self.interval {
            return;
        }
        let s = stats();
        let m = &s.metrics;
        let busy = s.num_requests_running + s.num_requests_waiting > 0;
        if !busy && !self.has_unlogged_work(m.prompt_tokens_total, m.generation_tokens_total) {
            self.last = Instant::now();
            return;
        }
        let per_s =
            |now: u64, before: u64| now.saturating_sub(before) as f64 / elapsed.as_secs_f64();
        let queries = s.prefix_cache_queries.saturating_sub(self.prefix_queries);
        let hits = s.prefix_cache_hits.saturating_sub(self.prefix_hits);
        let hit_rate = if queries > 0 {
            100.0 * hits as f64 / queries as f64
        } else {
            0.0
        };
        tracing::info!(
            target: "lantern::stats",
            "Avg prompt throughput: {:.1} tokens/s, Avg generation throughput: {:.1} tokens/s, Running: {} reqs, Waiting: {} reqs, KV cache usage: {:.1}%, Prefix cache hit rate: {:.1}%",
            per_s(m.prompt_tokens_total, self.prompt_tokens),
            per_s(m.generation_tokens_total, self.generation_tokens),
            s.num_requests_running,
            s.num_requests_waiting,
            100.0 * s.kv_cache_usage,
            hit_rate,
        );
        self.last = Instant::now();
        self.prompt_tokens = m.prompt_tokens_total;
        self.generation_tokens = m.generation_tokens_total;
        self.prefix_queries = s.prefix_cache_queries;
        self.prefix_hits = s.prefix_cache_hits;
    }
}
