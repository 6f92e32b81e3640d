//! The weight types: how a GGUF block decodes into unsigned quants and scales, and how
//! those are laid out in the repacked panels (see the crate docs).

use crate::{BLOCK, PANEL};
use half::f16;

/// The GGUF weight types this crate handles.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantType {
    /// 32 values in 18 bytes: `d: f16, qs: [u8; 16]`; `w = d · (q − 8)`.
    Q4_0 = 0,
    /// 32 values in 20 bytes: `d: f16, m: f16, qs: [u8; 16]`; `w = d · q + m`.
    Q4_1 = 1,
    /// 32 values in 22 bytes: `d: f16, qh: u32, qs: [u8; 16]`; `w = d · (q − 16)`.
    Q5_0 = 2,
    /// 32 values in 24 bytes: `d: f16, m: f16, qh: u32, qs: [u8; 16]`; `w = d · q + m`.
    Q5_1 = 3,
    /// 32 values in 34 bytes: `d: f16, qs: [i8; 32]`; `w = d · q`.
    Q8_0 = 4,
    /// 256 values in 144 bytes: `d, dmin: f16`, 8 six-bit (scale, min) pairs, 4-bit
    /// quants; `w = d · sc_j · q − dmin · m_j` for sub-block `j` of 32 values.
    Q4K = 5,
    /// 256 values in 176 bytes: as `Q4_K` with a fifth quant bit.
    Q5K = 6,
    /// 256 values in 210 bytes: 6-bit quants, 16 int8 scales (one per 16 values), `d:
    /// f16`; `w = d · sc_j · (q − 32)`.
    Q6K = 7,
    /// Unquantized f16 (products take the activations unquantized, see `dense`).
    F16 = 8,
    /// Unquantized bfloat16.
    BF16 = 9,
    /// Unquantized f32.
    F32 = 10,
    /// 256 values in 110 bytes: 3-bit quants (a high-bit mask, 2-bit planes), 16 six-bit
    /// scales (one per 16 values), `d: f16`; `w = d · (sc_j − 32) · (q − 4)`.
    Q3K = 11,
}

/// Bit planes of the repacked quants (per block-panel of 32 values x 16 rows).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Planes {
    /// 256 bytes of nibbles.
    Nibbles,
    /// Nibbles, then 64 bytes holding the fifth bit.
    Nibbles1,
    /// Nibbles, then 128 bytes holding bits 4 and 5.
    Nibbles2,
    /// 512 bytes of whole (biased) bytes.
    Bytes,
}

/// Where the per-block scales come from.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scales {
    /// Per block: `d[16]: f16`.
    D,
    /// Per block: `d[16]: f16, m[16]: f16` (`mneg = m`).
    DM,
    /// Per super-block of 8 blocks: `d[16], dmin[16]: f16, sc[8][16]: u8, m[8][16]: u8`
    /// (`dw = d · sc`, `mneg = −dmin · m`, both exact in f32).
    SuperDM,
    /// Per super-block of 8 blocks: `d[16]: f16, sc[16][16]: i8`, one scale per 16
    /// values (`dw_lo = d · sc[2j]`, `dw_hi = d · sc[2j+1]`, exact in f32).
    SuperHalves,
}

impl QuantType {
    /// Every type, in `repr` order.
    pub const ALL: [QuantType; 12] = [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q8_0,
        QuantType::Q4K,
        QuantType::Q5K,
        QuantType::Q6K,
        QuantType::F16,
        QuantType::BF16,
        QuantType::F32,
        QuantType::Q3K,
    ];

    /// The quantized types (int8 dot products against quantized activations).
    pub const QUANTIZED: [QuantType; 9] = [
        QuantType::Q4_0,
        QuantType::Q4_1,
        QuantType::Q5_0,
        QuantType::Q5_1,
        QuantType::Q8_0,
        QuantType::Q4K,
        QuantType::Q5K,
        QuantType::Q6K,
        QuantType::Q3K,
    ];

