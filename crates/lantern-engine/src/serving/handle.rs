//! The handle every front end drives: submit validated requests, read their events,
//! abort them, and ask for a view of the engine between two steps.

use super::engine_loop::EngineLoop;
use super::events::EngineEvent;
use super::generation::{Accepted, GenerationItem, PromptInput};
use super::health::{EngineBuildPanicked, EngineFaults};
use super::metrics::EngineStats;
use super::prompter::{PreparedItem, Prompter};
use super::request_log::EngineLogging;
use super::ServeError;
use crate::Engine;
use lantern_guided::GuidedVocab;
use lantern_kv::RequestId;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use tokio::sync::{mpsc as tmpsc, oneshot};

/// What the model is, as a front end needs to know it.
#[derive(Debug, Clone)]
pub struct ModelMeta {
    pub name: String,
    pub context_length: usize,
    pub vocab_size: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    /// The most tokens (prompt and output) the KV cache could ever hold for one
    /// sequence, at most the context.
    pub longest_sequence: usize,
    pub num_layers: usize,
    /// Query heads per layer (the smallest, if layers differ).
    pub num_heads: usize,
    /// Compiles structured-output grammars for this model's vocabulary (`Err`: why
    /// structured output is unavailable).
    pub guided: Result<GuidedVocab, String>,
    /// The sampling defaults the model recommends: a request that leaves one of these
    /// fields out gets it (vLLM's `--generation-config auto`).
    pub sampling_defaults: lantern_model::hf::generation_config::SamplingDefaults,
}

type AddReply = oneshot::Sender<Result<Vec<Accepted>, ServeError>>;

pub(super) enum Command {
    /// Sequences to add together: all are taken or none is.
    Add {
        items: Vec<PreparedItem>,
        events: tmpsc::UnboundedSender<EngineEvent>,
        reply: AddReply,
    },
    Abort(Vec<RequestId>),
    Stats(oneshot::Sender<EngineStats>),
    /// Abort everything and end the thread.
    Shutdown,
}

/// A cloneable handle on the engine thread, for a front end's request tasks.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    meta: Arc<ModelMeta>,
    prompter: Prompter,
    alive: Arc<AtomicBool>,
    busy: Arc<AtomicBool>,
    faults: Arc<EngineFaults>,
    /// Whether finished requests are logged (`EngineLogging::requests`).
    log_requests: bool,
    /// Beam searches in progress ([`Self::beam_search`]).
    beam_searches: Arc<AtomicUsize>,
}

/// A beam search counted as running while it lives.
pub(super) struct RunningSearch(Arc<AtomicUsize>);

impl Drop for RunningSearch {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The engine thread itself: join it after [`EngineHandle::shutdown`].
pub struct EngineThread {
    join: Option<JoinHandle<()>>,
}

impl EngineThread {
    /// Waits for the thread to end.
    pub fn join(mut self) {
        if let Some(join) = self.join.take() {
            let _ = join.join();
        }
    }
}

impl EngineHandle {
    /// Builds the engine on a new thread (so the engine never has to be `Send`) and starts
    /// its loop. Returns once the engine is built, or with the builder's error.
    /// A builder that panics (it should not: a bad model file is an error) is reported as
    /// [`EngineBuildPanicked`], never as a second panic here.
    pub fn start<F, E>(build: F) -> Result<(EngineHandle, EngineThread), E>
    where
        F: FnOnce() -> Result<Engine, E> + Send + 'static,
        E: From<EngineBuildPanicked> + Send + 'static,
    {
        Self::start_logging(build, EngineLogging::default())
    }

