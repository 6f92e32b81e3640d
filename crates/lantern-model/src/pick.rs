//! Logits rows reduced where the logits are ([`RowPick`]): edited by penalties
//! ([`LogitEdit`]), then reduced to the token a request samples (argmax, or a draw from
//! what top-k, top-p and min-p keep: [`SampleDraw`]) and to the logprobs it asks for (the
//! token's, its rank, the most likely alternatives), so that a model on a device copies a
//! few numbers per row to the host instead of the vocabulary-wide row. The functions here
//! are the references a device's kernels are held to.

/// Most alternatives a reduced row gives ([`RowReduction::logprobs`]): OpenAI's limit on
/// `top_logprobs`; rows asking for more are taken whole.
pub const MAX_REDUCED_TOP_LOGPROBS: usize = 20;

/// What the caller wants of one logits row.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RowPick {
    /// The whole row, on the host.
    Whole,
    /// Only what [`RowReduction`] says ([`ReducedRow`]).
    Reduced(RowReduction),
}

impl RowPick {
    /// The row's argmax alone (greedy sampling).
    pub const ARGMAX: RowPick = RowPick::Reduced(RowReduction {
        token: TokenChoice::Argmax,
        logprobs: None,
    });

    /// Whether the row is reduced where the logits are.
    pub fn is_picked(self) -> bool {
        self != RowPick::Whole
    }
}

/// A row reduced to one token, and that token scored against the row if asked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowReduction {
    pub token: TokenChoice,
    /// The token's logprob and rank in the row's log-softmax, with this many most likely
    /// tokens (at most [`MAX_REDUCED_TOP_LOGPROBS`]); `None`: the token alone.
    pub logprobs: Option<usize>,
}

/// How a reduced row's token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum TokenChoice {
    /// Its argmax (the first on ties): greedy sampling.
    Argmax,
    /// The token a uniform draw picks from the row's softmax ([`SampleDraw`]).
    Sample(SampleDraw),
    /// A token known before the step (the next prompt token, for prompt logprobs); it
    /// must be inside the row.
    Given(u32),
}

/// What a reduced row gives back.
#[derive(Debug, Clone, PartialEq)]
pub struct ReducedRow {
    pub token: u32,
    /// Present when [`RowReduction::logprobs`] asked for it.
    pub score: Option<RowScore>,
}

/// A token scored against its row's log-softmax (after the row's edits, before any
/// temperature or cut).
#[derive(Debug, Clone, PartialEq)]
pub struct RowScore {
    pub logprob: f32,
    /// 1 + how many logits are larger than the token's.
    pub rank: usize,
    /// The most likely tokens with their logprobs: larger logits first, ties to the lower
    /// id.
    pub top: Vec<(u32, f32)>,
}

/// A change to one logit of a reduced row before it is reduced (penalties, logit bias,
/// stop tokens before `min_tokens`), in the host sampler's order: the repetition penalty,
/// then `subtract`, then `add`, then `suppress`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LogitEdit {
    /// The row's index among the step's logits rows.
    pub row: u32,
    pub token: u32,
    /// A positive logit is divided by it, another multiplied (1: unchanged).
    pub repetition: f32,
    /// Subtracted where not 0 (frequency and presence penalties).
    pub subtract: f32,
    /// Added where not 0 (logit bias).
    pub add: f32,
    /// The logit becomes -inf (a stop token before `min_tokens`).
    pub suppress: bool,
}

impl LogitEdit {
    /// An edit of no row, changing nothing (a graph step's padding).
    pub const NONE: LogitEdit = LogitEdit {
        row: u32::MAX,
        token: 0,
        repetition: 1.0,
        subtract: 0.0,
        add: 0.0,
        suppress: false,
    };

    /// The edited logit.
    pub fn apply(&self, logit: f32) -> f32 {
        let mut x = logit;
        if self.repetition != 1.0 {
            x = if x > 0.0 {
                x / self.repetition
            } else {
                x * self.repetition
            };
        }
        if self.subtract != 0.0 {
            x -= self.subtract;
        }
        if self.add != 0.0 {
            x += self.add;
        }
        if self.suppress {
            x = f32::NEG_INFINITY;
        }
        x
    }
}

