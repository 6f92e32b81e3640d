//! Prompts and outputs as text, handled on a bounded blocking pool and never on the
//! engine thread: chat rendering, tokenization, detokenization and logprob tables.
//!
//! Length checks come before the expensive work: a text prompt longer than the context
//! could hold even at the vocabulary's longest token is refused without tokenizing it,
//! and the chat template's output is cut off at the same bound. A template also runs on
//! a fuel budget (see `lantern_model::chat`) and within a time limit; past either the
//! request gets a 400 naming the chat template.

use crate::serving::ServeError;
use crate::serving::{
    ChoiceEvent, EngineEvent, GenerationItem, LogprobEntry, PromptInput, PromptLogprobEntry,
};
use crate::token_filter::bad_word_sequences;
use crate::validate::InvalidRequest;
use crate::{PromptTokenLogprob, SamplingParams, TokenLogprobs};
use lantern_capture::{resolve_spans, CaptureError, CaptureSpec, PromptText, SpanAt};
use lantern_model::prompt::{locate_messages, tokenize_chat_rendered, ChatPromptError};
use lantern_model::{ChatRenderOptions, ChatTemplate, ModelTokenizer};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;

/// A request's `bad_words` and their token sequences, tokenized once for its samples.
type TokenizedWords = Option<(Arc<[String]>, Arc<[Arc<[u32]>]>)>;

/// Default time a prompt may take to prepare (render and tokenize).
pub const DEFAULT_PREPARE_TIMEOUT: Duration = Duration::from_secs(10);

/// One sequence ready for the engine: its prompt as token ids.
#[derive(Debug)]
pub struct PreparedItem {
    /// The item, its prompt moved out.
    pub item: GenerationItem,
    /// Shared by the samples of one prompt.
    pub prompt_ids: Arc<[u32]>,
    /// The prompt's text, when the item asked for `echo`.
    pub echo_text: Option<Arc<str>>,
}

/// The text a prompt's tokens spell, for capture spans named by characters or messages.
struct PromptSource {
    /// The prompt text (for chat, as the template rendered it).
    text: String,
    /// Chat: each message's content as bytes of `text` (`None`: not found as it is).
    messages: Option<Vec<Option<std::ops::Range<usize>>>>,
}

/// The prompt logprobs of one sequence as the engine reduced them, to turn into text.
#[derive(Debug, Clone)]
pub struct PromptLogprobRows {
    /// Entry `i` for prompt token `i + 1` (nothing predicts the first).
    pub rows: Vec<PromptTokenLogprob>,
    pub prompt: Arc<[u32]>,
    /// Alternatives per token.
    pub top: usize,
}

/// Tokenizer, chat template and the limits on their work, shared by request tasks.
#[derive(Clone)]
pub struct Prompter {
    tokenizer: Arc<ModelTokenizer>,
    template: Option<Arc<ChatTemplate>>,
    vocab_size: usize,
    context_length: usize,
    /// Bytes of the vocabulary's longest token: no token covers more text.
    max_token_bytes: usize,
    /// Work running on the blocking pool at once.
    permits: Arc<Semaphore>,
    timeout: Duration,
}

impl Prompter {
    pub fn new(
        tokenizer: Arc<ModelTokenizer>,
        template: Option<Arc<ChatTemplate>>,
        vocab_size: usize,
        context_length: usize,
    ) -> Self {
        let workers = std::thread::available_parallelism().map_or(2, |n| n.get());
        Self {
            max_token_bytes: tokenizer.longest_token_bytes().max(1),
            tokenizer,
            template,
            vocab_size,
            context_length,
            permits: Arc::new(Semaphore::new(workers)),
            timeout: DEFAULT_PREPARE_TIMEOUT,
        }
    }

