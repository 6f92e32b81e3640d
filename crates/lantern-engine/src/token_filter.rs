//! vLLM's `allowed_token_ids` and `bad_words`: tokens a request may not sample.
//!
//! A filter is a mask over the logits after the penalties, as structured output's is:
//! the logprobs a request gets stay those of the model's distribution (after penalties),
//! and a filtered request's rows are read on the host (`Request::reads_row_alone`).

use std::sync::Arc;

/// The tokens one request may not sample next.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenFilter {
    /// Only these may be sampled (sorted, without repeats); `None` allows every token.
    allowed: Option<Arc<[u32]>>,
    /// Token sequences the output may not contain: a sequence's last token is banned
    /// wherever the output ends with the others (a one-token sequence: always).
    pub bad_words: Arc<[Arc<[u32]>]>,
}

impl TokenFilter {
    /// A filter allowing only `tokens` (in any order, repeats allowed).
    pub fn allowing(tokens: &[u32]) -> Self {
        let mut allowed = tokens.to_vec();
        allowed.sort_unstable();
        allowed.dedup();
        Self {
            allowed: Some(allowed.into()),
            ..Self::default()
        }
    }

    /// The tokens it allows, when it names them (none when it allows every token).
    pub fn allowed(&self) -> impl Iterator<Item = u32> + '_ {
        self.allowed.iter().flat_map(|a| a.iter().copied())
    }

    /// The same filter, also banning `bad_words` (see [`bad_word_sequences`]).
    pub fn with_bad_words(self, bad_words: Arc<[Arc<[u32]>]>) -> Self {
        Self { bad_words, ..self }
    }

    /// Whether it bans nothing.
    pub fn is_empty(&self) -> bool {
        self.allowed.is_none() && self.bad_words.is_empty()
    }

    /// The request field to name when it leaves nothing to sample: `bad_words` where
    /// there are any (an allowed set alone is never empty).
    pub fn field(&self) -> &'static str {
        match self.bad_words.is_empty() {
            true => "allowed_token_ids",
            false => "bad_words",
        }
    }

    /// Whether `token` may follow `output`.
    pub fn allows(&self, token: u32, output: &[u32]) -> bool {
        let listed = self
            .allowed
            .as_ref()
            .is_none_or(|a| a.binary_search(&token).is_ok());
        listed && !self.banned_after(output).any(|t| t == token)
    }

    /// The last tokens of the bad words whose other tokens end `output`.
    fn banned_after<'a>(&'a self, output: &'a [u32]) -> impl Iterator<Item = u32> + 'a {
        self.bad_words.iter().filter_map(move |word| {
            let (&last, prefix) = word.split_last()?;
            output.ends_with(prefix).then_some(last)
        })
    }

    /// Sets the logit of every token it bans after `output` to minus infinity. Returns
    /// whether some token of the row is left to sample.
    pub fn apply(&self, logits: &mut [f32], output: &[u32]) -> bool {
        if let Some(allowed) = &self.allowed {
            let width = logits.len();
            let mut start = 0;
            for t in allowed.iter().map(|&t| t as usize).filter(|&t| t < width) {
                logits[start..t].fill(f32::NEG_INFINITY);
                start = t + 1;
            }
            logits[start.min(width)..].fill(f32::NEG_INFINITY);
        }
        for t in self.banned_after(output) {
            if let Some(logit) = logits.get_mut(t as usize) {
                *logit = f32::NEG_INFINITY;
            }
        }
        logits.iter().any(|&l| l > f32::NEG_INFINITY)
    }

    /// Whether the one-token bad words ban every allowed token (then nothing can ever
    /// be sampled).
    pub fn bans_every_allowed_token(&self) -> bool {
        let Some(allowed) = &self.allowed else {
            return false;
        };
        allowed
            .iter()
            .all(|t| self.bad_words.iter().any(|w| **w == [*t]))
    }
}

