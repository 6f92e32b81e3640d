//! Spans: labelled ranges of the prompt (retrieved passages, chat messages), and the
//! attention mass each captured row gives each of them — what RAG grounding and
//! citation research measures — computed from the same probabilities as the maps, one
//! row at a time.
//!
//! A request names spans by prompt tokens, by characters of a completion prompt, by a
//! chat message, or by characters inside one message. Character and message spans are
//! resolved to tokens before the request runs ([`resolve_spans`]), from each prompt
//! token's bytes in the prompt text; characters are Unicode code points (as Python's
//! `str` counts them).

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::CaptureError;

/// Most spans one request may name.
pub const MAX_SPANS: usize = 256;

/// The request field spans come from (every error about them names it).
pub const SPANS_FIELD: &str = "attn_capture_spans";

/// Where a span lies, as the request named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SpanAt {
    /// Prompt tokens `[start, end)`.
    Tokens(Range<usize>),
    /// Characters `[start, end)` of a completion prompt.
    Chars(Range<usize>),
    /// A chat message's whole content.
    Message(usize),
    /// Characters `[start, end)` of a chat message's content.
    MessageChars(usize, Range<usize>),
}

/// One labelled span of the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaptureSpan {
    pub label: String,
    pub at: SpanAt,
    /// Its prompt tokens, once resolved (at once for token spans).
    pub tokens: Option<Range<usize>>,
    /// Character and message spans: its characters in the prompt text (the rendered
    /// prompt for chat), once resolved.
    pub prompt_chars: Option<Range<usize>>,
    /// Character and message spans: whether a boundary falls inside a token (the token
    /// then belongs to the span; the span covers more text than was asked).
    pub cuts_token: bool,
}

impl CaptureSpan {
    pub fn new(label: impl Into<String>, at: SpanAt) -> Self {
        let tokens = match &at {
            SpanAt::Tokens(r) => Some(r.clone()),
            _ => None,
        };
        Self {
            label: label.into(),
            at,
            tokens,
            prompt_chars: None,
            cuts_token: false,
        }
    }

    /// A span of prompt tokens `tokens`.
    pub fn tokens(label: impl Into<String>, tokens: Range<usize>) -> Self {
        Self::new(label, SpanAt::Tokens(tokens))
    }

    /// The span as the meta describes it (once resolved).
    pub fn info(&self) -> SpanInfo {
        let tokens = self.tokens.clone().unwrap_or(0..0);
        let pair = |r: &Range<usize>| [r.start, r.end];
        let (message, chars) = match &self.at {
            SpanAt::Tokens(_) => (None, None),
            SpanAt::Chars(r) => (None, Some(pair(r))),
            SpanAt::Message(m) => (Some(*m), None),
            SpanAt::MessageChars(m, r) => (Some(*m), Some(pair(r))),
        };
        let by_text = !matches!(self.at, SpanAt::Tokens(_));
        SpanInfo {
            label: self.label.clone(),
            tokens: [tokens.start, tokens.end],
            message,
            chars,
            prompt_chars: self.prompt_chars.as_ref().map(pair),
            cuts_token: by_text.then_some(self.cuts_token),
        }
    }
}

/// One span in the meta (`spans`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpanInfo {
    pub label: String,
    /// Prompt tokens `[start, end)`: the keys whose mass is the span's.
    pub tokens: [usize; 2],
    /// Message spans: the message's index in `messages`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<usize>,
    /// Character spans: the characters asked (of the prompt, or of the message).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chars: Option<[usize; 2]>,
    /// Character and message spans: the characters in the prompt text (for chat, the
    /// rendered prompt, `span_prompt`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_chars: Option<[usize; 2]>,
    /// Character and message spans: whether a boundary cuts a token in two.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuts_token: Option<bool>,
}

/// The mapping from characters to tokens, returned with character and message spans
/// so that the caller can check it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpanText {
    /// Per prompt token, its characters `[start, end)` of the prompt text. A token that
    /// holds part of a character's bytes (an emoji split into byte tokens) covers that
    /// whole character; a token that spells nothing there (an added BOS) is empty.
    pub offsets: Vec<[usize; 2]>,
    /// Chat: each message's content as characters of the rendered prompt (`None` where
    /// the template does not write it as it is).
    pub messages: Option<Vec<Option<[usize; 2]>>>,
    /// Chat: the rendered prompt.
    pub prompt: Option<String>,
}

