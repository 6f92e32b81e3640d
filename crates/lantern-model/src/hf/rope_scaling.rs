//! `config.json`'s `rope_scaling`, turned into what llama.cpp's converter writes (plus the
//! `lantern.rope.scaling.*` keys for the YaRN parameters GGUF cannot say), with the
//! defaults transformers applies (`modeling_rope_utils`).

use super::config::{invalid, Keys};
use crate::error::Result;
use crate::source::keys;
use candle_core::quantized::gguf_file::Value;
use serde_json::{Map, Value as Json};
use std::collections::HashMap;
use std::path::Path;

/// transformers 5 saves RoPE as `rope_parameters` (`rope_theta`, `rope_type` and the
/// scaling's own keys, `partial_rotary_factor`), or one such object per layer type
/// (`full_attention`, `sliding_attention`: Gemma 3, OLMo 3), instead of the top-level
/// `rope_theta`, `rope_scaling` and `partial_rotary_factor` of earlier versions. This is
/// `config` with those top-level keys filled in from it where absent: the global layers'
/// parameters, and the sliding layers' base as `rope_local_base_freq` (Gemma 3's older
/// key). Sliding layers with a scaling of their own are refused (lantern never scales
/// them).
pub(super) fn lift_rope_parameters(path: &Path, config: &Json) -> Result<Json> {
    let Some(params) = config.get("rope_parameters").filter(|v| !v.is_null()) else {
        return Ok(config.clone());
    };
    let not_object = || invalid(path, "`rope_parameters` is not an object".into());
    let params = params.as_object().ok_or_else(not_object)?;
    let (global, sliding) = match params.get("full_attention") {
        Some(full) => (
            full.as_object().ok_or_else(not_object)?,
            params.get("sliding_attention").and_then(Json::as_object),
        ),
        None => (params, None),
    };
    let mut lifted: Map<String, Json> = config.as_object().cloned().unwrap_or_default();
    let mut fill = |key: &str, value: Option<&Json>| {
        if let Some(v) = value.filter(|v| !v.is_null()) {
            lifted.entry(key).or_insert_with(|| v.clone());
        }
    };
    fill("rope_theta", global.get("rope_theta"));
    fill("partial_rotary_factor", global.get("partial_rotary_factor"));
    let scaled = |p: &Map<String, Json>| {
        p.get("rope_type")
            .and_then(Json::as_str)
            .is_some_and(|t| t != "default")
    };
    if scaled(global) {
        fill("rope_scaling", Some(&Json::Object(global.clone())));
    }
    if let Some(sliding) = sliding {
        if scaled(sliding) {
            return Err(invalid(
                path,
                "`rope_parameters.sliding_attention` scales RoPE, which lantern does not do \
                 on sliding layers"
                    .into(),
            ));
        }
        fill("rope_local_base_freq", sliding.get("rope_theta"));
    }
    Ok(Json::Object(lifted))
}

