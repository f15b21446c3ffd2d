//! Tool calling, OpenAI's way: a request's functions and `tool_choice`, the format a
//! model's chat template writes calls in, the grammar that holds every call to its
//! function's parameter schema, and the parser that turns generated text back into content
//! and calls (whole, or piece by piece for a stream).
//!
//! Formats: Hermes (`<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`: Qwen2,
//! Qwen2.5, Qwen3, Hermes and the many templates that copied it), Llama 3.1's JSON
//! (`{"name": ..., "parameters": ...}`, one call a turn), and, for a template that renders
//! no tools, a generic one sluice writes into the system prompt (`{"tool_calls": [...]}`,
//! as llama.cpp's generic handler), used only when `tool_choice` forces a call: then the
//! constraint alone makes it.
//!
//! `auto` constrains lazily (llama.cpp's "lazy grammar"): the text is free until the model
//! starts a call (Hermes: it writes `<tool_call>`; Llama 3.1: its first byte is `{`), and
//! from then on the call must parse and match its function's schema. `required` and a
//! named function constrain from the first token. Since the grammar fixes the bytes
//! around names and arguments, the parser (`tool_parse.rs`) reads calls by that same
//! layout.

use super::grammar::{Grammar, Trigger, JSON_WHITESPACE};
use super::harmony::{self, Harmony};
use super::template::ChatMessage;
use serde_json::{json, Value};

/// One function a request offers.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    /// Its parameters' JSON schema (`{"type": "object"}` when the request gave none).
    pub parameters: Value,
    /// The request's tool object as given (`{"type": "function", "function": {...}}`),
    /// which templates render.
    pub object: Value,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    /// No calls: the tools are not offered.
    None,
    /// The model chooses between text and calls.
    Auto,
    /// At least one call, of any function.
    Required,
    /// A call of this function.
    Named(String),
}

/// A request's tools: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    pub list: Vec<Tool>,
    pub choice: ToolChoice,
    /// More than one call a turn (OpenAI's default; not with a named function).
    pub parallel: bool,
}

/// A refusal: the request field at fault and why.
pub type Refusal = (&'static str, String);

fn valid_name(n: &str) -> bool {
    (1..=64).contains(&n.len())
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

impl Tools {
    /// Reads OpenAI's fields; each malformed entry is refused naming it (`tools[1]`:
    /// what is wrong and what it must be).
    pub fn parse(
        tools: &[Value],
        choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Tools, Refusal> {
        let mut list: Vec<Tool> = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            let bad = |m: &str| ("tools", format!("tools[{i}]: {m}"));
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad("\"type\" must be \"function\""));
            }
            let f = t
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| bad("needs \"function\": {\"name\", \"parameters\"}"))?;
            let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
            if !valid_name(name) {
                return Err(bad(&format!(
                    "function.name {name:?} must be 1 to 64 letters, digits, _ or -"
                )));
            }
            if list.iter().any(|o| o.name == name) {
                return Err(bad(&format!("function.name {name:?} is given twice")));
            }
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
                Some(p @ Value::Object(_)) => p.clone(),
                Some(_) => {
                    return Err(bad("function.parameters must be a JSON schema (an object)"))
                }
            };
            list.push(Tool {
                name: name.to_string(),
                parameters,
                object: t.clone(),
            });
        }
        let choice = match choice {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err((
                        "tool_choice",
                        format!("tool_choice {other:?} is not none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                    ))
                }
            },
            Some(v) => {
                let name = v
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        (
                            "tool_choice",
                            "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}".to_string(),
                        )
                    })?;
                if !list.iter().any(|t| t.name == name) {
                    return Err((
                        "tool_choice",
                        format!("tool_choice names {name:?}, which is not among the tools"),
                    ));
                }
                ToolChoice::Named(name.to_string())
            }
        };
        if list.is_empty() && choice != ToolChoice::None {
            return Err((
                "tool_choice",
                "tool_choice needs tools to choose from".to_string(),
            ));
        }
        // A named function is one call of it.
        let parallel = parallel.unwrap_or(true) && !matches!(choice, ToolChoice::Named(_));
        Ok(Tools {
            list,
            choice,
            parallel,
        })
    }

    /// A call is made whatever the model prefers.
    pub fn forced(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// The functions a call may be of.
    fn callable(&self) -> Vec<&Tool> {
        match &self.choice {
            ToolChoice::Named(n) => self.list.iter().filter(|t| &t.name == n).collect(),
            _ => self.list.iter().collect(),
        }
    }
}

