//! Engine configuration.

use lantern_kv::KvDtype;

/// How the engine sizes its KV cache and batches.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Bytes of KV cache memory, over all layers.
    pub kv_cache_memory: usize,
    /// Tokens per KV cache block.
    pub block_size: usize,
    /// Element type of the KV cache (default f16: half of f32's memory per token, with
    /// keys and values rounded to 11 significant bits).
    pub kv_cache_dtype: KvDtype,
    /// Attention backend by name (`cpu-flash`, `cpu-reference`).
    pub attention_backend: String,
    /// Most tokens computed in one step (all requests together).
    pub max_num_batched_tokens: usize,
    /// Most requests running at once.
    pub max_num_seqs: usize,
    pub enable_prefix_caching: bool,
    /// Most requests waiting to be admitted (samples of one request count one each).
    /// The server answers requests that would exceed it with a 429 and `Retry-After`;
    /// the engine's own Rust API does not enforce it.
    pub max_waiting_requests: usize,
    /// Cap on a request's prompt plus generated tokens (vLLM's `--max-model-len`); `None`
    /// is the model's own context.
    pub max_model_len: Option<usize>,
    /// Run every step eagerly: no decode steps replayed from CUDA graphs (vLLM's
    /// `--enforce-eager`). Only a GPU backend records graphs.
    pub enforce_eager: bool,
}

/// Default [`EngineConfig::max_waiting_requests`].
pub const DEFAULT_MAX_WAITING_REQUESTS: usize = 1024;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_cache_memory: 1 << 30,
            block_size: 16,
            kv_cache_dtype: KvDtype::F16,
            attention_backend: "cpu-flash".to_string(),
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            enable_prefix_caching: true,
            max_waiting_requests: DEFAULT_MAX_WAITING_REQUESTS,
            max_model_len: None,
            enforce_eager: false,
        }
    }
}
