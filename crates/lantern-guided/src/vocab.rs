//! The model's vocabulary as `llguidance` sees it: a trie of each token's bytes.

use crate::constraint::Constraint;
use crate::error::GuidedError;
use crate::guide::Guide;
use lantern_model::ModelTokenizer;
use llguidance::api::ParserLimits;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// A token trie over the model's vocabulary. Text is tokenized greedily through the trie:
/// `llguidance` only tokenizes the literal pieces of a grammar, where any spelling works.
struct TrieEnv {
    trie: TokTrie,
}

impl TokenizerEnv for TrieEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }
}

/// Compiles guides into constraints for one model. Built once per model (the trie and
/// its slices take a fraction of a second); cheap to clone and share between threads.
#[derive(Clone)]
pub struct GuidedVocab {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for GuidedVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuidedVocab")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl GuidedVocab {
    /// The vocabulary of `tokenizer`, padded with never-allowed placeholders up to the
    /// model's `vocab_size` (the width of its logits). The tokenizer's stop tokens end a
    /// constrained output once its grammar accepts.
    pub fn new(tokenizer: &ModelTokenizer, vocab_size: usize) -> Result<Self, GuidedError> {
        let mut words: Vec<Vec<u8>> = tokenizer
            .token_bytes()
            .into_iter()
            .map(|(bytes, special)| {
                if special {
                    // Special tokens never match grammar text.
                    let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    marked.extend_from_slice(&bytes);
                    marked
                } else {
                    bytes
                }
            })
            .collect();
        if words.len() > vocab_size {
            return Err(GuidedError::Vocabulary(format!(
                "the tokenizer has {} tokens but the model's logits only {vocab_size}",
                words.len()
            )));
        }
        while words.len() < vocab_size {
            let mut name = format!(".<[{}]>", words.len()).into_bytes();
            name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(name);
        }
        let stops = tokenizer.stop_ids();
        let Some(&eos) = stops.first() else {
            return Err(GuidedError::Vocabulary(
                "the tokenizer has no end-of-sequence token".to_string(),
            ));
        };
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let mut trie = TokTrie::from(&info, &words);
        if stops.len() > 1 {
            trie = trie.with_eos_tokens(stops);
        }
        let env: TokEnv = Arc::new(TrieEnv { trie });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GuidedError::Vocabulary(e.to_string()))?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            // A client's grammar error names the problem, not the whole grammar.
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Self {
            factory: Arc::new(factory),
        })
    }

    /// The width of the masks this vocabulary's constraints compute.
    pub fn vocab_size(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size()
    }

    /// Compiles `guide` into a fresh constraint (milliseconds to seconds for large
    /// schemas: call it off the engine thread).
    pub fn compile(&self, guide: &Guide) -> Result<Constraint, GuidedError> {
        let grammar = guide.grammar().map_err(GuidedError::InvalidGrammar)?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GuidedError::InvalidGrammar(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(error) = matcher.get_error() {
            return Err(GuidedError::InvalidGrammar(error));
        }
        Ok(Constraint::new(matcher))
    }
}