    /// Whether the type is unquantized (`F16`, `BF16`, `F32`).
    pub const fn is_dense(self) -> bool {
        matches!(self, QuantType::F16 | QuantType::BF16 | QuantType::F32)
    }

    /// Bytes of one block in the GGUF file (one value for the dense types).
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantType::F16 | QuantType::BF16 => 2,
            QuantType::F32 => 4,
            QuantType::Q4_0 => 18,
            QuantType::Q4_1 => 20,
            QuantType::Q5_0 => 22,
            QuantType::Q5_1 => 24,
            QuantType::Q8_0 => 34,
            QuantType::Q4K => 144,
            QuantType::Q5K => 176,
            QuantType::Q6K => 210,
            QuantType::Q3K => 110,
        }
    }

    /// Values per block in the GGUF file (32, 256 for the K-quants, 1 for the dense
    /// types); `k` must be a multiple of it.
    pub const fn block_values(self) -> usize {
        match self {
            QuantType::F16 | QuantType::BF16 | QuantType::F32 => 1,
            QuantType::Q3K | QuantType::Q4K | QuantType::Q5K | QuantType::Q6K => 256,
            _ => BLOCK,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            QuantType::Q4_0 => "Q4_0",
            QuantType::Q4_1 => "Q4_1",
            QuantType::Q5_0 => "Q5_0",
            QuantType::Q5_1 => "Q5_1",
            QuantType::Q8_0 => "Q8_0",
            QuantType::Q4K => "Q4_K",
            QuantType::Q5K => "Q5_K",
            QuantType::Q6K => "Q6_K",
            QuantType::Q3K => "Q3_K",
            QuantType::F16 => "F16",
            QuantType::BF16 => "BF16",
            QuantType::F32 => "F32",
        }
    }

    pub(crate) const fn from_id(id: u8) -> QuantType {
        match id {
            0 => QuantType::Q4_0,
            1 => QuantType::Q4_1,
            2 => QuantType::Q5_0,
            3 => QuantType::Q5_1,
            4 => QuantType::Q8_0,
            5 => QuantType::Q4K,
            6 => QuantType::Q5K,
            7 => QuantType::Q6K,
            8 => QuantType::F16,
            9 => QuantType::BF16,
            11 => QuantType::Q3K,
            _ => QuantType::F32,
        }
    }

    pub(crate) const fn planes(self) -> Planes {
        match self {
            QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q4K | QuantType::Q3K => Planes::Nibbles,
            QuantType::Q5_0 | QuantType::Q5_1 | QuantType::Q5K => Planes::Nibbles1,
            QuantType::Q6K => Planes::Nibbles2,
            // The dense types have their own layout (`dense`); never read as planes.
            QuantType::Q8_0 | QuantType::F16 | QuantType::BF16 | QuantType::F32 => Planes::Bytes,
        }
    }

    pub(crate) const fn scales(self) -> Scales {
        match self {
            QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => Scales::D,
            QuantType::F16 | QuantType::BF16 | QuantType::F32 => Scales::D,
            QuantType::Q4_1 | QuantType::Q5_1 => Scales::DM,
            QuantType::Q4K | QuantType::Q5K => Scales::SuperDM,
            QuantType::Q6K | QuantType::Q3K => Scales::SuperHalves,
        }
    }

    /// The quants' offset: `w ∝ q − offset` for the unsigned repacked quants `q`.
    pub(crate) const fn offset(self) -> i32 {
        match self {
            QuantType::Q3K => 4,
            QuantType::Q4_0 => 8,
            QuantType::Q5_0 => 16,
            QuantType::Q6K => 32,
            QuantType::Q8_0 => 128,
            _ => 0,
        }
    }

    /// Whether `x86::amx` has tile kernels for the type (every quantized type but `Q3_K`,
    /// whose tiles are not written: it runs the `avx512` code there, the same bits).
    pub const fn has_tiles(self) -> bool {
        !self.is_dense() && !matches!(self, QuantType::Q3K)
    }

    /// Whether each block has two scales, one per 16 values (`Q3_K`, `Q6_K`): the kernels
    /// keep two integer dots per block.
    pub(crate) const fn splits(self) -> bool {
        matches!(self.scales(), Scales::SuperHalves)
    }

    /// Quant bytes of one repacked block-panel (16 rows x 32 values).
    pub(crate) const fn packed_quant_bytes(self) -> usize {
        match self.planes() {
            Planes::Nibbles => 256,
            Planes::Nibbles1 => 320,
            Planes::Nibbles2 => 384,
            Planes::Bytes => 512,
        }
    }

    /// Blocks that share one scale record (1, or 8 for the K-quants).
    pub(crate) const fn scale_unit(self) -> usize {
        if self.is_dense() {
            1
        } else {
            self.block_values() / BLOCK
        }
    }

    /// Bytes of one scale record (a block-panel's, or a super-block-panel's).
    pub(crate) const fn packed_scale_bytes(self) -> usize {
        match self.scales() {
            Scales::D => 32,
            Scales::DM => 64,
            Scales::SuperDM => 64 + 2 * 8 * PANEL,
            Scales::SuperHalves => 32 + 16 * PANEL,
        }
    }
}

