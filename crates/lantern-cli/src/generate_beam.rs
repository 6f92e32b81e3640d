//! `lantern generate --beam-width N`: the server's beam search over the command line's
//! prompts. Each prompt becomes the body the server would take (`use_beam_search`, `n`
//! beams), validated by the same code and run by the engine's own search
//! (`EngineHandle::beam_search`), so that the beams are the server's.

use crate::args::EngineArgs;
use anyhow::{anyhow, Context, Result};
use lantern_engine::serving::{EngineEvent, EngineHandle, EngineLogging, PromptInput};
use lantern_engine::validate::{
    generation_request, CaptureSettings, Endpoint, ModelLimits, RequestContext,
};
use lantern_model::ChatMessage;
use serde_json::{json, Value};
use std::io::Write;

/// A prompt as the command line gave it.
pub enum BeamPrompt {
    Text(String),
    Chat(Vec<ChatMessage>),
}

/// How the search runs: the command's flags.
pub struct BeamOptions {
    pub width: usize,
    pub length_penalty: f32,
    pub max_tokens: usize,
    pub ignore_eos: bool,
    pub json: bool,
}

/// One beam of a prompt, as the engine's events gave it.
#[derive(Default, Clone)]
struct Beam {
    token_ids: Vec<u32>,
    text: String,
    cumulative_logprob: f64,
    finish_reason: &'static str,
}

pub fn run(
    engine_args: &EngineArgs,
    verbose: bool,
    prompts: Vec<BeamPrompt>,
    options: &BeamOptions,
) -> Result<()> {
    let engine_args = engine_args.clone();
    let (handle, thread) = EngineHandle::start_logging(
        move || engine_args.build_engine(verbose),
        EngineLogging {
            requests: verbose,
            stats_interval: None,
        },
    )?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let result = runtime.block_on(search_all(&handle, prompts, options));
    handle.shutdown();
    thread.join();
    let results = result?;
    let mut stdout = std::io::stdout().lock();
    for (index, (prompt_ids, beams)) in results.iter().enumerate() {
        if options.json {
            let best = &beams[0];
            let beams_json: Vec<Value> = beams
                .iter()
                .map(|b| {
                    json!({
                        "token_ids": b.token_ids,
                        "text": b.text,
                        "finish_reason": b.finish_reason,
                        "cumulative_logprob": b.cumulative_logprob,
                    })
                })
                .collect();
            let line = json!({
                "index": index,
                "prompt_token_ids": prompt_ids,
                "token_ids": best.token_ids,
                "text": best.text,
                "finish_reason": best.finish_reason,
                "beams": beams_json,
                "model": handle.meta().name,
            });
            writeln!(stdout, "{line}")?;
        } else {
            writeln!(stdout, "=== prompt {} ===", index + 1)?;
            for (rank, b) in beams.iter().enumerate() {
                writeln!(
                    stdout,
                    "--- beam {} (logprob {:.3}, {}) ---\n{}\n",
                    rank + 1,
                    b.cumulative_logprob,
                    b.finish_reason,
                    b.text
                )?;
            }
        }
    }
    Ok(())
}

/// Every prompt's beams, best first, with its prompt's token ids.
async fn search_all(
    handle: &EngineHandle,
    prompts: Vec<BeamPrompt>,
    options: &BeamOptions,
) -> Result<Vec<(Vec<u32>, Vec<Beam>)>> {
    let mut results = Vec::with_capacity(prompts.len());
    let mut searches = Vec::with_capacity(prompts.len());
    // Submitted together: the engine batches the prompts' steps.
    for (i, prompt) in prompts.into_iter().enumerate() {
        let (endpoint, body) = body(prompt, options);
        let capture = CaptureSettings::default();
        let limits = ModelLimits {
            served_name: "",
            aliases: &[],
        };
        let context = RequestContext::new(limits, &capture, handle.meta());
        let request = generation_request(endpoint, &body, &context)
            .map_err(|e| anyhow!("prompt {}: {e}", i + 1))?;
        let search = request
            .beam_search
            .context("a beam search request without its search")?;
        // Tokenized once: the items run on these ids (they already hold any BOS).
        let prompt_ids = handle
            .prompter()
            .tokenize(
                (*request.items[0].prompt).clone(),
                true,
                request.items[0].prompt_field,
            )
            .await
            .map_err(|e| anyhow!("prompt {}: {e}", i + 1))?;
        let tokens = std::sync::Arc::new(PromptInput::Tokens(prompt_ids.clone()));
        let mut items = request.items;
        for item in &mut items {
            item.prompt = tokens.clone();
        }
        let (_, events) = handle
            .beam_search(items, search)
            .await
            .map_err(|e| anyhow!("prompt {}: {e}", i + 1))?;
        searches.push((prompt_ids, events));
    }
    for (prompt_ids, events) in searches {
        results.push((prompt_ids, collect(handle, events, options.width).await?));
    }
    Ok(results)
}

/// The body the server would take for one prompt's search.
fn body(prompt: BeamPrompt, options: &BeamOptions) -> (Endpoint, Value) {
    let mut body = json!({
        "use_beam_search": true,
        "n": options.width,
        "length_penalty": options.length_penalty,
        "max_tokens": options.max_tokens,
        "ignore_eos": options.ignore_eos,
    });
    let endpoint = match prompt {
        BeamPrompt::Text(text) => {
            body["prompt"] = json!(text);
            body["logprobs"] = json!(0);
            Endpoint::Completion
        }
        BeamPrompt::Chat(messages) => {
            body["messages"] = json!(messages);
            body["logprobs"] = json!(true);
            Endpoint::Chat
        }
    };
    (endpoint, body)
}

/// Reads one search's events to their ends.
async fn collect(
    handle: &EngineHandle,
    mut events: tokio::sync::mpsc::UnboundedReceiver<EngineEvent>,
    width: usize,
) -> Result<Vec<Beam>> {
    let mut beams = vec![Beam::default(); width];
    let mut open = width;
    while open > 0 {
        let event = events
            .recv()
            .await
            .context("the engine stopped before the search ended")?;
        let beam = beams.get_mut(event.index).context("an event for no beam")?;
        let event = handle.prompter().resolve(event).await?;
        beam.token_ids.extend(&event.token_ids);
        beam.text.push_str(&event.text);
        beam.cumulative_logprob += event
            .logprobs
            .iter()
            .map(|l| f64::from(l.logprob))
            .sum::<f64>();
        if let Some(finish) = event.finish {
            if let lantern_engine::serving::EndReason::Failed(failure) = &finish.reason {
                return Err(anyhow!("the search failed: {failure:?}"));
            }
            beam.finish_reason = finish.reason.as_str();
            open -= 1;
        }
    }
    Ok(beams)
}
