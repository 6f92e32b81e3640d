//! `lantern generate --capture FILE`: a prompt's attention maps written as a
//! safetensors file, without a server.
//!
//! The options mean what the HTTP request fields mean: they are turned into those
//! fields and read by the engine's validation and size check, as the server's are
//! (`lantern_engine::validate::capture`), and the file is the one the server delivers by
//! reference for the same request, byte for byte.

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use lantern_engine::lantern_capture::{wire, CaptureGeometry, CaptureSpec, PendingCapture};
use lantern_engine::serving::ItemCapture;
use lantern_engine::validate::capture::{check_capture, parse_capture_request, CaptureSettings};
use lantern_engine::validate::InvalidRequest;
use lantern_engine::{Completion, Engine};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

#[derive(Args, Debug, Default)]
pub struct CaptureArgs {
    /// Write the prompt's attention maps (and the generated tokens') to FILE as
    /// safetensors, as the server delivers a capture by reference; `lantern attn view`
    /// and `export` read it. With several prompts, prompt N (from 1) goes to FILE with
    /// `.N` before its extension (`cap.1.safetensors`, `cap.2.safetensors`, ...).
    #[arg(long, value_name = "FILE.safetensors")]
    pub capture: Option<PathBuf>,
    /// Layers to capture (`attn_capture_layers`): `all` (default), or indices and
    /// ranges like `0,7,15`, `0:4`, `-1` (negative counts from the end).
    #[arg(
        long,
        value_name = "LAYERS",
        requires = "capture",
        allow_hyphen_values = true
    )]
    pub capture_layers: Option<String>,
    /// Query heads to capture (`attn_capture_heads`): `all` (default) or indices and
    /// ranges as for --capture-layers.
    #[arg(
        long,
        value_name = "HEADS",
        requires = "capture",
        allow_hyphen_values = true
    )]
    pub capture_heads: Option<String>,
    /// Query rows (`attn_capture_rows`): `all` (default), `prompt`, `generated`, or
    /// positions `start:end` (either side may be left out).
    #[arg(long, value_name = "ROWS", requires = "capture")]
    pub capture_rows: Option<String>,
    /// Reduce over the heads (`attn_capture_reduce`): `none` (default), `mean_heads`
    /// or `max_heads`.
    #[arg(long, value_name = "REDUCE", requires = "capture")]
    pub capture_reduce: Option<String>,
    /// Keep only the K largest probabilities of each row, with their key positions
    /// (`attn_capture_top_k`).
    #[arg(long, value_name = "K", requires = "capture")]
    pub capture_top_k: Option<u64>,
    /// Element type of the maps (`attn_capture_dtype`): `float32` (default) or
    /// `float16`.
    #[arg(long, value_name = "DTYPE", requires = "capture")]
    pub capture_dtype: Option<String>,
    /// Key statistics over the captured rows (`attn_capture_stats`): any of
    /// `key_mass`, `key_max`, `block_mass`, comma-separated. Without --capture-maps
    /// true, only the statistics are written.
    #[arg(long, value_name = "STATS", requires = "capture")]
    pub capture_stats: Option<String>,
    /// Heads the statistics are kept for (`attn_capture_stats_heads`): `kv` (default:
    /// per KV head), `query` or `mean`.
    #[arg(long, value_name = "HEADS", requires = "capture")]
    pub capture_stats_heads: Option<String>,
    /// Write the maps too (`attn_capture_maps`): `true` (the default without
    /// --capture-stats) or `false`.
    #[arg(long, value_name = "BOOL", requires = "capture")]
    pub capture_maps: Option<bool>,
    /// Largest capture one prompt may ask for, in bytes (`256M`, `1G`), as the
    /// server's flag of the same name: a larger one is refused with the estimate
    /// before anything runs.
    #[arg(long, default_value = crate::args::DEFAULT_MAX_CAPTURE_BYTES, value_parser = crate::args::parse_bytes)]
    pub max_capture_bytes: usize,
}