impl std::fmt::Display for QuantType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[inline]
pub(crate) fn f16_at(s: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([s[2 * i], s[2 * i + 1]]).to_f32()
}

/// Writes the 32 unsigned quants `u` of row lane `r` into a block-panel's quant record.
fn encode_quants(ty: QuantType, u: &[u8; BLOCK], q: &mut [u8], r: usize) {
    if ty.planes() == Planes::Bytes {
        for c in 0..8 {
            q[c * 64 + 4 * r..c * 64 + 4 * r + 4].copy_from_slice(&u[4 * c..4 * c + 4]);
        }
        return;
    }
    for c in 0..4 {
        for j in 0..4 {
            let (lo, hi) = (u[4 * c + j], u[16 + 4 * c + j]);
            q[c * 64 + 4 * r + j] = (lo & 0x0F) | (hi & 0x0F) << 4;
            match ty.planes() {
                Planes::Nibbles1 => {
                    q[256 + 4 * r + j] |= (lo >> 4 & 1) << c | (hi >> 4 & 1) << (4 + c);
                }
                Planes::Nibbles2 => {
                    q[256 + 4 * r + j] |= (lo >> 4 & 3) << (2 * c);
                    q[320 + 4 * r + j] |= (hi >> 4 & 3) << (2 * c);
                }
                _ => {}
            }
        }
    }
}

/// The 32 unsigned quants of row lane `r` in a block-panel's quant record.
#[inline]
pub(crate) fn decode_quants(ty: QuantType, q: &[u8], r: usize) -> [u8; BLOCK] {
    let mut u = [0u8; BLOCK];
    if ty.planes() == Planes::Bytes {
        for c in 0..8 {
            u[4 * c..4 * c + 4].copy_from_slice(&q[c * 64 + 4 * r..c * 64 + 4 * r + 4]);
        }
        return u;
    }
    for c in 0..4 {
        for j in 0..4 {
            let b = q[c * 64 + 4 * r + j];
            let (mut lo, mut hi) = (b & 0x0F, b >> 4);
            match ty.planes() {
                Planes::Nibbles1 => {
                    let h = q[256 + 4 * r + j];
                    lo |= (h >> c & 1) << 4;
                    hi |= (h >> (4 + c) & 1) << 4;
                }
                Planes::Nibbles2 => {
                    lo |= (q[256 + 4 * r + j] >> (2 * c) & 3) << 4;
                    hi |= (q[320 + 4 * r + j] >> (2 * c) & 3) << 4;
                }
                _ => {}
            }
            u[4 * c + j] = lo;
            u[16 + 4 * c + j] = hi;
        }
    }
    u
}

