//! lantern on NVIDIA GPUs: the low-level layer (libraries, device, kernels, cuBLAS).

pub use cudarc;

pub mod backend;
pub mod blocks;
pub mod cache;
pub mod capture;
pub mod compute;
pub mod error;
pub mod fused;
pub mod gemm;
pub mod gemv;
pub mod gpu;
pub mod graph;
pub mod kept;
pub mod kernels;
pub mod launch;
pub mod libs;
pub mod maps;
pub mod pool;
mod profile;
pub mod reduce;

pub use backend::{CudaBackend, CUDA, CUDA_BACKEND_NAMES, CUDA_FLASHINFER};
pub use compute::CudaCompute;
pub use error::{CudaError, Result};
pub use gpu::{compile_all_kernels_ptx, Gpu};
pub use graph::GRAPH_BATCH_SIZES;
pub use kernels::{
    Activation, AttnParams, CacheElem, KvStrides, PagedMeta, RopeStep, MAX_HEAD_DIM,
};
