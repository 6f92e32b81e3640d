//! The paged KV cache of one layer in device memory, in either layout lantern knows
//! (FlashAttention's `[2, blocks, block_size, kv_heads, head_dim]` or FlashInfer's
//! `[blocks, 2, ...]`), f32, f16 or bf16. Kernels address it through [`KvStrides`] taken
//! from the layout, so nothing guesses the layout from a shape.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use lantern_attn::{AttnError, CacheGeometry, KvCacheLayout, LayerKvCache};
use lantern_kv::KvDtype;

use crate::gpu::Gpu;
use crate::kernels::{CacheElem, KvStrides};
use crate::CudaError;

/// The cache's elements, in its dtype.
pub enum CacheData {
    F32(CudaSlice<f32>),
    F16(CudaSlice<f16>),
    Bf16(CudaSlice<bf16>),
}

pub struct CudaKvCache {
    gpu: Arc<Gpu>,
    geometry: CacheGeometry,
    layout: KvCacheLayout,
    dtype: KvDtype,
    strides: KvStrides,
    pub(crate) data: CacheData,
}

impl fmt::Debug for CudaKvCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaKvCache")
            .field("geometry", &self.geometry)
            .field("layout", &self.layout)
            .field("dtype", &self.dtype)
            .finish()
    }
}

pub(crate) fn attn_error(e: CudaError) -> AttnError {
    AttnError::Tensor(format!("cuda: {e}"))
}

/// The kernels' strides of `layout` over `geometry`.
pub fn kv_strides(layout: &KvCacheLayout, geometry: &CacheGeometry) -> KvStrides {
    let s = layout.named_strides(geometry);
    KvStrides {
        kv: s.kv,
        block: s.block,
        in_block: s.in_block,
        head: s.head,
        dim: s.dim,
        block_size: geometry.block_size,
        num_kv_heads: geometry.num_kv_heads,
        head_dim: geometry.head_dim,
    }
}

impl CudaKvCache {
    /// A zeroed cache of `geometry` in `layout` on `gpu`.
    pub fn new(
        gpu: Arc<Gpu>,
        geometry: CacheGeometry,
        layout: KvCacheLayout,
        dtype: KvDtype,
    ) -> Result<Self, AttnError> {
        geometry.validate()?;
        layout.validate()?;
        let len = geometry.num_elements()?;
        let bytes = len.saturating_mul(dtype.size_bytes());
        let (free, _) = gpu.memory_info().map_err(attn_error)?;
        if bytes > free {
            return Err(attn_error(CudaError::OutOfMemory { bytes, free }));
        }
        let data = match dtype {
            KvDtype::F32 => CacheData::F32(gpu.zeros(len).map_err(attn_error)?),
            KvDtype::F16 => CacheData::F16(gpu.zeros(len).map_err(attn_error)?),
            KvDtype::BF16 => CacheData::Bf16(gpu.zeros(len).map_err(attn_error)?),
        };
        let strides = kv_strides(&layout, &geometry);
        Ok(Self {
            gpu,
            geometry,
            layout,
            dtype,
            strides,
            data,
        })
    }

    pub fn strides(&self) -> &KvStrides {
        &self.strides
    }

    /// Keys (and values) of `slots`, every kv head, `[slots, kv_heads, head_dim]` f32:
    /// each block the slots touch is copied to the host once (keys and values planes),
    /// then the rows are picked out there.
    pub fn read_slots(
        &self,
        slots: &[usize],
        keys: &mut [f32],
        values: Option<&mut [f32]>,
    ) -> Result<(), AttnError> {
        match &self.data {
            CacheData::F32(d) => self.read_slots_of(d, slots, keys, values),
            CacheData::F16(d) => self.read_slots_of(d, slots, keys, values),
            CacheData::Bf16(d) => self.read_slots_of(d, slots, keys, values),
        }
    }

    fn read_slots_of<T: CacheElem>(
        &self,
        data: &CudaSlice<T>,
        slots: &[usize],
        keys: &mut [f32],
        values: Option<&mut [f32]>,
    ) -> Result<(), AttnError> {
        let g = &self.geometry;
        let row = g.token_row_len();
        let expected = slots.len().saturating_mul(row);
        for (what, len) in [
            ("keys", Some(keys.len())),
            ("values", values.as_ref().map(|v| v.len())),
        ] {
            if let Some(len) = len.filter(|&l| l != expected) {
                return Err(AttnError::LengthMismatch {
                    what,
                    expected,
                    got: len,
                });
            }
        }
        let num_slots = g.num_slots()?;
        if let Some(&bad) = slots.iter().find(|&&s| s >= num_slots) {
            return Err(AttnError::SlotOutOfRange {
                slot: bad as i64,
                num_slots,
            });
        }
        gather_slots(
            &self.strides,
            slots,
            |start, len| {
                self.gpu
                    .download(&data.slice(start..start + len))
                    .map_err(attn_error)
            },
            keys,
            values,
        )
    }
}

/// Most blocks one download spans: a run of consecutive blocks (a request's blocks are
/// mostly handed out in order) is read in one copy instead of one copy a block.
const RUN_BLOCKS: usize = 64;

