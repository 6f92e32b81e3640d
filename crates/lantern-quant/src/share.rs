//! Single-token products shared between the calling thread and helper threads that stay
//! awake while products keep coming.
//!
//! A batch-1 decode step runs ~200 products of a few microseconds each. A rayon
//! fork-join from a thread outside the pool parks the caller on a latch and wakes it
//! again, and a rayon worker asleep between products takes tens of microseconds to wake
//! (about a whole product), so those products ran on the calling thread alone, leaving
//! the other cores idle and one core's memory bandwidth as the limit. Here the caller
//! publishes the product's chunks and starts on them itself; helper threads (one fewer
//! than rayon's thread count), which poll for new products for `LINGER` after their
//! last one before parking, claim chunks from the same atomic counters (each thread
//! starting on a share of its own, see [`Chunks`]). The caller never
//! waits for a helper to *start*, only (briefly) for a chunk a helper has claimed to
//! finish. A helper that looks after every chunk was claimed finds nothing to do and
//! touches nothing but the shared counters.
//!
//! Helpers are plain threads, not rayon jobs: a rayon job that waited for products could
//! be run by a worker blocked in a join, and stall that join until it gave up.
//!
//! Which thread computes a chunk does not change any result: each output element is
//! produced by one tile with the full k loop, as in every other split.
//!
//! A chunk that panics (on any thread) is counted as done, and once every chunk is done
//! `run` resumes the panic on the calling thread: helpers never hold the borrows of a
//! product whose caller has unwound, and a helper's panic never leaves the caller
//! waiting for a chunk that will not finish (the engine contains the panic as it does
//! any other).

use std::any::Any;
use std::mem::MaybeUninit;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How long a helper keeps polling after its last product before it parks: longer than
/// the gaps between a decode step's products and between steps.
const LINGER: Duration = Duration::from_millis(2);

/// One thread's share of a product's chunks: `next..end`, claimed from the front by its
/// own thread first, then by any thread that has finished its own.
#[repr(align(64))]
struct Share {
    next: AtomicUsize,
    end: usize,
}

/// The chunks of one product and who has claimed and finished them.
///
/// Chunk ranges are cut into one contiguous share a computing thread (the calling thread
/// is 0, helper `i` is `i + 1`), each thread starting on its own and then taking what is
/// left of the others'. Passes over a step's rows cut in proportion (a norm, then the
/// quantization of its output, then the residual add) so give each thread about the same
/// rows every time, and a thread mostly reads what it wrote itself, from its own cache,
/// rather than what another core wrote (with one shared counter, a thread's chunks were
/// anyone's: on `n` threads, `(n - 1) / n` of the reads of the previous pass's output).
struct Chunks {
    shares: Box<[Share]>,
    /// Chunks finished.
    done: AtomicUsize,
    work: Erased,
    /// The first panic of a chunk, resumed by the caller once every chunk is done.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Chunks {
    /// `count` chunks in `threads` shares of about as many chunks, or in the shares
    /// that start at `starts` (ascending chunk indices) when given.
    fn new(count: usize, threads: usize, starts: &[usize], work: Erased) -> Chunks {
        // Share boundaries: from 0, never going back, ending at `count`, so that every
        // chunk lies in exactly one share whatever `starts` holds.
        let mut bounds: Vec<usize> = if starts.is_empty() {
            let parts = threads.clamp(1, count.max(1));
            (0..parts).map(|p| p * count / parts).collect()
        } else {
            let mut at = 0;
            (starts.iter().enumerate())
                .map(|(p, &s)| {
                    at = if p == 0 { 0 } else { s.clamp(at, count) };
                    at
                })
                .collect()
        };
        bounds.push(count);
        let shares = bounds
            .windows(2)
            .map(|w| Share {
                next: AtomicUsize::new(w[0]),
                end: w[1],
            })
            .collect();
        Chunks {
            shares,
            done: AtomicUsize::new(0),
            work,
            panic: Mutex::new(None),
        }
    }

    /// Claims and computes chunks until none are left: computing thread `thread`'s own
    /// share first, then the others' in turn.
    fn drain(&self, thread: usize) {
        let parts = self.shares.len();
        for k in 0..parts {
            let share = &self.shares[(thread + k) % parts];
            loop {
                let c = share.next.fetch_add(1, Ordering::Relaxed);
                if c >= share.end {
                    break;
                }
                self.compute(c);
            }
        }
    }

