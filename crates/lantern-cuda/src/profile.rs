//! Device time per kernel, for finding where a step goes (`LANTERN_CUDA_PROFILE=on`).
//!
//! Every eager launch (and cuBLAS product) is bracketed by two timing events on the
//! stream; their elapsed times are summed by kernel name. Steps replayed from CUDA
//! graphs launch nothing from the host and are not broken down: profile with
//! `--enforce-eager`, and compare the sum with the step's wall time to see what launching
//! costs. The events add their own small cost, so figures taken with the profiler on are
//! for the breakdown, not for the headline speed.

use std::collections::BTreeMap;
use std::sync::Mutex;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaEvent, CudaStream};
use lantern_attn::KernelTime;

use crate::Result;

/// Launches timed before their events are read (which waits for the device).
const PENDING_MAX: usize = 4096;

/// Whether `LANTERN_CUDA_PROFILE` asks for the profiler.
pub(crate) fn profiler_requested() -> bool {
    requests_profile(std::env::var("LANTERN_CUDA_PROFILE").ok().as_deref())
}

fn requests_profile(setting: Option<&str>) -> bool {
    matches!(setting.map(str::trim), Some("on" | "1" | "true" | "yes"))
}

#[derive(Default)]
pub(crate) struct Profiler {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    pending: Vec<(&'static str, CudaEvent, CudaEvent)>,
    /// Launches and seconds per kernel name.
    totals: BTreeMap<&'static str, (u64, f64)>,
}

impl State {
    fn read_pending(&mut self) -> Result<()> {
        for (name, start, end) in self.pending.drain(..) {
            let ms = start.elapsed_ms(&end)?;
            let entry = self.totals.entry(name).or_default();
            entry.0 += 1;
            entry.1 += f64::from(ms) / 1e3;
        }
        Ok(())
    }
}

impl Profiler {
    /// Runs `work` (which queues `name` on `stream`) between two timing events.
    pub(crate) fn time<T>(
        &self,
        stream: &CudaStream,
        name: &'static str,
        work: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let out = work()?;
        let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.pending.push((name, start, end));
        if state.pending.len() >= PENDING_MAX {
            state.read_pending()?;
        }
        Ok(out)
    }

    /// Each kernel's launches and device time so far, the longest total first.
    pub(crate) fn report(&self) -> Result<Vec<KernelTime>> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.read_pending()?;
        let mut times: Vec<KernelTime> = state
            .totals
            .iter()
            .map(|(name, &(launches, seconds))| KernelTime {
                name: name.to_string(),
                launches,
                seconds,
            })
            .collect();
        times.sort_by(|a, b| b.seconds.total_cmp(&a.seconds).then(a.name.cmp(&b.name)));
        Ok(times)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_takes_on_and_its_synonyms_only() {
        for on in ["on", " 1 ", "true", "yes"] {
            assert!(requests_profile(Some(on)), "{on:?}");
        }
        for off in [None, Some("off"), Some(""), Some("0")] {
            assert!(!requests_profile(off), "{off:?}");
        }
    }
}