/// How a model writes its calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one block a call.
    Hermes,
    /// `{"name": "f", "parameters": {...}}` as the whole answer (one call).
    Llama3,
    /// `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (Mistral; the special token
    /// first, which the text does not show), one list a turn.
    Mistral,
    /// `{"tool_calls": [{"name": "f", "arguments": {...}}, ...]}` as the whole answer,
    /// described to the model in its system prompt (templates without tools).
    Generic,
    /// OpenAI's harmony (gpt-oss): a message to `functions.NAME` on the commentary
    /// channel, its body the arguments, ended by `<|call|>`; one call a turn
    /// (`harmony.rs`).
    Harmony,
}

/// The bytes around each call in a format: what opens the calls, each call's head before
/// its name, between name and arguments, after the arguments, between calls, and what
/// closes them.
pub(crate) struct Layout {
    pub(crate) open: &'static str,
    pub(crate) head: &'static str,
    pub(crate) mid: &'static str,
    pub(crate) tail: &'static str,
    pub(crate) sep: &'static str,
    pub(crate) close: &'static str,
}

impl ToolFormat {
    /// The format a chat template writes calls in; None where it renders no tools.
    pub fn of_template(src: &str) -> Option<ToolFormat> {
        if !src.contains("tools") {
            None
        } else if src.contains(harmony::CHANNEL) && src.contains(harmony::CALL) {
            Some(ToolFormat::Harmony)
        } else if src.contains("[TOOL_CALLS]") {
            Some(ToolFormat::Mistral)
        } else if src.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if src.contains("\"parameters\": ") && src.contains("ipython") {
            Some(ToolFormat::Llama3)
        } else {
            None
        }
    }

    pub(crate) fn layout(self) -> Layout {
        match self {
            ToolFormat::Hermes => Layout {
                open: "<tool_call>\n",
                head: "{\"name\": \"",
                mid: "\", \"arguments\": ",
                tail: "}\n</tool_call>",
                sep: "\n<tool_call>\n",
                close: "",
            },
            ToolFormat::Llama3 => Layout {
                open: "",
                head: "{\"name\": \"",
                mid: "\", \"parameters\": ",
                tail: "}",
                sep: "",
                close: "",
            },
            ToolFormat::Mistral => Layout {
                open: "[",
                head: "{\"name\": \"",
                mid: "\", \"arguments\": ",
                tail: "}",
                sep: ", ",
                close: "]",
            },
            ToolFormat::Generic => Layout {
                open: "{\"tool_calls\": [",
                head: "{\"name\": \"",
                mid: "\", \"arguments\": ",
                tail: "}",
                sep: ", ",
                close: "]}",
            },
            // Harmony's calls are messages, read by their markers (`harmony.rs`): the
            // grammar's own parts are in `harmony_grammar`.
            ToolFormat::Harmony => Layout {
                open: "",
                head: "",
                mid: "",
                tail: "",
                sep: "",
                close: "",
            },
        }
    }

    /// More than one call a turn is possible in this format.
    fn parallel(self) -> bool {
        !matches!(self, ToolFormat::Llama3 | ToolFormat::Harmony)
    }

    /// What the text writes to start calling when calls are optional (Hermes' tag,
    /// Mistral's special token, named by `special`); None where the grammar itself leaves
    /// the choice open (Llama 3.1's first byte).
    fn trigger(self, special: Option<u32>) -> Option<Trigger> {
        match self {
            ToolFormat::Hermes => Some(Trigger::Text(&["<tool_call>"])),
            ToolFormat::Mistral => special.map(Trigger::Token),
            // The recipient, before or after the channel: `assistant to=functions.` or
            // `<|channel|>commentary to=functions.`.
            ToolFormat::Harmony => Some(Trigger::Text(&[" to=functions."])),
            _ => None,
        }
    }

    /// The special token a call begins with, by name (Mistral's; harmony's channel
    /// marker, which stands for all of its tokens).
    pub fn special_token(self) -> Option<&'static str> {
        match self {
            ToolFormat::Mistral => Some("[TOOL_CALLS]"),
            ToolFormat::Harmony => Some(harmony::CHANNEL),
            _ => None,
        }
    }
}

