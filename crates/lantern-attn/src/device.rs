//! What crosses the attention backend boundary: device tensors and the caches a backend
//! allocates for itself.
//!
//! Queries, keys, values and the attention output are candle [`Tensor`]s on the
//! backend's [`Device`]; the CPU backends take tensors on `Device::Cpu` and lend their
//! values without a copy ([`host_f32`]). A layer's KV cache is a [`LayerKvCache`]: the
//! engine holds it as a trait object it never looks into, and only the backend that
//! allocated it reads or writes it (it downcasts to its own type, and a cache of another
//! type is an error, not a misread).

use std::any::Any;
use std::fmt::Debug;
use std::ops::{Deref, Range};

use candle_core::{CpuStorage, DType, Storage, StorageRef};
pub use candle_core::{Device, Tensor};
use lantern_kv::KvDtype;

use crate::cache::PagedKvCache;
use crate::error::AttnError;
use crate::layout::{CacheGeometry, KvCacheLayout};

/// One layer's KV cache as a backend allocated it, seen from outside the backend.
pub trait LayerKvCache: Any + Send + Sync + Debug {
    /// The cache's sizes.
    fn geometry(&self) -> &CacheGeometry;
    /// The layout it was allocated with.
    fn layout(&self) -> &KvCacheLayout;
    /// Element type of the stored keys and values.
    fn dtype(&self) -> KvDtype;
    /// Bytes it holds on its device.
    fn size_bytes(&self) -> usize;
    /// For the allocating backend to get its own type back.
    fn as_any(&self) -> &dyn Any;
    /// For the allocating backend to get its own type back.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl LayerKvCache for PagedKvCache {
    fn geometry(&self) -> &CacheGeometry {
        PagedKvCache::geometry(self)
    }

    fn layout(&self) -> &KvCacheLayout {
        PagedKvCache::layout(self)
    }

    fn dtype(&self) -> KvDtype {
        PagedKvCache::dtype(self)
    }

    fn size_bytes(&self) -> usize {
        PagedKvCache::size_bytes(self)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// A `[d0, d1, d2]` f32 tensor on `device` holding `values` (moved, not copied, on the
/// CPU; uploaded on other devices).
pub fn tensor3(values: Vec<f32>, dims: [usize; 3], device: &Device) -> Result<Tensor, AttnError> {
    Ok(Tensor::from_vec(
        values,
        (dims[0], dims[1], dims[2]),
        device,
    )?)
}

/// A tensor's f32 values in row-major order, readable as a host slice: borrowed from a
/// contiguous f32 tensor in host memory, copied to the host otherwise (a device tensor, a
/// strided view, another element type).
pub enum HostF32<'a> {
    Borrowed {
        storage: StorageRef<'a>,
        range: Range<usize>,
    },
    Copied(Vec<f32>),
}

impl Deref for HostF32<'_> {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        match self {
            HostF32::Borrowed { storage, range } => match &**storage {
                Storage::Cpu(CpuStorage::F32(values)) => &values[range.clone()],
                // `host_f32` borrows only host f32 storage.
                _ => &[],
            },
            HostF32::Copied(values) => values,
        }
    }
}

/// The values of `t` as a host f32 slice (see [`HostF32`]).
pub fn host_f32(t: &Tensor) -> Result<HostF32<'_>, AttnError> {
    let (storage, layout) = t.storage_and_layout();
    if let (Storage::Cpu(CpuStorage::F32(_)), Some((start, end))) =
        (&*storage, layout.contiguous_offsets())
    {
        return Ok(HostF32::Borrowed {
            storage,
            range: start..end,
        });
    }
    drop(storage);
    let host = t.flatten_all()?.to_dtype(DType::F32)?;
    Ok(HostF32::Copied(host.to_device(&Device::Cpu)?.to_vec1()?))
}

/// Checks that `t` is an f32 tensor of exactly `expected` dims.
pub fn expect_f32_dims(
    what: &'static str,
    t: &Tensor,
    expected: &[usize],
) -> Result<(), AttnError> {
    if t.dtype() != DType::F32 {
        return Err(AttnError::UnsupportedTensor {
            what,
            problem: format!("element type {:?}, expected f32", t.dtype()),
        });
    }
    if t.dims() != expected {
        return Err(AttnError::ShapeMismatch {
            what,
            expected: expected.to_vec(),
            got: t.dims().to_vec(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_values_are_borrowed_or_copied_in_row_major_order() {
        let values: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        let t = tensor3(values.clone(), [2, 3, 4], &Device::Cpu).unwrap();
        let host = host_f32(&t).unwrap();
        assert!(matches!(host, HostF32::Borrowed { .. }));
        assert_eq!(&*host, &values[..]);
        drop(host);

        // A narrowed view starts inside the storage: still borrowed, at its offset.
        let tail = t.narrow(0, 1, 1).unwrap();
        assert_eq!(&*host_f32(&tail).unwrap(), &values[12..]);

        // A transposed view is not contiguous: copied in its own row-major order.
        let tr = t.transpose(1, 2).unwrap();
        let host = host_f32(&tr).unwrap();
        assert!(matches!(host, HostF32::Copied(_)));
        assert_eq!(host[1], values[4]);
        assert_eq!(host[3], values[1]);

        // Another element type is converted.
        let f16 = t.to_dtype(DType::F16).unwrap();
        assert_eq!(&*host_f32(&f16).unwrap(), &values[..]);
    }

    #[test]
    fn shape_and_type_are_checked() {
        let t = tensor3(vec![0.0; 6], [1, 2, 3], &Device::Cpu).unwrap();
        expect_f32_dims("q", &t, &[1, 2, 3]).unwrap();
        assert!(matches!(
            expect_f32_dims("q", &t, &[2, 1, 3]),
            Err(AttnError::ShapeMismatch { what: "q", .. })
        ));
        let f16 = t.to_dtype(DType::F16).unwrap();
        assert!(matches!(
            expect_f32_dims("k", &f16, &[1, 2, 3]),
            Err(AttnError::UnsupportedTensor { what: "k", .. })
        ));
    }
}
