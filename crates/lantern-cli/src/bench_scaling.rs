//! `lantern bench --thread-speedup` and `--kernel-speedup`: how the figures scale from
//! one thread to all of `--threads`, or from a lower kernel level to the default one,
//! measured within one process.
//!
//! Runs seconds apart differ by more than the speedups being compared on shared
//! machines, so the two sides take turns: prefills run by run, decode batches step by
//! step (the same batch, one step on one side, the next on the other, which goes first
//! alternating). Each side's rate is its tokens over the sum of its own runs' or steps'
//! times. The single thread is the engine thread with every helper parked
//! (`lantern_quant::share::limit_threads`), and work is split for one thread then, as
//! `--threads 1` would; the lower level is forced with `lantern_quant::force_kernel`.
//! Results are the same bits either way (but at the opt-in inexact levels).

use crate::bench::{decode_params, median, prefill_seconds, run_prefills, synthetic_prompt};
use anyhow::{Context, Result};
use lantern_engine::Engine;
use lantern_quant::{share, Kernel};
use serde_json::{json, Value};
use std::time::Instant;

/// The two sides of every figure: the baseline first.
#[derive(Clone, Copy)]
pub enum Pair {
    /// One computing thread, then all of them.
    Threads,
    /// A lower kernel level, then the default one.
    Kernels { from: Kernel },
}

impl Pair {
    /// Runs `f` on the baseline side (`true`) or the other.
    fn with<T>(self, baseline: bool, f: impl FnOnce() -> T) -> T {
        match self {
            Pair::Threads => share::limit_threads(baseline.then_some(1)),
            Pair::Kernels { from } => {
                lantern_quant::force_kernel(baseline.then_some(from));
            }
        }
        let out = f();
        match self {
            Pair::Threads => share::limit_threads(None),
            Pair::Kernels { .. } => {
                lantern_quant::force_kernel(None);
            }
        }
        out
    }

    /// The sides' names in the table, and their keys in the JSON object.
    fn names(self) -> ([String; 2], [&'static str; 2]) {
        match self {
            Pair::Threads => (
                ["1".into(), share::threads().to_string()],
                ["one_thread", "all_threads"],
            ),
            Pair::Kernels { from } => (
                [from.name().into(), lantern_quant::kernel_level().into()],
                ["baseline_level", "default_level"],
            ),
        }
    }
}

/// What the figures are measured on.
pub struct ScalingArgs<'a> {
    pub pair: Pair,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub batches: &'a [usize],
    pub repeat: usize,
    /// One JSON object instead of the table.
    pub json: bool,
}

/// One figure's rounds: tokens/s on one thread and on all, per round.
#[derive(Default)]
struct Rounds {
    one: Vec<f64>,
    all: Vec<f64>,
}

/// A figure's medians and the spread of its per-round speedups.
struct Summary {
    one: f64,
    all: f64,
    speedup: f64,
    lowest: f64,
    highest: f64,
}

impl Rounds {
    fn summary(&self) -> Summary {
        let speedups: Vec<f64> = self.all.iter().zip(&self.one).map(|(a, o)| a / o).collect();
        Summary {
            one: median(self.one.clone()),
            all: median(self.all.clone()),
            lowest: speedups.iter().copied().fold(f64::INFINITY, f64::min),
            highest: speedups.iter().copied().fold(0.0, f64::max),
            speedup: median(speedups),
        }
    }

    fn json(&self, pair: Pair) -> Value {
        let s = self.summary();
        let [one, all] = pair.names().1;
        json!({
            one: s.one,
            all: s.all,
            "speedup": s.speedup,
            "lowest": s.lowest,
            "highest": s.highest,
        })
    }

    fn print(&self, label: &str, pair: Pair) {
        self.print_with(label, pair, "tokens/s")
    }

    fn print_with(&self, label: &str, pair: Pair, unit: &str) {
        let s = self.summary();
        let [one, all] = pair.names().0;
        println!(
            "{label:<28} {:8.1} -> {:8.1} {unit:<8}  speedup {one} -> {all}: median {:.2}x (rounds {:.2}-{:.2}x)",
            s.one, s.all, s.speedup, s.lowest, s.highest,
        );
    }
}

