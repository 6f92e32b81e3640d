//! Products on AMX-BF16 tiles for code outside the weight products: attention's scores and
//! weighted values at the opt-in `amx-bf16` level. `out = A · Bᵀ`, where the rows of `A`
//! ([`TileRows`]) and the columns of `B` ([`TileColumns`]) are rounded to bf16 (nearest
//! even) and zero-padded to whole tile rows of 32 values, and `tdpbf16ps` sums each output
//! in f32.
//!
//! Each output element is computed by the same instructions from its row of `A` and its
//! column of `B` alone, in the same order of `k`, whatever the other rows and columns are
//! and however many there are: a row computed alone gives the same bits as in a batch
//! (tested). Products of exact zeros leave a sum unchanged, so zeros before or after a
//! row's values (a longer `k`) do not change its results either (tested).

use super::amx::{release_tiles, TileConfig};
use super::amx_bf16::{available, dot, load, store_acc, zero_acc};
use crate::{active_kernel, Kernel};
use half::bf16;
use std::arch::x86_64::*;

/// Rows of an `A` (and `C`) tile.
const TILE_ROWS: usize = 16;
/// Columns of a `B` (and `C`) tile: a panel.
const PANEL: usize = 16;
/// Values of `k` in one tile row (64 bytes of bf16).
pub const CHUNK: usize = 32;

/// The right to run tile products: there is one only where the CPU has AMX-BF16 and this
/// process the tile state.
#[derive(Debug, Clone, Copy)]
pub struct Bf16Tiles(());

impl Bf16Tiles {
    /// The tiles, when the `amx-bf16` level is in effect (`LANTERN_KERNELS` or
    /// [`force_kernel`](crate::force_kernel), which never exceed what the CPU runs).
    pub fn in_effect() -> Option<Bf16Tiles> {
        (active_kernel() == Kernel::AmxBf16 && available()).then_some(Bf16Tiles(()))
    }

    /// The tiles, when this CPU and process can run them (whatever the level).
    pub fn on_this_cpu() -> Option<Bf16Tiles> {
        available().then_some(Bf16Tiles(()))
    }

    /// Configures this thread's tiles for products whose `A` has `rows` rows, until the
    /// session is dropped (configuring costs about what a small product does, so an
    /// attention item keeps one session for all its products). No other tile code may
    /// run on the thread meanwhile (the weight products configure their own tiles).
    ///
    /// # Panics
    /// When this thread already has a session: a second configuration would make the
    /// first one's products read and write past their operands.
    pub fn session(self, rows: usize) -> TileSession {
        assert!(
            !IN_SESSION.replace(true),
            "bf16 tiles: a session is already open on this thread"
        );
        let rows = rows.clamp(1, TILE_ROWS);
        let (acc, act, cols) = ((rows, 64), (rows, 64), (TILE_ROWS, 64));
        // SAFETY: `self` exists only where the tiles run.
        unsafe { TileConfig::with_tiles([acc, acc, acc, acc, act, act, cols, cols]).load() };
        TileSession {
            rows,
            _not_send: std::marker::PhantomData,
        }
    }
}

/// This thread's tiles, configured by [`Bf16Tiles::session`]; released when dropped.
pub struct TileSession {
    /// Rows configured: an `A` of this many rows, or of any whole number of 16 when 16.
    rows: usize,
    /// The configuration belongs to the thread that loaded it.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl TileSession {
    /// `out[i·ldo + j] = Σ_k a[i][k]·b[j][k]` for every row `i` of `a` and column `j` of
    /// `b`, in `tdpbf16ps`'s arithmetic. `out` holds `a.stored_rows()` rows of `ldo ≥
    /// b.stored_columns()` values; the padding rows and columns get what zeros give.
    ///
    /// # Panics
    /// When `a` and `b` have different `k`, `a`'s rows are not the session's, or `out` is
    /// too short (a caller's bug).
    pub fn product(&self, a: &TileRows, b: &TileColumns, out: &mut [f32], ldo: usize) {
        assert_eq!(a.stride, 2 * b.pairs, "bf16 tile product: k differs");
        assert_eq!(
            a.rows.clamp(1, TILE_ROWS),
            self.rows,
            "bf16 tile product: rows differ"
        );
        let rows = a.stored_rows();
        assert!(
            ldo >= b.stored_columns(),
            "bf16 tile product: ldo {ldo} too small"
        );
        assert!(
            rows == 0 || out.len() >= (rows - 1) * ldo + b.stored_columns(),
            "bf16 tile product: output too short"
        );
        if rows == 0 || b.columns == 0 {
            return;
        }
        // SAFETY: the session configured this thread's tiles for `a`'s rows; the operands
        // and `out` were checked to hold every tile row and column read or written.
        unsafe { run(a, b, out.as_mut_ptr(), ldo) }
    }
}