/// Applies `edits` to `rows` (`[rows, width]`, the step's logits rows in order); edits of
/// rows or tokens outside them are ignored.
pub fn apply_edits(rows: &mut [f32], width: usize, edits: &[LogitEdit]) {
    for e in edits {
        let t = e.token as usize;
        let at = (e.row as usize).checked_mul(width).filter(|_| t < width);
        if let Some(logit) = at.and_then(|start| rows.get_mut(start + t)) {
            *logit = e.apply(*logit);
        }
    }
}

/// The reference reduction of one row (what a device's kernel is held to): the token
/// [`RowReduction::token`] chooses, scored with the log-sum-exp summed in f64.
pub fn reduce_row(row: &[f32], want: RowReduction) -> ReducedRow {
    let token = match want.token {
        TokenChoice::Argmax => first_max(row),
        TokenChoice::Sample(d) => sample_row(row, d),
        TokenChoice::Given(t) => t,
    };
    ReducedRow {
        token,
        score: want.logprobs.map(|k| score_token(row, token, k)),
    }
}

/// `token`'s logprob and rank in `row` and its `k` most likely tokens ([`RowScore`]); a
/// token outside the row has logprob -inf.
pub fn score_token(row: &[f32], token: u32, k: usize) -> RowScore {
    let max = row
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| f64::from(v - max).exp())
        .sum();
    let log_sum = max + sum.ln() as f32;
    let value = row.get(token as usize).copied();
    RowScore {
        logprob: value.map_or(f32::NEG_INFINITY, |v| v - log_sum),
        rank: 1 + value.map_or(0, |t| row.iter().filter(|&&v| v > t).count()),
        top: top_k(row, k)
            .into_iter()
            .map(|i| (i, row[i as usize] - log_sum))
            .collect(),
    }
}

/// The ids of the `k` largest values of `row` (NaN never), larger first, ties to the lower
/// id.
pub fn top_k(row: &[f32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    if k <= FEW {
        return top_few(row, k);
    }
    let mut ids: Vec<u32> = (0..row.len() as u32)
        .filter(|&i| !row[i as usize].is_nan())
        .collect();
    // No NaN left: every pair compares (and -0 equals 0, as on a device).
    let by_desc = |a: &u32, b: &u32| {
        row[*b as usize]
            .partial_cmp(&row[*a as usize])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(b))
    };
    let k = k.min(ids.len());
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, by_desc);
        ids.truncate(k);
    }
    ids.sort_unstable_by(by_desc);
    ids
}

/// Up to this many alternatives (OpenAI's 20, and some), [`top_k`] keeps them in one pass.
const FEW: usize = 32;

/// [`top_k`] in one pass over the row, the best `k` kept in order as it goes: most values
/// fall below the k-th and cost one comparison, with no vocabulary-sized buffer.
fn top_few(row: &[f32], k: usize) -> Vec<u32> {
    let mut best: Vec<u32> = Vec::with_capacity(k + 1);
    let offer = |best: &mut Vec<u32>, i: usize| {
        let v = row[i];
        // A value equal to the k-th comes later in id order: it stays out (v is no NaN).
        if v.is_nan() || best.len() == k && v <= row[best[k - 1] as usize] {
            return;
        }
        let at = best.partition_point(|&b| row[b as usize] >= v);
        best.insert(at, i as u32);
        best.truncate(k);
    };
    // Once `k` are held, a chunk with no value above the k-th can change nothing: one
    // vector compare passes over it (almost every chunk of a vocabulary row).
    const CHUNK: usize = 64;
    let mut chunks = row.chunks_exact(CHUNK);
    for (n, c) in (&mut chunks).enumerate() {
        if best.len() == k {
            let kth = row[best[k - 1] as usize];
            if !above(c, kth) {
                continue;
            }
        }
        for i in n * CHUNK..(n + 1) * CHUNK {
            offer(&mut best, i);
        }
    }
    for i in row.len() - chunks.remainder().len()..row.len() {
        offer(&mut best, i);
    }
    best
}

/// Whether any of `chunk`'s values (NaN never) is above `t`: the larger of each lane's
/// values first, in lanes that vectorize.
fn above(chunk: &[f32], t: f32) -> bool {
    const LANES: usize = 16;
    let mut top = [f32::NEG_INFINITY; LANES];
    for c in chunk.chunks_exact(LANES) {
        for i in 0..LANES {
            top[i] = if c[i] > top[i] { c[i] } else { top[i] };
        }
    }
    top.iter().fold(false, |any, &v| any | (v > t))
}

