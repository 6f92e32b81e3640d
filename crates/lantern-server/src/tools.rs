//! Tool calling on chat: the `tools` and `tool_choice` fields, the prompt that describes
//! the tools, the grammar that enforces `required` and named choices, and the parser
//! that turns generated text into `tool_calls`.
//!
//! lantern's models' chat templates (SmolLM2, Gemma 3) have no `tools` variable, so the
//! tools are described in a system message, in the Hermes/Qwen convention llama.cpp and
//! vLLM use for such templates: the model answers `<tool_call>{"name": …, "arguments":
//! {…}}</tool_call>`. Tool results (`role: tool`) go back as user turns wrapped in
//! `<tool_response>`; an assistant turn's `tool_calls` are written back as `<tool_call>`.

use crate::error::ApiError;
use lantern_engine::lantern_guided::Guide;
use lantern_model::ChatMessage;
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

fn parse_function(i: usize, tool: &Value) -> Result<ToolFunction, ApiError> {
    let at = |what: &str| ApiError::field(FIELD, format!("tools[{i}]: {what}"));
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

fn parse_choice(value: Option<&Value>, names: &[&str]) -> Result<ToolChoice, ApiError> {
    const CHOICE: &str = "tool_choice";
    let wrong = || {
        ApiError::field(
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
                return Err(ApiError::field(
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
pub fn parse_tools(body: &Value) -> Result<Option<ChatTools>, ApiError> {
    let tools = match body.get("tools") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(t)) => t,
        Some(_) => return Err(ApiError::field(FIELD, "tools must be a list")),
    };
    if tools.is_empty() {
        return Ok(None);
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

    /// The system text describing the tools and how to call them.
    pub fn system_prompt(&self) -> String {
        let specs: Vec<String> = self
            .allowed()
            .map(|f| {
                json!({"type": "function", "function": {
                    "name": f.name, "description": f.description, "parameters": f.parameters,
                }})
                .to_string()
            })
            .collect();
        format!(
            "You may call one or more functions to help with the user's request. The functions are listed within <tools></tools>:\n<tools>\n{}\n</tools>\nTo call a function, answer with a JSON object holding its name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
            specs.join("\n")
        )
    }

    /// The conversation with the tools described in the first system message.
    pub fn with_system_prompt(&self, mut messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
        let prompt = self.system_prompt();
        match messages.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{prompt}", first.content);
            }
            _ => messages.insert(0, ChatMessage::new("system", &prompt)),
        }
        messages
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
        let schema = json!({"anyOf": calls});
        Some(Guide::Lark(format!(
            "start: \"<tool_call>\\n\" call \"\\n</tool_call>\"\ncall: %json {schema}"
        )))
    }
}

/// `role: tool` and assistant `tool_calls` messages, as the Hermes convention writes
/// them: a tool's result becomes a user turn in `<tool_response>`, an assistant's calls
/// `<tool_call>` blocks after its text.
pub fn tool_message(
    role: &str,
    obj: &serde_json::Map<String, Value>,
    content: &str,
) -> Option<ChatMessage> {
    match role {
        "tool" => Some(ChatMessage::new(
            "user",
            &format!("<tool_response>\n{content}\n</tool_response>"),
        )),
        "assistant" => {
            let calls = obj.get("tool_calls")?.as_array()?;
            let mut text = content.to_string();
            for call in calls {
                let f = call.get("function")?;
                let name = f.get("name")?.as_str()?;
                // OpenAI sends arguments as a JSON text.
                let args = match f.get("arguments") {
                    Some(Value::String(s)) => {
                        serde_json::from_str(s).unwrap_or(Value::String(s.clone()))
                    }
                    Some(v) => v.clone(),
                    None => json!({}),
                };
                if !text.is_empty() {
                    text.push('\n');
                }
                text.push_str(&format!(
                    "<tool_call>\n{}\n</tool_call>",
                    json!({"name": name, "arguments": args})
                ));
            }
            Some(ChatMessage::new("assistant", &text))
        }
        _ => None,
    }
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
        match serde_json::from_str::<Value>(body.trim())
            .ok()
            .as_ref()
            .and_then(call_from_json)
        {
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
            (json!({"tools": [{"type": "retrieval"}]}), "tools"),
            (
                json!({"tools": [{"type": "function", "function": {}}]}),
                "tools",
            ),
        ] {
            assert_eq!(
                parse_tools(&body).unwrap_err().param.as_deref(),
                Some(field),
                "{body}"
            );
        }
    }
}
