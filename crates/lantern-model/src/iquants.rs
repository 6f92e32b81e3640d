//! The i-quants lantern reads by widening them at load: llama.cpp's non-linear 4-bit
//! types IQ4_NL and IQ4_XS, whose 4-bit codes each pick one of 16 fixed int8 levels,
//! become Q8_0 (those levels, one scale per 32 weights), whose kernels lantern has.
//! Twice the memory of the file's tensors, Q8_0's speed.
//!
//! IQ4_NL's blocks are Q8_0's shape (a half-precision scale per 32 weights): widened
//! exactly. IQ4_XS has a half-precision scale per 256 weights and a 6-bit multiplier per
//! 32; their product, rounded to half precision for Q8_0, moves each weight by at most
//! 2^-11 of its block's largest (the 4-bit quantization itself moves weights by several
//! percent).

use half::f16;

/// The 16 levels of llama.cpp's `kvalues_iq4nl`.
pub const IQ4_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Weights per Q8_0 block, and its bytes (a half-precision scale, 32 int8 values).
const Q8_0_BLOCK: usize = 32;
const Q8_0_BYTES: usize = 2 + Q8_0_BLOCK;

/// A ggml type read by widening it to Q8_0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WidenedType {
    Iq4Nl,
    Iq4Xs,
}

impl WidenedType {
    /// The type of ggml's type number (ggml.h), if lantern widens it.
    pub fn from_ggml(id: u32) -> Option<Self> {
        match id {
            20 => Some(Self::Iq4Nl),
            23 => Some(Self::Iq4Xs),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Iq4Nl => "IQ4_NL",
            Self::Iq4Xs => "IQ4_XS",
        }
    }

    /// Weights per block.
    pub fn block_size(self) -> usize {
        match self {
            Self::Iq4Nl => 32,
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
        }
    }

    /// Bytes of Q8_0 blocks for `bytes` of this type (whole blocks).
    pub fn widened_len(self, bytes: usize) -> usize {
        bytes / self.type_size() * (self.block_size() / Q8_0_BLOCK) * Q8_0_BYTES
    }

    /// The Q8_0 blocks of `bytes` (whole blocks of this type, as the file stores them).
    pub fn to_q8_0(self, bytes: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.widened_len(bytes.len()));
        for block in bytes.chunks_exact(self.type_size()) {
            let d = f16::from_le_bytes([block[0], block[1]]);
            match self {
                Self::Iq4Nl => push_q8_0(&mut out, d, &block[2..18]),
                Self::Iq4Xs => {
                    let high = u16::from_le_bytes([block[2], block[3]]);
                    let (low, codes) = (&block[4..8], &block[8..]);
                    for sub in 0..8 {
                        let scale = f32::from(d) * (iq4_xs_multiplier(high, low, sub) as f32);
                        push_q8_0(&mut out, f16::from_f32(scale), &codes[sub * 16..][..16]);
                    }
                }
            }
        }
        out
    }
}

/// IQ4_XS's multiplier of sub-block `sub` (of 8): 6 bits, 4 low and 2 high, less 32.
fn iq4_xs_multiplier(high: u16, low: &[u8], sub: usize) -> i32 {
    let low_bits = (low[sub / 2] >> (4 * (sub % 2))) & 0xF;
    let high_bits = ((high >> (2 * sub)) & 3) as u8;
    (low_bits | (high_bits << 4)) as i32 - 32
}

/// One Q8_0 block: scale `d`, then the levels of 16 bytes of codes (low nibbles are the
/// first 16 weights, high nibbles the next 16, as in both i-quants).
fn push_q8_0(out: &mut Vec<u8>, d: f16, codes: &[u8]) {
    out.extend_from_slice(&d.to_le_bytes());
    let level = |c: u8| IQ4_LEVELS[c as usize] as u8;
    out.extend(codes.iter().map(|&c| level(c & 0xF)));
    out.extend(codes.iter().map(|&c| level(c >> 4)));
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
    use candle_core::Device;

    /// The weights of `bytes` as llama.cpp's `dequantize_row_iq4_nl` / `_iq4_xs` compute
    /// them (in f32, from the file's scales): the reference the widening is checked against.
    fn dequantize(ty: WidenedType, bytes: &[u8]) -> Vec<f32> {
        let mut out = Vec::with_capacity(bytes.len() / ty.type_size() * ty.block_size());
        let mut push = |scale: f32, codes: &[u8]| {
            let level = |c: u8| scale * IQ4_LEVELS[c as usize] as f32;
            out.extend(codes.iter().map(|&c| level(c & 0xF)));
            out.extend(codes.iter().map(|&c| level(c >> 4)));
        };
        for block in bytes.chunks_exact(ty.type_size()) {
            let d = f32::from(f16::from_le_bytes([block[0], block[1]]));
            match ty {
                WidenedType::Iq4Nl => push(d, &block[2..18]),
                WidenedType::Iq4Xs => {
                    let high = u16::from_le_bytes([block[2], block[3]]);
                    for sub in 0..8 {
                        let scale = d * iq4_xs_multiplier(high, &block[4..8], sub) as f32;
                        push(scale, &block[8 + sub * 16..][..16]);
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

    /// The widened blocks read by candle's Q8_0 code.
    fn widened_values(ty: WidenedType, bytes: &[u8]) -> Vec<f32> {
        let q8 = ty.to_q8_0(bytes);
        assert_eq!(q8.len(), ty.widened_len(bytes.len()));
        let n = bytes.len() / ty.type_size() * ty.block_size();
        let t = qtensor_from_ggml(GgmlDType::Q8_0, &q8, vec![n], &Device::Cpu).unwrap();
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

    #[test]
    fn iq4_xs_multipliers_read_their_low_and_high_bits() {
        // Sub-block 3: low nibble = high half of low[1], high bits = bits 6-7 of `high`.
        let low = [0x00, 0xA0, 0x00, 0x00];
        assert_eq!(iq4_xs_multiplier(0b1100_0000, &low, 3), 0x3A - 32);
        assert_eq!(iq4_xs_multiplier(0, &[0; 4], 5), -32);
    }
}
