//! Sampling parameters and the sampler.

use crate::error::RequestError;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::vocab_row;
use lantern_model::{LogitEdit, RowScore};

/// How one request picks its tokens and when it stops.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (1 keeps all).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 keeps all).
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one (0 keeps all).
    pub min_p: f32,
    /// Seed of the request's own random stream, for reproducible sampling.
    pub seed: Option<u64>,
    /// Tokens to generate at most; 0 runs the prompt only (its captures and prompt
    /// logits) and samples nothing.
    pub max_tokens: usize,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Extra token ids that end the request (the model's EOS always does unless ignored).
    /// Shared by the samples of one request.
    pub stop_token_ids: std::sync::Arc<[u32]>,
    /// Keep the logits of every prompt position (`[prompt_len, vocab]`, the last row being
    /// the one the first token is sampled from): scoring and teacher forcing in tests and
    /// offline use. Its memory grows with prompt × vocabulary; a server uses
    /// [`Self::prompt_logprobs`].
    pub prompt_logits: bool,
    /// Prompt logprobs with this many alternatives per token: each prompt row is reduced
    /// to [`PromptTokenLogprob`] as the step computes it, so a request keeps
    /// `prompt_len × (k + 1)` numbers, never a prompt × vocabulary table.
    pub prompt_logprobs: Option<usize>,
    /// OpenAI's `presence_penalty`: subtracted once from the logit of every token that
    /// occurs among the generated tokens. In [-2, 2]; 0 disables it.
    pub presence_penalty: f32,
    /// OpenAI's `frequency_penalty`: subtracted from a token's logit once per occurrence
    /// among the generated tokens. In [-2, 2]; 0 disables it.
    pub frequency_penalty: f32,
    /// vLLM/HF `repetition_penalty` over prompt and generated tokens: the logit of a token
    /// seen is divided by it when positive, multiplied when negative. > 0; 1 disables it.
    pub repetition_penalty: f32,
    /// Report log-probabilities of each sampled token and of this many most likely
    /// alternatives (0: the sampled token only). They are the log-softmax of the logits
    /// after penalties and before temperature, top-k, top-p and min-p.
    pub logprobs: Option<usize>,
    /// vLLM's `min_tokens`: until this many tokens are generated, end-of-sequence and
    /// stop token ids cannot be sampled (and stop strings are not matched).
    pub min_tokens: usize,
    /// OpenAI's `logit_bias`: added to a token's logit before sampling (with the
    /// penalties), each in [-100, 100].
    pub logit_bias: Vec<(u32, f32)>,
    /// Whether the text of the stop token (end-of-sequence or `stop_token_ids`) that
    /// ends the sequence is part of its text; the token itself always is part of its
    /// tokens. vLLM's `include_stop_str_in_output`: off, the text leaves it out.
    pub stop_token_text: bool,
    /// vLLM's `allowed_token_ids` and `bad_words`: tokens it may not sample, masked
    /// after the penalties (its logprobs are those before the mask).
    pub token_filter: crate::token_filter::TokenFilter,
    /// vLLM's `skip_special_tokens`: special tokens (end of turn, ...) have no text.
    pub skip_special_tokens: bool,
    /// Not sampling but carried with it: vLLM's `cache_salt`, part of the prefix-cache
    /// keys of the request's blocks, so that only requests with the same salt share
    /// them (tenants cannot learn each other's prompts from cache hits).
    pub cache_salt: Option<std::sync::Arc<str>>,
    /// Not sampling but carried with it: when the request finishes, its partial last
    /// block is kept for one request that continues its tokens (a beam search's next
    /// step), which then computes only its new tokens
    /// ([`lantern_kv::KvCacheManager::free_keeping_tail`]).
    pub keep_tail: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            max_tokens: 16,
            ignore_eos: false,
            stop_token_ids: std::sync::Arc::new([]),
            prompt_logits: false,
            prompt_logprobs: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logprobs: None,
            min_tokens: 0,
            logit_bias: Vec::new(),
            stop_token_text: false,
            token_filter: Default::default(),
            skip_special_tokens: true,
            cache_salt: None,
            keep_tail: false,
        }
    }
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        Self {
            temperature: 0.0,
            max_tokens,
            ..Self::default()
        }
    }

    /// Checks ranges; the message names the offending field.
    pub fn validate(&self) -> Result<(), RequestError> {
        let out_of_range = |field, expected, got: f32| {
            Err(RequestError::OutOfRange {
                field,
                expected,
                got: got.to_string(),
            })
        };
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return out_of_range("temperature", ">= 0", self.temperature);
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return out_of_range("top_p", "in (0, 1]", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return out_of_range("min_p", "in [0, 1]", self.min_p);
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return out_of_range(name, "in [-2, 2]", value);
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return out_of_range("repetition_penalty", "> 0", self.repetition_penalty);
        }
        if self.min_tokens > self.max_tokens {
            return Err(RequestError::OutOfRange {
                field: "min_tokens",
                expected: "at most max_tokens",
                got: format!("{} (max_tokens is {})", self.min_tokens, self.max_tokens),
            });
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(RequestError::OutOfRange {
                field: "logit_bias",
                expected: "in [-100, 100]",
                got: format!("{b} for token {t}"),
            });
        }
        Ok(())
    }

    /// Whether top-k, top-p or min-p cut the distribution.
    pub fn truncates(&self) -> bool {
        self.top_k > 0 || self.top_p < 1.0 || self.min_p > 0.0
    }

    /// Whether any penalty (or bias) changes the logits.
    pub fn has_penalties(&self) -> bool {
        self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
    }
}

