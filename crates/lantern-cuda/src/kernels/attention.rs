//! Paged attention on the GPU: the launch of attention.cu's kernels (plain and split over
//! the key axis), the checks of their arguments and the split-K heuristic.

use super::*;

/// Threads of a paged-attention block, keys per tile, accumulator values per thread (attention.cu).
const ATTN_THREADS: usize = 128;
const ATTN_TILE: usize = 16;
const ATTN_ACC: usize = 16;
/// Most key splits [`Gpu::paged_attention_split`] takes.
pub const MAX_ATTN_SPLITS: usize = 256;
/// Split-K heuristic of [`Gpu::paged_attention`]: split only when the plain grid has fewer
/// blocks than this many per SM, the visible range is longer than `SPLIT_ABOVE_KEYS`; each
/// split gets at least `SPLIT_KEYS` keys (attention.cu's SPLIT_MIN_KEYS), at most `AUTO_SPLITS` splits.
const SPLIT_BLOCKS_PER_SM: usize = 2;
const SPLIT_ABOVE_KEYS: usize = 256;
const SPLIT_KEYS: usize = 64;
const AUTO_SPLITS: usize = 32;

/// The key splits [`Gpu::paged_attention`] uses (1: the plain kernel) for a grid of `blocks`
/// blocks on `sm_count` SMs whose longest context is `max_seq_len` keys (0: unknown), of which
/// at most `visible` (the sliding window or chunk, when set) are visible to one query.
pub fn auto_attention_splits(
    blocks: usize,
    sm_count: usize,
    max_seq_len: usize,
    visible: Option<usize>,
) -> usize {
    let keys = visible.map_or(max_seq_len, |v| v.min(max_seq_len));
    let target = SPLIT_BLOCKS_PER_SM * sm_count.max(1);
    if max_seq_len == 0 || keys <= SPLIT_ABOVE_KEYS || blocks == 0 || blocks >= target {
        return 1;
    }
    target
        .div_ceil(blocks)
        .min(keys.div_ceil(SPLIT_KEYS))
        .clamp(1, AUTO_SPLITS)
}