/// The keys (and values) of `slots` in a cache laid out as `s` says, `[slots, kv_heads,
/// head_dim]` f32, reading the cache through `read(start, len)` (elements): each run of
/// consecutive blocks the slots touch is read once per plane, from its first block's
/// plane to its last's.
fn gather_slots<T: CacheElem>(
    s: &KvStrides,
    slots: &[usize],
    mut read: impl FnMut(usize, usize) -> Result<Vec<T>, AttnError>,
    keys: &mut [f32],
    mut values: Option<&mut [f32]>,
) -> Result<(), AttnError> {
    let row = s.num_kv_heads * s.head_dim;
    // One plane (the keys or the values of one block) spans this many elements from
    // its first, whatever the order of its three inner dimensions.
    let plane = (s.block_size - 1) * s.in_block
        + (s.num_kv_heads - 1) * s.head
        + (s.head_dim - 1) * s.dim
        + 1;
    let block_of = |i: usize| slots[i] / s.block_size;
    let mut order: Vec<usize> = (0..slots.len()).collect();
    order.sort_by_key(|&i| block_of(i));
    let mut at = 0;
    while at < order.len() {
        // The run: consecutive blocks from this slot's, at most RUN_BLOCKS of them.
        let first = block_of(order[at]);
        let mut end = at;
        let mut last = first;
        while end < order.len() {
            let b = block_of(order[end]);
            if b > last + 1 || b >= first + RUN_BLOCKS {
                break;
            }
            last = b;
            end += 1;
        }
        let span = (last - first) * s.block + plane;
        let k = read(first * s.block, span)?;
        let v = match values {
            Some(_) => read(first * s.block + s.kv, span)?,
            None => Vec::new(),
        };
        for &i in &order[at..end] {
            // The run's buffers start at its first block's plane.
            let base = first * s.block;
            for h in 0..s.num_kv_heads {
                for d in 0..s.head_dim {
                    let from = s.key_offset(slots[i], h, d) - base;
                    let out = i * row + h * s.head_dim + d;
                    keys[out] = k[from].to_f32();
                    if let Some(values) = values.as_deref_mut() {
                        values[out] = v[from].to_f32();
                    }
                }
            }
        }
        at = end;
    }
    Ok(())
}

impl LayerKvCache for CudaKvCache {
    fn geometry(&self) -> &CacheGeometry {
        &self.geometry
    }

    fn layout(&self) -> &KvCacheLayout {
        &self.layout
    }

    fn dtype(&self) -> KvDtype {
        self.dtype
    }

    fn size_bytes(&self) -> usize {
        self.geometry
            .num_elements()
            .unwrap_or(0)
            .saturating_mul(self.dtype.size_bytes())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::{gather_slots, KvStrides, RUN_BLOCKS};
    use rand::{Rng, SeedableRng};

    /// Slots read through runs of blocks equal slots read one by one at their offsets, in
    /// both layouts, with runs longer than a download spans, gaps, and slots out of
    /// order; a run of consecutive blocks costs one read a plane.
    #[test]
    fn runs_of_blocks_read_what_slot_by_slot_reads() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x51075);
        let (num_blocks, block_size, heads, dim) = (200, 4, 3, 8);
        for s in [
            KvStrides::kv_first(num_blocks, block_size, heads, dim),
            KvStrides::block_first(block_size, heads, dim),
        ] {
            let cache: Vec<f32> = (0..s.cache_len(num_blocks)).map(|_| rng.gen()).collect();
            // A request's blocks: 90 consecutive (more than one read spans), a gap, a few
            // scattered ones; all their slots, shuffled, and a partial last block.
            let mut blocks: Vec<usize> = (10..100).collect();
            blocks.extend([120, 121, 150, 7]);
            let mut slots: Vec<usize> = blocks
                .iter()
                .flat_map(|&b| (0..block_size).map(move |j| b * block_size + j))
                .collect();
            slots.pop();
            for i in (1..slots.len()).rev() {
                slots.swap(i, rng.gen_range(0..=i));
            }
            let row = heads * dim;
            let (mut keys, mut values) =
                (vec![0f32; slots.len() * row], vec![0f32; slots.len() * row]);
            let mut reads = 0;
            let read = |start: usize, len: usize| {
                reads += 1;
                Ok(cache[start..start + len].to_vec())
            };
            gather_slots(&s, &slots, read, &mut keys, Some(&mut values)).unwrap();
            for (i, &slot) in slots.iter().enumerate() {
                for h in 0..heads {
                    for d in 0..dim {
                        let at = s.key_offset(slot, h, d);
                        assert_eq!(keys[i * row + h * dim + d], cache[at], "slot {slot}");
                        assert_eq!(
                            values[i * row + h * dim + d],
                            cache[at + s.kv],
                            "slot {slot}"
                        );
                    }
                }
            }
            // Runs: 10..74, 74..100, 120..122, 150, 7 — two planes each.
            assert_eq!(90usize.div_ceil(RUN_BLOCKS), 2);
            assert_eq!(reads, 2 * 5);
        }
    }
}
