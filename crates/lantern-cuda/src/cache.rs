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
        mut values: Option<&mut [f32]>,
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
        let s = &self.strides;
        // One plane (the keys or the values of one block) spans this many elements from
        // its first, whatever the order of its three inner dimensions.
        let plane = (g.block_size - 1) * s.in_block
            + (g.num_kv_heads - 1) * s.head
            + (g.head_dim - 1) * s.dim
            + 1;
        let mut order: Vec<usize> = (0..slots.len()).collect();
        order.sort_by_key(|&i| slots[i] / g.block_size);
        let mut current: Option<(usize, Vec<T>, Vec<T>)> = None;
        for i in order {
            let (block, in_block) = (slots[i] / g.block_size, slots[i] % g.block_size);
            if current.as_ref().map(|c| c.0) != Some(block) {
                let read = |kv: usize| -> Result<Vec<T>, AttnError> {
                    let start = block * s.block + kv * s.kv;
                    self.gpu
                        .download(&data.slice(start..start + plane))
                        .map_err(attn_error)
                };
                let k = read(0)?;
                let v = if values.is_some() {
                    read(1)?
                } else {
                    Vec::new()
                };
                current = Some((block, k, v));
            }
            let Some((_, k, v)) = &current else {
                continue;
            };
            for h in 0..g.num_kv_heads {
                for d in 0..g.head_dim {
                    let at = in_block * s.in_block + h * s.head + d * s.dim;
                    let out = i * row + h * g.head_dim + d;
                    keys[out] = k[at].to_f32();
                    if let Some(values) = values.as_deref_mut() {
                        values[out] = v[at].to_f32();
                    }
                }
            }
        }
        Ok(())
    }
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
