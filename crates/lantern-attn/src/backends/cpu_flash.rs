//! `cpu-flash`: the default CPU backend. Tiled online softmax over the paged cache,
//! multi-threaded, f32/f16/bf16 caches.
//!
//! Work is cut into items of (request, kv head, tile of query tokens, range of keys), run
//! on the calling thread when a layer's attention is tiny, else on the calling thread
//! and `lantern_quant`'s helper threads, which run the matrix products too (the caller
//! works instead of parking, and the helpers are awake between a layer's parts):
//! - every item handles all query heads of one GQA group, so each K/V tile is read from
//!   the cache (and converted to f32) once for the whole group and all its query tokens;
//! - long prefills are cut into query tiles, so they spread over threads (tiles four
//!   times longer once a request's keys reach 1,024: an item converts its keys once for
//!   all its rows);
//! - long key ranges are split into pieces at fixed positions (multiples of
//!   `split_keys`, whole blocks) whose partial softmax states are merged afterwards in
//!   order (flash-decoding), so a few decodes over long contexts still use every thread.
//!
//! The cut depends only on a row's own positions, never on the rest of the batch or on the
//! thread count: a row gets bit-identical output alone or in any batch (batch invariance,
//! which makes greedy decoding independent of what else the server is running).
//!
//! Inside an item, keys are visited in groups of whole blocks (up to 32 KiB of keys: 128
//! at head dim 64, 32 at 256; groups start at multiples of that length), each group's K
//! and V gathered from its blocks through the block table and converted to f32 once. Each query row keeps a
//! running max `m`, a running sum `l` and an unnormalized output `acc`; a new group
//! rescales them by `exp(m_old - m_new)`. The sink joins only when a row is finalized, as
//! one more term of the denominator. Items of many rows (prefill tiles) take a group's
//! rows together at AVX2 and AVX-512 ([`update_rows`], `row_kernels`): the group's keys
//! transposed once, dot products two rows at a time, weighted values four at a time
//! (AVX-512), each row getting the same operations as alone, so the same bits. At the
//! opt-in `amx-bf16` level every item's scores and weighted values come from AMX-BF16
//! tiles instead (`tiles`: q, keys, probabilities and values rounded to bf16, groups of
//! at least 256 keys), batch and chunk invariant in the same way, and a capture's
//! probabilities use the same tile scores.
//!
//! Chunked-local layers run over the step's virtual batch ([`crate::local`]): each
//! virtual request lies inside one chunk, so the kernel needs no chunk mask, and a long
//! prefill over many chunks becomes many short requests that spread over threads.
//!
//! The default layout is `BlocksFirst` with the HND order, so one head's keys in a block
//! are one contiguous `block_size x head_dim` tile, read (and converted) in one pass.
//!
//! [`CpuFlashBackend::forward_with_probabilities`] also keeps chosen rows' logits as the
//! tiles compute them (for attention capture): each key's score is the same bits whatever
//! its tile (see `kernels::dots`), so once every tile has run, a row's logits turned into
//! probabilities over the whole row are exactly what capture computes from the keys.

use std::cell::RefCell;
use std::sync::{Mutex, OnceLock};

#[cfg(target_arch = "x86_64")]
use lantern_quant::bf16_tiles::Bf16Tiles;
use lantern_quant::share;

use crate::backend::{AttentionMetadata, CPU_FLASH};
use crate::backends::kernels::{
    axpy, dots, exp_shifted_sum, logits_and_rescale, probabilities_from_logits, scale,
    softmax_rows, weighted_sum, SOFTMAX_ROWS,
};
use crate::backends::row_kernels;
use crate::backends::{host_forward, load_step_row, HostAttention, KernelView, RequestView};
use crate::cache::{PagedKvCache, KEY, VALUE};
use crate::device::{LayerKvCache, Tensor};
use crate::error::AttnError;
use crate::layer::AttentionLayerSpec;
use crate::layout::{KvCacheLayout, KvCacheShape};
use crate::metadata::CommonAttentionMetadata;
use crate::tap::RowProbabilities;

#[cfg(target_arch = "x86_64")]
mod tiles;

/// How the flash backend cuts work into items.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlashTuning {
    /// Query tokens of one request per work item.
    pub query_tile: usize,
    /// Key ranges are cut at multiples of this many keys (rounded up to whole blocks).
    /// 256 rather than 512: a decode over a 512-key sliding window is then two or three
    /// pieces, not one, so it uses two threads.
    pub split_keys: usize,
}

impl Default for FlashTuning {
    fn default() -> Self {
        Self {
            query_tile: 16,
            split_keys: 256,
        }
    }
}

/// The tiled, multi-threaded CPU backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuFlashBackend {
    layout: KvCacheLayout,
    tuning: FlashTuning,
}

impl Default for CpuFlashBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl CpuFlashBackend {
    /// The backend with its default layout (`BlocksFirst`, HND order) and tuning.
    pub fn new() -> Self {
        Self {
            layout: KvCacheLayout::hnd(KvCacheShape::BlocksFirst),
            tuning: FlashTuning::default(),
        }
    }

    /// The backend declaring `layout` instead. Any valid layout is correct; layouts
    /// whose rows are not packed are slower (each tile is gathered).
    pub fn with_layout(layout: KvCacheLayout) -> Result<Self, AttnError> {
        layout.validate()?;
        Ok(Self {
            layout,
            tuning: FlashTuning::default(),
        })
    }

    /// The same backend with other tuning; every field must be non-zero.
    pub fn with_tuning(self, tuning: FlashTuning) -> Result<Self, AttnError> {
        if tuning.query_tile == 0 || tuning.split_keys == 0 {
            return Err(AttnError::Unsupported(format!(
                "flash tuning fields must be non-zero: {tuning:?}"
            )));
        }
        Ok(Self { tuning, ..self })
    }

    /// The tuning in use.
    pub fn tuning(&self) -> FlashTuning {
        self.tuning
    }

