//! The OpenAI wire format: request bodies of `/v1/chat/completions` and `/v1/completions`
//! parsed into the shared `GenerateInput` (every field OpenAI defines is either honoured or
//! refused with a 400 that names it, never silently ignored when it would change the
//! output), and the JSON of responses, stream chunks and errors.

use super::api::{ApiError, ErrorKind, Format, GenerateInput, Prompt};
use super::models::{parse_keep_alive, KeepAlive};
use crate::engine::scheduler::Finish;
use crate::text::grammar::Grammar;
use crate::text::tools::Tools;
use crate::text::{ChatMessage, SamplingParams};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Deserialize, Default)]
struct StreamOptions {
    include_usage: Option<bool>,
}

/// Fields both endpoints take.
#[derive(Deserialize, Default)]
struct Common {
    #[serde(default)]
    model: Option<String>,
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    /// Not OpenAI's, but vLLM's and llama-server's.
    top_k: Option<u32>,
    min_p: Option<f32>,
    seed: Option<i64>,
    stop: Option<Value>,
    n: Option<u32>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    /// vLLM's: transformers' repetition penalty over the prompt and the text.
    repetition_penalty: Option<f32>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    /// Chat's; vLLM takes it on completions too.
    response_format: Option<Value>,
    /// vLLM's: {"json" | "regex" | "grammar" | "choice" | "json_object": ...}.
    structured_outputs: Option<Value>,
    /// vLLM's older fields.
    guided_json: Option<Value>,
    guided_regex: Option<String>,
    guided_grammar: Option<String>,
    guided_choice: Option<Vec<String>>,
    /// llama-server's: a grammar (here llguidance's Lark) and a JSON schema.
    grammar: Option<String>,
    json_schema: Option<Value>,
    /// Ollama's: how long the model stays loaded after this request.
    keep_alive: Option<Value>,
}

/// `keep_alive`: a duration string or a number of seconds (negative: for ever).
fn keep_alive(v: Option<&Value>) -> Result<Option<KeepAlive>, ApiError> {
    let r = match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => parse_keep_alive(s),
        Some(Value::Number(n)) => parse_keep_alive(&n.to_string()),
        Some(_) => Err("keep_alive must be a duration string or a number of seconds".into()),
    };
    r.map_err(|m| ApiError::invalid(Some("keep_alive"), m))
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<Value>,
    max_completion_tokens: Option<u32>,
    logprobs: Option<bool>,
    top_logprobs: Option<u32>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: Value,
    logprobs: Option<u32>,
    echo: Option<bool>,
    suffix: Option<String>,
    best_of: Option<u32>,
    #[serde(flatten)]
    common: Common,
}

/// A parsed request: what to generate and how to answer.
pub struct Call {
    /// The model named (empty: the daemon's default) and how long to keep it loaded.
    pub model: String,
    pub keep_alive: Option<KeepAlive>,
    /// One input per prompt (chat: one).
    pub inputs: Vec<GenerateInput>,
    /// Choices per prompt (`n`): choice `i` of prompt `p` is at `p * n + i`, as OpenAI
    /// orders them (`Frontend::submit_in` makes them).
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
}

/// Choices per prompt at most (OpenAI's limit).
pub const N_MAX: usize = 128;

fn body_error(e: serde_json::Error) -> ApiError {
    ApiError::invalid(None, format!("the request body is not valid: {e}"))
}

fn unsupported(param: &'static str, what: &str) -> ApiError {
    ApiError::invalid(Some(param), format!("{what} is not supported by sluice"))
}

/// Stop strings: a string or a list of strings.
fn stop_list(v: Option<Value>) -> Result<Vec<String>, ApiError> {
    let bad = || ApiError::invalid(Some("stop"), "stop must be a string or a list of strings");
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s]),
        Some(Value::Array(a)) => a
            .into_iter()
            .map(|s| match s {
                Value::String(s) => Ok(s),
                _ => Err(bad()),
            })
            .collect(),
        Some(_) => Err(bad()),
    }
}

