//! Models for lantern: GGUF weights, the tokenizer and chat template stored in the model
//! file, and model families written against `lantern-attn`'s attention layer.

pub mod archs;
pub mod blocks;
pub mod chat;
pub mod compute;
pub mod cpu;
pub mod decoder;
pub mod default_model;
pub mod error;
pub mod gguf;
pub mod gguf_header;
pub mod hf;
pub mod hparams;
pub mod iquants;
pub mod linear;
pub mod ops;
pub mod pick;
pub mod prompt;
pub mod rope;
pub mod source;
pub mod synthetic;
pub mod template_json;
pub mod tokenizer;

pub use candle_core::quantized::GgmlDType;
pub use chat::{
    ChatMessage, ChatRenderOptions, ChatSegment, ChatTemplate, RenderedChat, TemplateError,
    ToolSupport,
};
pub use cpu::{simd_level, SimdLevel};
pub use error::{ModelError, Result};
pub use gguf::GgufFile;
pub use pick::{
    LogitEdit, ReducedRow, RowPick, RowReduction, RowScore, SampleDraw, TokenChoice,
    MAX_REDUCED_TOP_LOGPROBS,
};
pub use source::WeightSource;
pub use tokenizer::{IncrementalDecoder, ModelTokenizer};

use lantern_attn::{
    AttentionBackend, AttentionLayerSpec, AttentionMetadata, AttentionTap, LayerKvCache,
};
use std::path::Path;

/// What the engine needs to know about a model to schedule it and size its KV cache.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub architecture: String,
    pub name: String,
    pub num_layers: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    /// The attention of every layer: heads, scale, masks. Backends and capture read these.
    pub attention: Vec<AttentionLayerSpec>,
}

/// One step's flattened batch: the tokens of every scheduled request, back to back.
pub struct ForwardBatch<'a> {
    pub token_ids: &'a [u32],
    pub positions: &'a [usize],
    /// Attention metadata of each KV cache group, built once for this step.
    pub attention: &'a [AttentionMetadata],
    /// The KV cache group of each layer (an index into `attention`).
    pub layer_group: &'a [usize],
    /// Rows (token indices) whose logits are wanted, in output order.
    pub logits_rows: &'a [usize],
}

impl ForwardBatch<'_> {
    fn validate(&self, info: &ModelInfo, num_caches: usize) -> Result<()> {
        let problem = if self.positions.len() != self.token_ids.len() {
            Some("positions and token ids differ in length".to_string())
        } else if self.layer_group.len() != info.num_layers || num_caches != info.num_layers {
            Some(format!(
                "{} layer groups and {num_caches} caches for {} layers",
                self.layer_group.len(),
                info.num_layers
            ))
        } else if self.layer_group.iter().any(|&g| g >= self.attention.len()) {
            Some("a layer names a KV cache group without metadata".to_string())
        } else if self.logits_rows.iter().any(|&r| r >= self.token_ids.len()) {
            Some("a logits row is outside the batch".to_string())
        } else {
            None
        };
        match problem {
            Some(p) => Err(ModelError::Compute(p)),
            None => Ok(()),
        }
    }
}

/// A decoder-only language model.
pub trait CausalLm: Send + Sync {
    fn info(&self) -> &ModelInfo;

    /// Runs one step: writes this step's K/V into `caches` (one per layer, allocated by
    /// `backend`) and returns the logits of `batch.logits_rows`, `[logits_rows.len(),
    /// vocab_size]`. With a `tap`, each layer the tap wants hands it its query rows and
    /// attention output.
    fn forward(
        &self,
        batch: &ForwardBatch,
        backend: &dyn AttentionBackend,
        caches: &mut [Box<dyn LayerKvCache>],
        tap: Option<&mut dyn AttentionTap>,
    ) -> Result<Vec<f32>>;