    /// [`AttentionBackend::forward`](crate::AttentionBackend::forward), also filling in
    /// `probabilities` (the batch rows it asks for: their probabilities for every query
    /// head over the keys each sees) from the logits the kernel computes anyway. Left
    /// unfilled on a chunked-local layer (its kernel runs over a virtual batch) or when
    /// it asks for no rows; the output is the same bits either way.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_with_probabilities(
        &self,
        layer: &AttentionLayerSpec,
        meta: &AttentionMetadata,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cache: &mut dyn LayerKvCache,
        probabilities: &mut RowProbabilities,
    ) -> Result<Tensor, AttnError> {
        probabilities.clear_filled();
        host_forward(
            self,
            layer,
            meta,
            (q, k, v),
            cache,
            |q, k, v, cache, out| {
                let wanted = layer.chunk_size.is_none() && !probabilities.rows().is_empty();
                self.forward_inner(
                    layer,
                    meta,
                    (q, k, v),
                    cache,
                    out,
                    wanted.then_some(&mut *probabilities),
                )
            },
        )
    }

    /// The forward, keeping `probabilities`' rows when given (a layer without a chunk).
    fn forward_inner(
        &self,
        layer: &AttentionLayerSpec,
        meta: &AttentionMetadata,
        (q, k, v): (&[f32], &[f32], &[f32]),
        cache: &mut PagedKvCache,
        out: &mut [f32],
        probabilities: Option<&mut RowProbabilities>,
    ) -> Result<(), AttnError> {
        // Chunked-local layers run as causal attention over the virtual batch.
        let view = KernelView::new(meta, layer)?;
        cache.write(k, v, &meta.common.slot_mapping)?;
        let (common, layer) = (view.common(), view.layer());
        let block_size = cache.geometry().block_size;
        let items = plan(common, layer, &self.tuning, block_size);
        let piece_len = self.tuning.split_keys.div_ceil(block_size) * block_size;
        let mut keep = probabilities
            .map(|p| Keep::new(common, layer, piece_len, p))
            .transpose()?;
        let ctx = Ctx {
            common,
            layer,
            cache,
            q,
            k,
            v,
            keep: keep.as_mut().map(Keep::target),
            #[cfg(target_arch = "x86_64")]
            tiles: Bf16Tiles::in_effect(),
        };
        let work: usize = items.iter().map(|it| it.multiply_adds(layer)).sum();
        let singles = Singles::new(&items, layer, out);
        let partials = run_items(&ctx, &items, Runner::for_work(work), Some(&singles));
        merge_and_store(&items, partials, layer, &singles);
        if let Some(keep) = &mut keep {
            keep.finish(layer);
        }
        Ok(())
    }
}

/// The rows whose logits a forward keeps: per batch row, its index among them.
struct Keep<'p> {
    index: Vec<u32>,
    probabilities: &'p mut RowProbabilities,
    /// Key ranges are cut at multiples of this (see [`split_keys`]).
    piece_len: usize,
}

/// What a work item needs to store a kept row's logits.
struct KeepTarget<'a> {
    index: &'a [u32],
    keys: &'a [std::ops::Range<usize>],
    offsets: &'a [usize],
    values: share::SharedMut<'a, f32>,
}

impl<'p> Keep<'p> {
    fn new(
        common: &CommonAttentionMetadata,
        layer: &AttentionLayerSpec,
        piece_len: usize,
        probabilities: &'p mut RowProbabilities,
    ) -> Result<Self, AttnError> {
        let tokens = common.num_actual_tokens;
        let mut index = vec![u32::MAX; tokens];
        let mut request = vec![0usize; tokens];
        for r in 0..common.num_reqs {
            let (a, b) = (common.query_start_loc[r], common.query_start_loc[r + 1]);
            request[a..b].fill(r);
        }
        for (i, &row) in probabilities.rows().iter().enumerate() {
            match index.get_mut(row) {
                Some(slot) if *slot == u32::MAX => *slot = i as u32,
                _ => {
                    return Err(AttnError::Unsupported(format!(
                        "probabilities asked twice or for row {row} of a {tokens}-row batch"
                    )))
                }
            }
        }
        probabilities.prepare(layer.num_heads, |row| {
            let req = RequestView::new(common, request[row]);
            layer.visible_key_range(req.position(row))
        });
        Ok(Self {
            index,
            probabilities,
            piece_len,
        })
    }

    fn target(&mut self) -> KeepTarget<'_> {
        let (values, keys, offsets) = self.probabilities.parts_mut();
        KeepTarget {
            index: &self.index,
            keys,
            offsets,
            values: share::SharedMut::new(values),
        }
    }

    /// Turns the logits of every kept row whose keys were split over several items
    /// (the others' items did it) into its probabilities, head by head.
    fn finish(&mut self, layer: &AttentionLayerSpec) {
        let num_heads = layer.num_heads;
        let piece_len = self.piece_len;
        let (values, keys, offsets) = self.probabilities.parts_mut();
        let split: Vec<usize> = (0..keys.len())
            .filter(|&i| {
                let k = &keys[i];
                !k.is_empty() && k.start / piece_len != (k.end - 1) / piece_len
            })
            .collect();
        let len: usize = split.iter().map(|&i| keys[i].len() * num_heads).sum();
        let values = share::SharedMut::new(values);
        let row = |s: usize| {
            let i = split[s];
            let n = keys[i].len();
            // SAFETY: row `i`'s values are its own.
            let row = unsafe { values.range(offsets[i], n * num_heads) };
            for (h, logits) in row.chunks_exact_mut(n.max(1)).enumerate() {
                probabilities_from_logits(layer, h, logits);
            }
        };
        if split.len() > 1 && len >= share::SERIAL_VALUES {
            share::run(split.len(), &row);
        } else {
            (0..split.len()).for_each(row);
        }
    }
}

impl KeepTarget<'_> {
    /// Where batch row `row`'s logits for query head `head` over key positions `lo..hi`
    /// go, if it is kept.
    ///
    /// # Safety
    /// No other thread writes the same row, head and keys meanwhile (work items cover
    /// disjoint heads or keys).
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot(&self, row: usize, head: usize, lo: usize, hi: usize) -> Option<&mut [f32]> {
        let i = *self.index.get(row)? as usize;
        let keys = self.keys.get(i)?;
        let start = self.offsets[i] + head * keys.len() + (lo - keys.start);
        // SAFETY: by the caller's promise.
        Some(unsafe { self.values.range(start, hi - lo) })
    }
}

impl HostAttention for CpuFlashBackend {
    fn host_name(&self) -> &'static str {
        CPU_FLASH
    }

    fn host_layout(&self) -> KvCacheLayout {
        self.layout
    }

    fn forward_host(
        &self,
        layer: &AttentionLayerSpec,
        meta: &AttentionMetadata,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        cache: &mut PagedKvCache,
        out: &mut [f32],
    ) -> Result<(), AttnError> {
        self.forward_inner(layer, meta, (q, k, v), cache, out, None)
    }
}

/// Where a layer's work items run. Which one does not change any result: each item is
/// computed whole by one thread, and partial states are merged in item order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Runner {
    /// The calling thread alone.
    Inline,
    /// The calling thread and `lantern_quant`'s shared helper threads.
    Shared,
}

impl Runner {
    fn for_work(multiply_adds: usize) -> Self {
        if multiply_adds < INLINE_WORK {
            Runner::Inline
        } else {
            Runner::Shared
        }
    }
}

/// The outputs of the items that are their output's only piece: stored by the thread
/// that ran the item (nothing to merge), so that the caller merges and stores only the
/// outputs of several pieces (a decode batch's are nearly all single: 96 a layer at
/// batch 32 for SmolLM2, which the engine thread used to store alone).
struct Singles<'a> {
    single: Vec<bool>,
    layer: &'a AttentionLayerSpec,
    out: share::SharedMut<'a, f32>,
}

