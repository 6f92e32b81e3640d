//! Capture's probabilities on the device (`kernels/capture.cu`): the rows a capturing
//! request's key statistics, span masses and streamed figures are summed from, computed
//! from the layer's q and the paged cache right after its attention, and copied to the
//! host as the rows' values only.

use std::ops::Range;

use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};

use lantern_attn::HeadCombine;

use crate::error::{ensure, CudaError, Result};
use crate::gpu::Gpu;
use crate::kernels::{u32_of, AttnParams, CacheElem, KvStrides, StrideArgs, GRID_YZ, MAX_HEAD_DIM};

/// Threads per (row, head) block: a warp per key at a time, eight keys in flight.
const THREADS: u32 = 256;

/// One query row whose probabilities [`Gpu::row_probabilities`] computes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbabilityRow {
    /// Its row in the step's q.
    pub token: usize,
    /// Its request: the row of the block table its keys are looked up in.
    pub request: usize,
    /// The keys it sees (one contiguous range: the layer has no chunk).
    pub keys: Range<usize>,
    /// Where its `[num_heads, keys.len()]` values start in the output.
    pub offset: usize,
}

/// The kernel's per-row arguments: `(token, request, first key, key count)` as u32, and
/// the offsets as u64; checked against the output's, q's and the table's sizes.
fn row_args(
    rows: &[ProbabilityRow],
    spec: &AttnParams<'_>,
    q_len: usize,
    out_len: usize,
    table: (usize, usize),
    block_size: usize,
) -> Result<(Vec<u32>, Vec<u64>)> {
    let (table_len, stride) = table;
    let row_len = spec.num_heads * spec.head_dim;
    let mut args = Vec::with_capacity(rows.len() * 4);
    let mut offsets = Vec::with_capacity(rows.len());
    for row in rows {
        let n = row.keys.len();
        ensure((row.token + 1) * row_len <= q_len, || {
            format!(
                "row_probabilities: token {} past q's {} rows",
                row.token,
                q_len / row_len.max(1)
            )
        })?;
        ensure(row.offset + n * spec.num_heads <= out_len, || {
            format!(
                "row_probabilities: row at {} with {n} keys past the output's {out_len} values",
                row.offset
            )
        })?;
        ensure(
            (row.request + 1) * stride <= table_len && row.keys.end <= stride * block_size,
            || {
                format!(
                    "row_probabilities: request {} keys {:?} outside a table of {} rows of {stride} blocks",
                    row.request,
                    row.keys,
                    table_len / stride.max(1)
                )
            },
        )?;
        args.extend([
            u32_of("token", row.token)?,
            u32_of("request", row.request)?,
            u32_of("first key", row.keys.start)?,
            u32_of("keys", n)?,
        ]);
        offsets.push(row.offset as u64);
    }
    Ok((args, offsets))
}

