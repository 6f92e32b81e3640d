//! `LLM(...)`'s engine options, named as the CLI's flags (`kv_cache_memory`,
//! `block_size`, ...), and loading the model they describe.
//!
//! The CLI's own `EngineArgs` (clap) lives in the `lantern` binary; both parse values and
//! load the model through `lantern_engine::options`, and here each bad value is a
//! `ValueError` naming its option.

use lantern_engine::device::{parse_device, DeviceChoice};
use lantern_engine::lantern_capture::human_bytes;
use lantern_engine::options::{
    load_engine, parse_byte_count, parse_kv_dtype, parse_weight_type, ModelLoad,
};
use lantern_engine::reasoning::ReasoningParser;
use lantern_engine::validate::capture::DEFAULT_MAX_CAPTURE_BYTES;
use lantern_engine::validate::CaptureSettings;
use lantern_engine::{Engine, EngineConfig};
use lantern_model::GgmlDType;
use std::path::PathBuf;

/// A bad option: its name and what is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct OptionError {
    pub option: &'static str,
    pub message: String,
}

impl OptionError {
    fn new(option: &'static str, message: impl Into<String>) -> Self {
        Self {
            option,
            message: message.into(),
        }
    }
}

/// Options as Python passed them; `None` is the CLI's default.
#[derive(Debug, Default, Clone)]
pub struct RawOptions {
    pub model: Option<PathBuf>,
    pub kv_cache_memory: Option<ByteCount>,
    pub kv_cache_dtype: Option<String>,
    pub block_size: Option<usize>,
    pub attention_backend: Option<String>,
    pub max_num_batched_tokens: Option<usize>,
    pub max_num_seqs: Option<usize>,
    pub enable_prefix_caching: Option<bool>,
    pub f32_weights: Option<bool>,
    pub quantize: Option<String>,
    pub chat_template: Option<PathBuf>,
    pub generation_config: Option<String>,
    pub max_model_len: Option<usize>,
    pub threads: Option<usize>,
    pub enable_attention_capture: Option<bool>,
    pub max_capture_bytes: Option<ByteCount>,
    pub device: Option<String>,
    pub gpu_memory_utilization: Option<f32>,
    pub enforce_eager: Option<bool>,
    pub reasoning_parser: Option<String>,
}

/// A byte count as an int (`1073741824`) or as the CLI writes it (`"512M"`, `"1G"`).
#[derive(Debug, Clone, PartialEq)]
pub enum ByteCount {
    Int(i64),
    Text(String),
}

/// Options checked and resolved.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub model: Option<PathBuf>,
    pub config: EngineConfig,
    pub f32_weights: bool,
    pub quantize: Option<GgmlDType>,
    pub chat_template: Option<PathBuf>,
    /// The model's generation_config.json sampling defaults apply (vLLM's `auto`).
    pub model_sampling_defaults: bool,
    pub threads: Option<usize>,
    pub capture: CaptureSettings,
    pub device: DeviceChoice,
    pub gpu_memory_utilization: Option<f32>,
    /// vLLM's `reasoning_parser`: structured output waits for the model's thinking.
    pub reasoning_parser: Option<ReasoningParser>,
}

/// An int, or a byte count as the CLI writes it (`"512M"`, `"1G"`).
fn bytes(option: &'static str, value: &ByteCount) -> Result<usize, OptionError> {
    match value {
        ByteCount::Int(n) if *n > 0 => Ok(*n as usize),
        ByteCount::Int(n) => Err(OptionError::new(option, format!("{n} must be positive"))),
        ByteCount::Text(s) => parse_byte_count(s).map_err(|e| OptionError::new(option, e)),
    }
}

fn positive(option: &'static str, value: Option<usize>) -> Result<Option<usize>, OptionError> {
    match value {
        Some(0) => Err(OptionError::new(option, "must be at least 1")),
        v => Ok(v),
    }
}

