//! Intel AMX kernels: the integer dot products of 16 tokens x 16 rows x one block on the
//! tile units, the per-block f32 scaling on AVX-512 as at the `avx512` level.
//!
//! The repacked layout is already the tiles' own: a block-panel record's chunk `c` holds
//! in dword lane `r` four consecutive k values of row `r`, which is row `c` of an
//! AMX `B` tile (K/4 rows of 16 dwords) for the 16 rows. Nibble types are unpacked once
//! per panel into bytes (8 tile rows of 64 bytes a block, in a per-thread buffer), with
//! the offset `o` taken off (`q − o` fits an i8; the quants of the types without an
//! offset are below 64), so the tile product `tdpbssd` (signed bytes x signed bytes)
//! gives each block's exact dot `Σ (q_w − o)·q_a` with no correction.
//! The activations are quantized in groups of 16 tokens laid out for the tiles
//! (`act::Layout::Tiles`): a group's block is one 512-byte `A` tile. The dots are stored
//! and scaled in f32 with the same operations, in the same order, as every other level
//! (`avx512::scale_block`), so the outputs are the same bits.
//!
//! `Q6_K`, whose block halves have their own scales, runs two products of 16 values a
//! block. The last group is filled up with zero activations, whose outputs are dropped.

// The tiles are indexed by token; index loops read as the arithmetic does.
#![allow(clippy::needless_range_loop)]

use super::avx512::{block_scales, scale_block, scale_block_lanes, shift16};
use crate::act::{Layout, QuantAct, TILE_TOKENS as TOKENS};
use crate::format::Planes;
use crate::{AlignedBuf, Dst, PackedMatrix, QuantType, BLOCK, PANEL};
use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Bytes of one block of a panel unpacked for the tiles: 8 rows of 16 rows' 4 bytes.
const UNPACKED_BLOCK: usize = 8 * 64;

/// Whether the CPU has AMX-TILE and AMX-INT8 and the kernel granted this process the
/// tile data state (asked for once; a refusal is said once on stderr).
pub(crate) fn available() -> bool {
    static GRANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *GRANTED.get_or_init(|| has_cpuid_bits(&[AMX_TILE, AMX_INT8]) && request_tile_state())
}

/// CPUID leaf 7, sub-leaf 0, EDX bits of the AMX features.
pub(crate) const AMX_BF16: u32 = 22;
const AMX_TILE: u32 = 24;
const AMX_INT8: u32 = 25;

/// Whether CPUID leaf 7 (sub-leaf 0) sets every one of `bits` in EDX. The leaf exists on
/// every x86-64 CPU that has AVX-512 (checked first by the callers); on older ones it
/// returns zeros.
pub(crate) fn has_cpuid_bits(bits: &[u32]) -> bool {
    let edx = __cpuid_count(7, 0).edx;
    bits.iter().all(|b| edx & (1 << b) != 0)
}

/// Asks the kernel for the tile data state (Linux 5.16 and later), saying a refusal.
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    let granted = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    } == 0;
    if !granted {
        eprintln!(
            "lantern: the CPU has AMX but the kernel did not grant the tile state ({}); \
             using the avx512 kernels",
            std::io::Error::last_os_error()
        );
    }
    granted
}

/// A tile configuration (`ldtilecfg`'s 64 bytes, palette 1).
#[repr(C, align(64))]
pub(super) struct TileConfig([u8; 64]);

impl TileConfig {
    /// Tile `i` of `shapes[i].0` rows of `shapes[i].1` bytes.
    pub(super) fn with_tiles(shapes: [(usize, usize); 8]) -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1;
        for (tile, (rows, bytes)) in shapes.into_iter().enumerate() {
            c[16 + 2 * tile..18 + 2 * tile].copy_from_slice(&(bytes as u16).to_le_bytes());
            c[48 + tile] = rows as u8;
        }
        TileConfig(c)
    }

    /// Tiles 0-1 hold activations (16 tokens x `k` bytes), 2-3 weights (`k / 4` rows of
    /// 64 bytes), 4-7 the 16 x 16 dots; `k` is a block's 32 values, or a half-block's 16
    /// for `Q6_K`.
    fn new(k: usize) -> TileConfig {
        let (a, b, c) = ((TOKENS, k), (k / 4, 64), (TOKENS, 64));
        TileConfig::with_tiles([a, a, b, b, c, c, c, c])
    }

    /// Configures this thread's tiles.
    ///
    /// # Safety
    /// The CPU runs AMX and this process has the tile state.
    pub(super) unsafe fn load(&self) {
        asm!("ldtilecfg [{}]", in(reg) self.0.as_ptr(), options(nostack, readonly));
    }
}

