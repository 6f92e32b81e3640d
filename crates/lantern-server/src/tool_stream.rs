//! Tool calls streamed as they are generated, as vLLM streams them: text outside
//! `<tool_call>` blocks goes out as content as it comes (what may be the start of a tag,
//! and trailing whitespace, held back), and a call goes out as a first delta with its
//! name once the name and the start of its arguments are known, then its arguments'
//! JSON text in fragments as they are generated.
//!
//! A call's body that does not begin `{"name": "…", "arguments": ` (the Hermes order)
//! goes out whole when its block closes; an output that may be one Llama 3 style JSON
//! call (it begins with `{` or `<|python_tag|>`) is held to its end and parsed whole,
//! as a response that is not streamed is ([`parse_tool_calls`]).

use lantern_engine::validate::tools::{parse_tool_call_body, parse_tool_calls};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// A piece of a streamed chat choice with tools.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolDelta {
    Content(String),
    /// Call `index` begins (its arguments follow).
    CallStart {
        index: usize,
        name: String,
    },
    /// More of call `index`'s arguments' JSON text.
    Arguments {
        index: usize,
        text: String,
    },
}

/// Tells where a JSON value ends as its text arrives.
#[derive(Debug, Default)]
struct ValueEnd {
    depth: usize,
    in_string: bool,
    escaped: bool,
    done: bool,
}

impl ValueEnd {
    /// Bytes of `text` (the value's next text) that belong to the value.
    fn scan(&mut self, text: &str) -> usize {
        for (i, c) in text.char_indices() {
            if self.done {
                return i;
            }
            if self.in_string {
                match (self.escaped, c) {
                    (true, _) => self.escaped = false,
                    (false, '\\') => self.escaped = true,
                    (false, '"') => {
                        self.in_string = false;
                        self.done = self.depth == 0;
                    }
                    _ => {}
                }
                continue;
            }
            match c {
                '"' => self.in_string = true,
                '{' | '[' => self.depth += 1,
                '}' | ']' if self.depth > 0 => {
                    self.depth -= 1;
                    self.done = self.depth == 0;
                }
                // A scalar ends before the delimiter that follows it.
                '}' | ']' | ',' if self.depth == 0 => {
                    self.done = true;
                    return i;
                }
                c if c.is_whitespace() && self.depth == 0 => {
                    self.done = true;
                    return i;
                }
                _ => {}
            }
        }
        text.len()
    }
}

/// Bytes of the JSON string at the start of `text` (quotes included), once it is closed.
fn string_len(text: &str) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in text.char_indices().skip(1) {
        match (escaped, c) {
            (true, _) => escaped = false,
            (false, '\\') => escaped = true,
            (false, '"') => return Some(i + 1),
            _ => {}
        }
    }
    None
}

/// The name of a call whose body is arriving and where its arguments' value begins,
/// once both are there, when the body is in the Hermes order.
fn call_head(body: &str) -> Option<(String, usize)> {
    let skip = |at: usize| body.len() - body[at..].trim_start().len();
    let expect = |at: usize, s: &str| {
        let at = skip(at);
        body[at..].starts_with(s).then_some(at + s.len())
    };
    let at = expect(0, "{")?;
    let at = expect(at, "\"name\"")?;
    let start = skip(expect(at, ":")?);
    if !body[start..].starts_with('"') {
        return None;
    }
    let end = start + string_len(&body[start..])?;
    let name: String = serde_json::from_str(&body[start..end]).ok()?;
    let at = expect(end, ",")?;
    let at = expect(at, "\"arguments\"").or_else(|| expect(at, "\"parameters\""))?;
    let value = skip(expect(at, ":")?);
    (value < body.len()).then_some((name, value))
}

/// A call whose arguments are being streamed.
#[derive(Debug)]
struct OpenCall {
    index: usize,
    /// Next byte of the output's text to send as arguments.
    at: usize,
    end: ValueEnd,
}

#[derive(Debug)]
enum Block {
    Text,
    /// Inside `<tool_call>`; the body begins at byte `body`.
    Call {
        body: usize,
        open: Option<OpenCall>,
    },
}

/// One choice's output, turned into deltas as it arrives.
#[derive(Debug)]
pub struct ToolCallStream {
    text: String,
    /// Bytes of `text` dealt with (sent, or part of a call).
    done: usize,
    block: Block,
    calls: usize,
}

