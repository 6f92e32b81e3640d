//! `lantern generate`: prompts in, text out, all prompts in one batch.

use crate::args::EngineArgs;
use crate::generate_beam::{BeamOptions, BeamPrompt};
use crate::generate_capture::CaptureArgs;
use anyhow::{bail, Context, Result};
use clap::{ArgMatches, Args};
use lantern_engine::{Completion, Engine, SamplingParams};
use lantern_model::ChatMessage;
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// A raw prompt, tokenized as is (repeatable).
    #[arg(long, action = clap::ArgAction::Append)]
    pub prompt: Vec<String>,
    /// A user message, rendered through the model's chat template (repeatable).
    #[arg(long, action = clap::ArgAction::Append)]
    pub chat: Vec<String>,
    /// A file of prompts, one per line: plain text, or JSON `{"prompt": "..."}`,
    /// `{"chat": "a user message"}` or `{"chat": [{"role": ..., "content": ...}, ...]}`
    /// (JSON allows newlines inside a prompt); its prompts run where the flag stands.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// Most tokens generated per prompt.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling: sample from the smallest set of tokens whose probabilities add
    /// up to this (1 keeps every token).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 keeps every token.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed of the sampler's random numbers, for repeatable sampling at a temperature
    /// above 0 (default: fresh randomness for each prompt).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Generate exactly --max-tokens, past end-of-sequence.
    #[arg(long)]
    pub ignore_eos: bool,
    /// One JSON object per prompt, one per line, in input order.
    #[arg(long)]
    pub json: bool,
    /// Beam search with this many beams instead of sampling, as the server's
    /// `use_beam_search` (each prompt's beams best first; `--json` puts them in `beams`).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=256))]
    pub beam_width: Option<u16>,
    /// With --beam-width: a beam's score is its logprob over `length^PENALTY` (the
    /// length counting the prompt, as vLLM's).
    #[arg(long, default_value_t = 1.0, requires = "beam_width")]
    pub length_penalty: f32,
    #[command(flatten)]
    pub capture: CaptureArgs,
}

/// One input prompt, as given.
enum PromptInput {
    Raw(String),
    /// A conversation, rendered with the chat template (`--chat`: one user message).
    Chat(Vec<ChatMessage>),
}

pub fn run(args: GenerateArgs, matches: &ArgMatches, verbose: bool) -> Result<()> {
    let inputs = collect_inputs(&args, matches)?;
    if inputs.is_empty() {
        bail!("nothing to generate: give --prompt, --chat or --file");
    }
    if let Some(width) = args.beam_width {
        if args.capture.capture.is_some() {
            bail!("--capture cannot be combined with --beam-width: capture a chosen beam by giving its text as the prompt with --max-tokens 0");
        }
        let prompts = inputs
            .into_iter()
            .map(|input| match input {
                PromptInput::Raw(text) => BeamPrompt::Text(text),
                PromptInput::Chat(messages) => BeamPrompt::Chat(messages),
            })
            .collect();
        let options = BeamOptions {
            width: usize::from(width),
            length_penalty: args.length_penalty,
            max_tokens: args.max_tokens,
            ignore_eos: args.ignore_eos,
            json: args.json,
        };
        return crate::generate_beam::run(&args.engine, verbose, prompts, &options);
    }
    args.capture.check_path()?;
    let mut engine = args.engine.build_engine(verbose)?;
    let capture = args.capture.spec(&engine)?;
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: 0.0,
        seed: args.seed,
        max_tokens: args.max_tokens,
        ignore_eos: args.ignore_eos,
        stop_token_ids: std::sync::Arc::new([]),
        prompt_logits: false,
        ..SamplingParams::default()
    };
    let mut ids = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.iter().enumerate() {
        let prompt = match input {
            PromptInput::Raw(text) => engine.tokenizer().encode(text, true)?,
            PromptInput::Chat(messages) => engine.tokenize_chat(messages, true)?,
        };
        if let Some(spec) = &capture {
            // The most the engine may generate: up to the context's end.
            let room = engine
                .model_info()
                .context_length
                .saturating_sub(prompt.len());
            args.capture
                .check(spec, &engine, prompt.len(), args.max_tokens.min(room))
                .with_context(|| format!("prompt {}", i + 1))?;
        }
        ids.push(engine.add_request_with_capture(prompt, params.clone(), capture.clone())?);
    }
    // A single prompt in text mode streams as it is produced; otherwise results are
    // printed in input order once done.
    let stream = !args.json && ids.len() == 1;
    let mut stdout = std::io::stdout().lock();
    while engine.has_unfinished() {
        for out in engine.step()? {
            if stream {
                stdout.write_all(out.new_text.as_bytes())?;
                stdout.flush()?;
            }
        }
    }
    let completions: Vec<Completion> = ids
        .iter()
        .map(|&id| {
            engine
                .take_completion(id)
                .context("a request did not finish")
        })
        .collect::<Result<_>>()?;
    for (i, c) in completions.iter().enumerate() {
        if args.json {
            writeln!(stdout, "{}", completion_json(&engine, i, c))?;
        } else if stream {
            writeln!(stdout)?;
        } else {
            writeln!(stdout, "=== prompt {} ===\n{}\n", i + 1, c.text)?;
        }
    }
    if let Some(spec) = &capture {
        args.capture.write_all(spec, &completions)?;
    }
    if verbose {
        for c in &completions {
            eprintln!(
                "lantern: request {}: {} prompt tokens, {} generated ({}), first token {:.1} ms, total {:.1} ms",
                c.id,
                c.prompt_token_ids.len(),
                c.token_ids.len(),
                c.finish_reason.as_str(),
                c.time_to_first_token.as_secs_f64() * 1e3,
                c.total_time.as_secs_f64() * 1e3
            );
        }
    }
    Ok(())
}

