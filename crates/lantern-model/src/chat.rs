//! Chat templates from the model file, rendered with minijinja.

use crate::error::{ModelError, Result};
use minijinja::{context, Environment, Error, ErrorKind};
use serde::Serialize;

/// One message of a conversation.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.to_string(),
            content: content.to_string(),
        }
    }
}

/// A compiled chat template and the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Why the model file's template cannot be used: every render fails with it.
    broken: Option<String>,
}

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        // Templates are written for Python's Jinja2: string methods, `raise_exception`.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        Ok(Self {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            broken: None,
        })
    }

    /// A model file's template: one that does not compile is kept as broken, so that chat
    /// requests fail with the reason while raw prompts still work.
    pub fn from_model_file(source: &str, bos_token: &str, eos_token: &str) -> Self {
        Self::new(source, bos_token, eos_token).unwrap_or_else(|e| Self::broken(e.to_string()))
    }

    /// A template that fails every render with `reason`.
    pub fn broken(reason: String) -> Self {
        Self {
            env: Environment::new(),
            bos_token: String::new(),
            eos_token: String::new(),
            broken: Some(reason),
        }
    }

    /// Why this template cannot render, if it cannot.
    pub fn problem(&self) -> Option<&str> {
        self.broken.as_deref()
    }

    /// The prompt for `messages`, ending with the assistant's turn when
    /// `add_generation_prompt` is set.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        if let Some(reason) = &self.broken {
            return Err(ModelError::ChatTemplate(format!(
                "the model's chat template is broken: {reason}"
            )));
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_messages_and_generation_prompt() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}",
            "",
            "",
        )
        .unwrap();
        let out = t.render(&[ChatMessage::new("user", " hi ")], true).unwrap();
        assert_eq!(out, "<user>hi<assistant>");
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("no system role"), "{err}");
    }

    #[test]
    fn a_template_that_does_not_compile_fails_every_render_with_the_reason() {
        let t = ChatTemplate::from_model_file("{% for m in messages %}{{ m.content }}", "", "");
        let problem = t.problem().expect("kept as broken").to_string();
        let err = t
            .render(&[ChatMessage::new("user", "hi")], true)
            .unwrap_err();
        assert!(matches!(&err, ModelError::ChatTemplate(_)), "{err}");
        assert!(err.to_string().contains("broken"), "{err}");
        assert!(err.to_string().contains(&problem), "{err}");
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new("{{ messages[0].content.strip().upper() }}", "", "").unwrap();
        let out = t
            .render(&[ChatMessage::new("user", "  x ")], false)
            .unwrap();
        assert_eq!(out, "X");
    }
}