/// One round of the prefill figure: a prompt on each side, which goes first by `round`.
fn prefill_round(
    engine: &mut Engine,
    pair: Pair,
    salt: &mut u64,
    len: usize,
    round: usize,
) -> Result<[f64; 2]> {
    let vocab = engine.model_info().vocab_size;
    let mut rates = [0.0; 2];
    let first = round.is_multiple_of(2);
    for one in [first, !first] {
        *salt += 1;
        let prompt = synthetic_prompt(len, *salt, vocab);
        let seconds = pair.with(one, || prefill_seconds(engine, prompt))?;
        rates[usize::from(!one)] = len as f64 / seconds.max(1e-9);
    }
    Ok(rates)
}

/// One round of a decode figure: `batch` requests of `prompt_len`-token prompts (their
/// prefill not timed), then their decode steps on alternating sides.
fn decode_round(
    engine: &mut Engine,
    pair: Pair,
    salt: &mut u64,
    batch: usize,
    prompt_len: usize,
    tokens: usize,
) -> Result<[f64; 2]> {
    let vocab = engine.model_info().vocab_size;
    let ids = (0..batch)
        .map(|_| {
            *salt += 1;
            engine.add_request(
                synthetic_prompt(prompt_len, *salt, vocab),
                decode_params(tokens),
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    run_prefills(engine, &ids)?;
    let (mut seconds, mut decoded) = ([0.0f64; 2], [0usize; 2]);
    let mut one = true;
    while engine.has_unfinished() {
        let side = usize::from(!one);
        let (elapsed, outputs) = pair.with(one, || {
            let start = Instant::now();
            engine
                .step()
                .map(|o| (start.elapsed().as_secs_f64(), o.len()))
        })?;
        seconds[side] += elapsed;
        decoded[side] += outputs;
        one = !one;
    }
    for id in ids {
        engine.take_completion(id).context("request finished")?;
    }
    Ok([0, 1].map(|side| decoded[side] as f64 / seconds[side].max(1e-9)))
}

/// Pieces of the machine's own figures: enough for every thread to have many.
const PROBE_PIECES: usize = 64;

/// Seconds of `piece(p)` for every piece, shared between the computing threads.
fn probe_seconds(piece: &(dyn Fn(usize) -> f32 + Sync)) -> f64 {
    let sums: Vec<std::sync::atomic::AtomicU32> =
        (0..PROBE_PIECES).map(|_| Default::default()).collect();
    let start = Instant::now();
    share::run(PROBE_PIECES, &|p| {
        sums[p].store(piece(p).to_bits(), std::sync::atomic::Ordering::Relaxed)
    });
    let seconds = start.elapsed().as_secs_f64();
    std::hint::black_box(&sums);
    seconds
}

/// Independent chains of multiply-adds per probe piece: enough to keep two FMA units
/// with a 4-cycle latency busy (8), so that the probe measures the units' throughput.
const FMA_CHAINS: usize = 12;
/// Rounds of `FMA_CHAINS` vector multiply-adds per piece (a few milliseconds each).
const FMA_ROUNDS: usize = 1 << 20;

/// Multiply-adds on registers only (no memory traffic), as fast as the core's widest
/// vector FMA units take them: what this machine's cores give compute-bound work that
/// shares nothing. Two hardware threads of one core share those units, so a pair of
/// vCPUs that are such siblings shows about 1x here (a chain of dependent or called
/// multiply-adds would not: it leaves the units idle for the other thread).
fn compute_piece(p: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F.
            return unsafe { fma_chains_avx512(p) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { fma_chains_avx2(p) };
        }
    }
    fma_chains_portable(p)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_chains_avx512(p: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_set1_ps(p as f32 * 1e-3); FMA_CHAINS];
    let (a, b) = (_mm512_set1_ps(0.999_9), _mm512_set1_ps(1e-4));
    for _ in 0..FMA_ROUNDS {
        for v in &mut acc {
            *v = _mm512_fmadd_ps(*v, a, b);
        }
    }
    std::hint::black_box(acc)
        .iter()
        .map(|&v| _mm512_reduce_add_ps(v))
        .sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_chains_avx2(p: usize) -> f32 {
    use std::arch::x86_64::*;
    let mut acc = [_mm256_set1_ps(p as f32 * 1e-3); FMA_CHAINS];
    let (a, b) = (_mm256_set1_ps(0.999_9), _mm256_set1_ps(1e-4));
    for _ in 0..FMA_ROUNDS {
        for v in &mut acc {
            *v = _mm256_fmadd_ps(*v, a, b);
        }
    }
    let mut lanes = [0f32; 8];
    let mut sum = 0.0;
    for v in std::hint::black_box(acc) {
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        sum += lanes.iter().sum::<f32>();
    }
    sum
}

/// Elsewhere: the compiler's vectors for the baseline target (a multiply and an add).
fn fma_chains_portable(p: usize) -> f32 {
    let mut acc = [[p as f32 * 1e-3; 8]; FMA_CHAINS];
    for _ in 0..FMA_ROUNDS {
        for chain in &mut acc {
            for v in chain.iter_mut() {
                *v = *v * 0.999_9 + 1e-4;
            }
        }
    }
    std::hint::black_box(acc).iter().flatten().sum()
}

/// The speedup this machine gives from one thread to all on work with no serial part:
/// multiply-adds on registers, and a sum over a buffer far larger than the caches (the
/// memory bandwidth a decode step's weights stream through). A bound for the figures.
fn machine_rounds(repeat: usize) -> (Rounds, Rounds) {
    let buffer: Vec<f32> = (0..(64usize << 20)).map(|i| (i % 251) as f32).collect();
    let piece_len = buffer.len() / PROBE_PIECES;
    let read_piece = |p: usize| {
        let mut acc = [0f32; 16];
        for chunk in buffer[p * piece_len..(p + 1) * piece_len].chunks_exact(16) {
            for (a, x) in acc.iter_mut().zip(chunk) {
                *a += x;
            }
        }
        acc.iter().sum()
    };
    let (mut compute, mut memory) = (Rounds::default(), Rounds::default());
    for round in 0..repeat.max(5) {
        let first = round.is_multiple_of(2);
        for one in [first, !first] {
            let side = |r: &mut Rounds, rate: f64| {
                if one {
                    r.one.push(rate)
                } else {
                    r.all.push(rate)
                }
            };
            let c = Pair::Threads.with(one, || probe_seconds(&compute_piece));
            side(&mut compute, 1.0 / c);
            let m = Pair::Threads.with(one, || probe_seconds(&read_piece));
            side(&mut memory, (buffer.len() * 4) as f64 / m / 1e9);
        }
    }
    (compute, memory)
}

/// Empty passes timed per round of [`empty_pass_micros`].
const EMPTY_PASSES: usize = 2000;

/// Microseconds (median) of one shared pass that computes nothing, on one thread and on
/// all: publishing it, the claims of its `4 x threads` empty chunks and the caller's
/// wait for the helpers' (what each of a step's parallel passes pays beside its work:
/// about 140 of them in a batch-1 SmolLM2 step, 480 at batch 32).
fn empty_pass_micros(repeat: usize) -> [f64; 2] {
    let (mut one, mut all) = (Vec::new(), Vec::new());
    for round in 0..repeat.max(5) {
        let first = round.is_multiple_of(2);
        for baseline in [first, !first] {
            let micros = Pair::Threads.with(baseline, || {
                let chunks = 4 * share::threads();
                let times = (0..EMPTY_PASSES)
                    .map(|_| {
                        let start = Instant::now();
                        share::run(chunks, &|c| {
                            std::hint::black_box(c);
                        });
                        start.elapsed().as_secs_f64() * 1e6
                    })
                    .collect();
                median(times)
            });
            if baseline { &mut one } else { &mut all }.push(micros);
        }
    }
    [median(one), median(all)]
}

pub fn run(engine: &mut Engine, args: &ScalingArgs) -> Result<()> {
    let (pair, threads) = (args.pair, share::threads());
    let mut salt = 0u64;
    // Warm-up: first-touch of the KV cache pages and the kernels' lazy state.
    prefill_round(engine, pair, &mut salt, args.prompt_tokens, 0)?;
    let mut prefill = Rounds::default();
    for round in 0..args.repeat {
        let [one, all] = prefill_round(engine, pair, &mut salt, args.prompt_tokens, round)?;
        prefill.one.push(one);
        prefill.all.push(all);
    }
    let mut decode = |batch: usize, prompt_len: usize| -> Result<Rounds> {
        let mut rounds = Rounds::default();
        for _ in 0..args.repeat {
            let [one, all] = decode_round(
                engine,
                pair,
                &mut salt,
                batch,
                prompt_len,
                args.decode_tokens,
            )?;
            rounds.one.push(one);
            rounds.all.push(all);
        }
        Ok(rounds)
    };
    let batch_one = decode(1, 1)?;
    // Batch 1 over a long context: attention reads the whole KV cache each step.
    let batch_one_after = decode(1, args.prompt_tokens)?;
    let batched = args
        .batches
        .iter()
        .map(|&b| decode(b, 16).map(|r| (b, r)))
        .collect::<Result<Vec<_>>>()?;
    // The machine's own bounds concern threads only.
    let machine = matches!(pair, Pair::Threads).then(|| machine_rounds(args.repeat));
    let empty_pass = matches!(pair, Pair::Threads).then(|| empty_pass_micros(args.repeat));
    if args.json {
        let batched_json: serde_json::Map<String, Value> = batched
            .iter()
            .map(|(b, rounds)| (b.to_string(), rounds.json(pair)))
            .collect();
        let mut out = json!({
            "threads": threads,
            "rounds": args.repeat,
            "simd": lantern_model::simd_level().summary(),
            "kernel_level": lantern_quant::kernel_level(),
            "prefill": prefill.json(pair),
            "prompt_tokens": args.prompt_tokens,
            "decode_batch_1": batch_one.json(pair),
            "decode_batch_1_after_prompt": batch_one_after.json(pair),
            "decode_batched": batched_json,
        });
        if let Some((compute, memory)) = &machine {
            out["machine_multiply_adds"] = compute.json(pair);
            out["machine_memory_gb_per_s"] = memory.json(pair);
        }
        if let Some([one, all]) = empty_pass {
            out["empty_shared_pass_us"] = json!({ "one_thread": one, "all_threads": all });
        }
        if let Pair::Kernels { from } = pair {
            out["baseline_level"] = from.name().into();
        }
        println!("{out}");
        return Ok(());
    }
    let [one, all] = pair.names().0;
    match pair {
        Pair::Threads => println!("thread speedup, {one} -> {all} threads, paired within one process ({} rounds)", args.repeat),
        Pair::Kernels { .. } => println!("kernel speedup, {one} -> {all} on {threads} threads, paired within one process ({} rounds)", args.repeat),
    }
    if let Some((compute, memory)) = &machine {
        compute.print_with("machine: multiply-adds", pair, "rounds/s");
        memory.print_with("machine: reading memory", pair, "GB/s");
    }
    if let Some([one, all]) = empty_pass {
        let label = "lantern: an empty pass";
        println!(
            "{label:<28} {one:8.2} -> {all:8.2} {:<8}  publish, claims, join",
            "us"
        );
    }
    prefill.print(&format!("prefill ({} tokens)", args.prompt_tokens), pair);
    batch_one.print("decode, batch 1", pair);
    batch_one_after.print(
        &format!("decode, batch 1 after {}", args.prompt_tokens),
        pair,
    );
    for (b, rounds) in &batched {
        rounds.print(&format!("decode, batch {b} (aggregate)"), pair);
    }
    Ok(())
}
