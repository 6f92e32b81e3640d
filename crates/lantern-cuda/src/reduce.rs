//! The `reduce_rows` and `edit_logits` kernels' words: a row's reduction as the parameters
//! the kernel reads, its output read back into lantern-model's [`ReducedRow`], and logit
//! edits.

use lantern_model::{LogitEdit, ReducedRow, RowReduction, RowScore, SampleDraw, TokenChoice};

/// The kernel's marker for "none" (no given token, no score, no top entry).
const NONE: u32 = u32::MAX;

/// Words per row of the kernel's output for rows of up to `top_cap` alternatives.
pub fn reduce_stride(top_cap: usize) -> usize {
    3 + 2 * top_cap
}

/// Parameters per row.
pub const REDUCE_PARAMS: usize = 8;

/// `[1 / temperature, draw, given token, alternatives, top-k, top-p, min-p, 0]` (f32 as
/// bits; 0 and 0 for the argmax, NONE for no given token and no score, 0, 1 and 0 for no
/// cut).
pub fn reduce_params(want: &RowReduction) -> [u32; REDUCE_PARAMS] {
    let whole = SampleDraw::whole(0.0, 0.0);
    let (d, given) = match want.token {
        TokenChoice::Argmax => (whole, NONE),
        TokenChoice::Sample(d) => (d, NONE),
        TokenChoice::Given(t) => (whole, t),
    };
    let k = want
        .logprobs
        .map_or(NONE, |k| k.min(NONE as usize - 1) as u32);
    // top-k at or past u32::MAX keeps everything, as 0 does.
    let top_k = u32::try_from(d.top_k).unwrap_or(0);
    [
        d.inv_temperature.to_bits(),
        d.draw.to_bits(),
        given,
        k,
        top_k,
        d.top_p.to_bits(),
        d.min_p.to_bits(),
        0,
    ]
}

/// One row's output words (`reduce_stride` of them) as the reduction `want` asked for.
pub fn reduced_row(words: &[u32], want: &RowReduction) -> ReducedRow {
    let score = want.logprobs.map(|k| {
        let top = words[3..]
            .chunks_exact(2)
            .take(k)
            .take_while(|pair| pair[0] != NONE)
            .map(|pair| (pair[0], f32::from_bits(pair[1])))
            .collect();
        RowScore {
            logprob: f32::from_bits(words[2]),
            rank: words[1] as usize,
            top,
        }
    });
    ReducedRow {
        token: words[0],
        score,
    }
}

/// The `edit_logits` kernel's six words of each edit.
pub fn edit_words(edits: &[LogitEdit]) -> Vec<u32> {
    edits
        .iter()
        .flat_map(|e| {
            [
                e.row,
                e.token,
                e.repetition.to_bits(),
                e.subtract.to_bits(),
                e.add.to_bits(),
                u32::from(e.suppress),
            ]
        })
        .collect()
}
