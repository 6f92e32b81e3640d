//! What a request asks to capture, checked against the model, and how big the result
//! will be — known before any work starts.

use std::ops::Range;

use lantern_attn::{AttentionLayerSpec, RowScorer};

use crate::error::CaptureError;
pub use crate::spans::{CaptureSpan, SpanAt, SpanText};
pub use crate::stats::{KeyStat, StatHeads};

/// Which query rows (absolute positions) to capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowSelection {
    All,
    Prompt,
    Generated,
    /// `start..end` over absolute positions.
    Range {
        start: usize,
        end: usize,
    },
}

impl RowSelection {
    /// Parses `all`, `prompt`, `generated` or `start:end` (either side may be empty).
    pub fn parse(s: &str) -> Result<Self, CaptureError> {
        let bad = |message: String| CaptureError::InvalidField {
            field: "attn_capture_rows",
            message,
        };
        match s.trim() {
            "all" => Ok(Self::All),
            "prompt" => Ok(Self::Prompt),
            "generated" => Ok(Self::Generated),
            other => {
                let Some((a, b)) = other.split_once(':') else {
                    return Err(bad(format!(
                        "{other:?} is not \"all\", \"prompt\", \"generated\" or \"start:end\""
                    )));
                };
                let num = |x: &str, default: usize| -> Result<usize, CaptureError> {
                    let x = x.trim();
                    if x.is_empty() {
                        Ok(default)
                    } else {
                        x.parse()
                            .map_err(|_| bad(format!("{x:?} in {other:?} is not a position")))
                    }
                };
                let (start, end) = (num(a, 0)?, num(b, usize::MAX)?);
                if start >= end {
                    return Err(bad(format!("{other:?} is an empty range")));
                }
                Ok(Self::Range { start, end })
            }
        }
    }

    /// The positions selected in a sequence whose first `prompt_len` of `total_len`
    /// tokens are the prompt.
    pub fn positions(&self, prompt_len: usize, total_len: usize) -> Range<usize> {
        let r = match *self {
            Self::All => 0..total_len,
            Self::Prompt => 0..prompt_len,
            Self::Generated => prompt_len..total_len,
            Self::Range { start, end } => start..end,
        };
        r.start.min(total_len)..r.end.min(total_len).max(r.start.min(total_len))
    }

    /// The name used on the wire.
    pub fn describe(&self) -> String {
        match self {
            Self::All => "all".into(),
            Self::Prompt => "prompt".into(),
            Self::Generated => "generated".into(),
            Self::Range { start, end } if *end == usize::MAX => format!("{start}:"),
            Self::Range { start, end } => format!("{start}:{end}"),
        }
    }
}

/// How heads are combined into one map, if at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadReduce {
    None,
    MeanHeads,
    MaxHeads,
}

impl From<HeadReduce> for lantern_attn::HeadCombine {
    fn from(reduce: HeadReduce) -> Self {
        match reduce {
            HeadReduce::None => Self::Each,
            HeadReduce::MeanHeads => Self::Mean,
            HeadReduce::MaxHeads => Self::Max,
        }
    }
}

impl HeadReduce {
    pub fn parse(s: &str) -> Result<Self, CaptureError> {
        match s.trim() {
            "none" => Ok(Self::None),
            "mean_heads" => Ok(Self::MeanHeads),
            "max_heads" => Ok(Self::MaxHeads),
            other => Err(CaptureError::InvalidField {
                field: "attn_capture_reduce",
                message: format!("{other:?} is not \"none\", \"mean_heads\" or \"max_heads\""),
            }),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::MeanHeads => "mean_heads",
            Self::MaxHeads => "max_heads",
        }
    }
}

/// Element type of the delivered maps (computation is always f32).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaptureDtype {
    Float32,
    Float16,
}

impl CaptureDtype {
    pub fn parse(s: &str) -> Result<Self, CaptureError> {
        match s.trim() {
            "float32" => Ok(Self::Float32),
            "float16" => Ok(Self::Float16),
            other => Err(CaptureError::InvalidField {
                field: "attn_capture_dtype",
                message: format!("{other:?} is not \"float32\" or \"float16\""),
            }),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Float32 => "float32",
            Self::Float16 => "float16",
        }
    }

