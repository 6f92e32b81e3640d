//! A conversation to token ids: rendered through the chat template within its limits,
//! then tokenized so that only the template's own markup becomes control tokens.

use crate::chat::{tool_strings, ChatMessage, ChatRenderOptions, ChatTemplate, TemplateError};
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
    let template = template.ok_or(ChatPromptError::NoTemplate)?;
    let rendered = template.render_parts_with(messages, options, max_output_bytes)?;
    let tool_strings = tool_strings(messages, options);
    // Keys are never split out; the other strings are when there is a split.
    let split = rendered.segments.is_some();
    if tool_strings
        .iter()
        .any(|&(s, key)| (key || !split) && tokenizer.contains_control_text(s))
    {
        return Err(ChatPromptError::ControlTextInTools);
    }
    Ok(match rendered.segments {
        Some(segments) => tokenizer.encode_chat(&segments, add_special_tokens)?,
        None => {
            if let Some(index) = messages
                .iter()
                .position(|m| tokenizer.contains_control_text(&m.content))
            {
                return Err(ChatPromptError::ControlTextInContent { index });
            }
            tokenizer.encode(&rendered.text, add_special_tokens)?
        }
    })
}