/// Hands this thread's tile state back: the kernel then saves none of it on a switch.
///
/// # Safety
/// The CPU runs AMX.
pub(super) unsafe fn release_tiles() {
    asm!("tilerelease", options(nostack, nomem));
}

thread_local! {
    /// This thread's unpacked panel (grown to the widest matrix it has run).
    static UNPACKED: RefCell<AlignedBuf> = RefCell::new(AlignedBuf::zeroed(0));
}

/// Computes dst for panels `p0..p1` and tokens `t0..t1` on the tiles.
///
/// # Safety
/// The CPU runs the `amx` level; `mat` is quantized; `act` is in the tiles' layout and
/// `t0` starts one of its groups; `dst` holds rows `p0·16..` of every token in `t0..t1`
/// and no other thread writes this rectangle.
pub(crate) unsafe fn run_tile(
    mat: &PackedMatrix,
    act: &QuantAct,
    p0: usize,
    p1: usize,
    t0: usize,
    t1: usize,
    dst: Dst,
) {
    debug_assert!(act.layout == Layout::Tiles && t0.is_multiple_of(TOKENS));
    UNPACKED.with(|buf| {
        let mut buf = buf.borrow_mut();
        buf.set_len_to_overwrite(mat.nb * UNPACKED_BLOCK);
        let k = if mat.ty == QuantType::Q6K { 16 } else { 32 };
        TileConfig::new(k).load();
        for p in p0..p1 {
            let args = PanelArgs {
                mat,
                act,
                p,
                prefetch_next: p + 1 < p1,
                unpacked: buf.as_mut_slice().as_mut_ptr(),
                dst,
            };
            dispatch(mat.ty, &args, t0, t1);
        }
        release_tiles();
    });
}

/// One panel of a tile task.
struct PanelArgs<'a> {
    mat: &'a PackedMatrix,
    act: &'a QuantAct,
    p: usize,
    /// Whether the task's next panel follows: its weights are fetched while this one runs.
    prefetch_next: bool,
    /// `nb · UNPACKED_BLOCK` bytes, 64-byte aligned.
    unpacked: *mut u8,
    dst: Dst,
}

unsafe fn dispatch(ty: QuantType, a: &PanelArgs, t0: usize, t1: usize) {
    use QuantType as Q;
    match ty {
        Q::Q4_0 => panel::<{ Q::Q4_0 as u8 }>(a, t0, t1),
        Q::Q4_1 => panel::<{ Q::Q4_1 as u8 }>(a, t0, t1),
        Q::Q5_0 => panel::<{ Q::Q5_0 as u8 }>(a, t0, t1),
        Q::Q5_1 => panel::<{ Q::Q5_1 as u8 }>(a, t0, t1),
        Q::Q8_0 => panel::<{ Q::Q8_0 as u8 }>(a, t0, t1),
        Q::Q4K => panel::<{ Q::Q4K as u8 }>(a, t0, t1),
        Q::Q5K => panel::<{ Q::Q5K as u8 }>(a, t0, t1),
        Q::Q6K => panel::<{ Q::Q6K as u8 }>(a, t0, t1),
        Q::Q3K => unreachable!("Q3_K has no tiles (QuantType::has_tiles)"),
        Q::F16 | Q::BF16 | Q::F32 => unreachable!("dense types run in x86::dense"),
    }
}

/// The dots of one block (or half-block) for 16 tokens: `C = A · B` into `c`.
///
/// `SLOT` picks the tiles: activations and weights in tiles 0 and 2 (even slots) or 1
/// and 3 (odd), the dots in tile `4 + SLOT`, so that the products of the next block are
/// under way while this one's dots are scaled.
#[inline(always)]
unsafe fn tile_dot<const SLOT: usize>(a: *const u8, lda: usize, b: *const u8, c: *mut i32) {
    macro_rules! dot {
        ($ta:literal, $tb:literal, $tc:literal) => {
            asm!(
                concat!("tilezero ", $tc),
                concat!("tileloadd ", $ta, ", [{a} + {lda}*1]"),
                concat!("tileloadd ", $tb, ", [{b} + {ldb}*1]"),
                concat!("tdpbssd ", $tc, ", ", $ta, ", ", $tb),
                concat!("tilestored [{c} + {ldc}*1], ", $tc),
                a = in(reg) a,
                lda = in(reg) lda,
                b = in(reg) b,
                ldb = in(reg) 64usize,
                c = in(reg) c,
                ldc = in(reg) 64usize,
                options(nostack),
            )
        };
    }
    match SLOT {
        0 => dot!("tmm0", "tmm2", "tmm4"),
        1 => dot!("tmm1", "tmm3", "tmm5"),
        2 => dot!("tmm0", "tmm2", "tmm6"),
        _ => dot!("tmm1", "tmm3", "tmm7"),
    }
}

