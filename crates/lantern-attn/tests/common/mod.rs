//! Test helpers: random batches over shuffled paged block tables, a runner that writes
//! earlier steps' context into a cache and calls a backend, and a dense attention
//! oracle in f64 that knows nothing about pages, layouts or the crate's mask code.

#![allow(dead_code)]

use std::sync::Arc;

use lantern_attn::{
    round_to_dtype, slot_for_position, AttentionBackend, AttentionLayerSpec, AttentionMetadata,
    AttnError, CacheGeometry, CommonAttentionMetadata, Device, KvCacheLayout, KvCacheShape,
    LayerKvCache, PagedKvCache, ScheduledSeq, Tensor,
};
use lantern_kv::{BlockId, KvDtype};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// One request of a batch: tokens already cached, tokens computed this step.
#[derive(Debug, Clone, Copy)]
pub struct Req {
    pub num_computed: usize,
    pub query_len: usize,
}

impl Req {
    pub fn seq_len(&self) -> usize {
        self.num_computed + self.query_len
    }
}

/// A batch with all its values.
#[derive(Debug, Clone)]
pub struct Batch {
    pub reqs: Vec<Req>,
    pub block_size: usize,
    pub num_blocks: usize,
    pub tables: Vec<Vec<BlockId>>,
    /// Per request, K and V of the cached context, `[num_computed, kv_heads, head_dim]`.
    pub ctx_k: Vec<Vec<f32>>,
    pub ctx_v: Vec<Vec<f32>>,
    /// This step's q `[tokens, heads, head_dim]`, k and v `[tokens, kv_heads, head_dim]`.
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

fn uniform(rng: &mut StdRng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

/// A batch with random values whose block tables draw ids without replacement from a
/// shuffled pool `extra_blocks` larger than needed.
pub fn make_batch(
    seed: u64,
    layer: &AttentionLayerSpec,
    block_size: usize,
    reqs: &[Req],
    extra_blocks: usize,
) -> Batch {
    let mut rng = StdRng::seed_from_u64(seed);
    let needed: Vec<usize> = reqs
        .iter()
        .map(|r| r.seq_len().div_ceil(block_size))
        .collect();
    let num_blocks = needed.iter().sum::<usize>() + extra_blocks;
    let mut pool: Vec<BlockId> = (0..num_blocks as BlockId).collect();
    pool.shuffle(&mut rng);
    let mut tables = Vec::new();
    for n in needed {
        tables.push(pool.drain(..n).collect());
    }
    let row = layer.num_kv_heads * layer.head_dim;
    let tokens: usize = reqs.iter().map(|r| r.query_len).sum();
    Batch {
        reqs: reqs.to_vec(),
        block_size,
        num_blocks,
        tables,
        ctx_k: reqs
            .iter()
            .map(|r| uniform(&mut rng, r.num_computed * row))
            .collect(),
        ctx_v: reqs
            .iter()
            .map(|r| uniform(&mut rng, r.num_computed * row))
            .collect(),
        q: uniform(&mut rng, tokens * layer.num_heads * layer.head_dim),
        k: uniform(&mut rng, tokens * row),
        v: uniform(&mut rng, tokens * row),
    }
}

/// Every layout worth testing: both shapes in identity and HND order, plus `extra`.
pub fn layouts(extra: &[[usize; 5]]) -> Vec<KvCacheLayout> {
    let mut out = Vec::new();
    for shape in [KvCacheShape::KvFirst, KvCacheShape::BlocksFirst] {
        out.push(KvCacheLayout::contiguous(shape));
        out.push(KvCacheLayout::hnd(shape));
        for &order in extra {
            out.push(KvCacheLayout::new(shape, order).unwrap());
        }
    }
    out
}

/// Writes the context of every request into a fresh cache (as earlier steps would
/// have), builds the step's metadata and runs `backend`. Returns the output and cache.
pub fn run_backend(
    backend: &dyn AttentionBackend,
    layer: &AttentionLayerSpec,
    batch: &Batch,
    dtype: KvDtype,
    slot_window: Option<usize>,
) -> Result<(Vec<f32>, PagedKvCache), AttnError> {
    run_backend_with(backend, layer, batch, dtype, slot_window, |common| {
        Ok(backend.build_metadata(common))
    })
}

/// [`run_backend`] with the step's metadata built by `build` from the common metadata.
pub fn run_backend_with(
    backend: &dyn AttentionBackend,
    layer: &AttentionLayerSpec,
    batch: &Batch,
    dtype: KvDtype,
    slot_window: Option<usize>,
    build: impl FnOnce(Arc<CommonAttentionMetadata>) -> Result<AttentionMetadata, AttnError>,
) -> Result<(Vec<f32>, PagedKvCache), AttnError> {
    let geom = CacheGeometry {
        num_blocks: batch.num_blocks,
        block_size: batch.block_size,
        num_kv_heads: layer.num_kv_heads,
        head_dim: layer.head_dim,
    };
    let mut cache = PagedKvCache::new(geom, backend.kv_cache_layout(), dtype)?;
    for (r, req) in batch.reqs.iter().enumerate() {
        let slots: Vec<i64> = (0..req.num_computed)
            .map(|p| slot_for_position(&batch.tables[r], batch.block_size, p).unwrap())
            .collect();
        cache.write(&batch.ctx_k[r], &batch.ctx_v[r], &slots)?;
    }
    let seqs: Vec<ScheduledSeq<'_>> = batch
        .reqs
        .iter()
        .zip(&batch.tables)
        .map(|(r, t)| ScheduledSeq {
            num_computed_tokens: r.num_computed,
            num_scheduled_tokens: r.query_len,
            block_table: t,
            slot_window,
        })
        .collect();
    let common = CommonAttentionMetadata::build(&seqs, batch.block_size)?;
    let meta = build(Arc::new(common))?;
    let out = forward_slices(
        backend, layer, &meta, &batch.q, &batch.k, &batch.v, &mut cache,
    )?;
    Ok((out, cache))
}

/// `values` as a CPU tensor of rows of `heads x dim` (`[rows, heads, dim]`), or 1-D when
/// its length is not a whole number of rows, so the backend's shape check sees it.
pub fn rows_tensor(values: &[f32], heads: usize, dim: usize) -> Tensor {
    let row = heads * dim;
    if values.len().is_multiple_of(row) {
        Tensor::from_vec(
            values.to_vec(),
            (values.len() / row, heads, dim),
            &Device::Cpu,
        )
    } else {
        Tensor::from_vec(values.to_vec(), values.len(), &Device::Cpu)
    }
    .unwrap()
}

/// `backend.forward` on host buffers: q, k, v become tensors shaped by `layer`, the
/// output comes back as host values.
pub fn forward_slices(
    backend: &dyn AttentionBackend,
    layer: &AttentionLayerSpec,
    meta: &AttentionMetadata,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    cache: &mut dyn LayerKvCache,
) -> Result<Vec<f32>, AttnError> {
    let d = layer.head_dim;
    let out = backend.forward(
        layer,
        meta,
        &rows_tensor(q, layer.num_heads, d),
        &rows_tensor(k, layer.num_kv_heads, d),
        &rows_tensor(v, layer.num_kv_heads, d),
        cache,
    )?;
    Ok(out.flatten_all().unwrap().to_vec1().unwrap())
}

/// The mask, written out by hand from its definition (not the crate's).
fn visible(layer: &AttentionLayerSpec, q: usize, k: usize) -> bool {
    // `q - k` only where causal: a key after the query would underflow it.
    let causal = k <= q;
    let window = || layer.sliding_window.is_none_or(|w| q - k < w);
    let chunk = layer.chunk_size.is_none_or(|c| q / c == k / c);
    causal && window() && chunk
}

/// Dense attention output with, per output row, the norm of `sum_i p_i |v_i|`: the
/// scale of the terms that were summed, which rounding errors are proportional to.
pub struct Dense {
    pub out: Vec<f64>,
    pub magnitude: Vec<f64>,
}

/// Dense attention in f64 over each request's full K/V (context then step tokens,
/// rounded to `dtype` as a cache of that type would hold them).
pub fn dense_attention(layer: &AttentionLayerSpec, batch: &Batch, dtype: KvDtype) -> Dense {
    let (h_n, kvh, d) = (layer.num_heads, layer.num_kv_heads, layer.head_dim);
    let row = kvh * d;
    let mut out = Vec::with_capacity(batch.q.len());
    let mut magnitude = Vec::new();
    let mut t0 = 0;
    for (r, req) in batch.reqs.iter().enumerate() {
        let mut keys = batch.ctx_k[r].clone();
        keys.extend_from_slice(&batch.k[t0 * row..(t0 + req.query_len) * row]);
        let mut values = batch.ctx_v[r].clone();
        values.extend_from_slice(&batch.v[t0 * row..(t0 + req.query_len) * row]);
        round_to_dtype(&mut keys, dtype);
        round_to_dtype(&mut values, dtype);
        for i in 0..req.query_len {
            let pos = req.num_computed + i;
            for h in 0..h_n {
                let g = h / (h_n / kvh);
                let q = &batch.q[((t0 + i) * h_n + h) * d..][..d];
                let mut logits = Vec::new();
                for j in 0..req.seq_len() {
                    if !visible(layer, pos, j) {
                        continue;
                    }
                    let kr = &keys[(j * kvh + g) * d..][..d];
                    let raw: f64 = q.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mut s = raw * layer.scale as f64;
                    if let Some(cap) = layer.logits_soft_cap {
                        s = cap as f64 * (s / cap as f64).tanh();
                    }
                    logits.push((j, s));
                }
                let sink = layer.sinks.as_ref().map(|s| s[h] as f64);
                let m = logits
                    .iter()
                    .map(|x| x.1)
                    .chain(sink)
                    .fold(f64::NEG_INFINITY, f64::max);
                let denom: f64 = logits.iter().map(|x| (x.1 - m).exp()).sum::<f64>()
                    + sink.map_or(0.0, |s| (s - m).exp());
                let mut o = vec![0f64; d];
                let mut mag = vec![0f64; d];
                for &(j, s) in &logits {
                    let p = (s - m).exp() / denom;
                    let vr = &values[(j * kvh + g) * d..][..d];
                    for ((x, a), y) in o.iter_mut().zip(mag.iter_mut()).zip(vr) {
                        *x += p * *y as f64;
                        *a += p * (*y as f64).abs();
                    }
                }
                out.extend(o);
                magnitude.push(mag.iter().map(|a| a * a).sum::<f64>().sqrt());
            }
        }
        t0 += req.query_len;
    }
    Dense { out, magnitude }
}

/// Largest per-row relative error: L2 norm of `got - expected` over each `head_dim`
/// row, divided by the larger of the expected row's norm and its magnitude (see
/// [`Dense`]). The magnitude keeps rows whose values cancel to almost zero (likely with
/// tiny head dims) from turning f32 rounding into a large "relative" error; it is
/// never zero, so nothing is compared against zero.
pub fn max_rel_error(got: &[f32], expected: &Dense, head_dim: usize) -> f64 {
    assert_eq!(got.len(), expected.out.len());
    assert!(got.iter().all(|x| x.is_finite()), "non-finite output");
    got.chunks(head_dim)
        .zip(expected.out.chunks(head_dim))
        .zip(&expected.magnitude)
        .map(|((g, e), mag)| {
            let diff: f64 = g
                .iter()
                .zip(e)
                .map(|(a, b)| (*a as f64 - b).powi(2))
                .sum::<f64>()
                .sqrt();
            let norm: f64 = e.iter().map(|b| b * b).sum::<f64>().sqrt();
            diff / norm.max(*mag).max(f64::MIN_POSITIVE)
        })
        .fold(0.0, f64::max)
}

/// Tolerance for comparing a backend with the dense oracle on the same (rounded) values:
/// only f32 arithmetic differs, whatever the cache type.
pub fn tolerance(dtype: KvDtype) -> f64 {
    match dtype {
        KvDtype::F32 => 1e-5,
        KvDtype::F16 | KvDtype::BF16 => 2e-5,
    }
}

/// A random permutation of 0..5.
pub fn random_order(seed: u64) -> [usize; 5] {
    let mut order = [0, 1, 2, 3, 4];
    order.shuffle(&mut StdRng::seed_from_u64(seed));
    order
}

pub fn rng(seed: u64) -> StdRng {
    StdRng::seed_from_u64(seed)
}

pub fn gen_usize(rng: &mut StdRng, range: std::ops::RangeInclusive<usize>) -> usize {
    rng.gen_range(range)
}

/// The batch made of request `r` of `batch` alone, same values and block table.
pub fn alone(
    batch: &Batch,
    r: usize,
    layer: &AttentionLayerSpec,
) -> (Batch, std::ops::Range<usize>) {
    let start: usize = batch.reqs[..r].iter().map(|q| q.query_len).sum();
    let tokens = start..start + batch.reqs[r].query_len;
    let (qrow, kvrow) = (
        layer.num_heads * layer.head_dim,
        layer.num_kv_heads * layer.head_dim,
    );
    let rows = |x: &[f32], w: usize| x[tokens.start * w..tokens.end * w].to_vec();
    let single = Batch {
        reqs: vec![batch.reqs[r]],
        block_size: batch.block_size,
        num_blocks: batch.num_blocks,
        tables: vec![batch.tables[r].clone()],
        ctx_k: vec![batch.ctx_k[r].clone()],
        ctx_v: vec![batch.ctx_v[r].clone()],
        q: rows(&batch.q, qrow),
        k: rows(&batch.k, kvrow),
        v: rows(&batch.v, kvrow),
    };
    (single, tokens)
}