    fn compute(&self, c: usize) {
        // SAFETY: chunk `c` is claimed and below `count`, so `run` has not returned (it
        // waits for every chunk, panicked or not) and the closure's borrows are alive
        // (see `Erased`).
        let work = AssertUnwindSafe(|| unsafe { (*self.work.0)(c) });
        if let Err(payload) = catch_unwind(work) {
            if let Ok(mut first) = self.panic.lock() {
                first.get_or_insert(payload);
            }
        }
        self.done.fetch_add(1, Ordering::Release);
    }
}

/// A chunk closure with its borrows' lifetime erased, so that helpers can hold it.
struct Erased(*const (dyn Fn(usize) + Sync));
// SAFETY: the closure is `Sync`, and helpers call it only on claimed chunks, which all
// finish while `run` (which owns the borrows) is still waiting.
unsafe impl Send for Erased {}
unsafe impl Sync for Erased {}

/// The helper threads and the product they are offered.
struct Helpers {
    /// The latest published product.
    slot: Mutex<Option<Arc<Chunks>>>,
    /// Bumped on every publication; helpers poll it.
    generation: AtomicU64,
    /// Per helper: its thread, and whether it is parked (or about to park).
    threads: Vec<(Thread, Arc<AtomicBool>)>,
}

impl Helpers {
    fn start(count: usize) -> Helpers {
        let threads = (0..count)
            .filter_map(|i| {
                let parked = Arc::new(AtomicBool::new(false));
                let flag = Arc::clone(&parked);
                std::thread::Builder::new()
                    .name(format!("lantern-quant-{i}"))
                    .spawn(move || helper_loop(i, &flag))
                    .ok()
                    .map(|h| (h.thread().clone(), parked))
            })
            .collect();
        Helpers {
            slot: Mutex::new(None),
            generation: AtomicU64::new(0),
            threads,
        }
    }

    fn publish(&self, chunks: &Arc<Chunks>) {
        if let Ok(mut slot) = self.slot.lock() {
            *slot = Some(Arc::clone(chunks));
        }
        self.generation.fetch_add(1, Ordering::SeqCst);
        for (thread, parked) in &self.threads {
            if parked.swap(false, Ordering::SeqCst) {
                thread.unpark();
            }
        }
    }

    fn current(&self) -> Option<Arc<Chunks>> {
        self.slot.lock().ok().and_then(|s| s.clone())
    }
}

static HELPERS: OnceLock<Helpers> = OnceLock::new();

/// The helpers, started on first use: one fewer than rayon's thread count.
fn helpers() -> &'static Helpers {
    HELPERS.get_or_init(|| Helpers::start(rayon::current_num_threads().saturating_sub(1)))
}

/// Threads that compute from now on (the calling thread and `n - 1` helpers), when set
/// by [`limit_threads`]; 0: all of them.
static LIMIT: AtomicUsize = AtomicUsize::new(0);

/// Threads that compute a step: the calling thread and the helpers, one per thread of
/// rayon's pool, or fewer while [`limit_threads`] says so. Work is split for this many.
pub fn threads() -> usize {
    let all = rayon::current_num_threads().max(1);
    match LIMIT.load(Ordering::Relaxed) {
        0 => all,
        n => n.min(all),
    }
}

/// Lets only `n` threads (the calling thread and `n - 1` helpers) compute from the next
/// product on, the others parked, and splits work for `n` (`None`: every thread again).
/// For measuring how a step scales within one process, step by step, where the
/// machine's drift between runs would hide it; results are the same bits at every
/// count. Call it between steps, not while one runs.
pub fn limit_threads(n: Option<usize>) {
    LIMIT.store(n.unwrap_or(0), Ordering::Relaxed);
}