impl RawOptions {
    /// Checks every option; the first bad one is the error.
    pub fn resolve(self) -> Result<EngineOptions, OptionError> {
        let defaults = EngineConfig::default();
        let device = match &self.device {
            Some(d) => parse_device(d).map_err(|e| OptionError::new("device", e))?,
            None => DeviceChoice::Cpu,
        };
        let backend = self
            .attention_backend
            .unwrap_or(defaults.attention_backend.clone());
        // The backend follows the device (on a GPU a CPU backend's name means the
        // default CUDA one, as on the command line).
        let known: &[&str] = match device {
            DeviceChoice::Cpu => &["cpu-flash", "cpu-reference"],
            DeviceChoice::Cuda(_) => &["cpu-flash", "cpu-reference", "cuda", "cuda-flashinfer"],
        };
        if !known.contains(&backend.as_str()) {
            return Err(OptionError::new(
                "attention_backend",
                format!(
                    "{backend:?} is not an attention backend on {device} ({})",
                    known.join(", ")
                ),
            ));
        }
        if let Some(u) = self.gpu_memory_utilization {
            if device == DeviceChoice::Cpu {
                return Err(OptionError::new(
                    "gpu_memory_utilization",
                    "applies to device=\"cuda\" only",
                ));
            }
            if !(u > 0.0 && u <= 1.0) {
                return Err(OptionError::new(
                    "gpu_memory_utilization",
                    format!("{u} must be in (0, 1]"),
                ));
            }
        }
        let config = EngineConfig {
            kv_cache_memory: match &self.kv_cache_memory {
                Some(v) => bytes("kv_cache_memory", v)?,
                None => defaults.kv_cache_memory,
            },
            block_size: positive("block_size", self.block_size)?.unwrap_or(defaults.block_size),
            kv_cache_dtype: match &self.kv_cache_dtype {
                Some(s) => parse_kv_dtype(s).map_err(|e| OptionError::new("kv_cache_dtype", e))?,
                None => defaults.kv_cache_dtype,
            },
            attention_backend: backend,
            max_num_batched_tokens: positive(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
            )?
            .unwrap_or(defaults.max_num_batched_tokens),
            max_num_seqs: positive("max_num_seqs", self.max_num_seqs)?
                .unwrap_or(defaults.max_num_seqs),
            enable_prefix_caching: self
                .enable_prefix_caching
                .unwrap_or(defaults.enable_prefix_caching),
            // As `lantern generate`: a library call queues everything it is given.
            max_waiting_requests: usize::MAX,
            max_model_len: positive("max_model_len", self.max_model_len)?,
            enforce_eager: self.enforce_eager.unwrap_or(defaults.enforce_eager),
        };
        // On the host the cache must fit the machine's memory (the engine refuses it too,
        // naming the command line's flag).
        if device == DeviceChoice::Cpu {
            let total = lantern_engine::host_memory::total_bytes();
            if let Some(total) =
                lantern_engine::host_memory::exceeded(config.kv_cache_memory, total)
            {
                return Err(OptionError::new(
                    "kv_cache_memory",
                    format!(
                        "{} is more than this machine's memory of {}",
                        human_bytes(config.kv_cache_memory as u64),
                        human_bytes(total)
                    ),
                ));
            }
        }
        let capture = CaptureSettings {
            // On by default here: the caller is the only client, and asks per request.
            enabled: self.enable_attention_capture.unwrap_or(true),
            max_bytes: match &self.max_capture_bytes {
                Some(v) => bytes("max_capture_bytes", v)? as u64,
                None => DEFAULT_MAX_CAPTURE_BYTES,
            },
            ..CaptureSettings::default()
        };
        Ok(EngineOptions {
            model: self.model,
            config,
            f32_weights: self.f32_weights.unwrap_or(false),
            quantize: self
                .quantize
                .as_deref()
                .map(|s| parse_weight_type(s).map_err(|e| OptionError::new("quantize", e)))
                .transpose()?,
            chat_template: self.chat_template,
            model_sampling_defaults: match self.generation_config.as_deref() {
                None | Some("auto") => true,
                Some("vllm") => false,
                Some(other) => {
                    return Err(OptionError::new(
                        "generation_config",
                        format!("generation_config is \"auto\" or \"vllm\", not {other:?}"),
                    ))
                }
            },
            threads: positive("threads", self.threads)?,
            capture,
            device,
            gpu_memory_utilization: self.gpu_memory_utilization,
            reasoning_parser: self
                .reasoning_parser
                .as_deref()
                .map(|name| {
                    ReasoningParser::from_name(name).ok_or_else(|| {
                        let known = ReasoningParser::NAMES.join(", ");
                        OptionError::new(
                            "reasoning_parser",
                            format!("{name:?} is not a reasoning parser lantern knows ({known})"),
                        )
                    })
                })
                .transpose()?,
        })
    }
}

impl EngineOptions {
    /// The model's path: as given, or the default model (fetched when missing).
    pub fn model_path(&self) -> Result<PathBuf, String> {
        match &self.model {
            Some(path) if !path.exists() => {
                Err(lantern_engine::options::missing_model(path, "model"))
            }
            Some(path) => Ok(path.clone()),
            None => lantern_model::default_model::ensure_default_model()
                .map_err(|e| format!("no model given and the default model is unavailable: {e}")),
        }
    }

    /// Sizes the process's compute pool (once per process: rayon's global pool), to
    /// `threads` or, as the CLI does, the physical cores.
    pub fn init_threads(&self) -> Result<(), OptionError> {
        lantern_quant::threads::init_compute_pool(self.threads)
            .map(|_| ())
            .map_err(|e| OptionError::new("threads", e.to_string()))
    }

    /// Loads the model at `path` and builds an engine over it (on the engine thread).
    pub fn build_engine(&self, path: &std::path::Path) -> Result<Engine, String> {
        let load = ModelLoad {
            weights: lantern_model::LoadOptions {
                progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
                f32_weights: self.f32_weights,
                quantize: self.quantize,
                context_length: None,
            },
            device: self.device,
            gpu_memory_utilization: self.gpu_memory_utilization,
            chat_template: self.chat_template.clone(),
            model_sampling_defaults: self.model_sampling_defaults,
        };
        load_engine(path, &load, self.config.clone()).map_err(|e| e.to_string())
    }
}
