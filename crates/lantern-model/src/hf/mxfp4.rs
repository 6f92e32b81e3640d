//! The experts of MXFP4 checkpoints (gpt-oss as released): per expert and output row,
//! blocks of 32 weights as 16 bytes of 4-bit codes (`{name}_blocks`, `[experts, rows,
//! blocks, 16]`, two neighbouring weights per byte, the first in the low nibble) and one
//! power-of-two scale byte each (`{name}_scales`, `[experts, rows, blocks]`, `2^(s - 127)`
//! times the FP4 value). The codes and scales are llama.cpp's MXFP4 with the nibbles
//! paired differently, so they are repacked into its blocks and widened to Q5_0 as a GGUF
//! file's MXFP4 tensors are ([`crate::iquants`]).

use crate::iquants::WidenedType;
use candle_core::quantized::{ggml_file::qtensor_from_ggml, QTensor};
use candle_core::Device;

/// Weights per block, and bytes of codes per block.
const BLOCK: usize = 32;
const CODE_BYTES: usize = BLOCK / 2;

/// The `[experts, rows, columns]` shape of packed codes of `blocks_shape`, if it is one.
pub fn unpacked_shape(blocks_shape: &[usize]) -> Option<Vec<usize>> {
    match blocks_shape {
        [experts, rows, blocks, CODE_BYTES] => Some(vec![*experts, *rows, blocks * BLOCK]),
        _ => None,
    }
}

/// The widened tensor `[experts, rows, columns]` of the codes and scales; `gate_first`:
/// the rows alternate gate and up outputs (gpt-oss's `gate_up_proj`) and are regrouped,
/// every gate row, then every up row.
pub fn widen(
    codes: &[u8],
    codes_shape: &[usize],
    scales: &[u8],
    scales_shape: &[usize],
    gate_first: bool,
) -> candle_core::Result<QTensor> {
    let Some(shape) = unpacked_shape(codes_shape) else {
        candle_core::bail!(
            "MXFP4 codes of shape {codes_shape:?} are not [experts, rows, blocks, 16]"
        );
    };
    if scales_shape != &codes_shape[..3] {
        candle_core::bail!(
            "MXFP4 scales of shape {scales_shape:?} do not match codes of shape {codes_shape:?}"
        );
    }
    let (experts, rows, blocks) = (codes_shape[0], codes_shape[1], codes_shape[2]);
    if gate_first && rows % 2 != 0 {
        candle_core::bail!("{rows} rows cannot alternate gate and up");
    }
    let ggml_block = 1 + CODE_BYTES;
    let mut packed = Vec::with_capacity(experts * rows * blocks * ggml_block);
    for e in 0..experts {
        for row in 0..rows {
            let source = match gate_first {
                true if row < rows / 2 => 2 * row,
                true => 2 * (row - rows / 2) + 1,
                false => row,
            };
            let first = (e * rows + source) * blocks;
            for b in first..first + blocks {
                packed.push(scales[b]);
                packed.extend(ggml_pairs(&codes[b * CODE_BYTES..][..CODE_BYTES]));
            }
        }
    }
    let mxfp4 = WidenedType::Mxfp4;
    let widened = mxfp4.widen(&packed).map_err(candle_core::Error::Msg)?;
    qtensor_from_ggml(mxfp4.target(), &widened, shape, &Device::Cpu)
}

/// A block's codes paired as llama.cpp stores them: byte `j` holds weight `j` (low
/// nibble) and weight `j + 16` (high), from bytes holding weights `2k` and `2k + 1`.
fn ggml_pairs(codes: &[u8]) -> [u8; CODE_BYTES] {
    let code = |i: usize| (codes[i / 2] >> (4 * (i % 2))) & 0xF;
    std::array::from_fn(|j| code(j) | (code(j + CODE_BYTES) << 4))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers' `convert_moe_packed_tensors` for one row: FP4 values by code, low
    /// nibble first, times `2^(s - 127)`.
    fn reference_row(codes: &[u8], scales: &[u8]) -> Vec<f32> {
        const FP4: [f32; 16] = [
            0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
        ];
        let mut out = Vec::new();
        for (block, &s) in codes.chunks(CODE_BYTES).zip(scales) {
            let scale = 2f32.powi(i32::from(s) - 127);
            for &byte in block {
                out.push(FP4[(byte & 0xF) as usize] * scale);
                out.push(FP4[(byte >> 4) as usize] * scale);
            }
        }
        out
    }

    #[test]
    fn widened_experts_equal_transformers_dequantization_with_gate_rows_first() {
        let (experts, rows, blocks) = (2, 4, 3);
        let mut state = 0x1234_5678_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        };
        let codes: Vec<u8> = (0..experts * rows * blocks * CODE_BYTES)
            .map(|_| next())
            .collect();
        let scales: Vec<u8> = (0..experts * rows * blocks)
            .map(|i| 118 + (i % 9) as u8)
            .collect();
        let shape = [experts, rows, blocks, CODE_BYTES];
        let t = widen(&codes, &shape, &scales, &shape[..3], true).unwrap();
        assert_eq!(t.shape().dims(), [experts, rows, blocks * BLOCK]);
        let values: Vec<f32> = t
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let row_len = blocks * BLOCK;
        for e in 0..experts {
            // Gate rows (even source rows), then up rows (odd).
            for (out_row, source) in [0, 2, 1, 3].into_iter().enumerate() {
                let b = (e * rows + source) * blocks;
                let want = reference_row(
                    &codes[b * CODE_BYTES..][..blocks * CODE_BYTES],
                    &scales[b..b + blocks],
                );
                let got = &values[(e * rows + out_row) * row_len..][..row_len];
                assert_eq!(got, want.as_slice(), "expert {e} row {out_row}");
            }
        }
        assert!(widen(
            &codes,
            &shape,
            &scales[1..],
            &[experts, rows, blocks - 1],
            false
        )
        .is_err());
    }
}