    /// The same, with another time limit on preparing one request's prompts.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn tokenizer(&self) -> &ModelTokenizer {
        &self.tokenizer
    }

    /// The chat template chat requests are rendered with, if the model has one.
    pub fn template(&self) -> Option<&ChatTemplate> {
        self.template.as_deref()
    }

    /// Most bytes of text that could still fit the context.
    fn max_prompt_bytes(&self) -> usize {
        self.context_length
            .saturating_sub(1)
            .saturating_mul(self.max_token_bytes)
    }

    /// Runs `work` on the blocking pool, at most one per core at once, within the time
    /// limit. The permit goes with the work: work that outlives its time limit still
    /// counts until it ends (the template's fuel ends it).
    async fn blocking<T: Send + 'static>(
        &self,
        field: &'static str,
        work: impl FnOnce() -> Result<T, ServeError> + Send + 'static,
    ) -> Result<T, ServeError> {
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| ServeError::Unavailable)?;
        let task = tokio::task::spawn_blocking(move || {
            let result = work();
            drop(permit);
            result
        });
        match tokio::time::timeout(self.timeout, task).await {
            Ok(Ok(result)) => result,
            Ok(Err(join)) => Err(ServeError::Internal(format!(
                "preparing the prompt failed: {join}"
            ))),
            Err(_) => Err(InvalidRequest::invalid(
                field,
                format!(
                    "the prompt was not ready within {} s (the model's chat template or the tokenizer ran too long)",
                    self.timeout.as_secs_f64()
                ),
            )
            .into()),
        }
    }

    /// Token ids of a prompt, rendered (chat) and tokenized on the blocking pool.
    pub async fn tokenize(
        &self,
        prompt: PromptInput,
        add_special_tokens: bool,
        field: &'static str,
    ) -> Result<Vec<u32>, ServeError> {
        let this = self.clone();
        self.blocking(field, move || {
            Ok(this.tokenize_now(&prompt, add_special_tokens, field)?)
        })
        .await
    }

    /// The text of token ids (special tokens included).
    pub async fn detokenize(&self, tokens: Vec<u32>) -> Result<String, ServeError> {
        let this = self.clone();
        self.blocking("tokens", move || {
            Ok(this
                .tokenizer
                .decode(&tokens, false)
                .map_err(|e| InvalidRequest::invalid("tokens", e.to_string()))?)
        })
        .await
    }

    /// Tokenizes and checks every item; samples of one prompt are tokenized once.
    pub async fn prepare(
        &self,
        items: Vec<GenerationItem>,
    ) -> Result<Vec<PreparedItem>, ServeError> {
        let field = items.first().map_or("prompt", |i| i.prompt_field);
        let this = self.clone();
        self.blocking(field, move || {
            let mut prepared: Vec<PreparedItem> = Vec::with_capacity(items.len());
            type Done = (Arc<PromptInput>, Arc<[u32]>, Option<Arc<str>>);
            let mut last: Option<Done> = None;
            let mut bad_words = TokenizedWords::default();
            for mut item in items {
                this.check_token_ids(&item.params)?;
                this.prepare_token_filter(&mut item, &mut bad_words)?;
                let prompt = item.prompt.clone();
                let spans = item
                    .capture
                    .as_mut()
                    .map(|c| &mut c.spec)
                    .filter(|spec| !spec.spans.is_empty());
                let (ids, text) = match &last {
                    Some((p, ids, text))
                        if spans.is_none() && (Arc::ptr_eq(p, &prompt) || *p == prompt) =>
                    {
                        (ids.clone(), text.clone())
                    }
                    _ => {
                        let by_text = spans.as_ref().is_some_and(|spec| {
                            spec.spans
                                .iter()
                                .any(|s| !matches!(s.at, SpanAt::Tokens(_)))
                        });
                        let (mut ids, source) = this.tokenize_sourced(
                            &prompt,
                            item.add_special_tokens,
                            item.prompt_field,
                            by_text,
                        )?;
                        let cut = item.truncate_prompt.map_or(0, |t| {
                            t.cut(ids.len(), this.context_length, item.max_tokens)
                        });
                        ids.drain(..cut);
                        this.check_prompt(&ids, item.prompt_field, item.max_tokens)?;
                        if let Some(spec) = spans {
                            this.resolve_spans(spec, &ids, source.as_ref())?;
                        }
                        // A truncated prompt's text is that of the tokens kept.
                        let text: Option<Arc<str>> = match &*prompt {
                            PromptInput::Text(text) if cut == 0 => Some(text.as_str().into()),
                            _ if item.echo => Some(
                                this.tokenizer
                                    .decode(&ids, false)
                                    .map_err(|e| {
                                        InvalidRequest::invalid(item.prompt_field, e.to_string())
                                    })?
                                    .into(),
                            ),
                            _ => None,
                        };
                        let ids: Arc<[u32]> = ids.into();
                        last = Some((prompt, ids.clone(), text.clone()));
                        (ids, text)
                    }
                };
                if let Some(tags) = &item.reasoning {
                    item.begins_thinking = tags.parser.thinking_after(&this.prompt_end(&ids));
                }
                prepared.push(PreparedItem {
                    echo_text: text.filter(|_| item.echo),
                    item,
                    prompt_ids: ids,
                });
            }
            Ok(prepared)
        })
        .await
    }

    /// The text of a prompt's last tokens (special tokens written out): enough to see
    /// how a chat template ended it.
    fn prompt_end(&self, ids: &[u32]) -> String {
        const TAIL_TOKENS: usize = 16;
        let tail = &ids[ids.len().saturating_sub(TAIL_TOKENS)..];
        self.tokenizer.decode(tail, false).unwrap_or_default()
    }

    fn tokenize_now(
        &self,
        prompt: &PromptInput,
        add_special_tokens: bool,
        field: &'static str,
    ) -> Result<Vec<u32>, InvalidRequest> {
        self.tokenize_sourced(prompt, add_special_tokens, field, false)
            .map(|(ids, _)| ids)
    }

    /// Resolves a capture's spans to the prompt's tokens (characters through each
    /// token's bytes of `source`), before the request is admitted: its spans and the
    /// mapping are then part of the spec that admission counts.
    fn resolve_spans(
        &self,
        spec: &mut CaptureSpec,
        ids: &[u32],
        source: Option<&PromptSource>,
    ) -> Result<(), InvalidRequest> {
        const FIELD: &str = "attn_capture_spans";
        let by_text = spec
            .spans
            .iter()
            .any(|s| !matches!(s.at, SpanAt::Tokens(_)));
        let bytes = match source.filter(|_| by_text) {
            Some(source) => Some(self.tokenizer.token_byte_ranges(&source.text, ids).ok_or_else(|| {
                InvalidRequest::invalid(
                    FIELD,
                    "this model's tokenizer changes the text it tokenizes (its tokens do not spell the prompt), so characters cannot be mapped to tokens; name spans by \"tokens\"",
                )
            })?),
            None => None,
        };
        let text = source
            .zip(bytes.as_deref())
            .map(|(source, token_bytes)| PromptText {
                text: &source.text,
                token_bytes,
                messages: source.messages.as_deref(),
            });
        spec.span_text =
            resolve_spans(&mut spec.spans, ids.len(), text.as_ref()).map_err(|e| match e {
                CaptureError::InvalidField { field, message } => {
                    InvalidRequest::invalid(field, message)
                }
                other => InvalidRequest::invalid(FIELD, other.to_string()),
            })?;
        Ok(())
    }

    /// Token ids of a prompt and, when `with_source`, the text they spell (a chat's as
    /// rendered, with where each message's content is).
    fn tokenize_sourced(
        &self,
        prompt: &PromptInput,
        add_special_tokens: bool,
        field: &'static str,
        with_source: bool,
    ) -> Result<(Vec<u32>, Option<PromptSource>), InvalidRequest> {
        let limit = self.max_prompt_bytes();
        match prompt {
            PromptInput::Text(text) if text.len() > limit => Err(InvalidRequest::invalid(
                field,
                format!(
                    "the prompt has {} bytes; this model's context of {} tokens holds at most {limit} bytes of text",
                    text.len(),
                    self.context_length
                ),
            )),
            PromptInput::Text(text) => {
                let ids = self
                    .tokenizer
                    .encode(text, add_special_tokens)
                    .map_err(|e| {
                        InvalidRequest::invalid(field, format!("could not tokenize the prompt: {e}"))
                    })?;
                let source = with_source.then(|| PromptSource {
                    text: text.clone(),
                    messages: None,
                });
                Ok((ids, source))
            }
            PromptInput::Tokens(ids) => Ok((ids.clone(), None)),
            PromptInput::Chat(messages, options) => {
                let asked = messages.as_slice();
                let own_template = self.request_template(options)?;
                let template = own_template.as_ref().or(self.template.as_deref());
                let fitted = template.and_then(|t| {
                    crate::validate::tools::fit_template(t.tool_support(), messages, options)
                });
                let (messages, options) = match &fitted {
                    Some((m, o)) => (m.as_slice(), o),
                    None => (messages.as_slice(), options),
                };
                let (ids, rendered) = tokenize_chat_rendered(
                    template,
                    &self.tokenizer,
                    messages,
                    options,
                    add_special_tokens,
                    limit,
                )
                .map_err(|e| {
                    let own = own_template.is_some();
                    chat_error(field, e, self.context_length, own)
                })?;
                if ids.is_empty() && own_template.is_some() {
                    return Err(InvalidRequest::invalid(
                        "chat_template",
                        "the request's chat_template rendered an empty prompt",
                    ));
                }
                // Messages as the request numbered them (before any rewriting for tools).
                let source = with_source.then(|| PromptSource {
                    messages: Some(locate_messages(&rendered, asked)),
                    text: rendered.text,
                });
                Ok((ids, source))
            }
        }
    }

    /// A request's own `chat_template`, compiled (with the tokenizer's special tokens).
    fn request_template(
        &self,
        options: &ChatRenderOptions,
    ) -> Result<Option<ChatTemplate>, InvalidRequest> {
        let Some(source) = &options.template else {
            return Ok(None);
        };
        let bos = self.tokenizer.bos_token().unwrap_or("");
        let eos = self.tokenizer.eos_token().unwrap_or("");
        ChatTemplate::new(source, bos, eos).map(Some).map_err(|e| {
            InvalidRequest::invalid(
                "chat_template",
                format!("the chat_template does not compile: {e}"),
            )
        })
    }

    /// `logit_bias` and `stop_token_ids` name tokens of the vocabulary.
    fn check_token_ids(&self, params: &SamplingParams) -> Result<(), InvalidRequest> {
        let outside = |t: &u32| *t as usize >= self.vocab_size;
        let named = |field: &'static str, t: u32| {
            let size = self.vocab_size;
            let message =
                format!("{field} names token {t}, outside the vocabulary of {size} tokens");
            Err(InvalidRequest::invalid(field, message))
        };
        if let Some((t, _)) = params.logit_bias.iter().find(|(t, _)| outside(t)) {
            return named("logit_bias", *t);
        }
        if let Some(t) = params.stop_token_ids.iter().find(|t| outside(t)) {
            return named("stop_token_ids", *t);
        }
        Ok(())
    }

    /// `allowed_token_ids` names tokens of the vocabulary; `bad_words` are tokenized
    /// into the filter (vLLM's way, [`bad_word_sequences`]; once for the samples that
    /// share them, kept in `tokenized`); together they leave some token to sample.
    fn prepare_token_filter(
        &self,
        item: &mut GenerationItem,
        tokenized: &mut TokenizedWords,
    ) -> Result<(), InvalidRequest> {
        let filter = &item.params.token_filter;
        if let Some(t) = filter.allowed().find(|&t| t as usize >= self.vocab_size) {
            return Err(InvalidRequest::invalid(
                "allowed_token_ids",
                format!(
                    "allowed_token_ids names token {t}, outside the vocabulary of {} tokens",
                    self.vocab_size
                ),
            ));
        }
        if item.bad_words.is_empty() {
            return Ok(());
        }
        let words = match tokenized {
            Some((words, sequences)) if Arc::ptr_eq(words, &item.bad_words) => sequences.clone(),
            _ => {
                let encode = |word: &str| {
                    self.tokenizer
                        .encode(word, false)
                        .map_err(|e| format!("could not tokenize {word:?}: {e}"))
                };
                let sequences: Arc<[Arc<[u32]>]> = bad_word_sequences(&item.bad_words, encode)
                    .map_err(|e| InvalidRequest::invalid("bad_words", e))?
                    .into();
                *tokenized = Some((item.bad_words.clone(), sequences.clone()));
                sequences
            }
        };
        item.params.token_filter = filter.clone().with_bad_words(words);
        if item.params.token_filter.bans_every_allowed_token() {
            return Err(InvalidRequest::conflict(
                "bad_words",
                "bad_words ban every token of allowed_token_ids: nothing could be sampled",
            ));
        }
        Ok(())
    }

    /// The checks every prompt passes before the engine sees it.
    /// A prompt that generates nothing (`max_tokens: 0`, scoring) may fill the context.
    fn check_prompt(
        &self,
        ids: &[u32],
        field: &'static str,
        max_tokens: Option<usize>,
    ) -> Result<(), InvalidRequest> {
        if ids.is_empty() {
            return Err(InvalidRequest::invalid(field, "the prompt is empty"));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(InvalidRequest::invalid(
                field,
                format!(
                    "token id {bad} is outside the vocabulary of {} tokens",
                    self.vocab_size
                ),
            ));
        }
        // Unbounded (`None`) generates at least one token.
        let longest = crate::request::longest_prompt(self.context_length, max_tokens.unwrap_or(1));
        if ids.len() > longest {
            return Err(InvalidRequest::invalid(
                field,
                format!(
                    "the prompt has {} tokens; this model's context is {} tokens (the prompt must leave room for at least one generated token, unless max_tokens is 0)",
                    ids.len(),
                    self.context_length
                ),
            ));
        }
        Ok(())
    }

    /// An engine event with its logprobs as text (prompt logprobs on the blocking pool).
    pub async fn resolve(&self, event: EngineEvent) -> Result<ChoiceEvent, ServeError> {
        let prompt_logprobs = match event.prompt_logprobs {
            Some(rows) => Some(self.prompt_logprobs(rows).await?),
            None => None,
        };
        Ok(ChoiceEvent {
            index: event.index,
            text: event.text,
            token_ids: event.token_ids,
            logprobs: event
                .logprobs
                .iter()
                .map(|lp| self.logprob_entry(lp))
                .collect(),
            prompt_logprobs,
            capture_row: event.capture_row,
            finish: event.finish,
        })
    }

    /// Token texts of one generated token's logprobs.
    pub fn logprob_entry(&self, lp: &TokenLogprobs) -> LogprobEntry {
        let text = |t: u32| self.tokenizer.token_text(t);
        LogprobEntry {
            token_id: lp.token_id,
            token: text(lp.token_id),
            logprob: lp.logprob,
            top: lp.top.iter().map(|&(t, l)| (t, text(t), l)).collect(),
        }
    }

    /// Prompt logprobs with their tokens as text, on the blocking pool.
    pub async fn prompt_logprobs(
        &self,
        rows: PromptLogprobRows,
    ) -> Result<Vec<PromptLogprobEntry>, ServeError> {
        let this = self.clone();
        self.blocking("prompt_logprobs", move || {
            Ok(prompt_logprob_entries(
                &this.tokenizer,
                &rows.prompt,
                &rows.rows,
                rows.top,
            ))
        })
        .await
    }
}

