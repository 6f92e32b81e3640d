//! `lantern bench --capture`: what attention capture costs.
//!
//! - the aggregate decode rate of a batch with one of its requests capturing every layer
//!   (the Q-row copies ride along in each step), against the same batch without;
//! - key statistics and span masses: a batch of `STATS_BATCH` requests each asking for
//!   key statistics (or span masses) of every layer, against the same requests without
//!   capture, with and without the time their figures take to finalize;
//! - finalize time per layer and the memory a capture holds, against prompt length;
//! - the decode rate of a batch while another thread finalizes a large capture (what
//!   other requests lose while a capture is computed off the step loop).
//!
//! The first two are paired step by step: the batch runs on two engines in turn, one
//! with capture and one without, so that the machine's drift falls on both alike.

use crate::bench::{decode_params, median, run_prefills, synthetic_prompt};
use anyhow::{Context, Result};
use lantern_engine::lantern_capture::{
    CaptureSpan, CaptureSpec, CaptureWorker, KeyStat, PendingCapture, RowSelection,
};
use lantern_engine::Engine;
use lantern_kv::RequestId;
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

/// Aggregate tokens/s of `BATCH` requests, none capturing.
fn decode_rate(engine: &mut Engine, salt: &mut u64) -> Result<f64> {
    let vocab = engine.model_info().vocab_size;
    let prompts = (0..BATCH)
        .map(|_| {
            *salt += 1;
            synthetic_prompt(DECODE_PROMPT, *salt, vocab)
        })
        .collect();
    crate::bench::decode_rate(
        engine,
        prompts,
        DECODE_TOKENS,
        crate::bench::Sampling::GREEDY,
    )
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

/// A batch of paired runs: `size` requests of `DECODE_PROMPT`-token prompts decoding
/// `DECODE_TOKENS` tokens each, the first `capturing` of them asking for `capture` on the
/// capturing engine.
struct PairedBatch<'a> {
    size: usize,
    capturing: usize,
    capture: &'a CaptureSpec,
}

/// The same batch on both engines (the same prompts, so the same tokens are
/// generated), the capturing requests asking for capture on the second engine only.
fn add_paired_batch(
    engines: [&mut Engine; 2],
    salt: &mut u64,
    batch: &PairedBatch,
) -> Result<[Vec<RequestId>; 2]> {
    let vocab = engines[0].model_info().vocab_size;
    let prompts: Vec<Vec<u32>> = (0..batch.size)
        .map(|_| {
            *salt += 1;
            synthetic_prompt(DECODE_PROMPT, *salt, vocab)
        })
        .collect();
    let [plain, capturing] = engines;
    let add = |engine: &mut Engine, capturing: usize| {
        prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| {
                let capture = (i < capturing).then(|| batch.capture.clone());
                engine.add_request_with_capture(
                    prompt.clone(),
                    decode_params(DECODE_TOKENS),
                    capture,
                )
            })
            .collect::<Result<Vec<_>, _>>()
    };
    Ok([add(plain, 0)?, add(capturing, batch.capturing)?])
}

/// Rates of one paired run: the batch without capture, with it over the decode steps,
/// and with it counting the time its captures then take to finalize on one thread, as
/// the server's capture worker does.
struct PairedRates {
    plain: f64,
    decode: f64,
    with_finalize: f64,
}

/// The batch decoded on two engines in turn, step by step: one without capture, one
/// with the batch's capturing requests. The two share the model's file and the
/// compute threads, and each capture step is timed right beside a step without, so a
/// change in the machine's speed (on the shared machines these figures come from, tens
/// of percent over seconds) falls on both alike; which engine steps first alternates.
fn paired_rates(
    plain: &mut Engine,
    capturing: &mut Engine,
    salt: &mut u64,
    batch: &PairedBatch,
) -> Result<PairedRates> {
    let [plain_ids, capture_ids] = add_paired_batch([plain, capturing], salt, batch)?;
    run_prefills(plain, &plain_ids)?;
    run_prefills(capturing, &capture_ids)?;
    let mut seconds = [0.0f64; 2];
    let mut decoded = [0usize; 2];
    let mut timed_step = |engine: &mut Engine, which: usize| -> Result<()> {
        if engine.has_unfinished() {
            let start = Instant::now();
            let outputs = engine.step()?;
            seconds[which] += start.elapsed().as_secs_f64();
            decoded[which] += outputs.len();
        }
        Ok(())
    };
    let mut plain_first = true;
    while plain.has_unfinished() || capturing.has_unfinished() {
        if plain_first {
            timed_step(plain, 0)?;
            timed_step(capturing, 1)?;
        } else {
            timed_step(capturing, 1)?;
            timed_step(plain, 0)?;
        }
        plain_first = !plain_first;
    }
    anyhow::ensure!(
        decoded[0] == decoded[1],
        "both engines decode the same tokens"
    );
    for id in plain_ids {
        plain.take_completion(id).context("request finished")?;
    }
    let start = Instant::now();
    for id in capture_ids {
        let completion = capturing.take_completion(id).context("request finished")?;
        if let Some(pending) = completion.capture {
            pending.map_err(anyhow::Error::msg)?.finalize()?;
        }
    }
    let finalize_seconds = start.elapsed().as_secs_f64();
    let rate = |seconds: f64| decoded[0] as f64 / seconds.max(1e-9);
    Ok(PairedRates {
        plain: rate(seconds[0]),
        decode: rate(seconds[1]),
        with_finalize: rate(seconds[1] + finalize_seconds),
    })
}

