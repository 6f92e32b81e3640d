//! Errors of model loading and execution.

use std::path::PathBuf;

/// Everything that can go wrong while reading a model file or running it.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot open model file {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a valid GGUF file: {problem}")]
    InvalidGguf {
        path: PathBuf,
        problem: crate::gguf_header::GgufProblem,
    },
    #[error(
        "{path}: tensor `{tensor}` is of type {type_name}, which lantern does not read yet \
         (it reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K, IQ4_NL and \
         IQ4_XS: a Q4_K_M, Q5_K_M, Q6_K or Q8_0 file of the same model works)"
    )]
    UnreadGgufType {
        path: PathBuf,
        tensor: String,
        type_name: &'static str,
    },
    #[error("{path} is truncated: tensor `{tensor}` needs bytes up to {needed}, the file has {file_len}")]
    Truncated {
        path: PathBuf,
        tensor: String,
        needed: u64,
        file_len: u64,
    },
    #[error("{path}: {reason}")]
    InvalidHf { path: PathBuf, reason: String },
    #[error("GGUF metadata key `{key}` is missing")]
    MissingKey { key: String },
    #[error("GGUF metadata key `{key}` has the wrong type: expected {expected}")]
    WrongType { key: String, expected: &'static str },
    #[error("tensor `{name}` is missing from the model file")]
    MissingTensor { name: String },
    #[error("tensor `{hf}` is missing from the checkpoint (lantern reads it as `{gguf}`)")]
    MissingHfTensor { hf: String, gguf: String },
    #[error("tensor `{name}` has shape {actual:?}, expected {expected:?}")]
    BadShape {
        name: String,
        actual: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor `{name}` has type {dtype}, which lantern does not support here")]
    UnsupportedTensorType { name: String, dtype: String },
    #[error(
        "unsupported model architecture `{0}` (supported: {supported})",
        supported = crate::archs::SUPPORTED.join(", ")
    )]
    UnsupportedArchitecture(String),
    #[error("invalid model configuration: {0}")]
    InvalidConfig(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("tensor `{name}`: {source}")]
    Tensor {
        name: String,
        source: candle_core::Error,
    },
    #[error("compute: {0}")]
    Compute(String),
    #[error(transparent)]
    Attention(#[from] lantern_attn::AttnError),
}

pub type Result<T> = std::result::Result<T, ModelError>;