/// One `--json` line: `index` is the prompt's place in input order.
fn completion_json(engine: &Engine, index: usize, c: &Completion) -> serde_json::Value {
    let decode_secs = (c.total_time - c.time_to_first_token).as_secs_f64();
    json!({
        "index": index,
        "prompt_token_ids": &c.prompt_token_ids[..],
        "token_ids": c.token_ids,
        "text": c.text,
        "finish_reason": c.finish_reason.as_str(),
        "timings": {
            "time_to_first_token_ms": c.time_to_first_token.as_secs_f64() * 1e3,
            "total_ms": c.total_time.as_secs_f64() * 1e3,
            "decode_tokens_per_s": if decode_secs > 0.0 && c.token_ids.len() > 1 {
                (c.token_ids.len() - 1) as f64 / decode_secs
            } else {
                0.0
            },
        },
        "model": engine.model_info().name,
    })
}

/// The prompts in the order they were given on the command line, the file's lines
/// where `--file` stands.
fn collect_inputs(args: &GenerateArgs, matches: &ArgMatches) -> Result<Vec<PromptInput>> {
    let mut indexed: Vec<(usize, PromptInput)> = Vec::new();
    let positions = |name: &str| -> Vec<usize> {
        matches
            .indices_of(name)
            .map(|i| i.collect())
            .unwrap_or_default()
    };
    for (pos, text) in positions("prompt").into_iter().zip(&args.prompt) {
        indexed.push((pos, PromptInput::Raw(text.clone())));
    }
    for (pos, text) in positions("chat").into_iter().zip(&args.chat) {
        indexed.push((pos, PromptInput::Chat(vec![ChatMessage::new("user", text)])));
    }
    if let Some(path) = &args.file {
        let at = positions("file").first().copied().unwrap_or(usize::MAX);
        let content = std::fs::read_to_string(path)
            .with_context(|| format!("reading prompts from {}", path.display()))?;
        // A byte-order mark some editors write is not part of the first prompt.
        let content = content.strip_prefix('\u{feff}').unwrap_or(&content);
        for (n, line) in content.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let input = parse_prompt_line(line)
                .with_context(|| format!("{}:{}: not a prompt", path.display(), n + 1))?;
            indexed.push((at, input));
        }
    }
    // Stable: a file's lines keep their order at its place.
    indexed.sort_by_key(|(pos, _)| *pos);
    Ok(indexed.into_iter().map(|(_, p)| p).collect())
}

fn parse_prompt_line(line: &str) -> Result<PromptInput> {
    let trimmed = line.trim_start();
    if !trimmed.starts_with('{') && !trimmed.starts_with('"') {
        return Ok(PromptInput::Raw(line.to_string()));
    }
    let input = match serde_json::from_str::<serde_json::Value>(line)? {
        serde_json::Value::String(s) => PromptInput::Raw(s),
        serde_json::Value::Object(o) => {
            // One prompt a line; generation options are the command's flags.
            if let Some(other) = o.keys().find(|k| !matches!(k.as_str(), "prompt" | "chat")) {
                bail!("unknown field {other:?}: a line holds a \"prompt\" or a \"chat\" (options such as --max-tokens are flags)")
            }
            match (o.get("prompt"), o.get("chat")) {
                (Some(serde_json::Value::String(p)), None) => PromptInput::Raw(p.clone()),
                (None, Some(serde_json::Value::String(c))) if c.is_empty() => {
                    bail!("the prompt is empty")
                }
                (None, Some(serde_json::Value::String(c))) => {
                    PromptInput::Chat(vec![ChatMessage::new("user", c)])
                }
                // A conversation, as a request's `messages`.
                (None, Some(messages @ serde_json::Value::Array(_))) => PromptInput::Chat(
                    lantern_engine::validate::chat_messages(messages)
                        .map_err(|e| anyhow::anyhow!("{e}"))?,
                ),
                (Some(_), Some(_)) => bail!("give \"prompt\" or \"chat\", not both"),
                _ => bail!(
                    "expected a \"prompt\" string, or a \"chat\" string (a user message) or list of messages"
                ),
            }
        }
        _ => bail!("expected text, a JSON string or an object"),
    };
    match &input {
        PromptInput::Raw(s) if s.is_empty() => bail!("the prompt is empty"),
        _ => Ok(input),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lines_parse() {
        assert!(matches!(parse_prompt_line("hello"), Ok(PromptInput::Raw(s)) if s == "hello"));
        assert!(
            matches!(parse_prompt_line(r#"{"chat": "hi\nthere"}"#), Ok(PromptInput::Chat(m)) if m[0].content == "hi\nthere")
        );
        let conversation = r#"{"chat": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}"#;
        assert!(
            matches!(parse_prompt_line(conversation), Ok(PromptInput::Chat(m)) if m.len() == 2 && m[0].role == "system")
        );
        assert!(matches!(parse_prompt_line(r#""a\tb""#), Ok(PromptInput::Raw(s)) if s == "a\tb"));
        for bad in [
            r#"{"nope": 1}"#,
            r#"{"prompt": "a", "chat": "b"}"#,
            r#"{"prompt": "a", "max_tokens": 1}"#,
            r#"{"prompt": ""}"#,
            r#"{"chat": 3}"#,
            r#"{"chat": ""}"#,
            r#"{"chat": []}"#,
            r#"{"chat": [{"role": "wizard", "content": "x"}]}"#,
            "\"\"",
        ] {
            assert!(parse_prompt_line(bad).is_err(), "{bad}");
        }
    }
}
