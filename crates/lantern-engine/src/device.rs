//! Which device a model runs on (`--device cpu`, `cuda`, `cuda:N`), and loading a model
//! and its attention backend there. CUDA needs the cargo feature `cuda`; without it, or
//! without a driver and the libraries, asking for it is a clear error.

use crate::{Engine, EngineConfig, EngineError};
use lantern_model::{LoadOptions, LoadedModel};
use std::fmt;
use std::path::Path;

/// Where the model's blocks and attention run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    #[default]
    Cpu,
    /// The NVIDIA GPU of this ordinal.
    Cuda(usize),
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// `cpu`, `cuda` (GPU 0) or `cuda:N`.
pub fn parse_device(text: &str) -> Result<DeviceChoice, String> {
    let text = text.trim();
    match text {
        "cpu" => return Ok(DeviceChoice::Cpu),
        "cuda" => return Ok(DeviceChoice::Cuda(0)),
        _ => {}
    }
    text.strip_prefix("cuda:")
        .and_then(|n| n.parse().ok())
        .map(DeviceChoice::Cuda)
        .ok_or_else(|| format!("{text:?} is not a device (cpu, cuda, cuda:N)"))
}

/// A `(free, total)` reading of the device's memory, for sizing the KV cache from
/// `--gpu-memory-utilization`.
pub type MemoryInfo = (usize, usize);

/// Memory kept free beside the weights and the KV cache for a step's activations and
/// cuBLAS's workspace.
pub const ACTIVATION_RESERVE: usize = 1 << 30;

/// The KV cache budget that keeps the process's device memory at `utilization` of the
/// card's, after what is already in use (the weights).
pub fn kv_budget_from_utilization(
    utilization: f32,
    (free, total): MemoryInfo,
) -> Result<usize, EngineError> {
    if !(utilization > 0.0 && utilization <= 1.0) {
        return Err(EngineError::InvalidConfig(format!(
            "--gpu-memory-utilization {utilization} must be in (0, 1]"
        )));
    }
    let used = total.saturating_sub(free);
    let allowed = (total as f64 * utilization as f64) as usize;
    match allowed.checked_sub(used + ACTIVATION_RESERVE) {
        Some(budget) if budget > 0 => Ok(budget.min(free.saturating_sub(ACTIVATION_RESERVE))),
        _ => Err(EngineError::InvalidConfig(format!(
            "--gpu-memory-utilization {utilization} leaves no room for the KV cache: {used} bytes \
             of the card's {total} are in use and {ACTIVATION_RESERVE} are kept for activations"
        ))),
    }
}

/// What the products over weights of type `dtype` run on, on `device`: lantern's CPU
/// level for the type (`avx512`, ...), `candle`, `candle-f32` with `f32_weights`; on a
/// GPU `cuda-gguf` (kept quantized), `cuda-bf16` or `cuda-f32`.
pub fn product_kernel(
    device: DeviceChoice,
    dtype: lantern_model::GgmlDType,
    f32_weights: bool,
) -> &'static str {
    match device {
        DeviceChoice::Cpu if f32_weights => "candle-f32",
        DeviceChoice::Cpu => lantern_model::linear::kernel_for(dtype),
        #[cfg(feature = "cuda")]
        DeviceChoice::Cuda(_) => lantern_cuda::compute::product_kernel(dtype, f32_weights),
        #[cfg(not(feature = "cuda"))]
        DeviceChoice::Cuda(_) => "cuda (not built)",
    }
}

/// A model loaded onto its device, ready to start an engine there.
pub struct PlacedModel {
    pub loaded: LoadedModel,
    place: Place,
    /// Bytes the weights take on a GPU (`None` on the CPU).
    device_weight_bytes: Option<usize>,
}

enum Place {
    Cpu,
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<lantern_cuda::Gpu>),
}

/// Loads the model at `path` onto `device` (weights uploaded once, for a GPU).
pub fn load_on(
    device: DeviceChoice,
    path: &Path,
    weights: &LoadOptions,
) -> Result<PlacedModel, EngineError> {
    match device {
        DeviceChoice::Cpu => Ok(PlacedModel {
            loaded: lantern_model::load_model(path, weights)?,
            place: Place::Cpu,
            device_weight_bytes: None,
        }),
        DeviceChoice::Cuda(ordinal) => cuda::load(ordinal, path, weights),
    }
}

impl PlacedModel {
    /// Bytes the model's weights take on its GPU (GGUF's quantized types stay quantized
    /// there); `None` on the CPU.
    pub fn device_weight_bytes(&self) -> Option<usize> {
        self.device_weight_bytes
    }

