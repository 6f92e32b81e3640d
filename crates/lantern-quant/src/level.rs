//! Which kernels run: chosen at run time from what the CPU reports, optionally capped
//! by the `LANTERN_KERNELS` environment variable or forced through [`force_kernel`].

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

/// The environment variable that caps the kernel level (`scalar`, `avx2`, `avx-vnni`,
/// `avx512`, `amx`, or the opt-in `avx512-bf16` and `amx-bf16`).
pub const KERNELS_ENV: &str = "LANTERN_KERNELS";

/// An instruction-set level of the matrix kernels, ordered from the most portable to the
/// fastest. Every level computes bit-identical results ([`Kernel::is_exact`]) but the
/// opt-in [`Kernel::Avx512Bf16`] and [`Kernel::AmxBf16`], which change the products over
/// BF16 weights.
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
    /// AVX-512 as above, and for products of 32 tokens or more over quantized weights
    /// Intel AMX's tile products (`tdpbssd`, Sapphire Rapids and later): the
    /// same exact integer dots per block, so the same bits as [`Kernel::Avx512`]. Needs
    /// the kernel's grant of the tile state, asked for once per process.
    Amx,
    /// The best exact level below, and for BF16 weights AVX-512 BF16's `vdpbf16ps` (Zen
    /// 4/5, Intel Cooper Lake and Sapphire Rapids and later): the activations are rounded
    /// to bf16 (relative error 2^-9 each, as llama.cpp and PyTorch's bf16 products do) and each
    /// instruction sums two products per lane with the CPU's own rounding, so BF16
    /// products lose their bit-identity with the other levels and across CPU makers, for
    /// 1.8x the batched products' speed (1.4x a BF16 model's prefill, Zen 5). Never
    /// chosen by default: only when asked for (`LANTERN_KERNELS=avx512-bf16` or
    /// [`force_kernel`]). Other weight types run as at [`Kernel::Amx`] where the CPU
    /// has it, else at [`Kernel::Avx512`].
    Avx512Bf16,
    /// As [`Kernel::Avx512Bf16`], with BF16 weights' products on AMX-BF16's tiles
    /// (`tdpbf16ps`, Sapphire Rapids and later) at every batch size: activations rounded to
    /// bf16 as there, but each instruction sums the products of a pair in the other order
    /// and treats bf16 denormals as zero, so its results are its own (batch invariant,
    /// still). Opt-in only (`LANTERN_KERNELS=amx-bf16`); where the CPU lacks AMX-BF16 it
    /// caps to `avx512-bf16`.
    AmxBf16,
}

impl Kernel {
    /// Every level, most portable first.
    pub const ALL: [Kernel; 7] = [
        Kernel::Scalar,
        Kernel::Avx2,
        Kernel::AvxVnni,
        Kernel::Avx512,
        Kernel::Amx,
        Kernel::Avx512Bf16,
        Kernel::AmxBf16,
    ];

    /// The best exact level this CPU runs: the default.
    pub fn detect() -> Kernel {
        Kernel::Amx.capped()
    }

    /// The vector level whose element-wise code runs at this level: [`Kernel::Amx`] and
    /// the BF16 levels add their own products to [`Kernel::Avx512`]'s vectors.
    pub fn vectors(self) -> Kernel {
        match self {
            Kernel::Amx | Kernel::Avx512Bf16 | Kernel::AmxBf16 => Kernel::Avx512,
            level => level,
        }
    }

    /// Whether the level gives the same results as every other exact level, bit for bit.
    pub fn is_exact(self) -> bool {
        !matches!(self, Kernel::Avx512Bf16 | Kernel::AmxBf16)
    }

    /// The level products over `ty` weights run at when `self` is in effect: the BF16
    /// levels are themselves for BF16 weights only, and [`Kernel::Amx`] for the quantized
    /// types only; the others run at the best level below.
    pub fn for_type(self, ty: crate::QuantType) -> Kernel {
        match self {
            Kernel::Avx512Bf16 | Kernel::AmxBf16 if ty == crate::QuantType::BF16 => self,
            Kernel::Avx512Bf16 | Kernel::AmxBf16 | Kernel::Amx if ty.is_dense() => Kernel::Avx512,
            Kernel::Avx512Bf16 | Kernel::AmxBf16 => Kernel::Amx.capped().for_type(ty),
            Kernel::Amx if !ty.has_tiles() => Kernel::Avx512,
            level => level,
        }
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
            Kernel::Amx => "amx",
            Kernel::Avx512Bf16 => "avx512-bf16",
            Kernel::AmxBf16 => "amx-bf16",
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
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => crate::x86::avx512_available() && crate::x86::amx::available(),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Bf16 => crate::x86::avx512_bf16_available(),
            #[cfg(target_arch = "x86_64")]
            Kernel::AmxBf16 => {
                crate::x86::avx512_bf16_available() && crate::x86::amx_bf16::available()
            }
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
static AVAILABLE: OnceLock<[bool; 7]> = OnceLock::new();
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

/// The name of [`active_kernel`]: `"scalar"`, `"avx2"`, `"avx-vnni"`, `"avx512"`,
/// `"amx"`, `"avx512-bf16"` or `"amx-bf16"`.
pub fn kernel_level() -> &'static str {
    active_kernel().name()
}

/// The level asked for by the variable's value (unset or empty: the best exact one),
/// capped at what the CPU has, with one warning on stderr when capped or not understood.
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
                "warning: {KERNELS_ENV}={value:?} is not one of scalar, avx2, avx-vnni, avx512, \
                 amx, avx512-bf16, amx-bf16; \
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
        assert_eq!(level_from_env(Some("AMX")), Kernel::Amx.capped());
        assert_eq!(
            level_from_env(Some("AVX512-BF16")),
            Kernel::Avx512Bf16.capped()
        );
        assert_eq!(level_from_env(Some("amx-bf16")), Kernel::AmxBf16.capped());
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
        assert_eq!(Kernel::detect(), Kernel::Amx.capped());
        assert!(Kernel::detect().is_exact(), "the default is exact");
    }

    #[test]
    fn only_bf16_weights_see_the_bf16_levels_and_only_quantized_ones_amx() {
        use crate::QuantType;
        for ty in QuantType::ALL {
            for bf16_level in [Kernel::Avx512Bf16, Kernel::AmxBf16] {
                let want = if ty == QuantType::BF16 {
                    bf16_level
                } else if ty.is_dense() {
                    Kernel::Avx512
                } else {
                    Kernel::Amx.capped().for_type(ty)
                };
                assert_eq!(bf16_level.for_type(ty), want);
            }
            let amx = if !ty.has_tiles() {
                Kernel::Avx512
            } else {
                Kernel::Amx
            };
            assert_eq!(Kernel::Amx.for_type(ty), amx);
            for k in Kernel::ALL
                .into_iter()
                .filter(|k| k.is_exact() && *k != Kernel::Amx)
            {
                assert_eq!(k.for_type(ty), k);
            }
        }
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
