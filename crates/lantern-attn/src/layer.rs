//! The one description of a layer's attention: heads, scale, masks, soft-cap and sinks.
//!
//! Every backend and attention capture take the mask and the score transform from here,
//! so a captured attention map is by construction the one the kernel computed. Nothing
//! else in the crate re-derives which keys a query sees or how a raw dot product
//! becomes a logit.

use std::ops::Range;

use crate::error::AttnError;

/// How one attention layer attends.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionLayerSpec {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies the raw `q . k` (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// A query at position `p` sees keys `p - w + 1 ..= p` (at most `w` keys, itself included).
    pub sliding_window: Option<usize>,
    /// Chunked-local attention (Llama 4): a query sees only keys in its own chunk of `C` positions.
    pub chunk_size: Option<usize>,
    /// Gemma-2 style logit soft-cap: `cap * tanh(s / cap)`, applied after scaling.
    pub logits_soft_cap: Option<f32>,
    /// gpt-oss style attention sinks, one logit per query head: the sink joins the
    /// softmax denominator (as `exp(sink - max)`) but has no value, so it only takes
    /// probability mass away from the keys. It is used as given: no scale, no soft-cap.
    pub sinks: Option<Vec<f32>>,
}

impl AttentionLayerSpec {
    /// Plain causal attention with the usual `1 / sqrt(head_dim)` scale.
    pub fn new(num_heads: usize, num_kv_heads: usize, head_dim: usize) -> Self {
        Self {
            num_heads,
            num_kv_heads,
            head_dim,
            scale: 1.0 / (head_dim.max(1) as f32).sqrt(),
            sliding_window: None,
            chunk_size: None,
            logits_soft_cap: None,
            sinks: None,
        }
    }

