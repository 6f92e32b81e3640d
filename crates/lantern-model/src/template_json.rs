//! The `tojson` filter as chat templates are written for it: transformers renders them
//! with Python's `json.dumps` (`", "` and `": "` between items, non-ASCII kept, nothing
//! escaped for HTML), and models saw their tools and calls in that form in training.

use minijinja::value::Kwargs;
use minijinja::{Error, ErrorKind, Value};
use serde::Serialize;
use serde_json::Value as Json;
use std::io;

/// Python's compact JSON: a space after each `,` and `:`.
struct PythonFormatter;

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        self.begin_array_value(w, first)
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

fn sort_keys(value: &mut Json) {
    match value {
        Json::Object(map) => {
            let mut entries: Vec<(String, Json)> = std::mem::take(map).into_iter().collect();
            entries.sort_by(|a, b| a.0.cmp(&b.0));
            for (key, mut v) in entries {
                sort_keys(&mut v);
                map.insert(key, v);
            }
        }
        Json::Array(items) => items.iter_mut().for_each(sort_keys),
        _ => {}
    }
}

/// `value | tojson`, with transformers' `indent` and `sort_keys`.
pub fn python_tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sorted: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let failed = |e: serde_json::Error| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!("cannot serialize to JSON: {e}"),
        )
    };
    let mut json = serde_json::to_value(value).map_err(failed)?;
    if sorted == Some(true) {
        sort_keys(&mut json);
    }
    let mut out = Vec::new();
    match indent {
        Some(n) => {
            let indentation = " ".repeat(n);
            let formatter = serde_json::ser::PrettyFormatter::with_indent(indentation.as_bytes());
            json.serialize(&mut serde_json::Serializer::with_formatter(
                &mut out, formatter,
            ))
        }
        None => json.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonFormatter,
        )),
    }
    .map_err(failed)?;
    let text = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(text))
}

/// A string as `tojson` writes it inside its quotes.
pub fn escaped(text: &str) -> String {
    let quoted = Json::String(text.to_string()).to_string();
    quoted[1..quoted.len() - 1].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(source: &str, ctx: Value) -> String {
        let mut env = minijinja::Environment::new();
        env.add_filter("tojson", python_tojson);
        env.render_str(source, ctx).unwrap()
    }

    #[test]
    fn writes_json_as_python_does() {
        let tool = serde_json::json!({"name": "wé", "b": [1, "<x>"], "a": {"q\"": null}});
        let ctx = minijinja::context! { t => tool };
        assert_eq!(
            render("{{ t | tojson }}", ctx.clone()),
            r#"{"name": "wé", "b": [1, "<x>"], "a": {"q\"": null}}"#
        );
        assert_eq!(
            render("{{ t | tojson(sort_keys=true) }}", ctx.clone()),
            r#"{"a": {"q\"": null}, "b": [1, "<x>"], "name": "wé"}"#
        );
        assert_eq!(
            render("{{ t.b | tojson(indent=2) }}", ctx),
            "[\n  1,\n  \"<x>\"\n]"
        );
        assert_eq!(escaped("a\"b\\\n"), "a\\\"b\\\\\\n");
    }
}
