//! `lantern attn`: look at an attention capture, or convert it.
//!
//! A capture is a safetensors file (delivery "reference" or "file") or a JSON file
//! holding a response, or just an object, with `attn_capture_data` and
//! `attn_capture_meta` (delivery "inline"); see docs/capture-format.md.

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use half::f16;
use lantern_capture::{wire, CaptureDtype, CaptureResult, LayerMap};
use npyz::WriterBuilder;
use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct AttnArgs {
    #[command(subcommand)]
    command: AttnCommand,
}

#[derive(Subcommand, Debug)]
enum AttnCommand {
    /// Write one self-contained HTML page with the capture as a heatmap (tokens on both
    /// axes, a layer and a head selector, the probability under the pointer).
    View(ViewArgs),
    /// Convert a capture to safetensors, or to .npy files that numpy reads.
    Export(ExportArgs),
}

#[derive(Args, Debug)]
struct ViewArgs {
    /// Capture: a safetensors file, or JSON with attn_capture_data and attn_capture_meta.
    file: PathBuf,
    /// The HTML file to write. Default: FILE with the extension .html.
    #[arg(short, long)]
    output: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct ExportArgs {
    /// Capture: a safetensors file, or JSON with attn_capture_data and attn_capture_meta.
    file: PathBuf,
    /// npy: a directory of .npy files; safetensors: one file, as the server delivers it.
    #[arg(long, value_enum)]
    format: ExportFormat,
    /// safetensors: the file to write. npy: a directory, created if missing, that gets
    /// layer_{L}.npy ([rows, heads, keys]), layer_{L}.indices.npy (top-k),
    /// layer_{L}.{key_mass,key_max,block_mass}.npy ([groups, keys]),
    /// layer_{L}.span_mass.npy ([rows, groups, spans + 1]) and meta.json.
    #[arg(short, long)]
    output: PathBuf,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum ExportFormat {
    Npy,
    Safetensors,
}

pub fn run(args: AttnArgs) -> Result<()> {
    match args.command {
        AttnCommand::View(args) => view(args),
        AttnCommand::Export(args) => export(args),
    }
}

/// Reads a capture file, telling safetensors from JSON by its content.
fn load(path: &Path) -> Result<CaptureResult> {
    let bytes = fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let not_a_capture = || format!("{} is not a lantern attention capture", path.display());
    if looks_like_safetensors(&bytes) {
        return wire::from_safetensors(&bytes).with_context(not_a_capture);
    }
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
        anyhow!(
            "{} is not a lantern attention capture: neither a safetensors file nor JSON ({e})",
            path.display()
        )
    })?;
    wire::from_json(&value).with_context(not_a_capture)
}

/// An 8-byte little-endian header length that fits the file, then a JSON object.
fn looks_like_safetensors(bytes: &[u8]) -> bool {
    let Some((len, rest)) = bytes.split_first_chunk::<8>() else {
        return false;
    };
    let len = u64::from_le_bytes(*len);
    rest.first() == Some(&b'{') && len <= rest.len() as u64
}

fn dtype_of(result: &CaptureResult) -> Result<CaptureDtype> {
    Ok(CaptureDtype::parse(&result.meta.dtype)?)
}

fn view(args: ViewArgs) -> Result<()> {
    let result = load(&args.file)?;
    let output = args
        .output
        .unwrap_or_else(|| args.file.with_extension("html"));
    if output == args.file {
        bail!(
            "the page would overwrite the capture {}; give -o",
            args.file.display()
        );
    }
    let source = args.file.file_name().map_or_else(
        || args.file.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    let page = lantern_capture::view::embedded_page(&result, &source);
    fs::write(&output, page).with_context(|| format!("cannot write {}", output.display()))?;
    println!("wrote {}", output.display());
    Ok(())
}

fn export(args: ExportArgs) -> Result<()> {
    let result = load(&args.file)?;
    let dtype = dtype_of(&result)?;
    match args.format {
        ExportFormat::Safetensors => {
            let bytes = wire::to_safetensors(&result, dtype)?;
            fs::write(&args.output, bytes)
                .with_context(|| format!("cannot write {}", args.output.display()))?;
        }
        ExportFormat::Npy => {
            let dir = &args.output;
            fs::create_dir_all(dir)
                .with_context(|| format!("cannot create the directory {}", dir.display()))?;
            for layer in &result.layers {
                write_layer_npy(dir, layer, dtype)?;
            }
            // Statistics and span masses are float32 whatever the maps' dtype.
            for stat in &result.stats {
                let name = format!("layer_{}.{}.npy", stat.layer_idx, stat.stat.as_str());
                write_npy(&dir.join(name), &stat.shape, stat.values.iter().copied())?;
            }
            for mass in &result.span_mass {
                let name = format!("layer_{}.{}.npy", mass.layer_idx, wire::SPAN_MASS);
                write_npy(&dir.join(name), &mass.shape, mass.values.iter().copied())?;
            }
            let meta = serde_json::to_string_pretty(&result.meta)?;
            let path = dir.join("meta.json");
            fs::write(&path, meta).with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    println!("wrote {}", args.output.display());
    Ok(())
}

/// `layer_{L}.npy` in the capture's dtype and, with top-k, `layer_{L}.indices.npy` (int32).
fn write_layer_npy(dir: &Path, layer: &LayerMap, dtype: CaptureDtype) -> Result<()> {
    let name = format!("layer_{}", layer.layer_idx);
    let values = layer.values.iter().copied();
    match dtype {
        CaptureDtype::Float32 => write_npy(&dir.join(format!("{name}.npy")), &layer.shape, values)?,
        CaptureDtype::Float16 => write_npy(
            &dir.join(format!("{name}.npy")),
            &layer.shape,
            values.map(f16::from_f32),
        )?,
    }
    if let Some(indices) = &layer.indices {
        let indices = indices
            .iter()
            .map(|&i| i32::try_from(i).unwrap_or(i32::MAX));
        write_npy(
            &dir.join(format!("{name}.indices.npy")),
            &layer.shape,
            indices,
        )?;
    }
    Ok(())
}

fn write_npy<T: npyz::Serialize + npyz::AutoSerialize>(
    path: &Path,
    shape: &[usize],
    items: impl Iterator<Item = T>,
) -> Result<()> {
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    let mut bytes = Vec::new();
    let mut writer = npyz::WriteOptions::<T>::new()
        .default_dtype()
        .shape(&shape)
        .writer(&mut bytes)
        .begin_nd()?;
    writer.extend(items)?;
    writer.finish()?;
    fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_safetensors_from_json() {
        let mut st = 2u64.to_le_bytes().to_vec();
        st.extend(b"{}");
        assert!(looks_like_safetensors(&st));
        assert!(!looks_like_safetensors(b"{\"attn_capture_meta\": {}}"));
        assert!(!looks_like_safetensors(b"{"));
        let mut long = 99u64.to_le_bytes().to_vec();
        long.extend(b"{}");
        assert!(!looks_like_safetensors(&long));
    }
}
