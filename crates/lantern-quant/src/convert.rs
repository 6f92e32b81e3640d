//! Slice conversions between f32 and the KV cache's 16-bit types, at the active kernel
//! level: F16C's `vcvtph2ps`/`vcvtps2ph` (AVX2 and AVX-512 levels; f16 to f32 16 wide at
//! AVX-512, which made decode over 2048 tokens of f16 cache ~9% faster) for f16, shifts
//! for bf16. `half`'s slice conversions call a non-inlined function per 8 values and detect
//! the CPU on the way; the attention kernel converts every key and value it reads, so
//! that showed in profiles. Every level gives exactly `half`'s results (round to nearest
//! even; NaN stays NaN).

use half::{bf16, f16};

/// `dst[i] = src[i] as f32` (exact).
///
/// # Panics
/// If the lengths differ.
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16_to_f32: lengths differ");
    #[cfg(target_arch = "x86_64")]
    match crate::active_kernel().vectors() {
        // SAFETY: `active_kernel` never exceeds what the CPU reports.
        crate::Kernel::Avx512 => return unsafe { x86::f16_to_f32_avx512(src, dst) },
        // SAFETY: every other SIMD level includes AVX2 + F16C.
        crate::Kernel::Avx2 | crate::Kernel::AvxVnni => {
            return unsafe { x86::f16_to_f32(src, dst) }
        }
        _ => {} // scalar
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// `dst[i] = src[i]` rounded to f16 (nearest even, as [`f16::from_f32`](half::f16::from_f32)).
///
/// # Panics
/// If the lengths differ.
pub fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_f16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if crate::active_kernel() != crate::Kernel::Scalar {
        // SAFETY: as in `f16_to_f32`.
        return unsafe { x86::f32_to_f16(src, dst) };
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(*s);
    }
}

crate::per_level! {
    /// `dst[i] = src[i] as f32` (exact: bf16 is the top half of an f32).
    pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
        assert_eq!(src.len(), dst.len(), "bf16_to_f32: lengths differ");
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits(u32::from(s.to_bits()) << 16);
        }
    }

    /// `dst[i] = src[i]` rounded to bf16 (nearest even, NaN kept a quiet NaN, as
    /// [`bf16::from_f32`]).
    pub fn f32_to_bf16(src: &[f32], dst: &mut [bf16]) {
        assert_eq!(src.len(), dst.len(), "f32_to_bf16: lengths differ");
        for (d, s) in dst.iter_mut().zip(src) {
            let x = s.to_bits();
            let rounded = (x + 0x7FFF + ((x >> 16) & 1)) >> 16;
            let quiet_nan = (x >> 16) | 0x40;
            let bits = if s.is_nan() { quiet_nan } else { rounded };
            *d = bf16::from_bits(bits as u16);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::f16;
    use std::arch::x86_64::*;

    /// [`f16_to_f32`] 16 values at a time.
    ///
    /// # Safety
    /// The CPU supports AVX-512 F; the lengths are equal.
    #[target_feature(enable = "avx512f,avx2,f16c")]
    pub(super) unsafe fn f16_to_f32_avx512(src: &[f16], dst: &mut [f32]) {
        let n = src.len();
        let (s, d) = (src.as_ptr().cast::<u16>(), dst.as_mut_ptr());
        let mut i = 0;
        while i + 16 <= n {
            let h = _mm256_loadu_si256(s.add(i).cast());
            _mm512_storeu_ps(d.add(i), _mm512_cvtph_ps(h));
            i += 16;
        }
        f16_to_f32(&src[i..], &mut dst[i..]);
    }

    /// # Safety
    /// The CPU supports AVX2 and F16C; the lengths are equal.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        let n = src.len();
        let (s, d) = (src.as_ptr().cast::<u16>(), dst.as_mut_ptr());
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm_loadu_si128(s.add(i).cast());
            _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(h));
            i += 8;
        }
        for (x, y) in src[i..].iter().zip(&mut dst[i..]) {
            *y = x.to_f32();
        }
    }

    /// # Safety
    /// The CPU supports AVX2 and F16C; the lengths are equal.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f32_to_f16(src: &[f32], dst: &mut [f16]) {
        let n = src.len();
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr().cast::<u16>());
        let mut i = 0;
        while i + 8 <= n {
            let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s.add(i)));
            _mm_storeu_si128(d.add(i).cast(), h);
            i += 8;
        }
        for (x, y) in src[i..].iter().zip(&mut dst[i..]) {
            *y = f16::from_f32(*x);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{force_kernel, Kernel};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// Values of every magnitude f16 and bf16 meet: normal, subnormal, overflowing,
    /// halfway cases, signed zeros, infinities and NaN.
    fn samples(rng: &mut StdRng, n: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n)
            .map(|i| match i % 4 {
                0 => rng.gen_range(-4.0f32..4.0),
                1 => rng.gen_range(-1e-6f32..1e-6),
                2 => f32::from_bits(rng.gen::<u32>()),
                _ => f16::from_bits(rng.gen::<u16>()).to_f32() + f32::EPSILON,
            })
            .collect();
        v.extend([
            0.0,
            -0.0,
            65504.0,
            65520.0,
            1e9,
            f32::INFINITY,
            -f32::INFINITY,
            f32::NAN,
        ]);
        v
    }

    fn same(a: f32, b: f32) -> bool {
        a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
    }

    #[test]
    fn every_level_converts_exactly_as_half_does() {
        let mut rng = StdRng::seed_from_u64(7);
        // 1017 (1009 + 8 specials): whole 16- and 8-wide vectors and a scalar tail.
        let x = samples(&mut rng, 1009);
        for level in Kernel::ALL.into_iter().filter(|k| k.available()) {
            force_kernel(Some(level));
            let mut h = vec![f16::ZERO; x.len()];
            f32_to_f16(&x, &mut h);
            let mut back = vec![0f32; x.len()];
            f16_to_f32(&h, &mut back);
            let mut b = vec![bf16::ZERO; x.len()];
            f32_to_bf16(&x, &mut b);
            let mut back_b = vec![0f32; x.len()];
            bf16_to_f32(&b, &mut back_b);
            for i in 0..x.len() {
                let (want_h, want_b) = (f16::from_f32(x[i]), bf16::from_f32(x[i]));
                assert!(
                    same(h[i].to_f32(), want_h.to_f32()),
                    "{level:?} f16 of {}",
                    x[i]
                );
                assert!(
                    same(back[i], want_h.to_f32()),
                    "{level:?} f16 back {}",
                    x[i]
                );
                assert!(
                    same(b[i].to_f32(), want_b.to_f32()),
                    "{level:?} bf16 of {}",
                    x[i]
                );
                assert!(
                    same(back_b[i], want_b.to_f32()),
                    "{level:?} bf16 back {}",
                    x[i]
                );
            }
        }
        force_kernel(None);
    }
}
