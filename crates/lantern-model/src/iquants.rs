//! The 4-bit types lantern reads by widening them at load: llama.cpp's non-linear
//! IQ4_NL and IQ4_XS and OCP's MXFP4 (gpt-oss's experts), whose 4-bit codes each pick
//! one of 16 fixed int8 levels, become a type whose kernels lantern has. IQ4's levels
//! (-127 to 113) need Q8_0: twice the memory of the file's tensors. MXFP4's, doubled
//! (-12 to 12), fit Q5_0's 5-bit ones (-16 to 15): 22 bytes per 32 weights where the file
//! has 17 and Q8_0 would take 34.
//!
//! IQ4_NL's blocks are Q8_0's shape (a half-precision scale per 32 weights): widened
//! exactly. IQ4_XS has a half-precision scale per 256 weights and a 6-bit multiplier per
//! 32; their product, rounded to half precision for Q8_0, moves each weight by at most
//! 2^-11 of its block's largest (the 4-bit quantization itself moves weights by several
//! percent).
//!
//! MXFP4's blocks hold a power-of-two scale `2^(e - 128)` (llama.cpp's E8M0 halved, so
//! that the levels are integers) and 32 codes: widened exactly where half precision holds
//! the scale (`e` from 104 to 143, which covers real weights); a smaller scale becomes
//! 2^-24 with the levels rounded (values below 3.6e-7, moved by at most 2^-25); a larger
//! one (weights of 2^16 and more) is an error naming the tensor.

use candle_core::quantized::GgmlDType;
use half::f16;

/// The 16 levels of llama.cpp's `kvalues_iq4nl`.
pub const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The 16 levels of llama.cpp's `kvalues_mxfp4` (FP4 E2M1 values, doubled).
pub const MXFP4_LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Weights per Q8_0 and Q5_0 block.
const BLOCK: usize = 32;
/// Q5_0's levels are `q - 16` for 5-bit `q`.
const Q5_0_OFFSET: i8 = 16;

/// A ggml type read by widening it to one lantern's kernels take ([`Self::target`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WidenedType {
    Iq4Nl,
    Iq4Xs,
    Mxfp4,
}

impl WidenedType {
    /// The type of ggml's type number (ggml.h), if lantern widens it.
    pub fn from_ggml(id: u32) -> Option<Self> {
        match id {
            20 => Some(Self::Iq4Nl),
            23 => Some(Self::Iq4Xs),
            39 => Some(Self::Mxfp4),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Iq4Nl => "IQ4_NL",
            Self::Iq4Xs => "IQ4_XS",
            Self::Mxfp4 => "MXFP4",
        }
    }

