//! Which kernels run: chosen at run time from what the CPU reports, optionally capped
//! by the `LANTERN_KERNELS` environment variable or forced through [`force_kernel`].

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// The environment variable that caps the kernel level (`scalar`, `avx2`, `avx-vnni` or
/// `avx512`).
pub const KERNELS_ENV: &str = "LANTERN_KERNELS";

/// An instruction-set level of the matrix kernels. Every level computes bit-identical
/// results; the levels are ordered from the most portable to the fastest.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kernel {
    /// Portable scalar code.
    Scalar,
    /// AVX2 + FMA + F16C (x86-64): `vpmaddubsw` / `vpmaddwd` integer dot products.
    Avx2,
    /// AVX2 + AVX-VNNI (x86-64 without AVX-512: Intel Alder Lake and later client CPUs):
    /// the AVX2 kernels with the 256-bit `vpdpbusd` for the integer dot products.
    AvxVnni,
    /// AVX-512 F/BW + VNNI (x86-64): `vpdpbusd` integer dot products.
    Avx512,
}

impl Kernel {
    /// Every level, most portable first.
    pub const ALL: [Kernel; 4] = [
        Kernel::Scalar,
        Kernel::Avx2,
        Kernel::AvxVnni,
        Kernel::Avx512,
    ];

    /// The best level this CPU runs.
    pub fn detect() -> Kernel {
        Kernel::Avx512.capped()
    }

    /// Whether this CPU runs the level (detected once). Levels are not nested: a CPU
    /// with AVX-512 VNNI may lack AVX-VNNI (Ice Lake, Cascade Lake).
    pub fn available(self) -> bool {
        AVAILABLE.get_or_init(|| Kernel::ALL.map(Kernel::cpu_has))[self as usize]
    }

    /// `self`, lowered to the best level at or below it this CPU runs (every matrix
    /// product asks, so it reads the cached detection).
    pub fn capped(self) -> Kernel {
        Kernel::ALL
            .into_iter()
            .rev()
            .find(|k| *k <= self && k.available())
            .unwrap_or(Kernel::Scalar)
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::AvxVnni => "avx-vnni",
            Kernel::Avx512 => "avx512",
        }
    }

    /// The level named `name` (as [`Kernel::name`] writes it), case-insensitive.
    pub fn parse(name: &str) -> Option<Kernel> {
        Kernel::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(name.trim()))
    }

    fn cpu_has(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => crate::x86::avx2_available(),
            #[cfg(target_arch = "x86_64")]
            Kernel::AvxVnni => crate::x86::avx_vnni_available(),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => crate::x86::avx512_available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    fn to_u8(self) -> u8 {
        self as u8 + 1
    }

    fn from_u8(v: u8) -> Option<Kernel> {
        Kernel::ALL.get(usize::from(v).checked_sub(1)?).copied()
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `cpu_has` of each level, indexed by `Kernel as usize` (the order of `Kernel::ALL`).
static AVAILABLE: OnceLock<[bool; 4]> = OnceLock::new();
static FROM_ENV: OnceLock<Kernel> = OnceLock::new();
/// 0: no override; otherwise `Kernel::to_u8` of the forced level.
static FORCED: AtomicU8 = AtomicU8::new(0);

/// The level [`PackedMatrix::matmul`](crate::PackedMatrix::matmul) runs at: the level
/// forced by [`force_kernel`], else `LANTERN_KERNELS` capped at what the CPU has, else
/// the best level the CPU has.
pub fn active_kernel() -> Kernel {
    if let Some(k) = Kernel::from_u8(FORCED.load(Ordering::Relaxed)) {
        return k;
    }
    *FROM_ENV.get_or_init(|| level_from_env(std::env::var(KERNELS_ENV).ok().as_deref()))
}

/// Forces the level of every later `matmul` (for tests and benchmarks), capped at what
/// the CPU has; `None` returns to the default. Returns the level now in effect.
pub fn force_kernel(level: Option<Kernel>) -> Kernel {
    let v = level.map_or(0, |k| k.capped().to_u8());
    FORCED.store(v, Ordering::Relaxed);
    active_kernel()
}

/// The name of [`active_kernel`]: `"scalar"`, `"avx2"`, `"avx-vnni"` or `"avx512"`.
pub fn kernel_level() -> &'static str {
    active_kernel().name()
}

/// The level asked for by the variable's value (unset or empty: the best), capped at
/// what the CPU has, with one warning on stderr when capped or not understood.
fn level_from_env(value: Option<&str>) -> Kernel {
    let best = Kernel::detect();
    let Some(value) = value.filter(|v| !v.trim().is_empty()) else {
        return best;
    };
    match Kernel::parse(value) {
        Some(asked) if asked.available() => asked,
        Some(asked) => {
            let got = asked.capped();
            eprintln!(
                "warning: {KERNELS_ENV}={} but this CPU does not run it; using `{got}`",
                asked.name()
            );
            got
        }
        None => {
            eprintln!(
                "warning: {KERNELS_ENV}={value:?} is not one of scalar, avx2, avx-vnni, avx512; \
                 using `{best}`"
            );
            best
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_values_are_capped_at_the_cpu() {
        let best = Kernel::detect();
        assert_eq!(level_from_env(None), best);
        assert_eq!(level_from_env(Some("")), best);
        assert_eq!(level_from_env(Some("scalar")), Kernel::Scalar);
        assert_eq!(level_from_env(Some("AVX2")), Kernel::Avx2.capped());
        assert_eq!(level_from_env(Some("avx-vnni")), Kernel::AvxVnni.capped());
        assert_eq!(level_from_env(Some("avx512")), Kernel::Avx512.capped());
        assert_eq!(level_from_env(Some("sse9")), best);
    }

    #[test]
    fn capping_finds_the_best_level_the_cpu_runs_at_or_below() {
        for asked in Kernel::ALL {
            let got = asked.capped();
            assert!(got <= asked && got.available());
            assert!(Kernel::ALL
                .into_iter()
                .all(|k| !(k > got && k <= asked && k.available())));
        }
        assert_eq!(Kernel::detect(), Kernel::Avx512.capped());
    }

    #[test]
    fn names_round_trip() {
        for k in Kernel::ALL {
            assert_eq!(Kernel::parse(k.name()), Some(k));
            assert_eq!(Kernel::from_u8(k.to_u8()), Some(k));
        }
        assert_eq!(Kernel::from_u8(0), None);
    }
}
