//! BF16 weights at the opt-in `amx-bf16` level: AMX-BF16's `tdpbf16ps` multiplies 16
//! tokens' activations (rounded to bf16) by 16 pairs of columns of 16 rows and adds the
//! products to 16 x 16 f32 accumulators, 16 times the multiply-adds of AVX-512 BF16's
//! `vdpbf16ps` per instruction.
//!
//! The weights need no repacking: a BF16 panel's pair record (16 dwords, dword `r` holding
//! row `r`'s columns `2j` and `2j + 1`, see `crate::dense`) is one row of a `B` tile, so 16
//! consecutive records are a tile. The activations are rounded to bf16 ([`round_tiles`])
//! with each token padded to whole tile rows and the tokens to whole groups of 16; a
//! panel's last records, when fewer than 16, are copied into a zeroed tile first (the
//! next panel's weights, or the end of the matrix, follow them).
//!
//! Every (token, row) output sums its pairs in column order, one tile row of 16 pairs after
//! another, with the same instruction whatever the batch: results do not depend on the
//! batch, the tiling or the threads. They differ from `avx512-bf16`'s in the last bits:
//! `tdpbf16ps` adds a pair's even product first (`vdpbf16ps` the odd one) and treats bf16
//! denormals as zero (Intel's specification: round to nearest even, no exceptions).

use super::amx::{release_tiles, TileConfig, AMX_BF16};
use super::PREFETCH_BYTES;
use crate::{Dst, PackedMatrix, PANEL};
use half::bf16;
use std::arch::asm;
use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

/// Pairs of columns in one tile row (64 bytes).
const PAIRS: usize = 16;
/// Tokens in one activation tile.
const TOKENS: usize = 16;
/// Bytes of one `B` tile: 16 pair records.
const TILE_BYTES: usize = PAIRS * 64;

/// Whether the CPU has AMX-BF16 and this process the tile state (the `amx` level's grant).
pub(crate) fn available() -> bool {
    super::amx::has_cpuid_bits(&[AMX_BF16]) && super::amx::available()
}

/// Bytes of one token's rounded activations: `k` values padded to whole tile rows.
pub(crate) fn token_bytes(k: usize) -> usize {
    k.next_multiple_of(2 * PAIRS) * 2
}

/// The activations `x` (`m` tokens of `k`) rounded to bf16 (nearest even), each token
/// padded with zeros to [`token_bytes`], and beyond 16 tokens zero tokens up to a whole
/// group of 16 (fewer tokens are one group of their own size, see `run_tile`).
pub(crate) fn round_tiles(x: &[f32], m: usize, k: usize) -> Vec<bf16> {
    let stride = token_bytes(k) / 2;
    let tokens = if m > TOKENS {
        m.next_multiple_of(TOKENS)
    } else {
        m
    };
    super::bf16dot::round_padded(x, m, k, stride, tokens)
}

/// A panel's last pair records, when fewer than a tile's, with zeros after them.
#[repr(C, align(64))]
struct TailTile([u8; TILE_BYTES]);

/// 16 x 16 outputs for a partial store.
#[repr(C, align(64))]
struct Outputs([[f32; PANEL]; TOKENS]);

