//! `vllm serve`'s flags that a command line copied from a vLLM deployment carries and
//! that ask for what lantern does anyway: taken, with one line saying so, so that the
//! command runs as it is. Those that ask for something lantern does not do are refused,
//! naming what it does instead.

use crate::args::EngineArgs;
use anyhow::{bail, Result};
use clap::Args;

/// The tool-call formats lantern parses from every chat offered tools.
const TOOL_CALL_PARSERS: [&str; 2] = ["hermes", "llama3_json"];

#[derive(Args, Debug, Clone, Default)]
pub struct VllmServeFlags {
    /// vLLM's: prefix caching is on unless --no-prefix-caching.
    #[arg(long, hide = true)]
    pub enable_prefix_caching: bool,
    /// vLLM's spelling of --no-prefix-caching.
    #[arg(long, hide = true)]
    pub no_enable_prefix_caching: bool,
    /// vLLM's: prompts are always split into chunks that fit a step.
    #[arg(long, hide = true)]
    pub enable_chunked_prefill: bool,
    /// vLLM's: every chat offered tools is parsed for calls.
    #[arg(long, hide = true)]
    pub enable_auto_tool_choice: bool,
    /// vLLM's: `hermes` and `llama3_json` calls are both parsed.
    #[arg(long, hide = true, value_name = "NAME")]
    pub tool_call_parser: Option<String>,
    /// vLLM's: lantern runs no code from a model directory.
    #[arg(long, hide = true)]
    pub trust_remote_code: bool,
    /// vLLM's: `auto` (weights kept as stored) or `float32` (--f32-weights).
    #[arg(long, hide = true, value_name = "DTYPE")]
    pub dtype: Option<String>,
    /// vLLM's: one process holds the whole model.
    #[arg(long, hide = true, value_name = "N")]
    pub tensor_parallel_size: Option<usize>,
    #[arg(long, hide = true, value_name = "N")]
    pub pipeline_parallel_size: Option<usize>,
    #[arg(long, hide = true, value_name = "N")]
    pub data_parallel_size: Option<usize>,
    /// vLLM's: preempted requests are recomputed, not swapped.
    #[arg(long, hide = true, value_name = "GIB")]
    pub swap_space: Option<f64>,
    /// vLLM's: the tokenizer is the model's own (the same path is taken).
    #[arg(long, hide = true, value_name = "PATH")]
    pub tokenizer: Option<std::path::PathBuf>,
    /// vLLM's server logging options: lantern logs through `RUST_LOG`.
    #[arg(long, hide = true, value_name = "LEVEL")]
    pub uvicorn_log_level: Option<String>,
    #[arg(long, hide = true)]
    pub disable_uvicorn_access_log: bool,
    #[arg(long, hide = true)]
    pub enable_log_requests: bool,
    #[arg(long, hide = true, value_name = "N")]
    pub max_log_len: Option<usize>,
    /// vLLM's flags for what lantern does not do, refused with what to do instead.
    #[arg(long, hide = true)]
    pub enable_lora: bool,
    #[arg(long, hide = true, num_args = 1.., value_name = "NAME=PATH")]
    pub lora_modules: Vec<String>,
    #[arg(long, hide = true, value_name = "METHOD")]
    pub quantization: Option<String>,
    #[arg(long, hide = true, value_name = "REVISION")]
    pub revision: Option<String>,
    #[arg(long, hide = true, value_name = "DIR")]
    pub download_dir: Option<String>,
    #[arg(long, hide = true, value_name = "CONFIG")]
    pub speculative_config: Option<String>,
}

