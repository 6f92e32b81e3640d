//! Finding the CUDA shared libraries before cudarc does.
//!
//! cudarc (with `dynamic-loading`) opens each library by bare file name on first use
//! (`libcuda.so`, ..., `libcuda.so.13`, ..., `libcuda.so.1`: the list of
//! `cudarc::get_lib_name_candidates`), through the dynamic loader's own search path
//! (`LD_LIBRARY_PATH`, the ldconfig cache, the default dirs), honours no environment
//! variable of its own, and panics when none opens. The `check_*` functions here run first
//! and turn a missing library into [`CudaError::LibraryMissing`].
//!
//! When the loader does not find a library by name, the directories of
//! [`search_dirs`] are tried (`LANTERN_CUDA_LIB_DIR`, `$CUDA_PATH/lib64`, `$CUDA_HOME/lib64`,
//! `/usr/local/cuda/lib64`, `/usr/local/nvidia/lib64`, the system lib dirs, and the
//! `nvidia/*/lib` dirs of Python site-packages). A library found there is opened by its full
//! path and kept open for the life of the process; glibc then answers cudarc's later open
//! by bare name with that same library (a loaded object matches its SONAME). If the bare
//! name still does not open, the error says which directory to add to `LD_LIBRARY_PATH`.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use libloading::Library;

use crate::error::{CudaError, Result};

/// Libraries opened by full path, kept open for the life of the process.
static KEPT: Mutex<Vec<Library>> = Mutex::new(Vec::new());

/// Checks that the CUDA driver library (`libcuda`) can be loaded.
pub fn check_driver() -> Result<()> {
    static DONE: OnceLock<Result<()>> = OnceLock::new();
    DONE.get_or_init(|| find_library("libcuda", &["cuda", "nvcuda"], &[]))
        .clone()
}

/// Checks that NVRTC (`libnvrtc`, and its builtins beside it) can be loaded.
pub fn check_nvrtc() -> Result<()> {
    static DONE: OnceLock<Result<()>> = OnceLock::new();
    DONE.get_or_init(|| find_library("libnvrtc", &["nvrtc"], &["libnvrtc-builtins.so"]))
        .clone()
}

/// Checks that cuBLAS and cuBLASLt can be loaded.
pub fn check_cublas() -> Result<()> {
    static DONE: OnceLock<Result<()>> = OnceLock::new();
    DONE.get_or_init(|| {
        find_library("libcublasLt", &["cublasLt"], &[])?;
        find_library("libcublas", &["cublas"], &[])
    })
    .clone()
}

/// The file names cudarc tries for a library stem (`"cuda"`, `"nvrtc"`, ...), in its
/// order, each once (its list repeats some).
pub fn candidates(stem: &str) -> Vec<String> {
    let mut names = cudarc::get_lib_name_candidates(stem);
    let mut seen = std::collections::HashSet::new();
    names.retain(|n| seen.insert(n.clone()));
    names
}

