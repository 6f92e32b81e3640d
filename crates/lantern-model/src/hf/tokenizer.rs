//! The tokenizer and chat template of a Hugging Face directory: `tokenizer.json` as it is
//! (the `tokenizers` crate reads it, as `PreTrainedTokenizerFast` does), special tokens and
//! the template from `tokenizer_config.json` (or `chat_template.jinja`), stop ids from
//! `generation_config.json` and `config.json`.

use super::config::token_ids;
use crate::error::{ModelError, Result};
use crate::tokenizer::ModelTokenizer;
use serde_json::Value as Json;
use std::path::Path;
use tokenizers::Tokenizer;

/// What `tokenizer_config.json` says (all optional).
#[derive(Debug, Default)]
pub struct TokenizerConfig {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub add_bos_token: Option<bool>,
    pub chat_template: Option<String>,
}

impl TokenizerConfig {
    pub fn read(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer_config.json");
        let mut config = if path.is_file() {
            let json = read_json(&path)?;
            let token = |key: &str| match json.get(key) {
                Some(Json::String(s)) => Some(s.clone()),
                Some(Json::Object(o)) => o.get("content").and_then(Json::as_str).map(String::from),
                _ => None,
            };
            Self {
                bos_token: token("bos_token"),
                eos_token: token("eos_token"),
                pad_token: token("pad_token"),
                add_bos_token: json.get("add_bos_token").and_then(Json::as_bool),
                chat_template: chat_template(&path, json.get("chat_template"))?,
            }
        } else {
            Self::default()
        };
        // Newer checkpoints keep the template in its own file.
        let jinja = dir.join("chat_template.jinja");
        if config.chat_template.is_none() && jinja.is_file() {
            config.chat_template =
                Some(
                    std::fs::read_to_string(&jinja).map_err(|source| ModelError::Open {
                        path: jinja,
                        source,
                    })?,
                );
        }
        Ok(config)
    }
}

/// The template: a string, or a list of named templates (the one named `default`).
fn chat_template(path: &Path, value: Option<&Json>) -> Result<Option<String>> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(items)) => Ok(items
            .iter()
            .find(|t| t.get("name").and_then(Json::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Json::as_str)
            .map(String::from)),
        Some(_) => Err(ModelError::InvalidHf {
            path: path.to_path_buf(),
            reason: "`chat_template` is neither a string nor a list of named templates".into(),
        }),
    }
}

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| ModelError::InvalidHf {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

/// The EOS ids of `generation_config.json`, if the file is there.
pub fn generation_eos_ids(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let json = read_json(&path)?;
    token_ids(json.get("eos_token_id")).ok_or_else(|| ModelError::InvalidHf {
        path,
        reason: "key `eos_token_id` is not a token id or a list of them".into(),
    })
}

/// Builds the tokenizer of `dir`. `config_eos` are the EOS ids of `config.json`.
pub fn load_tokenizer(
    dir: &Path,
    config: &TokenizerConfig,
    config_eos: &[u32],
) -> Result<ModelTokenizer> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        return Err(ModelError::InvalidHf {
            path: dir.to_path_buf(),
            reason: "tokenizer.json is missing".into(),
        });
    }
    let inner = Tokenizer::from_file(&path).map_err(|e| ModelError::InvalidHf {
        path: path.clone(),
        reason: e.to_string(),
    })?;
    let vocab = inner.get_vocab(true);
    let size = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
    let mut tokens = vec![String::new(); size];
    for (token, id) in vocab {
        tokens[id as usize] = token;
    }
    let mut special = vec![false; size];
    for (id, added) in inner.get_added_tokens_decoder() {
        if let Some(slot) = special.get_mut(id as usize) {
            *slot = added.special;
        }
    }
    let named = |token: &Option<String>| -> Result<Option<(u32, String)>> {
        let Some(token) = token else { return Ok(None) };
        inner
            .token_to_id(token)
            .map(|id| Some((id, token.clone())))
            .ok_or_else(|| ModelError::InvalidHf {
                path: dir.join("tokenizer_config.json"),
                reason: format!("special token `{token}` is not in tokenizer.json's vocabulary"),
            })
    };
    let bos = named(&config.bos_token)?;
    let eos = named(&config.eos_token)?;
    // A padding token missing from the vocabulary only goes unnamed: nothing runs on it.
    let pad = named(&config.pad_token).ok().flatten();
    let add_bos = match config.add_bos_token {
        Some(add) => add,
        None => post_processor_adds(&inner, bos.as_ref().map(|b| b.0))?,
    };
    let mut stop_ids: Vec<u32> = eos.iter().map(|e| e.0).collect();
    for id in generation_eos_ids(dir)?
        .into_iter()
        .chain(config_eos.iter().copied())
    {
        if !stop_ids.contains(&id) && (id as usize) < size {
            stop_ids.push(id);
        }
    }
    Ok(
        ModelTokenizer::from_parts(inner, tokens, special, bos, eos, stop_ids, add_bos)?
            .with_pad(pad),
    )
}

/// Whether tokenizer.json's post-processor puts BOS in front of a text.
fn post_processor_adds(inner: &Tokenizer, bos: Option<u32>) -> Result<bool> {
    let Some(bos) = bos else { return Ok(false) };
    let with = inner
        .encode("a", true)
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    Ok(with.get_ids().first() == Some(&bos))
}
