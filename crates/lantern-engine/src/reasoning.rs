//! Reasoning models' thinking, as vLLM's `--reasoning-parser` reads it: the text between
//! `<think>` and `</think>` is the choice's reasoning, what follows its answer; gpt-oss's
//! harmony messages are split by channel instead, its tool calls among them
//! ([`harmony`]).
//!
//! One rule says where an output starts, for both the text split here and the
//! structured output that waits for the answer ([`ReasoningParser::thinking_after`]): an
//! output begins inside thinking when its prompt ends with `<think>` (a template that
//! opens it), or ends with neither tag and the parser's outputs open thinking without
//! writing the tag (DeepSeek-R1's); otherwise thinking begins only if the output itself
//! begins with `<think>`. Tags earlier in the prompt (a user's text, earlier turns) do
//! not count. Thinking that never closes (an output cut by `max_tokens`) is all reasoning.

mod harmony;

use std::fmt;
use std::sync::Arc;

use crate::validate::tools::ToolCall;

/// The reasoning parsers lantern knows (`--reasoning-parser`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningParser {
    /// DeepSeek-R1 and its distills, QwQ: the template opens `<think>`, so an output is
    /// reasoning until `</think>` even without the start tag.
    DeepseekR1,
    /// Qwen3: the model opens `<think>` itself (or the template closes it, with
    /// `enable_thinking: false`).
    Qwen3,
    /// gpt-oss: harmony messages, whose `analysis` channel is the reasoning and `final`
    /// the answer, and whose messages to `functions.NAME` are tool calls.
    OpenaiGptoss,
}

impl ReasoningParser {
    const ALL: [Self; 3] = [Self::DeepseekR1, Self::Qwen3, Self::OpenaiGptoss];
    pub const NAMES: [&'static str; 3] = [
        Self::ALL[0].name(),
        Self::ALL[1].name(),
        Self::ALL[2].name(),
    ];

    /// The parser named `name` (vLLM's names).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }

    pub const fn name(self) -> &'static str {
        match self {
            Self::DeepseekR1 => "deepseek_r1",
            Self::Qwen3 => "qwen3",
            Self::OpenaiGptoss => "openai_gptoss",
        }
    }

    /// The parser a model's vocabulary calls for without being asked: gpt-oss's, whose
    /// replies are harmony messages, when the harmony markers are control tokens (vLLM
    /// reads gpt-oss's chat replies so whatever `--reasoning-parser` says).
    pub fn implied_by(tokenizer: &lantern_model::tokenizer::ModelTokenizer) -> Option<Self> {
        harmony::MARKERS
            .iter()
            .all(|m| is_control_token(tokenizer, m))
            .then_some(Self::OpenaiGptoss)
    }

    /// Whether the parser reads control tokens in the output's text (which must then be
    /// decoded with them kept, whatever `skip_special_tokens` says).
    pub fn reads_control_tokens(self) -> bool {
        self == Self::OpenaiGptoss
    }

    /// What begins thinking: in harmony, the end of the prompt's header for the reply.
    pub fn start_tag(self) -> &'static str {
        match self {
            Self::OpenaiGptoss => "<|start|>assistant",
            _ => "<think>",
        }
    }

    /// What ends thinking (structured output waits for it): in harmony, the header of
    /// the `final` channel's message.
    pub fn end_tag(self) -> &'static str {
        match self {
            Self::OpenaiGptoss => "<|channel|>final<|message|>",
            _ => "</think>",
        }
    }

    /// How many tokens the end tag takes in a vocabulary made for the parser.
    fn end_tag_tokens(self) -> usize {
        match self {
            Self::OpenaiGptoss => 3,
            _ => 1,
        }
    }

    /// Whether an output begins thinking when its prompt ends with neither tag.
    fn opens_itself(self) -> bool {
        self == Self::DeepseekR1
    }

    /// Whether the output that follows a prompt ending with `prompt_end` (its last
    /// tokens' text) begins inside thinking: the prompt ends with the start tag (and
    /// whitespace), or with neither tag and the parser's outputs open thinking.
    pub fn thinking_after(self, prompt_end: &str) -> bool {
        let end = prompt_end.trim_end();
        if end.ends_with(self.start_tag()) {
            true
        } else if end.ends_with(self.end_tag()) {
            false
        } else {
            self.opens_itself()
        }
    }
}