/// Sampling from the softmax of a row at a temperature, by inverse transform: weights
/// `exp((logit - max) / temperature)` (the most likely token's is 1), those below the cut
/// of top-k, top-p and min-p dropped ([`cut_weight`]), and the token where their running
/// sum, in id order, first passes `draw` times their total. The host sampler picks the
/// same way from the same draw of the request's random stream; only the order of a
/// device's sums differs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleDraw {
    /// Uniform in [0, 1).
    pub draw: f32,
    /// 1 / temperature (> 0).
    pub inv_temperature: f32,
    /// Keep the `top_k` largest weights (0: all).
    pub top_k: usize,
    /// Keep the largest weights whose mass reaches `top_p` of what top-k kept (1: all).
    pub top_p: f32,
    /// Keep weights of at least `min_p` (0: all).
    pub min_p: f32,
}

impl SampleDraw {
    /// A draw from the whole softmax at `1 / inv_temperature`: nothing cut.
    pub fn whole(draw: f32, inv_temperature: f32) -> Self {
        Self {
            draw,
            inv_temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        }
    }

    /// Whether top-k, top-p or min-p may cut weights.
    pub fn truncates(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }
}

/// The smallest weight a token keeps under top-k, top-p and min-p, as values: top-k keeps
/// the weights of at least the `top_k`-th largest; top-p then the weights of at least the
/// largest value `y` whose tokens (weights >= y) hold `top_p` of what top-k kept; min-p
/// the weights of at least `min_p`. Tokens tied at a cut are all kept (as vLLM's masks
/// keep them). NaN weights are none.
pub fn cut_weight(weights: &[f32], d: &SampleDraw) -> f32 {
    let mut sorted: Vec<f32> = weights.iter().copied().filter(|w| !w.is_nan()).collect();
    sorted.sort_unstable_by(|a, b| b.total_cmp(a));
    let mut floor = 0.0f32;
    if d.top_k > 0 && d.top_k < sorted.len() {
        floor = sorted[d.top_k - 1];
        sorted.retain(|&w| w >= floor);
    }
    if d.top_p < 1.0 {
        // Summed in f64: over a large vocabulary an f32 running sum drifts by more than
        // the smallest weights it adds.
        let total: f64 = sorted.iter().map(|&w| f64::from(w)).sum();
        let target = f64::from(d.top_p) * total;
        let mut cumulative = 0.0f64;
        if let Some(&y) = sorted.iter().find(|&&w| {
            cumulative += f64::from(w);
            cumulative >= target
        }) {
            floor = y;
        }
    }
    floor.max(d.min_p)
}

/// [`SampleDraw`]'s token of `row`, summed in id order (the reference a device's kernel
/// is held to). A row whose sums fall short of the threshold (rounding, or no finite
/// logit) gives its argmax, as the host sampler does.
pub fn sample_row(row: &[f32], d: SampleDraw) -> u32 {
    let max = row
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f32> = row
        .iter()
        .map(|&v| ((v - max) * d.inv_temperature).exp())
        .collect();
    let floor = if d.truncates() {
        cut_weight(&weights, &d)
    } else {
        0.0
    };
    walk_weights(&weights, floor, d.draw).unwrap_or_else(|| first_max(row))
}

/// Weights summed a chunk at a time by [`walk_weights`].
const WALK_CHUNK: usize = 256;

/// The id where the running sum of the kept weights (`w >= floor`; NaN never), in id
/// order, first passes `draw` (in [0, 1)) times their total; `None` when no weight is
/// kept. Summed a chunk at a time (in lanes that vectorize), then walked one weight at a
/// time only in the chunk where the draw falls: the host sampler and this reference walk
/// the same way, so they pick the same token from the same weights.
pub fn walk_weights(weights: &[f32], floor: f32, draw: f32) -> Option<u32> {
    let sums: Vec<f32> = weights
        .chunks(WALK_CHUNK)
        .map(|c| kept_sum(c, floor))
        .collect();
    let total: f32 = sums.iter().sum();
    let mut threshold = draw * total;
    for (n, (chunk, &sum)) in weights.chunks(WALK_CHUNK).zip(&sums).enumerate() {
        if threshold >= sum {
            threshold -= sum;
            continue;
        }
        for (i, &w) in chunk.iter().enumerate() {
            if w >= floor {
                if threshold < w {
                    return Some((n * WALK_CHUNK + i) as u32);
                }
                threshold -= w;
            }
        }
    }
    None
}

