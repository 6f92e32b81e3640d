//! The engine on its own OS thread, fed by a channel of commands.
//!
//! The engine is single-threaded (`&mut self`), so one thread owns it, and it only
//! steps: prompts arrive tokenized and checked ([`super::Prompter`], on request tasks),
//! and logprobs leave as ids and logits for the request tasks to turn into text. It drains
//! the command channel, runs a step while there is work, and sends each request's new
//! text to that request's event channel; when there is no work it blocks on the channel.
//! A request whose event channel is closed (its client went away) is aborted, so its KV
//! blocks are freed.
//!
//! A panic while the thread admits requests or steps is contained: every request in
//! flight ends with an internal-fault finish ([`EngineFailure::Fault`]; the server answers
//! a 500 or an error event on a stream), the engine's book-keeping starts over
//! ([`Engine::reset`]: no block in use, nothing waiting) and the thread goes on serving,
//! with [`EngineFaults::health`] `Degraded` until the engine has run
//! [`super::CLEAN_STEPS_TO_RECOVER`] steps without a panic. Only when the reset itself
//! fails does the thread end: the health is then `Stopped`, and every request is refused
//! ([`super::ServeError::Stopped`]).

use super::events::{EndReason, EngineEvent, EngineFailure, Finish, StopReason};
use super::generation::{Accepted, GenerationItem};
use super::handle::Command;
use super::health::{panic_message, EngineFaults};
use super::metrics::{CacheConfigInfo, EngineMetrics, EngineStats, FinishedRequest};
use super::prompter::{PreparedItem, PromptLogprobRows};
use super::request_log::{log_finished, EngineLogging, StatsLog};
use super::stop::StopMatcher;
use super::ServeError;
use crate::engine::SamplingFailure;
use crate::validate::InvalidRequest;
use crate::{Completion, Engine, EngineError, FinishReason, RequestOutput};
use lantern_kv::{KvDtype, RequestId};
use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tokio::sync::mpsc as tmpsc;

/// Book-keeping of one live sequence.
struct Live {
    index: usize,
    events: tmpsc::UnboundedSender<EngineEvent>,
    stop: Option<StopMatcher>,
    stop_token_ids: Arc<[u32]>,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// `max_tokens` as settled against the context.
    max_tokens: usize,
    /// Stop strings are not matched in the text of the first `min_tokens` tokens.
    min_tokens: usize,
    request_id: Option<Arc<str>>,
    logged: bool,
    arrival: Instant,
    last_token: Option<Instant>,
    /// Alternatives per token and the prompt, while its prompt logprobs are still due.
    prompt_logprobs: Option<(usize, Arc<[u32]>)>,
}

/// A prepared item with its `max_tokens` settled: the item, its prompt ids, its echo text.
type Settled = (GenerationItem, Arc<[u32]>, Option<Arc<str>>);

pub(super) struct EngineLoop {
    engine: Engine,
    rx: mpsc::Receiver<Command>,
    live: HashMap<RequestId, Live>,
    metrics: EngineMetrics,
    shutting_down: bool,
    busy: Arc<AtomicBool>,
    log_requests: bool,
    stats_log: Option<StatsLog>,
    faults: Arc<EngineFaults>,
    /// A panic could not be recovered from: the thread ends.
    broken: bool,
}

impl EngineLoop {
    pub(super) fn new(
        engine: Engine,
        rx: mpsc::Receiver<Command>,
        busy: Arc<AtomicBool>,
        logging: EngineLogging,
        faults: Arc<EngineFaults>,
    ) -> Self {
        let metrics = EngineMetrics::new(
            engine.model_info().context_length,
            engine.config().max_num_batched_tokens,
        );
        Self {
            engine,
            rx,
            live: HashMap::new(),
            metrics,
            shutting_down: false,
            busy,
            log_requests: logging.requests,
            stats_log: logging.stats_interval.map(StatsLog::new),
            faults,
            broken: false,
        }
    }

