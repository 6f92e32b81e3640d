//! Tool calling on chat: the `tools` and `tool_choice` fields, how the tools and tool
//! messages reach the chat template, the grammar that enforces `required` and named
//! choices, and the parser that turns generated text into `tool_calls`.
//!
//! A template that reads a `tools` variable (Qwen2.5, Hermes, Llama 3.1 style) gets the
//! allowed functions there and describes them itself; one that writes assistant
//! `tool_calls` and `role: tool` turns gets those messages structured. lantern's built-in
//! models' templates (SmolLM2, Gemma 3) do neither, so for them the tools are described in
//! a system message, in the Hermes/Qwen convention llama.cpp and vLLM use for such
//! templates: the model answers `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
//! Tool results (`role: tool`) then go back as user turns wrapped in `<tool_response>`,
//! an assistant turn's `tool_calls` as `<tool_call>` blocks ([`fit_template`]).

use crate::validate::InvalidRequest;
use lantern_guided::Guide;
use lantern_model::{ChatMessage, ChatRenderOptions, ToolSupport};
use serde_json::{json, Value};

const FIELD: &str = "tools";

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolFunction {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the arguments (an empty object schema when not given).
    pub parameters: Value,
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The tools of a chat request, when it offers any and does not say `none`.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatTools {
    pub functions: Vec<ToolFunction>,
    pub choice: ToolChoice,
}

/// A call parsed from the output.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON text (OpenAI's wire form).
    pub arguments: String,
}

fn parse_function(i: usize, tool: &Value) -> Result<ToolFunction, InvalidRequest> {
    let at = |what: &str| InvalidRequest::invalid(FIELD, format!("tools[{i}]: {what}"));
    if tool.get("type").and_then(Value::as_str) != Some("function") {
        return Err(at("only tools of type `function` are supported"));
    }
    let f = tool
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| at("`function` must be an object"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| at("`function.name` must be a non-empty string"))?;
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => return Err(at("`function.parameters` must be a JSON schema object")),
    };
    Ok(ToolFunction {
        name: name.to_string(),
        description: f
            .get("description")
            .and_then(Value::as_str)
            .map(str::to_string),
        parameters,
    })
}

fn choice_needs_tools() -> InvalidRequest {
    InvalidRequest::invalid(
        "tool_choice",
        "a `required` or named tool_choice needs `tools`, and none were given",
    )
}

fn parse_choice(value: Option<&Value>, names: &[&str]) -> Result<ToolChoice, InvalidRequest> {
    const CHOICE: &str = "tool_choice";
    let wrong = || {
        InvalidRequest::invalid(
            CHOICE,
            "tool_choice must be `none`, `auto`, `required` or {\"type\": \"function\", \"function\": {\"name\": …}}",
        )
    };
    match value {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(ToolChoice::None),
            "auto" => Ok(ToolChoice::Auto),
            "required" => Ok(ToolChoice::Required),
            _ => Err(wrong()),
        },
        Some(obj) => {
            let name = obj
                .pointer("/function/name")
                .and_then(Value::as_str)
                .ok_or_else(wrong)?;
            if !names.contains(&name) {
                return Err(InvalidRequest::invalid(
                    CHOICE,
                    format!("tool_choice names `{name}`, which is not among the tools"),
                ));
            }
            Ok(ToolChoice::Named(name.to_string()))
        }
    }
}

/// Reads `tools` and `tool_choice`. `None` when no tool is offered or the choice is
/// `none` (the request is then a plain chat).
pub fn parse_tools(body: &Value) -> Result<Option<ChatTools>, InvalidRequest> {
    let tools = match body.get("tools") {
        None | Some(Value::Null) => &[][..],
        Some(Value::Array(t)) => &t[..],
        Some(_) => return Err(InvalidRequest::invalid(FIELD, "tools must be a list")),
    };
    if tools.is_empty() {
        // A choice that forces a call cannot be met without tools; `required` over an
        // empty list is `none`, as vLLM takes it.
        let empty_list = body.get("tools").is_some_and(Value::is_array);
        return match body.get("tool_choice") {
            Some(Value::Object(_)) => Err(choice_needs_tools()),
            Some(Value::String(s)) if s == "required" && !empty_list => Err(choice_needs_tools()),
            Some(Value::String(s)) if s == "required" => Ok(None),
            other => parse_choice(other, &[]).map(|_| None),
        };
    }
    let functions = tools
        .iter()
        .enumerate()
        .map(|(i, t)| parse_function(i, t))
        .collect::<Result<Vec<_>, _>>()?;
    let names: Vec<&str> = functions.iter().map(|f| f.name.as_str()).collect();
    match parse_choice(body.get("tool_choice"), &names)? {
        ToolChoice::None => Ok(None),
        choice => Ok(Some(ChatTools { functions, choice })),
    }
}