/// The prompt text behind a prompt's tokens, for character and message spans.
#[derive(Debug, Clone, Copy)]
pub struct PromptText<'a> {
    pub text: &'a str,
    /// Per prompt token, its bytes of `text`: contiguous, in order, covering `text`
    /// (empty for a token that spells nothing there).
    pub token_bytes: &'a [Range<usize>],
    /// Chat: each message's content as bytes of `text` (`None`: not found). `None` for
    /// a completion prompt.
    pub messages: Option<&'a [Option<Range<usize>>]>,
}

fn invalid(message: impl Into<String>) -> CaptureError {
    CaptureError::InvalidField {
        field: SPANS_FIELD,
        message: message.into(),
    }
}

/// Checks what can be checked before the prompt is known: the count, the labels, empty
/// or reversed ranges, and token spans' overlaps.
pub fn check_spans(spans: &[CaptureSpan]) -> Result<(), CaptureError> {
    if spans.len() > MAX_SPANS {
        return Err(invalid(format!(
            "{SPANS_FIELD} names {} spans; at most {MAX_SPANS} are allowed",
            spans.len()
        )));
    }
    for (i, span) in spans.iter().enumerate() {
        let at = format!("{SPANS_FIELD}[{i}]");
        if span.label.is_empty() {
            return Err(invalid(format!("{at}: the label is empty")));
        }
        if let Some(j) = spans[..i].iter().position(|s| s.label == span.label) {
            return Err(invalid(format!(
                "{at}: the label {:?} is also {SPANS_FIELD}[{j}]'s; labels must differ",
                span.label
            )));
        }
        let range = match &span.at {
            SpanAt::Tokens(r) | SpanAt::Chars(r) | SpanAt::MessageChars(_, r) => Some(r),
            SpanAt::Message(_) => None,
        };
        if let Some(r) = range {
            if r.start >= r.end {
                return Err(invalid(format!(
                    "{at} ({:?}): [{}, {}) is empty; a span is [start, end) with start < end",
                    span.label, r.start, r.end
                )));
            }
        }
    }
    check_overlaps(spans.iter().filter(|s| matches!(s.at, SpanAt::Tokens(_))))
}

/// Refuses spans whose tokens overlap.
fn check_overlaps<'a>(spans: impl Iterator<Item = &'a CaptureSpan>) -> Result<(), CaptureError> {
    let mut ranges: Vec<(&Range<usize>, &str)> = spans
        .filter_map(|s| s.tokens.as_ref().map(|t| (t, s.label.as_str())))
        .collect();
    ranges.sort_by_key(|(r, _)| (r.start, r.end));
    for pair in ranges.windows(2) {
        let ((a, la), (b, lb)) = (pair[0], pair[1]);
        if b.start < a.end {
            return Err(invalid(format!(
                "the spans {la:?} (tokens [{}, {})) and {lb:?} (tokens [{}, {})) overlap; spans must not share a token",
                a.start, a.end, b.start, b.end
            )));
        }
    }
    Ok(())
}

/// Char index of each byte of `text` (the char it is part of), and of `text.len()`.
fn char_of_bytes(text: &str) -> Vec<usize> {
    let mut out = vec![0; text.len() + 1];
    let mut count = 0;
    for (c, (b, ch)) in text.char_indices().enumerate() {
        out[b..b + ch.len_utf8()].fill(c);
        count = c + 1;
    }
    out[text.len()] = count;
    out
}