/// The f32 scales of one (row lane, block): `w_j = dw · (q_j − offset) + mneg` with
/// `dw = dw_lo` for `j < 16` and `dw_hi` after (equal except for `Q6_K`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BlockScales {
    pub dw_lo: f32,
    pub dw_hi: f32,
    pub mneg: f32,
}

/// Scales of row lane `r`, block `j` of the scale record `s` (`j` < [`QuantType::scale_unit`]).
#[inline]
pub(crate) fn decode_scales(ty: QuantType, s: &[u8], r: usize, j: usize) -> BlockScales {
    match ty.scales() {
        Scales::D => {
            let d = f16_at(s, r);
            BlockScales {
                dw_lo: d,
                dw_hi: d,
                mneg: 0.0,
            }
        }
        Scales::DM => {
            let d = f16_at(s, r);
            BlockScales {
                dw_lo: d,
                dw_hi: d,
                mneg: f16_at(s, PANEL + r),
            }
        }
        Scales::SuperDM => {
            let d = f16_at(s, r) * s[64 + j * PANEL + r] as f32;
            let m = f16_at(s, PANEL + r) * s[64 + 8 * PANEL + j * PANEL + r] as f32;
            BlockScales {
                dw_lo: d,
                dw_hi: d,
                mneg: -m,
            }
        }
        Scales::SuperHalves => {
            let d = f16_at(s, r);
            BlockScales {
                dw_lo: d * s[32 + 2 * j * PANEL + r] as i8 as f32,
                dw_hi: d * s[32 + (2 * j + 1) * PANEL + r] as i8 as f32,
                mneg: 0.0,
            }
        }
    }
}