/// `min_tokens`: the tokens that would end the request get a logit of minus infinity.
pub fn suppress_stop_tokens(logits: &mut [f32], stop_ids: &[u32]) {
    for &t in stop_ids {
        if let Some(logit) = logits.get_mut(t as usize) {
            *logit = f32::NEG_INFINITY;
        }
    }
}

/// Applies the penalties of `params` to one row of logits, in place: the repetition
/// penalty over `prompt` and `output` tokens, then the frequency and presence penalties
/// over `output` tokens, then the logit bias. Token ids outside the row are ignored.
pub fn apply_penalties(
    logits: &mut [f32],
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
) {
    if params.repetition_penalty != 1.0 {
        let mut seen = vec![false; logits.len()];
        for &t in prompt.iter().chain(output) {
            if let Some(s) = seen.get_mut(t as usize) {
                *s = true;
            }
        }
        for (logit, _) in logits.iter_mut().zip(&seen).filter(|(_, &s)| s) {
            if *logit > 0.0 {
                *logit /= params.repetition_penalty;
            } else {
                *logit *= params.repetition_penalty;
            }
        }
    }
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, count) in counts {
            if let Some(logit) = logits.get_mut(t as usize) {
                *logit -= params.frequency_penalty * count as f32 + params.presence_penalty;
            }
        }
    }
    for &(t, bias) in &params.logit_bias {
        if let Some(logit) = logits.get_mut(t as usize) {
            *logit += bias;
        }
    }
}

/// Most edits one reduced row may take, as a share of the vocabulary: a row with more
/// (a long prompt under a repetition penalty) is copied whole instead, which moves fewer
/// bytes.
const MAX_EDITS_PER_VOCAB: usize = 8;

/// What [`apply_penalties`] and then (below `min_tokens`) [`suppress_stop_tokens`] do to
/// row `row` of a step's logits, as one [`LogitEdit`] per logit they change: the same
/// values, bit for bit, where a device applies them. `suppressed`: the stop tokens
/// suppressed (empty at or past `min_tokens`). `None` where the row takes more than a
/// vocabulary's [`MAX_EDITS_PER_VOCAB`]th, or the bias names a token twice (applied twice
/// in a row by the host).
pub fn logit_edits(
    params: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    suppressed: &[&[u32]],
    vocab: usize,
    row: u32,
) -> Option<Vec<LogitEdit>> {
    let mut edits = RowEdits {
        edits: std::collections::BTreeMap::new(),
        limit: (vocab / MAX_EDITS_PER_VOCAB).max(1),
        vocab,
        row,
        overflow: false,
    };
    if params.repetition_penalty != 1.0 {
        for &t in prompt.iter().chain(output) {
            edits.change(t, |e| e.repetition = params.repetition_penalty);
        }
    }
    if params.frequency_penalty != 0.0 || params.presence_penalty != 0.0 {
        let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, count) in counts {
            let subtract = params.frequency_penalty * count as f32 + params.presence_penalty;
            edits.change(t, |e| e.subtract = subtract);
        }
    }
    let mut biased = std::collections::HashSet::new();
    for &(t, bias) in &params.logit_bias {
        if !biased.insert(t) {
            return None;
        }
        edits.change(t, |e| e.add = bias);
    }
    for &t in suppressed.iter().copied().flatten() {
        edits.change(t, |e| e.suppress = true);
    }
    (!edits.overflow).then(|| edits.edits.into_values().collect())
}

