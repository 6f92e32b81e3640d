//! Structured output on the HTTP side: which field of a body asks for it (OpenAI's
//! `response_format`, vLLM's `structured_outputs` and `guided_*`), and compiling it off
//! the engine thread, so that a bad schema or grammar is a 400 naming its field.

use crate::serving::ServeError;
use crate::validate::InvalidRequest;
use lantern_guided::{Constraint, Guide, GuidedVocab};
use serde_json::Value;

/// A guide and the body field it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldGuide {
    pub guide: Guide,
    pub field: &'static str,
}

/// A schema given as an object, or as a JSON string (vLLM accepts both).
fn schema_value(field: &'static str, value: &Value) -> Result<Value, InvalidRequest> {
    let schema = match value {
        Value::String(s) => serde_json::from_str(s).map_err(|e| {
            InvalidRequest::invalid(field, format!("{field}: the schema is not valid JSON: {e}"))
        })?,
        other => other.clone(),
    };
    if !schema.is_object() {
        return Err(InvalidRequest::invalid(
            field,
            format!("{field}: a JSON schema must be an object"),
        ));
    }
    Ok(schema)
}

fn string(field: &'static str, value: &Value) -> Result<String, InvalidRequest> {
    value
        .as_str()
        .map(str::to_string)
        .ok_or_else(|| InvalidRequest::invalid(field, format!("{field} must be a string")))
}

fn choices(field: &'static str, value: &Value) -> Result<Vec<String>, InvalidRequest> {
    let wrong = || {
        InvalidRequest::invalid(
            field,
            format!("{field} must be a non-empty list of strings"),
        )
    };
    let items = value
        .as_array()
        .filter(|a| !a.is_empty())
        .ok_or_else(wrong)?;
    items
        .iter()
        .map(|v| v.as_str().map(str::to_string).ok_or_else(wrong))
        .collect()
}

/// OpenAI's `response_format`: `text`, `json_object`, or `json_schema` with its
/// `json_schema.schema` (`strict` is accepted: the schema is always enforced).
fn response_format(value: &Value) -> Result<Option<Guide>, InvalidRequest> {
    const FIELD: &str = "response_format";
    let kind = value.get("type").and_then(Value::as_str).ok_or_else(|| {
        InvalidRequest::invalid(
            FIELD,
            "response_format needs a `type` (text, json_object or json_schema)",
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Guide::JsonObject)),
        "json_schema" => {
            let spec = value.get("json_schema").ok_or_else(|| {
                InvalidRequest::invalid(FIELD, "response_format of type json_schema needs `json_schema`")
            })?;
            if let Some(strict) = spec.get("strict") {
                if !(strict.is_boolean() || strict.is_null()) {
                    return Err(InvalidRequest::invalid(FIELD, "response_format.json_schema.strict must be a boolean"));
                }
            }
            match spec.get("schema") {
                // OpenAI's default when no schema is given: any JSON object.
                None | Some(Value::Null) => Ok(Some(Guide::JsonObject)),
                Some(schema) => Ok(Some(Guide::JsonSchema(schema_value(FIELD, schema)?))),
            }
        }
        other => Err(InvalidRequest::invalid(
            FIELD,
            format!("response_format of type `{other}` is not supported (text, json_object, json_schema)"),
        )),
    }
}

/// vLLM's `structured_outputs` object: one of `json`, `regex`, `choice`, `grammar`,
/// `json_object`.
fn structured_outputs(value: &Value) -> Result<Vec<Guide>, InvalidRequest> {
    const FIELD: &str = "structured_outputs";
    let obj = value
        .as_object()
        .ok_or_else(|| InvalidRequest::invalid(FIELD, "structured_outputs must be an object"))?;
    let mut guides = Vec::new();
    for (key, v) in obj {
        if v.is_null() {
            continue;
        }
        match key.as_str() {
            "json" => guides.push(Guide::JsonSchema(schema_value(FIELD, v)?)),
            "regex" => guides.push(Guide::Regex(string(FIELD, v)?)),
            "choice" => guides.push(Guide::Choice(choices(FIELD, v)?)),
            "grammar" => guides.push(Guide::Lark(string(FIELD, v)?)),
            "json_object" if v.as_bool() == Some(true) => guides.push(Guide::JsonObject),
            "json_object" => {}
            // Options that change nothing here.
            "disable_any_whitespace" | "disable_fallback" | "disable_additional_properties"
            | "whitespace_pattern" | "backend" => {}
            other => {
                return Err(InvalidRequest::invalid(
                    FIELD,
                    format!("structured_outputs.{other} is not supported (json, regex, choice, grammar, json_object)"),
                ))
            }
        }
    }
    Ok(guides)
}

