//! `lantern bench --capture`: what attention capture costs.
//!
//! - the aggregate decode rate of a batch with no capturing request, and with one of its
//!   requests capturing every layer (the Q-row copies ride along in each step);
//! - finalize time per layer and the memory a capture holds, against prompt length;
//! - the decode rate of a batch while another thread finalizes a large capture (what
//!   other requests lose while a capture is computed off the step loop);
//! - key statistics and span masses: a batch of `STATS_BATCH` requests each asking for
//!   key statistics (or span masses) of every layer, against the same requests without
//!   capture, with and without the time their figures take to finalize.

use crate::bench::{decode_params, decode_rate_with_capture, median, synthetic_prompt};
use anyhow::{Context, Result};
use lantern_engine::lantern_capture::{
    CaptureSpan, CaptureSpec, CaptureWorker, KeyStat, PendingCapture, RowSelection,
};
use lantern_engine::Engine;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Tokens each decode figure generates per request.
const DECODE_TOKENS: usize = 64;
/// Requests in the batch of the decode figures.
const BATCH: usize = 8;
/// Prompt length of the decode figures' requests.
const DECODE_PROMPT: usize = 128;

fn everything(engine: &Engine) -> CaptureSpec {
    let info = engine.model_info();
    CaptureSpec::everything(info.num_layers, info.attention[0].num_heads)
}

/// Aggregate tokens/s of `BATCH` requests, the first capturing with `capture`.
fn decode_rate(engine: &mut Engine, salt: &mut u64, capture: Option<CaptureSpec>) -> Result<f64> {
    let vocab = engine.model_info().vocab_size;
    let requests = (0..BATCH)
        .map(|i| {
            *salt += 1;
            let prompt = synthetic_prompt(DECODE_PROMPT, *salt, vocab);
            (prompt, if i == 0 { capture.clone() } else { None })
        })
        .collect();
    decode_rate_with_capture(engine, requests, DECODE_TOKENS)
}

/// Requests in the batch of the key statistics figures.
const STATS_BATCH: usize = 32;

/// Every key statistic of every layer over the generated rows, without maps: what an
/// eviction study asks of each request.
fn key_statistics(engine: &Engine) -> CaptureSpec {
    let mut spec = everything(engine);
    spec.rows = RowSelection::Generated;
    spec.stats = KeyStat::ALL.to_vec();
    spec.maps = false;
    spec
}

/// Passages of the prompt whose attention mass each generated row gives.
const SPANS: usize = 8;

/// The masses of `SPANS` passages of the prompt (`DECODE_PROMPT / (SPANS + 1)` tokens
/// each, after an instruction-sized gap, the rest after them outside every span) on
/// every layer, per KV head, over the generated rows, without maps: what a RAG
/// grounding study asks of each request.
fn span_masses(engine: &Engine) -> CaptureSpec {
    let mut spec = everything(engine);
    spec.rows = RowSelection::Generated;
    spec.maps = false;
    let len = DECODE_PROMPT / (SPANS + 1);
    spec.spans = (0..SPANS)
        .map(|i| CaptureSpan::tokens(format!("[{}]", i + 1), len * (i + 1)..len * (i + 2)))
        .collect();
    spec
}

