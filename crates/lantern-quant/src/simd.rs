//! Element-wise f32 code (norms, RoPE, activations, attention's dot products and
//! softmax) compiled once per kernel level and picked at run time.
//!
//! Such loops are written as plain Rust that LLVM vectorizes; what it vectorizes them
//! *for* is fixed at compile time by the target features. [`per_level!`](crate::per_level)
//! compiles a function's body three times, for AVX-512, for AVX2 + FMA and for the
//! baseline target, and calls the copy of the level in effect ([`active_kernel`]), so a
//! portable binary gets 256- or 512-bit vectors on the CPUs that have them and
//! `LANTERN_KERNELS` governs these loops as it does the matrix kernels.
//!
//! Bodies should use [`fma`] for multiply-adds and keep an explicit accumulation order
//! (fixed-width lane arrays): the copies then compute bit-identical results, since a
//! vector FMA lane rounds exactly as a scalar `mul_add`.
//!
//! [`active_kernel`]: crate::active_kernel

/// `x * y + acc` with one rounding, at every level (a hardware FMA where the level has
/// one, libm's correctly rounded `fmaf` otherwise), so all levels agree bit for bit.
#[inline(always)]
pub fn fma(x: f32, y: f32, acc: f32) -> f32 {
    x.mul_add(y, acc)
}

/// `e^x` for f32, written as branch-free arithmetic so a loop over a slice vectorizes
/// (libm's `expf` is one call per element and dominated the softmax).
///
/// Cephes' method: `x = n ln2 + r` with `|r| <= ln2 / 2`, a degree-6 polynomial for
/// `e^r`, and `2^n` built in the exponent bits. Relative error about 2e-7 (a couple of
/// ulp) over the whole range. Inputs are clamped to `[-87.3, 88]`, so results below
/// `f32::MIN_POSITIVE` flush to about `1e-38` instead of 0 (irrelevant next to the
/// row's maximum weight of 1) and large inputs saturate instead of overflowing. NaN
/// stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
    let nan = x.is_nan();
    let x = x.clamp(-87.336_54, 88.0);
    let n = fma(x, LOG2E, 0.5).floor();
    let r = fma(n, -LN2_LO, fma(n, -LN2_HI, x));
    let mut p = P[0];
    for c in &P[1..] {
        p = fma(p, r, *c);
    }
    let e_r = fma(p, r * r, r) + 1.0;
    // 2^n in the exponent bits without a float-to-int conversion (whose saturating
    // semantics kept the loop scalar): n is a whole number in [-126, 127], so adding
    // 1.5 * 2^23 puts it in the low mantissa bits, as an offset from the bits of 1.5 * 2^23.
    const MAGIC: f32 = 12_582_912.0;
    let biased = (n + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits() - 127);
    let two_n = f32::from_bits(biased << 23);
    if nan {
        f32::NAN
    } else {
        e_r * two_n
    }
}

/// Defines a function whose body is compiled for each kernel level and dispatched at
/// run time on [`active_kernel`](crate::active_kernel).
///
/// ```
/// lantern_quant::per_level! {
///     /// Doubles every value.
///     pub fn double(x: &mut [f32]) {
///         for v in x.iter_mut() {
///             *v *= 2.0;
///         }
///     }
/// }
/// let mut v = [1.0f32, 2.0];
/// double(&mut v);
/// assert_eq!(v, [2.0, 4.0]);
/// ```
///
/// The function may not be generic; lifetimes must be elided. Helpers the body calls are
/// compiled for the level only if they are inlined into it (`#[inline(always)]`).
#[macro_export]
macro_rules! per_level {
    ($(
        $(#[$meta:meta])*
        $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    )*) => {$(
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
                unsafe fn avx512($($arg: $ty),*) $(-> $ret)? $body
                #[target_feature(enable = "avx2,fma,f16c")]
                unsafe fn avx2($($arg: $ty),*) $(-> $ret)? $body
                match $crate::active_kernel().vectors() {
                    // SAFETY: `active_kernel` never exceeds what the CPU reports.
                    $crate::Kernel::Avx512 => return unsafe { avx512($($arg),*) },
                    // AVX-VNNI adds integer dot products only: element-wise code is AVX2's.
                    $crate::Kernel::Avx2 | $crate::Kernel::AvxVnni => {
                        return unsafe { avx2($($arg),*) }
                    }
                    _ => {} // scalar
                }
            }
            $body
        }
    )*};
}

#[cfg(test)]
mod tests {
    use super::exp;

    fn rel_err(x: f32) -> f64 {
        let want = (x as f64).exp();
        ((exp(x) as f64) - want).abs() / want
    }

    /// Every power of two the exponent trick builds, and the range between, against f64.
    #[test]
    fn exp_is_accurate_over_its_range() {
        for n in -125..=126 {
            let x = n as f32 * std::f32::consts::LN_2;
            assert!(rel_err(x) < 5e-7, "x = {x}: {}", rel_err(x));
        }
        let mut worst = 0f64;
        let mut x = -87.3f32;
        while x < 88.0 {
            worst = worst.max(rel_err(x));
            x += 0.000_731;
        }
        assert!(worst < 5e-7, "worst relative error {worst}");
    }

    #[test]
    fn exp_ends_and_nan() {
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::NEG_INFINITY) < 1e-37 && exp(f32::NEG_INFINITY) >= 0.0);
        assert!(exp(-1e30) < 1e-37);
        assert!(exp(f32::INFINITY).is_finite() && exp(f32::INFINITY) > 1e38);
        assert!(exp(f32::NAN).is_nan());
    }
}