/// The HTTP field names and the options that stand for them here, longest first so
/// that a name is never replaced inside a longer one.
const FIELD_OPTIONS: [(&str, &str); 11] = [
    ("attn_capture_stats_heads", "--capture-stats-heads"),
    ("attn_capture_layers", "--capture-layers"),
    ("attn_capture_stats", "--capture-stats"),
    ("attn_capture_maps", "--capture-maps"),
    ("attn_capture_reduce", "--capture-reduce"),
    ("attn_capture_heads", "--capture-heads"),
    ("attn_capture_dtype", "--capture-dtype"),
    ("attn_capture_top_k", "--capture-top-k"),
    ("attn_capture_rows", "--capture-rows"),
    ("attn_capture", "--capture"),
    ("max_tokens", "--max-tokens"),
];

/// A request error from the server's capture code, worded with this command's options
/// and naming the option at fault (the server names it in the error's `param`).
fn option_error(e: InvalidRequest) -> anyhow::Error {
    let option = |name: &str| {
        FIELD_OPTIONS
            .iter()
            .find(|(field, _)| *field == name)
            .map(|(_, option)| *option)
    };
    let mut message = e.to_string();
    for (field, option) in FIELD_OPTIONS {
        message = message.replace(field, option);
    }
    match e.field().filter(|f| *f != "attn_capture").and_then(option) {
        Some(option) if !message.contains(option) => anyhow!("{option}: {message}"),
        _ => anyhow!(message),
    }
}

impl CaptureArgs {
    /// The request body fields these options stand for.
    fn request_fields(&self) -> Value {
        let mut body = json!({"attn_capture": true});
        let text = [
            ("attn_capture_layers", &self.capture_layers),
            ("attn_capture_heads", &self.capture_heads),
            ("attn_capture_rows", &self.capture_rows),
            ("attn_capture_reduce", &self.capture_reduce),
            ("attn_capture_dtype", &self.capture_dtype),
            ("attn_capture_stats", &self.capture_stats),
            ("attn_capture_stats_heads", &self.capture_stats_heads),
        ];
        for (field, value) in text {
            if let Some(value) = value {
                body[field] = json!(value);
            }
        }
        if let Some(k) = self.capture_top_k {
            body["attn_capture_top_k"] = json!(k);
        }
        if let Some(maps) = self.capture_maps {
            body["attn_capture_maps"] = json!(maps);
        }
        body
    }

    /// Fails early, before the model loads, when the file could not be written.
    pub fn check_path(&self) -> Result<()> {
        let Some(path) = &self.capture else {
            return Ok(());
        };
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if !parent.is_dir() {
            bail!(
                "--capture {}: the directory {} does not exist",
                path.display(),
                parent.display()
            );
        }
        if path.is_dir() {
            bail!(
                "--capture {}: is a directory; give a file name",
                path.display()
            );
        }
        // Opened for writing as the capture will be (a file made for the test goes again;
        // one already there is left as it is until the capture replaces it).
        let existed = path.exists();
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("--capture {}: cannot be written", path.display()))?;
        if !existed {
            let _ = std::fs::remove_file(path);
        }
        Ok(())
    }

    /// What to capture, validated against the model; `None` without --capture.
    pub fn spec(&self, engine: &Engine) -> Result<Option<CaptureSpec>> {
        if self.capture.is_none() {
            return Ok(None);
        }
        let info = engine.model_info();
        // Heads as the server counts them: the smallest count of any layer.
        let num_heads = info
            .attention
            .iter()
            .map(|a| a.num_heads)
            .min()
            .unwrap_or(0);
        let settings = CaptureSettings {
            enabled: true,
            ..CaptureSettings::default()
        };
        let request = parse_capture_request(
            &self.request_fields(),
            &settings,
            info.num_layers,
            num_heads,
        )
        .map_err(option_error)?
        .context("capture fields were parsed as no capture")?;
        Ok(Some(request.spec))
    }

    /// Refuses, as the server would, a capture over --max-capture-bytes (or with rows
    /// that cannot exist) for a prompt of `prompt_len` tokens and `max_tokens` more.
    pub fn check(
        &self,
        spec: &CaptureSpec,
        engine: &Engine,
        prompt_len: usize,
        max_tokens: usize,
    ) -> Result<()> {
        let capture = ItemCapture {
            spec: spec.clone(),
            max_bytes: self.max_capture_bytes as u64,
            // Nothing is stored: the file is written once.
            max_stored_bytes: None,
        };
        let geometry = CaptureGeometry::of_layers(spec, &engine.model_info().attention);
        check_capture(&capture, prompt_len, max_tokens, geometry).map_err(option_error)
    }

    /// Where prompt `index` (from 0) of `count` writes its capture.
    pub fn path_for(&self, index: usize, count: usize) -> Option<PathBuf> {
        let path = self.capture.as_ref()?;
        if count == 1 {
            return Some(path.clone());
        }
        let stem = path.file_stem().unwrap_or_default().to_string_lossy();
        let name = match path.extension() {
            Some(ext) => format!("{stem}.{}.{}", index + 1, ext.to_string_lossy()),
            None => format!("{stem}.{}", index + 1),
        };
        Some(path.with_file_name(name))
    }

    /// Writes each finished prompt's capture to its file ([`Self::path_for`]).
    pub fn write_all(&self, spec: &CaptureSpec, completions: &[Completion]) -> Result<()> {
        for (i, c) in completions.iter().enumerate() {
            let prompt = || format!("prompt {}", i + 1);
            let path = self
                .path_for(i, completions.len())
                .context("--capture was not given")?;
            let pending = c
                .capture
                .as_ref()
                .context("the engine returned no capture")
                .with_context(prompt)?
                .as_ref()
                .map_err(|e| anyhow!("{}: the capture failed: {e}", prompt()))?;
            let bytes = write_capture(pending, spec, &path).with_context(prompt)?;
            eprintln!(
                "lantern: attention capture of {} written to {} ({bytes} bytes)",
                prompt(),
                path.display()
            );
        }
        Ok(())
    }
}

