//! The sampling defaults a model's creators recommend in `generation_config.json`, which
//! vLLM applies to requests that leave them out (its `--generation-config auto`).

use crate::error::{ModelError, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// The request fields `generation_config.json` may give defaults for, under vLLM's
/// names, and the file's key for each.
const SAMPLING_KEYS: [(&str, &str); 5] = [
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("top_k", "top_k"),
    ("min_p", "min_p"),
    ("repetition_penalty", "repetition_penalty"),
];

/// Defaults for the sampling fields a request leaves out, as request fields
/// (`{"temperature": 0.7, "top_k": 20}`); empty when the model recommends none.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingDefaults(Map<String, Value>);

impl SamplingDefaults {
    /// The defaults of `dir/generation_config.json` (none without the file).
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("generation_config.json");
        if !path.is_file() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path).map_err(|source| ModelError::Open {
            path: path.clone(),
            source,
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| ModelError::InvalidHf {
            path: path.clone(),
            reason: e.to_string(),
        })?;
        Self::from_config(&json).map_err(|reason| ModelError::InvalidHf { path, reason })
    }

    /// The sampling keys of a parsed `generation_config.json`; one that is not a
    /// number is an error naming it.
    pub fn from_config(config: &Value) -> std::result::Result<Self, String> {
        let mut fields = Map::new();
        for (field, key) in SAMPLING_KEYS {
            match config.get(key) {
                None | Some(Value::Null) => {}
                Some(v) if v.is_number() => {
                    fields.insert(field.to_string(), v.clone());
                }
                Some(v) => return Err(format!("key `{key}` is not a number: {v}")),
            }
        }
        Ok(Self(fields))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The defaults as request fields.
    pub fn fields(&self) -> &Map<String, Value> {
        &self.0
    }

    /// Gives `body` (a request) each default it does not set itself (absent or null).
    pub fn fill(&self, body: &mut Value) {
        let Some(obj) = body.as_object_mut() else {
            return;
        };
        for (field, value) in &self.0 {
            if obj.get(field).is_none_or(Value::is_null) {
                obj.insert(field.clone(), value.clone());
            }
        }
    }
}

impl std::fmt::Display for SamplingDefaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let pairs: Vec<String> = self.0.iter().map(|(k, v)| format!("{k}={v}")).collect();
        f.write_str(&pairs.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn defaults_fill_only_what_a_request_leaves_out() {
        let config = json!({"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
                            "do_sample": true, "eos_token_id": [2, 3], "max_new_tokens": 512});
        let defaults = SamplingDefaults::from_config(&config).unwrap();
        assert_eq!(defaults.fields().len(), 4);
        let mut body = json!({"prompt": "x", "temperature": 0, "top_p": null});
        defaults.fill(&mut body);
        assert_eq!(
            body,
            json!({"prompt": "x", "temperature": 0, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05})
        );
        assert_eq!(
            defaults.to_string(),
            "temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05"
        );
        assert!(SamplingDefaults::from_config(&json!({"do_sample": false}))
            .unwrap()
            .is_empty());
        let bad = SamplingDefaults::from_config(&json!({"top_k": "20"})).unwrap_err();
        assert!(bad.contains("top_k"), "{bad}");
    }
}