impl Default for ToolCallStream {
    fn default() -> Self {
        Self {
            text: String::new(),
            done: 0,
            block: Block::Text,
            calls: 0,
        }
    }
}

impl ToolCallStream {
    /// Whether any call went out.
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// The first delta of a call read outside the text (harmony's messages to a
    /// function), numbered after the calls before it.
    pub fn start_call(&mut self, name: String) -> ToolDelta {
        let index = self.calls;
        self.calls += 1;
        ToolDelta::CallStart { index, name }
    }

    /// More of the arguments of the call [`Self::start_call`] began last.
    pub fn call_arguments(&self, text: String) -> ToolDelta {
        ToolDelta::Arguments {
            index: self.calls.saturating_sub(1),
            text,
        }
    }

    /// The deltas that `text`, the output's next text, makes ready.
    pub fn push(&mut self, text: &str) -> Vec<ToolDelta> {
        self.text.push_str(text);
        let mut out = Vec::new();
        self.advance(false, &mut out);
        out
    }

    /// The deltas left once the output is complete.
    pub fn finish(&mut self) -> Vec<ToolDelta> {
        let mut out = Vec::new();
        self.advance(true, &mut out);
        out
    }

    fn call(&mut self, name: String, out: &mut Vec<ToolDelta>) -> usize {
        let delta = self.start_call(name);
        out.push(delta);
        self.calls - 1
    }

    fn advance(&mut self, end: bool, out: &mut Vec<ToolDelta>) {
        loop {
            let more = if matches!(self.block, Block::Text) {
                self.text_part(end, out)
            } else {
                self.call_part(end, out)
            };
            if !more {
                return;
            }
        }
    }

    /// Sends content up to the next block; true when a block opened.
    fn text_part(&mut self, end: bool, out: &mut Vec<ToolDelta>) -> bool {
        let rest = &self.text[self.done..];
        let start = rest.trim_start();
        if self.done == 0 && (start.starts_with('{') || start.starts_with(PYTHON_TAG)) {
            // Perhaps one Llama 3 style call: only the whole output tells.
            if end {
                let (calls, content) = parse_tool_calls(rest);
                if !content.is_empty() {
                    out.push(ToolDelta::Content(content));
                }
                for call in calls {
                    let index = self.call(call.name, out);
                    out.push(ToolDelta::Arguments {
                        index,
                        text: call.arguments,
                    });
                }
                self.done = self.text.len();
            }
            return false;
        }
        if self.done == 0 && !end && PYTHON_TAG.starts_with(start) {
            return false;
        }
        if let Some(at) = rest.find(OPEN) {
            let content = rest[..at].trim_end();
            if !content.is_empty() {
                out.push(ToolDelta::Content(content.to_string()));
            }
            self.done += at + OPEN.len();
            self.block = Block::Call {
                body: self.done,
                open: None,
            };
            return true;
        }
        let send = if end {
            // Without calls the text goes out as it is, as in a whole response.
            if self.called() {
                rest.trim_end().len()
            } else {
                rest.len()
            }
        } else {
            let held = (1..OPEN.len())
                .rev()
                .find(|&n| rest.ends_with(&OPEN[..n]))
                .unwrap_or(0);
            rest[..rest.len() - held].trim_end().len()
        };
        if send > 0 {
            out.push(ToolDelta::Content(rest[..send].to_string()));
        }
        self.done += send;
        false
    }

