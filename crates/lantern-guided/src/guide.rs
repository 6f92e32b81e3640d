//! What a request constrains its output to, and the grammar each kind becomes.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

/// A request's output constraint, as the client gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum Guide {
    /// JSON valid against this schema.
    JsonSchema(Value),
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// Text matching this regular expression, all of it.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

/// JSON is written compactly (`{"a":1,"b":[2,3]}`): flexible whitespace lets a small
/// model spend its whole budget on newlines. A schema's `x-guidance` options.
pub fn compact_json_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"})
}

impl Guide {
    /// The `llguidance` grammar of this guide.
    pub(crate) fn grammar(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            Guide::JsonSchema(schema) => {
                let mut schema = schema.clone();
                let Some(obj) = schema.as_object_mut() else {
                    return Err("a schema must be a JSON object".to_string());
                };
                obj.entry("x-guidance").or_insert_with(compact_json_options);
                TopLevelGrammar::from_json_schema(schema)
            }
            Guide::JsonObject => TopLevelGrammar::from_json_schema(
                json!({"type": "object", "x-guidance": compact_json_options()}),
            ),
            Guide::Regex(regex) => {
                // llguidance writes the regex into a Lark `/…/` literal, where a trailing
                // backslash would escape the delimiter rather than fail: parse it first.
                regex_syntax::Parser::new()
                    .parse(regex)
                    .map_err(|e| format!("not a valid regular expression: {e}"))?;
                TopLevelGrammar::from_regex(regex)
            }
            Guide::Choice(choices) => {
                if choices.is_empty() {
                    return Err("the list of choices is empty".to_string());
                }
                // Lark string literals take JSON's escapes.
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::to_string(c).unwrap_or_default())
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            Guide::Lark(grammar) => TopLevelGrammar::from_lark(grammar.clone()),
        })
    }
}