impl Common {
    /// The sampling settings and the refusals common to both endpoints. OpenAI's default
    /// temperature is 1; 0 is greedy.
    fn sampling(&self) -> Result<SamplingParams, ApiError> {
        if self.n.is_some_and(|n| n == 0 || n as usize > N_MAX) {
            return Err(ApiError::invalid(
                Some("n"),
                format!("n must be 1 to {N_MAX} (choices per prompt)"),
            ));
        }
        let mut temperature = self.temperature.unwrap_or(1.0);
        let top_p = self.top_p.unwrap_or(1.0);
        if top_p == 0.0 {
            // Only the most likely token is left.
            temperature = 0.0;
        }
        Ok(SamplingParams {
            temperature,
            top_k: self.top_k.unwrap_or(0) as usize,
            top_p: if top_p == 0.0 { 1.0 } else { top_p },
            min_p: self.min_p.unwrap_or(0.0),
            // Without a seed each request draws its own.
            seed: match self.seed {
                Some(s) => s as u64,
                None => fresh_seed(),
            },
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
        })
    }

    /// `logit_bias`: token ids (as strings, JSON keys) to a number in [-100, 100], in token
    /// order. Ids past the vocabulary are refused where the model is known.
    fn logit_bias(&self) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(m) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        let max = crate::text::sampler::LOGIT_BIAS_MAX;
        let mut out = Vec::with_capacity(m.len());
        for (k, v) in m {
            let bad = |what: String| ApiError::invalid(Some("logit_bias"), what);
            let t: u32 = k.trim().parse().map_err(|_| {
                bad(format!(
                    "logit_bias key {k:?} is not a token id (keys are token ids as strings: {{\"1234\": -100}})"
                ))
            })?;
            let b = v
                .as_f64()
                .filter(|b| b.abs() <= f64::from(max))
                .ok_or_else(|| {
                    bad(format!(
                        "logit_bias for token {t} must be a number in [-{max}, {max}]"
                    ))
                })?;
            out.push((t, b as f32));
        }
        out.sort_by_key(|&(t, _)| t);
        Ok(out)
    }

    /// What the text must be, from whichever field asks: OpenAI's `response_format`
    /// (`json_object`, `json_schema`), vLLM's `structured_outputs` and `guided_*`,
    /// llama-server's `grammar` and `json_schema`. At most one may; the grammar itself is
    /// checked when it is compiled for the model.
    fn format(&self) -> Result<Option<Format>, ApiError> {
        let mut found: Vec<Format> = Vec::new();
        let mut add = |grammar, param| found.push(Format { grammar, param });
        if let Some(f) = &self.response_format {
            if let Some(g) = response_format(f)? {
                add(g, "response_format");
            }
        }
        if let Some(so) = &self.structured_outputs {
            add(structured_outputs(so)?, "structured_outputs");
        }
        if let Some(v) = &self.guided_json {
            add(
                Grammar::JsonSchema(schema_value("guided_json", v)?),
                "guided_json",
            );
        }
        if let Some(r) = &self.guided_regex {
            add(Grammar::Regex(r.clone()), "guided_regex");
        }
        if let Some(g) = &self.guided_grammar {
            add(Grammar::Lark(g.clone()), "guided_grammar");
        }
        if let Some(c) = &self.guided_choice {
            add(Grammar::Choice(c.clone()), "guided_choice");
        }
        if let Some(g) = &self.grammar {
            add(Grammar::Lark(g.clone()), "grammar");
        }
        if let Some(v) = &self.json_schema {
            add(
                Grammar::JsonSchema(schema_value("json_schema", v)?),
                "json_schema",
            );
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|f| f.param).collect();
            return Err(ApiError::invalid(
                Some(found[1].param),
                format!("{} each constrain the text: give one", names.join(" and ")),
            ));
        }
        for f in &found {
            check_grammar(f)?;
        }
        Ok(found.pop())
    }

    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

/// A JSON schema given as an object, `true`, or JSON text (vLLM takes both).
fn schema_value(param: &'static str, v: &Value) -> Result<Value, ApiError> {
    match v {
        Value::String(text) => serde_json::from_str(text)
            .map_err(|e| ApiError::invalid(Some(param), format!("{param} is not JSON: {e}"))),
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        _ => Err(ApiError::invalid(
            Some(param),
            format!("{param} must be a JSON schema (an object)"),
        )),
    }
}

