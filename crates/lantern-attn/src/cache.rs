//! One layer's paged KV cache tensor: its values, in the element type and layout it was
//! allocated with.
//!
//! Every access goes through the cache's [`KvCacheLayout`]; nothing here infers the
//! layout from a shape. Writes follow a slot mapping (`slot = block * block_size +
//! offset`, negative slots are padding and skipped). Reads come in two flavours:
//! per-token helpers ([`PagedKvCache::read_key`], [`PagedKvCache::read_value`]) that
//! any reader such as attention capture can use, and tile loads that read one head's
//! rows of a block at once ([`PagedKvCache::load_tile`], and [`PagedKvCache::tile_f32`],
//! a zero-copy view for f32 caches that no backend of this crate uses since cpu-flash
//! gathers several blocks per softmax update).

use std::ops::Range;

use half::vec::HalfBitsVecExt;
use half::{bf16, f16};
use lantern_kv::KvDtype;
use lantern_quant::{convert, share};

use crate::error::AttnError;
use crate::layout::{CacheGeometry, KvCacheLayout, NamedStrides};

/// Index of the K plane in the `kv` dimension.
pub const KEY: usize = 0;
/// Index of the V plane in the `kv` dimension.
pub const VALUE: usize = 1;

/// The values of a cache tensor in its element type, in physical memory order.
#[derive(Debug, Clone, PartialEq)]
pub enum CacheStorage {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl CacheStorage {
    /// Zeroed storage from zeroed pages (`vec![0; n]` of a primitive is a `calloc`): the
    /// memory of blocks that are never written is never touched, so a short run does not
    /// page in the whole pool. (`vec![f16::ZERO; n]` would write every element.)
    fn zeros(dtype: KvDtype, len: usize) -> Self {
        match dtype {
            KvDtype::F32 => CacheStorage::F32(vec![0.0; len]),
            KvDtype::F16 => CacheStorage::F16(vec![0u16; len].reinterpret_into()),
            KvDtype::BF16 => CacheStorage::BF16(vec![0u16; len].reinterpret_into()),
        }
    }

    /// Element type of the storage.
    pub fn dtype(&self) -> KvDtype {
        match self {
            CacheStorage::F32(_) => KvDtype::F32,
            CacheStorage::F16(_) => KvDtype::F16,
            CacheStorage::BF16(_) => KvDtype::BF16,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            CacheStorage::F32(s) => s.len(),
            CacheStorage::F16(s) => s.len(),
            CacheStorage::BF16(s) => s.len(),
        }
    }

    /// True when the storage holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Converts `src.len()` contiguous elements starting at `start` into `dst`.
    /// Callers guarantee the range is inside the storage.
    #[inline]
    fn load_contiguous(&self, start: usize, dst: &mut [f32]) {
        let end = start + dst.len();
        match self {
            CacheStorage::F32(s) => dst.copy_from_slice(&s[start..end]),
            CacheStorage::F16(s) => convert::f16_to_f32(&s[start..end], dst),
            CacheStorage::BF16(s) => convert::bf16_to_f32(&s[start..end], dst),
        }
    }

    /// Reads one element as f32. Callers guarantee `i` is inside the storage.
    #[inline]
    fn get(&self, i: usize) -> f32 {
        match self {
            CacheStorage::F32(s) => s[i],
            CacheStorage::F16(s) => s[i].to_f32(),
            CacheStorage::BF16(s) => s[i].to_f32(),
        }
    }

    /// Stores `src` at `start..start + src.len()`, converting to the element type.
    #[inline]
    fn store_contiguous(&mut self, start: usize, src: &[f32]) {
        let end = start + src.len();
        match self {
            CacheStorage::F32(s) => s[start..end].copy_from_slice(src),
            CacheStorage::F16(s) => convert::f32_to_f16(src, &mut s[start..end]),
            CacheStorage::BF16(s) => convert::f32_to_bf16(src, &mut s[start..end]),
        }
    }