    pub fn size_bytes(self) -> u64 {
        match self {
            Self::Float32 => 4,
            Self::Float16 => 2,
        }
    }
}

/// What one request captures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureSpec {
    /// Layer indices, ascending, without repeats.
    pub layers: Vec<usize>,
    /// Query heads, ascending, without repeats.
    pub heads: Vec<usize>,
    pub rows: RowSelection,
    pub reduce: HeadReduce,
    /// Keep the `k` largest keys per row (values and key positions).
    pub top_k: Option<usize>,
    pub dtype: CaptureDtype,
    /// Also keep each captured row's attention output (the backend's result), so that
    /// `P · V` can be checked against what the model used. For verification.
    pub keep_attention_output: bool,
    /// Key statistics over the captured rows, ascending, without repeats.
    pub stats: Vec<KeyStat>,
    /// Over which heads the statistics are kept.
    pub stats_heads: StatHeads,
    /// Whether the maps are delivered (off for statistics or spans alone).
    pub maps: bool,
    /// Labelled spans of the prompt whose attention mass each row gives (over the
    /// groups of `stats_heads`); resolved to tokens before the request runs.
    pub spans: Vec<CaptureSpan>,
    /// With spans named by text: the characters of each prompt token.
    pub span_text: Option<SpanText>,
    /// Streamed responses: each captured row's span masses and top-k keys are computed
    /// as the row is run and sent with the token it samples ([`crate::live`]).
    pub stream_rows: bool,
}

impl CaptureSpec {
    /// Every layer and head, every row, full maps in f32.
    pub fn everything(num_layers: usize, num_heads: usize) -> Self {
        Self {
            layers: (0..num_layers).collect(),
            heads: (0..num_heads).collect(),
            rows: RowSelection::All,
            reduce: HeadReduce::None,
            top_k: None,
            dtype: CaptureDtype::Float32,
            keep_attention_output: false,
            stats: Vec::new(),
            stats_heads: StatHeads::Kv,
            maps: true,
            spans: Vec::new(),
            span_text: None,
            stream_rows: false,
        }
    }

    /// Checks layers and heads against the model (`num_heads` is the smallest query
    /// head count of the captured layers), sorts and dedups them.
    pub fn validate(&mut self, num_layers: usize, num_heads: usize) -> Result<(), CaptureError> {
        self.layers.sort_unstable();
        self.layers.dedup();
        self.heads.sort_unstable();
        self.heads.dedup();
        self.stats.sort_unstable();
        self.stats.dedup();
        if !self.maps && self.stats.is_empty() && self.spans.is_empty() {
            return Err(CaptureError::InvalidField {
                field: "attn_capture_maps",
                message: "attn_capture_maps is false and no attn_capture_stats or attn_capture_spans are asked for: nothing would be captured".into(),
            });
        }
        crate::spans::check_spans(&self.spans)?;
        if self.layers.is_empty() {
            return Err(CaptureError::InvalidField {
                field: "attn_capture_layers",
                message: "no layer selected".into(),
            });
        }
        if let Some(&l) = self.layers.iter().find(|&&l| l >= num_layers) {
            return Err(CaptureError::InvalidField {
                field: "attn_capture_layers",
                message: format!(
                    "layer {l} is out of range: the model has {num_layers} layers (0..{})",
                    num_layers.saturating_sub(1)
                ),
            });
        }
        if self.heads.is_empty() {
            return Err(CaptureError::InvalidField {
                field: "attn_capture_heads",
                message: "no head selected".into(),
            });
        }
        if let Some(&h) = self.heads.iter().find(|&&h| h >= num_heads) {
            return Err(CaptureError::InvalidField {
                field: "attn_capture_heads",
                message: format!(
                    "head {h} is out of range: the model has {num_heads} query heads (0..{})",
                    num_heads.saturating_sub(1)
                ),
            });
        }
        if self.top_k == Some(0) {
            return Err(CaptureError::InvalidField {
                field: "attn_capture_top_k",
                message: "must be at least 1".into(),
            });
        }
        Ok(())
    }

    /// Heads per map after the reduction.
    pub fn output_heads(&self) -> usize {
        match self.reduce {
            HeadReduce::None => self.heads.len(),
            HeadReduce::MeanHeads | HeadReduce::MaxHeads => 1,
        }
    }