    /// Whether [`Self::forward_picking`] saves work: the logits live on a device and a
    /// row reduced there (to a token and its logprobs) is not copied to the host.
    fn picks_on_device(&self) -> bool {
        false
    }

    /// [`Self::forward`] where each `batch.logits_rows` entry says in `pick` whether it is
    /// wanted whole or reduced (to its argmax, a sample or a given token, with logprobs
    /// if asked: [`RowPick`]), reduced rows after `edits` (penalties; none for whole
    /// rows, which the caller edits itself). Models that do not pick on a device return
    /// every row whole.
    fn forward_picking(
        &self,
        batch: &ForwardBatch,
        backend: &dyn AttentionBackend,
        caches: &mut [Box<dyn LayerKvCache>],
        tap: Option<&mut dyn AttentionTap>,
        pick: &[RowPick],
        edits: &[LogitEdit],
    ) -> Result<StepLogitRows> {
        let _ = (pick, edits);
        Ok(StepLogitRows::all(
            self.forward(batch, backend, caches, tap)?,
        ))
    }
}

/// A step's logits rows as the model returns them: whole rows, and rows reduced where the
/// caller asked only for that.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StepLogitRows {
    /// The whole rows, in the order of `ForwardBatch::logits_rows`, picked rows left out.
    pub logits: Vec<f32>,
    /// Per `logits_rows` entry: what it was reduced to, if it was (empty: none was).
    pub picked: Vec<Option<ReducedRow>>,
}

impl StepLogitRows {
    /// Every row whole.
    pub fn all(logits: Vec<f32>) -> Self {
        Self {
            logits,
            picked: Vec::new(),
        }
    }
}

/// A model with its tokenizer and chat template, as loaded from one file.
pub struct LoadedModel {
    pub model: Box<dyn CausalLm>,
    pub tokenizer: ModelTokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// The sampling defaults the model recommends (a Hugging Face directory's
    /// `generation_config.json`; none for GGUF files).
    pub sampling_defaults: hf::generation_config::SamplingDefaults,
}

/// A progress bar over the tensors being loaded (hidden when not wanted).
pub struct LoadProgress {
    bar: indicatif::ProgressBar,
}

impl LoadProgress {
    pub fn new(visible: bool) -> Self {
        let bar = if visible {
            indicatif::ProgressBar::new(0)
        } else {
            indicatif::ProgressBar::hidden()
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} tensors")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        Self { bar }
    }

    pub fn start(&self, total: usize) {
        self.bar.set_length(total as u64);
    }

    pub fn advance(&self) {
        self.bar.inc(1);
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// How to load a model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Show a progress bar while tensors load.
    pub progress: bool,
    /// Dequantize every weight matrix to f32 at load time, so that matrix products take
    /// f32 activations as they are (as transformers computes on dequantized weights)
    /// instead of quantizing them to 8 bits. Slower and ~8x the weight memory; for
    /// comparisons that need the reference's arithmetic.
    pub f32_weights: bool,
    /// Hugging Face directories: store every weight matrix in this type at load
    /// (`Q8_0`, ...); `None` keeps each tensor's own f32/f16/bf16. GGUF files ignore it.
    pub quantize: Option<candle_core::quantized::GgmlDType>,
    /// The context the model will serve (the engine's `--max-model-len`); `None`: the
    /// model's own. LongRoPE models pick their long-context factors beyond the original
    /// context by it.
    pub context_length: Option<usize>,
}

/// Loads a model: a GGUF file, or a Hugging Face directory (`config.json`, safetensors,
/// `tokenizer.json`); weights, tokenizer and chat template.
pub fn load_model(path: &Path, options: &LoadOptions) -> Result<LoadedModel> {
    load_model_on(path, options, &compute::Cpu)
}

/// A device a model can be loaded onto: builds the decoder an architecture describes
/// over its own [`compute::Compute`].
pub trait ModelDevice {
    fn build(
        &self,
        source: &mut dyn WeightSource,
        spec: decoder::DecoderSpec,
        progress: &LoadProgress,
        options: &LoadOptions,
    ) -> Result<Box<dyn CausalLm>>;
}

impl<C: compute::Compute + Clone> ModelDevice for C {
    fn build(
        &self,
        source: &mut dyn WeightSource,
        spec: decoder::DecoderSpec,
        progress: &LoadProgress,
        options: &LoadOptions,
    ) -> Result<Box<dyn CausalLm>> {
        Ok(Box::new(decoder::Decoder::load(
            self.clone(),
            source,
            spec,
            progress,
            options,
        )?))
    }
}

/// [`load_model`] with the model's blocks on `device`.
pub fn load_model_on(
    path: &Path,
    options: &LoadOptions,
    device: &dyn ModelDevice,
) -> Result<LoadedModel> {
    if hf::is_hf_directory(path) {
        return load_hf_directory(path, options, device);
    }
    let mut gguf = GgufFile::open(path)?;
    let progress = LoadProgress::new(options.progress);
    progress.bar.set_message(
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    let tokenizer = ModelTokenizer::from_gguf(&gguf)?;
    let chat_template = chat_template(&gguf, &tokenizer);
    let spec = archs::describe(&gguf)?;
    let model = device.build(&mut gguf, spec, &progress, options)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
        sampling_defaults: Default::default(),
    })
}

