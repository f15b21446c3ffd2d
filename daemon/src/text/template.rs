//! Chat templates: the model's Jinja template rendered with minijinja, configured like
//! transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, Python string methods,
//! `raise_exception`, `strftime_now`).

use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Instructions one render may run: real templates need a few hundred per message (a
/// thousand messages stay far below); a template that loops without end stops here, in
/// well under a second.
pub const TEMPLATE_FUEL: u64 = 5_000_000;
/// Nesting of blocks, loops, macro calls one render may reach (real templates: < 10).
pub const TEMPLATE_RECURSION_MAX: usize = 100;
/// Bytes a render may write beyond its messages' own: the template's own text, repeated
/// per message, is a few hundred bytes each.
pub const TEMPLATE_OUTPUT_SLACK: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
#[error("chat template: {0}")]
pub struct TemplateError(String);

impl TemplateError {
    pub(crate) fn new(msg: impl Into<String>) -> TemplateError {
        TemplateError(msg.into())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
    /// Renders go there (with the source), not to `env`.
    sandbox: Option<(Arc<dyn Renderer>, String)>,
}

/// Renders a template's source elsewhere (`sandbox::TemplateSandbox`: in a worker
/// process).
pub trait Renderer: Send + Sync {
    fn render(
        &self,
        source: &str,
        bos: &str,
        eos: &str,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError>;
}

impl ChatTemplate {
    pub fn new(source: &str, bos: String, eos: String) -> Result<ChatTemplate, TemplateError> {
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // The template comes from the model file, which may be hostile: bounded time and
        // depth (the output is bounded in `render`).
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_recursion_limit(TEMPLATE_RECURSION_MAX);
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
        Ok(ChatTemplate {
            env,
            bos,
            eos,
            sandbox: None,
        })
    }

    /// A template compiled here (so a broken one fails at load) and rendered by `sandbox`
    /// (a worker process, where a render that asks for too much memory kills only the
    /// worker).
    pub fn sandboxed(
        source: &str,
        bos: String,
        eos: String,
        sandbox: Arc<dyn Renderer>,
    ) -> Result<ChatTemplate, TemplateError> {
        let mut t = ChatTemplate::new(source, bos, eos)?;
        t.sandbox = Some((sandbox, source.to_string()));
        Ok(t)
    }

    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        if let Some((sandbox, source)) = &self.sandbox {
            return sandbox.render(
                source,
                &self.bos,
                &self.eos,
                messages,
                add_generation_prompt,
            );
        }
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError(e.to_string()))?;
        let input: usize = messages
            .iter()
            .map(|m| m.content.len() + m.role.len())
            .sum();
        let mut out = Bounded {
            buf: Vec::new(),
            max: 2 * input + TEMPLATE_OUTPUT_SLACK,
        };
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        };
        match t.render_captured_to(ctx, &mut out) {
            Ok(_) => {}
            Err(e) if e.kind() == minijinja::ErrorKind::WriteFailure => {
                return Err(TemplateError(format!(
                    "the template wrote more than {} bytes for {input} bytes of messages: refused (is the model's chat template hostile?)",
                    out.max
                )))
            }
            Err(e) if e.kind() == minijinja::ErrorKind::OutOfFuel => {
                return Err(TemplateError(format!(
                    "the template ran more than {TEMPLATE_FUEL} instructions: refused (does the model's chat template loop?)"
                )))
            }
            Err(e) => return Err(TemplateError(e.to_string())),
        }
        String::from_utf8(out.buf)
            .map_err(|_| TemplateError("the template wrote invalid UTF-8".into()))
    }
}

/// A writer that refuses to grow past `max` bytes.
struct Bounded {
    buf: Vec<u8>,
    max: usize,
}

impl std::io::Write for Bounded {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.max {
            return Err(std::io::Error::other("template output limit"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn render(src: &str) -> Result<String, TemplateError> {
        let t = ChatTemplate::new(src, "<s>".into(), "</s>".into())?;
        let msgs = [ChatMessage {
            role: "user".into(),
            content: "hello".into(),
        }];
        t.render(&msgs, true)
    }

    /// A hostile template fails with its reason, quickly, without taking the memory it asks.
    fn refused(src: &str, why: &str) {
        let t0 = Instant::now();
        let e = render(src)
            .expect_err("a hostile template is refused")
            .to_string();
        assert!(e.contains(why), "{src}: {e}");
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{src}: {:?}",
            t0.elapsed()
        );
    }

    #[test]
    fn hostile_templates_are_refused_within_bounds() {
        // A real template still renders.
        let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
        assert_eq!(
            render(chatml).expect("ChatML renders"),
            "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
        );
        // minijinja caps one range; loops within the cap run out of fuel.
        refused(
            "{% for i in range(1000000000) %}{% endfor %}",
            "too many elements",
        );
        refused(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            "instructions",
        );
        refused(
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            "recursion",
        );
        refused(
            "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
            "wrote more than",
        );
        refused("{{ 'x' * 1000000000 }}", "too large");
        refused("{% include '/etc/passwd' %}", "not found");
        refused("{% import 'x' as y %}", "not found");
    }
}