/// One row's edits by token, up to a limit.
struct RowEdits {
    edits: std::collections::BTreeMap<u32, LogitEdit>,
    limit: usize,
    vocab: usize,
    row: u32,
    /// A token past the limit was left out.
    overflow: bool,
}

impl RowEdits {
    /// Changes `token`'s edit (a new one unchanged but for `f`); tokens outside the row
    /// are ignored, as the host ignores them.
    fn change(&mut self, token: u32, f: impl FnOnce(&mut LogitEdit)) {
        use std::collections::btree_map::Entry;
        if token as usize >= self.vocab {
            return;
        }
        let full = self.edits.len() >= self.limit;
        match self.edits.entry(token) {
            Entry::Occupied(e) => f(e.into_mut()),
            Entry::Vacant(_) if full => self.overflow = true,
            Entry::Vacant(v) => f(v.insert(LogitEdit {
                row: self.row,
                token,
                ..LogitEdit::NONE
            })),
        }
    }
}

/// Structured output: every token not set in `allowed` (bit `t % 32` of word `t / 32`;
/// tokens past its end included) gets a logit of minus infinity, so no sampler picks it.
pub fn apply_token_mask(logits: &mut [f32], allowed: &[u32]) {
    for (t, logit) in logits.iter_mut().enumerate() {
        let set = allowed
            .get(t / 32)
            .is_some_and(|word| word & (1 << (t % 32)) != 0);
        if !set {
            *logit = f32::NEG_INFINITY;
        }
    }
}

/// Log-probability of the sampled token and of the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub token_id: u32,
    pub logprob: f32,
    /// 1 + how many tokens are more likely (have a larger logit), as vLLM ranks it.
    pub rank: usize,
    /// The `k` most likely tokens, most likely first (the lowest id first on ties).
    pub top: Vec<(u32, f32)>,
}

/// Log-softmax of a row of logits.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let log_sum = log_sum_exp(logits);
    logits.iter().map(|&l| l - log_sum).collect()
}

/// `ln(sum(exp(logits)))`, against the row's maximum.
fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = vocab_row::max(logits);
    max + vocab_row::exp_sum(logits, max).ln()
}

/// The logprob of `token` and the top `k` of a row of logits (see [`log_softmax`]).
pub fn token_logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let log_sum = log_sum_exp(logits);
    let chosen = logits.get(token as usize).copied();
    TokenLogprobs {
        token_id: token,
        logprob: chosen.map_or(f32::NEG_INFINITY, |l| l - log_sum),
        rank: 1 + chosen.map_or(logits.len(), |c| logits.iter().filter(|&&l| l > c).count()),
        top: top_k_logprobs(logits, log_sum, k),
    }
}

/// A prompt token's log-probability given the tokens before it: the log-softmax of
/// the raw logits (no penalties, no temperature).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptTokenLogprob {
    pub logprob: f32,
    /// 1 + how many tokens are more likely (have a larger logit).
    pub rank: usize,
    /// The `k` most likely tokens, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// A prompt token scored where the model's logits are (the same definitions).
impl From<RowScore> for PromptTokenLogprob {
    fn from(s: RowScore) -> Self {
        Self {
            logprob: s.logprob,
            rank: s.rank,
            top: s.top,
        }
    }
}