/// A chat prompt's failure as the request's error: on `field` (the messages), or on
/// `chat_template` when the request's own template (`own_template`) failed.
fn chat_error(
    field: &'static str,
    e: ChatPromptError,
    context_length: usize,
    own_template: bool,
) -> InvalidRequest {
    use lantern_model::chat::TemplateError;
    if own_template {
        if let ChatPromptError::Template(
            TemplateError::Broken(_)
            | TemplateError::Failed(_)
            | TemplateError::OutOfFuel
            | TemplateError::OutputTooLarge(_),
        ) = &e
        {
            let message = e
                .to_string()
                .replace("the model's chat template", "the request's chat_template");
            return InvalidRequest::invalid("chat_template", message);
        }
    }
    let message = match &e {
        ChatPromptError::Template(TemplateError::OutputTooLarge(limit)) => format!(
            "the prompt rendered by the model's chat template passed {limit} bytes, more than this model's context of {context_length} tokens can hold"
        ),
        ChatPromptError::Template(
            TemplateError::FinalMessageNotFound | TemplateError::FinalMessageEmpty,
        ) => {
            return InvalidRequest::invalid("continue_final_message", e.to_string())
        }
        ChatPromptError::ControlTextInTools => {
            return InvalidRequest::invalid("tools", e.to_string())
        }
        _ => e.to_string(),
    };
    InvalidRequest::invalid(field, message)
}

/// The prompt logprobs of `prompt` from the engine's rows (row `i` for token `i + 1`),
/// with at most `k` alternatives per token and every token as text.
fn prompt_logprob_entries(
    tokenizer: &ModelTokenizer,
    prompt: &[u32],
    rows: &[PromptTokenLogprob],
    k: usize,
) -> Vec<PromptLogprobEntry> {
    let text = |t: u32| tokenizer.token_text(t);
    prompt
        .iter()
        .enumerate()
        .map(|(i, &token_id)| {
            let row = i.checked_sub(1).and_then(|r| rows.get(r));
            PromptLogprobEntry {
                token_id,
                token: text(token_id),
                logprob: row.map(|r| r.logprob),
                rank: row.map_or(0, |r| r.rank),
                top: row.map_or_else(Vec::new, |r| {
                    r.top
                        .iter()
                        .take(k)
                        .map(|&(t, l)| (t, text(t), l))
                        .collect()
                }),
            }
        })
        .collect()
}