/// What a request's tools become for one model: the tools its template renders, the
/// grammar its text is held to (None: free text), and for a lazy grammar the text that
/// arms it.
pub struct ToolPlan {
    pub format: ToolFormat,
    pub template_tools: Vec<Value>,
    pub grammar: Option<Grammar>,
    pub trigger: Option<Trigger>,
    pub parallel: bool,
}

/// How a model whose chat template is `template` (its source) writes calls of `tools`:
/// its format and whether several calls may come; None when no tool is offered
/// (`tool_choice: none`). `special(name)` is a special token's id in the model's
/// vocabulary: a format whose calls begin with one it lacks is not read. The answer's
/// parser takes this; `plan` builds the rest on it.
pub fn syntax(
    tools: &Tools,
    template: &str,
    special: &dyn Fn(&str) -> Option<u32>,
) -> Result<Option<(ToolFormat, bool)>, Refusal> {
    if tools.choice == ToolChoice::None {
        return Ok(None);
    }
    let native = ToolFormat::of_template(template)
        .filter(|f| f.special_token().is_none_or(|name| special(name).is_some()));
    let format = match native {
        Some(f) => f,
        None if tools.forced() => ToolFormat::Generic,
        None => {
            return Err((
                "tools",
                "this model's chat template renders no tools in a format sluice reads (Hermes <tool_call>, Llama 3.1 JSON, Mistral [TOOL_CALLS], harmony): give tool_choice \"required\" or a function's name to have the call made by constraint alone, or serve the model with a template that has tools (--chat-template FILE)".into(),
            ))
        }
    };
    Ok(Some((format, tools.parallel && format.parallel())))
}

/// Plans `tools` for a model (see `syntax`): the format, the messages as the template must
/// see them (the generic format's instructions in the system prompt), and the grammar.
pub fn plan(
    tools: &Tools,
    template: &str,
    special: &dyn Fn(&str) -> Option<u32>,
    messages: &mut Vec<ChatMessage>,
) -> Result<Option<ToolPlan>, Refusal> {
    let Some((format, parallel)) = syntax(tools, template, special)? else {
        return Ok(None);
    };
    let template_tools = if format == ToolFormat::Generic {
        generic_instructions(tools, messages);
        Vec::new()
    } else {
        tools.list.iter().map(|t| t.object.clone()).collect()
    };
    if format == ToolFormat::Harmony {
        let h = Harmony::of(special).ok_or_else(|| {
            (
                "tools",
                "this model's template writes harmony (gpt-oss) calls, but its vocabulary lacks harmony's tokens".to_string(),
            )
        })?;
        let (grammar, trigger) = harmony_grammar(tools, &h);
        return Ok(Some(ToolPlan {
            format,
            template_tools,
            grammar: Some(Grammar::Lark(grammar)),
            trigger,
            parallel: false,
        }));
    }
    let token = ToolFormat::Mistral.special_token().and_then(special);
    let l = format.layout();
    let calls = calls_rule(tools, &l, parallel);
    // Mistral's calls begin with its special token, which the grammar names by id.
    let token_lit = match (format, token) {
        (ToolFormat::Mistral, Some(id)) => format!("<[{id}]> "),
        _ => String::new(),
    };
    let (grammar, trigger) = match (tools.forced(), format.trigger(token), format) {
        (true, _, _) => (
            format!("start: {token_lit}{}calls{}\n", lit(l.open), lit(l.close)),
            None,
        ),
        // After the trigger: the rest of the opening, the calls, the end.
        (false, Some(t), _) => {
            let rest = match t {
                Trigger::Text(&[text]) => l.open.strip_prefix(text).unwrap_or(l.open),
                Trigger::Text(_) => l.open,
                Trigger::Token(_) => l.open,
            };
            (
                format!("start: {}calls{}\n", lit(rest), lit(l.close)),
                Some(t),
            )
        }
        // Llama 3.1: a call, or any text that does not begin with `{`.
        (false, None, _) => (
            "start: calls | FREE\nFREE: /[^{][\\s\\S]*/\n".to_string(),
            None,
        ),
    };
    Ok(Some(ToolPlan {
        format,
        template_tools,
        grammar: Some(Grammar::Lark(grammar + &calls)),
        trigger,
        parallel,
    }))
}