impl Gpu {
    /// The probabilities of `rows` of `q` (`[tokens, heads, head_dim]` f32) over their
    /// keys in `cache` (`strides`' layout; `block_table` `[requests, table_stride]`), with
    /// the layer's scale, soft-cap and sinks, into `out`: row `i`'s `[num_heads, keys]`
    /// at `rows[i].offset`. A row that meets an invalid block gets NaN values.
    #[allow(clippy::too_many_arguments)]
    pub fn row_probabilities<T: CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        cache: &impl DevicePtr<T>,
        strides: &KvStrides,
        (block_table, table_stride): (&impl DevicePtr<u32>, usize),
        rows: &[ProbabilityRow],
        spec: &AttnParams<'_>,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let (heads, kv_heads, d) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
        ensure(
            kv_heads > 0 && heads.is_multiple_of(kv_heads) && (1..=MAX_HEAD_DIM).contains(&d),
            || format!("row_probabilities: {heads} heads over {kv_heads} kv heads of {d}"),
        )?;
        ensure(
            strides.num_kv_heads == kv_heads && strides.head_dim == d && strides.block_size > 0,
            || "row_probabilities: the cache's strides are not the layer's".to_string(),
        )?;
        ensure(spec.sinks.as_ref().is_none_or(|s| s.len() == heads), || {
            "row_probabilities: sinks are not one per head".to_string()
        })?;
        if rows.is_empty() {
            return Ok(());
        }
        let table = (block_table.len(), table_stride);
        let (args, offsets) = row_args(rows, spec, q.len(), out.len(), table, strides.block_size)?;
        let args = self.step_upload(&args)?;
        let offsets = self.step_upload(&offsets)?;
        let f = self.function(&format!("row_probabilities_{}", T::SUFFIX))?;
        let s = StrideArgs::new(strides)?;
        let cache_len = cache.len() as u64;
        let (qp, _gq) = q.device_ptr(&self.stream);
        let (cp, _gc) = cache.device_ptr(&self.stream);
        let (ap, _ga) = args.device_ptr(&self.stream);
        let (opp, _gop) = offsets.device_ptr(&self.stream);
        let (bt, _gb) = block_table.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let sinks = spec.sinks.as_ref().map(|s| s.device_ptr(&self.stream));
        let sinks_p: u64 = sinks.as_ref().map_or(0, |(p, _)| *p);
        let (heads32, kvh32, d32) = (heads as u32, kv_heads as u32, d as u32);
        let stride32 = u32_of("table_stride", table_stride)?;
        let cap = spec.soft_cap.unwrap_or(0.0);
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&qp).arg(&cp).arg(&cache_len);
        b.arg(&s.block).arg(&s.in_block).arg(&s.head).arg(&s.dim);
        b.arg(&s.block_size).arg(&heads32).arg(&kvh32).arg(&d32);
        b.arg(&ap).arg(&opp).arg(&bt).arg(&stride32);
        b.arg(&spec.scale).arg(&cap).arg(&sinks_p).arg(&op);
        let cfg = LaunchConfig {
            grid_dim: (u32_of("rows", rows.len())?, heads32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match the kernel's signature; every row's token, keys,
        // table row and output range were checked above, and cache reads are bounded by
        // the cache length in the kernel.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

/// Rows of a finished capture's map computed per launch: their dense probabilities of
/// every asked head take at most this many bytes of device memory (or one row).
pub const MAP_CHUNK_BYTES: usize = 64 << 20;

/// The kernel's per-row arguments of [`Gpu::map_probabilities`]: `(first key, key count)`
/// as u32, checked against the map's columns and the request's table.
fn map_row_args(visible: &[Range<usize>], num_keys: usize, table_keys: usize) -> Result<Vec<u32>> {
    let mut args = Vec::with_capacity(visible.len() * 2);
    for keys in visible {
        ensure(keys.end <= num_keys.min(table_keys), || {
            format!(
                "map_probabilities: keys {keys:?} past the map's {num_keys} columns or the table's {table_keys} keys"
            )
        })?;
        args.extend([
            u32_of("first key", keys.start)?,
            u32_of("keys", keys.len())?,
        ]);
    }
    Ok(args)
}

impl Gpu {
    /// The probabilities of one request's query rows over the keys each sees
    /// (`visible[i]` for row `i`, within `0..num_keys`): `q` `[rows, heads.len(),
    /// head_dim]` f32 (the asked heads' query rows; `heads` the layer's head each
    /// stands for), keys in `cache` (`strides`' layout) at the request's `block_table`,
    /// with the layer's scale, soft-cap and sinks. Writes `out` `[rows, heads.len(),
    /// num_keys]` at the visible keys only (the caller zeroes it); sets `bad` to nonzero
    /// when a row meets an invalid block.
    #[allow(clippy::too_many_arguments)]
    pub fn map_probabilities<T: CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        cache: &impl DevicePtr<T>,
        strides: &KvStrides,
        block_table: &impl DevicePtr<u32>,
        (heads, visible, num_keys): (&[usize], &[Range<usize>], usize),
        spec: &AttnParams<'_>,
        out: &mut impl DevicePtrMut<f32>,
        bad: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        let (kv_heads, d) = (spec.num_kv_heads, spec.head_dim);
        ensure(
            kv_heads > 0
                && spec.num_heads.is_multiple_of(kv_heads)
                && (1..=MAX_HEAD_DIM).contains(&d),
            || {
                format!(
                    "map_probabilities: {} heads over {kv_heads} kv heads of {d}",
                    spec.num_heads
                )
            },
        )?;
        ensure(
            strides.num_kv_heads == kv_heads && strides.head_dim == d && strides.block_size > 0,
            || "map_probabilities: the cache's strides are not the layer's".to_string(),
        )?;
        ensure(
            spec.sinks
                .as_ref()
                .is_none_or(|s| s.len() == spec.num_heads),
            || "map_probabilities: sinks are not one per head".to_string(),
        )?;
        ensure(heads.iter().all(|&h| h < spec.num_heads), || {
            format!(
                "map_probabilities: heads {heads:?} on a layer of {}",
                spec.num_heads
            )
        })?;
        let rows = visible.len();
        ensure(q.len() == rows * heads.len() * d, || {
            format!(
                "map_probabilities: q of {} values for {rows} rows of {} heads",
                q.len(),
                heads.len()
            )
        })?;
        ensure(
            out.len() == rows * heads.len() * num_keys && bad.len() == 1,
            || {
                format!("map_probabilities: an output of {} values for {rows} rows of {} heads and {num_keys} keys", out.len(), heads.len())
            },
        )?;
        if rows == 0 || heads.is_empty() {
            return Ok(());
        }
        let table_keys = block_table.len() * strides.block_size;
        let args = self.upload(&map_row_args(visible, num_keys, table_keys)?)?;
        let head_ids: Vec<u32> = heads.iter().map(|&h| h as u32).collect();
        let head_ids = self.upload(&head_ids)?;
        let f = self.function(&format!("map_probabilities_{}", T::SUFFIX))?;
        let s = StrideArgs::new(strides)?;
        let cache_len = cache.len() as u64;
        let (qp, _gq) = q.device_ptr(&self.stream);
        let (cp, _gc) = cache.device_ptr(&self.stream);
        let (hp, _gh) = head_ids.device_ptr(&self.stream);
        let (ap, _ga) = args.device_ptr(&self.stream);
        let (bt, _gb) = block_table.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let (bp, _gbad) = bad.device_ptr_mut(&self.stream);
        let sinks = spec.sinks.as_ref().map(|s| s.device_ptr(&self.stream));
        let sinks_p: u64 = sinks.as_ref().map_or(0, |(p, _)| *p);
        let group = (spec.num_heads / kv_heads) as u32;
        let (d32, asked) = (d as u32, u32_of("heads", heads.len())?);
        let keys32 = u32_of("num_keys", num_keys)?;
        let cap = spec.soft_cap.unwrap_or(0.0);
        let Some(mut b) = self.launcher(f)? else {
            return Err(CudaError::Graph(
                "map_probabilities inside a replayed graph step".into(),
            ));
        };
        b.arg(&qp).arg(&cp).arg(&cache_len);
        b.arg(&s.block).arg(&s.in_block).arg(&s.head).arg(&s.dim);
        b.arg(&s.block_size).arg(&group).arg(&d32);
        b.arg(&hp).arg(&asked).arg(&ap).arg(&bt).arg(&keys32);
        b.arg(&spec.scale).arg(&cap).arg(&sinks_p).arg(&op).arg(&bp);
        let cfg = LaunchConfig {
            grid_dim: (u32_of("rows", rows)?, asked, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match the kernel's signature; q, out and the heads
        // were checked above, every row's keys lie within the map's columns and the
        // table's blocks, and cache reads are bounded by the cache length in the kernel.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// `dense` `[rows, heads, num_keys]` with each row's heads combined as
    /// [`lantern_attn::combine_heads`] does (the same bits), into `out` `[rows, num_keys]`.
    pub fn combine_heads(
        &self,
        dense: &impl DevicePtr<f32>,
        (heads, num_keys): (usize, usize),
        combine: HeadCombine,
        out: &mut impl DevicePtrMut<f32>,
    ) -> Result<()> {
        let mode: u32 = match combine {
            HeadCombine::Each => {
                return Err(CudaError::Shape("combine_heads: nothing to combine".into()))
            }
            HeadCombine::Mean => 1,
            HeadCombine::Max => 2,
        };
        let row = heads * num_keys;
        ensure(row > 0 && dense.len().is_multiple_of(row), || {
            format!(
                "combine_heads: {} values are not rows of {heads} heads of {num_keys} keys",
                dense.len()
            )
        })?;
        let rows = dense.len() / row;
        ensure(out.len() == rows * num_keys && rows <= GRID_YZ, || {
            format!(
                "combine_heads: an output of {} values for {rows} rows of {num_keys} keys",
                out.len()
            )
        })?;
        let inv = 1.0 / heads as f32;
        let f = self.function("combine_heads")?;
        let (ip, _gi) = dense.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let (h32, k32) = (u32_of("heads", heads)?, u32_of("num_keys", num_keys)?);
        let Some(mut b) = self.launcher(f)? else {
            return Err(CudaError::Graph(
                "combine_heads inside a replayed graph step".into(),
            ));
        };
        b.arg(&ip).arg(&h32).arg(&k32).arg(&mode).arg(&inv).arg(&op);
        let cfg = LaunchConfig {
            grid_dim: (k32.div_ceil(THREADS), rows as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match the kernel's signature; both lengths checked.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The `k` largest values of each row of `rows` (`[n, num_keys]`, no NaN) and their
    /// positions, as [`lantern_attn::top_k`] gives them: `vals` and `idx` `[n, k]`.
    pub fn top_k_rows(
        &self,
        rows: &impl DevicePtr<f32>,
        (num_keys, k): (usize, usize),
        vals: &mut impl DevicePtrMut<f32>,
        idx: &mut impl DevicePtrMut<u32>,
    ) -> Result<()> {
        ensure(
            k > 0 && k <= num_keys && rows.len().is_multiple_of(num_keys),
            || {
                format!(
                    "top_k_rows: top {k} of rows of {num_keys} keys ({} values)",
                    rows.len()
                )
            },
        )?;
        let n = rows.len() / num_keys;
        ensure(vals.len() == n * k && idx.len() == n * k, || {
            format!(
                "top_k_rows: outputs of {} and {} values for {n} rows of {k}",
                vals.len(),
                idx.len()
            )
        })?;
        if n == 0 {
            return Ok(());
        }
        let f = self.function("top_k_rows")?;
        let (ip, _gi) = rows.device_ptr(&self.stream);
        let (vp, _gv) = vals.device_ptr_mut(&self.stream);
        let (xp, _gx) = idx.device_ptr_mut(&self.stream);
        let (k32, keys32) = (u32_of("k", k)?, u32_of("num_keys", num_keys)?);
        let Some(mut b) = self.launcher(f)? else {
            return Err(CudaError::Graph(
                "top_k_rows inside a replayed graph step".into(),
            ));
        };
        b.arg(&ip).arg(&keys32).arg(&k32).arg(&vp).arg(&xp);
        let cfg = LaunchConfig {
            grid_dim: (u32_of("rows", n)?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument types match the kernel's signature; lengths checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> AttnParams<'static> {
        AttnParams {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            scale: 0.5,
            sliding_window: None,
            chunk_size: None,
            soft_cap: None,
            sinks: None,
        }
    }

    fn row(token: usize, request: usize, keys: Range<usize>, offset: usize) -> ProbabilityRow {
        ProbabilityRow {
            token,
            request,
            keys,
            offset,
        }
    }

    /// A map's rows become `(first key, key count)` pairs; keys past the map's columns
    /// or the request's table are refused before anything is launched.
    #[test]
    fn map_rows_are_checked_and_packed() {
        // 40 columns, a table of 3 blocks of 16 keys.
        let args = map_row_args(&[0..5, 10..40, 39..40], 40, 48).unwrap();
        assert_eq!(args, [0, 5, 10, 30, 39, 1]);
        for (bad, columns, table) in [(0..41, 40, 48), (30..50, 60, 48)] {
            let e = map_row_args(&[bad], columns, table)
                .unwrap_err()
                .to_string();
            assert!(e.contains("past the map's"), "{e}");
        }
    }

    /// Rows become the kernel's arguments; a row past q, the output or its table's
    /// blocks is refused before anything is launched.
    #[test]
    fn rows_are_checked_and_packed() {
        let spec = params();
        // q of 3 tokens, 2 requests of 4 blocks of 16 keys, output of 200 values.
        let (q_len, out_len, table) = (3 * 32, 200, (8, 4));
        let rows = [row(2, 1, 10..30, 0), row(0, 0, 0..5, 80)];
        let (args, offsets) = row_args(&rows, &spec, q_len, out_len, table, 16).unwrap();
        assert_eq!(args, [2, 1, 10, 20, 0, 0, 0, 5]);
        assert_eq!(offsets, [0, 80]);
        for (bad, what) in [
            (row(3, 0, 0..1, 0), "past q"),
            (row(0, 0, 0..10, 170), "past the output"),
            (row(0, 2, 0..1, 0), "outside a table"),
            (row(0, 1, 60..65, 0), "outside a table"),
        ] {
            let e = row_args(&[bad], &spec, q_len, out_len, table, 16)
                .unwrap_err()
                .to_string();
            assert!(e.contains(what), "{e}");
        }
    }
}