/// Finalizes a finished request's capture and writes it to `path` as safetensors
/// (what the server's reference delivery stores); returns the file's size. Every prompt
/// has run by then, so finalizing takes every core.
fn write_capture(pending: &PendingCapture, spec: &CaptureSpec, path: &Path) -> Result<usize> {
    let threads = lantern_engine::host_threads::idle_finalize_threads();
    let result = pending
        .finalize_on(threads, || {})
        .context("computing the attention maps")?;
    let bytes = wire::to_safetensors(&result, spec.dtype).context("encoding the capture")?;
    std::fs::write(path, &bytes).with_context(|| format!("writing {}", path.display()))?;
    Ok(bytes.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_prompts_number_their_files_from_one() {
        let args = CaptureArgs {
            capture: Some(PathBuf::from("out/cap.safetensors")),
            ..CaptureArgs::default()
        };
        assert_eq!(
            args.path_for(0, 1),
            Some(PathBuf::from("out/cap.safetensors"))
        );
        assert_eq!(
            args.path_for(1, 3),
            Some(PathBuf::from("out/cap.2.safetensors"))
        );
        let bare = CaptureArgs {
            capture: Some(PathBuf::from("cap")),
            ..CaptureArgs::default()
        };
        assert_eq!(bare.path_for(0, 2), Some(PathBuf::from("cap.1")));
    }

    #[test]
    fn options_become_the_http_fields() {
        let args = CaptureArgs {
            capture: Some(PathBuf::from("c.safetensors")),
            capture_layers: Some("0:4,-1".into()),
            capture_top_k: Some(8),
            capture_dtype: Some("float16".into()),
            ..CaptureArgs::default()
        };
        assert_eq!(
            args.request_fields(),
            json!({"attn_capture": true, "attn_capture_layers": "0:4,-1",
                   "attn_capture_top_k": 8, "attn_capture_dtype": "float16"})
        );
    }

    #[test]
    fn errors_name_the_options() {
        let e = option_error(InvalidRequest::invalid(
            "attn_capture_top_k",
            "attn_capture_top_k must be a positive integer",
        ));
        assert_eq!(e.to_string(), "--capture-top-k must be a positive integer");
        let e = option_error(InvalidRequest::invalid(
            "attn_capture",
            "it fits with max_tokens 3; attn_capture_layers",
        ));
        assert_eq!(
            e.to_string(),
            "it fits with --max-tokens 3; --capture-layers"
        );
        let e = option_error(InvalidRequest::invalid(
            "attn_capture_layers",
            "99 is out of range",
        ));
        assert_eq!(e.to_string(), "--capture-layers: 99 is out of range");
    }
}