/// Computes dst for panels `p0..p1` and tokens `t0..t1` on the tiles.
///
/// # Safety
/// The CPU runs the `amx-bf16` level; `mat` is BF16; `x` is [`round_tiles`]' output for
/// the product's tokens and `t0` starts one of its groups of 16; `dst` holds rows `p0·16..`
/// of every token in `t0..t1` and no other thread writes this rectangle.
pub(crate) unsafe fn run_tile(
    mat: &PackedMatrix,
    x: *const u8,
    p0: usize,
    p1: usize,
    t0: usize,
    t1: usize,
    dst: Dst,
) {
    debug_assert!(t0.is_multiple_of(TOKENS) && t1 > t0);
    let pairs = mat.k.div_ceil(2);
    let whole_tiles = pairs / PAIRS;
    let tail_pairs = pairs % PAIRS;
    debug_assert!(pairs * 64 == whole_tiles * TILE_BYTES + tail_pairs * 64);
    // A task of fewer than 16 tokens (a decode) configures only its rows: less work per
    // instruction, the same sums per row, and no row read past the task's tokens.
    let rows = (t1 - t0).min(TOKENS);
    let (acc, act, weights) = ((rows, 64), (rows, 64), (PAIRS, 64));
    TileConfig::with_tiles([acc, acc, acc, acc, act, act, weights, weights]).load();
    let mut tails = [TailTile([0; TILE_BYTES]), TailTile([0; TILE_BYTES])];
    let mut p = p0;
    while p < p1 {
        let panels = (p1 - p).min(2);
        let mut w = [std::ptr::null(); 2];
        for q in 0..panels {
            w[q] = mat.quant_ptr(p + q);
            if tail_pairs > 0 {
                let from = w[q].add(whole_tiles * TILE_BYTES);
                std::ptr::copy_nonoverlapping(from, tails[q].0.as_mut_ptr(), tail_pairs * 64);
            }
        }
        let block = Block {
            w,
            tails: [tails[0].0.as_ptr(), tails[1].0.as_ptr()],
            tiles: whole_tiles + usize::from(tail_pairs > 0),
            whole_tiles,
            ldx: token_bytes(mat.k),
            streams: rows < TOKENS,
        };
        let mut t = t0;
        while t < t1 {
            let groups = (t1 - t).div_ceil(TOKENS).min(2);
            let x_at = x.add(t * block.ldx);
            let stores = Stores { mat, dst, p, t, t1 };
            match (groups, panels) {
                (2, 2) => {
                    block.products::<2, 2>(x_at);
                    stores.store::<2, 2>();
                }
                (2, _) => {
                    block.products::<2, 1>(x_at);
                    stores.store::<2, 1>();
                }
                (_, 2) => {
                    block.products::<1, 2>(x_at);
                    stores.store::<1, 2>();
                }
                _ => {
                    block.products::<1, 1>(x_at);
                    stores.store::<1, 1>();
                }
            }
            t += groups * TOKENS;
        }
        p += panels;
    }
    release_tiles();
}

/// The weights of up to two panels, as tiles.
struct Block {
    /// Each panel's first pair record.
    w: [*const u8; 2],
    /// Each panel's last, partial tile (the last of `tiles` when past `whole_tiles`).
    tails: [*const u8; 2],
    tiles: usize,
    whole_tiles: usize,
    /// Bytes between tokens' activations.
    ldx: usize,
    /// Whether the weights stream from memory (a decode uses each once): they are then
    /// prefetched ahead, as the vector kernels' decode tiles do (0.77x -> 0.9x of
    /// `avx512-bf16`'s batch-1 decode; four panels a block instead of two gained nothing).
    streams: bool,
}

impl Block {
    /// `G` groups of 16 tokens (from `x`) times `P` panels into the accumulator tiles
    /// `2g + q`: activations in tiles 4-5, weights in 6-7.
    #[inline(always)]
    unsafe fn products<const G: usize, const P: usize>(&self, x: *const u8) {
        for g in 0..G {
            for q in 0..P {
                zero_acc(2 * g + q);
            }
        }
        for c in 0..self.tiles {
            for q in 0..P {
                if self.streams {
                    let ahead = self.w[q].wrapping_add(c * TILE_BYTES + PREFETCH_BYTES);
                    for line in 0..TILE_BYTES / 64 {
                        // SAFETY: a prefetch never faults, whatever the address.
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast());
                    }
                }
                let b = if c < self.whole_tiles {
                    self.w[q].add(c * TILE_BYTES)
                } else {
                    self.tails[q]
                };
                load(6 + q, b, 64);
            }
            for g in 0..G {
                load(4 + g, x.add(g * TOKENS * self.ldx + c * 64), self.ldx);
            }
            for g in 0..G {
                for q in 0..P {
                    dot(2 * g + q);
                }
            }
        }
    }
}