    /// Streams the open block's call; true when the block closed.
    fn call_part(&mut self, end: bool, out: &mut Vec<ToolDelta>) -> bool {
        let Block::Call { body, open } = &mut self.block else {
            return false;
        };
        let body = *body;
        let mut open = open.take();
        let close = self.text[body..].find(CLOSE);
        let body_end = body + close.unwrap_or(self.text.len() - body);
        if open.is_none() {
            if let Some((name, value)) = call_head(&self.text[body..body_end]) {
                let index = self.call(name, out);
                open = Some(OpenCall {
                    index,
                    at: body + value,
                    end: ValueEnd::default(),
                });
            }
        }
        if let Some(call) = &mut open {
            let n = call.end.scan(&self.text[call.at..body_end]);
            if n > 0 {
                out.push(ToolDelta::Arguments {
                    index: call.index,
                    text: self.text[call.at..call.at + n].to_string(),
                });
                call.at += n;
            }
        }
        if close.is_none() && !end {
            self.block = Block::Call { body, open };
            return false;
        }
        if open.is_none() {
            // Not in the Hermes order: the whole body, or the block as text.
            let text = &self.text[body..body_end];
            match parse_tool_call_body(text) {
                Some(call) => {
                    let index = self.call(call.name, out);
                    out.push(ToolDelta::Arguments {
                        index,
                        text: call.arguments,
                    });
                }
                None => {
                    let closing = if close.is_some() { CLOSE } else { "" };
                    out.push(ToolDelta::Content(format!("{OPEN}{text}{closing}")));
                }
            }
        }
        self.done = close.map_or(self.text.len(), |_| body_end + CLOSE.len());
        self.block = Block::Text;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    /// Content, calls (name, arguments) and the number of argument deltas of `text`
    /// streamed in pieces of `step` characters.
    fn streamed(text: &str, step: usize) -> (String, Vec<(String, String)>, usize) {
        let mut stream = ToolCallStream::default();
        let chars: Vec<char> = text.chars().collect();
        let mut deltas = Vec::new();
        for piece in chars.chunks(step) {
            deltas.extend(stream.push(&piece.iter().collect::<String>()));
        }
        deltas.extend(stream.finish());
        let (mut content, mut calls, mut fragments) = (String::new(), Vec::new(), 0);
        for d in deltas {
            match d {
                ToolDelta::Content(c) => content.push_str(&c),
                ToolDelta::CallStart { index, name } => {
                    assert_eq!(index, calls.len());
                    calls.push((name, String::new()));
                }
                ToolDelta::Arguments { index, text } => {
                    calls[index].1.push_str(&text);
                    fragments += 1;
                }
            }
        }
        (content, calls, fragments)
    }

    fn json(text: &str) -> Value {
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    #[test]
    fn calls_stream_their_arguments_and_match_the_whole_parse() {
        for text in [
            "Let me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo \\\"}\", \"days\": [1, 2]}}\n</tool_call>\n<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>",
            "<tool_call>\n{\"name\": \"f\", \"parameters\": 12}\n</tool_call>",
            "<tool_call>\n{\"arguments\": {\"x\": 1}, \"name\": \"late\"}\n</tool_call>",
            "<tool_call>\n{\"name\": \"cut\", \"arguments\": {\"x\": 1}}\n",
            "<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}",
        ] {
            let (whole_calls, whole_rest) = parse_tool_calls(text);
            for step in [1, 3, 1000] {
                let (content, calls, _) = streamed(text, step);
                assert_eq!(content, whole_rest, "{text:?} by {step}");
                assert_eq!(calls.len(), whole_calls.len(), "{text:?} by {step}");
                for ((name, args), whole) in calls.iter().zip(&whole_calls) {
                    assert_eq!(name, &whole.name);
                    assert_eq!(json(args), json(&whole.arguments), "{text:?} by {step}");
                }
            }
        }
        // Token by token, the arguments go out in many fragments.
        let (_, calls, fragments) = streamed(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            2,
        );
        assert_eq!(calls[0].1, "{\"city\": \"Paris\"}");
        assert!(fragments > 3, "{fragments}");
    }

    #[test]
    fn text_goes_out_as_it_comes_and_bad_blocks_stay_text() {
        let mut stream = ToolCallStream::default();
        assert_eq!(
            stream.push("Hello <b>world</b> <tool_"),
            vec![ToolDelta::Content("Hello <b>world</b>".into())]
        );
        assert_eq!(
            stream.push("x"),
            vec![ToolDelta::Content(" <tool_x".into())]
        );
        assert!(!stream.called());
        for text in [
            "Just text, with a { brace.  ",
            "<tool_call>not json</tool_call> after",
            "{\"a\": 1}",
            "<",
        ] {
            for step in [1, 4, 1000] {
                let (content, calls, _) = streamed(text, step);
                assert!(calls.is_empty(), "{text:?}");
                assert_eq!(content, text, "{text:?} by {step}");
            }
        }
    }
}
