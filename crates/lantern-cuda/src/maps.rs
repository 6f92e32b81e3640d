//! A finished capture's maps computed on the device ([`AttentionBackend::probability_map`]
//! of [`CudaBackend`]): the request's query rows go up, the probabilities are computed from
//! the paged cache where it lives (`map_probabilities`), heads combined (`combine_heads`)
//! and top-k kept (`top_k_rows`) there, and only the map comes back — a few rows at a time,
//! so that what the device holds beside the cache stays bounded ([`MAP_CHUNK_BYTES`]).
//!
//! [`AttentionBackend::probability_map`]: lantern_attn::AttentionBackend::probability_map

use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaView};
use lantern_attn::{
    AttnError, HeadCombine, LayerKvCache, MapQueries, ProbabilityMap, ProbabilityMapJob,
};

use crate::backend::{attn_params, CudaBackend};
use crate::cache::{attn_error, CacheData, CudaKvCache};
use crate::capture::MAP_CHUNK_BYTES;
use crate::gpu::Gpu;
use crate::kept::CudaKeptRows;
use crate::kernels::{AttnParams, CacheElem, KvStrides, GRID_YZ};
use crate::CudaError;

/// Rows of the map computed per launch: their dense rows (`heads × num_keys` f32 each)
/// within [`MAP_CHUNK_BYTES`], at least one, at most a grid's y dimension.
pub(crate) fn rows_per_chunk(heads: usize, num_keys: usize) -> usize {
    let row_bytes = heads.saturating_mul(num_keys).saturating_mul(4).max(1);
    (MAP_CHUNK_BYTES / row_bytes).clamp(1, GRID_YZ)
}

impl CudaBackend {
    /// The map `job` asks for, computed on the device from `cache` at `block_table`.
    pub(crate) fn map_on_device(
        &self,
        cache: &dyn LayerKvCache,
        block_table: &[u32],
        job: &ProbabilityMapJob<'_>,
    ) -> Result<ProbabilityMap, AttnError> {
        job.check()?;
        let cache: &CudaKvCache = cache
            .as_any()
            .downcast_ref()
            .ok_or(AttnError::ForeignCache {
                backend: lantern_attn::AttentionBackend::name(self),
            })?;
        let mut map = ProbabilityMap {
            values: Vec::with_capacity(job.map_len()),
            indices: job.top_k.map(|_| Vec::with_capacity(job.map_len())),
        };
        if job.map_len() == 0 {
            return Ok(map);
        }
        let gpu = self.gpu();
        let table = gpu.upload(block_table).map_err(attn_error)?;
        let sinks = match &job.layer.sinks {
            Some(s) => Some(gpu.upload(s).map_err(attn_error)?),
            None => None,
        };
        let sinks = sinks.as_ref().map(|s| s.as_view());
        let params = attn_params(job.layer, sinks);
        let chunk = Chunk {
            gpu,
            job,
            table: &table,
            strides: cache.strides(),
            params: &params,
        };
        let row_len = job.heads.len() * job.layer.head_dim;
        // The rows where the device kept them, or else copied up from the host.
        let uploaded;
        let (all_rows, first_row) = match kept_on_device(job.queries) {
            Some(kept) => kept,
            None => {
                uploaded = gpu.upload(&job.host_queries()?).map_err(attn_error)?;
                (&uploaded, 0)
            }
        };
        let positions: Vec<usize> = job.positions.clone().collect();
        let per_chunk = rows_per_chunk(job.heads.len(), job.num_keys);
        for (c, rows) in positions.chunks(per_chunk).enumerate() {
            let first = (first_row + c * per_chunk) * row_len;
            let q = all_rows.slice(first..first + rows.len() * row_len);
            let visible: Vec<Range<usize>> = rows.iter().map(|&p| job.visible(p)).collect();
            match &cache.data {
                CacheData::F32(k) => chunk.run(k, &q, &visible, &mut map),
                CacheData::F16(k) => chunk.run(k, &q, &visible, &mut map),
                CacheData::Bf16(k) => chunk.run(k, &q, &visible, &mut map),
            }
            .map_err(attn_error)?;
        }
        Ok(map)
    }
}

/// Query rows this backend kept on the device: their buffer and the job's first row
/// in it.
fn kept_on_device(queries: MapQueries<'_>) -> Option<(&CudaSlice<f32>, usize)> {
    match queries {
        MapQueries::Kept { rows, first } => rows
            .as_any()
            .downcast_ref::<CudaKeptRows>()
            .map(|kept| (kept.rows(), first)),
        MapQueries::Host(_) => None,
    }
}

/// What every chunk of one map's rows shares.
struct Chunk<'a> {
    gpu: &'a Gpu,
    job: &'a ProbabilityMapJob<'a>,
    table: &'a CudaSlice<u32>,
    strides: &'a KvStrides,
    params: &'a AttnParams<'a>,
}

impl Chunk<'_> {
    /// The rows of `q` (on the device; seeing keys `visible`), their part of the map
    /// appended to `map`.
    fn run<T: CacheElem>(
        &self,
        cache: &CudaSlice<T>,
        q: &CudaView<'_, f32>,
        visible: &[Range<usize>],
        map: &mut ProbabilityMap,
    ) -> crate::Result<()> {
        let (gpu, job) = (self.gpu, self.job);
        let (rows, heads, n) = (visible.len(), job.heads.len(), job.num_keys);
        let mut dense = gpu.zeros::<f32>(rows * heads * n)?;
        let mut bad = gpu.zeros::<u32>(1)?;
        let shape = (job.heads, visible, n);
        gpu.map_probabilities(
            q,
            cache,
            self.strides,
            self.table,
            shape,
            self.params,
            &mut dense,
            &mut bad,
        )?;
        if gpu.download(&bad)?[0] != 0 {
            return Err(CudaError::Shape(
                "a captured row's keys lie in a block the request does not hold".into(),
            ));
        }
        let combined = match job.combine {
            HeadCombine::Each => dense,
            combine => {
                let mut out = gpu.output::<f32>(rows * n)?;
                gpu.combine_heads(&dense, (heads, n), combine, &mut out)?;
                out
            }
        };
        match (&mut map.indices, job.top_k) {
            (Some(indices), Some(_)) => {
                let (len, width) = (rows * job.output_heads() * job.width(), job.width());
                let mut vals = gpu.output::<f32>(len)?;
                let mut idx = gpu.output::<u32>(len)?;
                gpu.top_k_rows(&combined, (n, width), &mut vals, &mut idx)?;
                gpu.download_append(&vals, &mut map.values)?;
                gpu.download_append(&idx, indices)?;
            }
            _ => gpu.download_append(&combined, &mut map.values)?,
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks hold at most `MAP_CHUNK_BYTES` of dense rows, and never no row.
    #[test]
    fn chunks_are_bounded() {
        assert_eq!(rows_per_chunk(9, 512), MAP_CHUNK_BYTES / (9 * 512 * 4));
        assert_eq!(
            rows_per_chunk(64, 1 << 20),
            1,
            "one row even when it alone is larger"
        );
        assert_eq!(rows_per_chunk(1, 1), GRID_YZ, "at most a grid's rows");
        assert_eq!(rows_per_chunk(0, 0), GRID_YZ);
    }
}