/// OpenAI's `response_format`: text (None), `json_object` (llama-server also takes a
/// `schema` beside it), `json_schema` with `json_schema.schema`.
fn response_format(f: &Value) -> Result<Option<Grammar>, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("response_format"), m);
    match f.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => match f.get("schema") {
            Some(s) => Ok(Some(Grammar::JsonSchema(schema_value(
                "response_format",
                s,
            )?))),
            None => Ok(Some(Grammar::JsonObject)),
        },
        Some("json_schema") => {
            let schema = f
                .get("json_schema")
                .and_then(|j| j.get("schema"))
                .ok_or_else(|| {
                    bad(
                        "response_format json_schema needs json_schema.schema (a JSON schema)"
                            .into(),
                    )
                })?;
            Ok(Some(Grammar::JsonSchema(schema_value(
                "response_format",
                schema,
            )?)))
        }
        kind => Err(bad(format!(
            "response_format {} is not one of text, json_object, json_schema",
            kind.map_or("without a type".to_string(), |k| format!("{k:?}"))
        ))),
    }
}

/// vLLM's `structured_outputs`: exactly one of json, regex, grammar, choice, json_object.
fn structured_outputs(so: &Value) -> Result<Grammar, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("structured_outputs"), m);
    let Some(m) = so.as_object() else {
        return Err(bad("structured_outputs must be an object".into()));
    };
    let given: Vec<(&String, &Value)> = m.iter().filter(|(_, v)| !v.is_null()).collect();
    let [(key, v)] = given.as_slice() else {
        return Err(bad(format!(
            "structured_outputs needs exactly one of json, regex, grammar, choice, json_object (it has {})",
            if given.is_empty() { "none".to_string() } else { given.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(", ") }
        )));
    };
    let text = |v: &Value| {
        v.as_str()
            .map(str::to_string)
            .ok_or_else(|| bad(format!("structured_outputs.{key} must be a string")))
    };
    match key.as_str() {
        "json" => Ok(Grammar::JsonSchema(schema_value("structured_outputs", v)?)),
        "regex" => Ok(Grammar::Regex(text(v)?)),
        "grammar" => Ok(Grammar::Lark(text(v)?)),
        "choice" => serde_json::from_value::<Vec<String>>((*v).clone())
            .map(Grammar::Choice)
            .map_err(|_| bad("structured_outputs.choice must be a list of strings".into())),
        "json_object" if v.as_bool() == Some(true) => Ok(Grammar::JsonObject),
        k => Err(bad(format!(
            "structured_outputs.{k} is not supported (json, regex, grammar, choice, json_object)"
        ))),
    }
}

/// What can be refused before the model is known: an empty grammar or choice list.
fn check_grammar(f: &Format) -> Result<(), ApiError> {
    let empty = match &f.grammar {
        Grammar::Regex(r) => r.is_empty().then_some("an empty regex"),
        Grammar::Lark(g) => g.trim().is_empty().then_some("an empty grammar"),
        Grammar::Choice(c) => c.is_empty().then_some("an empty choice list"),
        Grammar::JsonObject | Grammar::JsonSchema(_) => None,
    };
    match empty {
        Some(what) => Err(ApiError::invalid(
            Some(f.param),
            format!("{}: {what} allows no text", f.param),
        )),
        None => Ok(()),
    }
}

/// A seed nobody chose: the standard library's per-process random keys, hashed with the
/// time so each call differs.
fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(t);
    h.finish()
}

