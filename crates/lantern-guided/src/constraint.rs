//! One request's constraint while it generates, and the masks it computes.

use crate::error::GuidedError;
use llguidance::toktrie::SimpleVob;
use llguidance::Matcher;

/// The tokens allowed next, as a bit set over the vocabulary.
#[derive(Debug, Clone)]
pub struct TokenMask {
    allowed: SimpleVob,
}

impl TokenMask {
    /// A mask allowing exactly `tokens` out of `vocab_size`.
    pub fn from_allowed(vocab_size: usize, tokens: &[u32]) -> Self {
        let mut allowed = SimpleVob::alloc(vocab_size);
        for &t in tokens {
            if (t as usize) < vocab_size {
                allowed.allow_token(t);
            }
        }
        Self { allowed }
    }

    pub fn is_allowed(&self, token: u32) -> bool {
        (token as usize) < self.allowed.len() && self.allowed.is_allowed(token)
    }

    /// The mask as 32-bit words, token `t` being bit `t % 32` of word `t / 32`.
    pub fn words(&self) -> &[u32] {
        self.allowed.as_slice()
    }

    pub fn num_allowed(&self) -> usize {
        self.allowed.num_set()
    }
}

/// A compiled grammar following one request's output. A clone is an independent copy
/// in the same state (one per sample of an `n > 1` request).
pub struct Constraint {
    matcher: Matcher,
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        self.fork()
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("finished", &self.is_finished())
            .finish()
    }
}

impl Constraint {
    pub(crate) fn new(matcher: Matcher) -> Self {
        Self { matcher }
    }

    /// An independent copy in the same state (for each of `n` samples of one request).
    pub fn fork(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
        }
    }

    /// The tokens that may come next. Never empty while the constraint is not finished:
    /// once the grammar accepts, the stop tokens are allowed.
    pub fn compute_mask(&mut self) -> Result<TokenMask, GuidedError> {
        let allowed = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| GuidedError::Matcher(e.to_string()))?;
        if allowed.is_zero() {
            return Err(GuidedError::Matcher(
                "no token can continue the output".to_string(),
            ));
        }
        Ok(TokenMask { allowed })
    }

    /// Advances past a sampled token.
    pub fn consume(&mut self, token: u32) -> Result<(), GuidedError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| GuidedError::Matcher(e.to_string()))
    }

    /// Whether the output is complete: the grammar accepted it and nothing more can
    /// follow (or a stop token was consumed).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
