//! lantern-attn: attention metadata, KV cache layouts and attention backends over the
//! paged KV cache.
//!
//! - [`layout`]: the logical shape and stride order of a layer's cache tensor; every
//!   reader of the cache asks the layout where an element lives.
//! - [`cache`]: one layer's cache tensor (f32/f16/bf16), the slot-mapped write and the
//!   read helpers shared by backends and attention capture.
//! - [`metadata`]: per-step [`CommonAttentionMetadata`] for a mixed prefill/decode
//!   batch, built once per KV cache group, plus the decode/prefill batch helpers.
//! - [`local`]: chunked-local attention as a virtual batch (vLLM's
//!   `make_local_attention_virtual_batches`): each request's queries cut at chunk
//!   boundaries, so the backends run chunked-local layers as plain causal attention.
//! - [`layer`]: the one description of a layer's attention (mask, scale, soft-cap,
//!   sinks) used by every backend and by capture.
//! - [`backend`]: the device-agnostic [`AttentionBackend`] trait and backend lookup.
//! - [`device`]: what crosses the backend boundary: tensors on the backend's device and
//!   the [`LayerKvCache`]s a backend allocates.
//! - [`tap`]: the hook that hands query rows to attention capture.
//! - [`kept`]: query rows a capture keeps on the backend's device between steps.
//! - [`maps`]: a captured layer's probability map as a backend computes it where its
//!   cache lives, and how rows of probabilities become a map.
//! - [`backends`]: `cpu-reference` (the oracle) and `cpu-flash` (the default on CPU).

pub mod backend;
pub mod backends;
pub mod cache;
pub mod device;
pub mod error;
pub mod graphs;
pub mod kept;
pub mod layer;
pub mod layout;
pub mod local;
pub mod maps;
pub mod metadata;
pub mod tap;

pub use backend::{
    backend_by_name, validate_forward_inputs, validate_step, AttentionBackend, AttentionMetadata,
    KernelTime, BACKEND_NAMES, CPU_FLASH, CPU_REFERENCE, DECODE_THRESHOLD,
};
pub use backends::cpu_flash::{CpuFlashBackend, FlashTuning};
pub use backends::cpu_reference::CpuReferenceBackend;
pub use backends::kernels::{probabilities_from_logits, row_probabilities};
pub use backends::row_scorer::RowScorer;
pub use cache::{round_to_dtype, CacheStorage, PagedKvCache};
pub use device::{host_f32, tensor3, Device, HostF32, LayerKvCache, Tensor};
pub use error::AttnError;
pub use graphs::{GraphKey, GraphStats, StepGraphs, MAX_GRAPH_PROBABILITY_BYTES};
pub use kept::{KeptHeads, KeptRows, MapQueries};
pub use layer::AttentionLayerSpec;
pub use layout::{CacheGeometry, KvCacheLayout, KvCacheShape, NamedStrides};
pub use local::{make_local_attention_virtual_batches, LocalVirtualBatch};
pub use maps::{combine_heads, top_k, HeadCombine, ProbabilityMap, ProbabilityMapJob};
pub use metadata::{
    reorder_batch_to_split_decodes_and_prefills, slot_for_position, split_decodes_and_prefills,
    BlockTable, CommonAttentionMetadata, DecodePrefillSplit, ScheduledSeq,
};
pub use tap::{AttentionTap, RecordedRows, RowProbabilities};