impl<'a> Singles<'a> {
    fn new(items: &[WorkItem], layer: &'a AttentionLayerSpec, out: &'a mut [f32]) -> Self {
        // An output's pieces are consecutive items: a single one shares it with neither
        // neighbour.
        let single = (0..items.len())
            .map(|i| {
                let output = items[i].output;
                let before = i > 0 && items[i - 1].output == output;
                let after = items.get(i + 1).is_some_and(|next| next.output == output);
                !before && !after
            })
            .collect();
        Self {
            single,
            layer,
            out: share::SharedMut::new(out),
        }
    }

    /// `partial` stored when item `i` is its output's only piece (an empty state
    /// returned), else `partial` back for the merge.
    fn store_if_single(&self, items: &[WorkItem], i: usize, partial: Partial) -> Partial {
        if !self.single[i] {
            return partial;
        }
        store_rows(&items[i], &partial, self.layer, &self.out);
        Partial::default()
    }
}

fn run_items(
    ctx: &Ctx<'_>,
    items: &[WorkItem],
    runner: Runner,
    singles: Option<&Singles<'_>>,
) -> Vec<Partial> {
    let run = |i: usize| {
        let partial = with_scratch(|scratch| run_item(ctx, &items[i], scratch));
        match singles {
            Some(singles) => singles.store_if_single(items, i, partial),
            None => partial,
        }
    };
    match runner {
        Runner::Inline => (0..items.len()).map(run).collect(),
        Runner::Shared => {
            let slots: Vec<OnceLock<Partial>> = items.iter().map(|_| OnceLock::new()).collect();
            share::run(items.len(), &|i| {
                let _ = slots[i].set(run(i));
            });
            // `share::run` returns only once every item has run (it resumes a panic).
            slots
                .into_iter()
                .map(|s| s.into_inner().unwrap_or_default())
                .collect()
        }
    }
}

/// Multiply-adds of a layer's attention below which it runs on the calling thread: waking
/// any other thread costs more.
const INLINE_WORK: usize = 1 << 15;

/// Everything a work item reads.
struct Ctx<'a> {
    common: &'a CommonAttentionMetadata,
    layer: &'a AttentionLayerSpec,
    cache: &'a PagedKvCache,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    /// Rows whose logits are kept, if any.
    keep: Option<KeepTarget<'a>>,
    /// The bf16 tiles, at the opt-in `amx-bf16` level (`tiles`).
    #[cfg(target_arch = "x86_64")]
    tiles: Option<Bf16Tiles>,
}

impl Ctx<'_> {
    /// Whether items run on the bf16 tiles.
    fn on_tiles(&self) -> bool {
        #[cfg(target_arch = "x86_64")]
        return self.tiles.is_some();
        #[cfg(not(target_arch = "x86_64"))]
        false
    }
}

/// One unit of parallel work: the query rows `rows` (batch token indices) of request
/// `req`, all query heads of `kv_head`'s group, over the key positions `keys`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct WorkItem {
    req: usize,
    kv_head: usize,
    rows: (usize, usize),
    keys: (usize, usize),
    /// Items with the same `output` cover the same query rows and must be merged.
    output: usize,
}

impl WorkItem {
    /// An upper bound of its multiply-adds (scores and weighted values of every row of
    /// the group over every key of the range), for choosing how to run a layer.
    fn multiply_adds(&self, layer: &AttentionLayerSpec) -> usize {
        let rows = (self.rows.1 - self.rows.0) * layer.group_size();
        rows * (self.keys.1 - self.keys.0) * layer.head_dim * 2
    }
}

/// Cuts the batch into work items (see the module docs).
fn plan(
    common: &CommonAttentionMetadata,
    layer: &AttentionLayerSpec,
    tuning: &FlashTuning,
    block_size: usize,
) -> Vec<WorkItem> {
    // Query tiles with the union of their rows' visible key ranges. Visible ranges start
    // at a position that never decreases with the query position, so the union is
    // [start of the first row's range, last row + 1).
    let mut tiles = Vec::new();
    for r in 0..common.num_reqs {
        let req = RequestView::new(common, r);
        let query_tile = if req.tokens.1 > req.tokens.0
            && req.position(req.tokens.1 - 1) + 1 >= LONG_CONTEXT_KEYS
        {
            tuning.query_tile * LONG_CONTEXT_TILES
        } else {
            tuning.query_tile
        };
        let mut a = req.tokens.0;
        while a < req.tokens.1 {
            let b = (a + query_tile).min(req.tokens.1);
            let first = layer.visible_key_range(req.position(a)).start;
            tiles.push((r, (a, b), (first, req.position(b - 1) + 1)));
            a = b;
        }
    }
    let piece_len = tuning.split_keys.div_ceil(block_size) * block_size;
    let mut items = Vec::with_capacity(tiles.len() * layer.num_kv_heads);
    let mut output = 0;
    for (req, rows, keys) in tiles {
        let pieces = split_keys(keys, piece_len);
        for kv_head in 0..layer.num_kv_heads {
            for &keys in &pieces {
                items.push(WorkItem {
                    req,
                    kv_head,
                    rows,
                    keys,
                    output,
                });
            }
            output += 1;
        }
    }
    items
}

/// Requests whose keys reach this many take query tiles `LONG_CONTEXT_TILES` times the
/// tuning's: each item converts (and transposes) its piece of keys once for all its
/// rows, and a long context is read once per tile; such a request still gives many
/// items (its key ranges are cut into pieces). A 7,680-token SmolLM2 prefill ran ~1.5x
/// faster with tiles of 64 than of 16 (1 thread, Emerald Rapids).
const LONG_CONTEXT_KEYS: usize = 1024;
const LONG_CONTEXT_TILES: usize = 4;

/// Cuts `keys` at the multiples of `piece_len` (a whole number of blocks) inside it.
fn split_keys(keys: (usize, usize), piece_len: usize) -> Vec<(usize, usize)> {
    let mut pieces = Vec::new();
    let mut start = keys.0;
    while start < keys.1 {
        let end = ((start / piece_len + 1) * piece_len).min(keys.1);
        pieces.push((start, end));
        start = end;
    }
    pieces
}

/// Per-thread buffers for tiles converted to f32 and for one row's logits. Every value
/// an item reads from them it has written first.
#[derive(Default)]
struct Scratch {
    keys: Vec<f32>,
    values: Vec<f32>,
    logits: Vec<f32>,
    rows: RowsScratch,
    #[cfg(target_arch = "x86_64")]
    tiles: tiles::TileScratch,
}

thread_local! {
    /// This thread's scratch, kept between items, layers and steps: a decode step runs
    /// thousands of items, and zeroing fresh tiles for each cost more than some items.
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Runs `f` with this thread's scratch (its buffers grow to what an item needs, from a
/// 64-byte boundary: [`aligned`]).
fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with_borrow_mut(f)
}