impl fmt::Display for ReasoningParser {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A parser and its end tag as the model's tokenizer writes it, to tell from an
/// output's token ids when its thinking ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThinkTags {
    pub parser: ReasoningParser,
    pub end: Arc<[u32]>,
}

impl ThinkTags {
    /// `end`: the token ids of the parser's end tag (not empty).
    pub fn new(parser: ReasoningParser, end: Vec<u32>) -> Self {
        assert!(!end.is_empty(), "the end tag has tokens");
        Self {
            parser,
            end: end.into(),
        }
    }

    /// `parser`'s end tag as `tokenizer` writes it. A tag of several tokens (no token of
    /// its own) is warned of: such a model is likely not a thinking model.
    pub fn for_tokenizer(
        parser: ReasoningParser,
        tokenizer: &lantern_model::tokenizer::ModelTokenizer,
    ) -> Result<Self, String> {
        let tag = parser.end_tag();
        let end = tokenizer
            .encode(tag, false)
            .ok()
            .filter(|ids| !ids.is_empty())
            .ok_or_else(|| {
                format!("the model's tokenizer cannot write {tag:?}, the end tag of the reasoning parser {parser}")
            })?;
        if end.len() > parser.end_tag_tokens() {
            tracing::warn!(
                "reasoning parser {parser}: this model's tokenizer writes {tag} as {} tokens where a thinking model's writes it as {}: it is likely not a thinking model",
                end.len(),
                parser.end_tag_tokens()
            );
        }
        Ok(Self::new(parser, end))
    }
}

/// Whether `text` is one control token of `tokenizer`'s.
fn is_control_token(tokenizer: &lantern_model::tokenizer::ModelTokenizer, text: &str) -> bool {
    tokenizer.contains_control_text(text)
        && tokenizer
            .encode(text, false)
            .is_ok_and(|ids| ids.len() == 1 && tokenizer.is_special(ids[0]))
}

/// A piece of an output, split as it arrives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ThinkingPiece {
    Reasoning(String),
    Answer(String),
    /// A tool call begins (harmony's messages to a function); its arguments follow.
    Call {
        name: String,
    },
    /// More of the open call's arguments (JSON text).
    Arguments(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// The output's start: it may open thinking with the start tag.
    MayOpen,
    /// Leading whitespace after a tag is dropped.
    ThinkingStart,
    Thinking,
    AnswerStart,
    Answer,
}

/// Splits an output's text into reasoning, answer and (harmony's) tool calls as it
/// arrives, as its parser reads it. Pushing a text whole or in any pieces gives the same
/// pieces, joined.
#[derive(Debug, Clone)]
pub struct ThinkingSplitter(Splitter);

#[derive(Debug, Clone)]
enum Splitter {
    Tags(TagSplitter),
    Harmony(harmony::HarmonySplitter),
}

impl ThinkingSplitter {
    /// `thinking`: whether the output begins inside thinking
    /// ([`ReasoningParser::thinking_after`]).
    pub fn new(parser: ReasoningParser, thinking: bool) -> Self {
        Self(match parser {
            ReasoningParser::OpenaiGptoss => {
                Splitter::Harmony(harmony::HarmonySplitter::new(thinking))
            }
            _ => Splitter::Tags(TagSplitter::new(parser, thinking)),
        })
    }

    /// Whether the output is inside its thinking now.
    pub fn thinking(&self) -> bool {
        match &self.0 {
            Splitter::Tags(s) => s.thinking(),
            Splitter::Harmony(s) => s.thinking(),
        }
    }

    /// [`Self::push`] of `tokens` tokens' `text`, counting them in `reasoning_tokens`
    /// when they are thinking (the tags' own tokens included).
    pub fn push_counted(
        &mut self,
        text: &str,
        tokens: usize,
        reasoning_tokens: &mut usize,
    ) -> Vec<ThinkingPiece> {
        let before = self.thinking();
        let pieces = self.push(text);
        if before || self.thinking() {
            *reasoning_tokens += tokens;
        }
        pieces
    }

