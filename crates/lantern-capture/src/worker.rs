//! The capture worker: one background thread that finalizes captures at the lowest CPU
//! priority, so requests still running keep their cores while maps are computed.
//!
//! Finalization is pure CPU work with no deadline the engine cares about; at normal
//! priority it would take a core from the step loop (on a 2-core machine, about half
//! the decode rate). Nice 19 is not enough: the engine's worker threads meet at many
//! short barriers per step, and each wake-up waited for the nice-19 thread's time
//! slice (measured: a third of the decode rate lost). In `SCHED_IDLE` a waking engine
//! thread preempts the worker at once, so the worker runs only in the cycles the engine
//! leaves idle. Even so, every time it runs it delays the engine's next wake-up a
//! little and takes cache, so while requests are running it also keeps itself to
//! [`BUSY_DUTY_CYCLE`] of a core ([`Pacer`]); when the engine is idle it runs flat out.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

type Job = Box<dyn FnOnce(&Pacer) + Send + 'static>;

/// Share of one core the worker takes while the engine is busy.
pub const BUSY_DUTY_CYCLE: f64 = 0.05;

/// Keeps a job to [`BUSY_DUTY_CYCLE`] of a core while the engine has requests running:
/// after each piece of work it sleeps long enough for the piece to be that share of the
/// time. While the engine is idle it does not wait at all.
pub struct Pacer {
    engine_busy: Arc<AtomicBool>,
    since: std::cell::Cell<Instant>,
}

impl Pacer {
    fn new(engine_busy: Arc<AtomicBool>) -> Self {
        Self {
            engine_busy,
            since: std::cell::Cell::new(Instant::now()),
        }
    }

    /// Whether requests are running now.
    pub fn engine_busy(&self) -> bool {
        self.engine_busy.load(Ordering::Relaxed)
    }

    /// Marks the start of a piece of work.
    pub fn start(&self) {
        self.since.set(Instant::now());
    }

    /// Called between pieces of work: sleeps while the engine is busy, then starts the
    /// next piece.
    pub fn pause(&self) {
        if self.engine_busy() {
            let worked = self.since.get().elapsed();
            std::thread::sleep(
                worked
                    .mul_f64(1.0 / BUSY_DUTY_CYCLE - 1.0)
                    .min(Duration::from_secs(5)),
            );
        }
        self.start();
    }
}

/// Captures waiting for the worker from which new capturing requests are refused, by
/// default. Each waiting job holds its request's copied keys and query rows (at most the
/// per-capture cap), so this bounds the memory captures hold between their requests' end
/// and their finalization: at most this many plus the capturing requests running when
/// the queue fills, each of which held its rows already while it ran.
pub const DEFAULT_MAX_QUEUED_CAPTURES: usize = 16;

/// Why a job was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the capture worker is not running")]
    Stopped,
}

/// A background thread that runs capture jobs in order. `max_queued` is an admission
/// threshold ([`is_full`](Self::is_full)), not a limit on [`submit`](Self::submit): a
/// capture admitted while the queue had room is finalized even when its request ends
/// with the queue full, so a burst of capturing requests finishing together loses none
/// of the work they did.
pub struct CaptureWorker {
    tx: Option<mpsc::Sender<Job>>,
    join: Option<JoinHandle<()>>,
    /// Jobs queued and not yet started.
    queued: Arc<AtomicUsize>,
    max_queued: usize,
}

/// Puts the calling thread in Linux's `SCHED_IDLE` class (scheduling policy is per
/// thread), falling back to nice 19.
fn lower_own_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain system calls on the calling thread itself (id 0 / its own tid), with
    // a parameter struct that lives across the call; no memory is shared.
    unsafe {
        let param = libc::sched_param { sched_priority: 0 };
        if libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) != 0 {
            let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
            if libc::setpriority(libc::PRIO_PROCESS, tid, 19) != 0 {
                tracing::debug!("could not lower the capture worker's priority");
            }
        }
    }
}

