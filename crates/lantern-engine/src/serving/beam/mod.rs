//! Beam search on the engine, the way vLLM runs it: each step is one request per live
//! beam, its prompt the beam's tokens, generating one token and returning the beam's
//! `2 × width` most likely next tokens as logprobs. The prefix cache gives each step its
//! beam's full blocks back, and a step's requests keep their partial last block for the
//! next step's beam that continues them (`SamplingParams::keep_tail`), so a beam computes
//! only its new token (a second child of one parent computes the partial block again).
//! The search runs on a task of its own; its sequences reach the front end as ordinary
//! [`EngineEvent`]s once a prompt's search is over.

mod search;

pub use search::{Beam, BeamGroup, BeamRules, BeamSearch, BeamToken, EarlyStopping, StepText};

use super::events::{EndReason, EngineEvent, EngineFailure, Finish};
use super::generation::{Accepted, GenerationItem, Origin, PromptInput};
use super::handle::EngineHandle;
use super::prompter::PromptLogprobRows;
use super::ServeError;
use crate::validate::InvalidRequest;
use lantern_kv::RequestId;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// The search of one prompt and what its choices report.
struct Group {
    beams: BeamGroup,
    prompt: Arc<[u32]>,
    /// The request's item: each step's requests are made from it.
    template: GenerationItem,
    /// The index of its first choice among the response's.
    first_choice: usize,
    /// Prompt tokens the first step found in the prefix cache.
    cached_tokens: usize,
    prompt_logprobs: Option<PromptLogprobRows>,
    /// Its sequences have been sent.
    sent: bool,
    started: Instant,
    /// Steps taken so far.
    steps: usize,
    /// Whether the request log has a line for it.
    log: bool,
}

impl Group {
    /// The request for one step of a beam: its tokens so far, one token to generate,
    /// with its most likely alternatives.
    fn step_item(&self, beam_ids: &[u32], first: bool) -> GenerationItem {
        let t = &self.template;
        let alternatives = self
            .beams
            .search
            .alternatives_per_beam()
            .max(self.beams.rules.logprobs.unwrap_or(0));
        let prompt_logprobs = t.prompt_logprobs.filter(|_| first);
        let params = crate::SamplingParams {
            max_tokens: 1,
            logprobs: Some(alternatives),
            prompt_logprobs,
            // What moves the logprobs (and so the beams) goes with every step.
            logit_bias: t.params.logit_bias.clone(),
            repetition_penalty: t.params.repetition_penalty,
            skip_special_tokens: t.params.skip_special_tokens,
            cache_salt: t.params.cache_salt.clone(),
            // The next step's beams continue this one's tokens (none follow the last).
            keep_tail: beam_ids.len() + 1 < self.beams.rules.max_tokens,
            ..crate::SamplingParams::greedy(1)
        };
        let mut prompt = Vec::with_capacity(self.prompt.len() + beam_ids.len());
        prompt.extend_from_slice(&self.prompt);
        prompt.extend_from_slice(beam_ids);
        GenerationItem {
            prompt: Arc::new(PromptInput::Tokens(prompt)),
            params,
            max_tokens: Some(1),
            max_tokens_defaulted: false,
            max_tokens_field: t.max_tokens_field,
            stop: Arc::from([]),
            include_stop_str_in_output: false,
            add_special_tokens: false,
            bad_words: Arc::from([]),
            echo: false,
            prompt_field: t.prompt_field,
            capture: None,
            prompt_logprobs,
            constraint: None,
            reasoning: None,
            begins_thinking: false,
            request_id: t.request_id.clone(),
            origin: if first {
                Origin::BeamStart {
                    width: self.beams.search.width,
                }
            } else {
                Origin::BeamStep
            },
            truncate_prompt: None,
        }
    }

    fn finish(&self, reason: EndReason, completion_tokens: usize) -> Finish {
        Finish {
            reason,
            stop_reason: None,
            prompt_tokens: self.prompt.len(),
            completion_tokens,
            cached_tokens: self.cached_tokens,
            capture: None,
        }
    }

    /// Sends the search's answer: choice `r` is the `r`-th best sequence.
    fn send(&mut self, events: &UnboundedSender<EngineEvent>) {
        let width = self.beams.search.width;
        let beams = self.beams.finish();
        let Some(best) = beams.first() else {
            return self.fail(EndReason::Length, events);
        };
        self.sent = true;
        self.log_end(&format!(
            "{width} beams, best generated {} tokens",
            best.tokens.len()
        ));
        for r in 0..width {
            let index = self.first_choice + r;
            // Fewer sequences than beams only when the vocabulary had fewer tokens to
            // offer: the last choices repeat the last one found.
            let beam = beams.get(r).unwrap_or(&beams[beams.len() - 1]);
            let (reason, stop_reason) = beam.end.clone().unwrap_or((EndReason::Length, None));
            let count = beam.tokens.len();
            for (j, token) in beam.tokens.iter().enumerate() {
                let finish = (j + 1 == count).then(|| Finish {
                    stop_reason: stop_reason.clone(),
                    ..self.finish(reason.clone(), count)
                });
                let _ = events.send(EngineEvent {
                    index,
                    text: token.text.to_string(),
                    token_ids: vec![token.id],
                    logprobs: token.logprobs.as_deref().cloned(),
                    prompt_logprobs: if j == 0 {
                        self.prompt_logprobs.clone()
                    } else {
                        None
                    },
                    capture_row: None,
                    finish,
                });
            }
        }
    }

