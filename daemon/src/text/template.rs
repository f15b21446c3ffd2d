//! Chat templates: the model's Jinja template rendered with minijinja, configured like
//! transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, Python string methods,
//! `raise_exception`, `strftime_now`).

use serde::Serialize;

#[derive(Debug, thiserror::Error)]
#[error("chat template: {0}")]
pub struct TemplateError(String);

#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    pub fn new(source: &str, bos: String, eos: String) -> Result<ChatTemplate, TemplateError> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_function("strftime_now", |_fmt: String| -> String {
            // Deterministic output matters more than the date in a template.
            String::new()
        });
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TemplateError(e.to_string()))?;
        Ok(ChatTemplate { env, bos, eos })
    }

    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError(e.to_string()))?;
        t.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| TemplateError(e.to_string()))
    }
}
