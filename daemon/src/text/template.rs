//! Chat templates: the model's Jinja template rendered with minijinja, configured like
//! transformers' `apply_chat_template` (trim_blocks, lstrip_blocks, Python string methods,
//! `raise_exception`, `strftime_now`).

use serde::{Deserialize, Serialize};
use std::borrow::Cow;
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

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's tool calls, as templates take them (transformers' shape:
    /// `{"id", "type": "function", "function": {"name", "arguments": {...}}}`, the
    /// arguments an object). Left out of the template's context when there are none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    /// A tool message's answer to this call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant message's reasoning before it (OpenAI-compatible servers'
    /// `reasoning_content`), under the name Qwen3's template reads ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// ... and the one gpt-oss's reads (its analysis before a call). Both or neither.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub thinking: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            ..Default::default()
        }
    }
}

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    source: String,
    bos: String,
    eos: String,
    /// Renders go there (with the source), not to `env`.
    sandbox: Option<(Arc<dyn Renderer>, String)>,
    /// Variables every render sees besides the conversation (transformers' and vLLM's
    /// chat template kwargs: `date_string`, `enable_thinking`, ...).
    vars: serde_json::Map<String, serde_json::Value>,
}

/// One render: the template's source and everything its context holds. Borrowed where the
/// daemon sends it, owned where the worker reads it.
#[derive(Serialize, Deserialize)]
pub struct RenderJob<'a> {
    pub source: Cow<'a, str>,
    pub bos: Cow<'a, str>,
    pub eos: Cow<'a, str>,
    pub messages: Cow<'a, [ChatMessage]>,
    #[serde(default)]
    pub tools: Cow<'a, [serde_json::Value]>,
    #[serde(default)]
    pub vars: Cow<'a, serde_json::Map<String, serde_json::Value>>,
    pub add_generation_prompt: bool,
}

/// Renders a template's source elsewhere (`sandbox::TemplateSandbox`: in a worker
/// process).
pub trait Renderer: Send + Sync {
    fn render(&self, job: &RenderJob<'_>) -> Result<String, TemplateError>;
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
        env.add_function("strftime_now", strftime_now);
        // Python's json.dumps, as transformers' `tojson` writes (minijinja's own is
        // compact and escapes HTML), so a template's tools render as transformers'.
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TemplateError(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos,
            eos,
            sandbox: None,
            vars: serde_json::Map::new(),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The template with variables every render sees (they do not override the
    /// conversation's own: messages, tools, add_generation_prompt, bos_token, eos_token).
    pub fn with_vars(mut self, vars: serde_json::Map<String, serde_json::Value>) -> ChatTemplate {
        self.set_vars(vars);
        self
    }

    pub fn set_vars(&mut self, vars: serde_json::Map<String, serde_json::Value>) {
        self.vars = vars;
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
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// The conversation with `tools` (OpenAI's tool objects) passed to the template as
    /// transformers' `apply_chat_template(..., tools=...)` passes them (none: `None`).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        if let Some((sandbox, source)) = &self.sandbox {
            return sandbox.render(&RenderJob {
                source: Cow::Borrowed(source),
                bos: Cow::Borrowed(&self.bos),
                eos: Cow::Borrowed(&self.eos),
                messages: Cow::Borrowed(messages),
                tools: Cow::Borrowed(tools),
                vars: Cow::Borrowed(&self.vars),
                add_generation_prompt,
            });
        }
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| TemplateError(e.to_string()))?;
        let input: usize = messages
            .iter()
            .map(|m| m.content.len() + m.role.len() + json_len(&m.tool_calls))
            .sum::<usize>()
            + json_len(tools);
        let mut out = Bounded {
            buf: Vec::new(),
            max: 2 * input + TEMPLATE_OUTPUT_SLACK,
        };
        let tools = (!tools.is_empty()).then_some(tools);
        let ctx = minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
            ..minijinja::Value::from_serialize(&self.vars)
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

fn json_len(v: &[serde_json::Value]) -> usize {
    v.iter().map(|x| x.to_string().len()).sum()
}

/// transformers' `strftime_now`: the local time in a strftime format (Llama 3.1's
/// template writes today's date with it).
fn strftime_now(fmt: String) -> Result<String, minijinja::Error> {
    let bad = || minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, "strftime_now");
    let cfmt = std::ffi::CString::new(fmt).map_err(|_| bad())?;
    let mut buf = [0u8; 256];
    // SAFETY: time/localtime_r/strftime on live, sized buffers.
    let n = unsafe {
        let t = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&t, &mut tm).is_null() {
            return Err(bad());
        }
        libc::strftime(buf.as_mut_ptr().cast(), buf.len(), cfmt.as_ptr(), &tm)
    };
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Python's `json.dumps(v, ensure_ascii=False, indent=indent)`: `", "` and `": "` between
/// items without an indent, `","` and a newline with one; keys in their order.
fn tojson(
    v: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let j = serde_json::to_value(&v).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    let mut out = String::new();
    py_json(&j, indent, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

fn py_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value;
    let (open, close, items): (char, char, Vec<(Option<&String>, &Value)>) = match v {
        Value::Array(a) => ('[', ']', a.iter().map(|x| (None, x)).collect()),
        Value::Object(m) => ('{', '}', m.iter().map(|(k, x)| (Some(k), x)).collect()),
        scalar => {
            out.push_str(&scalar.to_string());
            return;
        }
    };
    out.push(open);
    if items.is_empty() {
        out.push(close);
        return;
    }
    let newline = |out: &mut String, d: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * d));
        }
    };
    for (i, (k, x)) in items.into_iter().enumerate() {
        if i > 0 {
            out.push_str(if indent.is_some() { "," } else { ", " });
        }
        newline(out, depth + 1);
        if let Some(k) = k {
            out.push_str(&serde_json::Value::String(k.clone()).to_string());
            out.push_str(": ");
        }
        py_json(x, indent, depth + 1, out);
    }
    newline(out, depth);
    out.push(close);
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
        let msgs = [ChatMessage::new("user", "hello")];
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
