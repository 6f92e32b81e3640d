//! The engine thread's events, made ready for Python off the GIL: logprobs with their
//! tokens' text, prompt logprobs resolved, and a finished request's capture finalized
//! (the maps computed on the blocking pool, as the server's capture worker does).

use lantern_engine::lantern_capture::{CaptureFailure, CaptureResult, PendingCapture};
use lantern_engine::serving::Prompter;
use lantern_engine::serving::{
    guided_failure_message, no_token_left_message, EndReason, EngineEvent, EngineFailure,
    PromptLogprobEntry, StopReason,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

/// One generated token's logprob and its alternatives: (id, text, logprob).
pub struct TokenLogprob {
    pub token_id: u32,
    pub token: String,
    pub logprob: f32,
    pub rank: usize,
    pub top: Vec<(u32, String, f32)>,
}

/// How a sequence ended.
pub struct Finished {
    /// `stop`, `length`, `abort` or `error`.
    pub reason: &'static str,
    /// The stop string or stop token id that ended it.
    pub stop_reason: Option<StopReason>,
    pub cached_tokens: usize,
    /// Why the engine failed it (reason `error`).
    pub error: Option<String>,
    /// Its capture, finalized; `Err` says why there is none.
    pub capture: Option<Result<CaptureResult, String>>,
}

/// New output of one sequence of prompt `prompt` of a batch.
pub struct Ready {
    pub prompt: usize,
    /// The sample (`n`) it belongs to.
    pub index: usize,
    pub text: String,
    pub token_ids: Vec<u32>,
    pub logprobs: Option<Vec<TokenLogprob>>,
    pub prompt_logprobs: Option<Vec<PromptLogprobEntry>>,
    /// A streamed capture's live figures of the row that sampled the new token, as the
    /// JSON of the HTTP chunk's `attn_capture_row`.
    pub capture_row: Option<String>,
    pub finished: Option<Finished>,
    /// Unix time in seconds when it arrived.
    pub time: f64,
}

pub fn unix_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn failure_message(failure: &EngineFailure) -> String {
    match failure {
        EngineFailure::Step(message) => format!("the engine failed: {message}"),
        EngineFailure::Guided(message) => guided_failure_message(message),
        EngineFailure::NoTokenLeft(field) => no_token_left_message(field),
        EngineFailure::Fault { .. } => lantern_engine::serving::ENGINE_FAULT_MESSAGE
            .replace("see the server log", "see the log"),
    }
}

/// Finalizes a finished request's capture on the cores the engine leaves idle: all of
/// them when no request is running (`busy` unset).
async fn finalize(
    pending: Option<Result<PendingCapture, CaptureFailure>>,
    busy: &AtomicBool,
) -> Result<CaptureResult, String> {
    let pending = pending
        .ok_or("the request ended without a capture")?
        .map_err(|e| e.to_string())?;
    let threads = if busy.load(Ordering::Relaxed) {
        pending.finalize_threads
    } else {
        lantern_engine::host_threads::idle_finalize_threads()
    };
    tokio::task::spawn_blocking(move || pending.into_result(threads, || {}))
        .await
        .map_err(|e| format!("finalizing the capture failed: {e}"))?
        .map_err(|e| e.to_string())
}

async fn ready(
    prompter: &Prompter,
    busy: &AtomicBool,
    prompt: usize,
    captures: bool,
    event: EngineEvent,
) -> Ready {
    let text_of = |t: u32| prompter.tokenizer().token_text(t);
    let logprobs = event.logprobs.map(|lp| {
        vec![TokenLogprob {
            token_id: lp.token_id,
            token: text_of(lp.token_id),
            logprob: lp.logprob,
            rank: lp.rank,
            top: lp.top.iter().map(|&(t, l)| (t, text_of(t), l)).collect(),
        }]
    });
    let prompt_logprobs = match event.prompt_logprobs {
        // An error here only loses the tables' text (the blocking pool is gone).
        Some(rows) => prompter.prompt_logprobs(rows).await.ok(),
        None => None,
    };
    let finished = match event.finish {
        Some(finish) => {
            let error = match &finish.reason {
                EndReason::Failed(failure) => Some(failure_message(failure)),
                _ => None,
            };
            let capture = match (&finish.reason, captures) {
                (EndReason::Stop | EndReason::Length, true) => {
                    Some(finalize(finish.capture, busy).await)
                }
                _ => None,
            };
            Some(Finished {
                reason: finish.reason.as_str(),
                stop_reason: finish.stop_reason,
                cached_tokens: finish.cached_tokens,
                error,
                capture,
            })
        }
        None => None,
    };
    Ready {
        prompt,
        index: event.index,
        text: event.text,
        token_ids: event.token_ids,
        logprobs,
        prompt_logprobs,
        capture_row: event
            .capture_row
            .and_then(|row| serde_json::to_string(&row).ok()),
        finished,
        time: unix_time(),
    }
}

/// Forwards prompt `prompt`'s events, made ready, into a batch's one channel, until
/// the engine drops its side (every sequence finished or aborted). `captures`: the
/// request asked for a capture, which its end then carries (or says why not).
pub async fn forward(
    prompter: Prompter,
    busy: Arc<AtomicBool>,
    prompt: usize,
    captures: bool,
    mut events: UnboundedReceiver<EngineEvent>,
    out: UnboundedSender<Ready>,
) {
    while let Some(event) = events.recv().await {
        if out
            .send(ready(&prompter, &busy, prompt, captures, event).await)
            .is_err()
        {
            return;
        }
    }
}
