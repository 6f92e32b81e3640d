//! A conversation to token ids: rendered through the chat template within its limits,
//! then tokenized so that only the template's own markup becomes control tokens.

use crate::chat::{
    tool_strings, ChatMessage, ChatRenderOptions, ChatSegment, ChatTemplate, RenderedChat,
    TemplateError,
};
use crate::error::ModelError;
use crate::tokenizer::ModelTokenizer;

/// What a chat request to a model without a chat template is told: how to give one.
pub const NO_CHAT_TEMPLATE: &str = "this model has no chat template: give one with --chat-template FILE (a Jinja template), or send a raw prompt (/v1/completions, `lantern generate --prompt`)";

/// Why a conversation could not become a prompt; every case is about the request's
/// `messages`.
#[derive(Debug, thiserror::Error)]
pub enum ChatPromptError {
    #[error("{}", NO_CHAT_TEMPLATE)]
    NoTemplate,
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error("messages[{index}] contains the text of a control token, which this model's chat template does not keep apart from its own markup")]
    ControlTextInContent { index: usize },
    #[error("the tools or the messages' tool calls contain the text of a control token where this model's chat template does not keep it apart from its own markup (object keys, or a template that transforms them)")]
    ControlTextInTools,
    #[error(transparent)]
    Tokenizer(#[from] ModelError),
}

/// Token ids of `messages` rendered through `template` (ready for the assistant's
/// turn), the rendering stopped past `max_output_bytes`. Contents are tokenized as text
/// (see [`ModelTokenizer::encode_chat`]); when the template transforms contents so that
/// they cannot be located, a content that spells a control token is refused.
pub fn tokenize_chat(
    template: Option<&ChatTemplate>,
    tokenizer: &ModelTokenizer,
    messages: &[ChatMessage],
    add_special_tokens: bool,
    max_output_bytes: usize,
) -> Result<Vec<u32>, ChatPromptError> {
    let options = ChatRenderOptions::default();
    tokenize_chat_with(
        template,
        tokenizer,
        messages,
        &options,
        add_special_tokens,
        max_output_bytes,
    )
}

/// [`tokenize_chat`] with the request's rendering options.
pub fn tokenize_chat_with(
    template: Option<&ChatTemplate>,
    tokenizer: &ModelTokenizer,
    messages: &[ChatMessage],
    options: &ChatRenderOptions,
    add_special_tokens: bool,
    max_output_bytes: usize,
) -> Result<Vec<u32>, ChatPromptError> {
    tokenize_chat_rendered(
        template,
        tokenizer,
        messages,
        options,
        add_special_tokens,
        max_output_bytes,
    )
    .map(|(ids, _)| ids)
}

/// [`tokenize_chat_with`], with the conversation as the template rendered it (the
/// text the ids spell, and where the contents are in it).
pub fn tokenize_chat_rendered(
    template: Option<&ChatTemplate>,
    tokenizer: &ModelTokenizer,
    messages: &[ChatMessage],
    options: &ChatRenderOptions,
    add_special_tokens: bool,
    max_output_bytes: usize,
) -> Result<(Vec<u32>, RenderedChat), ChatPromptError> {
    let template = template.ok_or(ChatPromptError::NoTemplate)?;
    let control = |s: &str| tokenizer.contains_control_text(s);
    let rendered = template.render_parts_keeping(messages, options, max_output_bytes, &control)?;
    let tool_strings = tool_strings(messages, options);
    // Keys are never split out; the other strings are when there is a split.
    let split = rendered.segments.is_some();
    if tool_strings
        .iter()
        .any(|&(s, key)| (key || !split) && tokenizer.contains_control_text(s))
    {
        return Err(ChatPromptError::ControlTextInTools);
    }
    let ids = match &rendered.segments {
        Some(segments) => tokenizer.encode_chat(segments, add_special_tokens)?,
        None => {
            if let Some(index) = messages.iter().position(|m| {
                tokenizer.contains_control_text(&m.content)
                    || m.reasoning
                        .as_deref()
                        .is_some_and(|r| tokenizer.contains_control_text(r))
            }) {
                return Err(ChatPromptError::ControlTextInContent { index });
            }
            tokenizer.encode(&rendered.text, add_special_tokens)?
        }
    };
    Ok((ids, rendered))
}

/// Where each message's content lies in a rendered conversation, as bytes of
/// `rendered.text`: found in order, each after the one before, among the contents the
/// template wrote as they are (or anywhere in the text when the template's split is not
/// known). `None` for a content not found as it is (a template that trims or changes
/// it); an empty content is an empty range.
pub fn locate_messages(
    rendered: &RenderedChat,
    messages: &[ChatMessage],
) -> Vec<Option<std::ops::Range<usize>>> {
    let mut at = 0;
    let contents: Option<Vec<(usize, &str)>> = rendered.segments.as_ref().map(|segments| {
        let mut offset = 0;
        segments
            .iter()
            .filter_map(|segment| {
                let (text, content) = match segment {
                    ChatSegment::Template(t) => (t, false),
                    ChatSegment::Content(c) => (c, true),
                };
                let start = offset;
                offset += text.len();
                content.then_some((start, text.as_str()))
            })
            .collect()
    });
    messages
        .iter()
        .map(|m| {
            if m.content.is_empty() {
                return Some(at..at);
            }
            let start = match &contents {
                Some(contents) => contents
                    .iter()
                    .find(|&&(start, text)| start >= at && text == m.content)
                    .map(|&(start, _)| start),
                None => rendered.text[at..].find(&m.content).map(|i| at + i),
            }?;
            at = start + m.content.len();
            Some(start..at)
        })
        .collect()
}