    /// Upper bound of the delivered size in bytes for a prompt of `prompt_len` tokens
    /// and up to `max_tokens` generated ones (the maps and top-k indices, before
    /// compression). Only the rows asked for count, and only the keys they can see:
    /// a map's columns end at its last row (attention is causal), so prompt rows cost
    /// the same whatever `max_tokens` is. Admission adds [`Self::working_bytes`].
    pub fn estimate_bytes(&self, prompt_len: usize, max_tokens: usize) -> u64 {
        self.map_bytes(prompt_len, max_tokens)
            .saturating_add(self.stats_bytes(prompt_len, max_tokens))
            .saturating_add(self.span_bytes(prompt_len, max_tokens))
    }

    /// The span masses' part of [`Self::estimate_bytes`]: per layer, row, group and
    /// span (and the rest), in f32; and the meta's mapping (two offsets per prompt
    /// token, the rendered chat prompt).
    fn span_bytes(&self, prompt_len: usize, max_tokens: usize) -> u64 {
        if self.spans.is_empty() {
            return 0;
        }
        let mapping = self.span_text.as_ref().map_or(0, |t| {
            (t.offsets.len() as u64)
                .saturating_mul(16)
                .saturating_add(t.prompt.as_ref().map_or(0, |p| p.len() as u64))
        });
        self.span_mass_bytes(prompt_len, max_tokens)
            .saturating_add(mapping)
    }

    /// The span masses alone: per layer, row, group and span (and the rest), in f32.
    fn span_mass_bytes(&self, prompt_len: usize, max_tokens: usize) -> u64 {
        if self.spans.is_empty() {
            return 0;
        }
        let total = prompt_len.saturating_add(max_tokens);
        let rows = self.rows.positions(prompt_len, total).len() as u64;
        let groups = self.stats_heads.max_groups(self.heads.len()) as u64;
        [
            self.layers.len() as u64,
            rows,
            groups,
            self.spans.len() as u64 + 1,
            4,
        ]
        .into_iter()
        .fold(1u64, u64::saturating_mul)
    }

    /// The maps' part of [`Self::estimate_bytes`] (none without maps).
    fn map_bytes(&self, prompt_len: usize, max_tokens: usize) -> u64 {
        if !self.maps {
            return 0;
        }
        let total = prompt_len.saturating_add(max_tokens);
        let rows = self.rows.positions(prompt_len, total);
        let keys = rows.end as u64;
        let per_row_head = match self.top_k {
            Some(k) => (k as u64).min(keys) * (self.dtype.size_bytes() + 4),
            None => keys * self.dtype.size_bytes(),
        };
        (self.layers.len() as u64)
            .saturating_mul(self.output_heads() as u64)
            .saturating_mul(rows.len() as u64)
            .saturating_mul(per_row_head)
    }

    /// Statistics series kept per layer and group: those delivered, and key mass,
    /// which block mass is made from, when it is not.
    fn stats_series(&self) -> u64 {
        if self.stats.is_empty() {
            return 0;
        }
        self.stats.len() as u64 + u64::from(!self.stats.contains(&KeyStat::KeyMass))
    }

    /// The key statistics' part of [`Self::estimate_bytes`]: per layer, series, group
    /// and key (a block holds at least one key), in f32.
    fn stats_bytes(&self, prompt_len: usize, max_tokens: usize) -> u64 {
        let total = prompt_len.saturating_add(max_tokens);
        let keys = self.rows.positions(prompt_len, total).end as u64;
        let groups = self.stats_heads.max_groups(self.heads.len()) as u64;
        [
            self.layers.len() as u64,
            self.stats_series(),
            groups,
            keys,
            4,
        ]
        .into_iter()
        .fold(1u64, u64::saturating_mul)
    }

    /// Bytes a capture holds while it runs beyond what it delivers (an upper bound, for
    /// a prompt of `prompt_len` tokens and up to `max_tokens` generated ones on layers
    /// of `geometry`): the sum of [`AdmissionParts`]' working parts.
    pub fn working_bytes(
        &self,
        prompt_len: usize,
        max_tokens: usize,
        geometry: CaptureGeometry,
    ) -> u64 {
        self.admission_parts(prompt_len, max_tokens, geometry)
            .working()
    }

