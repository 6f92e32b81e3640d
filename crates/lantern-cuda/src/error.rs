//! Errors of the CUDA layer: every failure is a value, never a panic.

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;
use cudarc::nvrtc::result::NvrtcError;

/// What can go wrong on the CUDA backend.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// A shared library (driver, NVRTC, cuBLAS) could not be loaded.
    #[error(
        "the CUDA library {library} could not be loaded: {looked_for}. \
         Point lantern at it with LANTERN_CUDA_LIB_DIR=<dir>[:<dir>...] \
         or add its directory to LD_LIBRARY_PATH"
    )]
    LibraryMissing {
        library: &'static str,
        looked_for: String,
    },
    /// No device with that ordinal.
    #[error("no CUDA device {ordinal}: the driver sees {count} device(s)")]
    NoDevice { ordinal: usize, count: usize },
    /// A CUDA driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(String),
    /// NVRTC failed to compile a kernel source.
    #[error("NVRTC failed to compile {kernel}:\n{log}")]
    Nvrtc { kernel: String, log: String },
    /// A cuBLAS call failed.
    #[error("cuBLAS error: {0}")]
    Cublas(String),
    /// A device allocation did not fit.
    #[error("out of device memory: asked for {bytes} bytes, {free} free")]
    OutOfMemory { bytes: usize, free: usize },
    /// A decode-step graph could not be recorded or replayed (the step runs eagerly).
    #[error("CUDA graph: {0}")]
    Graph(String),
    /// Buffers whose lengths or parameters do not agree.
    #[error("shape error: {0}")]
    Shape(String),
}

/// Result of the CUDA layer.
pub type Result<T> = std::result::Result<T, CudaError>;

impl From<DriverError> for CudaError {
    fn from(e: DriverError) -> Self {
        CudaError::Driver(format!("{e:?}"))
    }
}

impl From<NvrtcError> for CudaError {
    fn from(e: NvrtcError) -> Self {
        CudaError::Nvrtc {
            kernel: String::from("(nvrtc call)"),
            log: format!("{e:?}"),
        }
    }
}

impl From<CublasError> for CudaError {
    fn from(e: CublasError) -> Self {
        CudaError::Cublas(format!("{e:?}"))
    }
}

/// Fails with [`CudaError::Shape`] carrying `msg` unless `ok`.
pub(crate) fn ensure(ok: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Shape(msg()))
    }
}