impl Drop for TileSession {
    fn drop(&mut self) {
        // SAFETY: a session exists only where the tiles run.
        unsafe { release_tiles() }
        IN_SESSION.set(false);
    }
}

thread_local! {
    /// Whether this thread has a [`TileSession`] open.
    static IN_SESSION: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Rows stored for `rows`: up to one tile they are exactly configured, beyond it padded to
/// whole tiles.
fn stored_rows(rows: usize) -> usize {
    if rows > TILE_ROWS {
        rows.next_multiple_of(TILE_ROWS)
    } else {
        rows
    }
}

/// The `A` operand: rows of `k` values rounded to bf16, each padded with zeros to whole
/// tile rows, and rows up to whole tiles beyond 16 rows (whose sums nobody reads).
#[derive(Debug, Default, Clone)]
pub struct TileRows {
    data: Vec<bf16>,
    rows: usize,
    /// Values per row: `k` rounded up to [`CHUNK`].
    stride: usize,
}

impl TileRows {
    /// Makes it `rows` rows of `k` values without clearing what it held: each row a
    /// product's caller reads must be written whole first ([`TileRows::set_whole_row`]);
    /// the others give rows of sums nobody reads (an output row comes from its row
    /// alone).
    pub fn reshape(&mut self, rows: usize, k: usize) {
        self.rows = rows;
        self.stride = k.next_multiple_of(CHUNK);
        let len = stored_rows(rows) * self.stride;
        if self.data.len() < len {
            self.data.resize(len, bf16::ZERO);
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Rows an output of a product with it must hold.
    pub fn stored_rows(&self) -> usize {
        stored_rows(self.rows)
    }

    /// Row `i`: `values` rounded from `at` on, zeros before and after them.
    ///
    /// # Panics
    /// When the row or the values are outside the rows and `k` given to `reshape`.
    pub fn set_whole_row(&mut self, i: usize, at: usize, values: &[f32]) {
        assert!(i < self.rows && at + values.len() <= self.stride);
        let row = &mut self.data[i * self.stride..][..self.stride];
        let (before, rest) = row.split_at_mut(at);
        let (mid, after) = rest.split_at_mut(values.len());
        before.fill(bf16::ZERO);
        round_into(values, mid);
        after.fill(bf16::ZERO);
    }
}

/// The `B` operand: `columns` columns of `k` values rounded to bf16, stored as tiles read
/// them: per panel of 16 columns, per pair of `k` values, 16 dwords (column `j`'s values
/// `2c` and `2c + 1`, the even one in the low half); zeros past `k` and past the columns.
#[derive(Debug, Default, Clone)]
pub struct TileColumns {
    data: Vec<u32>,
    columns: usize,
    /// Pairs of `k` per column: `k` rounded up to [`CHUNK`], halved.
    pairs: usize,
    /// Rows rounded on their way in (kept: a decode step fills thousands of these).
    staging: Vec<u32>,
}

impl TileColumns {
    /// Makes it `columns` columns of `k` values, all zero (keeps the allocation).
    pub fn reset(&mut self, columns: usize, k: usize) {
        let len = self.reshape(columns, k);
        self.data[..len].fill(0);
    }

    /// Makes it `columns` columns of `k` values without clearing what it held; returns
    /// the length of its records.
    fn reshape(&mut self, columns: usize, k: usize) -> usize {
        self.columns = columns;
        self.pairs = k.next_multiple_of(CHUNK) / 2;
        let len = columns.div_ceil(PANEL) * self.pairs * PANEL;
        if self.data.len() < len {
            self.data.resize(len, 0);
        }
        len
    }

    pub fn columns(&self) -> usize {
        self.columns
    }

    /// Columns an output row of a product with it must hold.
    pub fn stored_columns(&self) -> usize {
        self.columns.next_multiple_of(PANEL)
    }

    /// Resets it to the columns given as the rows of `rows` (`[columns, k]` row-major):
    /// as `keys` for scores `q · keysᵀ`.
    pub fn set_from_rows(&mut self, rows: &[f32], k: usize) {
        let columns = rows.len().checked_div(k).unwrap_or(0);
        // Every record of every panel is written below: no clearing.
        self.reshape(columns, k);
        if columns == 0 {
            return;
        }
        let pairs = self.pairs;
        // Each column's values rounded in place as dwords of pairs (a dword holds its
        // pair's even value in the low half, as bf16s in memory order), then 16 columns'
        // dword `c` gathered into record `c`.
        let packed = &mut self.staging;
        packed.clear();
        packed.resize(PANEL * pairs, 0);
        for (p, panel_rows) in rows[..columns * k].chunks(PANEL * k).enumerate() {
            let n = panel_rows.len() / k;
            if n < PANEL {
                // The missing columns' lanes are zeros.
                packed.fill(0);
            }
            for (j, row) in panel_rows.chunks_exact(k).enumerate() {
                let column = &mut packed[j * pairs..(j + 1) * pairs];
                // SAFETY: `bf16` is a `u16`; a dword slice is two of them per element,
                // aligned for either.
                let values: &mut [bf16] = unsafe {
                    std::slice::from_raw_parts_mut(column.as_mut_ptr().cast(), 2 * pairs)
                };
                round_into(row, &mut values[..k]);
                values[k..].fill(bf16::ZERO);
            }
            let records = &mut self.data[p * pairs * PANEL..][..pairs * PANEL];
            transpose_into(packed, n, pairs, records);
        }
    }

    /// Values `at..at + n` of every column from the `n` rows of `rows` (`[n, columns]`
    /// row-major, value `at + i` of column `j` is `rows[i][j]`): as `values` for
    /// `p · values`, the keys along `k`. The other values stay as they were (lanes past
    /// the columns may become zeros).
    ///
    /// # Panics
    /// When the rows are not `columns` long or reach past `k`.
    pub fn set_k_rows(&mut self, at: usize, rows: &[f32]) {
        let columns = self.columns;
        if columns == 0 {
            return;
        }
        assert!(rows.len().is_multiple_of(columns) && at + rows.len() / columns <= 2 * self.pairs);
        let n = rows.len() / columns;
        let mut i = 0;
        while i < n {
            // Two values of a pair at once where both are given (the even one first).
            if (at + i).is_multiple_of(2) && i + 1 < n {
                let (even, odd) = (
                    &rows[i * columns..][..columns],
                    &rows[(i + 1) * columns..][..columns],
                );
                self.set_pair((at + i) / 2, even, odd);
                i += 2;
            } else {
                self.set_half(at + i, &rows[i * columns..][..columns]);
                i += 1;
            }
        }
    }

    /// Pair `c` of every column from `even` and `odd` (`columns` values each).
    fn set_pair(&mut self, c: usize, even: &[f32], odd: &[f32]) {
        let pairs = self.pairs;
        for (p, (e, o)) in even.chunks(PANEL).zip(odd.chunks(PANEL)).enumerate() {
            let record = &mut self.data[(p * pairs + c) * PANEL..][..PANEL];
            pack_pair(e, o, record);
        }
    }

    /// Value `at` of every column from `row`, the other value of its pair kept.
    fn set_half(&mut self, at: usize, row: &[f32]) {
        let (c, shift) = (at / 2, 16 * (at % 2));
        for (j, chunk) in row.chunks(PANEL).enumerate() {
            let mut rounded = [bf16::ZERO; PANEL];
            round_into(chunk, &mut rounded[..chunk.len()]);
            let record = &mut self.data[(j * self.pairs + c) * PANEL..][..PANEL];
            for (dword, v) in record.iter_mut().zip(&rounded[..chunk.len()]) {
                *dword = (*dword & !(0xFFFF << shift)) | (u32::from(v.to_bits()) << shift);
            }
        }
    }
}

/// `records[c·16 + j] = packed[j·pairs + c]` for the `n ≤ 16` columns `j` (the other
/// lanes zero): a panel's columns of dword pairs turned into its pair records.
fn transpose_into(packed: &[u32], n: usize, pairs: usize, records: &mut [u32]) {
    debug_assert!(n <= PANEL && packed.len() >= PANEL * pairs && records.len() >= pairs * PANEL);
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512 F is present; the lengths were checked above.
        return unsafe { transpose_gather(packed, pairs, records) };
    }
    for c in 0..pairs {
        for j in 0..PANEL {
            records[c * PANEL + j] = if j < n { packed[j * pairs + c] } else { 0 };
        }
    }
}

/// [`transpose_into`] by gathers (the lanes past `n` read `packed`'s zeros).
///
/// # Safety
/// The CPU runs AVX-512 F; `packed` holds 16 columns of `pairs`, `records` `pairs` records.
#[target_feature(enable = "avx512f")]
unsafe fn transpose_gather(packed: &[u32], pairs: usize, records: &mut [u32]) {
    let stride = pairs as i32;
    let index = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(stride),
    );
    let base = packed.as_ptr().cast::<i32>();
    for c in 0..pairs {
        let record = _mm512_i32gather_epi32::<4>(index, base.add(c));
        _mm512_storeu_si512(records.as_mut_ptr().add(c * PANEL).cast(), record);
    }
}

/// One pair record (16 lanes) from 16 columns' even and odd values (fewer at the last
/// panel: zeros after them).
fn pack_pair(even: &[f32], odd: &[f32], record: &mut [u32]) {
    debug_assert!(even.len() == odd.len() && even.len() <= PANEL && record.len() == PANEL);
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512 F is present; the lengths were checked above.
        return unsafe { pack_pair_avx512(even, odd, record) };
    }
    let (mut e, mut o) = ([bf16::ZERO; PANEL], [bf16::ZERO; PANEL]);
    round_into(even, &mut e[..even.len()]);
    round_into(odd, &mut o[..odd.len()]);
    for j in 0..PANEL {
        record[j] = pack(e[j], o[j]);
    }
}