    /// The parts of the admission figure: the maps delivered, and what computing and
    /// encoding them holds — the query rows buffered during the steps (and the
    /// attention outputs with `keep_attention_output`), the keys (and values) copied
    /// out of the cache for every captured layer, the maps as finalizing holds them
    /// (f32 values and u32 indices whatever the wire dtype, alive while they are
    /// encoded), two rows of every head with their scratch and each kv head's keys
    /// transposed for scoring two rows at a time, the positions and tokens of the
    /// metadata, and the copy the safetensors encoder makes.
    pub fn admission_parts(
        &self,
        prompt_len: usize,
        max_tokens: usize,
        geometry: CaptureGeometry,
    ) -> AdmissionParts {
        let total = prompt_len.saturating_add(max_tokens) as u64;
        let rows = self
            .rows
            .positions(prompt_len, prompt_len.saturating_add(max_tokens));
        let (num_rows, keys) = (rows.len() as u64, rows.end as u64);
        let layers = self.layers.len() as u64;
        let heads = self.heads.len() as u64;
        let head_dim = geometry.head_dim as u64;
        let copies = if self.keep_attention_output { 2 } else { 1 };
        let mul = |factors: &[u64]| factors.iter().fold(1u64, |a, &b| a.saturating_mul(b));
        let width = self.top_k.map_or(keys, |k| (k as u64).min(keys));
        let per_value = if self.top_k.is_some() { 4 + 4 } else { 4 };
        // Two rows of every head (`dense`), the reduced row and the top-k selection order
        // (usize per key), and the keys as the two-row scorer reads them.
        let scorer_bytes = (geometry.num_kv_heads as u64).saturating_mul(RowScorer::held_bytes(
            usize::try_from(keys).unwrap_or(usize::MAX),
            geometry.head_dim,
        ));
        let scratch = mul(&[keys, 2 * heads * 4 + 4 + 8]).saturating_add(scorer_bytes);
        // With statistics: one row of every group, and the running sums beside the
        // copies finishing makes.
        let groups = self.stats_heads.max_groups(self.heads.len()) as u64;
        let stats_scratch =
            mul(&[keys, groups, (self.stats_series() + 1) * 4]) * u64::from(!self.stats.is_empty());
        // With spans: one row of every group, the key -> span table, and the masses
        // summed as the rows run beside the copy finishing makes.
        let span_scratch = (mul(&[keys, groups * 4 + 4]) * u64::from(!self.spans.is_empty()))
            .saturating_add(self.span_mass_bytes(prompt_len, max_tokens));
        let metadata = mul(&[num_rows.saturating_add(keys), 8]).saturating_add(mul(&[
            total,
            2,
            TOKEN_META_BYTES,
        ]));
        AdmissionParts {
            delivered: self.estimate_bytes(prompt_len, max_tokens),
            queries: mul(&[copies, layers, num_rows, heads, head_dim, 4]),
            keys: mul(&[
                copies,
                layers,
                keys,
                geometry.num_kv_heads as u64,
                head_dim,
                4,
            ]),
            f32_maps: mul(&[
                u64::from(self.maps),
                layers,
                self.output_heads() as u64,
                num_rows,
                width,
                per_value,
            ]),
            scratch_and_metadata: scratch
                .saturating_add(stats_scratch)
                .saturating_add(span_scratch)
                .saturating_add(metadata),
            encoding: self.encoding_bytes(prompt_len, max_tokens),
        }
    }

    /// What encoding holds beside the finalized maps and the encoded bytes: the
    /// safetensors encoder (reference and file delivery) copies the maps into the wire
    /// dtype before serializing them, one more delivered size.
    pub fn encoding_bytes(&self, prompt_len: usize, max_tokens: usize) -> u64 {
        self.estimate_bytes(prompt_len, max_tokens)
    }

    /// What admission compares with the cap: the delivered maps ([`Self::estimate_bytes`]),
    /// what computing them holds ([`Self::working_bytes`]) and what encoding them holds
    /// ([`Self::encoding_bytes`]).
    pub fn admission_bytes(
        &self,
        prompt_len: usize,
        max_tokens: usize,
        geometry: CaptureGeometry,
    ) -> u64 {
        self.admission_parts(prompt_len, max_tokens, geometry)
            .total()
    }