/// A message's content: a string, or a list of parts of which only text is understood.
fn content_text(i: usize, v: Option<&Value>) -> Result<String, ApiError> {
    let bad = |m: String| ApiError::invalid(Some("messages"), format!("messages[{i}]: {m}"));
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (Some(t), _) if t != "text" => {
                        return Err(bad(format!(
                            "content of type {t:?} is not supported (text only)"
                        )))
                    }
                    _ => {
                        return Err(bad(
                            "a content part needs \"type\": \"text\" and \"text\"".into()
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(bad("content must be a string or a list of parts".into())),
    }
}

pub(crate) fn messages(list: Vec<Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let mut calls_seen: Vec<String> = Vec::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.into_iter().enumerate() {
        let bad = |m: String| ApiError::invalid(Some("messages"), format!("messages[{i}]{m}"));
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(" has no role".into()))?;
        let role = match role {
            "system" | "user" | "assistant" | "tool" => role,
            // OpenAI's newer name for the system role.
            "developer" => "system",
            r => {
                return Err(bad(format!(
                    ": unknown role {r:?} (system, developer, user, assistant or tool)"
                )))
            }
        };
        let mut msg = ChatMessage::new(role, content_text(i, m.get("content"))?);
        if let Some(calls) = m.get("tool_calls").filter(|t| !t.is_null()) {
            if role != "assistant" {
                return Err(bad(
                    ".tool_calls: only an assistant message makes calls".into()
                ));
            }
            msg.tool_calls = tool_calls(calls).map_err(|e| bad(format!(".tool_calls{e}")))?;
            calls_seen.extend(
                msg.tool_calls
                    .iter()
                    .filter_map(|c| c["id"].as_str().map(str::to_string)),
            );
        }
        if let Some(r) = ["reasoning_content", "thinking", "reasoning"]
            .iter()
            .find_map(|k| m.get(*k).filter(|v| !v.is_null()))
        {
            let r = r.as_str().filter(|_| role == "assistant").ok_or_else(|| {
                bad(".reasoning_content: an assistant message's reasoning, as text".into())
            })?;
            msg.reasoning_content = Some(r.to_string());
            msg.thinking = Some(r.to_string());
        }
        if role == "tool" {
            let id = m
                .get("tool_call_id")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    bad(".tool_call_id: a tool message answers a call: give its id".into())
                })?;
            if !calls_seen.iter().any(|c| c == id) {
                return Err(ApiError::invalid(
                    Some("messages"),
                    format!("messages[{i}].tool_call_id {id:?} matches no call of an earlier assistant message"),
                ));
            }
            msg.tool_call_id = Some(id.to_string());
        }
        out.push(msg);
    }
    Ok(out)
}

/// An assistant message's `tool_calls` as templates take them (transformers' shape: the
/// arguments an object, not OpenAI's JSON text). An error reads after the field's name.
fn tool_calls(v: &Value) -> Result<Vec<Value>, String> {
    let list = v.as_array().ok_or(": must be a list")?;
    list.iter()
        .enumerate()
        .map(|(j, c)| {
            let id = c.get("id").and_then(Value::as_str).ok_or(format!("[{j}].id is missing"))?;
            let f = c.get("function").ok_or(format!("[{j}].function is missing"))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or(format!("[{j}].function.name is missing"))?;
            let arguments = match f.get("arguments") {
                Some(Value::String(text)) => serde_json::from_str::<Value>(text)
                    .map_err(|e| format!("[{j}].function.arguments is not JSON: {e}"))?,
                Some(o @ Value::Object(_)) => o.clone(),
                None | Some(Value::Null) => json!({}),
                Some(_) => return Err(format!("[{j}].function.arguments must be JSON text")),
            };
            Ok(json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}))
        })
        .collect()
}

pub fn parse_chat(body: &[u8]) -> Result<Call, ApiError> {
    let b: ChatBody = serde_json::from_slice(body).map_err(body_error)?;
    let logprobs = match (b.logprobs.unwrap_or(false), b.top_logprobs) {
        (true, top) => Some(top.unwrap_or(0) as usize),
        (false, Some(n)) if n > 0 => {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                "top_logprobs needs logprobs: true",
            ))
        }
        (false, _) => None,
    };
    let tools = match (&b.tools, &b.tool_choice) {
        (None, None) => None,
        (t, choice) => Some(
            Tools::parse(
                t.as_deref().unwrap_or_default(),
                choice.as_ref(),
                b.parallel_tool_calls,
            )
            .map_err(|(field, m)| ApiError::invalid(Some(field), m))?,
        ),
    };
    let sampling = b.common.sampling()?;
    let (logit_bias, format) = (b.common.logit_bias()?, b.common.format()?);
    let c = b.common;
    Ok(Call {
        keep_alive: keep_alive(c.keep_alive.as_ref())?,
        model: c.model.clone().unwrap_or_default(),
        include_usage: c.include_usage(),
        stream: c.stream.unwrap_or(false),
        n: c.n.unwrap_or(1) as usize,
        inputs: vec![GenerateInput {
            model: c.model.unwrap_or_default(),
            prompt: Prompt::Messages(messages(b.messages)?, Vec::new()),
            max_tokens: b.max_completion_tokens.or(c.max_tokens),
            sampling,
            stop: stop_list(c.stop)?,
            logprobs,
            truncate: false,
            logit_bias,
            format,
            tools,
        }],
    })
}

/// A token id list.
fn ids(v: &[Value]) -> Option<Vec<u32>> {
    v.iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect()
}