/// One line of the paired figures: the median rate and, beside it, the median, the
/// lowest and the highest of its ratios to the runs (`against`) it was paired with.
fn print_rate(label: &str, rates: &[f64], plain: &[f64], against: &str) {
    let ratios: Vec<f64> = rates.iter().zip(plain).map(|(r, p)| r / p).collect();
    let lowest = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let highest = ratios.iter().copied().fold(0.0, f64::max);
    println!(
        "  {label:<31} {:8.1} tokens/s  (per round median {:.1}% of {against}, lowest {:.1}%, highest {:.1}%)",
        median(rates.to_vec()),
        100.0 * median(ratios),
        100.0 * lowest,
        100.0 * highest,
    );
}

fn print_statistics_figures(
    engine: &mut Engine,
    twin: &mut Engine,
    salt: &mut u64,
    repeat: usize,
) -> Result<()> {
    let num_layers = engine.model_info().num_layers;
    let kinds = [
        ("key statistics", key_statistics(engine)),
        ("span masses", span_masses(engine)),
    ];
    let mut rounds: Vec<Vec<PairedRates>> = kinds.iter().map(|_| Vec::new()).collect();
    for _ in 0..repeat {
        for ((_, spec), rounds) in kinds.iter().zip(&mut rounds) {
            let batch = PairedBatch {
                size: STATS_BATCH,
                capturing: STATS_BATCH,
                capture: spec,
            };
            rounds.push(paired_rates(twin, engine, salt, &batch)?);
        }
    }
    println!(
        "capture: key statistics and span masses, batch {STATS_BATCH} ({DECODE_PROMPT}-token prompts, \
         {DECODE_TOKENS} tokens each), every request asking, over its generated rows on all \
         {num_layers} layers, key_mass, key_max and block_mass, or the masses of {SPANS} prompt \
         spans; each capture step timed beside a step without ({repeat} rounds)"
    );
    for ((name, _), rounds) in kinds.iter().zip(&rounds) {
        let plain: Vec<f64> = rounds.iter().map(|r| r.plain).collect();
        let decode: Vec<f64> = rounds.iter().map(|r| r.decode).collect();
        let with_finalize: Vec<f64> = rounds.iter().map(|r| r.with_finalize).collect();
        println!(
            "  {:<31} {:8.1} tokens/s",
            format!("{name}: no capture"),
            median(plain.clone())
        );
        print_rate(
            &format!("{name}, decode steps"),
            &decode,
            &plain,
            "no capture",
        );
        print_rate(
            &format!("{name}, with finalizing"),
            &with_finalize,
            &plain,
            "no capture",
        );
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

/// `twin`: a second engine on the same model, the no-capture side of the paired
/// figures.
pub fn run(
    engine: &mut Engine,
    twin: &mut Engine,
    repeat: usize,
    prompt_lengths: &[usize],
) -> Result<()> {
    let mut salt = 1_000u64;
    let num_layers = engine.model_info().num_layers;
    decode_rate(engine, &mut salt)?; // warm-up
    decode_rate(twin, &mut salt)?;
    let all_layers = everything(engine);
    let one_capturing = PairedBatch {
        size: BATCH,
        capturing: 1,
        capture: &all_layers,
    };
    let rounds = (0..repeat)
        .map(|_| paired_rates(twin, engine, &mut salt, &one_capturing))
        .collect::<Result<Vec<_>>>()?;
    let plain: Vec<f64> = rounds.iter().map(|r| r.plain).collect();
    let capturing: Vec<f64> = rounds.iter().map(|r| r.decode).collect();
    println!(
        "capture: decode, batch {BATCH} ({DECODE_PROMPT}-token prompts, {DECODE_TOKENS} tokens \
         each), each step of the batch with a capturing request timed beside one without"
    );
    println!(
        "  no capturing request            {:8.1} tokens/s",
        median(plain.clone())
    );
    print_rate(
        &format!("one capturing all {num_layers} layers"),
        &capturing,
        &plain,
        "no capturing request",
    );

    print_statistics_figures(engine, twin, &mut salt, repeat)?;

    println!("capture: finalize (every layer and head, prompt rows), per prompt length");
    let mut largest = None;
    let vocab = engine.model_info().vocab_size;
    let context = engine.model_info().context_length;
    for &len in prompt_lengths {
        if len >= context {
            println!("  {len:5} tokens: skipped (the model's context is {context} tokens)");
            continue;
        }
        // End to end: from the request's submission to its finalized maps (on every
        // core, as an idle server finalizes; a backend that computes maps where its
        // cache lives does that work as the request finishes, inside its last step),
        // beside the same prompt alone.
        let mut with_capture = Vec::with_capacity(repeat);
        let mut alone = Vec::with_capacity(repeat);
        for _ in 0..repeat {
            let start = Instant::now();
            let threads = lantern_engine::host_threads::idle_finalize_threads();
            capture_of(engine, &mut salt, len)?.into_result(threads, || {})?;
            with_capture.push(start.elapsed().as_secs_f64());
            salt += 1;
            alone.push(crate::bench::prefill_seconds(
                engine,
                synthetic_prompt(len, salt, vocab),
            )?);
        }
        let (with_capture, alone) = (median(with_capture), median(alone));
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
        println!(
            "  {len:5} tokens end to end: {:8.1} ms with capture, {:8.1} ms without ({:.2}x)",
            with_capture * 1e3,
            alone * 1e3,
            with_capture / alone,
        );
        largest = Some(pending);
    }

    if let Some(pending) = largest {
        print_finalizing_beside_others(engine, &mut salt, repeat, pending)?;
    }
    Ok(())
}

/// What a batch of `BATCH` others loses while captures finalize on the capture worker
/// (the server's arrangement: low priority, paced while requests run), `pending` finalized
/// back to back. The worker is held between layers for every other run, so each run
/// during finalization has a run alone right beside it.
fn print_finalizing_beside_others(
    engine: &mut Engine,
    salt: &mut u64,
    repeat: usize,
    pending: PendingCapture,
) -> Result<()> {
    let pending = Arc::new(pending);
    let stop = Arc::new(AtomicBool::new(false));
    let held = Arc::new(AtomicBool::new(true));
    let finalized = Arc::new(AtomicUsize::new(0));
    // The engine is busy throughout: the worker keeps to its duty cycle.
    let worker = CaptureWorker::start(Arc::new(AtomicBool::new(true)), 1)?;
    {
        let (pending, stop, held, finalized) = (
            pending.clone(),
            stop.clone(),
            held.clone(),
            finalized.clone(),
        );
        worker.submit(move |pacer| {
            let between_layers = || {
                pacer.pause();
                if held.load(Ordering::Relaxed) {
                    while held.load(Ordering::Relaxed) && !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                    pacer.start();
                }
            };
            while !stop.load(Ordering::Relaxed) {
                if pending.finalize_with(between_layers).is_ok() {
                    finalized.fetch_add(1, Ordering::Relaxed);
                }
            }
        })?;
    }
    let (mut alone, mut during) = (Vec::new(), Vec::new());
    for round in 0..repeat {
        // Which goes first alternates.
        let first = round.is_multiple_of(2);
        for finalizing in [first, !first] {
            held.store(!finalizing, Ordering::Relaxed);
            let rate = decode_rate(engine, salt)?;
            if finalizing {
                during.push(rate);
            } else {
                alone.push(rate);
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    drop(worker);
    println!(
        "capture: others' decode rate (batch {BATCH}) while captures finalize on the capture \
         worker, each run beside one without"
    );
    println!(
        "  alone                           {:8.1} tokens/s",
        median(alone.clone())
    );
    print_rate("during finalization", &during, &alone, "alone");
    println!(
        "  ({} captures finalized meanwhile)",
        finalized.load(Ordering::Relaxed)
    );
    Ok(())
}
