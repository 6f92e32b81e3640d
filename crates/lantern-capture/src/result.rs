//! A finished capture: one map per layer and the metadata that aligns it to tokens.

use serde::{Deserialize, Serialize};

/// Identifies the layout of [`CaptureMeta`] and the tensors beside it.
pub const CAPTURE_FORMAT: &str = "lantern.attn_capture.v1";

/// One position of the sequence.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenInfo {
    pub id: u32,
    /// The token decoded alone (special tokens included).
    pub text: String,
}

/// A requested row that has no probabilities, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AbsentRow {
    pub position: usize,
    pub reason: String,
}

/// How a captured layer attends, as its kernel did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerAttentionInfo {
    pub layer_idx: usize,
    pub scale: f32,
    pub sliding_window: Option<usize>,
    pub chunk_size: Option<usize>,
    pub logits_soft_cap: Option<f32>,
    /// With sinks, a row sums to less than 1: the rest is the sink's share.
    pub has_sinks: bool,
    pub num_heads: usize,
    pub num_kv_heads: usize,
}

/// Everything needed to read the maps: the same object in every wire format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CaptureMeta {
    /// [`CAPTURE_FORMAT`].
    pub format: String,
    pub prompt_len: usize,
    /// Prompt plus generated tokens.
    pub total_len: usize,
    /// Every position `0..total_len`.
    pub tokens: Vec<TokenInfo>,
    /// Captured layers, in the order of the maps.
    pub layers: Vec<usize>,
    /// Query heads captured (with a reduction: the heads reduced over).
    pub heads: Vec<usize>,
    /// `none`, `mean_heads` or `max_heads`.
    pub reduce: String,
    pub top_k: Option<usize>,
    /// `float32` or `float16`.
    pub dtype: String,
    /// Absolute position of each row of the maps.
    pub row_positions: Vec<usize>,
    /// Absolute position of each key (column) of the maps; with top-k the indices
    /// are positions too.
    pub key_positions: Vec<usize>,
    /// Requested positions that have no row, and why.
    pub absent_rows: Vec<AbsentRow>,
    pub layer_attention: Vec<LayerAttentionInfo>,
    /// Whether the maps are delivered: written only when false (key statistics alone),
    /// so the meta of every capture with maps is what it has always been.
    #[serde(default = "delivered", skip_serializing_if = "is_delivered")]
    pub maps: bool,
    /// Key statistics delivered: `key_mass`, `key_max`, `block_mass`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stats: Vec<String>,
    /// With statistics: `kv`, `query` or `mean`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stats_heads: Option<String>,
    /// With statistics: per captured layer, per group (the first dimension of its
    /// statistics), the query heads whose probabilities it averages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stats_groups: Vec<Vec<Vec<usize>>>,
    /// With statistics: tokens per KV cache block (the keys of each `block_mass` entry).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<usize>,
    /// With spans: each span, in the order of the last axis of `span_mass`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spans: Vec<crate::spans::SpanInfo>,
    /// With spans named by text: per prompt token, its characters `[start, end)` of the
    /// prompt text (for chat, of `span_prompt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub span_offsets: Option<Vec<[usize; 2]>>,
    /// Chat, with spans named by text: each message's content as characters of
    /// `span_prompt` (`null` where the template does not write it as it is).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub span_messages: Option<Vec<Option<[usize; 2]>>>,
    /// Chat, with spans named by text: the prompt the chat template rendered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub span_prompt: Option<String>,
}

fn delivered() -> bool {
    true
}

fn is_delivered(maps: &bool) -> bool {
    *maps
}

/// One layer's map: `[rows, heads, keys]` (heads is 1 after a reduction; keys is `k`
/// with top-k, with `indices` holding the key positions of the values).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerMap {
    pub layer_idx: usize,
    pub shape: [usize; 3],
    /// Row-major over `shape`, in f32 whatever the wire dtype.
    pub values: Vec<f32>,
    /// Top-k only: the key position of each value, same shape.
    pub indices: Option<Vec<u32>>,
}

/// A finished capture.
#[derive(Debug, Clone, PartialEq)]
pub struct CaptureResult {
    pub meta: CaptureMeta,
    /// One map per captured layer; none when the maps were not asked for.
    pub layers: Vec<LayerMap>,
    /// Each asked statistic of each captured layer, layer by layer.
    pub stats: Vec<crate::stats::LayerStat>,
    /// With spans: each captured layer's span masses, layer by layer.
    pub span_mass: Vec<crate::spans::LayerSpanMass>,
}