fn load_hf_directory(
    dir: &Path,
    options: &LoadOptions,
    device: &dyn ModelDevice,
) -> Result<LoadedModel> {
    let mut source = hf::HfDirectory::open(dir, options.quantize)?;
    let progress = LoadProgress::new(options.progress);
    progress.bar.set_message(
        dir.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    let tokenizer_config = hf::tokenizer::TokenizerConfig::read(dir)?;
    let tokenizer =
        hf::tokenizer::load_tokenizer(dir, &tokenizer_config, &source.config.eos_token_ids)?;
    // A template that does not compile fails chat requests only, as for GGUF files.
    let chat_template = tokenizer_config.chat_template.as_deref().map(|source| {
        ChatTemplate::from_model_file(
            source,
            tokenizer.bos_token().unwrap_or_default(),
            tokenizer.eos_token().unwrap_or_default(),
        )
    });
    if let Some(problem) = chat_template.as_ref().and_then(ChatTemplate::problem) {
        tracing::warn!(
            "{}: the chat template cannot be used, chat requests will fail: {problem}",
            dir.display()
        );
    }
    let sampling_defaults = hf::generation_config::SamplingDefaults::read(dir)?;
    let spec = archs::describe(&source)?;
    let model = device.build(&mut source, spec, &progress, options)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        chat_template,
        sampling_defaults,
    })
}

/// Builds the model `source` describes (`general.architecture` picks the family).
pub fn load_architecture(
    source: &mut dyn WeightSource,
    progress: &LoadProgress,
    options: &LoadOptions,
) -> Result<Box<dyn CausalLm>> {
    let spec = archs::describe(source)?;
    compute::Cpu.build(source, spec, progress, options)
}

/// The file's chat template. One that cannot be used (not a string, does not compile) is
/// kept as broken, with a warning: chat requests then fail with the reason, raw prompts
/// still work.
fn chat_template(gguf: &GgufFile, tokenizer: &ModelTokenizer) -> Option<ChatTemplate> {
    let template = match gguf.opt_string("tokenizer.chat_template") {
        Ok(None) => return None,
        Ok(Some(source)) => ChatTemplate::from_model_file(
            source,
            tokenizer.bos_token().unwrap_or_default(),
            tokenizer.eos_token().unwrap_or_default(),
        ),
        Err(e) => ChatTemplate::broken(e.to_string()),
    };
    if let Some(problem) = template.problem() {
        tracing::warn!(
            "{}: the chat template cannot be used, chat requests will fail: {problem}",
            gguf.path().display()
        );
    }
    Some(template)
}