    /// The most tokens (up to `room`) a request may generate with its capture's
    /// admission figure at most `limit_bytes`: `room` when the rows asked for do not
    /// grow with generation, `None` when not even one token fits.
    pub fn max_tokens_within(
        &self,
        prompt_len: usize,
        room: usize,
        limit_bytes: u64,
        geometry: CaptureGeometry,
    ) -> Option<usize> {
        largest_fitting(room, |m| {
            self.admission_bytes(prompt_len, m, geometry) <= limit_bytes
        })
    }

    /// Refuses a capture whose admission figure is over `limit_bytes`, saying which
    /// part dominates and the largest `max_tokens` that would fit.
    pub fn check_size(
        &self,
        prompt_len: usize,
        max_tokens: usize,
        limit_bytes: u64,
        geometry: CaptureGeometry,
    ) -> Result<(), CaptureError> {
        let parts = self.admission_parts(prompt_len, max_tokens, geometry);
        if parts.total() <= limit_bytes {
            return Ok(());
        }
        Err(CaptureError::TooLarge(Box::new(TooLarge {
            parts,
            limit_bytes,
            max_tokens,
            fitting_max_tokens: self.max_tokens_within(
                prompt_len,
                max_tokens,
                limit_bytes,
                geometry,
            ),
        })))
    }

    /// The positions whose rows can ever be captured for a prompt of `prompt_len`
    /// tokens generating up to `max_tokens`: the last generated token is never run
    /// through the model, so it has no query.
    pub fn possible_rows(prompt_len: usize, max_tokens: usize) -> Range<usize> {
        0..prompt_len.saturating_add(max_tokens.saturating_sub(1))
    }

    /// Refuses rows that can never exist in this request (a range past the longest
    /// the sequence can grow, `generated` with `max_tokens` under 2): a capture of no
    /// row is a mistake, never what was meant.
    pub fn check_rows(&self, prompt_len: usize, max_tokens: usize) -> Result<(), CaptureError> {
        let possible = Self::possible_rows(prompt_len, max_tokens);
        let asked = self
            .rows
            .positions(prompt_len, prompt_len.saturating_add(max_tokens));
        if asked.start < possible.end && !asked.is_empty() {
            return Ok(());
        }
        let reason = match self.rows {
            RowSelection::Generated => format!(
                "\"generated\" selects no row with max_tokens {max_tokens}: the last generated token is never run through the model, so generated rows need max_tokens of at least 2"
            ),
            _ => format!(
                "{:?} selects no row that can exist: with a prompt of {prompt_len} tokens and max_tokens {max_tokens}, rows are positions {}..{}{}",
                self.rows.describe(),
                possible.start,
                possible.end,
                if max_tokens > 0 { " (the last generated token is never run through the model)" } else { "" }
            ),
        };
        Err(CaptureError::InvalidField {
            field: "attn_capture_rows",
            message: reason,
        })
    }
}

/// The largest `m <= room` with `fits(m)`, for a `fits` that holds up to some point and
/// not after (a figure that never shrinks as `max_tokens` grows); `None` when not even
/// `min(1, room)` fits.
pub fn largest_fitting(room: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    let mut lo = 1.min(room);
    if !fits(lo) {
        return None;
    }
    let mut hi = room;
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(lo)
}

/// A capture's admission figure in parts (see [`CaptureSpec::admission_parts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionParts {
    /// The maps (and top-k indices) delivered, in the wire dtype.
    pub delivered: u64,
    /// Query rows buffered during the steps.
    pub queries: u64,
    /// Keys (and values) copied out of the KV cache for finalizing.
    pub keys: u64,
    /// The maps as finalizing holds them (f32, u32 indices).
    pub f32_maps: u64,
    pub scratch_and_metadata: u64,
    /// The copy the safetensors encoder makes.
    pub encoding: u64,
}

impl AdmissionParts {
    /// What computing the maps holds beyond what is delivered and encoded.
    pub fn working(&self) -> u64 {
        [
            self.queries,
            self.keys,
            self.f32_maps,
            self.scratch_and_metadata,
        ]
        .into_iter()
        .fold(0, u64::saturating_add)
    }