    /// Weights per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::Iq4Nl | Self::Mxfp4 => 32,
            Self::Iq4Xs => 256,
        }
    }

    /// Bytes per block in the file.
    pub fn type_size(self) -> usize {
        match self {
            // A half-precision scale and 16 bytes of codes.
            Self::Iq4Nl => 2 + 16,
            // A half-precision scale, the multipliers' high bits (2 bytes) and low bits
            // (4 bytes), 128 bytes of codes.
            Self::Iq4Xs => 2 + 2 + 4 + 128,
            // The scale's exponent byte, 16 bytes of codes.
            Self::Mxfp4 => 1 + 16,
        }
    }

    /// The type it is widened to.
    pub fn target(self) -> GgmlDType {
        match self {
            Self::Iq4Nl | Self::Iq4Xs => GgmlDType::Q8_0,
            Self::Mxfp4 => GgmlDType::Q5_0,
        }
    }

    /// Bytes of the target's blocks for `bytes` of this type (whole blocks).
    pub fn widened_len(self, bytes: usize) -> usize {
        bytes / self.type_size() * (self.block_size() / BLOCK) * self.target().type_size()
    }

    /// The target's blocks of `bytes` (whole blocks of this type, as the file stores
    /// them); an error where an MXFP4 scale is beyond what Q5_0 holds.
    pub fn widen(self, bytes: &[u8]) -> Result<Vec<u8>, String> {
        let mut out = Vec::with_capacity(self.widened_len(bytes.len()));
        for (index, block) in bytes.chunks_exact(self.type_size()).enumerate() {
            let d = f16::from_le_bytes([block[0], block[1]]);
            match self {
                Self::Iq4Nl => push_q8_0(&mut out, d, &IQ4_LEVELS, &block[2..18]),
                Self::Mxfp4 => push_mxfp4(&mut out, block[0], &block[1..17])
                    .map_err(|e| format!("MXFP4 block {index}: {e}"))?,
                Self::Iq4Xs => {
                    let high = u16::from_le_bytes([block[2], block[3]]);
                    let (low, codes) = (&block[4..8], &block[8..]);
                    for sub in 0..8 {
                        let scale = f32::from(d) * (iq4_xs_multiplier(high, low, sub) as f32);
                        let codes = &codes[sub * 16..][..16];
                        push_q8_0(&mut out, f16::from_f32(scale), &IQ4_LEVELS, codes);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// IQ4_XS's multiplier of sub-block `sub` (of 8): 6 bits, 4 low and 2 high, less 32.
fn iq4_xs_multiplier(high: u16, low: &[u8], sub: usize) -> i32 {
    let low_bits = (low[sub / 2] >> (4 * (sub % 2))) & 0xF;
    let high_bits = ((high >> (2 * sub)) & 3) as u8;
    (low_bits | (high_bits << 4)) as i32 - 32
}

/// One Q8_0 block: scale `d`, then the `levels` of 16 bytes of codes (low nibbles are the
/// first 16 weights, high nibbles the next 16, in all three types).
fn push_q8_0(out: &mut Vec<u8>, d: f16, levels: &[i8; 16], codes: &[u8]) {
    out.extend_from_slice(&d.to_le_bytes());
    let level = |c: u8| levels[c as usize] as u8;
    out.extend(codes.iter().map(|&c| level(c & 0xF)));
    out.extend(codes.iter().map(|&c| level(c >> 4)));
}

/// Half precision's smallest and largest powers of two (2^-24 is subnormal, exact).
const F16_MIN_EXP: i32 = -24;
const F16_MAX_EXP: i32 = 15;

/// One Q5_0 block: scale `d`, the 5th bits of the 32 weights (`qh`, weight `j` at bit
/// `j`), then their low 4 bits paired as Q8_0's halves are (byte `j`: weights `j` and
/// `j + 16`); `levels` in -16..=15.
fn push_q5_0(out: &mut Vec<u8>, d: f16, levels: &[i8; 16], codes: &[u8]) {
    let q = |c: u8| (levels[c as usize] + Q5_0_OFFSET) as u8;
    let mut qh = 0u32;
    let mut low = [0u8; BLOCK / 2];
    // Code byte `j` holds weights `j` (low nibble) and `j + 16` (high), as Q5_0's byte `j`.
    for (j, &c) in codes.iter().enumerate() {
        let (first, second) = (q(c & 0xF), q(c >> 4));
        qh |= u32::from(first >> 4) << j | u32::from(second >> 4) << (j + 16);
        low[j] = (first & 0xF) | ((second & 0xF) << 4);
    }
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&qh.to_le_bytes());
    out.extend_from_slice(&low);
}

/// One MXFP4 block (scale exponent byte `e`, 16 bytes of codes) as Q5_0: scale
/// `2^(e - 128)` where half precision holds it, else the nearest power it holds with the
/// levels shifted to match (rounded below, an error where they would leave Q5_0's
/// -16..=15 above).
fn push_mxfp4(out: &mut Vec<u8>, e: u8, codes: &[u8]) -> Result<(), String> {
    let exp = i32::from(e) - 128;
    let shift = exp - exp.clamp(F16_MIN_EXP, F16_MAX_EXP);
    if shift == 0 {
        push_q5_0(out, f16::from_f32(2f32.powi(exp)), &MXFP4_LEVELS, codes);
        return Ok(());
    }
    let mut levels = [0i8; 16];
    for (l, &m) in levels.iter_mut().zip(&MXFP4_LEVELS) {
        let v = (f32::from(m) * 2f32.powi(shift)).round();
        if !(-16.0..=15.0).contains(&v) {
            return Err(format!(
                "its scale 2^{exp} puts weights beyond what lantern's Q5_0 form holds"
            ));
        }
        *l = v as i8;
    }
    let d = 2f32.powi(exp.clamp(F16_MIN_EXP, F16_MAX_EXP));
    push_q5_0(out, f16::from_f32(d), &levels, codes);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::ggml_file::qtensor_from_ggml;
    use candle_core::Device;

    /// The weights of `bytes` as llama.cpp's `dequantize_row_iq4_nl` / `_iq4_xs` compute
    /// them (in f32, from the file's scales): the reference the widening is checked against.
    fn dequantize(ty: WidenedType, bytes: &[u8]) -> Vec<f32> {
        let mut out = Vec::with_capacity(bytes.len() / ty.type_size() * ty.block_size());
        let mut push = |scale: f32, levels: &[i8; 16], codes: &[u8]| {
            let level = |c: u8| scale * levels[c as usize] as f32;
            out.extend(codes.iter().map(|&c| level(c & 0xF)));
            out.extend(codes.iter().map(|&c| level(c >> 4)));
        };
        for block in bytes.chunks_exact(ty.type_size()) {
            if ty == WidenedType::Mxfp4 {
                // ggml's E8M0 halved: 2^(e - 128), the levels its kvalues_mxfp4.
                let d = 2f64.powi(i32::from(block[0]) - 128) as f32;
                push(d, &MXFP4_LEVELS, &block[1..17]);
                continue;
            }
            let d = f32::from(f16::from_le_bytes([block[0], block[1]]));
            match ty {
                WidenedType::Iq4Nl => push(d, &IQ4_LEVELS, &block[2..18]),
                WidenedType::Mxfp4 => unreachable!("handled above"),
                WidenedType::Iq4Xs => {
                    let high = u16::from_le_bytes([block[2], block[3]]);
                    for sub in 0..8 {
                        let scale = d * iq4_xs_multiplier(high, &block[4..8], sub) as f32;
                        push(scale, &IQ4_LEVELS, &block[8 + sub * 16..][..16]);
                    }
                }
            }
        }
        out
    }

    /// Random blocks of `ty` with scales of varied magnitude (never zero).
    fn random_blocks(ty: WidenedType, blocks: usize, seed: u64) -> Vec<u8> {
        let mut state = seed;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut bytes = Vec::with_capacity(blocks * ty.type_size());
        for b in 0..blocks {
            let d = f16::from_f32((1 + b % 7) as f32 * 1e-3 * if b % 2 == 0 { 1.0 } else { -3.0 });
            bytes.extend_from_slice(&d.to_le_bytes());
            bytes.extend((2..ty.type_size()).map(|_| next() as u8));
        }
        bytes
    }

    /// The widened blocks read by candle's code for the target type (ggml's).
    fn widened_values(ty: WidenedType, bytes: &[u8]) -> Vec<f32> {
        let widened = ty.widen(bytes).unwrap();
        assert_eq!(widened.len(), ty.widened_len(bytes.len()));
        let n = bytes.len() / ty.type_size() * ty.block_size();
        let t = qtensor_from_ggml(ty.target(), &widened, vec![n], &Device::Cpu).unwrap();
        t.dequantize(&Device::Cpu).unwrap().to_vec1().unwrap()
    }

    #[test]
    fn iq4_nl_widens_exactly() {
        let bytes = random_blocks(WidenedType::Iq4Nl, 64, 7);
        let reference = dequantize(WidenedType::Iq4Nl, &bytes);
        assert_eq!(widened_values(WidenedType::Iq4Nl, &bytes), reference);
    }

    #[test]
    fn iq4_xs_widens_within_half_precision_of_each_sub_block_scale() {
        let ty = WidenedType::Iq4Xs;
        let bytes = random_blocks(ty, 16, 11);
        let reference = dequantize(ty, &bytes);
        let widened = widened_values(ty, &bytes);
        let mut exact = 0;
        for (sub, (w, r)) in widened.chunks(32).zip(reference.chunks(32)).enumerate() {
            let largest = r.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in w.iter().zip(r) {
                assert!(
                    (a - b).abs() <= largest * 2f32.powi(-11),
                    "sub-block {sub}: {a} vs {b}"
                );
            }
            exact += usize::from(w == r);
        }
        // Most products of a half-precision scale and a 6-bit multiplier need rounding:
        // the comparison is not vacuous.
        assert!(exact < widened.len() / 32, "{exact} sub-blocks exact");
    }

    /// MXFP4 blocks with exponents in half precision's range, random codes.
    fn mxfp4_blocks(exponents: &[u8], seed: u64) -> Vec<u8> {
        let mut bytes = random_blocks(WidenedType::Mxfp4, exponents.len(), seed);
        for (block, &e) in bytes.chunks_exact_mut(17).zip(exponents) {
            block[0] = e;
        }
        bytes
    }

    #[test]
    fn mxfp4_widens_exactly_where_half_precision_holds_the_scale() {
        let exponents: Vec<u8> = (104..=143).chain([110, 120, 127, 128, 130]).collect();
        let bytes = mxfp4_blocks(&exponents, 5);
        let reference = dequantize(WidenedType::Mxfp4, &bytes);
        assert!(reference.iter().any(|&v| v != 0.0));
        assert_eq!(widened_values(WidenedType::Mxfp4, &bytes), reference);
        // Every code, both halves of a block: the 5th bit and the nibble pairing.
        let every: Vec<u8> = [128u8]
            .into_iter()
            .chain((0..16).map(|c| c | (15 - c) << 4))
            .collect();
        let values = widened_values(WidenedType::Mxfp4, &every);
        assert_eq!(values, dequantize(WidenedType::Mxfp4, &every));
        assert_eq!(values[..8], [0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0]);
    }

    #[test]
    fn mxfp4_scales_beyond_half_precision_round_below_and_fail_above() {
        let ty = WidenedType::Mxfp4;
        let small = mxfp4_blocks(&[0, 60, 100, 103], 9);
        let reference = dequantize(ty, &small);
        for (a, b) in widened_values(ty, &small).iter().zip(&reference) {
            assert!((a - b).abs() <= 2f32.powi(-25), "{a} vs {b}");
        }
        // 2^15 is half precision's largest power; 2^16 with level 12 would be 24 of 2^15,
        // past Q5_0's 15.
        assert!(ty.widen(&mxfp4_blocks(&[143], 3)).is_ok());
        let err = ty.widen(&mxfp4_blocks(&[128, 144], 3)).unwrap_err();
        assert!(err.contains("block 1") && err.contains("2^16"), "{err}");
    }

    #[test]
    fn iq4_xs_multipliers_read_their_low_and_high_bits() {
        // Sub-block 3: low nibble = high half of low[1], high bits = bits 6-7 of `high`.
        let low = [0x00, 0xA0, 0x00, 0x00];
        assert_eq!(iq4_xs_multiplier(0b1100_0000, &low, 3), 0x3A - 32);
        assert_eq!(iq4_xs_multiplier(0, &[0; 4], 5), -32);
    }
}