/// Keys per online-softmax update: whole blocks, as many as keep one K tile within 8192
/// f32 (32 KiB: 128 keys at head dim 64, 32 at 256). Each update has a fixed cost (the
/// running maximum and sum reduced across lanes, the rescale, the calls) that a small
/// group does not amortize: at 4,096 tokens, groups of 128 keys took 15% less attention
/// time than groups of 64 (SmolLM2; 25% less for Gemma 3), though K and V of a group no
/// longer fit L1 together; groups of 256 took more (Emerald Rapids, 2 threads). Groups
/// start at multiples of this length, which depends only on the layer, so a row's keys
/// are grouped the same way whatever batch, chunk or item it is computed in. On the
/// tiles, at least [`TILE_GROUP_KEYS`].
fn group_len(block_size: usize, head_dim: usize, on_tiles: bool) -> usize {
    let mut keys = (8192 / head_dim.max(1)).max(1);
    if on_tiles {
        keys = keys.max(TILE_GROUP_KEYS);
    }
    (keys / block_size).max(1) * block_size
}

/// Keys per group on the bf16 tiles: a whole piece of keys (`split_keys`'s default), so a
/// tile product's fixed costs (configuring, storing its sums) and each row's
/// online-softmax update are spread over many keys: a 4,096-token SmolLM2 prefill ran
/// 1.41-1.43x the `amx` level's speed with groups of 256 and 1.12-1.28x with 64 (2
/// threads, Emerald Rapids).
const TILE_GROUP_KEYS: usize = 256;

/// Online-softmax state of an item's query rows (row `i * group + j` is the item's
/// `i`-th token and the `j`-th head of the group), not yet normalized.
#[derive(Debug, Default)]
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