    #[inline]
    fn set(&mut self, i: usize, x: f32) {
        match self {
            CacheStorage::F32(s) => s[i] = x,
            CacheStorage::F16(s) => s[i] = f16::from_f32(x),
            CacheStorage::BF16(s) => s[i] = bf16::from_f32(x),
        }
    }
}

/// Values (keys and values) of one write from which it runs on the product helpers: a
/// decode batch of 32 SmolLM2 tokens writes 12K, about 10 us on one thread.
const SHARED_WRITE_VALUES: usize = 1 << 12;

/// A cache's storage shared with the threads of one [`share::run`], each writing its own
/// rows.
enum SharedStorage<'a> {
    F32(share::SharedMut<'a, f32>),
    F16(share::SharedMut<'a, f16>),
    BF16(share::SharedMut<'a, bf16>),
}

impl<'a> SharedStorage<'a> {
    fn new(storage: &'a mut CacheStorage) -> Self {
        match storage {
            CacheStorage::F32(s) => SharedStorage::F32(share::SharedMut::new(s)),
            CacheStorage::F16(s) => SharedStorage::F16(share::SharedMut::new(s)),
            CacheStorage::BF16(s) => SharedStorage::BF16(share::SharedMut::new(s)),
        }
    }

    /// Stores `src` at `start..start + src.len()`, converting as
    /// [`CacheStorage::store_contiguous`] does.
    ///
    /// # Safety
    /// No other thread uses these elements meanwhile.
    unsafe fn store(&self, start: usize, src: &[f32]) {
        // SAFETY: by the caller's promise (`range` checks the bounds).
        unsafe {
            match self {
                SharedStorage::F32(s) => s.range(start, src.len()).copy_from_slice(src),
                SharedStorage::F16(s) => convert::f32_to_f16(src, s.range(start, src.len())),
                SharedStorage::BF16(s) => convert::f32_to_bf16(src, s.range(start, src.len())),
            }
        }
    }
}

/// Rounds `values` in place to what a cache of element type `dtype` would hold (a no-op
/// for f32). Used where a key or value must be taken from somewhere other than the
/// cache but has to match what the cache would have returned.
pub fn round_to_dtype(values: &mut [f32], dtype: KvDtype) {
    match dtype {
        KvDtype::F32 => {}
        KvDtype::F16 => values
            .iter_mut()
            .for_each(|x| *x = f16::from_f32(*x).to_f32()),
        KvDtype::BF16 => values
            .iter_mut()
            .for_each(|x| *x = bf16::from_f32(*x).to_f32()),
    }
}

/// One layer's KV cache tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct PagedKvCache {
    geometry: CacheGeometry,
    layout: KvCacheLayout,
    strides: NamedStrides,
    num_slots: usize,
    storage: CacheStorage,
}

impl PagedKvCache {
    /// A zero-filled cache of `geometry` laid out as `layout` with elements of `dtype`.
    pub fn new(
        geometry: CacheGeometry,
        layout: KvCacheLayout,
        dtype: KvDtype,
    ) -> Result<Self, AttnError> {
        geometry.validate()?;
        layout.validate()?;
        let len = geometry.num_elements()?;
        Ok(Self {
            geometry,
            layout,
            strides: layout.named_strides(&geometry),
            num_slots: geometry.num_slots()?,
            storage: CacheStorage::zeros(dtype, len),
        })
    }

    /// Element type of the cache.
    pub fn dtype(&self) -> KvDtype {
        self.storage.dtype()
    }

    /// The layout the cache was allocated with.
    pub fn layout(&self) -> &KvCacheLayout {
        &self.layout
    }

    /// The cache's sizes.
    pub fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }

    /// Element strides by dimension name.
    pub fn strides(&self) -> &NamedStrides {
        &self.strides
    }

    /// Number of token slots (`num_blocks * block_size`).
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Bytes held by the tensor.
    pub fn size_bytes(&self) -> usize {
        self.storage.len() * self.dtype().size_bytes()
    }

    /// The raw values in physical order (for backends on other devices and for tests).
    pub fn storage(&self) -> &CacheStorage {
        &self.storage
    }

    /// Splits a slot into `(block, in_block)`, checking it is inside the cache.
    pub fn slot_position(&self, slot: i64) -> Result<(usize, usize), AttnError> {
        match usize::try_from(slot) {
            Ok(s) if s < self.num_slots => {
                Ok((s / self.geometry.block_size, s % self.geometry.block_size))
            }
            _ => Err(AttnError::SlotOutOfRange {
                slot,
                num_slots: self.num_slots,
            }),
        }
    }

    /// Writes this step's keys and values by slot mapping.
    ///
    /// `k` and `v` are `[num_tokens, num_kv_heads, head_dim]` row-major, one token per
    /// slot mapping entry. Negative slots (`PAD_SLOT_ID`) are skipped. Every slot is
    /// checked before anything is written, so an error leaves the cache untouched.
    pub fn write(&mut self, k: &[f32], v: &[f32], slot_mapping: &[i64]) -> Result<(), AttnError> {
        let row = self.geometry.token_row_len();
        // Saturates on overflow: no buffer can have that length, so it is a mismatch.
        let expected = slot_mapping.len().saturating_mul(row);
        for (what, buf) in [("k", k), ("v", v)] {
            if buf.len() != expected {
                return Err(AttnError::LengthMismatch {
                    what,
                    expected,
                    got: buf.len(),
                });
            }
        }
        for &slot in slot_mapping {
            if slot >= 0 {
                self.slot_position(slot)?;
            }
        }
        let (hd, nh) = (self.geometry.head_dim, self.geometry.num_kv_heads);
        if self.strides.dim == 1 && 2 * expected >= SHARED_WRITE_VALUES {
            self.write_shared(k, v, slot_mapping);
            return Ok(());
        }
        for (t, &slot) in slot_mapping.iter().enumerate() {
            let Ok((block, pos)) = self.slot_position(slot) else {
                continue;
            };
            for h in 0..nh {
                let src = t * row + h * hd..t * row + (h + 1) * hd;
                self.store_row(KEY, block, pos, h, &k[src.clone()]);
                self.store_row(VALUE, block, pos, h, &v[src]);
            }
        }
        Ok(())
    }

    /// [`write`](Self::write)'s stores (slots checked, rows contiguous) on the calling
    /// thread and the product helpers, one task per (K or V, kv head): tasks write
    /// disjoint rows whatever the slots, and a task stores its tokens in order, so a slot
    /// given twice ends with the later token's row, as in the serial loop.
    fn write_shared(&mut self, k: &[f32], v: &[f32], slot_mapping: &[i64]) {
        let (hd, nh) = (self.geometry.head_dim, self.geometry.num_kv_heads);
        let (block_size, row) = (self.geometry.block_size, self.geometry.token_row_len());
        let strides = self.strides;
        let storage = SharedStorage::new(&mut self.storage);
        share::run(2 * nh, &|task| {
            let (kv, h) = (task / nh, task % nh);
            let src = if kv == KEY { k } else { v };
            for (t, &slot) in slot_mapping.iter().enumerate() {
                let Ok(slot) = usize::try_from(slot) else {
                    continue;
                };
                let base = strides.offset(kv, slot / block_size, slot % block_size, h, 0);
                // SAFETY: the row of (kv, slot, h) is `hd` contiguous elements (dim stride
                // 1) inside the storage (slots checked by `write`); rows of another kv
                // plane or head never overlap it, and only this task writes this (kv, h).
                unsafe { storage.store(base, &src[t * row + h * hd..][..hd]) };
            }
        });
    }

    /// Stores one head's row; indices were checked by the caller.
    fn store_row(&mut self, kv: usize, block: usize, pos: usize, head: usize, src: &[f32]) {
        let base = self.strides.offset(kv, block, pos, head, 0);
        if self.strides.dim == 1 {
            self.storage.store_contiguous(base, src);
        } else {
            for (d, &x) in src.iter().enumerate() {
                self.storage.set(base + d * self.strides.dim, x);
            }
        }
    }

    /// Reads the key of `slot` for kv head `head` into `out` (`head_dim` long), as f32.
    pub fn read_key(&self, slot: usize, head: usize, out: &mut [f32]) -> Result<(), AttnError> {
        self.read_row(KEY, slot, head, out)
    }

    /// Reads the value of `slot` for kv head `head` into `out` (`head_dim` long), as f32.
    pub fn read_value(&self, slot: usize, head: usize, out: &mut [f32]) -> Result<(), AttnError> {
        self.read_row(VALUE, slot, head, out)
    }

    /// Reads the keys of `slots` into `keys`, and their values into `values` when given,
    /// every kv head: `[slots.len(), num_kv_heads, head_dim]` f32. A slot outside the cache
    /// or a buffer of the wrong length is an error.
    pub fn read_slots(
        &self,
        slots: &[usize],
        keys: &mut [f32],
        mut values: Option<&mut [f32]>,
    ) -> Result<(), AttnError> {
        let row = self.geometry.token_row_len();
        let expected = slots.len().saturating_mul(row);
        self.check_len("keys", keys.len(), expected)?;
        if let Some(v) = values.as_deref() {
            self.check_len("values", v.len(), expected)?;
        }
        let (dim, heads) = (self.geometry.head_dim, self.geometry.num_kv_heads);
        for (i, &slot) in slots.iter().enumerate() {
            for h in 0..heads {
                let at = i * row + h * dim..i * row + (h + 1) * dim;
                self.read_key(slot, h, &mut keys[at.clone()])?;
                if let Some(v) = values.as_deref_mut() {
                    self.read_value(slot, h, &mut v[at])?;
                }
            }
        }
        Ok(())
    }

    fn read_row(
        &self,
        kv: usize,
        slot: usize,
        head: usize,
        out: &mut [f32],
    ) -> Result<(), AttnError> {
        let (block, pos) = self.slot_position(i64::try_from(slot).unwrap_or(i64::MAX))?;
        self.check_head(head)?;
        self.check_len("read output", out.len(), self.geometry.head_dim)?;
        self.load_rows_unchecked(kv, block, head, pos..pos + 1, out);
        Ok(())
    }

    /// Loads rows `rows` (in-block positions) of kv head `head` of `block` from plane
    /// `kv` into `out` as f32, `[rows.len(), head_dim]` row-major.
    pub fn load_tile(
        &self,
        kv: usize,
        block: usize,
        head: usize,
        rows: Range<usize>,
        out: &mut [f32],
    ) -> Result<(), AttnError> {
        if kv > VALUE {
            return Err(AttnError::InvalidLayout(format!(
                "kv index {kv} is not 0 (K) or 1 (V)"
            )));
        }
        if block >= self.geometry.num_blocks {
            return Err(AttnError::BlockOutOfRange {
                block: block as u64,
                num_blocks: self.geometry.num_blocks,
            });
        }
        self.check_head(head)?;
        if rows.start > rows.end || rows.end > self.geometry.block_size {
            return Err(AttnError::InvalidLayout(format!(
                "rows {rows:?} outside block_size {}",
                self.geometry.block_size
            )));
        }
        self.check_len(
            "tile output",
            out.len(),
            rows.len() * self.geometry.head_dim,
        )?;
        self.load_rows_unchecked(kv, block, head, rows, out);
        Ok(())
    }

    /// Zero-copy view of a tile when the cache is f32 and the tile's rows are
    /// contiguous and packed (HND-style layouts); `None` otherwise, or when any index is
    /// out of range. Backends fall back to [`Self::load_tile`] on `None`.
    pub fn tile_f32(
        &self,
        kv: usize,
        block: usize,
        head: usize,
        rows: Range<usize>,
    ) -> Option<&[f32]> {
        let CacheStorage::F32(s) = &self.storage else {
            return None;
        };
        let hd = self.geometry.head_dim;
        let packed = self.strides.dim == 1 && (self.strides.in_block == hd || rows.len() <= 1);
        if !packed
            || kv > VALUE
            || block >= self.geometry.num_blocks
            || head >= self.geometry.num_kv_heads
            || rows.start > rows.end
            || rows.end > self.geometry.block_size
        {
            return None;
        }
        let start = self.strides.offset(kv, block, rows.start, head, 0);
        s.get(start..start + rows.len() * hd)
    }

    /// Asks the CPU to start fetching rows `rows` of `head`'s K or V in `block` into its
    /// second-level cache: a hint for a tile [`load_rows_unchecked`](Self::load_rows_unchecked)
    /// will read soon (a decode reads the whole cache once a step, from memory). Into L2,
    /// not L1: a long context's decode ran 1.07-1.10x faster so (paired, SmolLM2 after
    /// 4,096 tokens, Zen 4), the first level's few outstanding misses no longer held up
    /// the tile being read. Rows that are not packed, or an index out of range, make it do
    /// nothing.
    pub(crate) fn prefetch_rows(&self, kv: usize, block: usize, head: usize, rows: Range<usize>) {
        let hd = self.geometry.head_dim;
        let st = &self.strides;
        if st.dim != 1
            || (st.in_block != hd && rows.len() > 1)
            || block >= self.geometry.num_blocks
            || rows.end > self.geometry.block_size
        {
            return;
        }
        let start = st.offset(kv, block, rows.start, head, 0);
        let bytes = self.dtype().size_bytes();
        let (ptr, len) = match &self.storage {
            CacheStorage::F32(s) => (s.as_ptr().cast::<u8>(), s.len()),
            CacheStorage::F16(s) => (s.as_ptr().cast::<u8>(), s.len()),
            CacheStorage::BF16(s) => (s.as_ptr().cast::<u8>(), s.len()),
        };
        let end = (start + rows.len() * hd).min(len);
        for at in (start * bytes..end * bytes).step_by(64) {
            // SAFETY: `at` is inside the storage; a prefetch reads nothing.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
                _mm_prefetch::<_MM_HINT_T1>(ptr.add(at).cast());
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (ptr, at);
        }
    }

    /// Tile load without range checks: callers (the backends, after validating the
    /// metadata against the geometry, and the checked wrappers above) guarantee that
    /// every index is in range, so slice indexing below cannot fail.
    pub(crate) fn load_rows_unchecked(
        &self,
        kv: usize,
        block: usize,
        head: usize,
        rows: Range<usize>,
        out: &mut [f32],
    ) {
        let hd = self.geometry.head_dim;
        let st = &self.strides;
        let base = st.offset(kv, block, rows.start, head, 0);
        let n = rows.len();
        if st.dim == 1 && (st.in_block == hd || n <= 1) {
            self.storage.load_contiguous(base, &mut out[..n * hd]);
        } else if st.dim == 1 {
            for (i, dst) in out.chunks_exact_mut(hd).take(n).enumerate() {
                self.storage.load_contiguous(base + i * st.in_block, dst);
            }
        } else {
            for (i, dst) in out.chunks_exact_mut(hd).take(n).enumerate() {
                let row = base + i * st.in_block;
                for (d, x) in dst.iter_mut().enumerate() {
                    *x = self.storage.get(row + d * st.dim);
                }
            }
        }
    }

    fn check_head(&self, head: usize) -> Result<(), AttnError> {
        if head >= self.geometry.num_kv_heads {
            return Err(AttnError::HeadOutOfRange {
                head,
                num_kv_heads: self.geometry.num_kv_heads,
            });
        }
        Ok(())
    }

    fn check_len(&self, what: &'static str, got: usize, expected: usize) -> Result<(), AttnError> {
        if got != expected {
            return Err(AttnError::LengthMismatch {
                what,
                expected,
                got,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::KvCacheShape;

    #[test]
    fn write_then_read_back() {
        let geom = CacheGeometry {
            num_blocks: 2,
            block_size: 3,
            num_kv_heads: 2,
            head_dim: 4,
        };
        let mut cache = PagedKvCache::new(
            geom,
            KvCacheLayout::hnd(KvCacheShape::BlocksFirst),
            KvDtype::F32,
        )
        .unwrap();
        assert_eq!(cache.size_bytes(), 2 * 2 * 3 * 2 * 4 * 4);
        let k: Vec<f32> = (0..8).map(|x| x as f32).collect();
        let v: Vec<f32> = (0..8).map(|x| -(x as f32)).collect();
        cache.write(&k, &v, &[4]).unwrap();
        let mut out = [0.0; 4];
        cache.read_key(4, 1, &mut out).unwrap();
        assert_eq!(out, [4.0, 5.0, 6.0, 7.0]);
        cache.read_value(4, 0, &mut out).unwrap();
        assert_eq!(out, [0.0, -1.0, -2.0, -3.0]);
        assert!(cache.read_key(6, 0, &mut out).is_err());
        assert!(cache.read_key(0, 2, &mut out).is_err());
        assert!(cache.read_key(0, 0, &mut out[..3]).is_err());
        assert!(cache.write(&k, &v, &[6]).is_err());
        assert!(cache.write(&k[..4], &v, &[0]).is_err());
    }

    /// A prefetch is only a hint: in range or out of it (a block, a row, a head past
    /// the cache), on packed and unpacked layouts and every element type, it returns
    /// and leaves the cache's values as they were.
    #[test]
    fn prefetch_is_a_hint_in_and_out_of_range() {
        let geom = CacheGeometry {
            num_blocks: 3,
            block_size: 4,
            num_kv_heads: 2,
            head_dim: 16,
        };
        for layout in [
            KvCacheLayout::hnd(KvCacheShape::BlocksFirst),
            KvCacheLayout::contiguous(KvCacheShape::KvFirst),
        ] {
            for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16] {
                let mut cache = PagedKvCache::new(geom, layout, dtype).unwrap();
                let kv: Vec<f32> = (0..2 * 16).map(|x| x as f32 * 0.5).collect();
                cache.write(&kv, &kv, &[5]).unwrap();
                for (block, head, rows) in [
                    (1, 1, 0..4),
                    (2, 0, 1..3),
                    (3, 0, 0..4),
                    (0, 0, 2..9),
                    (2, 5, 0..4),
                ] {
                    for which in [KEY, VALUE] {
                        cache.prefetch_rows(which, block, head, rows.clone());
                    }
                }
                let mut out = [0.0; 16];
                cache.read_key(5, 1, &mut out).unwrap();
                assert_eq!(out[..], kv[16..], "{layout:?} {dtype:?}");
            }
        }
    }

    /// A write big enough for the helpers (one task per K/V plane and kv head) leaves
    /// the same bits as writing its tokens one by one on the calling thread, for every
    /// element type and layout, with padding slots and a slot given twice (the later
    /// token wins).
    #[test]
    fn a_shared_write_equals_the_token_by_token_write() {
        use rand::{rngs::StdRng, Rng, SeedableRng};
        let mut rng = StdRng::seed_from_u64(19);
        let geom = CacheGeometry {
            num_blocks: 12,
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
        };
        let row = geom.token_row_len();
        let tokens = 40;
        assert!(2 * tokens * row >= SHARED_WRITE_VALUES);
        assert!(2 * row < SHARED_WRITE_VALUES);
        let mut slots: Vec<i64> = (0..tokens as i64).map(|t| 3 * t + 5).collect();
        slots[7] = -1;
        slots[20] = slots[11];
        let orders = [
            KvCacheLayout::IDENTITY_ORDER,
            KvCacheLayout::HND_ORDER,
            [4, 3, 2, 1, 0],
        ];
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::BF16] {
            for shape in [KvCacheShape::KvFirst, KvCacheShape::BlocksFirst] {
                for order in orders {
                    let layout = KvCacheLayout::new(shape, order).unwrap();
                    let k: Vec<f32> = (0..tokens * row)
                        .map(|_| rng.gen_range(-3.0..3.0))
                        .collect();
                    let v: Vec<f32> = (0..tokens * row)
                        .map(|_| rng.gen_range(-3.0..3.0))
                        .collect();
                    let mut shared = PagedKvCache::new(geom, layout, dtype).unwrap();
                    shared.write(&k, &v, &slots).unwrap();
                    let mut serial = PagedKvCache::new(geom, layout, dtype).unwrap();
                    for (t, slot) in slots.iter().enumerate() {
                        let at = t * row..(t + 1) * row;
                        serial.write(&k[at.clone()], &v[at], &[*slot]).unwrap();
                    }
                    assert!(shared == serial, "{dtype:?} {shape:?} {order:?}");
                }
            }
        }
    }
}