fn helper_loop(index: usize, parked: &AtomicBool) {
    // `HELPERS` is set as soon as `start` returns; until then there is nothing to do.
    let helpers = loop {
        match HELPERS.get() {
            Some(h) => break h,
            None => std::thread::yield_now(),
        }
    };
    let mut seen = helpers.generation.load(Ordering::Acquire);
    let mut idle_since = Instant::now();
    loop {
        // Outside the threads `limit_threads` lets compute: no draining, no lingering.
        let enabled = index + 1 < threads();
        let g = helpers.generation.load(Ordering::SeqCst);
        if g != seen {
            seen = g;
            if enabled {
                if let Some(chunks) = helpers.current() {
                    chunks.drain(index + 1);
                }
            }
            idle_since = Instant::now();
            continue;
        }
        if enabled && idle_since.elapsed() < LINGER {
            // Look between pauses, so that a product is seen within a pause or so of its
            // publication: looking only after every 64 pauses started a helper's share
            // ~1.2 us late on average (on Zen 4), on each of the ~140 products of a
            // batch-1 step and ~480 passes of a batch-32 step.
            if published_within(helpers, seen, POLL_PAUSES) {
                continue;
            }
            // Let other runnable threads (rayon's workers) have this core.
            std::thread::yield_now();
            continue;
        }
        // Park, unless a product was published after the check above (`publish` bumps
        // the generation before it reads `parked`, so one of the two sees the other).
        parked.store(true, Ordering::SeqCst);
        if helpers.generation.load(Ordering::SeqCst) == seen {
            std::thread::park();
        }
        parked.store(false, Ordering::SeqCst);
        idle_since = Instant::now();
    }
}

/// Pauses a lingering helper makes between yields of its core.
const POLL_PAUSES: usize = 64;

/// Whether a product after generation `seen` is published within `pauses` spin-loop
/// pauses, looking before each.
fn published_within(helpers: &Helpers, seen: u64, pauses: usize) -> bool {
    for _ in 0..pauses {
        if helpers.generation.load(Ordering::Relaxed) != seen {
            return true;
        }
        std::hint::spin_loop();
    }
    helpers.generation.load(Ordering::Relaxed) != seen
}

/// Runs `work(c)` for every chunk `c < count`, on the calling thread and the helpers;
/// returns once every chunk is done. For work of a few microseconds to a millisecond,
/// where a rayon fork-join would cost as much as the work (batch-1 decode products and
/// attention).
pub fn run(count: usize, work: &(dyn Fn(usize) + Sync)) {
    run_split(count, &[], work)
}

/// [`run`], each computing thread's share of the chunks starting at `starts` (ascending
/// chunk indices, one a thread, the first 0; empty: shares of about as many chunks each),
/// for chunks of very different sizes: the caller cuts the shares at about the same work.
pub fn run_split(count: usize, starts: &[usize], work: &(dyn Fn(usize) + Sync)) {
    // SAFETY: only the lifetime is erased; see `Erased`.
    let erased = Erased(unsafe {
        std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const (dyn Fn(usize) + Sync)>(
            work,
        )
    });
    let threads = threads();
    let chunks = Arc::new(Chunks::new(count, threads, starts, erased));
    if count > 1 && threads > 1 {
        helpers().publish(&chunks);
    }
    chunks.drain(0);
    // Every chunk is claimed; wait for the ones helpers are still computing.
    let mut spins = 0u32;
    while chunks.done.load(Ordering::Acquire) < count {
        if spins < 1 << 12 {
            std::hint::spin_loop();
            spins += 1;
        } else {
            // A helper was descheduled mid-chunk: let it run.
            std::thread::yield_now();
        }
    }
    let panic = chunks.panic.lock().ok().and_then(|mut p| p.take());
    if let Some(payload) = panic {
        resume_unwind(payload);
    }
}

/// Values below which an element-wise pass over rows runs on the calling thread alone:
/// about the work a helper's wake-up and the chunk claims cost.
pub const SERIAL_VALUES: usize = 1 << 14;

/// Runs `work(i, chunk)` over the chunks of `chunk_len` elements of `data` (the last may be
/// shorter), on the calling thread and the helpers; on the calling thread alone when
/// `data` fits in one chunk. For element-wise passes over a step's rows (norms, residual
/// adds, activations, RoPE), which would otherwise leave the helpers idle between the
/// products of a layer.
pub fn for_each_chunk<T: Send>(
    data: &mut [T],
    chunk_len: usize,
    work: &(dyn Fn(usize, &mut [T]) + Sync),
) {
    let chunk_len = chunk_len.max(1);
    if data.len() <= chunk_len {
        work(0, data);
        return;
    }
    let len = data.len();
    let shared = SharedMut::new(data);
    run(len.div_ceil(chunk_len), &|c| {
        let start = c * chunk_len;
        // SAFETY: chunks are disjoint ranges of `data`.
        work(c, unsafe {
            shared.range(start, chunk_len.min(len - start))
        });
    });
}