    /// The request log's line for the search's end (`outcome`: how it ended).
    fn log_end(&self, outcome: &str) {
        if !self.log {
            return;
        }
        tracing::info!(
            target: "lantern::requests",
            "finished beam search {} choices {}..{}: {outcome}, {} steps, prompt {} tokens ({} cached), total {:.3} s",
            self.template.request_id.as_deref().unwrap_or("-"),
            self.first_choice,
            self.first_choice + self.beams.search.width,
            self.steps,
            self.prompt.len(),
            self.cached_tokens,
            self.started.elapsed().as_secs_f64(),
        );
    }

    /// Ends every choice of the group with `reason` and no output.
    fn fail(&mut self, reason: EndReason, events: &UnboundedSender<EngineEvent>) {
        self.sent = true;
        self.log_end(&format!("{} ({reason:?})", reason.as_str()));
        for r in 0..self.beams.search.width {
            let _ = events.send(EngineEvent {
                index: self.first_choice + r,
                text: String::new(),
                token_ids: Vec::new(),
                logprobs: None,
                prompt_logprobs: None,
                capture_row: None,
                finish: Some(self.finish(reason.clone(), 0)),
            });
        }
    }
}

/// The requests of one step in flight: which group's which beam each one extends.
struct Step {
    ids: Vec<RequestId>,
    owners: Vec<(usize, usize)>,
    events: UnboundedReceiver<EngineEvent>,
}

/// What one step request gave back.
#[derive(Default, Clone)]
struct StepResult {
    alternatives: Vec<(u32, f32)>,
    cached_tokens: usize,
    prompt_logprobs: Option<PromptLogprobRows>,
    /// How it ended, when not with its token.
    failed: Option<EndReason>,
    finished: bool,
}

impl EngineHandle {
    /// Runs a beam search for each prompt of `items` (`search.width` consecutive items
    /// per prompt, as `n` samples are) and returns what [`Self::add`] returns: the
    /// requests taken and a channel of their events, each choice one sequence, best
    /// first. The prompts and settings are checked, and the first step taken, before
    /// this returns: a request the engine refuses is an error here.
    pub async fn beam_search(
        &self,
        items: Vec<GenerationItem>,
        search: BeamSearch,
    ) -> Result<(Vec<Accepted>, UnboundedReceiver<EngineEvent>), ServeError> {
        if search.width == 0 || items.is_empty() || !items.len().is_multiple_of(search.width) {
            return Err(ServeError::Internal(format!(
                "a beam search of width {} was given {} sequences",
                search.width,
                items.len()
            )));
        }
        let prepared = self.prompter().prepare(items).await?;
        let meta = self.meta();
        let model_stops = self.prompter().tokenizer().stop_ids().to_vec();
        let mut groups: Vec<Group> = Vec::new();
        let mut accepted: Vec<Accepted> = Vec::with_capacity(prepared.len());
        for (i, p) in prepared.into_iter().enumerate() {
            accepted.push(Accepted {
                id: 0,
                prompt_tokens: p.prompt_ids.len(),
                prompt_text: p.echo_text.clone(),
                thinking: p.item.reasoning.is_some() && p.item.begins_thinking,
            });
            if i % search.width != 0 {
                continue;
            }
            let item = p.item;
            let prompt_tokens = p.prompt_ids.len();
            let max_tokens =
                item.settled_max_tokens(prompt_tokens, meta.context_length, meta.longest_sequence)?;
            let params = &item.params;
            if params.min_tokens > max_tokens {
                return Err(InvalidRequest::conflict(
                    "min_tokens",
                    format!(
                        "min_tokens is {}, but at most {max_tokens} tokens can be generated for this prompt",
                        params.min_tokens
                    ),
                )
                .into());
            }
            let mut stop_ids: Vec<u32> = params.stop_token_ids.to_vec();
            if !params.ignore_eos {
                stop_ids.extend(&model_stops);
            }
            let rules = BeamRules {
                prompt_tokens,
                max_tokens,
                min_tokens: params.min_tokens,
                stop_ids,
                stop_token_ids: params.stop_token_ids.clone(),
                stop: item.stop.clone(),
                include_stop: item.include_stop_str_in_output,
                skip_special_tokens: params.skip_special_tokens,
                logprobs: params.logprobs,
            };
            groups.push(Group {
                beams: BeamGroup::new(search, rules),
                prompt: p.prompt_ids,
                template: item,
                first_choice: i,
                cached_tokens: 0,
                prompt_logprobs: None,
                sent: false,
                started: Instant::now(),
                steps: 0,
                log: self.logs_requests(),
            });
        }
        let step = self.next_step(&groups, true).await?;
        for (a, i) in accepted.iter_mut().zip(0..) {
            a.id = step.ids[i / search.width];
        }
        let (events, rx) = unbounded_channel();
        let handle = self.clone();
        let running = self.beam_search_running();
        tokio::spawn(async move {
            handle.drive(groups, step, events).await;
            drop(running);
        });
        Ok((accepted, rx))
    }

