//! The flash kernel's group step on AMX-BF16 tiles, at the opt-in `amx-bf16` level: an
//! item's query rows (rounded to bf16 once per item) times a group's keys on the tiles
//! give every row's scores; the online-softmax step is the vector one
//! ([`softmax_run`]); the probabilities, rounded to bf16, times the group's values on the
//! tiles give what each row's accumulator gains.
//!
//! Every row gets the same results in any item, batch or chunk, and alone:
//! - a score is one tile element from its query row and its key alone, the same
//!   instructions over the head dimension wherever they run; a capture's probabilities
//!   are computed with the same tile scores (`kernels::dots`);
//! - along the keys of the weighted sum, a key sits at its position modulo 32 within
//!   32-key chunks that start at multiples of 32 (its group's first key rounded down), so
//!   a row's non-zero probabilities meet the same values in the same tile slots whatever
//!   range of keys the group spans; the slots of keys it does not see hold zeros, and
//!   products of zeros leave a sum unchanged (tested in `lantern_quant::bf16_tiles`). The
//!   values of keys a row does not see are multiplied by its zeros: a value that is not
//!   finite (an overflowed model) makes those products NaN.
//!
//! Groups are at least 256 keys (`TILE_GROUP_KEYS`): whole tile columns, and the tiles'
//! fixed costs spread over many keys.

use lantern_quant::bf16_tiles::{TileColumns, TileRows, TileSession, CHUNK};

use super::{
    axpy, find_spans, same_start_run, softmax_run, Ctx, Partial, RowSpan, WorkItem, SOFTMAX_ROWS,
};
use crate::backends::RequestView;

/// This thread's operands and outputs of the tile products (kept between items).
#[derive(Default)]
pub(super) struct TileScratch {
    queries: TileRows,
    keys: TileColumns,
    probabilities: TileRows,
    values: TileColumns,
    scores: Vec<f32>,
    weighted: Vec<f32>,
    spans: Vec<RowSpan>,
}

/// Rounds `item`'s query rows (in its [`Partial`]'s order: token by token, the group's
/// heads in each) for all its groups.
pub(super) fn prepare(ctx: &Ctx<'_>, item: &WorkItem, scratch: &mut TileScratch) {
    let layer = ctx.layer;
    let (d, group_heads) = (layer.head_dim, layer.group_size());
    let queries = &mut scratch.queries;
    queries.reshape((item.rows.1 - item.rows.0) * group_heads, d);
    for (ti, row) in (item.rows.0..item.rows.1).enumerate() {
        for j in 0..group_heads {
            let h = item.kv_head * group_heads + j;
            let q_row = &ctx.q[(row * layer.num_heads + h) * d..][..d];
            queries.set_whole_row(ti * group_heads + j, 0, q_row);
        }
    }
}

/// One group's online-softmax step for every row of `item` that sees some of its keys
/// `start..end` (`k_tile`, `v_tile`: their rows in f32), after [`prepare`], in a session
/// for the item's rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn update(
    tiles: &TileSession,
    ctx: &Ctx<'_>,
    item: &WorkItem,
    req: &RequestView<'_>,
    (start, end): (usize, usize),
    (k_tile, v_tile): (&[f32], &[f32]),
    scratch: &mut TileScratch,
    state: &mut Partial,
) {
    let layer = ctx.layer;
    let d = layer.head_dim;
    let n = end - start;
    let TileScratch {
        queries,
        keys,
        probabilities,
        values,
        scores,
        weighted,
        spans,
    } = scratch;
    find_spans(layer, item, req, (start, end), spans);
    if spans.is_empty() {
        return;
    }
    keys.set_from_rows(&k_tile[..n * d], d);
    let ldo = keys.stored_columns();
    let scores = fitted(scores, queries.stored_rows() * ldo);
    tiles.product(queries, keys, scores, ldo);

    let base = start / CHUNK * CHUNK;
    // Rows that see none of these keys are left as they were: their sums are not read.
    probabilities.reshape(queries.rows(), end - base);
    values.reset(d, end - base);
    values.set_k_rows(start - base, &v_tile[..n * d]);
    let mut first = 0;
    while first < spans.len() {
        let runs = &spans[first..first + same_start_run(&spans[first..])];
        let rows = scores[runs[0].state * ldo..].chunks_exact_mut(ldo);
        let mut p: [&mut [f32]; SOFTMAX_ROWS] = Default::default();
        for ((p, s), row) in p.iter_mut().zip(runs).zip(rows) {
            *p = &mut row[s.lo - start..s.hi - start];
        }
        softmax_run(ctx, runs, &mut p, state);
        for (s, p) in runs.iter().zip(&p) {
            probabilities.set_whole_row(s.state, s.lo - base, p);
        }
        first += runs.len();
    }
    let ldv = values.stored_columns();
    let weighted = fitted(weighted, probabilities.stored_rows() * ldv);
    tiles.product(probabilities, values, weighted, ldv);
    for s in spans.iter() {
        axpy(
            &mut state.acc[s.state * d..][..d],
            1.0,
            &weighted[s.state * ldv..][..d],
        );
    }
}

/// The first `len` values of `buf`, grown to hold them.
fn fitted(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    &mut buf[..len]
}
