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
    // A task of fewer than 16 tokens (a decode) is one group that configures only its
    // rows (less work per instruction, the same sums per row, no row read past the task's
    // tokens) and runs four panels at a time: its weights stream from memory, and four
    // streams keep more of them in flight than two.
    let rows = (t1 - t0).min(TOKENS);
    let narrow = rows < TOKENS;
    let (acc, act, weights) = ((rows, 64), (rows, 64), (PAIRS, 64));
    let config = if narrow {
        [acc, acc, acc, acc, weights, weights, weights, act]
    } else {
        [acc, acc, acc, acc, act, act, weights, weights]
    };
    TileConfig::with_tiles(config).load();
    let per_block = if narrow { 4 } else { 2 };
    let mut tails: [TailTile; 4] = std::array::from_fn(|_| TailTile([0; TILE_BYTES]));
    let mut p = p0;
    while p < p1 {
        let panels = (p1 - p).min(per_block);
        let mut w = [std::ptr::null(); 4];
        for q in 0..panels {
            w[q] = mat.quant_ptr(p + q);
            if tail_pairs > 0 {
                let from = w[q].add(whole_tiles * TILE_BYTES);
                std::ptr::copy_nonoverlapping(from, tails[q].0.as_mut_ptr(), tail_pairs * 64);
            }
        }
        let block = Block {
            w,
            tails: std::array::from_fn(|q| tails[q].0.as_ptr()),
            whole_tiles,
            has_tail: tail_pairs > 0,
            ldx: token_bytes(mat.k),
        };
        let mut t = t0;
        while t < t1 {
            let groups = (t1 - t).div_ceil(TOKENS).min(2);
            let x_at = x.add(t * block.ldx);
            let stores = Stores {
                mat,
                dst,
                p,
                t,
                t1,
                rows,
            };
            match (narrow, groups, panels) {
                (true, _, 4) => block.one_group::<4>(x_at),
                (true, _, 3) => block.one_group::<3>(x_at),
                (true, _, 2) => block.one_group::<2>(x_at),
                (true, _, _) => block.one_group::<1>(x_at),
                (false, 2, 2) => block.groups::<2, 2>(x_at),
                (false, 2, _) => block.groups::<2, 1>(x_at),
                (false, _, 2) => block.groups::<1, 2>(x_at),
                (false, _, _) => block.groups::<1, 1>(x_at),
            }
            match (groups, panels) {
                (2, 2) => stores.store::<2, 2>(),
                (2, _) => stores.store::<2, 1>(),
                (_, 4) => stores.store::<1, 4>(),
                (_, 3) => stores.store::<1, 3>(),
                (_, 2) => stores.store::<1, 2>(),
                _ => stores.store::<1, 1>(),
            }
            t += groups * TOKENS;
        }
        p += panels;
    }
    release_tiles();
}

/// The weights of up to four panels, as tiles.
struct Block {
    /// Each panel's first pair record.
    w: [*const u8; 4],
    /// Each panel's last, partial tile (when `has_tail`).
    tails: [*const u8; 4],
    whole_tiles: usize,
    has_tail: bool,
    /// Bytes between tokens' activations.
    ldx: usize,
}

impl Block {
    /// Tile `c`'s weights of panel `q`, when `c` is the last, partial one from its copy.
    #[inline(always)]
    unsafe fn weights(&self, q: usize, c: usize) -> *const u8 {
        if c < self.whole_tiles {
            self.w[q].add(c * TILE_BYTES)
        } else {
            self.tails[q]
        }
    }

    fn tiles(&self) -> usize {
        self.whole_tiles + usize::from(self.has_tail)
    }

    /// `G` groups of 16 tokens (from `x`) times `P` panels (at most 2 x 2) into the
    /// accumulator tiles `2g + q`: activations in tiles 4-5, weights in 6-7.
    #[inline(always)]
    unsafe fn groups<const G: usize, const P: usize>(&self, x: *const u8) {
        for g in 0..G {
            for q in 0..P {
                zero_acc(2 * g + q);
            }
        }
        for c in 0..self.tiles() {
            for q in 0..P {
                load(6 + q, self.weights(q, c), 64);
            }
            for g in 0..G {
                load(4 + g, x.add(g * TOKENS * self.ldx + c * 64), self.ldx);
            }
            for g in 0..G {
                for q in 0..P {
                    dot(2 * g + q, 4 + g, 6 + q);
                }
            }
        }
    }