impl ChatTools {
    /// The functions `tool_choice` allows.
    fn allowed(&self) -> impl Iterator<Item = &ToolFunction> {
        self.functions.iter().filter(move |f| match &self.choice {
            ToolChoice::Named(n) => &f.name == n,
            _ => true,
        })
    }

    /// The functions `tool_choice` allows, in OpenAI's shape, as chat templates and the
    /// system prompt describe them.
    pub fn offered(&self) -> Vec<Value> {
        self.allowed()
            .map(|f| {
                let mut function = serde_json::Map::new();
                function.insert("name".into(), json!(f.name));
                if let Some(d) = &f.description {
                    function.insert("description".into(), json!(d));
                }
                function.insert("parameters".into(), f.parameters.clone());
                json!({"type": "function", "function": function})
            })
            .collect()
    }

    /// For `required` and a named choice: a grammar whose only outputs are calls of the
    /// allowed functions with arguments valid against their schemas.
    pub fn guide(&self) -> Option<Guide> {
        if self.choice == ToolChoice::Auto {
            return None;
        }
        let calls: Vec<Value> = self
            .allowed()
            .map(|f| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f.name}, "arguments": f.parameters},
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        // Compact, as structured output's JSON: streamed arguments are then the same
        // text as the parsed call's.
        let schema = json!({"anyOf": calls, "x-guidance": lantern_guided::compact_json_options()});
        Some(Guide::Lark(format!(
            "start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {schema}"
        )))
    }
}

/// The system text describing `tools` and how to call them.
fn system_prompt(tools: &[Value]) -> String {
    let specs: Vec<String> = tools.iter().map(Value::to_string).collect();
    format!(
        "You may call one or more functions to help with the user's request. The functions are listed within <tools></tools>:\n<tools>\n{}\n</tools>\nTo call a function, answer with a JSON object holding its name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
        specs.join("\n")
    )
}

/// The conversation with `tools` described in the first system message.
fn with_system_prompt(tools: &[Value], mut messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
    let prompt = system_prompt(tools);
    match messages.first_mut() {
        Some(first) if first.role == "system" => {
            first.content = format!("{}\n\n{prompt}", first.content);
        }
        _ => messages.insert(0, ChatMessage::new("system", &prompt)),
    }
    messages
}

/// A tool message as the Hermes convention writes it, for a template that does not:
/// a tool's result becomes a user turn in `<tool_response>`, an assistant's calls
/// `<tool_call>` blocks after its text.
fn as_hermes_text(message: &ChatMessage) -> ChatMessage {
    if message.role == "tool" {
        return ChatMessage::new(
            "user",
            &format!("<tool_response>\n{}\n</tool_response>", message.content),
        );
    }
    let mut text = message.content.clone();
    for call in message.tool_calls.iter().flatten() {
        let f = &call["function"];
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str(&format!(
            "<tool_call>\n{}\n</tool_call>",
            json!({"name": f["name"], "arguments": f["arguments"]})
        ));
    }
    ChatMessage::new(&message.role, &text)
}

/// The conversation and options fitted to what a template does with tools: the tools
/// go to its `tools` variable, or are described in a system message when it has none;
/// tool results and assistant calls stay structured for a template that writes them,
/// and become Hermes text for one that does not. `None` when nothing changes.
pub fn fit_template(
    support: ToolSupport,
    messages: &[ChatMessage],
    options: &ChatRenderOptions,
) -> Option<(Vec<ChatMessage>, ChatRenderOptions)> {
    let describe = options.tools.is_some() && !support.tools;
    let as_text = |m: &ChatMessage| {
        (m.role == "tool" && !support.tool_role) || (m.tool_calls.is_some() && !support.tool_calls)
    };
    if !describe && !messages.iter().any(as_text) {
        return None;
    }
    let mut messages: Vec<ChatMessage> = messages
        .iter()
        .map(|m| {
            if as_text(m) {
                as_hermes_text(m)
            } else {
                m.clone()
            }
        })
        .collect();
    let mut options = options.clone();
    if describe {
        let tools = options.tools.take().unwrap_or_default();
        messages = with_system_prompt(&tools, messages);
    }
    Some((messages, options))
}

