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
    /// The format a chat template writes calls in; None where it renders no tools or
    /// writes them in a format sluice does not read yet (gpt-oss's channels).
    pub fn of_template(src: &str) -> Option<ToolFormat> {
        if !src.contains("tools") {
            None
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
        }
    }

    /// More than one call a turn is possible in this format.
    fn parallel(self) -> bool {
        self != ToolFormat::Llama3
    }

    /// What the text writes to start calling when calls are optional (Hermes' tag,
    /// Mistral's special token, named by `special`); None where the grammar itself leaves
    /// the choice open (Llama 3.1's first byte).
    fn trigger(self, special: Option<u32>) -> Option<Trigger> {
        match self {
            ToolFormat::Hermes => Some(Trigger::Text("<tool_call>")),
            ToolFormat::Mistral => special.map(Trigger::Token),
            _ => None,
        }
    }

    /// The special token a call begins with, by name (Mistral's).
    pub fn special_token(self) -> Option<&'static str> {
        (self == ToolFormat::Mistral).then_some("[TOOL_CALLS]")
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
                "this model's chat template renders no tools in a format sluice reads (Hermes <tool_call>, Llama 3.1 JSON, Mistral [TOOL_CALLS]): give tool_choice \"required\" or a function's name to have the call made by constraint alone, or serve the model with a template that has tools (--chat-template FILE)".into(),
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
    let token = ToolFormat::Mistral.special_token().and_then(special);
    let template_tools = if format == ToolFormat::Generic {
        generic_instructions(tools, messages);
        Vec::new()
    } else {
        tools.list.iter().map(|t| t.object.clone()).collect()
    };
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
                Trigger::Text(text) => l.open.strip_prefix(text).unwrap_or(l.open),
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
    let callable = tools.callable();
    let mut g = if parallel {
        format!("calls: call ({}call)*\n", lit(l.sep))
    } else {
        "calls: call\n".to_string()
    };
    let names: Vec<String> = (0..callable.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&format!("call: {}\n", names.join(" | ")));
    for (i, t) in callable.iter().enumerate() {
        let mut schema = t.parameters.clone();
        if let Value::Object(m) = &mut schema {
            m.entry("x-guidance")
                .or_insert_with(|| json!({"whitespace_pattern": JSON_WHITESPACE}));
        }
        g.push_str(&format!(
            "call_{i}: {}%json {} {}\n",
            lit(&format!("{}{}{}", l.head, t.name, l.mid)),
            schema,
            lit(l.tail).trim_end()
        ));
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
            (ToolFormat::Hermes, Some(Trigger::Text("<tool_call>")), 2)
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
}