/// A new `len`-value output made by `fill(i, chunk)` over chunks of `chunk_len` values,
/// as [`for_each_chunk`] runs them: each chunk is zeroed by the thread that fills it, just
/// before, so a step's fresh activations (a norm's output, attention's) are not zeroed
/// first by the calling thread alone, in a pass of their own.
pub fn fresh_chunks(
    len: usize,
    chunk_len: usize,
    fill: &(dyn Fn(usize, &mut [f32]) + Sync),
) -> Vec<f32> {
    // SAFETY: every element of each chunk is initialized (zeroed) before `fill` sees it.
    unsafe {
        initialized_in_chunks(len, chunk_len, &|i, part| {
            part.fill(MaybeUninit::new(0.0));
            // SAFETY: initialized just above; `MaybeUninit<f32>` has `f32`'s layout.
            fill(i, &mut *(part as *mut [MaybeUninit<f32>] as *mut [f32]))
        })
    }
}

/// A copy of `src`, made in chunks on the step's threads (a prefill's attention output
/// leaving its tensor: a megabyte or more a layer).
pub fn copied(src: &[f32]) -> Vec<f32> {
    let chunk = chunk_len(src.len(), 1);
    // SAFETY: each chunk is written whole from `src`, which is as long as the output.
    unsafe {
        initialized_in_chunks(src.len(), chunk, &|i, part| {
            for (to, from) in part.iter_mut().zip(&src[i * chunk..]) {
                to.write(*from);
            }
        })
    }
}

/// A new `len`-value output of zeros, zeroed in chunks on the step's threads.
pub fn zeroed(len: usize) -> Vec<f32> {
    fresh_chunks(len, chunk_len(len, 1), &|_, _| {})
}

/// A new `len`-value output whose chunks of `chunk_len` values `init(i, chunk)` writes, as
/// [`for_each_chunk`] runs them.
///
/// # Safety
/// `init` initializes every element of the chunk it is given.
unsafe fn initialized_in_chunks(
    len: usize,
    chunk_len: usize,
    init: &(dyn Fn(usize, &mut [MaybeUninit<f32>]) + Sync),
) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    for_each_chunk(&mut out.spare_capacity_mut()[..len], chunk_len, init);
    // SAFETY: the chunks cover `0..len`, and `init` initialized each (the caller's promise).
    unsafe { out.set_len(len) };
    out
}

/// Chunk length for an element-wise pass over `len` values in units (rows) of `unit`:
/// whole units, and as many chunks as [`SERIAL_VALUES`]-long ones would make, rounded up
/// to a multiple of the thread count and evened out, so that no thread is left with one
/// long chunk while the others wait (a decode batch of 32 SmolLM2 rows is two chunks of
/// 16 rows on 2 threads, not 29 and 3). `len` itself (one chunk, the calling thread
/// alone) up to [`SERIAL_VALUES`].
pub fn chunk_len(len: usize, unit: usize) -> usize {
    chunk_len_for(len, unit, threads())
}

/// [`chunk_len`] for `threads` threads.
fn chunk_len_for(len: usize, unit: usize, threads: usize) -> usize {
    let unit = unit.max(1);
    let units = len.div_ceil(unit);
    let threads = threads.max(1);
    let chunks = len.div_ceil(SERIAL_VALUES).max(1);
    let chunks = if chunks > 1 {
        chunks.next_multiple_of(threads)
    } else {
        1
    };
    units.div_ceil(chunks).max(1) * unit
}

/// A mutable slice shared with the threads of one `run`, each of which writes its own
/// disjoint ranges of it (outputs that are not one contiguous chunk per task).
pub struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _slice: std::marker::PhantomData<&'a mut [T]>,
}