/// Aggregate tokens/s of `STATS_BATCH` requests each capturing with `capture`: over the
/// decode steps alone (tokens sampled after every request has its first token), and
/// counting the time their captures then take to finalize on one thread, as the
/// server's capture worker does.
fn statistics_rates(
    engine: &mut Engine,
    salt: &mut u64,
    capture: Option<CaptureSpec>,
) -> Result<(f64, f64)> {
    let vocab = engine.model_info().vocab_size;
    let ids = (0..STATS_BATCH)
        .map(|_| {
            *salt += 1;
            let prompt = synthetic_prompt(DECODE_PROMPT, *salt, vocab);
            engine.add_request_with_capture(prompt, decode_params(DECODE_TOKENS), capture.clone())
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut started = std::collections::HashSet::new();
    let (mut decode_start, mut decoded) = (None, 0usize);
    while engine.has_unfinished() {
        let outputs = engine.step()?;
        match decode_start {
            Some(_) => decoded += outputs.len(),
            None => {
                started.extend(outputs.iter().map(|o| o.id));
                if started.len() == ids.len() {
                    decode_start = Some(Instant::now());
                }
            }
        }
    }
    let start = decode_start.context("every request started")?;
    let decode_seconds = start.elapsed().as_secs_f64();
    for id in ids {
        let completion = engine.take_completion(id).context("request finished")?;
        if let Some(pending) = completion.capture {
            pending.map_err(anyhow::Error::msg)?.finalize()?;
        }
    }
    let total_seconds = start.elapsed().as_secs_f64();
    let rate = |seconds: f64| decoded as f64 / seconds.max(1e-9);
    Ok((rate(decode_seconds), rate(total_seconds)))
}

/// One line of the statistics figures: a median rate and, beside it, the median and the
/// lowest of its ratios to the no-capture run of the same round.
fn print_rate(label: &str, rates: &[f64], plain: &[f64]) {
    let ratios: Vec<f64> = rates.iter().zip(plain).map(|(r, p)| r / p).collect();
    let lowest = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "  {label:<31} {:8.1} tokens/s  ({:.1}% of no capture; per round median {:.1}%, lowest {:.1}%)",
        median(rates.to_vec()),
        100.0 * median(rates.to_vec()) / median(plain.to_vec()),
        100.0 * median(ratios),
        100.0 * lowest,
    );
}

fn print_statistics_figures(engine: &mut Engine, salt: &mut u64, repeat: usize) -> Result<()> {
    let num_layers = engine.model_info().num_layers;
    let kinds = [
        ("key statistics", key_statistics(engine)),
        ("span masses", span_masses(engine)),
    ];
    // Each round runs the batch without capture, then with each kind, so that a change
    // in the machine's load falls on all alike and each kind has a no-capture run of its
    // own round to be compared with.
    let mut plain = Vec::new();
    let mut rates = vec![(Vec::new(), Vec::new()); kinds.len()];
    for _ in 0..repeat {
        plain.push(statistics_rates(engine, salt, None)?.0);
        for ((_, spec), (decode, with_finalize)) in kinds.iter().zip(&mut rates) {
            let (d, f) = statistics_rates(engine, salt, Some(spec.clone()))?;
            decode.push(d);
            with_finalize.push(f);
        }
    }
    println!(
        "capture: key statistics and span masses, batch {STATS_BATCH} ({DECODE_PROMPT}-token prompts, \
         {DECODE_TOKENS} tokens each), every request asking, over its generated rows on all \
         {num_layers} layers, key_mass, key_max and block_mass, or the masses of {SPANS} prompt spans"
    );
    println!(
        "  no capture                      {:8.1} tokens/s",
        median(plain.clone())
    );
    for ((name, _), (decode, with_finalize)) in kinds.iter().zip(&rates) {
        print_rate(&format!("{name}, decode steps"), decode, &plain);
        print_rate(&format!("{name}, with finalizing"), with_finalize, &plain);
    }
    Ok(())
}

/// A finished capture of every layer, head and row of a `prompt_len`-token prompt.
fn capture_of(engine: &mut Engine, salt: &mut u64, prompt_len: usize) -> Result<PendingCapture> {
    *salt += 1;
    let prompt = synthetic_prompt(prompt_len, *salt, engine.model_info().vocab_size);
    let mut spec = everything(engine);
    spec.rows = RowSelection::Prompt;
    let id = engine.add_request_with_capture(prompt, decode_params(1), Some(spec))?;
    while engine.has_unfinished() {
        engine.step()?;
    }
    let completion = engine
        .take_completion(id)
        .context("capture request finished")?;
    completion
        .capture
        .context("a capture")?
        .map_err(anyhow::Error::msg)
}

pub fn run(engine: &mut Engine, repeat: usize, prompt_lengths: &[usize]) -> Result<()> {
    let mut salt = 1_000u64;
    let num_layers = engine.model_info().num_layers;
    decode_rate(engine, &mut salt, None)?; // warm-up
    let runs = |engine: &mut Engine, salt: &mut u64, capture: Option<CaptureSpec>| {
        (0..repeat)
            .map(|_| decode_rate(engine, salt, capture.clone()))
            .collect::<Result<Vec<_>>>()
            .map(median)
    };
    let plain = runs(engine, &mut salt, None)?;
    let capturing = runs(engine, &mut salt, Some(everything(engine)))?;
    println!("capture: decode, batch {BATCH} ({DECODE_PROMPT}-token prompts, {DECODE_TOKENS} tokens each)");
    println!("  no capturing request            {plain:8.1} tokens/s");
    println!(
        "  one capturing all {num_layers} layers    {capturing:8.1} tokens/s  ({:+.1}% change)",
        100.0 * (capturing / plain - 1.0)
    );

    print_statistics_figures(engine, &mut salt, repeat)?;

    println!("capture: finalize (every layer and head, prompt rows), per prompt length");
    let mut largest = None;
    for &len in prompt_lengths {
        let pending = capture_of(engine, &mut salt, len)?;
        let seconds = median(
            (0..repeat)
                .map(|_| {
                    let start = Instant::now();
                    pending.finalize().map(|_| start.elapsed().as_secs_f64())
                })
                .collect::<Result<Vec<_>, _>>()?,
        );
        let result = pending.finalize()?;
        let out_bytes: usize = result.layers.iter().map(|m| m.values.len() * 4).sum();
        println!(
            "  {len:5} tokens: {:8.2} ms per layer, held while pending {:7.1} MiB, maps {:8.1} MiB (f32)",
            seconds * 1e3 / num_layers as f64,
            pending.size_bytes() as f64 / (1 << 20) as f64,
            out_bytes as f64 / (1 << 20) as f64,
        );
        largest = Some(pending);
    }

    if let Some(pending) = largest {
        // The server's arrangement: finalization on the low-priority capture worker,
        // kept busy with back-to-back captures for the whole measurement.
        let pending = Arc::new(pending);
        let stop = Arc::new(AtomicBool::new(false));
        let finalized = Arc::new(AtomicUsize::new(0));
        // The engine is busy throughout: the worker keeps to its duty cycle.
        let worker = CaptureWorker::start(Arc::new(AtomicBool::new(true)), 1)?;
        {
            let (pending, stop, finalized) = (pending.clone(), stop.clone(), finalized.clone());
            worker.submit(move |pacer| {
                while !stop.load(Ordering::Relaxed) {
                    if pending.finalize_with(|| pacer.pause()).is_ok() {
                        finalized.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })?;
        }
        let during = runs(engine, &mut salt, None)?;
        stop.store(true, Ordering::Relaxed);
        drop(worker);
        let after = runs(engine, &mut salt, None)?;
        println!("capture: others' decode rate while captures finalize on the capture worker");
        println!("  alone                           {after:8.1} tokens/s");
        println!(
            "  during finalization             {during:8.1} tokens/s  ({:+.1}% change; {} captures finalized meanwhile)",
            100.0 * (during / after - 1.0),
            finalized.load(Ordering::Relaxed)
        );
    }
    Ok(())
}