/// 16 x 16 dots, 64-byte aligned for the tile stores and the vector loads.
#[repr(C, align(64))]
struct Dots([[i32; PANEL]; TOKENS]);

/// A panel's stack space: the current block's activation scales, then the dots of two
/// blocks in flight (`hi`: `Q6_K`'s second halves). The scales come first so that no tile
/// store shares their offset modulo 4 KiB but `Q6_K`'s last dots (`Q6_K` does without).
#[repr(C, align(64))]
struct Scratch {
    scalars: [[f32; TOKENS]; 2],
    lo: [Dots; 2],
    hi: [Dots; 2],
}

/// The dots of block `b` (both halves for `Q6_K`) of the 16 tokens' activation tile at
/// `aq` and the unpacked weights at `w`, into `lo` (and `hi`), on the slots of `b`'s
/// parity.
#[inline(always)]
unsafe fn block_dots<const F: u8>(
    b: usize,
    aq: *const u8,
    w: *const u8,
    lo: &mut Dots,
    hi: &mut Dots,
) {
    let lda = BLOCK;
    let ty = QuantType::from_id(F);
    let (lo, hi) = (lo.0.as_mut_ptr().cast(), hi.0.as_mut_ptr().cast());
    if ty == QuantType::Q6K {
        let (aq_hi, w_hi) = (aq.add(16), w.add(UNPACKED_BLOCK / 2));
        if b.is_multiple_of(2) {
            tile_dot::<0>(aq, lda, w, lo);
            tile_dot::<1>(aq_hi, lda, w_hi, hi);
        } else {
            tile_dot::<2>(aq, lda, w, lo);
            tile_dot::<3>(aq_hi, lda, w_hi, hi);
        }
    } else if b.is_multiple_of(2) {
        tile_dot::<0>(aq, lda, w, lo);
    } else {
        tile_dot::<1>(aq, lda, w, lo);
    }
}