/// Resolves every span of a prompt of `prompt_len` tokens to its tokens, checks that
/// none overlap or lies outside the prompt, and returns the character mapping when a
/// span was named by text (`text` is needed then).
pub fn resolve_spans(
    spans: &mut [CaptureSpan],
    prompt_len: usize,
    text: Option<&PromptText>,
) -> Result<Option<SpanText>, CaptureError> {
    check_spans(spans)?;
    let by_text = spans.iter().any(|s| !matches!(s.at, SpanAt::Tokens(_)));
    let mut mapping = None;
    if by_text {
        let Some(text) = text else {
            return Err(invalid(format!(
                "{SPANS_FIELD} names characters or messages, but this prompt was given as token ids: name spans by \"tokens\""
            )));
        };
        if text.token_bytes.len() != prompt_len {
            return Err(CaptureError::Incomplete(format!(
                "the prompt has {prompt_len} tokens but {} token offsets",
                text.token_bytes.len()
            )));
        }
        mapping = Some(resolve_text_spans(spans, text)?);
    }
    for (i, span) in spans.iter().enumerate() {
        let tokens = span.tokens.clone().unwrap_or(0..0);
        if tokens.end > prompt_len {
            return Err(invalid(format!(
                "{SPANS_FIELD}[{i}] ({:?}): tokens [{}, {}) are out of range: the prompt has {prompt_len} tokens",
                span.label, tokens.start, tokens.end
            )));
        }
    }
    check_overlaps(spans.iter())?;
    Ok(mapping)
}

fn resolve_text_spans(
    spans: &mut [CaptureSpan],
    text: &PromptText,
) -> Result<SpanText, CaptureError> {
    let chars = char_of_bytes(text.text);
    let num_chars = chars[text.text.len()];
    let to_chars = |r: &Range<usize>| [chars[r.start], chars[r.end]];
    // Char index -> byte offset (and the end).
    let mut char_starts: Vec<usize> = text.text.char_indices().map(|(b, _)| b).collect();
    char_starts.push(text.text.len());
    let offsets: Vec<[usize; 2]> = text
        .token_bytes
        .iter()
        .map(|r| {
            let start = chars[r.start.min(text.text.len())];
            let end = if r.is_empty() {
                start
            } else {
                chars[r.end - 1] + 1
            };
            [start, end]
        })
        .collect();
    for (i, span) in spans.iter_mut().enumerate() {
        let at = format!("{SPANS_FIELD}[{i}] ({:?})", span.label);
        let message = |m: usize| -> Result<Range<usize>, CaptureError> {
            let messages = text.messages.ok_or_else(|| {
                invalid(format!(
                    "{at}: \"message\" names a chat message; this is a completion prompt (name \"chars\" or \"tokens\")"
                ))
            })?;
            let found = messages.get(m).ok_or_else(|| {
                invalid(format!(
                    "{at}: message {m} is out of range: the request has {} messages",
                    messages.len()
                ))
            })?;
            found.clone().ok_or_else(|| {
                invalid(format!(
                    "{at}: message {m}'s content was not found in the prompt the chat template rendered (the template changes it), so its characters have no tokens"
                ))
            })
        };
        let bytes: Range<usize> = match span.at.clone() {
            SpanAt::Tokens(_) => continue,
            SpanAt::Chars(r) => {
                if text.messages.is_some() {
                    return Err(invalid(format!(
                        "{at}: \"chars\" alone on a chat request; name the message too ({{\"message\": i, \"chars\": [start, end)}})"
                    )));
                }
                if r.end > num_chars {
                    return Err(invalid(format!(
                        "{at}: chars [{}, {}) are out of range: the prompt has {num_chars} characters",
                        r.start, r.end
                    )));
                }
                char_starts[r.start]..char_starts[r.end]
            }
            SpanAt::Message(m) => {
                let bytes = message(m)?;
                if bytes.is_empty() {
                    return Err(invalid(format!("{at}: message {m}'s content is empty")));
                }
                bytes
            }
            SpanAt::MessageChars(m, r) => {
                let bytes = message(m)?;
                let [first, last] = to_chars(&bytes);
                if r.end > last - first {
                    return Err(invalid(format!(
                        "{at}: chars [{}, {}) are out of range: message {m} has {} characters",
                        r.start,
                        r.end,
                        last - first
                    )));
                }
                char_starts[first + r.start]..char_starts[first + r.end]
            }
        };
        // The tokens that hold any of the span's bytes.
        let touches =
            |t: &Range<usize>| !t.is_empty() && t.end > bytes.start && t.start < bytes.end;
        let first = text.token_bytes.iter().position(touches);
        let last = text.token_bytes.iter().rposition(touches);
        let (Some(first), Some(last)) = (first, last) else {
            return Err(invalid(format!(
                "{at}: its characters hold no prompt token"
            )));
        };
        span.cuts_token =
            text.token_bytes[first].start < bytes.start || text.token_bytes[last].end > bytes.end;
        span.tokens = Some(first..last + 1);
        span.prompt_chars = Some(chars[bytes.start]..chars[bytes.end]);
    }
    Ok(SpanText {
        offsets,
        messages: text
            .messages
            .map(|m| m.iter().map(|r| r.as_ref().map(to_chars)).collect()),
        prompt: text.messages.map(|_| text.text.to_string()),
    })
}