    /// The pieces `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<ThinkingPiece> {
        match &mut self.0 {
            Splitter::Tags(s) => s.push(text),
            Splitter::Harmony(s) => s.push(text),
        }
    }

    /// The pieces held at the output's end: text that could still have become a tag is
    /// what it is.
    pub fn finish(&mut self) -> Vec<ThinkingPiece> {
        match &mut self.0 {
            Splitter::Tags(s) => s.finish(),
            Splitter::Harmony(s) => s.finish(),
        }
    }
}

/// [`ThinkingSplitter`] for `<think>` tags: the tags and the whitespace right after each
/// are dropped, and text that may be the start of a tag is held back until it is known.
#[derive(Debug, Clone)]
struct TagSplitter {
    parser: ReasoningParser,
    phase: Phase,
    held: String,
}

impl TagSplitter {
    fn new(parser: ReasoningParser, thinking: bool) -> Self {
        Self {
            parser,
            phase: if thinking {
                Phase::ThinkingStart
            } else {
                Phase::MayOpen
            },
            held: String::new(),
        }
    }

    fn thinking(&self) -> bool {
        matches!(self.phase, Phase::ThinkingStart | Phase::Thinking)
    }

    fn push(&mut self, text: &str) -> Vec<ThinkingPiece> {
        self.held.push_str(text);
        let mut pieces = Vec::new();
        loop {
            match self.phase {
                Phase::MayOpen => {
                    let tag = self.parser.start_tag();
                    if let Some(rest) = self.held.strip_prefix(tag) {
                        self.held = rest.to_string();
                        self.phase = Phase::ThinkingStart;
                    } else if tag.starts_with(self.held.as_str()) {
                        return pieces; // may still become the tag
                    } else {
                        self.phase = Phase::Answer;
                    }
                }
                Phase::ThinkingStart | Phase::AnswerStart => {
                    let trimmed = self.held.trim_start();
                    if trimmed.is_empty() {
                        self.held.clear();
                        return pieces;
                    }
                    self.held = trimmed.to_string();
                    self.phase = if self.phase == Phase::ThinkingStart {
                        Phase::Thinking
                    } else {
                        Phase::Answer
                    };
                }
                Phase::Thinking => {
                    let tag = self.parser.end_tag();
                    if let Some(at) = self.held.find(tag) {
                        let rest = self.held.split_off(at);
                        push_piece(&mut pieces, ThinkingPiece::Reasoning(self.take_held()));
                        self.held = rest[tag.len()..].to_string();
                        self.phase = Phase::AnswerStart;
                    } else {
                        let keep = partial_tag_len(&self.held, tag);
                        let rest = self.held.split_off(self.held.len() - keep);
                        push_piece(&mut pieces, ThinkingPiece::Reasoning(self.take_held()));
                        self.held = rest;
                        return pieces;
                    }
                }
                Phase::Answer => {
                    push_piece(&mut pieces, ThinkingPiece::Answer(self.take_held()));
                    return pieces;
                }
            }
        }
    }

    fn finish(&mut self) -> Vec<ThinkingPiece> {
        let held = self.take_held();
        let piece = match self.phase {
            Phase::MayOpen | Phase::Answer | Phase::AnswerStart => ThinkingPiece::Answer(held),
            Phase::Thinking | Phase::ThinkingStart => ThinkingPiece::Reasoning(held),
        };
        let mut pieces = Vec::new();
        push_piece(&mut pieces, piece);
        pieces
    }