/// Panel `a.p` for tokens `t0..t1` (from the start of a group), weight type `F`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni")]
unsafe fn panel<const F: u8>(a: &PanelArgs, t0: usize, t1: usize) {
    let ty = QuantType::from_id(F);
    let (mat, act) = (a.mat, a.act);
    let nb = mat.nb;
    let split = ty == QuantType::Q6K;
    let sbp = ty.packed_scale_bytes();
    let qbp = ty.packed_quant_bytes();
    let unit = ty.scale_unit();
    unpack::<F>(mat.quant_ptr(a.p), nb, a.unpacked);
    let sc = mat.scale_ptr(a.p);
    let new_dots = || Dots([[0; PANEL]; TOKENS]);
    let mut scratch = Scratch {
        scalars: [[0.0; TOKENS]; 2],
        lo: [new_dots(), new_dots()],
        hi: [new_dots(), new_dots()],
    };
    let mask = ((1u32 << mat.valid_rows(a.p)) - 1) as u16;
    for t in (t0..t1).step_by(TOKENS) {
        // The group's blocks: one 16 x 32-byte activation tile and 16 scales each.
        let group = t * nb;
        let aq = act.q.as_ptr().add(group * BLOCK);
        let (ad, as_) = (act.d.as_ptr().add(group), act.s.as_ptr().add(group));
        let tile = |b: usize| aq.add(b * TOKENS * BLOCK);
        let mut acc = [_mm512_setzero_ps(); TOKENS];
        for i in 0..(t1 - t).min(TOKENS) {
            prefetch_for_store(a.dst.at(t + i, a.p * PANEL));
        }
        let Scratch { scalars, lo, hi } = &mut scratch;
        let [lo0, lo1] = lo;
        let [hi0, hi1] = hi;
        block_dots::<F>(0, tile(0), a.unpacked, lo0, hi0);
        for b in 0..nb {
            // The block's 16 d_a and s_a, read once (two loads, not 32 broadcasts that
            // may each wait on a tile store whose address matches theirs modulo 4 KiB:
            // that halved Q4_1's speed) into lines no tile store aliases.
            // `Q6_K`'s dots fill all 4 KiB, so its d_a stay in a register (it has no s_a).
            let da_lanes = if split {
                _mm512_loadu_ps(ad.add(b * TOKENS))
            } else {
                for (copy, from) in scalars.iter_mut().zip([ad, as_]) {
                    let v = _mm512_loadu_ps(from.add(b * TOKENS));
                    _mm512_store_ps(copy.as_mut_ptr(), v);
                }
                _mm512_setzero_ps()
            };
            // The next block's products go first: they run while this block's dots,
            // stored one block earlier, are scaled.
            if b + 1 < nb {
                let (l, h) = if b.is_multiple_of(2) {
                    (&mut *lo1, &mut *hi1)
                } else {
                    (&mut *lo0, &mut *hi0)
                };
                let w = a.unpacked.add((b + 1) * UNPACKED_BLOCK);
                block_dots::<F>(b + 1, tile(b + 1), w, l, h);
            }
            let (l, h) = if b.is_multiple_of(2) {
                (&*lo0, &*hi0)
            } else {
                (&*lo1, &*hi1)
            };
            if a.prefetch_next && t == t0 {
                // The next panel's block `b`, so that its unpacking finds it in L2 rather
                // than waiting on memory at the panel's start: a decode step of 32 tokens
                // or more streams every matrix from memory (BENCHMARKS.md).
                let next_quants = mat.quant_ptr(a.p + 1).add(b * qbp);
                prefetch_lines(next_quants, qbp);
                if b % unit == 0 {
                    prefetch_lines(mat.scale_ptr(a.p + 1).add(b / unit * sbp), sbp);
                }
            }
            let scales = block_scales(ty.scales(), sc.add(b / unit * sbp), b % unit);
            for i in 0..TOKENS {
                let dot = _mm512_load_si512(l.0[i].as_ptr().cast());
                if split {
                    let dot_hi = _mm512_load_si512(h.0[i].as_ptr().cast());
                    let da = _mm512_permutexvar_ps(_mm512_set1_epi32(i as i32), da_lanes);
                    scale_block_lanes(&mut acc[i], &scales, dot, dot_hi, da);
                } else {
                    let (da, sa) = (scalars[0][i], scalars[1][i]);
                    let none = _mm512_setzero_si512();
                    scale_block(&mut acc[i], &scales, dot, none, da, sa);
                }
            }
        }
        for i in 0..(t1 - t).min(TOKENS) {
            _mm512_mask_storeu_ps(a.dst.at(t + i, a.p * PANEL), mask, acc[i]);
        }
    }
}

/// Asks for the one or two lines of a token's 16 outputs at `at` in L1, ready to be
/// written, while the group's blocks run: a store whose line is in no cache would hold
/// back the next group's tile stores (stores leave in order) until it arrived. A
/// vocabulary's logits for many tokens miss on almost every line: measured at 512
/// tokens, SmolLM2's and Gemma 3's output matrices 1.55-1.8x faster and their layers
/// 1.05-1.2x (2-core Xeon with AMX, 2 threads, `quant_bench --decode --batch 512`).
/// `prefetchw` (every AMX CPU has it) takes the lines for writing: 3-5% on top of a
/// plain prefetch for the output matrices there.
#[inline(always)]
unsafe fn prefetch_for_store(at: *const f32) {
    asm!(
        "prefetchw [{first}]",
        "prefetchw [{last}]",
        first = in(reg) at,
        last = in(reg) at.wrapping_add(PANEL - 1),
        options(nostack, readonly, preserves_flags),
    );
}

/// Asks for the 64-byte lines of `bytes` bytes at `at` to be brought into L2.
#[inline(always)]
unsafe fn prefetch_lines(at: *const u8, bytes: usize) {
    for line in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T1>(at.add(line).cast());
    }
}