/// Reduces one row of logits to the logprob and rank of `token` and the top `k`
/// (`None` when `token` is outside the row).
pub fn prompt_token_logprob(logits: &[f32], token: u32, k: usize) -> Option<PromptTokenLogprob> {
    let logit = *logits.get(token as usize)?;
    let log_sum = log_sum_exp(logits);
    Some(PromptTokenLogprob {
        logprob: logit - log_sum,
        rank: 1 + vocab_row::count_above(logits, logit),
        top: top_k_logprobs(logits, log_sum, k),
    })
}

/// The `k` largest logits of a row as logprobs (`log_sum`: the row's log-sum-exp), most
/// likely first, ties to the lower id (as a device's reduction orders them:
/// [`lantern_model::pick::top_k`]).
fn top_k_logprobs(logits: &[f32], log_sum: f32, k: usize) -> Vec<(u32, f32)> {
    lantern_model::pick::top_k(logits, k)
        .into_iter()
        .map(|id| (id, logits[id as usize] - log_sum))
        .collect()
}

/// Per-request sampling state: its random stream.
pub struct Sampler {
    rng: StdRng,
    /// The next token's uniform draw, taken before the step for a row sampled whole by a
    /// device model or by the step's threads ([`Self::draw_ahead`]).
    drawn: Option<f32>,
}

impl Sampler {
    pub fn new(seed: Option<u64>) -> Self {
        let rng = match seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_entropy(),
        };
        Self { rng, drawn: None }
    }

    /// The uniform draw the next token is sampled with, taken now (once per token: a
    /// second call before the token is sampled gives the same draw). The stream is the
    /// one [`Self::sample`] reads, so a token gets the same draw wherever it is sampled.
    pub fn draw_ahead(&mut self) -> f32 {
        *self.drawn.get_or_insert_with(|| self.rng.gen::<f32>())
    }

    /// The draw taken ahead, if any.
    pub fn drawn(&self) -> Option<f32> {
        self.drawn
    }

    /// The token was sampled elsewhere (on the device) with the draw taken ahead.
    pub fn used_draw(&mut self) {
        self.drawn = None;
    }

    /// The next uniform draw: the one taken ahead, else a new one.
    fn next_draw(&mut self) -> f32 {
        self.drawn.take().unwrap_or_else(|| self.rng.gen::<f32>())
    }

    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32], params: &SamplingParams) -> u32 {
        if params.temperature == 0.0 {
            return argmax(logits);
        }
        sample_with_draw(logits, params, self.next_draw())
    }
}