fn run_item(ctx: &Ctx<'_>, item: &WorkItem, scratch: &mut Scratch) -> Partial {
    let layer = ctx.layer;
    let (d, group_heads) = (layer.head_dim, layer.group_size());
    let block_size = ctx.cache.geometry().block_size;
    let req = RequestView::new(ctx.common, item.req);
    let n_rows = (item.rows.1 - item.rows.0) * group_heads;
    let mut state = Partial {
        max: vec![f32::NEG_INFINITY; n_rows],
        sum: vec![0.0; n_rows],
        acc: vec![0.0; n_rows * d],
    };
    let Scratch {
        keys,
        values,
        logits,
        rows,
        #[cfg(target_arch = "x86_64")]
            tiles: tile_scratch,
    } = scratch;
    let group = group_len(block_size, d, ctx.on_tiles());
    let (keys, values) = (aligned(keys, group * d), aligned(values, group * d));
    let logits = aligned(logits, group);
    // One tile configuration for all the item's products (released when it ends).
    #[cfg(target_arch = "x86_64")]
    let session = ctx.tiles.map(|on| {
        tiles::prepare(ctx, item, tile_scratch);
        on.session(n_rows)
    });
    let all_rows = n_rows >= ROWS_AT_ONCE && row_kernels::pays(d);
    let mut start = item.keys.0;
    while start < item.keys.1 {
        let end = ((start / group + 1) * group).min(item.keys.1);
        let n = end - start;
        let (k_tile, v_tile) = (&mut keys[..n * d], &mut values[..n * d]);
        let mut pos = start;
        while pos < end {
            let bi = pos / block_size;
            let tile_end = ((bi + 1) * block_size).min(end);
            let block = req.table[bi] as usize;
            // The item's next block on its way from memory while this one is read (a
            // decode over a long context reads the whole cache each step), and its first
            // block asked for as it starts: a decode's items are pieces of 16 blocks, and
            // each first block read without the hint cost a long context's decode about
            // as much as the other fifteen (a block further ahead was slower; paired,
            // SmolLM2 after 4,096 tokens, Zen 4).
            if pos == item.keys.0 {
                prefetch_block(ctx, item, &req, bi, block_size);
            }
            if (bi + 1) * block_size < item.keys.1 {
                prefetch_block(ctx, item, &req, bi + 1, block_size);
            }
            let in_block = pos - bi * block_size..tile_end - bi * block_size;
            let rows = (pos - start) * d..(tile_end - start) * d;
            for (kv, dst) in [(KEY, &mut k_tile[rows.clone()]), (VALUE, &mut v_tile[rows])] {
                load_tile(
                    ctx,
                    &req,
                    kv,
                    block,
                    item.kv_head,
                    in_block.clone(),
                    pos,
                    dst,
                );
            }
            pos = tile_end;
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(session) = &session {
            let kv = (&k_tile[..], &v_tile[..]);
            tiles::update(
                session,
                ctx,
                item,
                &req,
                (start, end),
                kv,
                tile_scratch,
                &mut state,
            );
            start = end;
            continue;
        }
        if all_rows {
            let tiles = (&k_tile[..], &v_tile[..]);
            update_rows(ctx, item, &req, (start, end), tiles, rows, &mut state);
            start = end;
            continue;
        }
        for (ti, row) in (item.rows.0..item.rows.1).enumerate() {
            let visible = layer.visible_key_range(req.position(row));
            let (lo, hi) = (visible.start.max(start), visible.end.min(end));
            if lo >= hi {
                continue;
            }
            let (k_rows, v_rows) = (
                &k_tile[(lo - start) * d..(hi - start) * d],
                &v_tile[(lo - start) * d..(hi - start) * d],
            );
            for j in 0..group_heads {
                let h = item.kv_head * group_heads + j;
                let q_row = &ctx.q[(row * layer.num_heads + h) * d..][..d];
                let r = ti * group_heads + j;
                // SAFETY: this item alone covers this row's head `h` over `lo..hi`.
                let kept = ctx
                    .keep
                    .as_ref()
                    .and_then(|keep| unsafe { keep.slot(row, h, lo, hi) });
                update_row(
                    layer,
                    q_row,
                    k_rows,
                    v_rows,
                    &mut logits[..hi - lo],
                    kept,
                    &mut state.max[r],
                    &mut state.sum[r],
                    &mut state.acc[r * d..(r + 1) * d],
                );
            }
        }
        start = end;
    }
    if let Some(keep) = &ctx.keep {
        // Kept rows whose every key this item saw: their probabilities, here while the
        // logits are in cache (rows split over pieces are finished after every item).
        for row in item.rows.0..item.rows.1 {
            let visible = layer.visible_key_range(req.position(row));
            if visible.is_empty() || visible.start < item.keys.0 || visible.end > item.keys.1 {
                continue;
            }
            for j in 0..group_heads {
                let h = item.kv_head * group_heads + j;
                // SAFETY: this item alone covers this row's head `h`.
                if let Some(logits) = unsafe { keep.slot(row, h, visible.start, visible.end) } {
                    probabilities_from_logits(layer, h, logits);
                }
            }
        }
    }
    state
}

/// Query rows (tokens x heads of the group) of an item from which [`update_rows`] takes a
/// group's rows all at once: transposing the keys costs about what two rows' dot
/// products save, and decodes (one token, a group of 1-8 heads) stay on [`update_row`].
const ROWS_AT_ONCE: usize = 8;

/// [`update_rows`]' buffers: the group's keys transposed, every row's logits
/// (`stride` apart), and the rows that see some key of the group.
#[derive(Default)]
struct RowsScratch {
    transposed: Vec<f32>,
    logits: Vec<f32>,
    spans: Vec<RowSpan>,
}

/// A query row of an item and the keys of the current group it sees.
#[derive(Clone, Copy)]
struct RowSpan {
    /// Batch row.
    row: usize,
    /// Index in the item's [`Partial`].
    state: usize,
    /// Query head.
    head: usize,
    lo: usize,
    hi: usize,
}

/// The rows of `item` (every head of its group) that see some of the keys `start..end`,
/// with the part they see, into `spans` (in the item's [`Partial`] order).
fn find_spans(
    layer: &AttentionLayerSpec,
    item: &WorkItem,
    req: &RequestView<'_>,
    (start, end): (usize, usize),
    spans: &mut Vec<RowSpan>,
) {
    let group_heads = layer.group_size();
    spans.clear();
    for (ti, row) in (item.rows.0..item.rows.1).enumerate() {
        let visible = layer.visible_key_range(req.position(row));
        let (lo, hi) = (visible.start.max(start), visible.end.min(end));
        if lo < hi {
            spans.extend((0..group_heads).map(|j| RowSpan {
                row,
                state: ti * group_heads + j,
                head: item.kv_head * group_heads + j,
                lo,
                hi,
            }));
        }
    }
}

/// One group's online-softmax step for every row of `item`: the same operations on
/// each row as [`update_row`], so the same bits, but the dot products come two rows at
/// a time from the group's keys transposed once (`row_kernels`), and rows whose keys
/// start at the same one (four at a time) take their softmax steps in one call and add
/// their weighted values together over the keys they all see.
fn update_rows(
    ctx: &Ctx<'_>,
    item: &WorkItem,
    req: &RequestView<'_>,
    (start, end): (usize, usize),
    (k_tile, v_tile): (&[f32], &[f32]),
    scratch: &mut RowsScratch,
    state: &mut Partial,
) {
    let layer = ctx.layer;
    let d = layer.head_dim;
    let n = end - start;
    let stride = n.next_multiple_of(row_kernels::KEYS);
    let RowsScratch {
        transposed,
        logits,
        spans,
    } = scratch;
    find_spans(layer, item, req, (start, end), spans);
    let kt = aligned(transposed, row_kernels::transposed_len(n, d));
    let logits = aligned(logits, spans.len() * stride);
    row_kernels::transpose_keys(&k_tile[..n * d], d, kt);
    let q_row = |s: &RowSpan| &ctx.q[(s.row * layer.num_heads + s.head) * d..][..d];
    // Every key of the group for each row (a key's score does not depend on which
    // others are computed); the rows then take the part they see.
    for (pair, out) in spans.chunks(2).zip(logits.chunks_mut(2 * stride)) {
        match pair {
            [a, b] => {
                let (out_a, out_b) = out.split_at_mut(stride);
                let outs = [&mut out_a[..n], &mut out_b[..n]];
                row_kernels::dots_pair([q_row(a), q_row(b)], kt, d, outs);
            }
            [a] => dots(q_row(a), &k_tile[..n * d], d, &mut out[..n]),
            _ => {}
        }
    }
    let mut first = 0;
    while first < spans.len() {
        let run = same_start_run(&spans[first..]);
        let runs = &spans[first..first + run];
        let run_logits = logits[first * stride..(first + run) * stride].chunks_exact_mut(stride);
        // The rows' probabilities over the keys each sees (empty past the run).
        let mut p: [&mut [f32]; SOFTMAX_ROWS] = Default::default();
        for ((p, s), row_logits) in p.iter_mut().zip(runs).zip(run_logits) {
            *p = &mut row_logits[s.lo - start..s.hi - start];
        }
        softmax_run(ctx, runs, &mut p, state);
        let accs = &mut state.acc[runs[0].state * d..(runs[0].state + run) * d];
        add_weighted_values(&p[..run], accs, &v_tile[(runs[0].lo - start) * d..], d);
        first += run;
    }
}

/// The online-softmax step of a run of rows ([`same_start_run`]) over their logits `p`
/// (past the run: empty), in one call, or one row at a time in a step that captures (it
/// keeps rows' logits); the same bits either way. Their accumulators are rescaled to the
/// new maxima.
fn softmax_run(
    ctx: &Ctx<'_>,
    runs: &[RowSpan],
    p: &mut [&mut [f32]; SOFTMAX_ROWS],
    state: &mut Partial,
) {
    let layer = ctx.layer;
    let d = layer.head_dim;
    let states = runs[0].state..runs[0].state + runs.len();
    let accs = &mut state.acc[states.start * d..states.end * d];
    if let Some(keep) = &ctx.keep {
        for ((s, p), acc) in runs.iter().zip(p.iter_mut()).zip(accs.chunks_exact_mut(d)) {
            // SAFETY: this item alone covers this row's head over `lo..hi`.
            let kept = unsafe { keep.slot(s.row, s.head, s.lo, s.hi) };
            let (max, sum) = (&mut state.max[s.state], &mut state.sum[s.state]);
            softmax_step(layer, p, kept, max, sum, acc);
        }
        return;
    }
    let mut max = [f32::NEG_INFINITY; SOFTMAX_ROWS];
    let mut sum = [0.0; SOFTMAX_ROWS];
    max[..runs.len()].copy_from_slice(&state.max[states.clone()]);
    sum[..runs.len()].copy_from_slice(&state.sum[states.clone()]);
    let alpha = softmax_rows(p, layer.scale, layer.logits_soft_cap, &mut max, &mut sum);
    state.max[states.clone()].copy_from_slice(&max[..runs.len()]);
    state.sum[states].copy_from_slice(&sum[..runs.len()]);
    for (acc, alpha) in accs.chunks_exact_mut(d).zip(alpha) {
        if alpha != 1.0 {
            scale(acc, alpha);
        }
    }
}

/// How many of `spans`' first rows (at most [`SOFTMAX_ROWS`]) go through a group's step
/// together: consecutive accumulators whose keys start at the same one (rows of one
/// token see the same keys, and on the diagonal a later token's row sees those and more).
fn same_start_run(spans: &[RowSpan]) -> usize {
    let first = spans[0];
    spans
        .iter()
        .take(SOFTMAX_ROWS)
        .enumerate()
        .take_while(|(i, s)| s.lo == first.lo && s.state == first.state + i)
        .count()
}

/// `acc[r] += p[r] · V` for rows whose keys start at the same one (`values`: from that
/// key on; `accs`: the rows' accumulators one after another): four rows at once over
/// the keys they all see, then each row's further keys (the same chain of multiply-adds,
/// continued), or row by row.
fn add_weighted_values(p: &[&mut [f32]], accs: &mut [f32], values: &[f32], d: usize) {
    match p {
        [p0, p1, p2, p3] => {
            let common = p.iter().map(|p| p.len()).min().unwrap_or(0);
            let (a0, rest) = accs.split_at_mut(d);
            let (a1, rest) = rest.split_at_mut(d);
            let (a2, a3) = rest.split_at_mut(d);
            let shared = [&p0[..common], &p1[..common], &p2[..common], &p3[..common]];
            row_kernels::weighted_sum_quad([a0, a1, a2, a3], shared, &values[..common * d], d);
            for (p, acc) in p.iter().zip(accs.chunks_exact_mut(d)) {
                if p.len() > common {
                    weighted_sum(acc, &p[common..], &values[common * d..p.len() * d], d);
                }
            }
        }
        few => {
            for (p, acc) in few.iter().zip(accs.chunks_exact_mut(d)) {
                weighted_sum(acc, p, &values[..p.len() * d], d);
            }
        }
    }
}

/// Grows `buf` to at least `len` floats (never shrinks it).
fn grow(buf: &mut Vec<f32>, len: usize) {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
}

/// `len` floats of `buf` (grown to hold them) from a 64-byte boundary: the kernels'
/// vector loads then never straddle two cache lines (aligned, the transposed keys' dot
/// products ran 20-30% faster, and a decode's one-row weighted sums up to 1.8x).
fn aligned(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    const LINE_FLOATS: usize = 64 / std::mem::size_of::<f32>();
    grow(buf, len + LINE_FLOATS);
    let start = buf.as_ptr().align_offset(64).min(LINE_FLOATS);
    &mut buf[start..start + len]
}

/// One online-softmax step for one query row over a tile's visible keys; the tile's
/// logits are copied to `kept` when given.
#[allow(clippy::too_many_arguments)]
#[inline]
fn update_row(
    layer: &AttentionLayerSpec,
    q_row: &[f32],
    k_rows: &[f32],
    v_rows: &[f32],
    logits: &mut [f32],
    kept: Option<&mut [f32]>,
    max: &mut f32,
    sum: &mut f32,
    acc: &mut [f32],
) {
    let d = q_row.len();
    dots(q_row, k_rows, d, logits);
    softmax_step(layer, logits, kept, max, sum, acc);
    weighted_sum(acc, logits, v_rows, d);
}

/// The part of an online-softmax step between the dot products and the weighted sum of
/// values: `logits` (one row's raw dot products with a tile's visible keys) become the
/// tile's unnormalized probabilities, the running maximum and sum move on, and `acc` is
/// rescaled to the new maximum. The logits are copied to `kept` when given.
#[inline]
fn softmax_step(
    layer: &AttentionLayerSpec,
    logits: &mut [f32],
    kept: Option<&mut [f32]>,
    max: &mut f32,
    sum: &mut f32,
    acc: &mut [f32],
) {
    let (new_max, alpha) = logits_and_rescale(logits, layer.scale, layer.logits_soft_cap, *max);
    if let Some(kept) = kept {
        kept.copy_from_slice(logits);
    }
    if alpha != 1.0 {
        scale(acc, alpha);
    }
    *sum = *sum * alpha + exp_shifted_sum(logits, new_max);
    *max = new_max;
}

/// Asks for the item's keys and values in its `bi`-th block of the request's table (its
/// rows up to the item's last key) to be fetched into the caches.
fn prefetch_block(
    ctx: &Ctx<'_>,
    item: &WorkItem,
    req: &RequestView<'_>,
    bi: usize,
    block_size: usize,
) {
    let first = bi * block_size;
    let rows = 0..(item.keys.1 - first).min(block_size);
    let block = req.table[bi] as usize;
    for kv in [KEY, VALUE] {
        ctx.cache
            .prefetch_rows(kv, block, item.kv_head, rows.clone());
    }
}

/// Rows `in_block` of one head's K or V in `block`, as f32, into `dst`. Rows of step
/// tokens that were not written (padding slots) come from the step's inputs. `first_pos`
/// is the position of the first row.
#[allow(clippy::too_many_arguments)]
fn load_tile(
    ctx: &Ctx<'_>,
    req: &RequestView<'_>,
    kv: usize,
    block: usize,
    head: usize,
    in_block: std::ops::Range<usize>,
    first_pos: usize,
    dst: &mut [f32],
) {
    let n = in_block.len();
    let d = ctx.layer.head_dim;
    ctx.cache
        .load_rows_unchecked(kv, block, head, in_block, dst);
    if req.any_padded(first_pos..first_pos + n) {
        let src = if kv == KEY { ctx.k } else { ctx.v };
        for (i, row_buf) in dst.chunks_exact_mut(d).enumerate() {
            if let Some(row) = req.padded_step_row(first_pos + i) {
                load_step_row(
                    src,
                    row,
                    head,
                    ctx.layer.num_kv_heads,
                    ctx.cache.dtype(),
                    row_buf,
                );
            }
        }
    }
}

/// Merges the partial states of items that share an output (key-range splits),
/// normalizes with the layer's sinks, and writes the rows into `out`.
fn merge_and_store(
    items: &[WorkItem],
    partials: Vec<Partial>,
    layer: &AttentionLayerSpec,
    singles: &Singles<'_>,
) {
    // Consecutive items with the same output: one output's key-range pieces (those of one
    // piece were stored as they ran).
    let mut outputs: Vec<std::ops::Range<usize>> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        match outputs.last_mut() {
            Some(last) if items[last.start].output == item.output => last.end = i + 1,
            _ => outputs.push(i..i + 1),
        }
    }
    outputs.retain(|pieces| !singles.single[pieces.start]);
    if outputs.is_empty() {
        return;
    }
    let values: usize = outputs
        .iter()
        .map(|p| (items[p.start].rows.1 - items[p.start].rows.0) * layer.group_size())
        .sum::<usize>()
        * layer.head_dim;
    let runner = if outputs.len() > 1 && values >= MERGE_SERIAL_VALUES {
        Runner::Shared
    } else {
        Runner::Inline
    };
    // One task per output, which alone locks its pieces (the locks only make them `Sync`).
    let partials: Vec<Mutex<Partial>> = partials.into_iter().map(Mutex::new).collect();
    let out = &singles.out;
    let store = |o: usize| {
        let pieces = outputs[o].clone();
        let Some((first, rest)) = partials.get(pieces.clone()).and_then(<[_]>::split_first) else {
            return;
        };
        let Ok(mut merged) = first.lock() else { return };
        // Each piece is freed by the thread that merged it, not by the caller after the
        // last output (hundreds of buffers a layer at prefill, freed one by one).
        for next in rest {
            if let Ok(mut next) = next.lock() {
                merge_into(&mut merged, &next, layer.head_dim);
                drop(std::mem::take(&mut *next));
            }
        }
        store_rows(&items[pieces.start], &merged, layer, out);
        drop(std::mem::take(&mut *merged));
    };
    match runner {
        Runner::Inline => (0..outputs.len()).for_each(store),
        Runner::Shared => share::run(outputs.len(), &store),
    }
}