    /// Submits one request per live beam of every group still searching.
    async fn next_step(&self, groups: &[Group], first: bool) -> Result<Step, ServeError> {
        let mut items = Vec::new();
        let mut owners = Vec::new();
        for (g, group) in groups.iter().enumerate().filter(|(_, g)| !g.sent) {
            for (b, beam) in group.beams.live().iter().enumerate() {
                items.push(group.step_item(&beam.ids, first));
                owners.push((g, b));
            }
        }
        let (accepted, events) = self.add(items).await?;
        Ok(Step {
            ids: accepted.iter().map(|a| a.id).collect(),
            owners,
            events,
        })
    }

    /// Steps every group to its end, sending each group's sequences as it ends. Stops
    /// (aborting the step in flight) when the front end stops listening.
    async fn drive(
        &self,
        mut groups: Vec<Group>,
        mut step: Step,
        events: UnboundedSender<EngineEvent>,
    ) {
        let mut first = true;
        loop {
            let Some(results) = self.wait_for(&mut step, &events).await else {
                return;
            };
            let mut alternatives: Vec<Vec<Vec<(u32, f32)>>> = vec![Vec::new(); groups.len()];
            let mut failed: Vec<Option<EndReason>> = vec![None; groups.len()];
            for (&(g, _), result) in step.owners.iter().zip(results) {
                if first {
                    groups[g].cached_tokens = result.cached_tokens;
                    groups[g].prompt_logprobs = result.prompt_logprobs;
                }
                if let Some(reason) = result.failed {
                    failed[g].get_or_insert(reason);
                }
                alternatives[g].push(result.alternatives);
            }
            let tokenizer = self.prompter().tokenizer();
            for (g, group) in groups.iter_mut().enumerate().filter(|(_, g)| !g.sent) {
                if let Some(reason) = failed[g].take() {
                    group.fail(reason, &events);
                    continue;
                }
                if let Err(e) = group.beams.advance(&alternatives[g], tokenizer) {
                    group.fail(EndReason::Failed(EngineFailure::Step(e)), &events);
                    continue;
                }
                group.steps += 1;
                if group.beams.is_done() {
                    group.send(&events);
                }
            }
            first = false;
            if groups.iter().all(|g| g.sent) || events.is_closed() {
                return;
            }
            step = match self.next_step(&groups, false).await {
                Ok(step) => step,
                Err(e) => {
                    let reason = EndReason::Failed(EngineFailure::Step(e.to_string()));
                    for group in groups.iter_mut().filter(|g| !g.sent) {
                        group.fail(reason.clone(), &events);
                    }
                    return;
                }
            };
        }
    }

    /// Waits for every request of `step` to end; `None` when the front end stopped
    /// listening (the step is aborted).
    async fn wait_for(
        &self,
        step: &mut Step,
        listener: &UnboundedSender<EngineEvent>,
    ) -> Option<Vec<StepResult>> {
        let mut results = vec![StepResult::default(); step.ids.len()];
        while results.iter().any(|r| !r.finished) {
            let event = tokio::select! {
                event = step.events.recv() => event,
                _ = listener.closed() => {
                    self.abort(step.ids.clone());
                    return None;
                }
            };
            let Some(event) = event else {
                // The engine went away with the step unfinished.
                for r in results.iter_mut().filter(|r| !r.finished) {
                    r.finished = true;
                    r.failed = Some(EndReason::Failed(EngineFailure::Step(
                        self.gone().to_string(),
                    )));
                }
                break;
            };
            let Some(result) = results.get_mut(event.index) else {
                continue;
            };
            if let Some(logprobs) = event.logprobs {
                result.alternatives = logprobs.top;
            }
            if event.prompt_logprobs.is_some() {
                result.prompt_logprobs = event.prompt_logprobs;
            }
            if let Some(finish) = event.finish {
                result.finished = true;
                result.cached_tokens = finish.cached_tokens;
                if matches!(finish.reason, EndReason::Failed(_) | EndReason::Abort) {
                    result.failed = Some(finish.reason);
                }
            }
        }
        Some(results)
    }
}