    /// An engine over the model, with attention on its device: the backend
    /// `config.attention_backend` names on the CPU; on a GPU the CUDA backend it names, or
    /// the default CUDA one when it names a CPU backend. `utilization` (GPU only) sizes
    /// the KV cache from the card's memory instead of `config.kv_cache_memory`.
    pub fn start(
        self,
        config: EngineConfig,
        utilization: Option<f32>,
    ) -> Result<Engine, EngineError> {
        match self.place {
            Place::Cpu => {
                if utilization.is_some() {
                    return Err(EngineError::InvalidConfig(
                        "--gpu-memory-utilization applies to --device cuda only".into(),
                    ));
                }
                if config.attention_backend.starts_with("cuda") {
                    return Err(EngineError::InvalidConfig(format!(
                        "the attention backend {} runs on a GPU: add --device cuda",
                        config.attention_backend
                    )));
                }
                Engine::new(self.loaded, config)
            }
            #[cfg(feature = "cuda")]
            Place::Cuda(gpu) => {
                use lantern_cuda::{CudaBackend, CUDA, CUDA_BACKEND_NAMES};
                let mut config = config;
                let name = if CUDA_BACKEND_NAMES.contains(&config.attention_backend.as_str()) {
                    config.attention_backend.clone()
                } else {
                    CUDA.to_string()
                };
                if let Some(u) = utilization {
                    let memory = gpu.memory_info().map_err(cuda::gpu_error(gpu.ordinal()))?;
                    config.kv_cache_memory = kv_budget_from_utilization(u, memory)?;
                }
                let backend = CudaBackend::new(gpu, &name)?;
                let backend = if config.enforce_eager {
                    backend.eager()
                } else {
                    backend
                };
                config.attention_backend = name;
                let mut engine = Engine::with_backend(self.loaded, config, Box::new(backend))?;
                engine.device_weight_bytes = self.device_weight_bytes;
                Ok(engine)
            }
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use lantern_cuda::{CudaCompute, Gpu};

    /// An error of GPU `ordinal` as the engine's.
    pub fn gpu_error(ordinal: usize) -> impl Fn(lantern_cuda::CudaError) -> EngineError {
        move |e| EngineError::Device {
            device: DeviceChoice::Cuda(ordinal).to_string(),
            message: e.to_string(),
        }
    }

    pub fn load(
        ordinal: usize,
        path: &Path,
        weights: &LoadOptions,
    ) -> Result<PlacedModel, EngineError> {
        let gpu = Gpu::open(ordinal).map_err(gpu_error(ordinal))?;
        let compute = CudaCompute::new(gpu.clone());
        let loaded = lantern_model::load_model_on(path, weights, &compute)?;
        let (bytes, quantized) = (compute.weight_bytes(), compute.quantized_weight_bytes());
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        tracing::info!(
            "weights on cuda:{ordinal}: {:.1} MiB ({:.1} MiB of it GGUF matrices kept quantized)",
            mib(bytes),
            mib(quantized)
        );
        Ok(PlacedModel {
            loaded,
            place: Place::Cuda(gpu),
            device_weight_bytes: Some(bytes),
        })
    }
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::*;

    pub fn load(
        ordinal: usize,
        _path: &Path,
        _weights: &LoadOptions,
    ) -> Result<PlacedModel, EngineError> {
        Err(EngineError::Device {
            device: DeviceChoice::Cuda(ordinal).to_string(),
            message: "this lantern was built without CUDA: build it with `--features cuda` \
                      to use --device cuda"
                .into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_name_the_kernels_of_their_device() {
        use lantern_model::GgmlDType;
        let cpu = DeviceChoice::Cpu;
        assert_eq!(product_kernel(cpu, GgmlDType::Q4_1, true), "candle-f32");
        assert_eq!(
            product_kernel(cpu, GgmlDType::Q4_1, false),
            lantern_model::linear::kernel_for(GgmlDType::Q4_1)
        );
        #[cfg(feature = "cuda")]
        {
            let gpu = DeviceChoice::Cuda(0);
            assert_eq!(product_kernel(gpu, GgmlDType::Q4_1, true), "cuda-f32");
            assert_eq!(product_kernel(gpu, GgmlDType::BF16, false), "cuda-bf16");
            if std::env::var_os("LANTERN_CUDA_QUANTIZED_WEIGHTS").is_none() {
                assert_eq!(product_kernel(gpu, GgmlDType::Q6K, false), "cuda-gguf");
            }
        }
    }

    #[test]
    fn devices_parse_and_bad_ones_are_named() {
        assert_eq!(parse_device("cpu"), Ok(DeviceChoice::Cpu));
        assert_eq!(parse_device("cuda"), Ok(DeviceChoice::Cuda(0)));
        assert_eq!(parse_device("cuda:3"), Ok(DeviceChoice::Cuda(3)));
        assert!(parse_device("gpu").unwrap_err().contains("\"gpu\""));
        assert!(parse_device("cuda:x").is_err());
    }

    #[test]
    fn utilization_leaves_the_weights_and_a_reserve() {
        let gib = 1usize << 30;
        // 80 GiB card, 2 GiB in use (weights): 0.5 allows 40 GiB, minus 2 used, minus 1.
        let budget = kv_budget_from_utilization(0.5, (78 * gib, 80 * gib)).unwrap();
        assert_eq!(budget, 40 * gib - 2 * gib - gib);
        assert!(kv_budget_from_utilization(0.01, (78 * gib, 80 * gib)).is_err());
        assert!(kv_budget_from_utilization(1.5, (78 * gib, 80 * gib)).is_err());
    }
}