/// The token a uniform `draw` in [0, 1) picks from `logits` under `params` (a temperature
/// above 0): from the whole softmax, or from the weights top-k, top-p and min-p keep
/// ([`crate::cut::cut_weight`]), walked in id order (the same distribution as walking
/// them sorted; a device samples the same way: `lantern_model::pick::sample_row`).
pub fn sample_with_draw(logits: &[f32], params: &SamplingParams, draw: f32) -> u32 {
    thread_local! {
        // A vocabulary's weights, kept between the rows this thread samples.
        static WEIGHTS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    WEIGHTS.with_borrow_mut(|weights| {
        weights.resize(logits.len(), 0.0);
        let max = vocab_row::max(logits);
        let total = vocab_row::exp_scaled(logits, max, 1.0 / params.temperature, weights);
        let floor = if params.truncates() {
            crate::cut::cut_weight(weights, total, params)
        } else {
            0.0
        };
        lantern_model::pick::walk_weights(weights, floor, draw).unwrap_or_else(|| argmax(logits))
    })
}

/// The most likely token; the lowest id wins a tie, so greedy decoding is deterministic.
pub fn argmax(logits: &[f32]) -> u32 {
    vocab_row::argmax(logits) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_argmax_and_lowest_id_on_ties() {
        let mut s = Sampler::new(Some(0));
        let p = SamplingParams::greedy(1);
        assert_eq!(s.sample(&[0.1, 3.0, 3.0, -1.0], &p), 1);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(Some(7));
        let p = SamplingParams {
            temperature: 1.5,
            top_k: 1,
            ..SamplingParams::default()
        };
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, 1.0, 5.0, 4.9], &p), 2);
        }
    }

    /// Rows with NaN, infinities or nothing finite, under any cut, give a token of the
    /// row and never a panic.
    #[test]
    fn any_row_under_any_cut_gives_a_token() {
        use rand::Rng;
        let seed = rand::random::<u64>();
        let mut rng = StdRng::seed_from_u64(seed);
        for round in 0..300 {
            let n = [1usize, 7, 300, 5000, 70_000][round % 5];
            let odd = [
                f32::NAN,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::MAX,
                -f32::MAX,
            ];
            let share = [0.0, 0.01, 0.5, 0.99, 1.0][rng.gen_range(0..5)];
            let logits: Vec<f32> = (0..n)
                .map(|_| {
                    if rng.gen::<f64>() < share {
                        odd[rng.gen_range(0..odd.len())]
                    } else {
                        rng.gen::<f32>() * 20.0 - 10.0
                    }
                })
                .collect();
            let params = SamplingParams {
                temperature: [0.01, 0.7, 1.0, 5.0][rng.gen_range(0..4)],
                top_k: [0, 1, 3, 2000][rng.gen_range(0..4)],
                top_p: [1.0, 0.999, 0.5, 1e-6][rng.gen_range(0..4)],
                min_p: [0.0, 0.1, 1.0][rng.gen_range(0..3)],
                ..SamplingParams::default()
            };
            let token = sample_with_draw(&logits, &params, rng.gen());
            assert!(
                (token as usize) < n,
                "seed {seed}, round {round}: token {token} of {n}"
            );
        }
    }

    #[test]
    fn whole_row_sampling_follows_the_softmax() {
        let logits = [0.0f32, 1.0, 2.0, -50.0];
        let params = SamplingParams::default();
        let mut s = Sampler::new(Some(3));
        let mut counts = [0usize; 4];
        for _ in 0..20_000 {
            counts[s.sample(&logits, &params) as usize] += 1;
        }
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        for (i, &c) in counts.iter().enumerate() {
            let p = (logits[i] as f64).exp() / z;
            assert!((c as f64 / 20_000.0 - p).abs() < 0.015, "token {i}: {c}");
        }
    }

    #[test]
    fn same_seed_same_samples() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams::default();
        let draw = |seed| {
            let mut s = Sampler::new(Some(seed));
            (0..30).map(|_| s.sample(&logits, &p)).collect::<Vec<_>>()
        };
        assert_eq!(draw(42), draw(42));
        assert_ne!(draw(42), draw(43));
    }

    #[test]
    fn top_k_keeps_k_entries_not_the_vocabulary() {
        let logprobs: Vec<f32> = (0..50_000).map(|i| -(i as f32)).collect();
        let top = top_k_logprobs(&logprobs, 0.0, 3);
        assert_eq!(top, vec![(0, 0.0), (1, -1.0), (2, -2.0)]);
        assert!(top.capacity() < 1000, "holds {} entries", top.capacity());
    }

    /// The host's logprobs follow the definitions a device's reduction is held to
    /// (lantern-model's `score_token`): the same ranks and top ids (ties to the lower
    /// id), logprobs up to the order of the f32 sums.
    #[test]
    fn host_logprobs_follow_the_reduced_rows_definitions() {
        use rand::rngs::StdRng;
        let mut r = StdRng::seed_from_u64(5);
        for n in [7usize, 1000, 49_152] {
            let mut row: Vec<f32> = (0..n).map(|_| r.gen_range(-8.0f32..8.0)).collect();
            row[n / 2] = 9.0;
            row[n - 1] = 9.0;
            for k in [0, 1, 5, 20] {
                let token = r.gen_range(0..n as u32);
                let want = lantern_model::pick::score_token(&row, token, k);
                let host = prompt_token_logprob(&row, token, k).unwrap();
                let sampled = token_logprobs(&row, token, k);
                assert_eq!(host.rank, want.rank, "{n} ids: rank");
                let ids = |t: &[(u32, f32)]| t.iter().map(|e| e.0).collect::<Vec<_>>();
                assert_eq!(ids(&host.top), ids(&want.top), "{n} ids: top");
                assert_eq!(sampled.top, host.top);
                assert_eq!(sampled.logprob, host.logprob);
                let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 + 1e-5 * b.abs();
                assert!(close(host.logprob, want.logprob), "{n} ids: logprob");
                for (a, b) in host.top.iter().zip(&want.top) {
                    assert!(close(a.1, b.1), "{n} ids: {a:?} against {b:?}");
                }
            }
        }
    }

    /// A row edited by `logit_edits` (what a device applies) is bit for bit the row
    /// `apply_penalties` and `suppress_stop_tokens` give, for every kind of penalty alone
    /// and together, tokens outside the row included; too many edits, or a bias naming a
    /// token twice, give none.
    #[test]
    fn logit_edits_give_the_hosts_penalized_row() {
        use rand::Rng;
        let mut rng = StdRng::seed_from_u64(9);
        let vocab = 3000;
        for round in 0..40 {
            let row: Vec<f32> = (0..vocab).map(|_| rng.gen_range(-6.0f32..6.0)).collect();
            let prompt: Vec<u32> = (0..rng.gen_range(0..200))
                .map(|_| rng.gen_range(0..vocab as u32 + 10))
                .collect();
            let output: Vec<u32> = (0..rng.gen_range(0..60))
                .map(|_| rng.gen_range(0..400))
                .collect();
            let params = SamplingParams {
                repetition_penalty: [1.0, 1.3, 0.8][round % 3],
                frequency_penalty: [0.0, 0.5, -1.25][round % 4 % 3],
                presence_penalty: [0.0, 1.5][round % 2],
                logit_bias: (0..round % 5)
                    .map(|i| (rng.gen_range(0..vocab as u32) * 5 + i as u32, 3.0))
                    .filter(|(t, _)| (*t as usize) < vocab)
                    .collect(),
                ..SamplingParams::default()
            };
            let stops: &[u32] = &[7, 2999, 5000];
            let suppressed: Vec<&[u32]> = if round % 3 == 0 { vec![stops] } else { vec![] };
            let mut want = row.clone();
            apply_penalties(&mut want, &params, &prompt, &output);
            for s in &suppressed {
                suppress_stop_tokens(&mut want, s);
            }
            let edits = logit_edits(&params, &prompt, &output, &suppressed, vocab, 0).unwrap();
            let mut got = row.clone();
            lantern_model::pick::apply_edits(&mut got, vocab, &edits);
            let bits = |r: &[f32]| r.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert!(bits(&got) == bits(&want), "round {round}: rows differ");
            assert!(edits.len() <= vocab / MAX_EDITS_PER_VOCAB);
        }
        let many: Vec<u32> = (0..vocab as u32).collect();
        let params = SamplingParams {
            repetition_penalty: 1.2,
            ..SamplingParams::default()
        };
        assert_eq!(logit_edits(&params, &many, &[], &[], vocab, 0), None);
        let params = SamplingParams {
            logit_bias: vec![(5, 1.0), (5, 2.0)],
            ..SamplingParams::default()
        };
        assert_eq!(logit_edits(&params, &[], &[], &[], vocab, 0), None);
    }

    #[test]
    fn validation_names_the_field() {
        let p = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        };
        assert_eq!(p.validate().unwrap_err().field(), "top_p");
        for (p, field) in [
            (
                SamplingParams {
                    presence_penalty: 2.5,
                    ..SamplingParams::default()
                },
                "presence_penalty",
            ),
            (
                SamplingParams {
                    frequency_penalty: -2.1,
                    ..SamplingParams::default()
                },
                "frequency_penalty",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..SamplingParams::default()
                },
                "repetition_penalty",
            ),
        ] {
            assert_eq!(p.validate().unwrap_err().field(), field);
        }
    }

    #[test]
    fn frequency_and_presence_penalties_count_generated_tokens() {
        let mut logits = vec![1.0, 2.0, 3.0, 4.0];
        let p = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..SamplingParams::default()
        };
        // Prompt tokens do not count; token 1 twice, token 3 once among the output.
        apply_penalties(&mut logits, &p, &[0, 2], &[1, 3, 1]);
        // 2 - 0.5*2 - 0.25 = 0.75; 4 - 0.5 - 0.25 = 3.25.
        assert_eq!(logits, vec![1.0, 0.75, 3.0, 3.25]);
    }

    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative() {
        let mut logits = vec![2.0, -1.0, 3.0, -4.0, 5.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..SamplingParams::default()
        };
        // Prompt and output both count, each token once however often it occurs.
        apply_penalties(&mut logits, &p, &[0, 1, 0], &[1, 4]);
        assert_eq!(logits, vec![1.0, -2.0, 3.0, -4.0, 2.5]);
        assert!(!SamplingParams::default().has_penalties());
        assert!(p.has_penalties());
    }

    #[test]
    fn token_mask_leaves_only_allowed_tokens_to_any_sampler() {
        let mut rng = StdRng::seed_from_u64(3);
        for vocab in [1usize, 31, 32, 33, 100, 1000] {
            let logits: Vec<f32> = (0..vocab).map(|_| rng.gen_range(-5.0..5.0)).collect();
            // A bit set a little shorter than the vocabulary: the tail is disallowed too.
            let words = vocab.saturating_sub(7).div_ceil(32);
            let allowed: Vec<u32> = (0..words).map(|_| rng.gen()).collect();
            let is_allowed = |t: usize| t / 32 < words && allowed[t / 32] >> (t % 32) & 1 == 1;
            let mut masked = logits.clone();
            apply_token_mask(&mut masked, &allowed);
            for t in 0..vocab {
                let expected = if is_allowed(t) {
                    logits[t]
                } else {
                    f32::NEG_INFINITY
                };
                assert_eq!(masked[t], expected, "vocab {vocab} token {t}");
            }
            if !(0..vocab).any(is_allowed) {
                continue;
            }
            let best = (0..vocab)
                .filter(|&t| is_allowed(t))
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a)))
                .unwrap();
            assert_eq!(argmax(&masked) as usize, best);
            let mut s = Sampler::new(Some(vocab as u64));
            for _ in 0..50 {
                let t = s.sample(&masked, &SamplingParams::default()) as usize;
                assert!(is_allowed(t), "sampled a masked token {t}");
            }
        }
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_sorted_top() {
        // ln(1 + e + e^2) = 2.40760596
        let lp = token_logprobs(&[0.0, 1.0, 2.0], 0, 2);
        assert!((lp.logprob - (0.0 - 2.407_606)).abs() < 1e-5);
        assert_eq!(lp.top.len(), 2);
        assert_eq!(lp.top[0].0, 2);
        assert!((lp.top[0].1 - (2.0 - 2.407_606)).abs() < 1e-5);
        assert_eq!(lp.top[1].0, 1);
        // Ranked below the two larger logits, whatever k; ties share the better rank.
        assert_eq!(lp.rank, 3);
        assert_eq!(token_logprobs(&[2.0, 1.0, 2.0], 2, 0).rank, 1);
        assert!(token_logprobs(&[0.0, 1.0], 1, 0).top.is_empty());
        assert_eq!(token_logprobs(&[0.0, 1.0], 1, 10).top.len(), 2);
    }

    #[test]
    fn logit_bias_is_added_and_min_tokens_masks_stop_ids() {
        let p = SamplingParams {
            logit_bias: vec![(0, 100.0), (2, -100.0), (9, 5.0)],
            ..SamplingParams::greedy(4)
        };
        assert!(p.has_penalties());
        let mut row = vec![1.0, 2.0, 3.0];
        apply_penalties(&mut row, &p, &[], &[]);
        assert_eq!(row, vec![101.0, 2.0, -97.0]);
        assert_eq!(Sampler::new(Some(0)).sample(&row, &p), 0);
        suppress_stop_tokens(&mut row, &[0, 7]);
        assert_eq!(row[0], f32::NEG_INFINITY);
        assert_eq!(Sampler::new(Some(0)).sample(&row, &p), 1);
        let bad = SamplingParams {
            logit_bias: vec![(3, 100.5)],
            ..SamplingParams::greedy(4)
        };
        assert_eq!(bad.validate().unwrap_err().field(), "logit_bias");
        let bad = SamplingParams {
            min_tokens: 5,
            ..SamplingParams::greedy(4)
        };
        assert_eq!(bad.validate().unwrap_err().field(), "min_tokens");
    }
}