/// One layer's span masses: `[rows, groups, spans + 1]`, the last column the mass
/// outside every span.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerSpanMass {
    pub layer_idx: usize,
    pub shape: [usize; 3],
    pub values: Vec<f32>,
}

/// Which span each key belongs to: keys past the last span's end (the generated ones
/// among them) are outside every span.
#[derive(Debug, Clone)]
pub(crate) struct SpanOwners {
    /// Per key up to the last span's end: its span, or `num_spans` (outside every span).
    owner: Vec<u32>,
    num_spans: usize,
}

impl SpanOwners {
    /// Owners of disjoint token ranges `spans`.
    pub(crate) fn new(spans: &[Range<usize>]) -> Self {
        let end = spans.iter().map(|r| r.end).max().unwrap_or(0);
        let mut owner = vec![spans.len() as u32; end];
        for (s, r) in spans.iter().enumerate() {
            owner[r.clone()].fill(s as u32);
        }
        Self {
            owner,
            num_spans: spans.len(),
        }
    }

    /// Values per row and group: one per span and, last, the rest.
    pub(crate) fn width(&self) -> usize {
        self.num_spans + 1
    }

    /// Adds one row's values of keys `keys` (`values[i]` is key `keys.start + i`) to
    /// `out` (`width()` sums): each key's to its span's sum, in key order.
    pub(crate) fn add(&self, keys: Range<usize>, values: &[f32], out: &mut [f32]) {
        let split = keys.end.min(self.owner.len()).max(keys.start);
        let (within, past) = values.split_at(split - keys.start);
        let owners = self.owner.get(keys.start..split).unwrap_or_default();
        for (&p, &s) in within.iter().zip(owners) {
            out[s as usize] += p;
        }
        let rest = &mut out[self.num_spans];
        for &p in past {
            *rest += p;
        }
    }

    pub(crate) fn size_bytes(&self) -> usize {
        self.owner.capacity() * 4
    }
}

/// Accumulates one layer's span masses as its rows are computed.
pub(crate) struct SpanMassAccumulator {
    groups: Vec<Vec<usize>>,
    num_keys: usize,
    spans: SpanOwners,
    /// One row's value per group and key.
    row: Vec<f32>,
    rows: usize,
    values: Vec<f32>,
}

impl SpanMassAccumulator {
    pub(crate) fn new(
        groups: Vec<Vec<usize>>,
        num_keys: usize,
        spans: &[Range<usize>],
        rows: usize,
    ) -> Self {
        let width = groups.len() * (spans.len() + 1);
        Self {
            row: vec![0.0; groups.len() * num_keys],
            groups,
            num_keys,
            spans: SpanOwners::new(spans),
            rows: 0,
            values: Vec::with_capacity(rows * width),
        }
    }

    /// Adds one row: `dense` is `[heads, keys]`. A group's probability is the mean of
    /// its heads' (as key statistics and `mean_heads` maps have it); each span's mass is
    /// the sum of its keys' in key order, and so is the rest's.
    pub(crate) fn add_row(&mut self, dense: &[f32]) {
        crate::stats::group_row(&self.groups, dense, self.num_keys, &mut self.row);
        let width = self.spans.width();
        for g in 0..self.groups.len() {
            let start = self.values.len();
            self.values.resize(start + width, 0.0);
            let row = &self.row[g * self.num_keys..(g + 1) * self.num_keys];
            self.spans
                .add(0..self.num_keys, row, &mut self.values[start..]);
        }
        self.rows += 1;
    }

    pub(crate) fn finish(self, layer_idx: usize) -> LayerSpanMass {
        LayerSpanMass {
            layer_idx,
            shape: [self.rows, self.groups.len(), self.spans.width()],
            values: self.values,
        }
    }