/// One GGUF block of a quantized type (`ty.block_values()` values of a row) written into row lane `r` of
/// its block-panel quant records `q` (one per 32 values, consecutive) and its scale
/// record `s`.
pub(crate) fn pack_gguf_block(ty: QuantType, src: &[u8], q: &mut [u8], s: &mut [u8], r: usize) {
    let qbp = ty.packed_quant_bytes();
    let mut put = |j: usize, u: &[u8; BLOCK]| encode_quants(ty, u, &mut q[j * qbp..], r);
    let set_f16 = |s: &mut [u8], i: usize, bytes: &[u8]| {
        s[2 * i..2 * i + 2].copy_from_slice(&bytes[..2]);
    };
    match ty {
        QuantType::Q4_0 | QuantType::Q4_1 | QuantType::Q5_0 | QuantType::Q5_1 => {
            let with_min = matches!(ty, QuantType::Q4_1 | QuantType::Q5_1);
            set_f16(s, r, &src[0..2]);
            let mut at = 2;
            if with_min {
                set_f16(s, PANEL + r, &src[2..4]);
                at = 4;
            }
            let qh = if matches!(ty, QuantType::Q5_0 | QuantType::Q5_1) {
                at += 4;
                u32::from_le_bytes(src[at - 4..at].try_into().unwrap())
            } else {
                0
            };
            let qs = &src[at..at + 16];
            let mut u = [0u8; BLOCK];
            for j in 0..16 {
                u[j] = (qs[j] & 0x0F) | ((qh >> j & 1) as u8) << 4;
                u[j + 16] = (qs[j] >> 4) | ((qh >> (j + 16) & 1) as u8) << 4;
            }
            put(0, &u);
        }
        QuantType::Q8_0 => {
            set_f16(s, r, &src[0..2]);
            let u: [u8; BLOCK] = std::array::from_fn(|j| src[2 + j] ^ 0x80);
            put(0, &u);
        }
        QuantType::Q4K | QuantType::Q5K => {
            set_f16(s, r, &src[0..2]);
            set_f16(s, PANEL + r, &src[2..4]);
            let scales = &src[4..16];
            let (qh, qs) = if ty == QuantType::Q5K {
                (Some(&src[16..48]), &src[48..176])
            } else {
                (None, &src[16..144])
            };
            for j in 0..8 {
                let (sc, m) = scale_min_k4(j, scales);
                s[64 + j * PANEL + r] = sc;
                s[64 + 8 * PANEL + j * PANEL + r] = m;
                let (g, high) = (j / 2, j % 2 == 1);
                let u: [u8; BLOCK] = std::array::from_fn(|l| {
                    let b = qs[32 * g + l];
                    let nib = if high { b >> 4 } else { b & 0x0F };
                    let h = qh.map_or(0, |qh| qh[l] >> j & 1);
                    nib | h << 4
                });
                put(j, &u);
            }
        }
        // Packed by `dense::pack_row`.
        QuantType::F16 | QuantType::BF16 | QuantType::F32 => {}
        QuantType::Q3K => {
            let (hmask, qs, scales) = (&src[0..32], &src[32..96], &src[96..108]);
            set_f16(s, r, &src[108..110]);
            for (i, sc) in q3_k_scales(scales).into_iter().enumerate() {
                s[32 + i * PANEL + r] = sc as u8;
            }
            // Value v: 2 bits of qs[32 n + l] at shift 2 part, and bit (4 n + part) of
            // hmask[l] (n = v / 128, part = v % 128 / 32, l = v % 32): u = low + 4 · high.
            for j in 0..8 {
                let u: [u8; BLOCK] = std::array::from_fn(|l| {
                    let v = 32 * j + l;
                    let (n, part, l) = (v / 128, v % 128 / 32, v % 32);
                    let low = qs[32 * n + l] >> (2 * part) & 3;
                    let high = hmask[l] >> (4 * n + part) & 1;
                    low | high << 2
                });
                put(j, &u);
            }
        }
        QuantType::Q6K => {
            let (ql, qh, sc) = (&src[0..128], &src[128..192], &src[192..208]);
            set_f16(s, r, &src[208..210]);
            for (i, &v) in sc.iter().enumerate() {
                s[32 + i * PANEL + r] = v;
            }
            for j in 0..8 {
                let u: [u8; BLOCK] = std::array::from_fn(|l| {
                    let v = 32 * j + l;
                    let (n, part, l) = (v / 128, v % 128 / 32, v % 32);
                    let b = ql[64 * n + (part & 1) * 32 + l];
                    let nib = if part < 2 { b & 0x0F } else { b >> 4 };
                    nib | (qh[32 * n + l] >> (2 * part) & 3) << 4
                });
                put(j, &u);
            }
        }
    }
}

/// `Q3_K`'s 16 six-bit scales (ggml's `dequantize_row_q3_K`), less 32: the low 4 bits of
/// scale `i` are nibble `i % 8` of the first 8 bytes (`i / 8` picks the high nibble), the
/// high 2 bits are bits `2 (i / 4)` of byte `8 + i % 4`.
fn q3_k_scales(packed: &[u8]) -> [i8; 16] {
    std::array::from_fn(|i| {
        let low = packed[i % 8] >> (4 * (i / 8)) & 0x0F;
        let high = packed[8 + i % 4] >> (2 * (i / 4)) & 3;
        (low | high << 4) as i8 - 32
    })
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block `j`.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Dequantizes 32 values as ggml does: `d · (q − offset)`, `d · q + m`, or for the
/// K-quants `(d·sc) · q − dmin·m`.
#[inline]
pub(crate) fn dequantize_block(ty: QuantType, u: &[u8; BLOCK], sc: BlockScales, out: &mut [f32]) {
    let off = ty.offset();
    for (j, (o, &q)) in out.iter_mut().zip(u).enumerate() {
        let dw = if j < 16 { sc.dw_lo } else { sc.dw_hi };
        let q = (q as i32 - off) as f32;
        *o = match ty.scales() {
            Scales::D | Scales::SuperHalves => dw * q,
            Scales::DM | Scales::SuperDM => dw * q + sc.mneg,
        };
    }
}