    /// Waits for the next command while idle; when a stats line is still owed for the
    /// last work, only until it is due. `None`: every handle is gone.
    fn wait_idle(&mut self) -> Option<Option<Command>> {
        let m = &self.metrics;
        let owed = self
            .stats_log
            .as_ref()
            .filter(|log| log.has_unlogged_work(m.prompt_tokens_total, m.generation_tokens_total));
        match owed {
            Some(log) => match self.rx.recv_timeout(log.due_in()) {
                Ok(cmd) => Some(Some(cmd)),
                Err(mpsc::RecvTimeoutError::Timeout) => Some(None),
                Err(mpsc::RecvTimeoutError::Disconnected) => None,
            },
            None => self.rx.recv().ok().map(Some),
        }
    }

    fn log_stats(&mut self) {
        if let Some(mut log) = self.stats_log.take() {
            log.maybe_log(|| self.stats());
            self.stats_log = Some(log);
        }
    }

    pub(super) fn run(mut self) {
        loop {
            self.busy
                .store(self.engine.has_unfinished(), Ordering::Relaxed);
            if !self.engine.has_unfinished() {
                // Idle: sleep until a command arrives; every handle gone ends the thread.
                match self.wait_idle() {
                    Some(Some(cmd)) => self.handle_contained(cmd),
                    Some(None) => {}
                    None => break,
                }
            }
            // A broken engine takes no further command: the ones left are dropped with
            // the channel, so their senders learn the engine stopped.
            while !self.broken {
                let Ok(cmd) = self.rx.try_recv() else { break };
                self.handle_contained(cmd);
            }
            if self.shutting_down || self.broken {
                break;
            }
            if self.engine.has_unfinished() {
                if let Err(panic) = catch_unwind(AssertUnwindSafe(|| self.step_once())) {
                    self.recover(panic.as_ref());
                }
            }
            self.log_stats();
            if self.broken {
                break;
            }
        }
        if !self.broken {
            self.abort_all();
        }
    }

    /// One engine step, its outputs sent to their clients.
    fn step_once(&mut self) {
        let started = Instant::now();
        match self.engine.step() {
            Ok(outputs) => {
                let tokens = self.engine.last_step_tokens();
                if tokens > 0 {
                    self.metrics.iteration_tokens.observe(tokens as f64);
                    self.faults.step_succeeded();
                }
                if outputs.is_empty() && started.elapsed() < Duration::from_micros(50) {
                    // Nothing could be scheduled: wait for a command rather than
                    // spin (the scheduler should never get here).
                    if let Ok(cmd) = self.rx.recv_timeout(Duration::from_millis(1)) {
                        self.handle(cmd);
                    }
                }
                self.dispatch(outputs);
            }
            Err(e) => self.fail_all(&e),
        }
    }

    /// After a panic on this thread: every request in flight ends with an internal-fault
    /// error, and the engine starts over with no request and no block in use (its
    /// book-keeping may have been left half-updated). If starting over panics too, the
    /// thread ends and `/health` turns 503.
    fn recover(&mut self, panic: &(dyn std::any::Any + Send)) {
        let message = panic_message(panic);
        tracing::error!(
            panic = %message,
            requests = self.live.len(),
            "the engine thread panicked; ending the requests in flight and restarting the engine"
        );
        self.faults.record(&message);
        let live_requests = std::mem::take(&mut self.live);
        let restarted = catch_unwind(AssertUnwindSafe(|| self.engine.reset())).is_ok();
        if !restarted {
            tracing::error!("restarting the engine panicked too; the engine thread stops");
            self.faults.record_unrecoverable();
            self.broken = true;
        }
        for (id, live) in live_requests {
            let reason = EndReason::Failed(EngineFailure::Fault { restarted });
            // The engine's books are not trusted here: the times are the thread's own.
            self.record_finish(id, &live, None, reason.as_str());
            let _ = live.events.send(EngineEvent {
                index: live.index,
                text: String::new(),
                token_ids: Vec::new(),
                logprobs: None,
                prompt_logprobs: None,
                capture_row: None,
                finish: Some(Finish {
                    reason,
                    stop_reason: None,
                    prompt_tokens: live.prompt_tokens,
                    completion_tokens: live.completion_tokens,
                    cached_tokens: 0,
                    capture: None,
                }),
            });
        }
    }

