//! The capture worker: one background thread that finalizes captures at the lowest CPU
//! priority, so requests still running keep their cores while maps are computed.
//!
//! Finalization is pure CPU work with no deadline the engine cares about; at normal
//! priority it would take a core from the step loop (on a 2-core machine, about half
//! the decode rate). At nice 19 the scheduler gives it the cycles the engine leaves
//! idle, and about 1.5% of a core when both want it, so a capture still finishes under
//! sustained load.

use std::sync::mpsc;
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A background thread that runs capture jobs in order.
pub struct CaptureWorker {
    tx: Option<mpsc::Sender<Job>>,
    join: Option<JoinHandle<()>>,
}

/// Lowers the calling thread's CPU priority to nice 19 (Linux: niceness is per thread).
fn lower_own_priority() {
    #[cfg(target_os = "linux")]
    // SAFETY: plain system calls on the calling thread's own id; no memory is shared.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        if libc::setpriority(libc::PRIO_PROCESS, tid, 19) != 0 {
            tracing::debug!("could not lower the capture worker's priority");
        }
    }
}

impl CaptureWorker {
    /// Starts the worker thread.
    pub fn start() -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let join = std::thread::Builder::new()
            .name("lantern-capture".to_string())
            .spawn(move || {
                lower_own_priority();
                for job in rx {
                    job();
                }
            })?;
        Ok(Self {
            tx: Some(tx),
            join: Some(join),
        })
    }

    /// Queues `job`; returns `false` when the worker is gone.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) -> bool {
        self.tx
            .as_ref()
            .is_some_and(|tx| tx.send(Box::new(job)).is_ok())
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
            let worker = CaptureWorker::start().unwrap();
            for i in 0..5 {
                let tx = tx.clone();
                assert!(worker.submit(move || tx.send(i).unwrap()));
            }
        }
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
    }
}
