//! GGUF weights as plain per-value quants and f32 scales: the form a device that
//! dequantizes as it reads a matrix takes (lantern-cuda's small products keep GGUF
//! weights quantized in it). Every type reads the same way:
//!
//! `w[r, c] = scale[r, c / g] · (q[r, c] − offset)`, `+ min[r, c / 32]` for the types
//! with mins (`Q4_1`, `Q5_1`, `Q4_K`, `Q5_K`), where the scale group `g` is 16 for `Q6_K`
//! (a scale per 16 values) and 32 for every other type,
//!
//! each product rounded to f32 as written (no fused multiply-add), which gives the bits
//! of [`crate::PackedMatrix::dequantize_row`]. The K-quants' scales are the products
//! `d · sc` and `−dmin · m`, exact in f32.

use crate::format::{self, Planes, Scales};
use crate::{QuantError, QuantType, BLOCK};
use rayon::prelude::*;

/// Values sharing one min.
pub const MIN_GROUP: usize = BLOCK;

/// A matrix `[rows, cols]` of a quantized GGUF type in the blockwise form.
#[derive(Clone, Debug)]
pub struct Blockwise {
    ty: QuantType,
    rows: usize,
    cols: usize,
    quants: Vec<u8>,
    scales: Vec<f32>,
    mins: Vec<f32>,
}