impl VllmServeFlags {
    /// Checks the flags, applies those with a lantern meaning to `engine`, and says in
    /// one line each what the others change (nothing).
    pub fn apply(&self, engine: &mut EngineArgs) -> Result<Vec<String>> {
        self.refuse_what_lantern_does_not_do()?;
        let mut notes = Vec::new();
        let mut nothing_to_do = |flag: &str, why: &str| {
            notes.push(format!("--{flag}: nothing to change ({why})"));
        };
        if self.enable_prefix_caching {
            if self.no_enable_prefix_caching || engine.no_prefix_caching {
                bail!("--enable-prefix-caching contradicts --no-prefix-caching");
            }
            nothing_to_do("enable-prefix-caching", "prefix caching is on by default");
        }
        if self.no_enable_prefix_caching {
            engine.no_prefix_caching = true;
        }
        if self.enable_chunked_prefill {
            nothing_to_do("enable-chunked-prefill", "prompts are always chunked");
        }
        if self.enable_auto_tool_choice {
            nothing_to_do(
                "enable-auto-tool-choice",
                "every chat offered tools is parsed for calls",
            );
        }
        if let Some(parser) = &self.tool_call_parser {
            if !TOOL_CALL_PARSERS.contains(&parser.as_str()) {
                bail!(
                    "--tool-call-parser {parser:?}: lantern parses {} calls (both, always), not others",
                    TOOL_CALL_PARSERS.join(" and ")
                );
            }
            nothing_to_do(
                "tool-call-parser",
                "hermes and llama3_json calls are both parsed",
            );
        }
        if self.trust_remote_code {
            nothing_to_do("trust-remote-code", "lantern runs no code from a model");
        }
        match self.dtype.as_deref() {
            None => {}
            Some("auto") => nothing_to_do("dtype", "weights are kept as the model stores them"),
            Some("float32") => engine.f32_weights = true,
            Some(other) => bail!(
                "--dtype {other:?}: lantern keeps weights as the model stores them (--dtype auto) \
                 or widens them to float32 (--dtype float32, --f32-weights); \
                 --quantize TYPE quantizes a Hugging Face directory's"
            ),
        }
        for (flag, size) in [
            ("tensor-parallel-size", self.tensor_parallel_size),
            ("pipeline-parallel-size", self.pipeline_parallel_size),
            ("data-parallel-size", self.data_parallel_size),
        ] {
            match size {
                None | Some(1) => {}
                Some(n) => bail!(
                    "--{flag} {n}: one lantern process holds the whole model (run one server per \
                     machine or NUMA node, or Ray Data over many: see the README)"
                ),
            }
        }
        if self.swap_space.is_some() {
            nothing_to_do(
                "swap-space",
                "preempted requests are recomputed, not swapped",
            );
        }
        if let Some(tokenizer) = &self.tokenizer {
            if engine.model.as_deref() != Some(tokenizer.as_path()) {
                bail!(
                    "--tokenizer {}: lantern uses the model's own tokenizer (a GGUF file's, or \
                     tokenizer.json in the model's directory)",
                    tokenizer.display()
                );
            }
        }
        if self.uvicorn_log_level.is_some() || self.disable_uvicorn_access_log {
            nothing_to_do(
                "uvicorn-log-level",
                "lantern's log is set with RUST_LOG and --disable-log-requests",
            );
        }
        if self.enable_log_requests {
            nothing_to_do("enable-log-requests", "requests are logged by default");
        }
        if self.max_log_len.is_some() {
            nothing_to_do("max-log-len", "request lines hold no prompt text");
        }
        Ok(notes)
    }

    fn refuse_what_lantern_does_not_do(&self) -> Result<()> {
        if self.enable_lora || !self.lora_modules.is_empty() {
            bail!(
                "LoRA adapters are not served: merge the adapter into its base model (peft's \
                 merge_and_unload, saved with save_pretrained) and serve that directory"
            );
        }
        if let Some(method) = &self.quantization {
            bail!(
                "--quantization {method}: lantern serves GGUF files in the types they store, \
                 and quantizes a Hugging Face directory's weights with --quantize \
                 (q8_0, q4_0, q4_k, ...)"
            );
        }
        if self.revision.is_some() || self.download_dir.is_some() {
            bail!(
                "--revision and --download-dir name a model hub's files: lantern serves a \
                 local GGUF file or Hugging Face directory (download it first)"
            );
        }
        if self.speculative_config.is_some() {
            bail!("--speculative-config: lantern does not decode speculatively");
        }
        Ok(())
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
        #[command(flatten)]
        vllm: VllmServeFlags,
    }

    fn apply(args: &[&str]) -> Result<(EngineArgs, Vec<String>)> {
        let cli = Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))?;
        let mut engine = cli.engine;
        let notes = cli.vllm.apply(&mut engine)?;
        Ok((engine, notes))
    }

    #[test]
    fn a_vllm_command_line_runs_as_it_is() {
        let (engine, notes) = apply(&[
            "--model",
            "m.gguf",
            "--enable-auto-tool-choice",
            "--tool-call-parser",
            "hermes",
            "--trust-remote-code",
            "--dtype",
            "auto",
            "--tensor-parallel-size",
            "1",
            "--enable-prefix-caching",
            "--swap-space",
            "4",
            "--tokenizer",
            "m.gguf",
            "--uvicorn-log-level",
            "warning",
        ])
        .unwrap();
        assert!(!engine.no_prefix_caching && !engine.f32_weights);
        assert_eq!(notes.len(), 7, "{notes:?}");
        assert!(notes[0].starts_with("--enable-prefix-caching: nothing to change"));
    }

    #[test]
    fn flags_with_a_lantern_meaning_take_it() {
        let (engine, notes) = apply(&["--no-enable-prefix-caching", "--dtype", "float32"]).unwrap();
        assert!(engine.no_prefix_caching && engine.f32_weights);
        assert!(notes.is_empty());
    }

    #[test]
    fn flags_asking_for_what_lantern_does_not_do_are_refused() {
        for (args, says) in [
            (&["--tensor-parallel-size", "2"][..], "one lantern process"),
            (&["--dtype", "bfloat16"], "as the model stores them"),
            (&["--tool-call-parser", "mistral"], "hermes and llama3_json"),
            (
                &["--enable-lora", "--lora-modules", "a=b"],
                "merge the adapter",
            ),
            (&["--quantization", "awq"], "--quantize"),
            (&["--revision", "main"], "local GGUF file"),
            (
                &["--model", "a.gguf", "--tokenizer", "b"],
                "model's own tokenizer",
            ),
            (
                &["--enable-prefix-caching", "--no-prefix-caching"],
                "contradicts",
            ),
        ] {
            let e = apply(args).unwrap_err().to_string();
            assert!(e.contains(says), "{args:?}: {e}");
        }
    }
}