/// Where the accumulators of one block go.
struct Stores<'a> {
    mat: &'a PackedMatrix,
    dst: Dst,
    /// First panel and first token of the block.
    p: usize,
    t: usize,
    /// End of the task's tokens.
    t1: usize,
}

impl Stores<'_> {
    /// Stores the accumulators `2g + q` of `G` groups x `P` panels: straight into dst
    /// where the whole tile exists, else through a buffer (a group of fewer than 16
    /// tokens stores only its configured rows).
    #[inline(always)]
    unsafe fn store<const G: usize, const P: usize>(&self) {
        let ldo_bytes = self.dst.ldo * 4;
        for g in 0..G {
            let t = self.t + g * TOKENS;
            let tokens = (self.t1 - t).min(TOKENS);
            for q in 0..P {
                let p = self.p + q;
                let valid = self.mat.valid_rows(p);
                let out = self.dst.at(t, p * PANEL);
                if tokens == TOKENS && valid == PANEL {
                    store_acc(2 * g + q, out, ldo_bytes);
                    continue;
                }
                let mut buf = Outputs([[0.0; PANEL]; TOKENS]);
                store_acc(2 * g + q, buf.0.as_mut_ptr().cast(), 64);
                for (i, row) in buf.0.iter().enumerate().take(tokens) {
                    std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(i * self.dst.ldo), valid);
                }
            }
        }
    }
}

#[inline(always)]
pub(super) unsafe fn zero_acc(c: usize) {
    match c {
        0 => asm!("tilezero tmm0", options(nostack, nomem)),
        1 => asm!("tilezero tmm1", options(nostack, nomem)),
        2 => asm!("tilezero tmm2", options(nostack, nomem)),
        _ => asm!("tilezero tmm3", options(nostack, nomem)),
    }
}

/// Loads tile `tile` (4-7) from `at`, rows `stride` bytes apart.
#[inline(always)]
pub(super) unsafe fn load(tile: usize, at: *const u8, stride: usize) {
    macro_rules! load {
        ($tmm:literal) => {
            asm!(
                concat!("tileloadd ", $tmm, ", [{at} + {stride}*1]"),
                at = in(reg) at,
                stride = in(reg) stride,
                options(nostack, readonly),
            )
        };
    }
    match tile {
        4 => load!("tmm4"),
        5 => load!("tmm5"),
        6 => load!("tmm6"),
        _ => load!("tmm7"),
    }
}

/// Accumulator `2g + q` += activations `g` x weights `q` (tiles 4 + g and 6 + q).
#[inline(always)]
pub(super) unsafe fn dot(c: usize) {
    match c {
        0 => asm!("tdpbf16ps tmm0, tmm4, tmm6", options(nostack, nomem)),
        1 => asm!("tdpbf16ps tmm1, tmm4, tmm7", options(nostack, nomem)),
        2 => asm!("tdpbf16ps tmm2, tmm5, tmm6", options(nostack, nomem)),
        _ => asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem)),
    }
}

