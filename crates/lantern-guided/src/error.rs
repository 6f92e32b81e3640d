//! Errors of structured output.

/// What went wrong: a grammar the client gave (a client fault), or a constraint that
/// failed while generating (an engine fault).
#[derive(Debug, thiserror::Error)]
pub enum GuidedError {
    /// The schema, regex, choices or grammar cannot be compiled.
    #[error("{0}")]
    InvalidGrammar(String),
    /// The tokenizer's vocabulary cannot be turned into a token trie.
    #[error("structured output is unavailable for this tokenizer: {0}")]
    Vocabulary(String),
    /// The constraint failed while generating (it should accept every token its mask
    /// allowed).
    #[error("the output constraint failed: {0}")]
    Matcher(String),
}
