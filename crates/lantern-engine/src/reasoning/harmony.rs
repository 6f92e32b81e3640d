//! gpt-oss's replies (OpenAI's harmony format), read as vLLM reads them for chat: an
//! output is a run of messages, each a header and its content,
//!
//! ```text
//! <|channel|>analysis<|message|>…<|end|><|start|>assistant<|channel|>final<|message|>…<|return|>
//! ```
//!
//! The `analysis` channel is the reasoning; `final`, and `commentary` addressed to no
//! one (a preamble), are the answer; a message addressed `to=functions.NAME` (in its
//! header, before or after the channel) is a call of tool `NAME`, its content the
//! arguments. Messages of one kind are joined by a newline. The markers are the
//! vocabulary's control tokens, so the output's text must be decoded with them kept.
//!
//! Text is read as it arrives: a header is held until `<|message|>` ends it, content goes
//! out as it comes but for what may be the start of a marker. Text between messages that
//! begins no header is answer, so an output that is not harmony at all is all answer.

use super::ThinkingPiece;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
/// The markers a harmony vocabulary has as control tokens.
pub(super) const MARKERS: [&str; 4] = [START, CHANNEL, MESSAGE, "<|end|>"];
/// Markers that end a message's content: the first three are consumed, the last two
/// begin the next header (a model that left out `<|end|>`).
const CONTENT_ENDS: [&str; 5] = ["<|end|>", "<|return|>", "<|call|>", START, CHANNEL];
/// The most bytes a header may hold before `<|message|>` (gpt-oss writes a few dozen):
/// longer text is no header, and is kept as answer.
const MAX_HEADER_BYTES: usize = 512;

/// What a message's content is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Content {
    Reasoning,
    Answer,
    Call,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Before a message: a header begins with `<|start|>` or `<|channel|>`; whitespace
    /// is dropped, other text is answer.
    Between,
    /// Inside a header, up to `<|message|>`.
    Header,
    /// Inside a message's content.
    Body(Content),
}

/// What a header says about the message that follows it.
#[derive(Debug, PartialEq, Eq)]
struct Header<'a> {
    channel: Option<&'a str>,
    recipient: Option<&'a str>,
}

impl<'a> Header<'a> {
    /// `text`: the header, from its first marker up to `<|message|>`, e.g.
    /// `<|start|>assistant to=functions.f<|channel|>commentary <|constrain|>json`.
    fn parse(text: &'a str) -> Self {
        let words = |s: &'a str| {
            s.split(|c: char| c.is_whitespace() || c == '<')
                .filter(|w| !w.is_empty())
        };
        let channel = text
            .split_once(CHANNEL)
            .and_then(|(_, rest)| words(rest).next());
        let recipient = words(text).find_map(|w| w.strip_prefix("to="));
        Self { channel, recipient }
    }

    fn content(&self) -> Content {
        match (self.recipient, self.channel) {
            (Some(_), _) => Content::Call,
            (None, Some("analysis")) => Content::Reasoning,
            (None, Some("final" | "commentary") | None) => Content::Answer,
            // A channel gpt-oss does not define: not for the user, not lost either.
            (None, Some(_)) => Content::Reasoning,
        }
    }

    /// The tool a call message calls: its recipient without the `functions.` namespace.
    fn tool(&self) -> Option<&'a str> {
        self.recipient
            .map(|r| r.strip_prefix("functions.").unwrap_or(r))
    }
}

/// Splits one output's text into reasoning, answer and tool calls as it arrives. Pushing
/// a text whole or in any pieces gives the same pieces, joined.
#[derive(Debug, Clone)]
pub(super) struct HarmonySplitter {
    state: State,
    held: String,
    /// Whether a message of this kind gave text already (the next one's text follows a
    /// newline).
    said_reasoning: bool,
    said_answer: bool,
    /// Whether the current message gave text yet.
    message_said: bool,
}

impl HarmonySplitter {
    /// `in_header`: the prompt ended inside a message's header (`<|start|>assistant`,
    /// as gpt-oss's template ends it), so the output begins with the header's rest.
    pub(super) fn new(in_header: bool) -> Self {
        Self {
            state: if in_header {
                State::Header
            } else {
                State::Between
            },
            held: String::new(),
            said_reasoning: false,
            said_answer: false,
            message_said: false,
        }
    }

    /// Whether the output is inside reasoning now.
    pub(super) fn thinking(&self) -> bool {
        self.state == State::Body(Content::Reasoning)
    }

    /// The pieces `text` completes.
    pub(super) fn push(&mut self, text: &str) -> Vec<ThinkingPiece> {
        self.held.push_str(text);
        let mut pieces = Vec::new();
        while self.step(&mut pieces) {}
        pieces
    }