/// A message's tool fields as chat templates read them: an assistant's `tool_calls`
/// (arguments as a JSON object, as OpenAI's JSON text is parsed), a tool result's
/// `tool_call_id` and `name`. The error names what is wrong.
pub fn read_tool_fields(
    role: &str,
    obj: &serde_json::Map<String, Value>,
    message: &mut ChatMessage,
) -> Result<(), String> {
    let text = |field: &str| match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(format!("`{field}` must be a string")),
    };
    match role {
        "tool" => {
            message.tool_call_id = text("tool_call_id")?;
            message.name = text("name")?;
        }
        "assistant" => {
            let calls = match obj.get("tool_calls") {
                None | Some(Value::Null) => return Ok(()),
                Some(Value::Array(calls)) if calls.is_empty() => return Ok(()),
                Some(Value::Array(calls)) => calls,
                Some(_) => return Err("`tool_calls` must be a list".into()),
            };
            let calls = calls
                .iter()
                .enumerate()
                .map(|(j, call)| template_call(call).ok_or_else(|| format!("tool_calls[{j}] needs `function.name` (a string) and `arguments` (a JSON text or object)")))
                .collect::<Result<Vec<_>, _>>()?;
            message.tool_calls = Some(calls);
        }
        _ => {}
    }
    Ok(())
}

/// One call of an assistant message in the shape templates read.
fn template_call(call: &Value) -> Option<Value> {
    let f = call.get("function")?;
    let name = f.get("name")?.as_str()?;
    // OpenAI sends arguments as a JSON text; templates write them with `tojson`.
    let arguments = match f.get("arguments") {
        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
        Some(v @ Value::Object(_)) => v.clone(),
        None | Some(Value::Null) => json!({}),
        Some(_) => return None,
    };
    let mut out = json!({"type": "function", "function": {"name": name, "arguments": arguments}});
    if let Some(id) = call.get("id").and_then(Value::as_str) {
        out["id"] = json!(id);
    }
    Some(out)
}