impl Blockwise {
    /// Unpacks `bytes`, `rows` GGUF rows of `cols` values of type `ty` (a quantized type).
    pub fn from_gguf_bytes(
        ty: QuantType,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self, QuantError> {
        if ty.is_dense() {
            return Err(QuantError::NotQuantized { ty });
        }
        let bv = ty.block_values();
        if cols == 0 || !cols.is_multiple_of(bv) {
            return Err(QuantError::BadCols {
                k: cols,
                block: bv,
                ty,
            });
        }
        if rows == 0 {
            return Err(QuantError::NoRows);
        }
        let blocks = rows
            .checked_mul(cols / bv)
            .ok_or(QuantError::Overflow { n: rows, k: cols })?;
        let expected = blocks
            .checked_mul(ty.block_bytes())
            .ok_or(QuantError::Overflow { n: rows, k: cols })?;
        if bytes.len() != expected {
            return Err(QuantError::Length {
                what: "GGUF bytes",
                expected,
                got: bytes.len(),
            });
        }
        let values = rows
            .checked_mul(cols)
            .ok_or(QuantError::Overflow { n: rows, k: cols })?;
        let bits = quant_bits(ty) as usize;
        let mut quants = vec![0u8; values * bits / 8];
        let group = scale_group(ty);
        let mut scales = vec![0f32; values / group];
        let mut mins = vec![0f32; if has_mins(ty) { values / MIN_GROUP } else { 0 }];
        let row_bytes = bytes.len() / rows;
        let min_rows: Vec<&mut [f32]> = if mins.is_empty() {
            (0..rows).map(|_| &mut [][..]).collect()
        } else {
            mins.chunks_mut(cols / MIN_GROUP).collect()
        };
        bytes
            .par_chunks(row_bytes)
            .zip(quants.par_chunks_mut(cols * bits / 8))
            .zip(scales.par_chunks_mut(cols / group))
            .zip(min_rows)
            .for_each(|(((src, q), s), m)| unpack_row(ty, src, q, s, m));
        Ok(Self {
            ty,
            rows,
            cols,
            quants,
            scales,
            mins,
        })
    }

    pub fn quant_type(&self) -> QuantType {
        self.ty
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bits a quant takes: 4 for the types whose quants fit a nibble (two a byte, the
    /// even column in the low nibble), else 8 (one a byte).
    pub fn bits(&self) -> u32 {
        quant_bits(self.ty)
    }

    /// What is subtracted from every quant before it is scaled.
    pub fn offset(&self) -> i32 {
        self.ty.offset()
    }

    /// The quants, row-major, packed as [`Self::bits`] says.
    pub fn quants(&self) -> &[u8] {
        &self.quants
    }

    /// Values sharing one scale: 16 for `Q6_K`, 32 for the other types.
    pub fn scale_group(&self) -> usize {
        scale_group(self.ty)
    }

    /// One scale per [`Self::scale_group`] values, row-major.
    pub fn scales(&self) -> &[f32] {
        &self.scales
    }

    /// One min per [`MIN_GROUP`] values, row-major; empty for the types without.
    pub fn mins(&self) -> &[f32] {
        &self.mins
    }

    /// Value `i` (row-major) as the form defines it.
    pub fn value(&self, i: usize) -> f32 {
        let u = if self.bits() == 4 {
            self.quants[i / 2] >> (4 * (i % 2)) & 0x0F
        } else {
            self.quants[i]
        };
        let w = self.scales[i / self.scale_group()] * (u as i32 - self.offset()) as f32;
        match self.mins.get(i / MIN_GROUP) {
            Some(&m) => w + m,
            None => w,
        }
    }

    /// Row `r` dequantized into `out` (`cols` values).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) -> Result<(), QuantError> {
        if r >= self.rows {
            return Err(QuantError::RowOutOfRange {
                row: r,
                rows: self.rows,
            });
        }
        if out.len() != self.cols {
            return Err(QuantError::Length {
                what: "out",
                expected: self.cols,
                got: out.len(),
            });
        }
        for (c, o) in out.iter_mut().enumerate() {
            *o = self.value(r * self.cols + c);
        }
        Ok(())
    }
}

/// One GGUF row `src` into its quants `q`, scales `s` and mins `m` (empty for the types
/// without), one block at a time through the CPU's own repacking (row lane 0 of a scratch
/// record) read back with its decoders: the same values by construction.
fn unpack_row(ty: QuantType, src: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    let unit = ty.scale_unit();
    let (qbp, sbp) = (ty.packed_quant_bytes(), ty.packed_scale_bytes());
    let (mut qr, mut sr) = (vec![0u8; unit * qbp], vec![0u8; sbp]);
    let nibbles = quant_bits(ty) == 4;
    for (b, block) in src.chunks_exact(ty.block_bytes()).enumerate() {
        qr.fill(0);
        sr.fill(0);
        format::pack_gguf_block(ty, block, &mut qr, &mut sr, 0);
        for j in 0..unit {
            let i = b * unit + j; // the row's block of 32
            let u = format::decode_quants(ty, &qr[j * qbp..], 0);
            if nibbles {
                for (byte, pair) in q[i * BLOCK / 2..][..BLOCK / 2]
                    .iter_mut()
                    .zip(u.chunks_exact(2))
                {
                    *byte = pair[0] | pair[1] << 4;
                }
            } else {
                q[i * BLOCK..][..BLOCK].copy_from_slice(&u);
            }
            let sc = format::decode_scales(ty, &sr, 0, j);
            if scale_group(ty) == 16 {
                s[2 * i] = sc.dw_lo;
                s[2 * i + 1] = sc.dw_hi;
            } else {
                s[i] = sc.dw_lo; // dw_hi is the same scale
            }
            if let Some(min) = m.get_mut(i) {
                *min = sc.mneg;
            }
        }
    }
}

fn quant_bits(ty: QuantType) -> u32 {
    if ty.planes() == Planes::Nibbles {
        4
    } else {
        8
    }
}

/// Values sharing one scale: `Q6_K` scales each half-block of 16 values apart.
fn scale_group(ty: QuantType) -> usize {
    if ty.scales() == Scales::SuperHalves {
        16
    } else {
        BLOCK
    }
}

/// Whether the type adds a min to each block's scaled quants.
fn has_mins(ty: QuantType) -> bool {
    matches!(ty.scales(), Scales::DM | Scales::SuperDM)
}