/// Below this many output values the outputs are merged and stored on the calling thread:
/// a decode batch's outputs (SmolLM2 at batch 32: 18K values in 96 outputs of one row)
/// are too small to share (measured 3.6% slower shared at 2^14; 2-core Zen 4); a 512-token
/// prefill's (295K) gained ~4.6%.
const MERGE_SERIAL_VALUES: usize = 1 << 16;

/// Normalizes an output's merged state into its rows of `out`.
fn store_rows(
    item: &WorkItem,
    merged: &Partial,
    layer: &AttentionLayerSpec,
    out: &share::SharedMut<'_, f32>,
) {
    let (d, group) = (layer.head_dim, layer.group_size());
    for (ti, row) in (item.rows.0..item.rows.1).enumerate() {
        for j in 0..group {
            let h = item.kv_head * group + j;
            let r = ti * group + j;
            // SAFETY: this (row, head) belongs to this output alone, whose pieces one
            // thread merges and stores.
            let dst = unsafe { out.range((row * layer.num_heads + h) * d, d) };
            finalize_row(
                merged.max[r],
                merged.sum[r],
                &merged.acc[r * d..(r + 1) * d],
                layer.sink_logit(h),
                dst,
            );
        }
    }
}

/// Folds `other` into `into`: both are online-softmax states over disjoint keys.
fn merge_into(into: &mut Partial, other: &Partial, d: usize) {
    for r in 0..into.max.len() {
        let (m1, m2) = (into.max[r], other.max[r]);
        let m = m1.max(m2);
        if m == f32::NEG_INFINITY {
            continue;
        }
        let (a1, a2) = ((m1 - m).exp(), (m2 - m).exp());
        into.sum[r] = into.sum[r] * a1 + other.sum[r] * a2;
        let acc = &mut into.acc[r * d..(r + 1) * d];
        scale(acc, a1);
        axpy(acc, a2, &other.acc[r * d..(r + 1) * d]);
        into.max[r] = m;
    }
}