/// The prompt of a completion: a string, a list of strings, a list of token ids or a list
/// of token id lists.
fn prompts(v: Value, max: usize) -> Result<Vec<Prompt>, ApiError> {
    let bad = || {
        ApiError::invalid(
            Some("prompt"),
            "prompt must be a string, a list of strings, a list of token ids or a list of token id lists",
        )
    };
    let out = match v {
        Value::String(s) => vec![Prompt::Text(s)],
        Value::Array(a) if a.is_empty() => return Err(bad()),
        Value::Array(a) => match &a[0] {
            Value::String(_) => a
                .into_iter()
                .map(|s| match s {
                    Value::String(s) => Ok(Prompt::Text(s)),
                    _ => Err(bad()),
                })
                .collect::<Result<_, _>>()?,
            Value::Number(_) => vec![Prompt::Ids(ids(&a).ok_or_else(bad)?)],
            Value::Array(_) => a
                .iter()
                .map(|p| {
                    p.as_array()
                        .and_then(|p| ids(p))
                        .map(Prompt::Ids)
                        .ok_or_else(bad)
                })
                .collect::<Result<_, _>>()?,
            _ => return Err(bad()),
        },
        _ => return Err(bad()),
    };
    if out.len() > max {
        return Err(ApiError::invalid(
            Some("prompt"),
            format!("{} prompts; at most {max} in one request", out.len()),
        ));
    }
    Ok(out)
}

/// OpenAI's default for `/v1/completions` when max_tokens is not given.
pub const COMPLETION_MAX_TOKENS_DEFAULT: u32 = 16;

pub fn parse_completion(body: &[u8], max_prompts: usize) -> Result<Call, ApiError> {
    let b: CompletionBody = serde_json::from_slice(body).map_err(body_error)?;
    // The legacy endpoint's limit.
    if b.logprobs.is_some_and(|n| n > 5) {
        return Err(ApiError::invalid(
            Some("logprobs"),
            "logprobs must be 0 to 5",
        ));
    }
    if b.echo == Some(true) {
        return Err(unsupported("echo", "echo"));
    }
    if b.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(unsupported("suffix", "suffix (fill in the middle)"));
    }
    if b.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid(Some("best_of"), "best_of must be 1"));
    }
    let sampling = b.common.sampling()?;
    let (logit_bias, format) = (b.common.logit_bias()?, b.common.format()?);
    let c = b.common;
    let stop = stop_list(c.stop)?;
    let model = c.model.unwrap_or_default();
    let max_tokens = c.max_tokens.unwrap_or(COMPLETION_MAX_TOKENS_DEFAULT);
    let n = c.n.unwrap_or(1) as usize;
    Ok(Call {
        keep_alive: keep_alive(c.keep_alive.as_ref())?,
        model: model.clone(),
        include_usage: c.stream_options.as_ref().and_then(|o| o.include_usage) == Some(true),
        stream: c.stream.unwrap_or(false),
        inputs: prompts(b.prompt, max_prompts)?
            .into_iter()
            .map(|prompt| GenerateInput {
                model: model.clone(),
                prompt,
                max_tokens: Some(max_tokens),
                sampling,
                stop: stop.clone(),
                logprobs: b.logprobs.map(|n| n as usize),
                truncate: false,
                logit_bias: logit_bias.clone(),
                format: format.clone(),
                tools: None,
            })
            .collect(),
        n,
    })
}

/// OpenAI's finish reasons: an end token or a stop string is `stop`, a token limit
/// (max_tokens or the context) is `length`. Cancelled has none: the wire reports it as an
/// error.
pub fn finish_reason(f: Finish) -> Option<&'static str> {
    match f {
        Finish::Stop | Finish::StopString => Some("stop"),
        Finish::Length | Finish::Context => Some("length"),
        Finish::Cancelled => None,
    }
}

/// HTTP status, OpenAI error type and code of an error kind.
pub fn error_shape(kind: ErrorKind) -> (u16, &'static str, Option<&'static str>) {
    match kind {
        ErrorKind::Invalid => (400, "invalid_request_error", None),
        ErrorKind::ModelNotFound => (404, "invalid_request_error", Some("model_not_found")),
        ErrorKind::Unauthenticated => (401, "invalid_request_error", Some("invalid_api_key")),
        ErrorKind::QueueFull => (429, "rate_limit_error", Some("queue_full")),
        ErrorKind::Unavailable => (503, "server_error", Some("unavailable")),
        ErrorKind::DataLoss => (500, "server_error", Some("data_loss")),
        ErrorKind::Internal => (500, "server_error", None),
    }
}