// SAFETY: threads reach the slice only through `range`, whose callers promise disjoint
// ranges.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    pub fn new(slice: &'a mut [T]) -> Self {
        SharedMut {
            ptr: slice.as_mut_ptr(),
            len: slice.len(),
            _slice: std::marker::PhantomData,
        }
    }

    /// Elements `start..start + len` (panics when outside the slice).
    ///
    /// # Safety
    /// No other thread uses any of these elements while the returned slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn range(&self, start: usize, len: usize) -> &mut [T] {
        assert!(
            start.checked_add(len).is_some_and(|end| end <= self.len),
            "range {start}+{len} outside a slice of {}",
            self.len
        );
        // SAFETY: in bounds (checked); exclusive by the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// With the threads limited to one, `threads()` says so (work is split for one) and
    /// every chunk runs on the calling thread (the helpers are not offered the work).
    #[test]
    fn limited_to_one_thread_every_chunk_runs_on_the_caller() {
        let caller = std::thread::current().id();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        pool.install(|| {
            assert_eq!(threads(), 2);
            limit_threads(Some(1));
            assert_eq!(threads(), 1);
            let ran_on = Mutex::new(Vec::new());
            run(64, &|_| {
                ran_on.lock().unwrap().push(std::thread::current().id())
            });
            limit_threads(None);
            let ran_on = ran_on.into_inner().unwrap();
            assert_eq!(ran_on.len(), 64);
            let caller_here = std::thread::current().id();
            assert!(
                ran_on.iter().all(|&t| t == caller_here),
                "a helper ran a chunk"
            );
            assert_eq!(threads(), 2);
        });
        assert_eq!(std::thread::current().id(), caller);
    }

    /// A fresh output holds what each chunk wrote where it wrote, zeros elsewhere in the
    /// chunk, for lengths on and off the chunk length, on one thread and on a pool; a
    /// chunked copy equals its source.
    #[test]
    fn fresh_chunks_hold_what_each_chunk_wrote_and_zeros_elsewhere() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for (len, chunk) in [(0, 4), (5, 8), (64, 16), (70, 16), (50_000, 4_096)] {
            // Each chunk writes its index + 1 into its even elements and leaves the rest.
            let fill = |c: usize, part: &mut [f32]| {
                for v in part.iter_mut().step_by(2) {
                    *v = (c + 1) as f32;
                }
            };
            let want: Vec<f32> = (0..len)
                .map(|i| {
                    if (i % chunk) % 2 == 0 {
                        (i / chunk + 1) as f32
                    } else {
                        0.0
                    }
                })
                .collect();
            assert_eq!(fresh_chunks(len, chunk, &fill), want, "len {len}");
            let on_pool = pool.install(|| fresh_chunks(len, chunk, &fill));
            assert_eq!(on_pool, want, "len {len}, 3 threads");
            assert!(pool.install(|| zeroed(len)).iter().all(|&v| v == 0.0));
            let src: Vec<f32> = (0..len).map(|i| i as f32 * 0.5 - 3.0).collect();
            assert_eq!(pool.install(|| copied(&src)), src, "copy of {len}");
        }
    }

    #[test]
    fn every_chunk_runs_once() {
        for count in [1, 2, 7, 64] {
            let hits: Vec<AtomicUsize> = (0..count).map(|_| AtomicUsize::new(0)).collect();
            run(count, &|c| {
                hits[c].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    /// A panicking chunk reaches the caller with its message once every other chunk has
    /// finished, and later products still run on the helpers.
    #[test]
    fn a_panicking_chunk_is_resumed_on_the_caller_after_the_rest() {
        let finished = AtomicUsize::new(0);
        let outcome = catch_unwind(AssertUnwindSafe(|| {
            run(32, &|c| {
                if c == 5 {
                    panic!("chunk five failed");
                }
                std::thread::sleep(Duration::from_micros(200));
                finished.fetch_add(1, Ordering::Relaxed);
            })
        }));
        let payload = outcome.expect_err("the panic reaches the caller");
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"chunk five failed"));
        assert_eq!(finished.load(Ordering::Relaxed), 31);
        let again = AtomicUsize::new(0);
        run(16, &|_| {
            again.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(again.load(Ordering::Relaxed), 16);
    }

    /// The shares cut the chunks into contiguous, even, disjoint ranges, at most one a
    /// chunk; a thread takes its own share first, in order, then the others' in turn.
    #[test]
    fn each_thread_starts_on_its_own_share() {
        for (count, threads) in [(0, 4), (1, 4), (7, 2), (64, 3), (5, 16)] {
            let order = Mutex::new(Vec::new());
            let work = |c: usize| order.lock().unwrap().push(c);
            // SAFETY: `work` outlives `chunks`, which is dropped at the end of the loop.
            let erased = Erased(unsafe {
                std::mem::transmute::<
                    *const (dyn Fn(usize) + Sync + '_),
                    *const (dyn Fn(usize) + Sync),
                >(&work)
            });
            let chunks = Chunks::new(count, threads, &[], erased);
            let parts = chunks.shares.len();
            assert_eq!(parts, threads.min(count).max(1), "{count} / {threads}");
            let bounds: Vec<(usize, usize)> = chunks
                .shares
                .iter()
                .map(|s| (s.next.load(Ordering::Relaxed), s.end))
                .collect();
            assert_eq!(bounds.first().map_or(0, |b| b.0), 0);
            assert_eq!(bounds.last().map_or(0, |b| b.1), count);
            for (a, b) in bounds.iter().zip(bounds.iter().skip(1)) {
                assert_eq!(a.1, b.0, "contiguous: {bounds:?}");
            }
            assert!(bounds
                .iter()
                .all(|(lo, hi)| hi - lo <= count.div_ceil(parts)));
            // The last thread drains alone: its share, then the others' from the first.
            chunks.drain(parts - 1);
            let last = bounds[parts - 1].0;
            let want: Vec<usize> = (last..count).chain(0..last).collect();
            assert_eq!(*order.lock().unwrap(), want, "{count} / {threads}");
            assert_eq!(chunks.done.load(Ordering::Relaxed), count);
        }
    }

    /// Given shares cover every chunk once, whatever the starts say.
    #[test]
    fn given_shares_cover_every_chunk_once() {
        for starts in [&[0, 2, 9][..], &[3, 5], &[0, 7, 4, 40], &[0]] {
            let hits: Vec<AtomicUsize> = (0..10).map(|_| AtomicUsize::new(0)).collect();
            run_split(10, starts, &|c| {
                hits[c].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "{starts:?}"
            );
        }
    }

    #[test]
    fn every_chunk_of_a_slice_is_visited_once_with_its_index() {
        for (len, chunk) in [(0, 4), (3, 4), (4, 4), (1000, 7), (100_000, 1 << 14)] {
            let mut data = vec![0usize; len];
            for_each_chunk(&mut data, chunk, &|c, part| {
                for (i, v) in part.iter_mut().enumerate() {
                    *v += c * chunk + i + 1;
                }
            });
            assert!(
                data.iter().enumerate().all(|(i, &v)| v == i + 1),
                "{len}/{chunk}"
            );
        }
    }

    /// Chunks are whole units; one for small passes; otherwise at least as many as
    /// `SERIAL_VALUES`-long ones would make (or one per unit), none longer than an even
    /// split of the units over one chunk fewer.
    #[test]
    fn chunks_are_whole_even_units() {
        let cases = [
            (0, 576),
            (576, 576),
            (18_432, 576),
            (49_152, 1),
            (294_912, 576),
            (100_003, 1),
            (1 << 16, 1 << 15),
        ];
        for threads in [1, 2, 3, 16] {
            for (len, unit) in cases {
                let chunk = chunk_len_for(len, unit, threads);
                assert_eq!(chunk % unit, 0, "{len} {unit}");
                if len <= SERIAL_VALUES {
                    assert!(chunk >= len, "{len} {unit}");
                    continue;
                }
                let (units, count) = (len.div_ceil(unit), len.div_ceil(chunk));
                assert!(
                    count >= len.div_ceil(SERIAL_VALUES).min(units),
                    "{len} {unit}"
                );
                assert!(
                    chunk / unit <= units.div_ceil(count - 1).max(1),
                    "{len} {unit}"
                );
            }
        }
        assert_eq!(chunk_len_for(18_432, 576, 2), 16 * 576);
        assert_eq!(chunk_len_for(49_152, 1, 2), 12_288);
    }
}