/// Vectors the tensor reader presents as tensors, named as llama.cpp's converter writes them.
pub(super) type RopeTensors = Vec<(&'static str, Vec<f32>)>;

/// `llama3` becomes `rope_freqs.weight` and `longrope` the two factor sets (written by the
/// tensor reader, as llama.cpp does); `linear`, `yarn` and LongRoPE's other parameters
/// become `rope.scaling.*` keys.
pub(super) fn rope_scaling(
    c: &Keys,
    a: &str,
    m: &mut HashMap<String, Value>,
    theta: f64,
    rotary_dim: usize,
) -> Result<RopeTensors> {
    let Some(scaling) = c.json.get("rope_scaling").filter(|v| !v.is_null()) else {
        return Ok(Vec::new());
    };
    let s = Keys {
        path: c.path,
        json: scaling,
    };
    let kind = match s.opt_str("rope_type")? {
        Some(kind) => kind,
        None => s
            .opt_str("type")?
            .ok_or_else(|| invalid(c.path, "rope_scaling has no `rope_type`".into()))?,
    };
    let factor = || {
        s.opt_f64("factor")?
            .ok_or_else(|| invalid(c.path, format!("rope_scaling `{kind}` has no `factor`")))
    };
    let key = |k: &str| format!("{a}.rope.scaling.{k}");
    match kind {
        "default" => {}
        "llama3" => {
            let num =
                |key: &str, default: f64| -> Result<f64> { Ok(s.opt_f64(key)?.unwrap_or(default)) };
            return Ok(vec![(
                "rope_freqs.weight",
                llama3_divisors(
                theta,
                rotary_dim,
                factor()?,
                num("low_freq_factor", 1.0)?,
                num("high_freq_factor", 4.0)?,
                    num("original_max_position_embeddings", 8192.0)?,
                ),
            )]);
        }
        // `su` is LongRoPE's first name (Phi-3's first 128k configs).
        "longrope" | "su" => return long_rope(c, &s, m, &key, rotary_dim),
        "linear" => {
            m.insert(key("type"), Value::String(kind.into()));
            m.insert(key("factor"), Value::F32(factor()? as f32));
        }
        "yarn" => yarn(c, &s, m, &key)?,
        other => {
            return Err(invalid(
                c.path,
                format!(
                "rope_scaling type `{other}` is not supported (supported: llama3, linear, yarn, longrope)"
            ),
            ))
        }
    }
    Ok(Vec::new())
}

/// The original context as transformers reads it for YaRN and LongRoPE: a top-level
/// `original_max_position_embeddings` (Phi-3 style, which wins), else the scaling's own,
/// else `max_position_embeddings`.
fn original_context(c: &Keys, s: &Keys) -> Result<usize> {
    let original = match c.opt_usize("original_max_position_embeddings")? {
        Some(o) => o,
        None => match s.opt_usize("original_max_position_embeddings")? {
            Some(o) => o,
            None => c.opt_usize("max_position_embeddings")?.unwrap_or(2048),
        },
    };
    if original == 0 {
        return Err(invalid(
            c.path,
            "rope_scaling: the original context length is 0".into(),
        ));
    }
    Ok(original)
}

/// LongRoPE as transformers' `_compute_longrope_parameters` reads it: `short_factor` and
/// `long_factor`, one divisor per rotary frequency each; the attention factor given, or
/// `sqrt(1 + ln(f) / ln(original))` (1 for f <= 1) with `f` the scaling's `factor` or
/// `max_position_embeddings / original`.
fn long_rope(
    c: &Keys,
    s: &Keys,
    m: &mut HashMap<String, Value>,
    key: &dyn Fn(&str) -> String,
    rotary_dim: usize,
) -> Result<RopeTensors> {
    let original = original_context(c, s)?;
    let factors = |name: &str| -> Result<Vec<f32>> {
        let bad = |why: &str| invalid(c.path, format!("rope_scaling `{name}` {why}"));
        let list = s
            .json
            .get(name)
            .and_then(Json::as_array)
            .ok_or_else(|| bad("is missing (LongRoPE needs it)"))?;
        if list.len() != rotary_dim / 2 {
            return Err(bad(&format!(
                "has {} values; the {rotary_dim} rotary dimensions need {}",
                list.len(),
                rotary_dim / 2
            )));
        }
        list.iter()
            .map(|v| match v.as_f64() {
                Some(f) if f.is_finite() && f > 0.0 => Ok(f as f32),
                _ => Err(bad(&format!("holds {v}, not a positive number"))),
            })
            .collect()
    };
    let (long, short) = (factors("long_factor")?, factors("short_factor")?);
    let factor = match s.opt_f64("factor")? {
        Some(f) => f,
        None => c.opt_usize("max_position_embeddings")?.unwrap_or(2048) as f64 / original as f64,
    };
    let attention_factor = match s.opt_f64("attention_factor")? {
        Some(a) => a,
        None if factor <= 1.0 => 1.0,
        None => (1.0 + factor.ln() / (original as f64).ln()).sqrt(),
    };
    m.insert(key("original_context_length"), Value::U32(original as u32));
    m.insert(key("attn_factor"), Value::F32(attention_factor as f32));
    Ok(vec![
        (crate::rope::LONG_FACTORS, long),
        (crate::rope::SHORT_FACTORS, short),
    ])
}

/// YaRN as transformers' `_compute_yarn_parameters` reads it: the original context as
/// [`original_context`] reads it; `factor` by default `max_position_embeddings` over it;
/// `beta_fast`/`beta_slow` 32/1 when absent or 0; the attention factor given, or
/// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` when both are given (and
/// non-zero), or `mscale(factor)`, with `mscale(f, m) = 0.1 m ln(f) + 1` (1 for f <= 1).
fn yarn(
    c: &Keys,
    s: &Keys,
    m: &mut HashMap<String, Value>,
    key: &dyn Fn(&str) -> String,
) -> Result<()> {
    let original = original_context(c, s)?;
    let factor = match s.opt_f64("factor")? {
        Some(f) => f,
        None => c.opt_usize("max_position_embeddings")?.unwrap_or(2048) as f64 / original as f64,
    };
    let mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let nonzero = |k: &str| -> Result<Option<f64>> { Ok(s.opt_f64(k)?.filter(|&v| v != 0.0)) };
    let attention_factor = match s.opt_f64("attention_factor")? {
        Some(a) => a,
        None => match (nonzero("mscale")?, nonzero("mscale_all_dim")?) {
            (Some(ms), Some(all)) => mscale(factor, ms) / mscale(factor, all),
            _ => mscale(factor, 1.0),
        },
    };
    m.insert(key("type"), Value::String("yarn".into()));
    m.insert(key("factor"), Value::F32(factor as f32));
    m.insert(key("original_context_length"), Value::U32(original as u32));
    for (hf, gguf) in [
        ("beta_fast", "yarn_beta_fast"),
        ("beta_slow", "yarn_beta_slow"),
    ] {
        if let Some(beta) = nonzero(hf)? {
            m.insert(key(gguf), Value::F32(beta as f32));
        }
    }
    m.insert(
        keys::ROPE_ATTENTION_FACTOR.into(),
        Value::F32(attention_factor as f32),
    );
    if let Some(truncate) = s.opt_bool("truncate")? {
        m.insert(keys::ROPE_YARN_TRUNCATE.into(), Value::Bool(truncate));
    }
    Ok(())
}

/// Llama 3's frequency divisors, computed as llama.cpp's converter does (in f32 like torch):
/// long wavelengths divided by `factor`, short ones kept, a smooth blend between.
fn llama3_divisors(
    theta: f64,
    dim: usize,
    factor: f64,
    low: f64,
    high: f64,
    old_ctx: f64,
) -> Vec<f32> {
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    (0..dim / 2)
        .map(|i| {
            let exponent = (2 * i) as f32 / dim as f32;
            let freq = 1.0 / (theta as f32).powf(exponent);
            let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor as f32
            } else {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::config::HfConfig;
    use super::*;
    use serde_json::json;
    use std::path::Path;

    fn metadata(extra: serde_json::Value) -> Result<HashMap<String, Value>> {
        let mut config = json!({
            "model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 128,
            "max_position_embeddings": 1024,
        });
        config
            .as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        Ok(HfConfig::from_json(Path::new("config.json"), &config)?.metadata)
    }

    fn number(m: &HashMap<String, Value>, key: &str) -> Option<f64> {
        m.get(key).map(|v| match v {
            Value::F32(f) => *f as f64,
            Value::U32(u) => *u as f64,
            other => panic!("{key}: {other:?}"),
        })
    }

    #[test]
    fn transformers_5_rope_parameters_mean_what_the_old_keys_did() {
        // As transformers 5.25's save_pretrained writes them (Qwen2, Llama 3, Phi-3).
        let m = metadata(json!({"rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}))
            .unwrap();
        assert_eq!(number(&m, "qwen2.rope.freq_base"), Some(1e6));
        let m = metadata(json!({"rope_parameters": {
            "rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5}}))
        .unwrap();
        assert_eq!(number(&m, "qwen2.rope.scaling.factor"), Some(4.0));
        assert_eq!(number(&m, "qwen2.rope.dimension_count"), Some(16.0));
        // The old top-level keys win where both are present.
        let m = metadata(json!({"rope_theta": 5e5,
            "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}))
        .unwrap();
        assert_eq!(number(&m, "qwen2.rope.freq_base"), Some(5e5));
    }

    #[test]
    fn per_layer_type_rope_parameters_give_the_global_and_local_bases() {
        let config = json!({
            "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "intermediate_size": 128, "head_dim": 32,
            "rope_parameters": {
                "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
                "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
        });
        let m = HfConfig::from_json(Path::new("config.json"), &config)
            .unwrap()
            .metadata;
        assert_eq!(number(&m, "gemma3.rope.freq_base"), Some(1e6));
        assert_eq!(number(&m, "gemma3.rope.freq_base_swa"), Some(1e4));
        assert_eq!(number(&m, "gemma3.rope.scaling.factor"), Some(8.0));
        let mut scaled_sliding = config.clone();
        scaled_sliding["rope_parameters"]["sliding_attention"]["rope_type"] = json!("linear");
        let err = HfConfig::from_json(Path::new("config.json"), &scaled_sliding)
            .unwrap_err()
            .to_string();
        assert!(err.contains("sliding_attention"), "{err}");
    }

    #[test]
    fn qwen_yarn_gets_transformers_defaults() {
        let m = metadata(json!({"rope_scaling": {
            "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}))
        .unwrap();
        assert_eq!(number(&m, "qwen2.rope.scaling.factor"), Some(4.0));
        assert_eq!(
            number(&m, "qwen2.rope.scaling.original_context_length"),
            Some(32.0)
        );
        assert_eq!(number(&m, "qwen2.rope.scaling.yarn_beta_fast"), None);
        let a = number(&m, keys::ROPE_ATTENTION_FACTOR).unwrap();
        assert!((a - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-6);
        assert!(!m.contains_key(keys::ROPE_YARN_TRUNCATE));
    }

    #[test]
    fn deepseek_yarn_parameters_are_kept() {
        let m = metadata(json!({"rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
            "beta_fast": 8, "beta_slow": 0.5, "mscale": 1.0, "mscale_all_dim": 0.5,
            "truncate": false}}))
        .unwrap();
        assert_eq!(number(&m, "qwen2.rope.scaling.yarn_beta_fast"), Some(8.0));
        assert_eq!(number(&m, "qwen2.rope.scaling.yarn_beta_slow"), Some(0.5));
        let a = number(&m, keys::ROPE_ATTENTION_FACTOR).unwrap();
        let expected = (0.1 * 4f64.ln() + 1.0) / (0.05 * 4f64.ln() + 1.0);
        assert!((a - expected).abs() < 1e-6);
        assert!(matches!(
            m.get(keys::ROPE_YARN_TRUNCATE),
            Some(Value::Bool(false))
        ));
    }

    #[test]
    fn yarn_defaults_come_from_the_context_lengths() {
        // No factor: max_position_embeddings / original; a top-level original wins.
        let m = metadata(json!({"original_max_position_embeddings": 256,
            "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 32}}))
        .unwrap();
        assert_eq!(
            number(&m, "qwen2.rope.scaling.original_context_length"),
            Some(256.0)
        );
        assert_eq!(number(&m, "qwen2.rope.scaling.factor"), Some(4.0));
    }

    #[test]
    fn linear_without_factor_is_refused() {
        let err = metadata(json!({"rope_scaling": {"rope_type": "linear"}})).unwrap_err();
        assert!(err.to_string().contains("factor"), "{err}");
        let err =
            metadata(json!({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})).unwrap_err();
        assert!(err.to_string().contains("dynamic"), "{err}");
    }

    fn long_rope_config(extra: serde_json::Value) -> Result<HfConfig> {
        // Phi-3.5-mini's shape of config: a top-level original context, the old `type`.
        let mut config = json!({
            "model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 128,
            "max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.5],
                             "long_factor": [2.0, 3.0]},
            "partial_rotary_factor": 0.125,
        });
        for (k, v) in extra.as_object().unwrap() {
            match (k.as_str(), v) {
                ("rope_scaling", serde_json::Value::Object(o)) => config["rope_scaling"]
                    .as_object_mut()
                    .unwrap()
                    .extend(o.clone()),
                _ => config[k] = v.clone(),
            }
        }
        HfConfig::from_json(Path::new("config.json"), &config)
    }

    #[test]
    fn longrope_becomes_llama_cpp_s_two_factor_sets_and_attention_factor() {
        let c = long_rope_config(json!({})).unwrap();
        let tensors: Vec<(&str, Vec<f32>)> = c.rope_tensors.clone();
        assert_eq!(
            tensors,
            vec![
                ("rope_factors_long.weight", vec![2.0, 3.0]),
                ("rope_factors_short.weight", vec![1.0, 1.5]),
            ]
        );
        let m = &c.metadata;
        assert_eq!(
            number(m, "phi3.rope.scaling.original_context_length"),
            Some(4096.0)
        );
        // sqrt(1 + ln(131072 / 4096) / ln(4096)), as transformers and llama.cpp's converter.
        let a = number(m, "phi3.rope.scaling.attn_factor").unwrap();
        assert!((a - 1.190_238_071_423_808).abs() < 1e-6, "{a}");
        // A given factor or attention factor wins (transformers 5); `rope_type` also names it.
        let c = long_rope_config(json!({"rope_scaling": {"factor": 8.0}})).unwrap();
        let a = number(&c.metadata, "phi3.rope.scaling.attn_factor").unwrap();
        assert!(
            (a - (1.0 + 8f64.ln() / 4096f64.ln()).sqrt()).abs() < 1e-6,
            "{a}"
        );
        let c = long_rope_config(json!({"rope_scaling": {"rope_type": "longrope",
            "attention_factor": 1.0}}))
        .unwrap();
        assert_eq!(
            number(&c.metadata, "phi3.rope.scaling.attn_factor"),
            Some(1.0)
        );
        // Within the original context: no scaling of cos/sin.
        let c = long_rope_config(json!({"max_position_embeddings": 4096})).unwrap();
        assert_eq!(
            number(&c.metadata, "phi3.rope.scaling.attn_factor"),
            Some(1.0)
        );
    }

    #[test]
    fn longrope_factors_that_do_not_fit_are_refused_naming_the_key() {
        for (extra, key, what) in [
            (
                json!({"rope_scaling": {"long_factor": [1.0]}}),
                "long_factor",
                "need 2",
            ),
            (
                json!({"rope_scaling": {"short_factor": null}}),
                "short_factor",
                "missing",
            ),
            (
                json!({"rope_scaling": {"short_factor": [1.0, -1.0]}}),
                "short_factor",
                "-1",
            ),
        ] {
            let err = long_rope_config(extra).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains(what), "{err}");
        }
    }
}