impl CaptureWorker {
    /// Starts the worker thread; `engine_busy` says when requests are running, so that
    /// jobs pace themselves (see [`Pacer`]); new captures are refused while `max_queued`
    /// jobs wait ([`is_full`](Self::is_full)).
    pub fn start(engine_busy: Arc<AtomicBool>, max_queued: usize) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let join = std::thread::Builder::new()
            .name("lantern-capture".to_string())
            .spawn(move || {
                lower_own_priority();
                let pacer = Pacer::new(engine_busy);
                for job in rx {
                    pacer.start();
                    // One job's panic must not end the thread: the jobs after it (and
                    // every later submit) would fail too.
                    let ran =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&pacer)));
                    if ran.is_err() {
                        tracing::error!("a capture job panicked; the worker goes on");
                    }
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            join: Some(join),
            queued: Arc::new(AtomicUsize::new(0)),
            max_queued,
        })
    }

    /// Queues the job of a capture admitted earlier (its request checked
    /// [`is_full`](Self::is_full) before it ran), however many wait; fails only when the
    /// worker is gone.
    pub fn submit(&self, job: impl FnOnce(&Pacer) + Send + 'static) -> Result<(), SubmitError> {
        let tx = self.tx.as_ref().ok_or(SubmitError::Stopped)?;
        self.queued.fetch_add(1, Ordering::SeqCst);
        let queued = self.queued.clone();
        let job: Job = Box::new(move |pacer| {
            queued.fetch_sub(1, Ordering::SeqCst);
            job(pacer)
        });
        tx.send(job).map_err(|_| {
            self.queued.fetch_sub(1, Ordering::SeqCst);
            SubmitError::Stopped
        })
    }

    /// Jobs waiting to start.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::SeqCst)
    }

    /// Whether `max_queued` jobs or more wait: new capturing requests are refused then.
    pub fn is_full(&self) -> bool {
        self.queued() >= self.max_queued
    }
}

impl Drop for CaptureWorker {
    fn drop(&mut self) {
        // Closing the channel ends the thread once queued jobs are done.
        self.tx.take();
        if let Some(join) = self.join.take() {
            let _ = join.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_jobs_in_order_and_drains_on_drop() {
        let (tx, rx) = mpsc::channel();
        {
            let worker = CaptureWorker::start(Arc::new(AtomicBool::new(true)), 8).unwrap();
            for i in 0..5 {
                let tx = tx.clone();
                worker
                    .submit(move |pacer| {
                        pacer.pause();
                        tx.send(i).unwrap()
                    })
                    .unwrap();
            }
        }
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn a_panicking_job_fails_alone_and_the_worker_serves_the_next() {
        let worker = CaptureWorker::start(Arc::new(AtomicBool::new(false)), 4).unwrap();
        let (tx, rx) = mpsc::channel();
        let before = tx.clone();
        worker.submit(move |_| before.send(0).unwrap()).unwrap();
        worker
            .submit(|_| panic!("injected fault: panic while finalizing a capture"))
            .unwrap();
        let after = tx.clone();
        worker.submit(move |_| after.send(2).unwrap()).unwrap();
        assert_eq!(rx.recv().unwrap(), 0);
        // Generous: the worker is in `SCHED_IDLE` and the panic prints a backtrace, so
        // on a machine whose cores are all busy (tests in parallel, a build beside them)
        // it waits for idle time (10 s once timed out that way).
        let wait = Duration::from_secs(120);
        assert_eq!(rx.recv_timeout(wait).unwrap(), 2);
        assert_eq!(worker.queued(), 0);
        worker.submit(move |_| tx.send(3).unwrap()).unwrap();
        assert_eq!(rx.recv_timeout(wait).unwrap(), 3);
    }

    #[test]
    fn a_full_queue_refuses_admission_but_takes_every_admitted_job() {
        let worker = CaptureWorker::start(Arc::new(AtomicBool::new(false)), 2).unwrap();
        // The first job holds the worker until released, so the next ones wait.
        let (release, held) = mpsc::channel::<()>();
        let (started_tx, started) = mpsc::channel::<()>();
        worker
            .submit(move |_| {
                started_tx.send(()).unwrap();
                held.recv().unwrap();
            })
            .unwrap();
        started.recv().unwrap();
        assert!(!worker.is_full());
        // Four captures admitted while there was room end together: all of them queue.
        let (done_tx, done) = mpsc::channel();
        for i in 0..4 {
            let done_tx = done_tx.clone();
            worker.submit(move |_| done_tx.send(i).unwrap()).unwrap();
        }
        assert_eq!(worker.queued(), 4);
        assert!(worker.is_full());
        release.send(()).unwrap();
        let finished: Vec<i32> = (0..4).map(|_| done.recv().unwrap()).collect();
        assert_eq!(finished, [0, 1, 2, 3]);
        assert_eq!(worker.queued(), 0);
        assert!(!worker.is_full());
    }
}