    /// The pieces held at the output's end: the rest of a message's content, or text
    /// that could still have become a marker. An unfinished header is dropped.
    pub(super) fn finish(&mut self) -> Vec<ThinkingPiece> {
        let held = std::mem::take(&mut self.held);
        let mut pieces = Vec::new();
        match self.state {
            State::Body(content) => self.say(content, held, &mut pieces),
            State::Between if !held.trim().is_empty() => {
                self.say(Content::Answer, held, &mut pieces)
            }
            State::Between | State::Header => {}
        }
        pieces
    }

    /// One move on the held text; false when it needs more text.
    fn step(&mut self, pieces: &mut Vec<ThinkingPiece>) -> bool {
        match self.state {
            State::Between => {
                let rest = self.held.trim_start();
                if rest.starts_with(START) || rest.starts_with(CHANNEL) {
                    self.held = rest.to_string();
                    self.state = State::Header;
                    true
                } else if rest.is_empty() || START.starts_with(rest) || CHANNEL.starts_with(rest) {
                    false
                } else {
                    self.begin(Content::Answer);
                    true
                }
            }
            State::Header => match self.held.find(MESSAGE) {
                Some(at) => {
                    let header = Header::parse(&self.held[..at]);
                    let content = header.content();
                    if let (Content::Call, Some(name)) = (content, header.tool()) {
                        pieces.push(ThinkingPiece::Call {
                            name: name.to_string(),
                        });
                    }
                    self.held.drain(..at + MESSAGE.len());
                    self.begin(content);
                    true
                }
                None if self.held.len() > MAX_HEADER_BYTES => {
                    let text = std::mem::take(&mut self.held);
                    self.begin(Content::Answer);
                    self.say(Content::Answer, text, pieces);
                    false
                }
                None => false,
            },
            State::Body(content) => {
                let end = CONTENT_ENDS
                    .iter()
                    .filter_map(|m| self.held.find(m).map(|at| (at, *m)))
                    .min();
                match end {
                    Some((at, marker)) => {
                        let rest = self.held.split_off(at);
                        let text = std::mem::replace(&mut self.held, rest);
                        self.say(content, text, pieces);
                        if marker != START && marker != CHANNEL {
                            self.held.drain(..marker.len());
                        }
                        self.state = State::Between;
                        true
                    }
                    None => {
                        let keep = CONTENT_ENDS
                            .iter()
                            .map(|m| super::partial_tag_len(&self.held, m))
                            .max()
                            .unwrap_or(0);
                        let rest = self.held.split_off(self.held.len() - keep);
                        let text = std::mem::replace(&mut self.held, rest);
                        self.say(content, text, pieces);
                        false
                    }
                }
            }
        }
    }

    fn begin(&mut self, content: Content) {
        self.state = State::Body(content);
        self.message_said = false;
    }