fn call_from_json(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?;
    // Llama 3 writes `parameters`, Hermes `arguments`.
    let args = v.get("arguments").or_else(|| v.get("parameters"))?;
    let arguments = match args {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    Some(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

/// The call in the body of a `<tool_call>` block, if it is one.
pub fn parse_tool_call_body(body: &str) -> Option<ToolCall> {
    serde_json::from_str::<Value>(body.trim())
        .ok()
        .as_ref()
        .and_then(call_from_json)
}

/// The calls in a generated text, and the text outside them. Recognizes Hermes/Qwen
/// `<tool_call>{json}</tool_call>` blocks (any number) and a whole output that is one
/// Llama 3 style JSON call (`{"name": …, "parameters": …}`, optionally after
/// `<|python_tag|>`). No calls: the text comes back unchanged.
pub fn parse_tool_calls(text: &str) -> (Vec<ToolCall>, String) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut calls = Vec::new();
    let mut rest = String::new();
    let mut tail = text;
    while let Some(start) = tail.find(OPEN) {
        let after = &tail[start + OPEN.len()..];
        let (body, next) = match after.find(CLOSE) {
            Some(end) => (&after[..end], &after[end + CLOSE.len()..]),
            // An unclosed last block (the model stopped at its end-of-turn).
            None => (after, ""),
        };
        match parse_tool_call_body(body) {
            Some(call) => {
                rest.push_str(&tail[..start]);
                calls.push(call);
            }
            None => rest.push_str(&tail[..start + OPEN.len() + (after.len() - next.len())]),
        }
        tail = next;
    }
    rest.push_str(tail);
    if calls.is_empty() {
        let bare = text.trim().trim_start_matches("<|python_tag|>").trim();
        if bare.starts_with('{') {
            if let Some(call) = serde_json::from_str::<Value>(bare)
                .ok()
                .as_ref()
                .and_then(call_from_json)
            {
                return (vec![call], String::new());
            }
        }
        return (Vec::new(), text.to_string());
    }
    (calls, rest.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hermes_blocks_become_calls_and_the_rest_stays_text() {
        let (calls, rest) = parse_tool_calls(
            "Let me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>{\"name\": \"time\", \"arguments\": {}}</tool_call>",
        );
        assert_eq!(rest, "Let me check.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].name, "weather");
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert_eq!(args, json!({"city": "Oslo"}));
        assert_eq!(calls[1].name, "time");
        assert_eq!(calls[1].arguments, "{}");
    }

    #[test]
    fn llama3_json_unclosed_blocks_and_plain_text() {
        let (calls, rest) =
            parse_tool_calls("<|python_tag|>{\"name\": \"f\", \"parameters\": {\"x\": 1}}");
        assert_eq!((calls[0].name.as_str(), rest.as_str()), ("f", ""));
        assert_eq!(calls[0].arguments, "{\"x\":1}");
        let (calls, _) = parse_tool_calls("<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n");
        assert_eq!(calls[0].name, "g");
        for text in [
            "Just text.",
            "{\"a\": 1}",
            "<tool_call>not json</tool_call>",
        ] {
            let (calls, rest) = parse_tool_calls(text);
            assert!(calls.is_empty(), "{text}");
            assert_eq!(rest, text);
        }
    }

    #[test]
    fn tool_choice_is_parsed_and_checked() {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        let t = parse_tools(&json!({"tools": tools})).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert!(t.guide().is_none());
        assert!(parse_tools(&json!({"tools": tools, "tool_choice": "none"}))
            .unwrap()
            .is_none());
        for choice in [json!("none"), json!("auto"), Value::Null] {
            assert!(parse_tools(&json!({"tool_choice": choice}))
                .unwrap()
                .is_none());
        }
        // `required` over an empty list is `none` (vLLM's reading).
        assert!(
            parse_tools(&json!({"tools": [], "tool_choice": "required"}))
                .unwrap()
                .is_none()
        );
        let t = parse_tools(&json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}})).unwrap().unwrap();
        assert_eq!(t.choice, ToolChoice::Named("f".into()));
        assert!(matches!(t.guide(), Some(Guide::Lark(g)) if g.contains("\"const\":\"f\"")));
        for (body, field) in [
            (
                json!({"tools": tools, "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": tools, "tool_choice": "sometimes"}),
                "tool_choice",
            ),
            // Forcing a call with no tools to call.
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "f"}}}),
                "tool_choice",
            ),
            (json!({"tool_choice": "sometimes"}), "tool_choice"),
            (json!({"tools": [{"type": "retrieval"}]}), "tools"),
            (
                json!({"tools": [{"type": "function", "function": {}}]}),
                "tools",
            ),
        ] {
            assert_eq!(
                parse_tools(&body).unwrap_err().field(),
                Some(field),
                "{body}"
            );
        }
    }

    fn tools_options() -> ChatRenderOptions {
        let tools = json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]);
        let t = parse_tools(&json!({"tools": tools})).unwrap().unwrap();
        ChatRenderOptions {
            tools: Some(t.offered()),
            ..ChatRenderOptions::default()
        }
    }

    fn conversation() -> Vec<ChatMessage> {
        let mut call = ChatMessage::new("assistant", "");
        let obj = json!({"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]});
        read_tool_fields("assistant", obj.as_object().unwrap(), &mut call).unwrap();
        let mut result = ChatMessage::new("tool", "42");
        let obj = json!({"tool_call_id": "c1"});
        read_tool_fields("tool", obj.as_object().unwrap(), &mut result).unwrap();
        vec![ChatMessage::new("user", "hi"), call, result]
    }

    #[test]
    fn a_template_without_tools_gets_the_hermes_system_prompt_and_text() {
        let messages = conversation();
        assert_eq!(
            messages[1].tool_calls.as_ref().unwrap()[0]["function"]["arguments"],
            json!({"x": 1})
        );
        assert_eq!(messages[2].tool_call_id.as_deref(), Some("c1"));
        let (fitted, options) =
            fit_template(ToolSupport::default(), &messages, &tools_options()).unwrap();
        assert!(options.tools.is_none());
        assert_eq!(fitted[0].role, "system");
        assert!(
            fitted[0]
                .content
                .contains("<tools>\n{\"type\":\"function\",\"function\":{\"name\":\"f\""),
            "{}",
            fitted[0].content
        );
        assert_eq!(
            fitted[2].content,
            "<tool_call>\n{\"name\":\"f\",\"arguments\":{\"x\":1}}\n</tool_call>"
        );
        assert_eq!(
            (fitted[3].role.as_str(), fitted[3].content.as_str()),
            ("user", "<tool_response>\n42\n</tool_response>")
        );
        assert!(fitted.iter().all(|m| m.tool_calls.is_none()));
    }

    #[test]
    fn a_template_that_writes_tools_gets_them_as_they_are() {
        let all = ToolSupport {
            tools: true,
            tool_calls: true,
            tool_role: true,
        };
        assert!(fit_template(all, &conversation(), &tools_options()).is_none());
        // Tools read, but no turn for tool results: only those become text.
        let no_role = ToolSupport {
            tool_role: false,
            ..all
        };
        let (fitted, options) = fit_template(no_role, &conversation(), &tools_options()).unwrap();
        assert!(options.tools.is_some());
        assert!(fitted[1].tool_calls.is_some());
        assert_eq!(fitted[2].role, "user");
        let mut bad = ChatMessage::new("assistant", "");
        let obj = json!({"tool_calls": [{"function": {"arguments": "{}"}}]});
        let err = read_tool_fields("assistant", obj.as_object().unwrap(), &mut bad).unwrap_err();
        assert!(err.contains("tool_calls[0]"), "{err}");
    }
}
