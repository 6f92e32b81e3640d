//! The machine's memory, against which a KV cache on the host is checked before it is
//! allocated: the cache is zeroed pages, promised rather than given, so a budget past
//! the machine's memory would start and then kill the process when the pages are
//! touched (or abort it at once when the promise is refused).

use crate::error::{EngineError, Result};
use lantern_capture::human_bytes;

/// Total memory from `/proc/meminfo` (`MemTotal`), where the system tells it.
pub fn total_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    mem_total(&meminfo)
}

/// `MemTotal:       16083160 kB` in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The machine's memory `total` when `bytes` is more than it (`None` when it fits, or
/// the total is unknown).
pub fn exceeded(bytes: usize, total: Option<u64>) -> Option<u64> {
    total.filter(|&t| bytes as u64 > t)
}

/// Refuses a host KV cache of `kv_bytes` larger than the machine's memory `total`.
pub fn check_kv_cache_fits(kv_bytes: usize, total: Option<u64>) -> Result<()> {
    match exceeded(kv_bytes, total) {
        Some(total) => Err(EngineError::InvalidConfig(format!(
            "--kv-cache-memory: the KV cache would take {} ({kv_bytes} bytes), more than this machine's memory of {}; ask for less (the default is 1G)",
            human_bytes(kv_bytes as u64),
            human_bytes(total)
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_past_the_machines_memory_is_refused() {
        let meminfo = "MemTotal:       16083160 kB\nMemFree:         1000 kB\n";
        let total = mem_total(meminfo);
        assert_eq!(total, Some(16083160 * 1024));
        assert!(check_kv_cache_fits(1 << 30, total).is_ok());
        let e = check_kv_cache_fits(64 << 30, total)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--kv-cache-memory") && e.contains("64"), "{e}");
        assert!(
            check_kv_cache_fits(usize::MAX, None).is_ok(),
            "unknown: not refused"
        );
        assert!(total_bytes().is_some_and(|t| t > 0) || !cfg!(target_os = "linux"));
    }
}
