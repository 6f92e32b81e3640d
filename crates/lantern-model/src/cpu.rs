//! The SIMD level the matrix kernels run at.
//!
//! candle picks its quantized kernels with `cfg(target_feature = ...)` at compile time, so
//! what matters is both what the binary was compiled for and what this CPU offers.

/// Instruction-set extensions the kernels may use, as compiled and as detected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimdLevel {
    /// Features the binary was compiled with (what candle's `cfg` paths use).
    pub compiled: Vec<&'static str>,
    /// Features this CPU reports at run time.
    pub detected: Vec<&'static str>,
}

impl SimdLevel {
    /// A one-word summary of the best compiled level: `avx512-vnni`, `avx512`, `avx2`,
    /// `neon` or `scalar`.
    pub fn summary(&self) -> &'static str {
        let has = |f| self.compiled.contains(&f);
        if has("avx512f") && has("avx512vnni") {
            "avx512-vnni"
        } else if has("avx512f") {
            "avx512"
        } else if has("avx2") && has("fma") {
            "avx2"
        } else if has("neon") {
            "neon"
        } else {
            "scalar"
        }
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

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn builds_use_the_machines_vector_extensions() {
        // `.cargo/config.toml` compiles for the native CPU, so every AVX level the CPU has
        // must be compiled in; a scalar build here means candle's fast paths are off.
        let level = simd_level();
        for f in ["avx2", "fma", "avx512f", "avx512vnni"] {
            if level.detected.contains(&f) {
                assert!(
                    level.compiled.contains(&f),
                    "{f} available but not compiled in"
                );
            }
        }
    }
}
