//! How many compute threads lantern starts: rayon's global pool (weight repacking at load,
//! structured-output masks), whose size also sets the product helpers' ([`crate::share`]:
//! one fewer than the pool), which compute every step with the engine thread.
//!
//! The default is the machine's physical cores, not its logical CPUs: two hardware
//! threads of one core share its vector units and caches, so a second thread per core
//! adds contention to these memory- and FMA-bound kernels, and the threads that wait on
//! the slowest one lose more than the extra thread gains.

/// The environment variable that sizes the pool when no count is given.
pub const THREADS_ENV: &str = "RAYON_NUM_THREADS";

/// The default pool size: `RAYON_NUM_THREADS` when set to a positive number, else the
/// physical cores, at most the CPUs this process may run on (affinity, cgroup quota).
pub fn default_compute_threads() -> usize {
    if let Some(n) = std::env::var(THREADS_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .filter(|&n| n > 0)
    {
        return n;
    }
    let allowed = std::thread::available_parallelism().map_or(1, |n| n.get());
    num_cpus::get_physical().clamp(1, allowed)
}

/// Sizes the global compute pool before anything uses it: `requested` threads, or
/// [`default_compute_threads`]. Returns the pool's size. Fails when the pool already
/// runs with another size (it is sized once per process).
pub fn init_compute_pool(requested: Option<usize>) -> Result<usize, PoolAlreadySized> {
    let threads = requested.unwrap_or_else(default_compute_threads).max(1);
    let built = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("lantern-compute-{i}"))
        .build_global();
    match built {
        Ok(()) => Ok(threads),
        Err(_) if rayon::current_num_threads() == threads || requested.is_none() => {
            Ok(rayon::current_num_threads())
        }
        Err(_) => Err(PoolAlreadySized {
            running: rayon::current_num_threads(),
            requested: threads,
        }),
    }
}

/// The compute pool was already started with another size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolAlreadySized {
    pub running: usize,
    pub requested: usize,
}

impl std::fmt::Display for PoolAlreadySized {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the compute pool of this process already has {} threads ({} asked for); it is sized once per process, before the first model is loaded",
            self.running, self.requested
        )
    }
}

impl std::error::Error for PoolAlreadySized {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_is_physical_cores_within_the_allowed_cpus() {
        let allowed = std::thread::available_parallelism().unwrap().get();
        let n = default_compute_threads();
        if std::env::var(THREADS_ENV).is_err() {
            assert!(
                n >= 1 && n <= allowed,
                "{n} threads, {allowed} CPUs allowed"
            );
            assert!(n <= num_cpus::get_physical().max(1));
        }
    }
}
