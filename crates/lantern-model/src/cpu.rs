//! The SIMD level lantern's kernels run at, and what the binary and the CPU offer.
//!
//! Every kernel on the hot path (matrix products, norms, RoPE, activations, attention,
//! the logits row) is compiled per level and picked at run time
//! ([`lantern_quant::active_kernel`]), so the build needs no `target-cpu` setting; the
//! features the binary was compiled with are reported only as information.

/// Instruction-set extensions the kernels may use, as compiled and as detected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimdLevel {
    /// Features the binary was compiled with (what candle's `cfg` paths use).
    pub compiled: Vec<&'static str>,
    /// Features this CPU reports at run time.
    pub detected: Vec<&'static str>,
}

impl SimdLevel {
    /// The kernel level in effect (see [`lantern_quant::active_kernel`] and
    /// [`lantern_quant::Kernel::name`]).
    pub fn summary(&self) -> &'static str {
        lantern_quant::kernel_level()
    }
}

impl std::fmt::Display for SimdLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (compiled: {}; cpu: {})",
            self.summary(),
            join(&self.compiled),
            join(&self.detected)
        )
    }
}

fn join(features: &[&str]) -> String {
    if features.is_empty() {
        "none".to_string()
    } else {
        features.join(" ")
    }
}

/// The level of this binary on this machine.
pub fn simd_level() -> SimdLevel {
    let mut compiled = Vec::new();
    let mut detected = Vec::new();
    macro_rules! feature {
        ($name:tt) => {
            #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
            {
                if cfg!(target_feature = $name) {
                    compiled.push($name);
                }
                if std::arch::is_x86_feature_detected!($name) {
                    detected.push($name);
                }
            }
        };
    }
    feature!("sse4.2");
    feature!("avx");
    feature!("avx2");
    feature!("fma");
    feature!("f16c");
    feature!("avx512f");
    feature!("avx512bw");
    feature!("avx512vl");
    feature!("avx512vnni");
    feature!("avx512bf16");
    feature!("avxvnni");
    #[cfg(target_arch = "aarch64")]
    {
        if cfg!(target_feature = "neon") {
            compiled.push("neon");
            detected.push("neon");
        }
    }
    SimdLevel { compiled, detected }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compiled_features_are_available_on_this_cpu() {
        // A binary compiled for features the CPU lacks would crash on the first such
        // instruction; a test binary that runs at all must see its features detected.
        let level = simd_level();
        for f in &level.compiled {
            assert!(level.detected.contains(f), "{f} compiled but not detected");
        }
    }

    #[test]
    fn the_summary_is_the_level_in_effect() {
        assert_eq!(simd_level().summary(), lantern_quant::kernel_level());
    }
}