    /// [`Self::handle`], recovering from a panic in it.
    fn handle_contained(&mut self, cmd: Command) {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(|| self.handle(cmd))) {
            self.recover(panic.as_ref());
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Add {
                items,
                events,
                reply,
            } => match catch_unwind(AssertUnwindSafe(|| self.add(items, &events))) {
                Ok(result) => {
                    let _ = reply.send(result);
                }
                Err(panic) => {
                    self.recover(panic.as_ref());
                    let _ = reply.send(Err(ServeError::Fault {
                        restarted: !self.broken,
                    }));
                }
            },
            Command::Abort(ids) => {
                for id in ids {
                    if let Some(live) = self.live.remove(&id) {
                        self.engine.abort(id);
                        self.finish_in_engine(id, &live, EndReason::Abort.as_str());
                    }
                }
            }
            Command::Stats(reply) => {
                let _ = reply.send(self.stats());
            }
            Command::Shutdown => self.shutting_down = true,
        }
    }

    fn stats(&self) -> EngineStats {
        let kv = self.engine.kv_cache();
        let prefix = self.engine.prefix_cache_stats();
        EngineStats {
            num_requests_running: self.engine.num_running(),
            num_requests_waiting: self.engine.num_waiting(),
            num_preemptions: self.engine.num_preemptions(),
            kv_cache_usage: kv.usage(),
            kv_cache_free_blocks: kv.num_free_blocks(),
            kv_cache_total_blocks: kv.num_blocks(),
            prefix_cache_queries: prefix.queries,
            prefix_cache_hits: prefix.hits,
            engine_faults: self.faults.count(),
            // The handle counts them.
            beam_searches_running: 0,
            cache_config: CacheConfigInfo {
                block_size: self.engine.config().block_size,
                num_gpu_blocks: kv.num_blocks(),
                cache_dtype: match self.engine.config().kv_cache_dtype {
                    KvDtype::F32 => "float32",
                    KvDtype::F16 => "float16",
                    KvDtype::BF16 => "bfloat16",
                },
                enable_prefix_caching: self.engine.config().enable_prefix_caching,
            },
            metrics: self.metrics.clone(),
        }
    }

    /// Refuses `new` more sequences with a 429 when they would take the waiting queue
    /// past `max_waiting_requests`, before any work is done for them.
    fn check_waiting_room(&self, new: usize) -> Result<(), ServeError> {
        waiting_room(
            self.engine.num_waiting(),
            new,
            self.engine.config().max_waiting_requests,
        )
    }

    /// Settles every item's `max_tokens`, then adds them all (or none).
    fn add(
        &mut self,
        items: Vec<PreparedItem>,
        events: &tmpsc::UnboundedSender<EngineEvent>,
    ) -> Result<Vec<Accepted>, ServeError> {
        if self.shutting_down {
            return Err(ServeError::Unavailable);
        }
        self.check_waiting_room(items.iter().map(|i| i.item.origin.waiting_weight()).sum())?;
        let mut prepared = Vec::with_capacity(items.len());
        for item in items {
            prepared.push(self.prepare(item)?);
        }
        let mut accepted: Vec<Accepted> = Vec::with_capacity(prepared.len());
        let now = Instant::now();
        let mut new_live = Vec::with_capacity(prepared.len());
        // The first sample of the current prompt, and that prompt (items come as `n`
        // consecutive samples of each prompt).
        let mut leader: Option<(RequestId, Arc<[u32]>)> = None;
        for (index, (mut item, prompt_ids, prompt_text)) in prepared.into_iter().enumerate() {
            // As vLLM: a stop token's text, as a stop string, only when asked for.
            item.params.stop_token_text = item.include_stop_str_in_output;
            let prompt_tokens = prompt_ids.len();
            let max_tokens = item.params.max_tokens;
            let min_tokens = item.params.min_tokens;
            let stop_token_ids = item.params.stop_token_ids.clone();
            let prompt_logprobs = item.prompt_logprobs.map(|k| (k, prompt_ids.clone()));
            let capture = item.capture.map(|c| c.spec);
            let constraint = item.constraint;
            let thinking = item.reasoning.is_some() && item.begins_thinking;
            // Samples of one prompt (n > 1) share its blocks: the first computes it,
            // the others follow it through the prefix cache. They also share the
            // leader's copy of the prompt ids.
            let sibling_of = leader
                .as_ref()
                .filter(|(_, p)| Arc::ptr_eq(p, &prompt_ids) || **p == *prompt_ids)
                .map(|(id, p)| (*id, p.clone()));
            let new_leader_prompt = sibling_of.is_none().then(|| prompt_ids.clone());
            let added = match (sibling_of, capture) {
                (Some((leader, prompt)), None) => {
                    self.engine.add_sibling_request(leader, prompt, item.params)
                }
                (_, capture) => {
                    self.engine
                        .add_request_with_capture(prompt_ids, item.params, capture)
                }
            };
            match added {
                Ok(id) => {
                    match (constraint, &item.reasoning) {
                        (Some(c), Some(tags)) if thinking => {
                            self.engine.constrain_after(id, c, tags.end.clone())
                        }
                        (Some(c), _) => self.engine.constrain(id, c),
                        (None, _) => {}
                    }
                    if let Some(prompt) = new_leader_prompt {
                        leader = Some((id, prompt));
                    }
                    accepted.push(Accepted {
                        id,
                        prompt_tokens,
                        prompt_text,
                        thinking,
                    });
                    new_live.push((
                        id,
                        Live {
                            index,
                            events: events.clone(),
                            stop: StopMatcher::new(&item.stop, item.include_stop_str_in_output),
                            stop_token_ids,
                            prompt_tokens,
                            completion_tokens: 0,
                            max_tokens,
                            min_tokens,
                            request_id: item.request_id.clone(),
                            logged: item.origin.logged(),
                            arrival: now,
                            last_token: None,
                            prompt_logprobs,
                        },
                    ));
                }
                Err(e) => {
                    for a in &accepted {
                        self.engine.abort(a.id);
                        let _ = self.engine.take_completion(a.id);
                    }
                    return Err(ServeError::from(e).for_prompt_field(item.prompt_field));
                }
            }
        }
        for (id, live) in new_live {
            self.metrics.prompt_tokens_total += live.prompt_tokens as u64;
            self.live.insert(id, live);
        }
        Ok(accepted)
    }

    /// Settles one prepared item's `max_tokens` against the context and the KV cache,
    /// and checks its capture's size.
    fn prepare(&self, prepared: PreparedItem) -> Result<Settled, ServeError> {
        let PreparedItem {
            mut item,
            prompt_ids: ids,
            echo_text,
        } = prepared;
        let context = self.engine.model_info().context_length;
        let longest = self.engine.kv_cache().longest_sequence(context);
        let max_tokens = item.settled_max_tokens(ids.len(), context, longest)?;
        let max_tokens = match &item.capture {
            Some(capture) => {
                let geometry = lantern_capture::CaptureGeometry::of_layers(
                    &capture.spec,
                    &self.engine.model_info().attention,
                );
                // Unasked, generation stops where the capture would outgrow the cap.
                let max_tokens = match item.max_tokens {
                    Some(m) if !item.max_tokens_defaulted => m,
                    _ => crate::validate::capture::max_tokens_within(
                        capture,
                        ids.len(),
                        max_tokens,
                        geometry,
                    )
                    .unwrap_or(max_tokens.min(1)),
                };
                crate::validate::capture::check_capture(capture, ids.len(), max_tokens, geometry)?;
                max_tokens
            }
            None => max_tokens,
        };
        if item.params.min_tokens > max_tokens {
            return Err(InvalidRequest::conflict(
                "min_tokens",
                format!(
                    "min_tokens is {}, but at most {max_tokens} tokens can be generated for this prompt",
                    item.params.min_tokens
                ),
            )
            .into());
        }
        item.params.max_tokens = max_tokens;
        Ok((item, ids, echo_text))
    }

    /// Sends each request's new output to its client.
    fn dispatch(&mut self, outputs: Vec<RequestOutput>) {
        let now = Instant::now();
        for mut out in outputs {
            let Some(live) = self.live.get_mut(&out.id) else {
                // Aborted while its step ran.
                continue;
            };
            if !out.new_token_ids.is_empty() {
                match live.last_token {
                    None => self
                        .metrics
                        .time_to_first_token
                        .observe(now.duration_since(live.arrival).as_secs_f64()),
                    Some(last) => self
                        .metrics
                        .inter_token_latency
                        .observe(now.duration_since(last).as_secs_f64()),
                }
                live.last_token = Some(now);
                live.completion_tokens += out.new_token_ids.len();
                self.metrics.generation_tokens_total += out.new_token_ids.len() as u64;
            }
            let (mut text, matched) = match &mut live.stop {
                Some(stop) if live.completion_tokens <= live.min_tokens => {
                    (stop.pass(&out.new_text), None)
                }
                Some(stop) => {
                    let o = stop.push(&out.new_text);
                    (o.text, o.matched)
                }
                None => (out.new_text, None),
            };
            let finish = if let Some(stop) = matched {
                // The stop string ends it; the engine has not finished it yet.
                self.engine.finish_early(out.id, FinishReason::Stop);
                Some((EndReason::Stop, Some(StopReason::Text(stop))))
            } else if let Some(failure) = out.sampling_failure.take() {
                let failure = match failure {
                    SamplingFailure::Guided(error) => EngineFailure::Guided(error),
                    SamplingFailure::NoTokenLeft(field) => EngineFailure::NoTokenLeft(field),
                };
                Some((EndReason::Failed(failure), None))
            } else if let Some(reason) = out.finished {
                if let Some(stop) = &mut live.stop {
                    text.push_str(&stop.flush());
                }
                let stop_reason = match reason {
                    FinishReason::Stop => out
                        .new_token_ids
                        .last()
                        .filter(|t| live.stop_token_ids.contains(t))
                        .map(|&t| StopReason::Token(t)),
                    _ => None,
                };
                Some((EndReason::from(reason), stop_reason))
            } else {
                None
            };
            let id = out.id;
            // Every prompt row is in once the first token is sampled; the request task
            // turns the token ids into text.
            let mut prompt_logprobs = None;
            if live.prompt_logprobs.is_some() {
                if let Some(rows) = self.engine.take_prompt_logprobs(id) {
                    prompt_logprobs = live
                        .prompt_logprobs
                        .take()
                        .map(|(top, prompt)| PromptLogprobRows { rows, prompt, top });
                }
            }
            let event = EngineEvent {
                index: live.index,
                text,
                token_ids: out.new_token_ids,
                logprobs: out.logprobs,
                prompt_logprobs,
                capture_row: out.capture_row,
                finish: None,
            };
            match finish {
                None => {
                    if live.events.send(event).is_err() {
                        // The client is gone: free its blocks now.
                        if let Some(live) = self.live.remove(&id) {
                            self.engine.abort(id);
                            self.finish_in_engine(id, &live, EndReason::Abort.as_str());
                        }
                    }
                }
                Some((reason, stop_reason)) => {
                    let Some(live) = self.live.remove(&id) else {
                        continue;
                    };
                    let completion = self.engine.take_completion(id);
                    self.record_finish(id, &live, completion.as_ref(), reason.as_str());
                    let finish = Finish {
                        reason,
                        stop_reason,
                        prompt_tokens: live.prompt_tokens,
                        completion_tokens: completion
                            .as_ref()
                            .map_or(live.completion_tokens, |c| c.token_ids.len()),
                        cached_tokens: completion
                            .as_ref()
                            .map_or(0, |c| c.num_cached_prompt_tokens),
                        capture: completion.and_then(|c| c.capture),
                    };
                    let _ = live.events.send(EngineEvent {
                        finish: Some(finish),
                        ..event
                    });
                }
            }
        }
    }

    /// Takes an aborted request out of the engine and counts it.
    fn finish_in_engine(&mut self, id: RequestId, live: &Live, reason: &'static str) {
        let completion = self.engine.take_completion(id);
        self.record_finish(id, live, completion.as_ref(), reason);
    }

    /// Counts a finished sequence into the metrics. The engine's completion has its
    /// phases; without one (it never reached the engine's books) the times are the
    /// engine thread's own.
    fn record_finish(
        &mut self,
        id: RequestId,
        live: &Live,
        completion: Option<&Completion>,
        reason: &'static str,
    ) {
        let total = live.arrival.elapsed();
        let finished = match completion {
            Some(c) => FinishedRequest {
                id,
                reason,
                prompt_tokens: live.prompt_tokens,
                generation_tokens: c.token_ids.len(),
                max_tokens: live.max_tokens,
                queue: c.queue_time,
                ttft: (!c.token_ids.is_empty()).then_some(c.time_to_first_token),
                prefill: c.prefill_time,
                decode: c.decode_time,
                total: c.total_time,
            },
            None => FinishedRequest {
                id,
                reason,
                prompt_tokens: live.prompt_tokens,
                generation_tokens: live.completion_tokens,
                max_tokens: live.max_tokens,
                queue: total,
                ttft: None,
                prefill: Duration::ZERO,
                decode: Duration::ZERO,
                total,
            },
        };
        self.metrics.observe_finished(&finished);
        if self.log_requests && live.logged {
            let cached = completion.map_or(0, |c| c.num_cached_prompt_tokens);
            log_finished(live.request_id.as_deref(), live.index, &finished, cached);
        }
    }

    /// A step failed: every live request ends with the error.
    fn fail_all(&mut self, error: &EngineError) {
        tracing::error!(%error, "engine step failed; aborting every running request");
        self.end_all(EndReason::Failed(EngineFailure::Step(error.to_string())));
    }

    fn abort_all(&mut self) {
        self.end_all(EndReason::Abort);
    }

    fn end_all(&mut self, reason: EndReason) {
        for (id, live) in std::mem::take(&mut self.live) {
            self.engine.abort(id);
            let completion = self.engine.take_completion(id);
            self.record_finish(id, &live, completion.as_ref(), reason.as_str());
            let mut text = String::new();
            if let Some(mut stop) = live.stop {
                text = stop.flush();
            }
            let _ = live.events.send(EngineEvent {
                index: live.index,
                text,
                token_ids: Vec::new(),
                logprobs: None,
                prompt_logprobs: None,
                capture_row: None,
                finish: Some(Finish {
                    reason: reason.clone(),
                    stop_reason: None,
                    prompt_tokens: live.prompt_tokens,
                    completion_tokens: completion
                        .as_ref()
                        .map_or(live.completion_tokens, |c| c.token_ids.len()),
                    cached_tokens: completion.map_or(0, |c| c.num_cached_prompt_tokens),
                    capture: None,
                }),
            });
        }
    }
}

/// Whether `new` more sequences fit a waiting queue of `waiting` under `limit`. Items that
/// add none (a beam search's later steps, counted when the search was taken) always fit,
/// even where those steps have taken the queue past the limit.
fn waiting_room(waiting: usize, new: usize, limit: usize) -> Result<(), ServeError> {
    if new > 0 && waiting.saturating_add(new) > limit {
        return Err(ServeError::TooManyWaiting {
            waiting,
            new,
            limit,
        });
    }
    Ok(())
}

#[cfg(test)]
mod waiting_room_tests {
    use super::*;

    #[test]
    fn sequences_fit_up_to_the_limit_and_steps_always_fit() {
        assert!(waiting_room(1, 1, 2).is_ok());
        assert!(waiting_room(2, 1, 2).is_err());
        assert!(waiting_room(0, 4, 2).is_err(), "a search of 4 beams");
        // A beam search's steps (which add none) once they fill the queue past the limit.
        assert!(waiting_room(3, 0, 2).is_ok());
        assert!(waiting_room(3, 1, 2).is_err());
    }
}