/// Harmony's call grammar: forced, the answer is one message to a function from its first
/// token (`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`,
/// no analysis before it); lazy, the text after ` to=functions.`: the name, the rest of
/// the header in either of its orders, the arguments. `<|call|>` ends the turn once the
/// arguments are whole (an end token: allowed when the grammar accepts).
fn harmony_grammar(tools: &Tools, h: &Harmony) -> (String, Option<Trigger>) {
    let (channel, constrain, message) = (
        format!("<[{}]>", h.channel),
        format!("<[{}]>", h.constrain),
        format!("<[{}]>", h.message),
    );
    let mut g = if tools.forced() {
        format!("start: {channel} \"commentary to=functions.\" call\n")
    } else {
        "start: call\n".to_string()
    };
    let rest = if tools.forced() {
        format!("\" \" {constrain} \"json\"")
    } else {
        format!("({channel} \"commentary\")? (\" \" {constrain}? \"json\")?")
    };
    g.push_str(&call_alternatives(tools, |name, schema| {
        format!("{}{rest} {message} %json {schema}", lit(name))
    }));
    let trigger = (!tools.forced())
        .then(|| ToolFormat::Harmony.trigger(None))
        .flatten();
    (g, trigger)
}

/// `s` as a Lark literal followed by a space (nothing for an empty string).
fn lit(s: &str) -> String {
    if s.is_empty() {
        String::new()
    } else {
        format!("{} ", serde_json::to_string(s).unwrap_or_default())
    }
}

/// The grammar's `calls` rule and one rule per callable function: its head, its name,
/// its arguments held to its schema (with JSON mode's whitespace rule), its tail.
fn calls_rule(tools: &Tools, l: &Layout, parallel: bool) -> String {
    let mut g = if parallel {
        format!("calls: call ({}call)*\n", lit(l.sep))
    } else {
        "calls: call\n".to_string()
    };
    g.push_str(&call_alternatives(tools, |name, schema| {
        format!(
            "{}%json {schema} {}",
            lit(&format!("{}{name}{}", l.head, l.mid)),
            lit(l.tail).trim_end()
        )
    }));
    g
}

/// The `call` rule, one alternative per callable function, and each function's rule as
/// `rule` writes it from its name and its schema (with JSON mode's whitespace rule).
fn call_alternatives(tools: &Tools, rule: impl Fn(&str, &Value) -> String) -> String {
    let callable = tools.callable();
    let names: Vec<String> = (0..callable.len()).map(|i| format!("call_{i}")).collect();
    let mut g = format!("call: {}\n", names.join(" | "));
    for (i, t) in callable.iter().enumerate() {
        let mut schema = t.parameters.clone();
        if let Value::Object(m) = &mut schema {
            m.entry("x-guidance")
                .or_insert_with(|| json!({"whitespace_pattern": JSON_WHITESPACE}));
        }
        g.push_str(&format!("call_{i}: {}\n", rule(&t.name, &schema)));
    }
    g
}

/// The generic format's instructions and the tools, in the system prompt.
fn generic_instructions(tools: &Tools, messages: &mut Vec<ChatMessage>) {
    let list: Vec<Value> = tools
        .list
        .iter()
        .map(|t| t.object.get("function").cloned().unwrap_or(Value::Null))
        .collect();
    let tools_json = serde_json::to_string_pretty(&list).unwrap_or_default();
    let instructions = format!(
        "You can call these functions:\n{tools_json}\n\nTo call functions, answer with only a JSON object: {{\"tool_calls\": [{{\"name\": <function name>, \"arguments\": <arguments object>}}]}}. Each function's answer comes back in a message from the tool."
    );
    match messages.first_mut() {
        Some(m) if m.role == "system" => m.content = format!("{}\n\n{instructions}", m.content),
        _ => messages.insert(0, ChatMessage::new("system", instructions)),
    }
}