/// The extra directories searched when the loader does not find a library by name.
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("LANTERN_CUDA_LIB_DIR") {
        dirs.extend(std::env::split_paths(&v));
    }
    for var in ["CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"] {
        if let Some(v) = std::env::var_os(var) {
            let root = PathBuf::from(v);
            dirs.push(root.join("lib64"));
            dirs.push(root.join("lib"));
        }
    }
    for d in [
        "/usr/local/cuda/lib64",
        "/usr/local/nvidia/lib64",
        "/usr/local/nvidia/lib",
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib/wsl/lib",
    ] {
        dirs.push(PathBuf::from(d));
    }
    // Python wheels (nvidia-cuda-nvrtc, nvidia-cublas, ...): <prefix>/lib/python3.*/site-packages/nvidia/*/lib.
    let mut prefixes: Vec<PathBuf> = Vec::new();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(v) = std::env::var_os(var) {
            prefixes.push(PathBuf::from(v));
        }
    }
    if let Some(home) = std::env::var_os("HOME") {
        prefixes.push(PathBuf::from(home).join(".local"));
    }
    prefixes.push(PathBuf::from("/usr/local"));
    prefixes.push(PathBuf::from("/usr"));
    for prefix in prefixes {
        for python in read_dir_names(&prefix.join("lib")) {
            if !python.starts_with("python3") {
                continue;
            }
            for packages in ["site-packages", "dist-packages"] {
                let nvidia = prefix
                    .join("lib")
                    .join(&python)
                    .join(packages)
                    .join("nvidia");
                for sub in read_dir_names(&nvidia) {
                    dirs.push(nvidia.join(sub).join("lib"));
                }
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| d.is_dir() && seen.insert(d.clone()));
    dirs
}

fn read_dir_names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Opens the library `library` (one of the cudarc stems `stems`) by name, else from [`search_dirs`].
///
/// `companions` are file-name prefixes of libraries the found one opens itself by name
/// (NVRTC's builtins); they are opened first from the same directory.
pub fn find_library(library: &'static str, stems: &[&str], companions: &[&str]) -> Result<()> {
    let names: Vec<String> = stems.iter().flat_map(|s| candidates(s)).collect();
    // SAFETY: opening a CUDA library runs only its initialisers, as cudarc's own open would.
    if names.iter().any(|n| unsafe { Library::new(n) }.is_ok()) {
        return Ok(());
    }
    let dirs = search_dirs();
    for dir in &dirs {
        for name in &names {
            let path = dir.join(name);
            if !path.is_file() {
                continue;
            }
            for prefix in companions {
                for file in read_dir_names(dir) {
                    if file.starts_with(prefix) && !file.contains(".alt.") {
                        keep_open(&dir.join(file));
                    }
                }
            }
            if !keep_open(&path) {
                continue;
            }
            // cudarc opens by bare name: check that the loader now answers with this library.
            if names.iter().any(|n| unsafe { Library::new(n) }.is_ok()) {
                return Ok(());
            }
            return Err(CudaError::LibraryMissing {
                library,
                looked_for: format!(
                    "found {} but it does not answer to the names cudarc opens ({}); \
                     add {} to LD_LIBRARY_PATH",
                    path.display(),
                    names.join(", "),
                    dir.display()
                ),
            });
        }
    }
    Err(CudaError::LibraryMissing {
        library,
        looked_for: format!(
            "none of the names [{}] opens through the dynamic loader (LD_LIBRARY_PATH, ldconfig), \
             nor is found in [{}]",
            names.join(", "),
            dirs.iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    })
}

/// Opens `path` and keeps it open; false when it does not open.
fn keep_open(path: &Path) -> bool {
    // SAFETY: as in `find_library`.
    match unsafe { Library::new(path) } {
        Ok(lib) => {
            KEPT.lock().unwrap_or_else(|e| e.into_inner()).push(lib);
            true
        }
        Err(_) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_an_error_naming_it() {
        let err = find_library("liblantern_missing", &["lantern_no_such_lib_xyz"], &[])
            .expect_err("a bogus library cannot load");
        let msg = err.to_string();
        assert!(matches!(err, CudaError::LibraryMissing { .. }));
        assert!(msg.contains("liblantern_missing"), "{msg}");
        assert!(msg.contains("liblantern_no_such_lib_xyz.so"), "{msg}");
        assert!(msg.contains("LD_LIBRARY_PATH"), "{msg}");
    }

    #[test]
    fn candidates_include_the_versioned_names() {
        let names = candidates("nvrtc");
        assert!(names.iter().any(|n| n == "libnvrtc.so.13"), "{names:?}");
        assert!(candidates("cuda").iter().any(|n| n == "libcuda.so.1"));
    }

    #[test]
    fn checks_never_panic() {
        // Whatever this machine has, the checks answer with a value.
        let _ = check_driver();
        let _ = check_nvrtc();
        let _ = check_cublas();
    }
}