/// # Safety
/// The CPU runs AVX-512 F; as [`pack_pair`].
#[target_feature(enable = "avx512f")]
unsafe fn pack_pair_avx512(even: &[f32], odd: &[f32], record: &mut [u32]) {
    let mask: __mmask16 = ((1u32 << even.len()) - 1) as __mmask16;
    let e = rne(_mm512_maskz_loadu_ps(mask, even.as_ptr()));
    let o = rne(_mm512_maskz_loadu_ps(mask, odd.as_ptr()));
    let packed = _mm512_or_si512(e, _mm512_slli_epi32::<16>(o));
    _mm512_storeu_si512(record.as_mut_ptr().cast(), packed);
}

fn pack(even: bf16, odd: bf16) -> u32 {
    u32::from(even.to_bits()) | u32::from(odd.to_bits()) << 16
}

/// `dst[i] = src[i]` rounded to bf16 as [`crate::convert::f32_to_bf16`] (nearest even,
/// NaN kept a quiet NaN), 16 at a time.
fn round_into(src: &[f32], dst: &mut [bf16]) {
    debug_assert_eq!(src.len(), dst.len());
    let whole = src.len() / 16 * 16;
    // SAFETY: AVX-512 F is present wherever AMX is (every caller holds a `Bf16Tiles` or
    // built operands for one; the check keeps a stray caller safe).
    if is_x86_feature_detected!("avx512f") {
        unsafe { round16(&src[..whole], &mut dst[..whole]) };
    } else {
        crate::convert::f32_to_bf16(&src[..whole], &mut dst[..whole]);
    }
    crate::convert::f32_to_bf16(&src[whole..], &mut dst[whole..]);
}