/// `acc / sum`, with the sink (if any) as one more term of the denominator.
fn finalize_row(max: f32, sum: f32, acc: &[f32], sink: Option<f32>, dst: &mut [f32]) {
    let (max_all, sum_all, acc_scale) = match sink {
        Some(s) => {
            let m = max.max(s);
            let a = (max - m).exp();
            (m, sum * a + (s - m).exp(), a)
        }
        None => (max, sum, 1.0),
    };
    if max_all == f32::NEG_INFINITY || sum_all == 0.0 {
        dst.fill(0.0);
        return;
    }
    let inv = acc_scale / sum_all;
    for (o, a) in dst.iter_mut().zip(acc) {
        *o = a * inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::ScheduledSeq;

    #[test]
    fn groups_are_whole_blocks_within_32_kib_of_keys() {
        assert_eq!(group_len(16, 64, false), 128);
        assert_eq!(group_len(16, 128, false), 64);
        assert_eq!(group_len(16, 256, false), 32);
        assert_eq!(group_len(4, 80, false), 100);
        // At least one block, however large.
        assert_eq!(group_len(64, 256, false), 64);
        assert_eq!(group_len(16, 16384, false), 16);
        // On the tiles, at least 256 keys (whole blocks).
        assert_eq!(group_len(16, 64, true), 256);
        assert_eq!(group_len(16, 8, true), 1024);
        assert_eq!(group_len(100, 256, true), 200);
    }

    /// The metadata of requests of `(computed, scheduled)` tokens, each with blocks of its
    /// own (in reverse order, so gathering follows the table), and the blocks in all.
    fn batch(lens: &[(usize, usize)], block_size: usize) -> (CommonAttentionMetadata, usize) {
        let tables: Vec<Vec<u32>> = {
            let mut next = 0u32;
            lens.iter()
                .map(|&(c, q)| {
                    let n = (c + q).div_ceil(block_size) as u32;
                    next += n;
                    (next - n..next).rev().collect()
                })
                .collect()
        };
        let num_blocks = tables.iter().map(|t| t.len()).sum::<usize>();
        let seqs: Vec<ScheduledSeq<'_>> = lens
            .iter()
            .zip(&tables)
            .map(|(&(c, q), t)| ScheduledSeq {
                num_computed_tokens: c,
                num_scheduled_tokens: q,
                block_table: t,
                slot_window: None,
            })
            .collect();
        let common = CommonAttentionMetadata::build(&seqs, block_size).unwrap();
        (common, num_blocks)
    }

    /// Both ways of running a layer's items give the same partial states bit for
    /// bit, on a batch of decodes and chunked prefills over many groups and pieces.
    #[test]
    fn every_runner_gives_the_same_partials() {
        let layer = AttentionLayerSpec::new(6, 2, 64);
        let block_size = 16;
        let lens: [(usize, usize); 4] = [(700, 1), (30, 45), (300, 200), (0, 77)];
        let (common, num_blocks) = batch(&lens, block_size);
        let geom = crate::layout::CacheGeometry {
            num_blocks,
            block_size,
            num_kv_heads: 2,
            head_dim: 64,
        };
        let mut cache = PagedKvCache::new(
            geom,
            KvCacheLayout::hnd(KvCacheShape::BlocksFirst),
            lantern_kv::KvDtype::F16,
        )
        .unwrap();
        let value = |i: usize| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.8;
        let all_slots: Vec<i64> = (0..num_blocks as i64 * block_size as i64).collect();
        let row = 2 * 64;
        let kv: Vec<f32> = (0..all_slots.len() * row).map(value).collect();
        cache.write(&kv, &kv, &all_slots).unwrap();
        let t = common.num_actual_tokens;
        let q: Vec<f32> = (0..t * 6 * 64).map(|i| value(i + 17)).collect();
        let step_kv: Vec<f32> = (0..t * row).map(|i| value(i + 3)).collect();
        // The vector kernels, and the bf16 tiles where this CPU has them (given to the
        // items directly: forcing the level would reach the other tests' threads).
        #[cfg(target_arch = "x86_64")]
        let kinds = [None, Bf16Tiles::on_this_cpu()];
        #[cfg(not(target_arch = "x86_64"))]
        let kinds = [()];
        for kind in kinds {
            let ctx = Ctx {
                common: &common,
                layer: &layer,
                cache: &cache,
                q: &q,
                k: &step_kv,
                v: &step_kv,
                keep: None,
                #[cfg(target_arch = "x86_64")]
                tiles: kind,
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = kind;
            let items = plan(&common, &layer, &FlashTuning::default(), block_size);
            assert!(items.len() > 10);
            let inline = run_items(&ctx, &items, Runner::Inline, None);
            let shared = run_items(&ctx, &items, Runner::Shared, None);
            for (a, b) in inline.iter().zip(&shared) {
                assert_eq!(a.max, b.max);
                assert_eq!(a.sum, b.sum);
                assert_eq!(a.acc, b.acc);
            }
            assert!(inline.iter().all(|p| p.acc.iter().any(|&x| x != 0.0)));
        }
    }

    /// The probabilities `forward_with_probabilities` keeps are, bit for bit, what
    /// `row_probabilities` gives each row from the keys read back from the cache (what
    /// capture computes when finalizing), for decodes and rows of chunked prefills whose
    /// keys span several tiles and pieces, on plain, soft-capped, sink and sliding-window
    /// layers, at head dims with and without a tail; and the output is the same bits as
    /// the plain forward's. Fresh random inputs on every run.
    #[test]
    fn kept_probabilities_equal_row_probabilities_from_the_cache() {
        use crate::backend::{AttentionBackend, DECODE_THRESHOLD};
        use crate::backends::kernels::row_probabilities;
        use crate::device::{host_f32, tensor3, Device};
        use rand::{Rng, SeedableRng};
        use std::sync::Arc;
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let block_size = 16;
        // (computed, scheduled): decodes over one piece and over several, prefill chunks.
        let lens: [(usize, usize); 5] = [(700, 1), (30, 45), (300, 21), (0, 77), (90, 1)];
        let (common, num_blocks) = batch(&lens, block_size);
        let common = Arc::new(common);
        let meta = AttentionMetadata::new(common.clone(), DECODE_THRESHOLD);
        let t = common.num_actual_tokens;
        // Batch rows asked for, and each one's request: all of request 0 and 4 (decodes),
        // some rows of each prefill.
        let starts = &common.query_start_loc;
        let mut asked: Vec<(usize, usize)> = vec![(starts[0], 0), (starts[4], 4)];
        for r in 1..4 {
            for row in starts[r]..starts[r + 1] {
                if rng.gen_bool(0.3) {
                    asked.push((row, r));
                }
            }
        }
        for d in [64, 80] {
            let mut plain = AttentionLayerSpec::new(6, 2, d);
            plain.scale = rng.gen_range(0.05..0.5);
            let mut capped = plain.clone();
            capped.logits_soft_cap = Some(rng.gen_range(5.0..30.0));
            capped.sinks = Some((0..6).map(|_| rng.gen_range(-2.0..4.0)).collect());
            let mut sliding = plain.clone();
            sliding.sliding_window = Some(rng.gen_range(20..200));
            for (name, layer) in [("plain", plain), ("capped", capped), ("sliding", sliding)] {
                let geom = crate::layout::CacheGeometry {
                    num_blocks,
                    block_size,
                    num_kv_heads: 2,
                    head_dim: d,
                };
                let backend = CpuFlashBackend::new();
                let mut caches: Vec<_> = (0..2)
                    .map(|_| {
                        backend
                            .allocate_cache(geom, lantern_kv::KvDtype::F16)
                            .unwrap()
                    })
                    .collect();
                let row = 2 * d;
                let all_slots: Vec<i64> = (0..(num_blocks * block_size) as i64).collect();
                let kv: Vec<f32> = (0..all_slots.len() * row)
                    .map(|_| rng.gen_range(-2.0..2.0))
                    .collect();
                for cache in &mut caches {
                    let cache: &mut PagedKvCache = cache.as_any_mut().downcast_mut().unwrap();
                    cache.write(&kv, &kv, &all_slots).unwrap();
                }
                let q: Vec<f32> = (0..t * 6 * d).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let step: Vec<f32> = (0..t * row).map(|_| rng.gen_range(-2.0..2.0)).collect();
                let cpu = Device::Cpu;
                let qt = tensor3(q.clone(), [t, 6, d], &cpu).unwrap();
                let kt = tensor3(step.clone(), [t, 2, d], &cpu).unwrap();
                let plain_out = backend
                    .forward(&layer, &meta, &qt, &kt, &kt, caches[0].as_mut())
                    .unwrap();
                let mut probs = RowProbabilities::default();
                probs.ask(asked.iter().map(|&(row, _)| row));
                let out = backend
                    .forward_with_probabilities(
                        &layer,
                        &meta,
                        &qt,
                        &kt,
                        &kt,
                        caches[1].as_mut(),
                        &mut probs,
                    )
                    .unwrap();
                assert_eq!(
                    host_f32(&out).unwrap().to_vec(),
                    host_f32(&plain_out).unwrap().to_vec(),
                    "seed {seed} {name} d {d}: the output changed"
                );
                assert!(probs.is_filled());
                let cache: &PagedKvCache = caches[1].as_any().downcast_ref().unwrap();
                for (i, &(row, r)) in asked.iter().enumerate() {
                    let req = RequestView::new(&common, r);
                    let pos = req.position(row);
                    let visible = layer.visible_key_range(pos);
                    assert_eq!(probs.keys(i), visible, "seed {seed} {name} row {row}");
                    let slots: Vec<usize> = visible
                        .clone()
                        .map(|p| req.table[p / block_size] as usize * block_size + p % block_size)
                        .collect();
                    let mut keys = vec![0f32; slots.len() * row_len(d)];
                    cache.read_slots(&slots, &mut keys, None).unwrap();
                    for h in 0..6 {
                        let kv_head = layer.kv_head_for(h);
                        let head_keys: Vec<f32> = keys
                            .chunks_exact(d)
                            .skip(kv_head)
                            .step_by(2)
                            .flatten()
                            .copied()
                            .collect();
                        let q_row = &q[(row * 6 + h) * d..][..d];
                        let mut want = vec![f32::NAN; visible.len()];
                        row_probabilities(&layer, h, q_row, &head_keys, &mut want);
                        let got = probs.head(i, h);
                        let same = got
                            .iter()
                            .zip(&want)
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "seed {seed} {name} d {d} row {row} head {h}");
                    }
                }
            }
        }
        // A chunked-local layer's kernel runs over a virtual batch: nothing is kept.
        let mut chunked = AttentionLayerSpec::new(6, 2, 64);
        chunked.chunk_size = Some(32);
        let geom = crate::layout::CacheGeometry {
            num_blocks,
            block_size,
            num_kv_heads: 2,
            head_dim: 64,
        };
        let backend = CpuFlashBackend::new();
        let mut cache = backend
            .allocate_cache(geom, lantern_kv::KvDtype::F32)
            .unwrap();
        let cpu = Device::Cpu;
        let qt = tensor3(vec![0.5; t * 6 * 64], [t, 6, 64], &cpu).unwrap();
        let kt = tensor3(vec![0.25; t * 2 * 64], [t, 2, 64], &cpu).unwrap();
        let mut probs = RowProbabilities::default();
        probs.ask([0]);
        backend
            .forward_with_probabilities(&chunked, &meta, &qt, &kt, &kt, cache.as_mut(), &mut probs)
            .unwrap();
        assert!(!probs.is_filled());

        fn row_len(d: usize) -> usize {
            2 * d
        }
    }

    #[test]
    fn split_keys_cuts_at_fixed_positions_and_covers() {
        assert_eq!(split_keys((0, 10), 16), vec![(0, 10)]);
        assert_eq!(split_keys((0, 10), 4), vec![(0, 4), (4, 8), (8, 10)]);
        assert_eq!(split_keys((5, 10), 4), vec![(5, 8), (8, 10)]);
        let pieces = split_keys((3, 1000), 128);
        assert_eq!(pieces.first().unwrap().0, 3);
        assert_eq!(pieces.last().unwrap().1, 1000);
        for w in pieces.windows(2) {
            assert_eq!(w[0].1, w[1].0);
            assert_eq!(w[0].1 % 128, 0);
        }
    }
}