    pub fn total(&self) -> u64 {
        self.delivered
            .saturating_add(self.working())
            .saturating_add(self.encoding)
    }

    /// The largest part, with what it is in words.
    pub fn dominant(&self) -> (&'static str, u64) {
        [
            ("the maps delivered", self.delivered),
            (
                "the query rows buffered while the request runs",
                self.queries,
            ),
            ("the keys copied out of the KV cache to finalize", self.keys),
            (
                "the maps in float32 while they are finalized",
                self.f32_maps,
            ),
            ("scratch and token metadata", self.scratch_and_metadata),
            ("the maps' copy while they are encoded", self.encoding),
        ]
        .into_iter()
        // The first of equal parts: the maps before their copies.
        .fold(("the maps delivered", 0), |best, part| {
            if part.1 > best.1 {
                part
            } else {
                best
            }
        })
    }
}

/// Why a capture was refused as too large: its admission figure in parts, the cap,
/// and what would fit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooLarge {
    pub parts: AdmissionParts,
    pub limit_bytes: u64,
    /// The `max_tokens` the figure was computed for.
    pub max_tokens: usize,
    /// The largest `max_tokens` whose capture fits, when the rows asked for grow with
    /// generation and one fits at all.
    pub fitting_max_tokens: Option<usize>,
}

impl TooLarge {
    pub fn estimate_bytes(&self) -> u64 {
        self.parts.total()
    }
}

impl std::fmt::Display for TooLarge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (part, part_bytes) = self.parts.dominant();
        write!(
            f,
            "the attention capture would take about {} ({} bytes: its maps and the query rows, keys and scratch that compute them), over the limit of {} (--max-capture-bytes); most of it is {part} ({})",
            human_bytes(self.estimate_bytes()),
            self.estimate_bytes(),
            human_bytes(self.limit_bytes),
            human_bytes(part_bytes),
        )?;
        match self.fitting_max_tokens {
            Some(m) => write!(
                f,
                ". It fits with max_tokens {m} or fewer (this request's is {}, and rows and keys grow with each generated token); or ask",
                self.max_tokens
            )?,
            None => f.write_str(". Ask")?,
        }
        f.write_str(" for fewer layers, heads or rows, a reduction, top-k or float16")
    }
}

/// Bytes in binary units, one decimal (`1.5 GiB`, `256.0 MiB`, `900 bytes`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} bytes");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// Allowance per position for its [`crate::TokenInfo`] and short text, held in the
/// pending capture and again in the result's metadata.
pub const TOKEN_META_BYTES: u64 = 64;

