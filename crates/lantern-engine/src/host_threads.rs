//! How many host threads finalizing a capture may use: the cores the engine leaves idle.
//! On the CPU the step's threads (`--threads`) compute the forward, so a capture is
//! finalized beside them on what is left, at least one thread (the capture worker's,
//! which paces itself while requests run); on a GPU the host computes next to nothing,
//! so every core but the engine thread's may finalize; and while the engine is idle
//! (the server and Python with no request running, the CLI after its prompts) every
//! core may.

/// `LANTERN_CAPTURE_THREADS=N` sets the count instead (at least 1).
const ENV: &str = "LANTERN_CAPTURE_THREADS";

/// Threads a capture's finalizing may use on this machine, the calling thread included,
/// for an engine whose forward runs on the host (`on_host`) or on a GPU.
pub fn finalize_threads(on_host: bool) -> usize {
    if let Some(n) = env_threads() {
        return n;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let computing = if on_host {
        rayon::current_num_threads()
    } else {
        1
    };
    spare(cores, computing)
}

/// Threads a capture's finalizing may use while the engine computes nothing (every
/// request done): every core.
pub fn idle_finalize_threads() -> usize {
    env_threads().unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn env_threads() -> Option<usize> {
    let n = std::env::var(ENV).ok()?.trim().parse::<usize>().ok()?;
    Some(n.max(1))
}

/// The cores `computing` threads leave of `cores`, at least one.
fn spare(cores: usize, computing: usize) -> usize {
    cores.saturating_sub(computing).max(1)
}

#[cfg(test)]
mod tests {
    use super::spare;

    #[test]
    fn finalizing_takes_the_cores_the_forward_leaves_and_at_least_one() {
        // A CPU engine on every core (the default) leaves one thread, the worker's.
        assert_eq!(spare(2, 2), 1);
        assert_eq!(spare(16, 16), 1);
        // `--threads 8` on 16 cores, and a GPU engine on a 16-core host.
        assert_eq!(spare(16, 8), 8);
        assert_eq!(spare(16, 1), 15);
        // More threads than cores (oversubscribed): still one.
        assert_eq!(spare(4, 8), 1);
    }
}
