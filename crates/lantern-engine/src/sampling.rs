//! Sampling parameters and the sampler.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

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
    pub max_tokens: usize,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Extra token ids that end the request (the model's EOS always does unless ignored).
    pub stop_token_ids: Vec<u32>,
    /// Keep the logits of every prompt position (`[prompt_len, vocab]`, the last row being
    /// the one the first token is sampled from): scoring, teacher forcing, prompt logprobs.
    pub prompt_logits: bool,
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
            stop_token_ids: Vec::new(),
            prompt_logits: false,
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
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".to_string());
        }
        Ok(())
    }
}

/// Per-request sampling state: its random stream.
pub struct Sampler {
    rng: StdRng,
}

impl Sampler {
    pub fn new(seed: Option<u64>) -> Self {
        let rng = match seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_entropy(),
        };
        Self { rng }
    }

    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32], params: &SamplingParams) -> u32 {
        if params.temperature == 0.0 {
            return argmax(logits);
        }
        let candidates = filtered_probabilities(logits, params);
        let total: f32 = candidates.iter().map(|(_, p)| p).sum();
        let mut threshold = self.rng.gen::<f32>() * total;
        for &(id, p) in &candidates {
            if threshold < p {
                return id;
            }
            threshold -= p;
        }
        candidates
            .last()
            .map(|&(id, _)| id)
            .unwrap_or_else(|| argmax(logits))
    }
}

/// The most likely token; the lowest id wins a tie, so greedy decoding is deterministic.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// Tokens that survive temperature, top-k, top-p and min-p, most likely first, with their
/// (unnormalized) probabilities.
fn filtered_probabilities(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, ((l - max) / params.temperature).exp()))
        .collect();
    let by_prob_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if params.top_k > 0 && params.top_k < probs.len() {
        probs.select_nth_unstable_by(params.top_k - 1, by_prob_desc);
        probs.truncate(params.top_k);
    }
    probs.sort_unstable_by(by_prob_desc);
    let total: f32 = probs.iter().map(|(_, p)| p).sum();
    if params.top_p < 1.0 {
        let mut cumulative = 0.0;
        let keep = probs
            .iter()
            .position(|&(_, p)| {
                cumulative += p / total;
                cumulative >= params.top_p
            })
            .map_or(probs.len(), |i| i + 1);
        probs.truncate(keep);
    }
    if params.min_p > 0.0 {
        let floor = params.min_p * probs.first().map_or(0.0, |p| p.1);
        probs.retain(|&(_, p)| p >= floor);
    }
    probs
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

    #[test]
    fn top_p_keeps_the_nucleus() {
        let logits = [10.0, 9.0, -10.0, -10.0];
        let p = SamplingParams {
            top_p: 0.9,
            ..SamplingParams::default()
        };
        let kept: Vec<u32> = filtered_probabilities(&logits, &p)
            .iter()
            .map(|c| c.0)
            .collect();
        assert_eq!(kept, vec![0, 1]);
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
    fn validation_names_the_field() {
        let p = SamplingParams {
            top_p: 0.0,
            ..SamplingParams::default()
        };
        assert!(p.validate().unwrap_err().contains("top_p"));
    }
}