/// The sum of `chunk`'s weights of at least `floor`, in 16 lanes and then the rest.
fn kept_sum(chunk: &[f32], floor: f32) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let mut lanes = chunk.chunks_exact(LANES);
    for c in &mut lanes {
        for i in 0..LANES {
            acc[i] += if c[i] >= floor { c[i] } else { 0.0 };
        }
    }
    let rest = lanes.remainder().iter().filter(|&&w| w >= floor);
    rest.fold(acc.iter().sum::<f32>(), |s, &w| s + w)
}

/// The first index of the largest value (NaN never wins).
pub fn first_max(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] || row[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Draws spread over [0, 1) pick each token as often as its softmax probability
    /// says, at two temperatures; the lowest draw picks the first token of mass.
    #[test]
    fn draws_pick_tokens_in_proportion_to_the_softmax() {
        let row = [1.0f32, -2.0, 0.5, 3.0, f32::NEG_INFINITY, 0.0];
        for temperature in [1.0f32, 0.5] {
            let inv_temperature = 1.0 / temperature;
            let weights: Vec<f64> = row
                .iter()
                .map(|&v| (((v - 3.0) * inv_temperature) as f64).exp())
                .collect();
            let total: f64 = weights.iter().sum();
            let n = 100_000;
            let mut counts = [0usize; 6];
            for i in 0..n {
                let draw = (i as f32 + 0.5) / n as f32;
                counts[sample_row(&row, SampleDraw::whole(draw, inv_temperature)) as usize] += 1;
            }
            for (id, &c) in counts.iter().enumerate() {
                let want = weights[id] / total;
                let got = c as f64 / n as f64;
                assert!(
                    (got - want).abs() < 1e-3,
                    "token {id}: {got} against {want}"
                );
            }
            assert_eq!(counts[4], 0, "a token of -inf is never sampled");
            let first = SampleDraw::whole(0.0, inv_temperature);
            assert_eq!(sample_row(&row, first), 0);
        }
    }

    #[test]
    fn a_row_without_mass_gives_its_argmax() {
        let d = SampleDraw::whole(0.5, 1.0);
        assert_eq!(sample_row(&[f32::NEG_INFINITY; 3], d), 0);
        assert_eq!(sample_row(&[f32::NAN, 2.0, f32::NAN], d), 1);
        assert_eq!(first_max(&[1.0, 3.0, 3.0]), 1);
    }

    /// Top-k, top-p and min-p cut by value (ties at a cut all kept), and draws spread
    /// over [0, 1) pick each kept token as often as its share of the kept weights.
    #[test]
    fn cuts_keep_values_and_draws_follow_the_kept_weights() {
        let row = [2.0f32, 0.0, 2.0, 1.0, -1.0, f32::NAN, 1.0];
        let weights: Vec<f32> = row.iter().map(|&v| (v - 2.0).exp()).collect();
        let cut = |top_k, top_p, min_p| {
            let d = SampleDraw {
                top_k,
                top_p,
                min_p,
                ..SampleDraw::whole(0.0, 1.0)
            };
            let floor = cut_weight(&weights, &d);
            (0..row.len())
                .filter(|&i| weights[i] >= floor)
                .collect::<Vec<_>>()
        };
        assert_eq!(cut(1, 1.0, 0.0), [0, 2], "the tie at the top-k cut is kept");
        assert_eq!(cut(3, 1.0, 0.0), [0, 2, 3, 6]);
        assert_eq!(cut(0, 0.5, 0.0), [0, 2], "the two ones hold over half");
        assert_eq!(cut(0, 0.75, 0.0), [0, 2, 3, 6]);
        assert_eq!(cut(0, 1.0, 0.3), [0, 2, 3, 6]);
        assert_eq!(cut(0, 1.0, 0.5), [0, 2]);
        assert_eq!(cut(5, 0.99, 0.0), [0, 1, 2, 3, 6]);
        let d = SampleDraw {
            top_k: 3,
            ..SampleDraw::whole(0.0, 1.0)
        };
        let kept = [0usize, 2, 3, 6];
        let total: f64 = kept.iter().map(|&i| weights[i] as f64).sum();
        let n = 100_000;
        let mut counts = [0usize; 7];
        for i in 0..n {
            let draw = (i as f32 + 0.5) / n as f32;
            counts[sample_row(&row, SampleDraw { draw, ..d }) as usize] += 1;
        }
        for (id, &c) in counts.iter().enumerate() {
            let want = if kept.contains(&id) {
                weights[id] as f64 / total
            } else {
                0.0
            };
            let got = c as f64 / n as f64;
            assert!(
                (got - want).abs() < 1e-3,
                "token {id}: {got} against {want}"
            );
        }
    }

    /// A seed from the clock (for a failing test to name) and an xorshift stream from it.
    fn fresh_stream() -> (u64, impl FnMut() -> u64) {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            | 1;
        let mut s = seed;
        let next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        (seed, next)
    }

    /// The chunked walk picks the token whose span of the kept weights' running sum (in
    /// f64) holds the draw, on fresh weights of vocabularies small and large (where a
    /// running f32 subtraction drifts by whole tokens), with cuts, zeros and NaN.
    #[test]
    fn walked_weights_cover_the_draw() {
        let (seed, mut next) = fresh_stream();
        let mut unit = || (next() >> 40) as f32 / (1u64 << 24) as f32;
        for n in [1usize, 7, 255, 256, 257, 5000, 262_144] {
            let weights: Vec<f32> = (0..n)
                .map(|i| match i % 97 {
                    5 => f32::NAN,
                    9 => 0.0,
                    _ => (unit() * 12.0 - 12.0).exp(),
                })
                .collect();
            for floor in [0.0, 1e-3] {
                let kept: Vec<f64> = weights
                    .iter()
                    .map(|&w| if w >= floor { f64::from(w) } else { 0.0 })
                    .collect();
                let total: f64 = kept.iter().sum();
                for draw in [0.0, unit(), unit(), 0.999_99] {
                    let Some(t) = walk_weights(&weights, floor, draw) else {
                        assert_eq!(total, 0.0, "n {n}, seed {seed}: nothing picked");
                        continue;
                    };
                    let t = t as usize;
                    assert!(kept[t] > 0.0, "n {n}: token {t} is not kept");
                    let before = kept[..t].iter().sum::<f64>() / total;
                    let after = before + kept[t] / total;
                    let d = f64::from(draw);
                    assert!(
                        before <= d + 1e-6 && d - 1e-6 <= after,
                        "n {n}, floor {floor}, seed {seed}: token {t} spans [{before}, {after}), \
                         the draw is {d}"
                    );
                }
            }
        }
        assert_eq!(walk_weights(&[0.0, f32::NAN], 0.0, 0.5), None);
    }

    /// The one-pass top-k of a few gives the ids the sort gives (ties to the lower id,
    /// NaN never, -0 equal to 0).
    #[test]
    fn top_few_is_the_sorted_top() {
        // The ids by value, larger first, ties to the lower id, NaN left out.
        let sorted_top = |row: &[f32], k: usize| {
            let mut ids: Vec<u32> = (0..row.len() as u32)
                .filter(|&i| !row[i as usize].is_nan())
                .collect();
            ids.sort_by(|a, b| {
                row[*b as usize]
                    .partial_cmp(&row[*a as usize])
                    .unwrap()
                    .then(a.cmp(b))
            });
            ids.truncate(k);
            ids
        };
        let mut row: Vec<f32> = (0..5000u32)
            .map(|i| ((i * 7919 % 1013) as f32 / 101.0).sin())
            .collect();
        row[17] = f32::NAN;
        row[40] = 2.0;
        row[41] = 2.0;
        row[3] = -0.0;
        row[4] = 0.0;
        for k in [1, 2, 5, 20, 32] {
            assert_eq!(top_few(&row, k), sorted_top(&row, k), "top {k}");
        }
        assert_eq!(top_few(&[0.0, -0.0, f32::NAN], 3), vec![0, 1]);
        // Fresh random rows of every length around a chunk, with ties (values on a
        // coarse grid), NaNs and -inf, rising so that later chunks keep displacing the
        // held ones.
        let (seed, mut next) = fresh_stream();
        for len in (1..70).chain([4099, 20_000]) {
            let row: Vec<f32> = (0..len)
                .map(|i| match next() % 23 {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    r => (r % 7) as f32 + (i / 16) as f32 * 0.25,
                })
                .collect();
            for k in [1, 3, 16, 32] {
                let want = sorted_top(&row, k);
                assert_eq!(top_few(&row, k), want, "top {k} of {len}, seed {seed}");
            }
        }
        assert_eq!(top_k(&[1.0, f32::NAN], 0), Vec::<u32>::new());
    }
}