/// `{"error": {"message", "type", "param", "code"}}`.
pub fn error_body(e: &ApiError) -> Value {
    let (_, kind, code) = error_shape(e.kind);
    json!({"error": {"message": e.message, "type": kind, "param": e.param, "code": code}})
}

/// OpenAI's usage object; `cached`: prompt tokens served from the prefix cache.
pub fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bodies_parse_into_the_shared_input_and_unsupported_fields_are_named() {
        let c = parse_chat(br#"{"model":"m","messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},{"role":"user","content":"hi"}],"temperature":0,"stop":"x","max_completion_tokens":5,"stream":true,"stream_options":{"include_usage":true},"user":"ignored"}"#).expect("a valid body");
        assert!(c.stream && c.include_usage);
        let i = &c.inputs[0];
        assert_eq!(
            (i.max_tokens, i.stop.as_slice()),
            (Some(5), &["x".to_string()][..])
        );
        assert_eq!(i.sampling.temperature, 0.0);
        let Prompt::Messages(m, _) = &i.prompt else {
            panic!("messages")
        };
        assert_eq!(
            (m[0].role.as_str(), m[0].content.as_str()),
            ("system", "a\nb")
        );
        for (body, param) in [
            (&br#"{"messages":[],"n":0}"#[..], "n"),
            (br#"{"messages":[],"n":129}"#, "n"),
            (br#"{"messages":[],"top_logprobs":2}"#, "top_logprobs"),
            (br#"{"messages":[],"logit_bias":{"x":5}}"#, "logit_bias"),
            (br#"{"messages":[],"logit_bias":{"1":101}}"#, "logit_bias"),
            (br#"{"messages":[],"logit_bias":{"1":"5"}}"#, "logit_bias"),
            (
                br#"{"messages":[],"response_format":{"type":"json_schema"}}"#,
                "response_format",
            ),
            (
                br#"{"messages":[],"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":5}}}"#,
                "response_format",
            ),
            (
                br#"{"messages":[],"response_format":{}}"#,
                "response_format",
            ),
            (br#"{"messages":[],"tools":[{"type":"function"}]}"#, "tools"),
            (
                br#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                "messages",
            ),
            (br#"{"messages":[],"stop":[1]}"#, "stop"),
        ] {
            let e = parse_chat(body).err().expect("refused");
            assert_eq!(e.param, Some(param), "{}", e.message);
        }
        let e = parse_chat(br#"{"messages":"hi"}"#).err().expect("refused");
        assert!(e.message.contains("invalid type"), "{}", e.message);
        let c = parse_completion(br#"{"prompt":[[1,2],[3]]}"#, 8).expect("token id lists");
        assert_eq!(c.inputs.len(), 2);
        assert_eq!(c.inputs[0].max_tokens, Some(COMPLETION_MAX_TOKENS_DEFAULT));
        assert!(matches!(&c.inputs[1].prompt, Prompt::Ids(v) if v == &[3]));
        assert!(parse_completion(br#"{"prompt":["a","b","c"]}"#, 2).is_err());
        // n choices a prompt: one input a prompt still (the front end submits n of each).
        let c = parse_completion(br#"{"prompt":["a","b"],"n":3,"seed":7}"#, 8).expect("n");
        assert_eq!((c.n, c.inputs.len(), c.inputs[1].sampling.seed), (3, 2, 7));
        let c = parse_chat(br#"{"messages":[{"role":"user","content":"x"}],"n":2}"#).expect("n");
        assert_eq!((c.n, c.inputs.len()), (2, 1));
        assert!(parse_completion(br#"{"prompt":[1,-2]}"#, 2).is_err());
        // Biases come in token order; JSON mode on either endpoint.
        let c = parse_chat(br#"{"messages":[],"logit_bias":{"70":-100,"3":2.5},"response_format":{"type":"json_object"}}"#).expect("bias");
        let i = &c.inputs[0];
        assert_eq!(i.logit_bias, [(3, 2.5), (70, -100.0)]);
        assert!(
            matches!(&i.format, Some(f) if f.grammar == Grammar::JsonObject && f.param == "response_format")
        );
        let c = parse_completion(
            br#"{"prompt":["a","b"],"logit_bias":{"9":1},"response_format":{"type":"text"}}"#,
            8,
        )
        .expect("bias");
        assert!(c
            .inputs
            .iter()
            .all(|i| i.logit_bias == [(9, 1.0)] && i.format.is_none()));
    }

    /// Every way the field has of asking for a constraint reaches the same grammar, and two
    /// at once are refused, naming both.
    #[test]
    fn constraints_arrive_from_every_field() {
        let chat = |extra: &str| {
            parse_chat(
                format!(r#"{{"messages":[{{"role":"user","content":"x"}}],{extra}}}"#).as_bytes(),
            )
        };
        let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 2}}});
        for (extra, param, want) in [
            (
                format!(
                    r#""response_format":{{"type":"json_schema","json_schema":{{"name":"x","schema":{schema}}}}}"#
                ),
                "response_format",
                Grammar::JsonSchema(schema.clone()),
            ),
            (
                format!(r#""response_format":{{"type":"json_object","schema":{schema}}}"#),
                "response_format",
                Grammar::JsonSchema(schema.clone()),
            ),
            (
                format!(r#""guided_json":{schema}"#),
                "guided_json",
                Grammar::JsonSchema(schema.clone()),
            ),
            (
                format!(
                    r#""guided_json":{}"#,
                    serde_json::Value::from(schema.to_string())
                ),
                "guided_json",
                Grammar::JsonSchema(schema.clone()),
            ),
            (
                format!(r#""json_schema":{schema}"#),
                "json_schema",
                Grammar::JsonSchema(schema.clone()),
            ),
            (
                format!(r#""structured_outputs":{{"json":{schema}}}"#),
                "structured_outputs",
                Grammar::JsonSchema(schema.clone()),
            ),
            (
                r#""structured_outputs":{"regex":"a+b"}"#.into(),
                "structured_outputs",
                Grammar::Regex("a+b".into()),
            ),
            (
                r#""guided_regex":"a+b""#.into(),
                "guided_regex",
                Grammar::Regex("a+b".into()),
            ),
            (
                r#""structured_outputs":{"grammar":"start: \"x\""}"#.into(),
                "structured_outputs",
                Grammar::Lark("start: \"x\"".into()),
            ),
            (
                r#""guided_grammar":"start: \"x\"""#.into(),
                "guided_grammar",
                Grammar::Lark("start: \"x\"".into()),
            ),
            (
                r#""grammar":"start: \"x\"""#.into(),
                "grammar",
                Grammar::Lark("start: \"x\"".into()),
            ),
            (
                r#""structured_outputs":{"choice":["a","b"]}"#.into(),
                "structured_outputs",
                Grammar::Choice(vec!["a".into(), "b".into()]),
            ),
            (
                r#""guided_choice":["a","b"]"#.into(),
                "guided_choice",
                Grammar::Choice(vec!["a".into(), "b".into()]),
            ),
            (
                r#""structured_outputs":{"json_object":true}"#.into(),
                "structured_outputs",
                Grammar::JsonObject,
            ),
        ] {
            let c = chat(&extra).unwrap_or_else(|e| panic!("{extra}: {}", e.message));
            let f = c.inputs[0].format.as_ref().expect("a constraint");
            assert_eq!((&f.grammar, f.param), (&want, param), "{extra}");
        }
        for (extra, param, says) in [
            (
                r#""guided_regex":"a","grammar":"start: \"x\"""#,
                "grammar",
                "guided_regex and grammar",
            ),
            (
                r#""structured_outputs":{"regex":"a","choice":["b"]}"#,
                "structured_outputs",
                "exactly one",
            ),
            (
                r#""structured_outputs":{"xml":"a"}"#,
                "structured_outputs",
                "structured_outputs.xml",
            ),
            (r#""guided_choice":[]"#, "guided_choice", "empty choice"),
            (r#""guided_json":"{not json""#, "guided_json", "not JSON"),
            (
                r#""response_format":{"type":"yaml"}"#,
                "response_format",
                "\"yaml\"",
            ),
        ] {
            let e = chat(extra)
                .err()
                .unwrap_or_else(|| panic!("{extra} accepted"));
            assert_eq!(e.param, Some(param), "{extra}: {}", e.message);
            assert!(e.message.contains(says), "{extra}: {}", e.message);
        }
    }
}