    /// Gives `text` of the current message, after the newline that parts it from an
    /// earlier message of its kind.
    fn say(&mut self, content: Content, text: String, pieces: &mut Vec<ThinkingPiece>) {
        if text.is_empty() {
            return;
        }
        let said = match content {
            Content::Reasoning => &mut self.said_reasoning,
            Content::Answer => &mut self.said_answer,
            Content::Call => {
                pieces.push(ThinkingPiece::Arguments(text));
                return;
            }
        };
        let text = if *said && !self.message_said {
            format!("\n{text}")
        } else {
            text
        };
        *said = true;
        self.message_said = true;
        pieces.push(match content {
            Content::Reasoning => ThinkingPiece::Reasoning(text),
            _ => ThinkingPiece::Answer(text),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reasoning::tests::three_way_cuts;

    /// Reasoning, answer and calls (name, arguments) of the output `texts` make.
    fn read(in_header: bool, texts: &[&str]) -> (String, String, Vec<(String, String)>) {
        let mut s = HarmonySplitter::new(in_header);
        let mut pieces = Vec::new();
        for text in texts {
            pieces.extend(s.push(text));
        }
        pieces.extend(s.finish());
        let (mut reasoning, mut answer, mut calls) = (String::new(), String::new(), Vec::new());
        for piece in pieces {
            match piece {
                ThinkingPiece::Reasoning(t) => reasoning += &t,
                ThinkingPiece::Answer(t) => answer += &t,
                ThinkingPiece::Call { name } => calls.push((name, String::new())),
                ThinkingPiece::Arguments(t) => calls.last_mut().expect("a call is open").1 += &t,
            }
        }
        (reasoning, answer, calls)
    }

    fn call(name: &str, arguments: &str) -> (String, String) {
        (name.to_string(), arguments.to_string())
    }

    const REPLY: &str = "<|channel|>analysis<|message|>User asks 2+2. Easy.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.";

    #[test]
    fn analysis_is_reasoning_and_final_the_answer() {
        let (reasoning, answer, calls) = read(true, &[REPLY]);
        assert_eq!(reasoning, "User asks 2+2. Easy.");
        assert_eq!(answer, "2 + 2 = 4.");
        assert!(calls.is_empty());
        // The final channel straight away; `<|return|>` kept (include_stop_str_in_output).
        let (reasoning, answer, _) =
            read(true, &["<|channel|>final<|message|>Hi there.<|return|>"]);
        assert_eq!((reasoning.as_str(), answer.as_str()), ("", "Hi there."));
    }

    #[test]
    fn a_message_to_a_function_is_a_call_in_either_header_order() {
        let after_channel = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>";
        let before_channel = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}";
        for text in [after_channel, before_channel] {
            let (reasoning, answer, calls) = read(true, &[text]);
            assert_eq!(reasoning, "Need weather.");
            assert_eq!(answer, "");
            assert_eq!(calls, vec![call("get_weather", "{\"city\": \"Oslo\"}")]);
        }
        // A built-in tool keeps its whole recipient as the name; two calls, two entries.
        let text = "<|channel|>commentary to=browser.search<|message|>{\"q\": 1}<|call|><|start|>assistant<|channel|>commentary to=functions.f<|message|>{}";
        assert_eq!(
            read(true, &[text]).2,
            vec![call("browser.search", "{\"q\": 1}"), call("f", "{}")]
        );
    }

    #[test]
    fn messages_of_one_kind_are_joined_by_a_newline() {
        let text = "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|><|start|>assistant<|channel|>final<|message|>Done.<|return|>";
        let (reasoning, answer, _) = read(true, &[text]);
        assert_eq!(reasoning, "One.\nTwo.");
        // A preamble (commentary to no one) is for the user, as vLLM gives it.
        assert_eq!(answer, "Let me look.\nDone.");
    }

    #[test]
    fn an_output_that_is_not_harmony_is_all_answer() {
        for text in [
            "Hello there.",
            "  <|st",
            "<|channel",
            "a <|channel|>final<|message|>b",
        ] {
            let (reasoning, answer, calls) = read(false, &[text]);
            assert_eq!(reasoning, "", "{text:?}");
            assert!(calls.is_empty());
            let expected = match text {
                // Text before a header is answer; the header's message follows it.
                "a <|channel|>final<|message|>b" => "a \nb",
                _ => text,
            };
            assert_eq!(answer, expected, "{text:?}");
        }
        // Without the prompt's header, an output may still open one itself.
        assert_eq!(read(false, &[REPLY]).1, "2 + 2 = 4.");
        // A "header" too long to be one is kept as answer.
        let long = "x".repeat(MAX_HEADER_BYTES + 1);
        assert_eq!(read(true, &[&long]).1, long);
    }

    #[test]
    fn an_output_cut_short_keeps_what_it_said() {
        assert_eq!(
            read(true, &["<|channel|>analysis<|message|>Thinking ab"]).0,
            "Thinking ab"
        );
        // Cut inside a header: nothing to give.
        assert_eq!(
            read(
                true,
                &["<|channel|>analysis<|message|>A.<|end|><|start|>assi"]
            ),
            ("A.".into(), String::new(), vec![])
        );
        // A content's end that is only the start of a marker is text.
        assert_eq!(
            read(true, &["<|channel|>final<|message|>x <|en"]).1,
            "x <|en"
        );
    }

    #[test]
    fn pieces_in_any_cut_give_the_whole_split() {
        let texts = [
            REPLY,
            "<|channel|>analysis<|message|>é<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{\"a\":\"ü\"}<|call|>",
            "<|channel|>commentary<|message|>pre<|end|>\n<|start|>assistant<|channel|>final<|message|>an<|ret",
            "plain <|channel|>x",
        ];
        for in_header in [false, true] {
            for text in texts {
                let whole = read(in_header, &[text]);
                for cut in three_way_cuts(text) {
                    assert_eq!(read(in_header, &cut), whole, "{text:?} cut as {cut:?}");
                }
            }
        }
    }

    #[test]
    fn content_goes_out_as_it_comes_but_a_possible_marker_waits() {
        let mut s = HarmonySplitter::new(true);
        assert_eq!(s.push("<|channel|>analy"), vec![]);
        assert!(!s.thinking());
        assert_eq!(s.push("sis<|message|>"), vec![]);
        assert!(s.thinking());
        assert_eq!(
            s.push("Hmm<|e"),
            vec![ThinkingPiece::Reasoning("Hmm".into())]
        );
        assert_eq!(s.push("nd|>"), vec![]);
        assert!(!s.thinking());
        assert_eq!(
            s.push("<|start|>assistant<|channel|>final<|message|>4"),
            vec![ThinkingPiece::Answer("4".into())]
        );
    }

    #[test]
    fn headers_name_their_channel_and_recipient() {
        let h =
            Header::parse("<|start|>assistant to=functions.get_weather<|channel|>commentary json");
        assert_eq!(
            h,
            Header {
                channel: Some("commentary"),
                recipient: Some("functions.get_weather")
            }
        );
        assert_eq!(h.tool(), Some("get_weather"));
        let h = Header::parse("<|channel|>analysis");
        assert_eq!(
            (h.channel, h.recipient, h.content()),
            (Some("analysis"), None, Content::Reasoning)
        );
        assert_eq!(
            Header::parse("<|start|>assistant").content(),
            Content::Answer
        );
    }
}