/// vLLM's tokenization of `bad_words`: each word as it would start the text and, when
/// that gives different tokens of the same count, as it would follow a space (a
/// tokenizer whose words carry their leading space has two spellings of each). Empty
/// words ban nothing.
pub fn bad_word_sequences(
    words: &[String],
    mut encode: impl FnMut(&str) -> Result<Vec<u32>, String>,
) -> Result<Vec<Arc<[u32]>>, String> {
    let mut sequences: Vec<Arc<[u32]>> = Vec::new();
    for word in words {
        let word = word.trim_start();
        let first = encode(word)?;
        if first.is_empty() {
            continue;
        }
        let spaced = encode(&format!(" {word}"))?;
        let another_spelling = spaced.len() == first.len() && spaced.first() != first.first();
        sequences.push(first.into());
        if another_spelling {
            sequences.push(spaced.into());
        }
    }
    Ok(sequences)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn words(seqs: &[&[u32]]) -> Arc<[Arc<[u32]>]> {
        seqs.iter().map(|s| Arc::from(*s)).collect()
    }

    /// The simple reference: token by token, whether the filter allows it.
    fn reference(filter: &TokenFilter, logits: &[f32], output: &[u32]) -> Vec<f32> {
        (0..logits.len())
            .map(|t| match filter.allows(t as u32, output) {
                true => logits[t],
                false => f32::NEG_INFINITY,
            })
            .collect()
    }

    #[test]
    fn apply_equals_the_token_by_token_reference_on_random_filters() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..200 {
            let vocab = rng.gen_range(1..300);
            let logits: Vec<f32> = (0..vocab).map(|_| rng.gen_range(-5.0..5.0)).collect();
            let allowed: Option<Vec<u32>> = rng.gen_bool(0.7).then(|| {
                (0..rng.gen_range(1..20))
                    // Some past the row's end: ignored, as logit_bias's are.
                    .map(|_| rng.gen_range(0..vocab as u32 + 10))
                    .collect()
            });
            let bad: Vec<Vec<u32>> = (0..rng.gen_range(0..4))
                .map(|_| {
                    (0..rng.gen_range(1..4))
                        .map(|_| rng.gen_range(0..vocab as u32))
                        .collect()
                })
                .collect();
            let output: Vec<u32> = (0..rng.gen_range(0..5))
                .map(|_| rng.gen_range(0..vocab as u32))
                .collect();
            let mut filter =
                allowed.map_or_else(TokenFilter::default, |a| TokenFilter::allowing(&a));
            filter.bad_words = bad.into_iter().map(Arc::from).collect();
            let mut got = logits.clone();
            let left = filter.apply(&mut got, &output);
            let want = reference(&filter, &logits, &output);
            assert_eq!(got, want, "{filter:?} after {output:?}");
            assert_eq!(left, want.iter().any(|l| l.is_finite()));
        }
    }

    #[test]
    fn a_bad_word_bans_its_last_token_only_after_its_others() {
        let filter = TokenFilter {
            bad_words: words(&[&[5], &[1, 2, 3]]),
            ..TokenFilter::default()
        };
        let mut row = vec![0.0; 8];
        filter.apply(&mut row, &[9, 1, 2]);
        assert_eq!(row[3], f32::NEG_INFINITY);
        assert_eq!(row[5], f32::NEG_INFINITY);
        let mut row = vec![0.0; 8];
        filter.apply(&mut row, &[1, 2, 4]);
        assert!(row[3].is_finite());
        // Too few tokens yet for the prefix.
        let mut row = vec![0.0; 8];
        filter.apply(&mut row, &[2]);
        assert!(row[3].is_finite());
        assert_eq!(row.iter().filter(|l| l.is_finite()).count(), 7);
    }

    #[test]
    fn nothing_left_is_reported() {
        let mut filter = TokenFilter::allowing(&[2, 2]);
        filter.bad_words = words(&[&[2]]);
        assert!(filter.bans_every_allowed_token());
        assert!(!filter.apply(&mut [1.0, 2.0, 3.0], &[]));
        let mut filter = TokenFilter::allowing(&[2, 1]);
        filter.bad_words = words(&[&[2]]);
        assert!(!filter.bans_every_allowed_token());
        assert!(filter.apply(&mut [1.0, 2.0, 3.0], &[]));
    }

    #[test]
    fn bad_words_are_spelled_at_the_start_and_after_a_space() {
        // A toy tokenizer: a leading space makes a different first token.
        let encode = |s: &str| -> Result<Vec<u32>, String> {
            let spaced = if s.starts_with(' ') { 100 } else { 0 };
            Ok(match s.trim() {
                "" => Vec::new(),
                word => vec![spaced + word.len() as u32],
            })
        };
        let seqs = bad_word_sequences(&["  ab".into(), "".into()], encode).unwrap();
        assert_eq!(seqs, vec![Arc::from([2u32]), Arc::from([102u32])]);
        // Where the spaced spelling has another length, only the first is kept.
        let split_space =
            |s: &str| -> Result<Vec<u32>, String> { Ok(s.bytes().map(u32::from).collect()) };
        let seqs = bad_word_sequences(&["ab".into()], split_space).unwrap();
        assert_eq!(seqs, vec![Arc::from([97u32, 98])]);
    }
}