/// Stores accumulator `c` (0-3) at `at`, rows `stride` bytes apart.
#[inline(always)]
pub(super) unsafe fn store_acc(c: usize, at: *mut f32, stride: usize) {
    macro_rules! store {
        ($tmm:literal) => {
            asm!(
                concat!("tilestored [{at} + {stride}*1], ", $tmm),
                at = in(reg) at,
                stride = in(reg) stride,
                options(nostack),
            )
        };
    }
    match c {
        0 => store!("tmm0"),
        1 => store!("tmm1"),
        2 => store!("tmm2"),
        _ => store!("tmm3"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Kernel, QuantType};
    use rand::{Rng, SeedableRng};

    /// Bytes of `values` as a BF16 GGUF tensor, and the values they hold.
    fn bf16_matrix(values: &[f32]) -> (Vec<u8>, Vec<f32>) {
        let b: Vec<bf16> = values.iter().map(|&v| bf16::from_f32(v)).collect();
        let bytes = b.iter().flat_map(|v| v.to_le_bytes()).collect();
        (bytes, b.iter().map(|v| v.to_f32()).collect())
    }

    /// `x · Wᵀ` in f64 from the bf16-rounded activations.
    fn rounded_product(w: &[f32], n: usize, k: usize, x: &[f32], m: usize) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for t in 0..m {
            for r in 0..n {
                out[t * n + r] = (0..k)
                    .map(|i| {
                        let xi = bf16::from_f32(x[t * k + i]).to_f32();
                        f64::from(w[r * k + i]) * f64::from(xi)
                    })
                    .sum();
            }
        }
        out
    }

    /// The tile kernel called directly (the level's dispatch could fall back unnoticed):
    /// the product of the weights and the rounded activations up to f32 summation, for
    /// partial last panels, partial groups, a lone short group, odd `k` and `k` whose
    /// pairs end in a partial tile; each token alone (a short group) gives the same bits
    /// as in the batch.
    #[test]
    fn tile_kernel_computes_the_rounded_product_batch_invariantly() {
        if !Kernel::AmxBf16.available() {
            eprintln!("skipped: this CPU has no usable AMX-BF16");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xbf16);
        for (n, k, m) in [
            (40, 64, 21),
            (33, 37, 5),
            (16, 1000, 40),
            (70, 576, 16),
            (5, 3, 1),
        ] {
            let values: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-1f32..1.0)).collect();
            let (bytes, w) = bf16_matrix(&values);
            let mat = PackedMatrix::from_gguf_bytes(QuantType::BF16, &bytes, n, k).unwrap();
            let x: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-2f32..2.0)).collect();
            let product = |x: &[f32], m: usize| {
                let rounded = round_tiles(x, m, k);
                let mut out = vec![0f32; m * n];
                let dst = Dst {
                    ptr: out.as_mut_ptr(),
                    ldo: n,
                    row0: 0,
                };
                // SAFETY: AMX-BF16 is available; `out` holds every row of every token.
                unsafe { run_tile(&mat, rounded.as_ptr().cast(), 0, mat.np, 0, m, dst) };
                out
            };
            let got = product(&x, m);
            let want = rounded_product(&w, n, k, &x, m);
            let (mut err, mut norm) = (0f64, 0f64);
            for (g, w) in got.iter().zip(&want) {
                err += (f64::from(*g) - w).powi(2);
                norm += w * w;
            }
            let rel = (err / norm).sqrt();
            assert!(rel < 1e-5, "{n}x{k} m={m}: rel err {rel}");
            for t in 0..m {
                let alone = product(&x[t * k..(t + 1) * k], 1);
                let same = alone
                    .iter()
                    .zip(&got[t * n..(t + 1) * n])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{n}x{k} m={m}: token {t} alone differs");
            }
        }
    }

    /// A panel whose pairs end in a partial tile reads none of the next panel's weights:
    /// an infinity there would turn the zero padding's products into NaNs.
    #[test]
    fn a_partial_last_tile_reads_nothing_past_its_panel() {
        if !Kernel::AmxBf16.available() {
            eprintln!("skipped: this CPU has no usable AMX-BF16");
            return;
        }
        let (n, k, m) = (32, 36, 3);
        let mut values = vec![0.5f32; n * k];
        values[PANEL * k..].fill(f32::INFINITY);
        let (bytes, _) = bf16_matrix(&values);
        let mat = PackedMatrix::from_gguf_bytes(QuantType::BF16, &bytes, n, k).unwrap();
        let x = vec![1f32; m * k];
        let rounded = round_tiles(&x, m, k);
        let mut out = vec![0f32; m * n];
        let dst = Dst {
            ptr: out.as_mut_ptr(),
            ldo: n,
            row0: 0,
        };
        // SAFETY: as above.
        unsafe { run_tile(&mat, rounded.as_ptr().cast(), 0, mat.np, 0, m, dst) };
        for t in 0..m {
            assert!(out[t * n..t * n + PANEL].iter().all(|&v| v == 18.0));
            assert!(out[t * n + PANEL..(t + 1) * n]
                .iter()
                .all(|&v| v == f32::INFINITY));
        }
    }
}