    /// Span masses summed elsewhere ([`crate::stats::LiveSums`]): `values`,
    /// `[rows, groups, spans + 1]`.
    pub(crate) fn summed(
        layer_idx: usize,
        rows: usize,
        groups: usize,
        spans: usize,
        values: &[f32],
    ) -> LayerSpanMass {
        LayerSpanMass {
            layer_idx,
            shape: [rows, groups, spans + 1],
            values: values.to_vec(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(list: &[(&str, SpanAt)]) -> Vec<CaptureSpan> {
        list.iter()
            .map(|(l, at)| CaptureSpan::new(*l, at.clone()))
            .collect()
    }

    fn message_of(e: CaptureError) -> String {
        match e {
            CaptureError::InvalidField { field, message } => {
                assert_eq!(field, SPANS_FIELD);
                message
            }
            other => panic!("expected InvalidField, got {other:?}"),
        }
    }

    /// "é😀ab": the emoji in two byte tokens, then "ab" in one token; BOS first.
    fn emoji_prompt() -> (&'static str, Vec<Range<usize>>) {
        let text = "é😀ab";
        // é is bytes 0..2, 😀 2..6, "ab" 6..8.
        (text, vec![0..0, 0..2, 2..4, 4..6, 6..8])
    }

    #[test]
    fn chars_map_to_the_tokens_that_hold_them() {
        let (text, bytes) = emoji_prompt();
        let prompt = PromptText {
            text,
            token_bytes: &bytes,
            messages: None,
        };
        let mut list = spans(&[
            ("start", SpanAt::Chars(0..1)),
            ("emoji", SpanAt::Chars(1..2)),
            ("a", SpanAt::Chars(2..3)),
        ]);
        let mapping = resolve_spans(&mut list, 5, Some(&prompt)).unwrap().unwrap();
        assert_eq!(
            mapping.offsets,
            vec![[0, 0], [0, 1], [1, 2], [1, 2], [2, 4]]
        );
        assert_eq!(list[0].tokens, Some(1..2));
        assert!(!list[0].cuts_token);
        assert_eq!(list[1].tokens, Some(2..4));
        assert!(!list[1].cuts_token);
        // "a" is half of the token "ab".
        assert_eq!(list[2].tokens, Some(4..5));
        assert!(list[2].cuts_token);
        assert_eq!(list[2].prompt_chars, Some(2..3));
        let info = list[2].info();
        assert_eq!(info.chars, Some([2, 3]));
        assert_eq!(info.cuts_token, Some(true));
        // The end of the prompt.
        let mut end = spans(&[("end", SpanAt::Chars(3..4))]);
        resolve_spans(&mut end, 5, Some(&prompt)).unwrap();
        assert_eq!(end[0].tokens, Some(4..5));
        // Beyond it.
        let mut out = spans(&[("far", SpanAt::Chars(3..5))]);
        let e = message_of(resolve_spans(&mut out, 5, Some(&prompt)).unwrap_err());
        assert!(
            e.contains("out of range") && e.contains("4 characters"),
            "{e}"
        );
        // "a" and "b" share the token "ab".
        let mut shared = spans(&[("a", SpanAt::Chars(2..3)), ("b", SpanAt::Chars(3..4))]);
        let e = message_of(resolve_spans(&mut shared, 5, Some(&prompt)).unwrap_err());
        assert!(e.contains("overlap"), "{e}");
    }

    #[test]
    fn messages_and_chars_inside_them() {
        // "<s>Hi 👋|Bye": message 0 is "Hi 👋" (bytes 3..10), message 1 "Bye".
        let text = "<s>Hi 👋|Bye";
        let bytes = vec![0..3, 3..5, 5..6, 6..10, 10..11, 11..14];
        let messages = vec![Some(3..10), Some(11..14), None, Some(3..3)];
        let prompt = PromptText {
            text,
            token_bytes: &bytes,
            messages: Some(&messages),
        };
        let mut list = spans(&[
            ("m0", SpanAt::Message(0)),
            ("wave", SpanAt::MessageChars(1, 0..1)),
        ]);
        let mapping = resolve_spans(&mut list, 6, Some(&prompt)).unwrap().unwrap();
        assert_eq!(list[0].tokens, Some(1..4));
        assert_eq!(list[0].prompt_chars, Some(3..7));
        assert_eq!(list[1].tokens, Some(5..6));
        assert!(list[1].cuts_token);
        assert_eq!(list[1].prompt_chars, Some(8..9));
        assert_eq!(
            mapping.messages,
            Some(vec![Some([3, 7]), Some([8, 11]), None, Some([3, 3])])
        );
        assert_eq!(mapping.prompt.as_deref(), Some(text));
        let cases: [(SpanAt, &str); 6] = [
            (SpanAt::Message(4), "out of range"),
            (SpanAt::Message(2), "not found"),
            (SpanAt::Message(3), "empty"),
            (SpanAt::MessageChars(0, 2..5), "4 characters"),
            (SpanAt::Chars(0..1), "name the message"),
            (SpanAt::MessageChars(0, 3..4), ""),
        ];
        for (at, expected) in cases {
            let mut one = spans(&[("x", at.clone())]);
            match resolve_spans(&mut one, 6, Some(&prompt)) {
                Err(e) => assert!(message_of(e).contains(expected), "{at:?}"),
                Ok(_) => assert!(expected.is_empty(), "{at:?}"),
            }
        }
        // The emoji alone: its one token.
        let mut emoji = spans(&[("emoji", SpanAt::MessageChars(0, 3..4))]);
        resolve_spans(&mut emoji, 6, Some(&prompt)).unwrap();
        assert_eq!(emoji[0].tokens, Some(3..4));
        assert!(!emoji[0].cuts_token);
    }

    #[test]
    fn bad_spans_name_the_field() {
        let bad: [(Vec<CaptureSpan>, &str); 5] = [
            (spans(&[("a", SpanAt::Tokens(3..3))]), "empty"),
            (spans(&[("", SpanAt::Tokens(0..1))]), "label"),
            (
                spans(&[("a", SpanAt::Tokens(0..4)), ("a", SpanAt::Tokens(5..6))]),
                "labels must differ",
            ),
            (
                spans(&[("a", SpanAt::Tokens(0..4)), ("b", SpanAt::Tokens(3..6))]),
                "overlap",
            ),
            (
                (0..=MAX_SPANS)
                    .map(|i| CaptureSpan::tokens(i.to_string(), i..i + 1))
                    .collect(),
                "at most 256",
            ),
        ];
        for (list, expected) in bad {
            let e = message_of(check_spans(&list).unwrap_err());
            assert!(e.contains(expected), "{e}");
        }
        let mut far = spans(&[("a", SpanAt::Tokens(2..9))]);
        let e = message_of(resolve_spans(&mut far, 8, None).unwrap_err());
        assert!(e.contains("out of range"), "{e}");
        let mut chars = spans(&[("a", SpanAt::Chars(0..2))]);
        let e = message_of(resolve_spans(&mut chars, 8, None).unwrap_err());
        assert!(e.contains("token ids"), "{e}");
        let mut tokens = spans(&[("a", SpanAt::Tokens(0..8))]);
        assert_eq!(resolve_spans(&mut tokens, 8, None).unwrap(), None);
    }

    #[test]
    fn span_masses_are_the_sums_of_their_keys() {
        // Two heads in one group, five keys; spans [1, 3) and [4, 5).
        let mut acc = SpanMassAccumulator::new(vec![vec![0, 1]], 5, &[1..3, 4..5], 2);
        acc.add_row(&[0.1, 0.2, 0.3, 0.4, 0.0, 0.3, 0.1, 0.1, 0.2, 0.3]);
        acc.add_row(&[0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]);
        let out = acc.finish(3);
        assert_eq!(out.shape, [2, 1, 3]);
        // Row means: [0.2, 0.15, 0.2, 0.3, 0.15] and [0, 0, 0, 0, 1].
        let expected = [0.15f32 + 0.2, 0.15, 0.2 + 0.3, 0.0, 1.0, 0.0];
        for (a, b) in out.values.iter().zip(expected) {
            assert!((a - b).abs() < 1e-6, "{:?}", out.values);
        }
        for row in out.values.chunks(3) {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        }
    }
}
