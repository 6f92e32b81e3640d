//! Faults raised on purpose, so tests can check that a panic is contained: the engine
//! thread and the capture worker must survive one, fail only the work in flight, and go
//! on serving. Compiled in (the tests drive a real server), off unless asked for, and
//! not a user feature.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Fires once, on its N-th [`Trigger::hit`] (1-based); never when unset.
#[derive(Debug, Clone, Default)]
pub struct Trigger {
    at: Option<u64>,
    seen: Arc<AtomicU64>,
}

impl Trigger {
    pub fn at(n: u64) -> Self {
        Self {
            at: Some(n),
            seen: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Counts one event; true for the one the trigger fires on.
    pub fn hit(&self) -> bool {
        match self.at {
            None => false,
            Some(n) => self.seen.fetch_add(1, Ordering::SeqCst) + 1 == n,
        }
    }

    /// Panics when this event is the one it fires on.
    pub fn panic_if_hit(&self, what: &str) {
        if self.hit() {
            panic!("injected fault: panic {what}");
        }
    }
}

/// Where to panic: each trigger counts its own events.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    /// Inside the N-th engine step, after the scheduler allocated its blocks.
    pub step: Trigger,
    /// While admitting the N-th sequence.
    pub admission: Trigger,
    /// While finalizing the N-th capture (on the capture worker).
    pub capture: Trigger,
    /// In the N-th [`crate::Engine::reset`] (the restart after a contained panic).
    pub reset: Trigger,
}

impl std::str::FromStr for FaultPlan {
    type Err = String;

    /// `panic-at-step:N`, `panic-at-admission:N`, `panic-at-capture:N`,
    /// `panic-at-reset:N`, comma-separated.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut plan = FaultPlan::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, n) = part
                .split_once(':')
                .ok_or_else(|| format!("{part:?}: expected NAME:N"))?;
            let n: u64 = n
                .parse()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{part:?}: N must be a positive integer"))?;
            let slot = match name {
                "panic-at-step" => &mut plan.step,
                "panic-at-admission" => &mut plan.admission,
                "panic-at-capture" => &mut plan.capture,
                "panic-at-reset" => &mut plan.reset,
                other => return Err(format!("unknown fault {other:?}")),
            };
            *slot = Trigger::at(n);
        }
        Ok(plan)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trigger_fires_once_on_its_nth_event_and_clones_share_the_count() {
        let t = Trigger::at(3);
        let other = t.clone();
        assert_eq!(
            [t.hit(), other.hit(), t.hit(), other.hit()],
            [false, false, true, false]
        );
        assert!(!Trigger::default().hit());
    }

    #[test]
    fn plans_parse_and_bad_ones_are_refused() {
        let plan: FaultPlan = "panic-at-step:2, panic-at-capture:1,panic-at-reset:1"
            .parse()
            .unwrap();
        assert!(!plan.step.hit() && plan.step.hit());
        assert!(plan.capture.hit());
        assert!(plan.reset.hit());
        assert!(!plan.admission.hit());
        for bad in [
            "panic-at-step",
            "panic-at-step:0",
            "explode:1",
            "panic-at-step:x",
        ] {
            assert!(bad.parse::<FaultPlan>().is_err(), "{bad}");
        }
    }
}