    fn take_held(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

fn push_piece(pieces: &mut Vec<ThinkingPiece>, piece: ThinkingPiece) {
    let empty = match &piece {
        ThinkingPiece::Reasoning(t) | ThinkingPiece::Answer(t) => t.is_empty(),
        ThinkingPiece::Call { .. } | ThinkingPiece::Arguments(_) => false,
    };
    if !empty {
        pieces.push(piece);
    }
}

/// The length of the longest end of `text` that begins `tag` (a tag that may be
/// completed by the next text).
fn partial_tag_len(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| {
            text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

/// A whole output as its parser reads it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SplitOutput {
    /// The thinking (`None` when the output did not think, or thought nothing).
    pub reasoning: Option<String>,
    /// The text after it (harmony: the `final` channel's).
    pub answer: String,
    /// Harmony's tool calls (a `<tool_call>` in the answer is not parsed here).
    pub calls: Vec<ToolCall>,
}

/// An output's reasoning, answer and calls gathered as its text arrives (for a response
/// that is not streamed), its thinking tokens counted as a stream counts them.
#[derive(Debug, Clone)]
pub struct ThinkingOutput {
    splitter: ThinkingSplitter,
    reasoning: String,
    answer: String,
    calls: Vec<ToolCall>,
    reasoning_tokens: usize,
}

impl ThinkingOutput {
    /// `thinking`: whether the output begins inside thinking.
    pub fn new(parser: ReasoningParser, thinking: bool) -> Self {
        Self {
            splitter: ThinkingSplitter::new(parser, thinking),
            reasoning: String::new(),
            answer: String::new(),
            calls: Vec::new(),
            reasoning_tokens: 0,
        }
    }

    /// The output's next `tokens` tokens' `text`.
    pub fn push(&mut self, text: &str, tokens: usize) {
        let pieces = self
            .splitter
            .push_counted(text, tokens, &mut self.reasoning_tokens);
        self.gather(pieces);
    }

    /// Tokens spent thinking so far (the tags' own included).
    pub fn reasoning_tokens(&self) -> usize {
        self.reasoning_tokens
    }

    /// The whole output, read.
    pub fn finish(mut self) -> SplitOutput {
        let held = self.splitter.finish();
        self.gather(held);
        SplitOutput {
            reasoning: (!self.reasoning.is_empty()).then_some(self.reasoning),
            answer: self.answer,
            calls: self.calls,
        }
    }

    fn gather(&mut self, pieces: Vec<ThinkingPiece>) {
        for piece in pieces {
            match piece {
                ThinkingPiece::Reasoning(t) => self.reasoning.push_str(&t),
                ThinkingPiece::Answer(t) => self.answer.push_str(&t),
                ThinkingPiece::Call { name } => self.calls.push(ToolCall {
                    name,
                    arguments: String::new(),
                }),
                ThinkingPiece::Arguments(t) => {
                    if let Some(call) = self.calls.last_mut() {
                        call.arguments.push_str(&t);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R1: ReasoningParser = ReasoningParser::DeepseekR1;
    const QWEN3: ReasoningParser = ReasoningParser::Qwen3;

    /// The reasoning and answer of the output that `texts` make one after the other.
    fn split_texts<'a>(
        parser: ReasoningParser,
        thinking: bool,
        texts: impl IntoIterator<Item = &'a str>,
    ) -> (Option<String>, String) {
        let mut output = ThinkingOutput::new(parser, thinking);
        for text in texts {
            output.push(text, 0);
        }
        let split = output.finish();
        (split.reasoning, split.answer)
    }

    fn split(parser: ReasoningParser, thinking: bool, text: &str) -> (Option<String>, String) {
        split_texts(parser, thinking, [text])
    }

    /// Every cut of `text` into three pieces at character boundaries (empty ones too).
    pub(super) fn three_way_cuts(text: &str) -> Vec<[&str; 3]> {
        let bounds: Vec<usize> = (0..=text.len())
            .filter(|&i| text.is_char_boundary(i))
            .collect();
        let mut cuts = Vec::new();
        for &a in &bounds {
            for &b in bounds.iter().filter(|&&b| b >= a) {
                cuts.push([&text[..a], &text[a..b], &text[b..]]);
            }
        }
        cuts
    }

    fn some(text: &str) -> Option<String> {
        Some(text.to_string())
    }

    #[test]
    fn a_whole_output_splits_at_its_tags() {
        let text = "<think>\nLet me see.\n</think>\n\nThe answer is 4.";
        assert_eq!(
            split(QWEN3, false, text),
            (some("Let me see.\n"), "The answer is 4.".into())
        );
        // Begun inside thinking: no start tag in the output.
        assert_eq!(
            split(R1, true, "Let me see.</think>4"),
            (some("Let me see."), "4".into())
        );
        // Thinking never closed (cut by max_tokens): all reasoning.
        assert_eq!(split(R1, true, "Let me"), (some("Let me"), String::new()));
        assert_eq!(
            split(QWEN3, false, "<think>Let me"),
            (some("Let me"), String::new())
        );
        // No thinking: all answer, tags later in the text kept as they are.
        assert_eq!(
            split(QWEN3, false, "Plain <think>x</think>"),
            (None, "Plain <think>x</think>".into())
        );
        assert_eq!(split(QWEN3, false, "<thin"), (None, "<thin".into()));
        assert_eq!(split(QWEN3, false, ""), (None, String::new()));
        // Empty thinking (Qwen3 with enable_thinking: false writes it in the prompt; a
        // model may write it too).
        assert_eq!(
            split(QWEN3, false, "<think>\n\n</think>\n\nHi"),
            (None, "Hi".into())
        );
    }

    #[test]
    fn pieces_in_any_cut_give_the_whole_split() {
        let texts = [
            "<think>\nabc </thi</think>\n\n done <think>",
            "<think>é</think>ü",
            "</think>x",
            "<th",
            "  <think>x</think>y",
            "reason\u{2028}ing</think>\n",
        ];
        for parser in [R1, QWEN3] {
            for thinking in [false, true] {
                for text in texts {
                    let whole = split(parser, thinking, text);
                    for cut in three_way_cuts(text) {
                        let (r, t) = split_texts(parser, thinking, cut);
                        assert_eq!((r, t), whole, "{text:?} cut as {cut:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn thinking_tokens_are_counted_with_their_tags() {
        let mut s = ThinkingSplitter::new(QWEN3, false);
        let mut n = 0;
        for token in ["<think>", "\n", "Let", " me", "</think>", "\n\n", "Hi", "."] {
            s.push_counted(token, 1, &mut n);
        }
        assert_eq!(n, 5);
        let mut n = 0;
        ThinkingSplitter::new(QWEN3, false).push_counted("Hi <think>", 2, &mut n);
        assert_eq!(n, 0);
    }

    #[test]
    fn reasoning_goes_out_as_it_comes_but_a_possible_tag_waits() {
        let mut s = ThinkingSplitter::new(R1, true);
        assert_eq!(
            s.push("abc</"),
            vec![ThinkingPiece::Reasoning("abc".into())]
        );
        assert_eq!(s.push("think>"), vec![]);
        assert_eq!(s.push("\n"), vec![]);
        assert_eq!(s.push("x"), vec![ThinkingPiece::Answer("x".into())]);
    }

    #[test]
    fn the_prompt_end_says_whether_an_output_begins_thinking() {
        for parser in [R1, QWEN3] {
            assert!(
                parser.thinking_after("<|im_start|>assistant\n<think>\n"),
                "{parser}: opened"
            );
            assert!(
                !parser.thinking_after("assistant\n<think>\n\n</think>\n\n"),
                "{parser}: closed"
            );
            // A tag in a user's text or an earlier turn is not the output's.
            assert_eq!(
                parser.thinking_after("user: what is <think>?\nassistant:"),
                parser.thinking_after("assistant:"),
                "{parser}: a tag inside the prompt"
            );
        }
        assert!(R1.thinking_after("<｜Assistant｜>"));
        assert!(!QWEN3.thinking_after("<|im_start|>assistant\n"));
        // gpt-oss's template ends the prompt in the reply's header; a prompt that opened
        // the final channel itself is answered at once.
        let gptoss = ReasoningParser::OpenaiGptoss;
        assert!(gptoss.thinking_after("<|end|><|start|>assistant"));
        assert!(!gptoss.thinking_after("<|start|>assistant<|channel|>final<|message|>"));
        assert!(!gptoss.thinking_after("<|im_start|>assistant\n"));
        assert_eq!(ReasoningParser::from_name("openai_gptoss"), Some(gptoss));
        assert_eq!(ReasoningParser::from_name("qwen3"), Some(QWEN3));
        assert_eq!(ReasoningParser::from_name("granite"), None);
    }
}