    /// [`Self::start`], writing the request log and stats lines `logging` asks for.
    pub fn start_logging<F, E>(
        build: F,
        logging: EngineLogging,
    ) -> Result<(EngineHandle, EngineThread), E>
    where
        F: FnOnce() -> Result<Engine, E> + Send + 'static,
        E: From<EngineBuildPanicked> + Send + 'static,
    {
        let log_requests = logging.requests;
        let (tx, rx) = mpsc::channel::<Command>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(ModelMeta, Prompter), E>>();
        let alive = Arc::new(AtomicBool::new(true));
        let alive_in_thread = alive.clone();
        let busy = Arc::new(AtomicBool::new(false));
        let busy_in_thread = busy.clone();
        let faults = Arc::new(EngineFaults::default());
        let faults_in_thread = faults.clone();
        let join = std::thread::Builder::new()
            .name("lantern-engine".to_string())
            .spawn(move || {
                let built = std::panic::catch_unwind(std::panic::AssertUnwindSafe(build))
                    .unwrap_or_else(|panic| Err(EngineBuildPanicked::from_payload(panic).into()));
                let engine = match built {
                    Ok(engine) => engine,
                    Err(e) => {
                        alive_in_thread.store(false, Ordering::SeqCst);
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let info = engine.model_info();
                let meta = ModelMeta {
                    name: info.name.clone(),
                    context_length: info.context_length,
                    vocab_size: info.vocab_size,
                    num_blocks: engine.kv_cache().num_blocks(),
                    block_size: engine.config().block_size,
                    longest_sequence: engine.kv_cache().longest_sequence(info.context_length),
                    num_layers: info.num_layers,
                    num_heads: info
                        .attention
                        .iter()
                        .map(|a| a.num_heads)
                        .min()
                        .unwrap_or(0),
                    guided: GuidedVocab::new(engine.tokenizer(), info.vocab_size)
                        .map_err(|e| e.to_string()),
                    sampling_defaults: engine.sampling_defaults().clone(),
                };
                let prompter = Prompter::new(
                    engine.shared_tokenizer(),
                    engine.shared_chat_template(),
                    info.vocab_size,
                    info.context_length,
                );
                let _ = ready_tx.send(Ok((meta, prompter)));
                EngineLoop::new(engine, rx, busy_in_thread, logging, faults_in_thread).run();
                alive_in_thread.store(false, Ordering::SeqCst);
            })
            .expect("spawning the engine thread");
        let thread = EngineThread { join: Some(join) };
        match ready_rx.recv() {
            Ok(Ok((meta, prompter))) => Ok((
                EngineHandle {
                    tx,
                    meta: Arc::new(meta),
                    prompter,
                    alive,
                    busy,
                    faults,
                    log_requests,
                    beam_searches: Arc::default(),
                },
                thread,
            )),
            Ok(Err(e)) => {
                thread.join();
                Err(e)
            }
            Err(_) => {
                // The thread ended without an answer (it cannot, short of an abort).
                thread.join();
                Err(EngineBuildPanicked("the engine thread ended without a result".into()).into())
            }
        }
    }

    pub fn meta(&self) -> &ModelMeta {
        &self.meta
    }

    /// Tokenizer and chat template, for work on request tasks.
    pub fn prompter(&self) -> &Prompter {
        &self.prompter
    }

    /// Set while the engine has requests to run (background work paces itself by it).
    pub fn busy_flag(&self) -> Arc<AtomicBool> {
        self.busy.clone()
    }

    /// Whether the engine thread is still running.
    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Whether finished requests are logged.
    pub(super) fn logs_requests(&self) -> bool {
        self.log_requests
    }

    /// Counts a beam search as running until the returned guard is dropped.
    pub(super) fn beam_search_running(&self) -> RunningSearch {
        self.beam_searches.fetch_add(1, Ordering::SeqCst);
        RunningSearch(self.beam_searches.clone())
    }

    /// Panics the engine thread contained (each one restarted the engine's state).
    pub fn faults(&self) -> &EngineFaults {
        &self.faults
    }

    /// Why the engine thread does not answer: it stopped after a fault, or the server
    /// is shutting down.
    pub fn gone(&self) -> ServeError {
        if self.faults.unrecoverable() {
            ServeError::Stopped
        } else {
            ServeError::Unavailable
        }
    }

    /// Prepares sequences (on a request task) and submits them; their events arrive on
    /// the returned receiver, tagged with their index in `items`.
    pub async fn add(
        &self,
        items: Vec<GenerationItem>,
    ) -> Result<(Vec<Accepted>, tmpsc::UnboundedReceiver<EngineEvent>), ServeError> {
        if !self.is_alive() {
            // Before tokenizing: a stopped engine answers at once.
            return Err(self.gone());
        }
        let items = self.prompter.prepare(items).await?;
        let (events, rx) = tmpsc::unbounded_channel();
        let (reply, reply_rx) = oneshot::channel();
        self.tx
            .send(Command::Add {
                items,
                events,
                reply,
            })
            .map_err(|_| self.gone())?;
        let accepted = reply_rx.await.map_err(|_| self.gone())??;
        Ok((accepted, rx))
    }

    /// Cancels requests (finished or unknown ids are ignored).
    pub fn abort(&self, ids: Vec<RequestId>) {
        if !ids.is_empty() {
            let _ = self.tx.send(Command::Abort(ids));
        }
    }

    /// A view of the engine taken between two steps.
    pub async fn stats(&self) -> Result<EngineStats, ServeError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Stats(reply))
            .map_err(|_| self.gone())?;
        let mut stats = rx.await.map_err(|_| self.gone())?;
        stats.beam_searches_running = self.beam_searches.load(Ordering::SeqCst);
        Ok(stats)
    }

    /// The token ids of a prompt, as a generation request would see them.
    pub async fn tokenize(
        &self,
        prompt: PromptInput,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, ServeError> {
        let field = match prompt {
            PromptInput::Chat(..) => "messages",
            _ => "prompt",
        };
        self.prompter
            .tokenize(prompt, add_special_tokens, field)
            .await
    }

    /// The text of token ids (special tokens included).
    pub async fn detokenize(&self, tokens: Vec<u32>) -> Result<String, ServeError> {
        self.prompter.detokenize(tokens).await
    }

    /// Asks the engine thread to abort every request and end.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_builder_that_panics_is_an_error_naming_the_panic() {
        let result = EngineHandle::start(|| -> Result<Engine, EngineBuildPanicked> {
            panic!("tensor table is nonsense")
        });
        match result {
            Err(e) => assert!(e.to_string().contains("tensor table is nonsense"), "{e}"),
            Ok(_) => panic!("a panicking builder started an engine"),
        }
    }
}