/// Unpacks a panel's `nb` block records at `q` into tile rows at `out`: per block, rows
/// 0-3 hold values `4c..4c+4` and rows 4-7 values `16+4c..16+4c+4` of the 16 rows (chunk
/// `c`'s low and high nibbles with their high bits), less the type's offset; `Q8_0`'s 8
/// chunks are its rows, unbiased.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn unpack<const F: u8>(q: *const u8, nb: usize, out: *mut u8) {
    let ty = QuantType::from_id(F);
    let planes = ty.planes();
    let qbp = ty.packed_quant_bytes();
    let off = _mm512_set1_epi8(ty.offset() as u8 as i8);
    let nib = _mm512_set1_epi8(0x0F);
    let bit4 = _mm512_set1_epi8(0x10);
    let bits45 = _mm512_set1_epi8(0x30);
    for b in 0..nb {
        let rec = q.add(b * qbp);
        let dst = out.add(b * UNPACKED_BLOCK);
        let row = |r: usize| dst.add(64 * r).cast::<__m512i>();
        if planes == Planes::Bytes {
            for c in 0..8 {
                let v = _mm512_load_si512(rec.add(64 * c).cast());
                // Wrapping byte subtraction: `Q8_0`'s `q + 128 − 128` is its i8 again.
                _mm512_store_si512(row(c), _mm512_sub_epi8(v, off));
            }
            continue;
        }
        let h0 = _mm512_load_si512(rec.add(256).cast());
        let h1 = if planes == Planes::Nibbles2 {
            _mm512_load_si512(rec.add(320).cast())
        } else {
            h0
        };
        for c in 0..4 {
            let w = _mm512_load_si512(rec.add(64 * c).cast());
            let mut low = _mm512_and_si512(w, nib);
            let mut high = _mm512_and_si512(_mm512_srli_epi16::<4>(w), nib);
            let ci = c as i32;
            if planes == Planes::Nibbles1 {
                low = _mm512_or_si512(low, _mm512_and_si512(shift16(h0, 4 - ci), bit4));
                high = _mm512_or_si512(high, _mm512_and_si512(shift16(h0, -ci), bit4));
            } else if planes == Planes::Nibbles2 {
                low = _mm512_or_si512(low, _mm512_and_si512(shift16(h0, 4 - 2 * ci), bits45));
                high = _mm512_or_si512(high, _mm512_and_si512(shift16(h1, 4 - 2 * ci), bits45));
            }
            _mm512_store_si512(row(c), _mm512_sub_epi8(low, off));
            _mm512_store_si512(row(4 + c), _mm512_sub_epi8(high, off));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{scalar, Kernel};
    use rand::{Rng, SeedableRng};

    /// The tile kernel itself, called directly (the level's dispatch could fall back to
    /// vectors unnoticed), on every quantized type, with a partial last panel and a
    /// partial last group: the same bits as the scalar kernel.
    #[test]
    fn tile_kernel_equals_the_scalar_kernel() {
        if !Kernel::Amx.available() {
            eprintln!("skipped: this CPU has no usable AMX");
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x7115);
        for ty in QuantType::QUANTIZED.into_iter().filter(|t| t.has_tiles()) {
            let (n, k, m) = (40, 512, 21);
            let mut bytes: Vec<u8> = (0..n * k / ty.block_values() * ty.block_bytes())
                .map(|_| rng.gen())
                .collect();
            // Finite f16 scales where each type keeps them.
            let scales_at: &[usize] = match ty {
                QuantType::Q4_0 | QuantType::Q5_0 | QuantType::Q8_0 => &[0],
                QuantType::Q6K => &[208],
                _ => &[0, 2],
            };
            for block in bytes.chunks_mut(ty.block_bytes()) {
                for &at in scales_at {
                    let d = half::f16::from_f32(rng.gen_range(1e-3f32..2e-2));
                    block[at..at + 2].copy_from_slice(&d.to_le_bytes());
                }
            }
            let mat = PackedMatrix::from_gguf_bytes(ty, &bytes, n, k).unwrap();
            let x: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-2f32..2.0)).collect();
            let (mut tiles, mut want) = (vec![0f32; m * n], vec![0f32; m * n]);
            let dst = |out: &mut [f32]| Dst {
                ptr: out.as_mut_ptr(),
                ldo: n,
                row0: 0,
            };
            let act = QuantAct::quantize(Kernel::Amx, &x, m, k, false);
            assert_eq!(act.layout, Layout::Tiles);
            let plain = QuantAct::quantize(Kernel::Scalar, &x, m, k, false);
            // SAFETY: AMX is available; dst holds every row of every token.
            unsafe {
                run_tile(&mat, &act, 0, mat.np, 0, m, dst(&mut tiles));
                scalar::run_tile(&mat, &plain, 0, mat.np, 0, m, dst(&mut want));
            }
            let same = tiles
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{ty}: the tile kernel differs from the scalar kernel");
        }
    }
}