/// The attention shape a capture's working memory depends on: the largest key/value
/// head count and head size of the captured layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CaptureGeometry {
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl CaptureGeometry {
    /// The geometry of `spec`'s layers among the model's `attention` layers.
    pub fn of_layers(spec: &CaptureSpec, attention: &[AttentionLayerSpec]) -> Self {
        spec.layers
            .iter()
            .filter_map(|&l| attention.get(l))
            .fold(Self::default(), |g, a| Self {
                num_kv_heads: g.num_kv_heads.max(a.num_kv_heads),
                head_dim: g.head_dim.max(a.head_dim),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_row_selections() {
        assert_eq!(RowSelection::parse("all").unwrap(), RowSelection::All);
        assert_eq!(RowSelection::parse("prompt").unwrap(), RowSelection::Prompt);
        assert_eq!(
            RowSelection::parse("3:7").unwrap(),
            RowSelection::Range { start: 3, end: 7 }
        );
        assert_eq!(
            RowSelection::parse("5:").unwrap(),
            RowSelection::Range {
                start: 5,
                end: usize::MAX
            }
        );
        for bad in ["", "7:3", "3:3", "x:4", "rows", "1:2:3"] {
            assert!(RowSelection::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn row_positions_clip_to_the_sequence() {
        assert_eq!(RowSelection::All.positions(4, 10), 0..10);
        assert_eq!(RowSelection::Prompt.positions(4, 10), 0..4);
        assert_eq!(RowSelection::Generated.positions(4, 10), 4..10);
        let r = RowSelection::Range { start: 8, end: 20 };
        assert_eq!(r.positions(4, 10), 8..10);
        let r = RowSelection::Range { start: 12, end: 20 };
        assert!(r.positions(4, 10).is_empty());
    }

    #[test]
    fn validate_names_the_field() {
        let mut s = CaptureSpec::everything(30, 9);
        s.validate(30, 9).unwrap();
        s.layers = vec![3, 30];
        let e = s.clone().validate(30, 9).unwrap_err().to_string();
        assert!(e.contains("attn_capture_layers") && e.contains("30"), "{e}");
        s.layers = vec![1];
        s.heads = vec![9];
        let e = s.validate(30, 9).unwrap_err().to_string();
        assert!(e.contains("attn_capture_heads"), "{e}");
    }

    #[test]
    fn estimate_counts_layers_heads_rows_keys() {
        let mut s = CaptureSpec::everything(2, 3);
        // 2 layers x 3 heads x 10 rows x 10 keys x 4 bytes
        assert_eq!(s.estimate_bytes(6, 4), 2 * 3 * 10 * 10 * 4);
        s.reduce = HeadReduce::MeanHeads;
        s.dtype = CaptureDtype::Float16;
        assert_eq!(s.estimate_bytes(6, 4), 2 * 10 * 10 * 2);
        s.top_k = Some(3);
        assert_eq!(s.estimate_bytes(6, 4), 2 * 10 * 3 * (2 + 4));
        let figure = s.admission_bytes(6, 4, GEOMETRY);
        assert!(figure > s.estimate_bytes(6, 4));
        assert!(s.check_size(6, 4, figure - 1, GEOMETRY).is_err());
        assert!(s.check_size(6, 4, figure, GEOMETRY).is_ok());
    }

    #[test]
    fn estimate_counts_only_the_rows_asked_for_and_the_keys_they_see() {
        let mut s = CaptureSpec::everything(2, 3);
        s.rows = RowSelection::Prompt;
        // 6 prompt rows see 6 keys, however long the generation.
        assert_eq!(s.estimate_bytes(6, 0), 2 * 3 * 6 * 6 * 4);
        assert_eq!(s.estimate_bytes(6, 1_000_000), 2 * 3 * 6 * 6 * 4);
        s.rows = RowSelection::Generated;
        assert_eq!(s.estimate_bytes(6, 4), 2 * 3 * 4 * 10 * 4);
        assert_eq!(s.estimate_bytes(6, 0), 0);
        s.rows = RowSelection::Range { start: 2, end: 5 };
        assert_eq!(s.estimate_bytes(6, 100), 2 * 3 * 3 * 5 * 4);
    }

    const GEOMETRY: CaptureGeometry = CaptureGeometry {
        num_kv_heads: 1,
        head_dim: 8,
    };

    #[test]
    fn working_bytes_count_queries_keys_f32_maps_and_scratch() {
        // 1,000 prompt rows of 30 layers, 9 heads of 64 (3 kv heads), top-1: the maps
        // delivered are a few hundred KB, the queries alone 69 MB.
        let mut s = CaptureSpec::everything(30, 9);
        s.rows = RowSelection::Prompt;
        s.reduce = HeadReduce::MeanHeads;
        s.top_k = Some(1);
        let g = CaptureGeometry {
            num_kv_heads: 3,
            head_dim: 64,
        };
        let (n, layers) = (1000u64, 30u64);
        assert_eq!(s.estimate_bytes(1000, 0), layers * n * (4 + 4));
        let queries = layers * n * 9 * 64 * 4;
        let keys = layers * n * 3 * 64 * 4;
        let f32_maps = layers * n * (4 + 4);
        // Two rows of every head, the reduced row and the top-k order; each kv head's
        // keys transposed in blocks of 16 (1,008 keys) and two rows of scores.
        let scratch = n * (2 * 9 * 4 + 4 + 8) + 3 * (1008 * 64 + 2 * (n + 16)) * 4;
        let metadata = 2 * n * 8 + 2 * n * TOKEN_META_BYTES;
        let working = queries + keys + f32_maps + scratch + metadata;
        assert_eq!(s.working_bytes(1000, 0, g), working);
        // The maps delivered, and once more while safetensors encodes them.
        assert_eq!(s.admission_bytes(1000, 0, g), working + 2 * layers * n * 8);
        assert!(queries > 69_000_000);
        // Outputs kept beside the queries, and values beside the keys, double both.
        s.keep_attention_output = true;
        assert_eq!(s.working_bytes(1000, 0, g), working + queries + keys);
        let e = s.check_size(1000, 0, 1 << 20, g).unwrap_err().to_string();
        let figure = s.admission_bytes(1000, 0, g);
        assert!(e.contains(&figure.to_string()), "{e}");
    }

    #[test]
    fn bytes_in_binary_units() {
        assert_eq!(human_bytes(900), "900 bytes");
        assert_eq!(human_bytes(20 << 10), "20.0 KiB");
        assert_eq!(human_bytes(256 << 20), "256.0 MiB");
        assert_eq!(human_bytes(13_157_767_596), "12.3 GiB");
    }

    #[test]
    fn rows_that_can_exist_end_before_the_last_generated_token() {
        assert_eq!(CaptureSpec::possible_rows(9, 0), 0..9);
        assert_eq!(CaptureSpec::possible_rows(9, 1), 0..9);
        assert_eq!(CaptureSpec::possible_rows(9, 5), 0..13);
        let mut s = CaptureSpec::everything(1, 1);
        for (rows, max_tokens, ok) in [
            (RowSelection::Generated, 1, false),
            (RowSelection::Generated, 2, true),
            (RowSelection::Range { start: 12, end: 20 }, 5, true),
            (RowSelection::Range { start: 12, end: 20 }, 4, false),
            (RowSelection::Prompt, 0, true),
        ] {
            s.rows = rows;
            let result = s.check_rows(9, max_tokens);
            assert_eq!(result.is_ok(), ok, "{rows:?} {max_tokens}: {result:?}");
        }
    }

    #[test]
    fn too_large_names_the_dominant_part_and_what_fits() {
        let mut s = CaptureSpec::everything(4, 4);
        s.rows = RowSelection::Prompt;
        s.top_k = Some(1);
        // Top-1 of prompt rows: the buffered queries dominate, whatever max_tokens is.
        let g = CaptureGeometry {
            num_kv_heads: 1,
            head_dim: 256,
        };
        let Err(CaptureError::TooLarge(e)) = s.check_size(1000, 8, 1 << 20, g) else {
            panic!("over the cap");
        };
        assert_eq!(
            e.parts.dominant().0,
            "the query rows buffered while the request runs"
        );
        assert_eq!(e.fitting_max_tokens, None);
        assert!(e.to_string().contains("limit of 1.0 MiB"), "{e}");
    }

    #[test]
    fn geometry_is_the_largest_of_the_captured_layers() {
        let attention = [
            AttentionLayerSpec::new(8, 2, 64),
            AttentionLayerSpec::new(8, 4, 32),
            AttentionLayerSpec::new(8, 8, 128),
        ];
        let mut s = CaptureSpec::everything(3, 8);
        s.layers = vec![0, 1];
        let g = CaptureGeometry::of_layers(&s, &attention);
        assert_eq!((g.num_kv_heads, g.head_dim), (4, 64));
    }

    #[test]
    fn max_tokens_within_the_cap() {
        let mut s = CaptureSpec::everything(1, 1);
        let fits = |s: &CaptureSpec, p, m| s.admission_bytes(p, m, GEOMETRY) <= 4000;
        // The figure grows with every row: a prompt of 4 leaves the most tokens that fit.
        let m = s.max_tokens_within(4, 1000, 4000, GEOMETRY).unwrap();
        assert!(m > 0 && fits(&s, 4, m) && !fits(&s, 4, m + 1), "{m}");
        assert_eq!(s.max_tokens_within(4, m - 1, 4000, GEOMETRY), Some(m - 1));
        assert_eq!(s.max_tokens_within(4 + m, 1000, 4000, GEOMETRY), None);
        s.rows = RowSelection::Prompt;
        // Prompt rows do not grow with generation (only the tokens' metadata does).
        let p = 8;
        assert!(fits(&s, p, 1));
        assert!(s.max_tokens_within(p, 1000, 4000, GEOMETRY).unwrap() >= 1);
        assert_eq!(s.max_tokens_within(4, 0, 4000, GEOMETRY), Some(0));
    }
}