impl Gpu {
    /// Paged attention: out `[t, heads, d]` from q `[t, heads, d]` and the cache (see attention.cu).
    /// A step whose grid would leave most SMs idle and whose contexts are long (see
    /// [`auto_attention_splits`]) takes the split-K path of [`Gpu::paged_attention_split`].
    pub fn paged_attention<T: CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        cache: &impl DevicePtr<T>,
        strides: &KvStrides,
        meta: &PagedMeta<'_>,
        spec: &AttnParams<'_>,
    ) -> Result<()> {
        let plan = check_attention(q, out, strides, meta, spec)?;
        let visible = match (spec.sliding_window, spec.chunk_size) {
            (Some(w), Some(c)) => Some(w.min(c)),
            (w, c) => w.or(c),
        };
        let blocks = meta.num_tokens * spec.num_kv_heads * plan.group_splits;
        let splits = auto_attention_splits(blocks, self.sm_count(), meta.max_seq_len, visible);
        let splits = if splits > 1 && plan.group_splits * splits <= GRID_YZ {
            splits
        } else {
            0
        };
        self.launch_attention(q, out, cache, strides, meta, spec, &plan, splits)
    }

    /// Paged attention as [`Gpu::paged_attention`], always split-K: each (token, kv head,
    /// head group, split) block takes `num_splits`-th of the query's visible keys (at least 64
    /// where there are that many; later splits may be empty), then a merge kernel combines the
    /// splits' partial softmax states. `num_splits` in `1..=MAX_ATTN_SPLITS`; 0 forces the
    /// plain kernel (no split, no merge).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_split<T: CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        cache: &impl DevicePtr<T>,
        strides: &KvStrides,
        meta: &PagedMeta<'_>,
        spec: &AttnParams<'_>,
        num_splits: usize,
    ) -> Result<()> {
        let plan = check_attention(q, out, strides, meta, spec)?;
        ensure(
            num_splits <= MAX_ATTN_SPLITS && plan.group_splits * num_splits <= GRID_YZ,
            || format!("paged_attention_split: {num_splits} splits outside 0..={MAX_ATTN_SPLITS}"),
        )?;
        self.launch_attention(q, out, cache, strides, meta, spec, &plan, num_splits)
    }

    /// Launches the plain kernel (`num_splits` 0) or the split pass and the merge.
    #[allow(clippy::too_many_arguments)]
    fn launch_attention<T: CacheElem>(
        &self,
        q: &impl DevicePtr<f32>,
        out: &mut impl DevicePtrMut<f32>,
        cache: &impl DevicePtr<T>,
        strides: &KvStrides,
        meta: &PagedMeta<'_>,
        spec: &AttnParams<'_>,
        plan: &AttnPlan,
        num_splits: usize,
    ) -> Result<()> {
        let t = meta.num_tokens;
        if t == 0 {
            return Ok(());
        }
        let (heads, kv_heads, d) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
        let group_block = plan.group_block;
        let splits = plan.group_splits;
        let shared = 8 * ATTN_TILE
            + 4 * (2 * ATTN_TILE * (d + 1)
                + group_block * d
                + group_block * ATTN_TILE
                + 3 * group_block);
        let name = if num_splits == 0 {
            format!("paged_attention_{}", T::SUFFIX)
        } else {
            format!("paged_attention_split_{}", T::SUFFIX)
        };
        let f = self.function(&name)?;
        // Split mode: the splits' partial results (m, l, acc per token, head, split), each
        // entry written by the split pass before the merge reads it.
        let part_len = t * heads * num_splits * (d + 2);
        // A graph step takes it from the graph arena: the shared scratch may be replaced
        // by a larger one, and a graph must keep the address it was captured with.
        let mut graph_part = match num_splits {
            0 => None,
            _ => self.graph_buffer::<f32>(part_len)?,
        };
        let mut scratch = self.attn_scratch.lock().unwrap_or_else(|e| e.into_inner());
        if graph_part.is_none()
            && num_splits > 0
            && scratch.as_ref().is_none_or(|p| p.len() < part_len)
        {
            *scratch = None;
            let n = part_len.next_power_of_two();
            self.check_fits(n * 4)?;
            // SAFETY: every (token, head, split) gets m and l from the split pass; acc is
            // written wherever m is not -inf, the only entries the merge reads.
            *scratch = Some(unsafe { self.stream.alloc::<f32>(n) }?);
        }
        let mut part = match graph_part.as_mut() {
            Some(p) => Some(&mut **p),
            None => scratch.as_mut().filter(|_| num_splits > 0),
        };
        let s = StrideArgs::new(strides)?;
        let cache_len = cache.len() as u64;
        let (qp, _gq) = q.device_ptr(&self.stream);
        let (op, _go) = out.device_ptr_mut(&self.stream);
        let (cp, _gc) = cache.device_ptr(&self.stream);
        let (qsl, _g1) = meta.query_start_loc.device_ptr(&self.stream);
        let (sl, _g2) = meta.seq_lens.device_ptr(&self.stream);
        let (bt, _g3) = meta.block_table.device_ptr(&self.stream);
        let sinks_ptr = spec.sinks.as_ref().map(|s| s.device_ptr(&self.stream));
        let sinks_p: u64 = sinks_ptr.as_ref().map_or(0, |(p, _)| *p);
        let heads32 = u32_of("heads", heads)?;
        let kvh32 = kv_heads as u32;
        let d32 = d as u32;
        let gb32 = group_block as u32;
        let stride32 = u32_of("table_stride", meta.table_stride)?;
        let r32 = u32_of("requests", meta.num_reqs)?;
        let window = u32_of("window", spec.sliding_window.unwrap_or(0))?;
        let chunk = u32_of("chunk", spec.chunk_size.unwrap_or(0))?;
        let cap = spec.soft_cap.unwrap_or(0.0);
        let part_ptr = part.as_mut().map(|p| p.device_ptr_mut(&self.stream));
        let first_out: u64 = part_ptr.as_ref().map_or(op, |(p, _)| *p);
        let splits32 = num_splits as u32;
        let Some(mut b) = self.launcher(f)? else {
            return Ok(());
        };
        b.arg(&qp).arg(&first_out).arg(&cp).arg(&cache_len);
        b.arg(&s.kv)
            .arg(&s.block)
            .arg(&s.in_block)
            .arg(&s.head)
            .arg(&s.dim);
        b.arg(&s.block_size)
            .arg(&heads32)
            .arg(&kvh32)
            .arg(&d32)
            .arg(&gb32);
        b.arg(&qsl).arg(&sl).arg(&bt).arg(&stride32).arg(&r32);
        b.arg(&spec.scale).arg(&window).arg(&chunk).arg(&cap);
        if num_splits == 0 {
            b.arg(&sinks_p);
        } else {
            b.arg(&splits32);
        }
        let cfg = LaunchConfig {
            grid_dim: (
                u32_of("tokens", t)?,
                kv_heads as u32,
                (splits * num_splits.max(1)) as u32,
            ),
            block_dim: (ATTN_THREADS as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        // SAFETY: argument types and lengths match the kernel's signature; the kernel reads
        // only visible keys and bounds every cache read by the cache length.
        unsafe { b.launch(cfg) }?;
        if num_splits > 0 {
            let f = self.function("paged_attention_merge")?;
            let Some(mut b) = self.launcher(f)? else {
                return Ok(());
            };
            b.arg(&first_out)
                .arg(&op)
                .arg(&heads32)
                .arg(&d32)
                .arg(&splits32)
                .arg(&sinks_p);
            let cfg = LaunchConfig {
                grid_dim: (u32_of("tokens", t)?, heads as u32, 1),
                block_dim: (d.next_multiple_of(32) as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: part holds t x heads x num_splits x (d + 2) values as the split pass
            // wrote them; out holds t x heads x d.
            unsafe { b.launch(cfg) }?;
        }
        drop(part_ptr);
        drop(scratch);
        Ok(())
    }
}

/// How a paged-attention launch covers a kv head's query heads.
struct AttnPlan {
    /// Query heads per block.
    group_block: usize,
    /// Blocks per kv head (grid z without key splits).
    group_splits: usize,
}

/// Checks paged attention's arguments; the head-group blocking.
fn check_attention(
    q: &impl DevicePtr<f32>,
    out: &impl DevicePtrMut<f32>,
    strides: &KvStrides,
    meta: &PagedMeta<'_>,
    spec: &AttnParams<'_>,
) -> Result<AttnPlan> {
    let (heads, kv_heads, d) = (spec.num_heads, spec.num_kv_heads, spec.head_dim);
    ensure(
        kv_heads > 0 && heads > 0 && heads.is_multiple_of(kv_heads),
        || format!("paged_attention: {heads} heads over {kv_heads} kv heads"),
    )?;
    ensure(d > 0 && d <= MAX_HEAD_DIM, || {
        format!("paged_attention: head_dim {d} outside 1..={MAX_HEAD_DIM}")
    })?;
    ensure(
        strides.num_kv_heads == kv_heads && strides.head_dim == d,
        || {
            format!(
                "paged_attention: cache strides are for {} kv heads of {}, the layer has {kv_heads} of {d}",
                strides.num_kv_heads, strides.head_dim
            )
        },
    )?;
    ensure(strides.block_size > 0, || {
        "paged_attention: block_size is 0".into()
    })?;
    let t = meta.num_tokens;
    ensure(
        q.len() == t * heads * d && out.len() == t * heads * d,
        || {
            format!(
                "paged_attention: q {} and out {} values, want {t} x {heads} x {d}",
                q.len(),
                out.len()
            )
        },
    )?;
    let r = meta.num_reqs;
    ensure(
        meta.query_start_loc.len() > r
            && meta.seq_lens.len() >= r
            && meta.block_table.len() >= r * meta.table_stride,
        || {
            format!(
                    "paged_attention: {r} requests need query_start_loc {} > {r}, seq_lens {} >= {r}, block_table {} >= {r} x {}",
                    meta.query_start_loc.len(),
                    meta.seq_lens.len(),
                    meta.block_table.len(),
                    meta.table_stride
                )
        },
    )?;
    ensure(r > 0 || t == 0, || {
        "paged_attention: tokens without requests".into()
    })?;
    ensure(spec.sliding_window != Some(0), || {
        "paged_attention: window 0".into()
    })?;
    ensure(spec.chunk_size != Some(0), || {
        "paged_attention: chunk 0".into()
    })?;
    ensure(spec.soft_cap.is_none_or(|c| c > 0.0), || {
        format!(
            "paged_attention: soft cap {:?} is not positive",
            spec.soft_cap
        )
    })?;
    if let Some(s) = &spec.sinks {
        ensure(s.len() == heads, || {
            format!("paged_attention: {} sinks for {heads} heads", s.len())
        })?;
    }
    let group = heads / kv_heads;
    let group_block = group.min(ATTN_THREADS * ATTN_ACC / d).max(1);
    let group_splits = group.div_ceil(group_block);
    ensure(
        kv_heads <= GRID_YZ && group_splits <= GRID_YZ && heads <= GRID_YZ,
        || format!("paged_attention: {heads} heads over {kv_heads} kv heads"),
    )?;
    Ok(AttnPlan {
        group_block,
        group_splits,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn attention_splits_only_small_grids_over_long_contexts() {
        // SmolLM2 decode at batch 1 (3 kv heads): 512 keys in 8 splits of 64, 3000 in 32.
        assert_eq!(auto_attention_splits(3, 132, 512, None), 8);
        assert_eq!(auto_attention_splits(3, 132, 3000, None), AUTO_SPLITS);
        // Short or unknown contexts, windows and chunks of at most 256 keys: no split.
        assert_eq!(auto_attention_splits(3, 132, 16, None), 1);
        assert_eq!(auto_attention_splits(3, 132, 256, None), 1);
        assert_eq!(auto_attention_splits(3, 132, 0, None), 1);
        assert_eq!(auto_attention_splits(3, 132, 4000, Some(128)), 1);
        assert_eq!(auto_attention_splits(3, 132, 4000, Some(1024)), 16);
        // Enough blocks already: none; nearly enough: a few.
        assert_eq!(auto_attention_splits(264, 132, 4000, None), 1);
        assert_eq!(auto_attention_splits(100, 132, 4000, None), 3);
        assert_eq!(auto_attention_splits(0, 132, 4000, None), 1);
        for blocks in 1..300 {
            for keys in [0usize, 100, 257, 1000, 100_000] {
                let s = auto_attention_splits(blocks, 132, keys, None);
                assert!((1..=AUTO_SPLITS).contains(&s));
                assert!(s == 1 || s * SPLIT_KEYS <= keys.next_multiple_of(SPLIT_KEYS));
            }
        }
    }

    #[test]
    fn attention_shared_memory_fits_48k() {
        for d in [64usize, 80, 96, 128, 192, 256] {
            for group in [1usize, 2, 4, 7, 8, 16, 32] {
                let gb = group.min(ATTN_THREADS * ATTN_ACC / d).max(1);
                let shared = 8 * ATTN_TILE
                    + 4 * (2 * ATTN_TILE * (d + 1) + gb * d + gb * ATTN_TILE + 3 * gb);
                assert!(shared <= 48 * 1024, "d {d} group {group}: {shared}");
                assert!(gb * d <= ATTN_THREADS * ATTN_ACC);
            }
        }
    }
}