    /// One group of fewer than 16 tokens (tile 7) times `P` panels (up to 4) into the
    /// accumulator tiles `q`, the weights in tiles 4-6 (the fourth panel's in tile 4 again,
    /// once the first's product has read it), prefetched ahead as the vector kernels'
    /// decode tiles do: few tokens use each weight once, so they stream from memory.
    #[inline(always)]
    unsafe fn one_group<const P: usize>(&self, x: *const u8) {
        for q in 0..P {
            zero_acc(q);
        }
        for c in 0..self.tiles() {
            for q in 0..P {
                let ahead = self.w[q].wrapping_add(c * TILE_BYTES + 2 * PREFETCH_BYTES);
                for line in 0..TILE_BYTES / 64 {
                    // SAFETY: a prefetch never faults, whatever the address.
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64 * line).cast());
                }
            }
            load(7, x.add(c * 64), self.ldx);
            for q in 0..P.min(3) {
                load(4 + q, self.weights(q, c), 64);
            }
            dot(0, 7, 4);
            if P == 4 {
                load(4, self.weights(3, c), 64);
            }
            if P >= 2 {
                dot(1, 7, 5);
            }
            if P >= 3 {
                dot(2, 7, 6);
            }
            if P == 4 {
                dot(3, 7, 4);
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
    /// Rows the tiles are configured with.
    rows: usize,
}

impl Stores<'_> {
    /// Stores the accumulators `2g + q` of `G` groups x `P` panels: straight into dst
    /// where the whole tile exists, else through a buffer.
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
                for (i, row) in buf.0.iter().enumerate().take(tokens.min(self.rows)) {
                    std::ptr::copy_nonoverlapping(row.as_ptr(), out.add(i * self.dst.ldo), valid);
                }
            }
        }
    }
}

#[inline(always)]
unsafe fn zero_acc(c: usize) {
    match c {
        0 => asm!("tilezero tmm0", options(nostack, nomem)),
        1 => asm!("tilezero tmm1", options(nostack, nomem)),
        2 => asm!("tilezero tmm2", options(nostack, nomem)),
        _ => asm!("tilezero tmm3", options(nostack, nomem)),
    }
}

/// Loads tile `tile` (4-7) from `at`, rows `stride` bytes apart.
#[inline(always)]
unsafe fn load(tile: usize, at: *const u8, stride: usize) {
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

/// Accumulator tile `c` += activations tile `a` x weights tile `b`, for the pairings
/// `Block`'s two layouts use.
#[inline(always)]
unsafe fn dot(c: usize, a: usize, b: usize) {
    macro_rules! dot {
        ($c:literal, $a:literal, $b:literal) => {
            asm!(
                concat!("tdpbf16ps ", $c, ", ", $a, ", ", $b),
                options(nostack, nomem)
            )
        };
    }
    match (c, a, b) {
        (0, 4, 6) => dot!("tmm0", "tmm4", "tmm6"),
        (1, 4, 7) => dot!("tmm1", "tmm4", "tmm7"),
        (2, 5, 6) => dot!("tmm2", "tmm5", "tmm6"),
        (3, 5, 7) => dot!("tmm3", "tmm5", "tmm7"),
        (0, 7, 4) => dot!("tmm0", "tmm7", "tmm4"),
        (1, 7, 5) => dot!("tmm1", "tmm7", "tmm5"),
        (2, 7, 6) => dot!("tmm2", "tmm7", "tmm6"),
        (3, 7, 4) => dot!("tmm3", "tmm7", "tmm4"),
        _ => unreachable!("no tile product {c} += {a} x {b}"),
    }
}

/// Stores accumulator `c` (0-3) at `at`, rows `stride` bytes apart.
#[inline(always)]
unsafe fn store_acc(c: usize, at: *mut f32, stride: usize) {
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
    /// partial last panels, partial groups, a lone short group with 1 to 4 panels a block,
    /// odd `k` and `k` whose pairs end in a partial tile; each token alone (a short group)
    /// gives the same bits as in the batch.
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