/// For a template that renders no tool calls: each earlier call written into its
/// message's content as the generic format writes it, so the model sees what it called
/// (the template would drop the calls). Any request, with tools or without.
pub fn calls_as_text(template: &str, messages: &mut [ChatMessage]) {
    if messages.iter().all(|m| m.tool_calls.is_empty())
        || ToolFormat::of_template(template).is_some()
    {
        return;
    }
    for m in messages.iter_mut() {
        if m.tool_calls.is_empty() {
            continue;
        }
        let calls: Vec<Value> = m
            .tool_calls
            .iter()
            .map(
                |c| json!({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}),
            )
            .collect();
        let text = json!({ "tool_calls": calls }).to_string();
        m.content = if m.content.is_empty() {
            text
        } else {
            format!("{}\n{text}", m.content)
        };
        m.tool_calls.clear();
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::text::answer::{Parse, ToolEvent};
    use crate::text::grammar::{Grammars, TokenKind, TokenTexts};
    use crate::text::harmony::{
        HarmonyParser, CALL, CHANNEL, CONSTRAIN, END, FINAL, MESSAGE, RETURN, START,
    };
    use crate::text::sampler::{OutputFormat, Sampler, SamplingParams};
    use crate::util::rng::Rng;

    pub(crate) fn tools(choice: Value, parallel: Option<bool>) -> Tools {
        let list = [
            json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}}}),
            json!({"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -1000, "maximum": 1000}, "b": {"type": "number", "minimum": -1e6, "maximum": 1e6}}, "required": ["a", "b"], "additionalProperties": false}}}),
        ];
        Tools::parse(&list, Some(&choice), parallel).expect("tools")
    }

    #[test]
    fn bad_tools_are_named() {
        for (t, c, field, says) in [
            (
                json!([{"type": "function"}]),
                json!("auto"),
                "tools",
                "tools[0]",
            ),
            (
                json!([{"type": "retrieval"}]),
                json!("auto"),
                "tools",
                "\"type\"",
            ),
            (
                json!([{"type": "function", "function": {"name": "a b"}}]),
                json!("auto"),
                "tools",
                "a b",
            ),
            (
                json!([{"type": "function", "function": {"name": "f", "parameters": 3}}]),
                json!("auto"),
                "tools",
                "parameters",
            ),
            (
                json!([{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]),
                json!("auto"),
                "tools",
                "twice",
            ),
            (
                json!([{"type": "function", "function": {"name": "f"}}]),
                json!("always"),
                "tool_choice",
                "always",
            ),
            (
                json!([{"type": "function", "function": {"name": "f"}}]),
                json!({"type": "function", "function": {"name": "g"}}),
                "tool_choice",
                "\"g\"",
            ),
            (json!([]), json!("required"), "tool_choice", "needs tools"),
        ] {
            let e = Tools::parse(t.as_array().unwrap(), Some(&c), None).expect_err("refused");
            assert_eq!(e.0, field, "{e:?}");
            assert!(e.1.contains(says), "{e:?}");
        }
    }

    fn no_special(_: &str) -> Option<u32> {
        None
    }

    /// The plan of `choice` on `template`, which must offer calls.
    fn planned(
        choice: Value,
        parallel: Option<bool>,
        template: &str,
        special: &dyn Fn(&str) -> Option<u32>,
        m: &mut Vec<ChatMessage>,
    ) -> ToolPlan {
        plan(&tools(choice, parallel), template, special, m)
            .expect("planned")
            .expect("calls offered")
    }

    #[test]
    fn plans_follow_the_template_and_the_choice() {
        let hermes =
            "{% if tools %}{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>{% endif %}";
        let mut m = vec![ChatMessage::new("user", "hi")];
        let p = planned(json!("auto"), None, hermes, &no_special, &mut m);
        assert_eq!(
            (p.format, p.trigger, p.template_tools.len()),
            (ToolFormat::Hermes, Some(Trigger::Text(&["<tool_call>"])), 2)
        );
        let p = planned(json!("required"), Some(false), hermes, &no_special, &mut m);
        assert_eq!((p.trigger, p.parallel), (None, false));
        assert!(
            plan(&tools(json!("none"), None), hermes, &no_special, &mut m)
                .unwrap()
                .is_none()
        );
        // No tools in the template: only a forced call, in the generic format, its
        // instructions in the system prompt.
        let chatml = "{% for m in messages %}{{ m.content }}{% endfor %}";
        assert_eq!(
            plan(&tools(json!("auto"), None), chatml, &no_special, &mut m)
                .err()
                .map(|e| e.0),
            Some("tools")
        );
        let add = json!({"type": "function", "function": {"name": "add"}});
        let p = planned(add, None, chatml, &no_special, &mut m);
        assert_eq!(p.format, ToolFormat::Generic);
        assert!(p.template_tools.is_empty());
        assert_eq!(m[0].role, "system");
        assert!(m[0].content.contains("\"get_weather\"") && m[0].content.contains("tool_calls"));
        let Some(Grammar::Lark(g)) = &p.grammar else {
            panic!("a grammar")
        };
        assert!(
            g.contains("\\\"add\\\"") && !g.contains("get_weather"),
            "{g}"
        );
        // Mistral's template: its special token starts the calls, named by id in the
        // grammar, and arms `auto`; a vocabulary without it is a template without tools.
        let mistral = "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]";
        let special = |n: &str| (n == "[TOOL_CALLS]").then_some(5);
        let p = planned(json!("required"), None, mistral, &special, &mut Vec::new());
        let Some(Grammar::Lark(mg)) = &p.grammar else {
            panic!("a grammar")
        };
        assert!(mg.starts_with("start: <[5]> \"[\""), "{mg}");
        let p = planned(json!("auto"), None, mistral, &special, &mut Vec::new());
        assert_eq!(
            (p.format, p.trigger),
            (ToolFormat::Mistral, Some(Trigger::Token(5)))
        );
        let p = planned(
            json!("required"),
            None,
            mistral,
            &no_special,
            &mut Vec::new(),
        );
        assert_eq!(p.format, ToolFormat::Generic);
    }

    /// A harmony answer's calls (function, arguments) and content, as `HarmonyParser`
    /// reads them.
    fn harmony_read(tools: bool, text: &str) -> (Vec<(String, String)>, String) {
        let mut p = HarmonyParser::new(tools);
        let mut events = p.feed(text);
        events.extend(p.finish());
        let (mut calls, mut content) = (Vec::new(), String::new());
        for e in events {
            match e {
                ToolEvent::Call { name, .. } => calls.push((name, String::new())),
                ToolEvent::Args { index, text } => calls[index].1.push_str(&text),
                ToolEvent::Text(t) => content.push_str(&t),
                ToolEvent::Reasoning(_) => {}
            }
        }
        (calls, content)
    }

    /// A byte vocabulary with harmony's tokens: texts are written as a chat answer's are
    /// (markers as their names, end tokens left out).
    struct Vocab {
        texts: Vec<Vec<u8>>,
        h: Harmony,
        grammars: Grammars,
    }

    fn vocab() -> Vocab {
        let mut texts: Vec<Vec<u8>> = (0x20u8..0x7f).map(|b| vec![b]).collect();
        texts.push(b"\n".to_vec());
        let base = texts.len() as u32;
        let names = [START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL];
        let mut v: Vec<(&[u8], TokenKind)> =
            texts.iter().map(|t| (&t[..], TokenKind::Text)).collect();
        for n in names {
            let kind = if n == RETURN || n == CALL {
                TokenKind::End
            } else {
                TokenKind::Silent
            };
            v.push((b"", kind));
        }
        let table = TokenTexts::of(&v);
        texts.extend(names.iter().map(|n| n.as_bytes().to_vec()));
        let id = |s: &str| names.iter().position(|n| *n == s).map(|i| base + i as u32);
        let h = Harmony::of(id).expect("harmony");
        let grammars = Grammars::new(&table, |t| {
            names
                .get((t - base) as usize)
                .map_or(String::new(), |n| n.to_string())
        })
        .expect("grammars");
        Vocab { texts, h, grammars }
    }

    impl Vocab {
        /// The tokens of `text`, markers as one token each.
        fn tokens(&self, mut text: &str) -> Vec<u32> {
            let mut out = Vec::new();
            while !text.is_empty() {
                let (id, n) = (0..self.texts.len() as u32)
                    .rev()
                    .find(|&i| text.as_bytes().starts_with(&self.texts[i as usize]))
                    .map(|i| (i, self.texts[i as usize].len()))
                    .expect("a token");
                out.push(id);
                text = &text[n..];
            }
            out
        }

        /// Samples under `format` from random logits, the first tokens pushed to
        /// `prefix`'s: the text written (markers in it) and whether an end token ended it.
        fn sample(&self, format: &OutputFormat, prefix: &[u32], seed: u64) -> (String, bool) {
            let mut rng = Rng::new(seed);
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                seed,
                ..Default::default()
            })
            .constrained(&[], format);
            let mut text = Vec::new();
            for step in 0..400 {
                let mut logits: Vec<f32> = (0..self.texts.len())
                    .map(|_| rng.below(300) as f32 / 100.0)
                    .collect();
                if let Some(&t) = prefix.get(step) {
                    logits[t as usize] = 100.0;
                }
                let t = s.sample(&logits);
                if t == self.h.ret || t == self.h.call {
                    return (String::from_utf8(text).unwrap(), true);
                }
                text.extend_from_slice(&self.texts[t as usize]);
            }
            (String::from_utf8(text).unwrap(), false)
        }
    }

    /// Sampled from random logits, every forced harmony call (any function, a named one)
    /// and every lazy one (the model writing `<|channel|>commentary to=functions.` after
    /// its analysis, or the recipient first) is read back into one call of an offered
    /// function whose arguments parse and hold its required fields.
    #[test]
    fn sampled_harmony_calls_parse_and_match_their_schemas() {
        let v = vocab();
        let special = |n: &str| v.tokens(n).first().copied().filter(|_| n.starts_with("<|"));
        let template = "{% if tools %}<|channel|>commentary<|call|>{% endif %}";
        let mut read = 0;
        for (choice, prefix) in [
            (json!("required"), ""),
            (json!({"type": "function", "function": {"name": "add"}}), ""),
            (
                json!("auto"),
                "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>commentary to=functions.",
            ),
            (json!("auto"), " to=functions."),
        ] {
            let t = tools(choice, None);
            let p = plan(&t, template, &special, &mut Vec::new())
                .unwrap()
                .unwrap();
            let g = p.grammar.as_ref().unwrap();
            let c = match p.trigger {
                Some(tr) => v.grammars.compile_lazy(g, tr),
                None => v.grammars.compile(g),
            }
            .unwrap_or_else(|e| panic!("{e}\n{g:?}"));
            let format = OutputFormat::Constrained(Box::new(c));
            for seed in 0..30 {
                let (text, ended) = v.sample(&format, &v.tokens(prefix), seed);
                if !ended {
                    continue;
                }
                let calls = harmony_read(true, &text).0;
                assert_eq!(calls.len(), 1, "{text}");
                let (name, args) = &calls[0];
                let a: Value = serde_json::from_str(args)
                    .unwrap_or_else(|e| panic!("{e}: {args} in {text}"));
                let tool = t.list.iter().find(|x| &x.name == name).expect("offered");
                for r in tool.parameters["required"].as_array().unwrap() {
                    assert!(a.get(r.as_str().unwrap()).is_some(), "{name} {args}");
                }
                read += 1;
            }
        }
        assert!(read > 40, "{read} calls read");
    }

    /// A response format on a harmony answer holds its final channel's body and no end
    /// token comes before it: the analysis is free, the final text is the JSON.
    #[test]
    fn a_response_format_holds_the_final_channel() {
        let v = vocab();
        let g = Grammar::JsonSchema(
            json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false}),
        );
        let c = v.grammars.compile_after(&g, Trigger::Text(FINAL)).unwrap();
        // No end token until the final channel.
        let mut early = c.clone();
        assert!(!early.allows(v.h.ret) && !early.allows(v.h.call) && early.allows(v.h.end));
        let mut row = vec![0.0; v.texts.len()];
        early.mask(&mut row);
        assert!(row[v.h.ret as usize] == f32::NEG_INFINITY && row[v.h.start as usize] == 0.0);
        let format = OutputFormat::Constrained(Box::new(c));
        // An analysis that says "final" does not arm it; the final channel does, with or
        // without a content type.
        let mut whole = 0;
        for header in FINAL {
            let prefix = v.tokens(&format!(
                "<|channel|>analysis<|message|>final<|end|><|start|>assistant{header}"
            ));
            for seed in 0..10 {
                let (text, ended) = v.sample(&format, &prefix, seed);
                if !ended {
                    continue;
                }
                let content = harmony_read(false, &text).1;
                let a: Value =
                    serde_json::from_str(&content).unwrap_or_else(|e| panic!("{e}: {text}"));
                assert!(a["n"].is_i64(), "{text}");
                whole += 1;
            }
        }
        assert!(whole > 10, "{whole} of 20 ended");
    }
}