/// The structured output a chat or completion body asks for, if any. Asking in two
/// ways at once is refused.
pub fn parse_guide(body: &Value) -> Result<Option<FieldGuide>, InvalidRequest> {
    let mut found: Vec<FieldGuide> = Vec::new();
    let mut push = |field: &'static str, guide: Guide| found.push(FieldGuide { guide, field });
    let present = |name: &str| body.get(name).filter(|v| !v.is_null());
    if let Some(v) = present("response_format") {
        if let Some(g) = response_format(v)? {
            push("response_format", g);
        }
    }
    if let Some(v) = present("structured_outputs") {
        for g in structured_outputs(v)? {
            push("structured_outputs", g);
        }
    }
    if let Some(v) = present("guided_json") {
        push(
            "guided_json",
            Guide::JsonSchema(schema_value("guided_json", v)?),
        );
    }
    if let Some(v) = present("guided_regex") {
        push("guided_regex", Guide::Regex(string("guided_regex", v)?));
    }
    if let Some(v) = present("guided_choice") {
        push("guided_choice", Guide::Choice(choices("guided_choice", v)?));
    }
    if let Some(v) = present("guided_grammar") {
        push("guided_grammar", Guide::Lark(string("guided_grammar", v)?));
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ if found[0].field == found[1].field => Err(InvalidRequest::conflict(
            found[0].field,
            format!(
                "{} asks for two kinds of structured output at once: keep one of json, regex, choice, grammar and json_object",
                found[0].field
            ),
        )),
        _ => Err(InvalidRequest::conflict(
            found[1].field,
            format!(
                "ask for one kind of structured output at a time ({} and {} were both given)",
                found[0].field, found[1].field
            ),
        )),
    }
}

/// Compiles a guide on a blocking thread (large schemas take a while); an invalid one is
/// a 400 naming its field.
pub async fn compile(
    vocab: &Result<GuidedVocab, String>,
    guide: FieldGuide,
) -> Result<Constraint, ServeError> {
    let vocab = vocab.clone().map_err(|e| {
        InvalidRequest::invalid(
            guide.field,
            format!("structured output is unavailable for this model: {e}"),
        )
    })?;
    let field = guide.field;
    tokio::task::spawn_blocking(move || vocab.compile(&guide.guide))
        .await
        .map_err(|e| ServeError::Internal(format!("compiling the grammar failed: {e}")))?
        .map_err(|e| InvalidRequest::invalid(field, format!("{field}: {e}")).into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::Seen;
    use serde_json::json;

    #[test]
    fn every_field_maps_to_its_guide() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let cases = [
            (json!({"response_format": {"type": "text"}}), None),
            (
                json!({"response_format": {"type": "json_object"}}),
                Some(("response_format", Guide::JsonObject)),
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}}}),
                Some(("response_format", Guide::JsonSchema(schema.clone()))),
            ),
            (
                json!({"guided_json": schema.to_string()}),
                Some(("guided_json", Guide::JsonSchema(schema.clone()))),
            ),
            (
                json!({"guided_regex": "[0-9]+"}),
                Some(("guided_regex", Guide::Regex("[0-9]+".into()))),
            ),
            (
                json!({"guided_choice": ["a", "b"]}),
                Some(("guided_choice", Guide::Choice(vec!["a".into(), "b".into()]))),
            ),
            (
                json!({"guided_grammar": "start: \"x\""}),
                Some(("guided_grammar", Guide::Lark("start: \"x\"".into()))),
            ),
            (
                json!({"structured_outputs": {"choice": ["y"]}}),
                Some(("structured_outputs", Guide::Choice(vec!["y".into()]))),
            ),
            (
                json!({"structured_outputs": {"json_object": true}}),
                Some(("structured_outputs", Guide::JsonObject)),
            ),
        ];
        for (body, expected) in cases {
            let got = parse_guide(&body).unwrap().map(|g| (g.field, g.guide));
            assert_eq!(got, expected, "{body}");
        }
    }

    #[test]
    fn bad_fields_are_named() {
        for (body, field) in [
            (
                json!({"response_format": {"type": "yaml"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
                "response_format",
            ),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_regex": 5}), "guided_regex"),
            (
                json!({"structured_outputs": {"xml": "a"}}),
                "structured_outputs",
            ),
            (
                json!({"guided_regex": "a", "guided_choice": ["b"]}),
                "guided_choice",
            ),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
                "structured_outputs",
            ),
        ] {
            let e = Seen::from(parse_guide(&body).unwrap_err());
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
            assert!(
                !e.message
                    .contains("structured_outputs and structured_outputs"),
                "{}",
                e.message
            );
        }
    }
}