/// # Safety
/// The CPU runs AVX-512 F; both slices are the same whole number of 16s long.
#[target_feature(enable = "avx512f")]
unsafe fn round16(src: &[f32], dst: &mut [bf16]) {
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr().cast::<__m256i>());
    for i in 0..src.len() / 16 {
        let bits = rne(_mm512_loadu_ps(s.add(16 * i)));
        _mm256_storeu_si256(d.add(i), _mm512_cvtepi32_epi16(bits));
    }
}

/// 16 values rounded to bf16 as [`crate::convert::f32_to_bf16`] does, each in the low
/// half of its dword (the high half zero).
#[inline]
#[target_feature(enable = "avx512f")]
fn rne(x: __m512) -> __m512i {
    let x = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(x, bias));
    let magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF));
    let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7F80_0000));
    let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(0x40));
    _mm512_mask_blend_epi32(nan, rounded, quiet)
}

/// The product on the tiles: 2 x 2 blocks of (16 rows) x (16 columns) in accumulators
/// `2g + q`, rows in tiles 4-5, columns in 6-7 (as the weight products lay them out).
///
/// # Safety
/// The tiles are configured for `a`'s rows ([`TileSession`]); `out` holds `a`'s stored
/// rows of `ldo >= b.stored_columns()` values; `a` and `b` have the same `k`.
unsafe fn run(a: &TileRows, b: &TileColumns, out: *mut f32, ldo: usize) {
    let groups = a.stored_rows().div_ceil(TILE_ROWS);
    let panels = b.columns.div_ceil(PANEL);
    let chunks = a.stride / CHUNK;
    let lda = a.stride * 2;
    let (x, w) = (a.data.as_ptr().cast::<u8>(), b.data.as_ptr().cast::<u8>());
    let panel_bytes = b.pairs * PANEL * 4;
    let mut g = 0;
    while g < groups {
        let gs = (groups - g).min(2);
        let mut p = 0;
        while p < panels {
            let ps = (panels - p).min(2);
            for i in 0..gs {
                for q in 0..ps {
                    zero_acc(2 * i + q);
                }
            }
            for c in 0..chunks {
                for q in 0..ps {
                    load(6 + q, w.add((p + q) * panel_bytes + c * PANEL * 64), 64);
                }
                for i in 0..gs {
                    load(4 + i, x.add((g + i) * TILE_ROWS * lda + c * 64), lda);
                }
                for i in 0..gs {
                    for q in 0..ps {
                        dot(2 * i + q);
                    }
                }
            }
            for i in 0..gs {
                for q in 0..ps {
                    let at = out.add((g + i) * TILE_ROWS * ldo + (p + q) * PANEL);
                    store_acc(2 * i + q, at, ldo * 4);
                }
            }
            p += ps;
        }
        g += gs;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rounded(x: f32) -> f64 {
        f64::from(bf16::from_f32(x).to_f32())
    }

    /// The product through operands that held other values before (reshaped, not
    /// cleared), so leftovers would show.
    fn product(tiles: Bf16Tiles, a: &[f32], m: usize, b: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut rows = TileRows::default();
        rows.reshape(m + 20, k + 40);
        for i in 0..m + 20 {
            rows.set_whole_row(i, 0, &vec![f32::INFINITY; k + 40]);
        }
        rows.reshape(m, k);
        for i in 0..m {
            rows.set_whole_row(i, 0, &a[i * k..(i + 1) * k]);
        }
        let mut cols = TileColumns::default();
        cols.set_from_rows(&vec![f32::INFINITY; (n + 20) * (k + 40)], k + 40);
        cols.set_from_rows(b, k);
        let ldo = cols.stored_columns() + 3;
        let mut out = vec![f32::NAN; rows.stored_rows() * ldo];
        tiles.session(m).product(&rows, &cols, &mut out, ldo);
        (0..m)
            .flat_map(|i| out[i * ldo..i * ldo + n].to_vec())
            .collect()
    }

    /// The product of the rounded operands up to f32 summation, for shapes with partial
    /// tiles of rows, columns and `k`; each row alone gives the same bits as in the batch;
    /// `set_k_rows` lays out the same operand as `set_from_rows` of the transpose.
    #[test]
    fn tile_products_are_the_rounded_product_row_by_row() {
        let Some(tiles) = Bf16Tiles::on_this_cpu() else {
            eprintln!("skipped: this CPU has no usable AMX-BF16");
            return;
        };
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for (m, n, k) in [
            (1, 1, 1),
            (3, 40, 64),
            (16, 16, 32),
            (17, 33, 70),
            (48, 64, 256),
            (5, 7, 3),
        ] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-2f32..2.0)).collect();
            let b: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-1f32..1.0)).collect();
            let got = product(tiles, &a, m, &b, n, k);
            let (mut err, mut norm) = (0f64, 0f64);
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|t| rounded(a[i * k + t]) * rounded(b[j * k + t]))
                        .sum();
                    err += (f64::from(got[i * n + j]) - want).powi(2);
                    norm += want * want;
                }
            }
            assert!((err / norm).sqrt() < 1e-5, "seed {seed} {m}x{n}x{k}");
            for i in 0..m {
                let alone = product(tiles, &a[i * k..(i + 1) * k], 1, &b, n, k);
                let same = alone
                    .iter()
                    .zip(&got[i * n..])
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "seed {seed} {m}x{n}x{k}: row {i} alone differs");
            }
            // The same columns given along k (as values): bᵀ's rows.
            let mut by_k = TileColumns::default();
            by_k.reset(n, k);
            let bt: Vec<f32> = (0..k)
                .flat_map(|t| (0..n).map(|j| b[j * k + t]).collect::<Vec<_>>())
                .collect();
            by_k.set_k_rows(0, &bt);
            let mut from_rows = TileColumns::default();
            from_rows.set_from_rows(&b, k);
            assert_eq!(by_k.data, from_rows.data, "seed {seed} {m}x{n}x{k}");
        }
    }

    /// Zeros before and after a row's values along `k` (a wider operand, the values at
    /// another offset within their chunk-aligned place) leave its results the same bits.
    #[test]
    fn zeros_along_k_do_not_change_a_result() {
        let Some(tiles) = Bf16Tiles::on_this_cpu() else {
            eprintln!("skipped: this CPU has no usable AMX-BF16");
            return;
        };
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (n, k) = (24, 40);
        for _ in 0..20 {
            let a: Vec<f32> = (0..k).map(|_| rng.gen_range(-1f32..1.0) * 1e-3).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.gen_range(-3f32..3.0)).collect();
            let run = |before: usize, after: usize| {
                let wide = before + k + after;
                let mut rows = TileRows::default();
                rows.reshape(1, wide);
                rows.set_whole_row(0, before, &a);
                let mut cols = TileColumns::default();
                cols.reset(n, wide);
                cols.set_k_rows(before, &b);
                let mut out = vec![0f32; cols.stored_columns()];
                let session = tiles.session(1);
                session.product(&rows, &cols, &mut out, cols.stored_columns());
                out[..n].to_vec()
            };
            let plain = run(0, 0);
            for (before, after) in [(32, 0), (0, 50), (64, 100)] {
                let wide = run(before, after);
                let same = plain
                    .iter()
                    .zip(&wide)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "seed {seed}: zeros {before} before, {after} after");
            }
        }
    }

    /// Values given along `k` at any offset, one by one or in pairs, land in their lanes
    /// and leave the others as they were.
    #[test]
    fn values_along_k_land_in_their_lanes() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for (columns, k) in [(5, 9), (16, 64), (20, 33)] {
            for (at, n) in [(0, 1), (1, 1), (1, 4), (3, 5), (0, 8)] {
                if at + n > k {
                    continue;
                }
                let rows: Vec<f32> = (0..n * columns)
                    .map(|_| rng.gen_range(-4f32..4.0))
                    .collect();
                let mut got = TileColumns::default();
                got.reset(columns, k);
                got.data.fill(0xDEAD_BEEF);
                let before = got.data.clone();
                got.set_k_rows(at, &rows);
                let pairs = got.pairs;
                for (idx, (&g, &b)) in got.data.iter().zip(&before).enumerate() {
                    let (panel, c, lane) =
                        (idx / (pairs * PANEL), idx / PANEL % pairs, idx % PANEL);
                    let j = panel * PANEL + lane;
                    let mut want = b;
                    for half in 0..2 {
                        let value = 2 * c + half;
                        if j < columns && (at..at + n).contains(&value) {
                            let v = bf16::from_f32(rows[(value - at) * columns + j]).to_bits();
                            let shift = 16 * half;
                            want = (want & !(0xFFFF << shift)) | (u32::from(v) << shift);
                        }
                    }
                    if j >= columns && (at..at + n).any(|v| v / 2 == c) {
                        // Lanes past the columns of a whole pair written: zeros.
                        assert!(
                            g == want || g == 0,
                            "seed {seed} {columns}x{k} at {at} n {n}: lane {idx}"
                        );
                    } else {
                        assert_eq!(
                            g, want,
                            "seed {seed} {columns}x{k} at {at} n {n}: lane {idx}"
                        );
                    }
                }
            }
        }
    }

    /// A second session on the same thread is refused (its configuration would be the
    /// first one's), and a thread may open one again once the first is dropped.
    #[test]
    fn sessions_do_not_nest() {
        let Some(tiles) = Bf16Tiles::on_this_cpu() else {
            eprintln!("skipped: this CPU has no usable AMX-BF16");
            return;
        };
        let first = tiles.session(3);
        let nested = std::panic::catch_unwind(|| drop(tiles.session(16)));
        assert!(nested.is_err());
        drop(first);
        drop(tiles.session(16));
    }

    #[test]
    fn rounding_matches_half() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut x: Vec<f32> = (0..1000).map(|_| f32::from_bits(rng.gen())).collect();
        x.extend([
            f32::NAN,
            f32::INFINITY,
            -0.0,
            1.0 + f32::EPSILON,
            3.390_625_2,
        ]);
        let mut got = vec![bf16::ZERO; x.len()];
        round_into(&x, &mut got);
        for (v, g) in x.iter().zip(&got) {
            let want = bf16::from_f32(*v);
            assert!(
                g.to_bits() == want.to_bits() || (v.is_nan() && g.is_nan()),
                "{v:e}: {g} vs {want}"
            );
        }
    }
}