    /// Checks that the description is usable: non-zero sizes, query heads a multiple of
    /// kv heads, finite scale, non-zero window and chunk, a positive finite soft-cap and
    /// one finite sink per query head.
    pub fn validate(&self) -> Result<(), AttnError> {
        let bad = |msg: String| Err(AttnError::InvalidLayerSpec(msg));
        if self.num_heads == 0 || self.num_kv_heads == 0 || self.head_dim == 0 {
            return bad(format!(
                "num_heads {}, num_kv_heads {} and head_dim {} must be non-zero",
                self.num_heads, self.num_kv_heads, self.head_dim
            ));
        }
        if self.num_heads.checked_rem(self.num_kv_heads) != Some(0) {
            return bad(format!(
                "num_heads {} is not a multiple of num_kv_heads {}",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.scale.is_finite() {
            return bad(format!("scale {} is not finite", self.scale));
        }
        if self.sliding_window == Some(0) {
            return bad("sliding_window must be non-zero".into());
        }
        if self.chunk_size == Some(0) {
            return bad("chunk_size must be non-zero".into());
        }
        if let Some(cap) = self.logits_soft_cap {
            if !(cap.is_finite() && cap > 0.0) {
                return bad(format!("logits_soft_cap {cap} must be positive and finite"));
            }
        }
        if let Some(sinks) = &self.sinks {
            if sinks.len() != self.num_heads {
                return bad(format!(
                    "{} sinks for {} query heads",
                    sinks.len(),
                    self.num_heads
                ));
            }
            if sinks.iter().any(|s| !s.is_finite()) {
                return bad("sinks must be finite".into());
            }
        }
        Ok(())
    }

    /// Query heads per kv head (the GQA group size); 1 for an invalid spec.
    pub fn group_size(&self) -> usize {
        self.num_heads
            .checked_div(self.num_kv_heads)
            .unwrap_or(1)
            .max(1)
    }

    /// The kv head that query head `h` reads: `h / (num_heads / num_kv_heads)`.
    pub fn kv_head_for(&self, query_head: usize) -> usize {
        query_head / self.group_size()
    }

    /// Whether the query at absolute position `query_pos` sees the key at `key_pos`:
    /// causal, inside the sliding window, and in the same chunk.
    pub fn key_visible(&self, query_pos: usize, key_pos: usize) -> bool {
        if key_pos > query_pos {
            return false;
        }
        if let Some(w) = self.sliding_window {
            if query_pos - key_pos >= w {
                return false;
            }
        }
        if let Some(c) = self.chunk_size {
            // checked_div: a zero chunk (rejected by `validate`) must not panic here.
            if query_pos.checked_div(c) != key_pos.checked_div(c) {
                return false;
            }
        }
        true
    }

    /// The keys the query at `query_pos` sees, as one contiguous range that always
    /// contains `query_pos` itself. Equal to the set where [`Self::key_visible`] holds.
    pub fn visible_key_range(&self, query_pos: usize) -> Range<usize> {
        let mut start = 0;
        if let Some(w) = self.sliding_window {
            start = start.max((query_pos + 1).saturating_sub(w));
        }
        if let Some(c) = self.chunk_size.filter(|&c| c > 0) {
            start = start.max(query_pos / c * c);
        }
        start..query_pos + 1
    }

    /// Turns a raw `q . k` into the logit the softmax sees: scale, then soft-cap.
    #[inline]
    pub fn transform_score(&self, raw_dot: f32) -> f32 {
        let s = raw_dot * self.scale;
        match self.logits_soft_cap {
            Some(cap) => cap * (s / cap).tanh(),
            None => s,
        }
    }

    /// The sink logit of query head `h`, if the layer has sinks.
    #[inline]
    pub fn sink_logit(&self, query_head: usize) -> Option<f32> {
        self.sinks.as_ref().and_then(|s| s.get(query_head).copied())
    }

    /// Turns the logits of one query row (query head `query_head`, visible keys only)
    /// into probabilities in place: max-subtracted softmax whose denominator includes the
    /// head's sink. With a sink the row sums to less than 1; the rest is the sink's share.
    pub fn softmax_in_place(&self, query_head: usize, logits: &mut [f32]) {
        let sink = self.sink_logit(query_head);
        let max = logits
            .iter()
            .copied()
            .chain(sink)
            .fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            logits.iter_mut().for_each(|x| *x = 0.0);
            return;
        }
        let mut sum = sink.map_or(0.0, |s| (s - max).exp());
        for x in logits.iter_mut() {
            *x = (*x - max).exp();
            sum += *x;
        }
        let inv = 1.0 / sum;
        logits.iter_mut().for_each(|x| *x *= inv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gqa_head_mapping() {
        let spec = AttentionLayerSpec::new(8, 2, 16);
        assert_eq!(
            (0..8).map(|h| spec.kv_head_for(h)).collect::<Vec<_>>(),
            [0, 0, 0, 0, 1, 1, 1, 1]
        );
        let mqa = AttentionLayerSpec::new(4, 1, 16);
        assert!((0..4).all(|h| mqa.kv_head_for(h) == 0));
    }

    #[test]
    fn visible_range_matches_key_visible() {
        for window in [None, Some(1), Some(3), Some(8)] {
            for chunk in [None, Some(1), Some(4), Some(5)] {
                let mut spec = AttentionLayerSpec::new(2, 1, 4);
                spec.sliding_window = window;
                spec.chunk_size = chunk;
                for q in 0..20 {
                    let range = spec.visible_key_range(q);
                    assert!(range.contains(&q));
                    for k in 0..25 {
                        assert_eq!(
                            range.contains(&k),
                            spec.key_visible(q, k),
                            "{window:?} {chunk:?} q{q} k{k}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn window_sees_at_most_w_keys() {
        let mut spec = AttentionLayerSpec::new(1, 1, 4);
        spec.sliding_window = Some(3);
        assert_eq!(spec.visible_key_range(10), 8..11);
        assert_eq!(spec.visible_key_range(1), 0..2);
    }

    #[test]
    fn soft_cap_and_scale() {
        let mut spec = AttentionLayerSpec::new(1, 1, 4);
        spec.scale = 0.5;
        assert_eq!(spec.transform_score(4.0), 2.0);
        spec.logits_soft_cap = Some(1.0);
        assert!((spec.transform_score(4.0) - 2f32.tanh()).abs() < 1e-7);
    }

    #[test]
    fn sinks_take_mass_from_keys() {
        let mut spec = AttentionLayerSpec::new(1, 1, 4);
        let mut p = [0.0f32, 0.0];
        spec.softmax_in_place(0, &mut p);
        assert_eq!(p, [0.5, 0.5]);
        spec.sinks = Some(vec![0.0]);
        let mut p = [0.0f32, 0.0];
        spec.softmax_in_place(0, &mut p);
        assert!((p[0] - 1.0 / 3.0).abs() < 1e-7 && (p[1] - 1.0 / 3.0).abs() < 1e-7);
    }

    #[test]
    fn validate_rejects_bad_specs() {
        assert!(AttentionLayerSpec::new(6, 4, 8).validate().is_err());
        assert!(AttentionLayerSpec::new(0, 1, 8).validate().is_err());
        let mut s = AttentionLayerSpec::new(4, 2, 8);
        s.validate().unwrap();
        s.sinks = Some(vec![0.0; 3]);
        assert!(s.validate().is_err());
        s.sinks = None;
        s.logits_soft_cap = Some(0.0);
        assert!(s.validate().is_err());
        s.logits_soft_cap = None;
        s.sliding_window = Some(0);
        assert!(s.validate().is_err());
    }
}
