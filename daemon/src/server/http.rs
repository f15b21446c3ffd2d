//! The OpenAI-compatible HTTP API, on axum/hyper beside gRPC in the same process and the
//! same scheduler (HTTP and gRPC requests share passes): `POST /v1/chat/completions`,
//! `POST /v1/completions` (both with server-sent events when `stream`), `GET /v1/models`,
//! `GET /health` (503 until the model is loaded and once shutdown starts) and
//! `GET /metrics` (Prometheus). The listener comes up before the model loads so that
//! probes see "loading" rather than a refused connection.
//!
//! A streamed request is pumped by a task of its own from the engine's events into the
//! response body; a client that goes away closes the body, the task sees it at once and
//! drops the events, and the engine evicts the sequence before its next step.

use super::api::{ApiError, ErrorKind, Events, Frontend, Hold, RequestLimits};
use super::auth::ApiKeys;
use super::metrics::{Api, Metrics};
use super::models::{Listing, Models};
use super::openai::{self, Call};
use crate::engine::scheduler::Event;
use crate::text::answer::ToolEvent;
use crate::text::tool_parse::{self, Syntax, ToolParser};
use crate::text::{TokenLogprob, Tokenizer};
use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use tokio::sync::mpsc;
use tokio_stream::{StreamExt, StreamMap};

/// Which paths answer without a key.
#[derive(Clone, Copy, Debug)]
pub struct Public {
    pub health: bool,
    pub metrics: bool,
}

pub struct HttpState {
    models: OnceLock<Arc<Models>>,
    draining: AtomicBool,
    keys: Arc<ApiKeys>,
    public: Public,
    metrics: Arc<Metrics>,
    limits: RequestLimits,
}

impl HttpState {
    pub fn new(
        keys: Arc<ApiKeys>,
        public: Public,
        metrics: Arc<Metrics>,
        limits: RequestLimits,
    ) -> Arc<HttpState> {
        Arc::new(HttpState {
            models: OnceLock::new(),
            draining: AtomicBool::new(false),
            keys,
            public,
            metrics,
            limits,
        })
    }

    /// The models are ready (the daemon's --model loaded): requests are served from now on.
    pub fn set_ready(&self, m: Arc<Models>) {
        let _ = self.models.set(m);
    }

    /// Shutdown began: /health answers 503 and new requests are refused.
    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    fn models(&self) -> Result<&Arc<Models>, ApiError> {
        if self.draining.load(Ordering::Acquire) {
            return Err(ApiError::new(
                ErrorKind::Unavailable,
                "the daemon is shutting down",
            ));
        }
        self.models.get().ok_or_else(|| {
            ApiError::new(
                ErrorKind::Unavailable,
                "the model is still loading; GET /health answers 200 once it is served",
            )
        })
    }

    fn authorize(&self, h: &HeaderMap) -> Result<(), ApiError> {
        self.keys
            .check(h.get(header::AUTHORIZATION).map(HeaderValue::as_bytes))
    }

    /// An error answered before the request reached the frontend (which counts its own).
    fn refuse(&self, e: ApiError) -> Response {
        self.metrics.request(Api::Http, e.kind.outcome());
        error_response(&e)
    }
}

pub fn router(state: Arc<HttpState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/cache/clear", post(clear_cache))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

pub fn error_response(e: &ApiError) -> Response {
    let (code, _, _) = openai::error_shape(e.kind);
    let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = json_response(status, &openai::error_body(e));
    if e.kind == ErrorKind::QueueFull {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

async fn not_found(uri: axum::http::Uri) -> Response {
    error_response(&ApiError::new(
        ErrorKind::Invalid,
        format!("no route {}: this daemon serves /v1/chat/completions, /v1/completions, /v1/models, /health and /metrics", uri.path()),
    ))
    .map_status(StatusCode::NOT_FOUND)
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> Response {
    error_response(&ApiError::new(
        ErrorKind::Invalid,
        format!("{method} is not allowed on {}", uri.path()),
    ))
    .map_status(StatusCode::METHOD_NOT_ALLOWED)
}

trait MapStatus {
    fn map_status(self, s: StatusCode) -> Self;
}

impl MapStatus for Response {
    fn map_status(mut self, s: StatusCode) -> Response {
        *self.status_mut() = s;
        self
    }
}

async fn health(State(s): State<Arc<HttpState>>, h: HeaderMap) -> Response {
    if !s.public.health {
        if let Err(e) = s.authorize(&h) {
            return error_response(&e);
        }
    }
    match s.models() {
        Ok(_) => json_response(StatusCode::OK, &json!({"status": "ok"})),
        Err(e) => {
            let status = if s.draining.load(Ordering::Acquire) {
                "shutting_down"
            } else {
                "loading"
            };
            let mut body = openai::error_body(&e);
            body["status"] = json!(status);
            json_response(StatusCode::SERVICE_UNAVAILABLE, &body)
        }
    }
}

async fn metrics(State(s): State<Arc<HttpState>>, h: HeaderMap) -> Response {
    if !s.public.metrics {
        if let Err(e) = s.authorize(&h) {
            return error_response(&e);
        }
    }
    let Some(m) = s.models.get() else {
        return error_response(&ApiError::new(
            ErrorKind::Unavailable,
            "the model is still loading",
        ));
    };
    let current = m.current();
    let status = current.as_ref().map(|c| c.front.sched.status());
    let model = current
        .as_ref()
        .zip(status.as_ref())
        .map(|(c, st)| (st, &c.stat));
    let text = s.metrics.render(model, m.loaded_count());
    (
        StatusCode::OK,
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

fn model_object(m: &Models, l: &Listing) -> Value {
    json!({
        "id": l.name,
        "object": "model",
        "created": l.created,
        "owned_by": "sluice",
        "max_model_len": m.cfg.max_context,
        "loaded": l.loaded,
        "architecture": l.info.architecture,
        "quantization": l.info.quantization,
        "stored_bytes": l.info.stored_bytes,
    })
}

async fn models(State(s): State<Arc<HttpState>>, h: HeaderMap) -> Response {
    match s.authorize(&h).and_then(|()| s.models()) {
        Ok(m) => {
            let data: Vec<Value> = m.list(false).iter().map(|l| model_object(m, l)).collect();
            json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
        }
        Err(e) => error_response(&e),
    }
}

/// POST /v1/cache/clear (`{"model": NAME}`, or no body: every loaded model): empties the
/// prefix cache; answers `{"cleared": [{"model", "positions"}]}`.
async fn clear_cache(
    State(s): State<Arc<HttpState>>,
    h: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let model = match serde_json::from_slice::<Value>(&body) {
        _ if body.iter().all(u8::is_ascii_whitespace) => Ok(String::new()),
        Ok(Value::Object(o)) => match o.get("model") {
            None => Ok(String::new()),
            Some(Value::String(m)) => Ok(m.clone()),
            Some(_) => Err("model must be a string"),
        },
        _ => Err("the body must be a JSON object, {\"model\": NAME}, or empty"),
    }
    .map_err(|m| ApiError::new(ErrorKind::Invalid, m));
    let r = match (s.authorize(&h).and_then(|()| s.models()), model) {
        (Ok(m), Ok(model)) => m.clear_prefix_caches(&model).await,
        (Err(e), _) | (_, Err(e)) => Err(e),
    };
    match r {
        Ok(c) => {
            let cleared: Vec<Value> = c
                .into_iter()
                .map(|(model, positions)| json!({"model": model, "positions": positions}))
                .collect();
            json_response(StatusCode::OK, &json!({"cleared": cleared}))
        }
        Err(e) => error_response(&e),
    }
}

async fn model(State(s): State<Arc<HttpState>>, h: HeaderMap, Path(id): Path<String>) -> Response {
    let r = s.authorize(&h).and_then(|()| s.models()).and_then(|m| {
        // The name as requests use it: unknown names get the same 404 as a request.
        let (name, _) = m.loaded(&id)?;
        m.list(false)
            .into_iter()
            .find(|l| l.name == name)
            .map(|l| model_object(m, &l))
            .ok_or_else(|| ApiError::new(ErrorKind::ModelNotFound, format!("no model {id:?}")))
    });
    match r {
        Ok(v) => json_response(StatusCode::OK, &v),
        Err(e) => error_response(&e),
    }
}

/// Authorizes, reads the body within the limit, parses it and finds (or loads) the model
/// it names; the hold keeps the model loaded until the request is submitted.
async fn accept(
    s: &HttpState,
    h: &HeaderMap,
    body: Body,
    parse: impl FnOnce(&[u8], &RequestLimits) -> Result<Call, ApiError>,
) -> Result<(Arc<Frontend>, Hold, Call), Response> {
    s.authorize(h).map_err(|e| s.refuse(e))?;
    let models = s.models().map_err(|e| s.refuse(e))?.clone();
    let limit = s.limits.max_request_bytes;
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|e| {
        s.refuse(ApiError::invalid(
            None,
            format!(
                "the request body could not be read within {limit} bytes (max_request_bytes): {e}"
            ),
        ))
    })?;
    let call = parse(&bytes, &s.limits).map_err(|e| s.refuse(e))?;
    let (served, hold) = models
        .resolve(&call.model, call.keep_alive)
        .await
        .map_err(|e| s.refuse(e))?;
    Ok((served.front.clone(), hold, call))
}

async fn chat(State(s): State<Arc<HttpState>>, h: HeaderMap, body: Body) -> Response {
    let (front, _hold, call) = match accept(&s, &h, body, |b, _| openai::parse_chat(b)).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    run(front, call, Kind::Chat).await
}

async fn completions(State(s): State<Arc<HttpState>>, h: HeaderMap, body: Body) -> Response {
    let parse = |b: &[u8], l: &RequestLimits| openai::parse_completion(b, l.max_messages);
    let (front, _hold, call) = match accept(&s, &h, body, parse).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    run(front, call, Kind::Completion).await
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// What every chunk and response of one request repeats.
#[derive(Clone)]
struct Head {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
    tok: Arc<Tokenizer>,
    /// Choices per prompt (`n`): a prompt's tokens count once in the usage.
    n: usize,
    /// How a chat answer is read back: the calls of the tools offered, a harmony model's
    /// channels (`Frontend::answer_syntax`); None: plain text.
    answer: Option<Syntax>,
}

impl Head {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Completion, _) => "text_completion",
        }
    }

    /// One choice's part of a stream chunk.
    fn choice_delta(
        &self,
        index: usize,
        text: Option<&str>,
        logprobs: Value,
        finish: Option<&str>,
    ) -> Value {
        match self.kind {
            Kind::Chat => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Kind::Completion => {
                json!({"index": index, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish})
            }
        }
    }

    /// A chat choice's message and finish reason: the text read back into reasoning
    /// (`reasoning_content`, as llama.cpp and vLLM name it), content and calls
    /// (`tool_calls`, the finish reason `tool_calls` when the model ended after them).
    fn message(&self, text: String, finish: &'static str) -> (Value, &'static str) {
        let Some(syntax) = self.answer else {
            return (json!({"role": "assistant", "content": text}), finish);
        };
        let a = tool_parse::parse_all(syntax, &text);
        let mut m = json!({"role": "assistant", "content": a.content});
        if let Some(r) = a.reasoning {
            m["reasoning_content"] = json!(r);
        }
        if a.calls.is_empty() {
            if m["content"].is_null() {
                m["content"] = json!("");
            }
            return (m, finish);
        }
        let calls: Vec<Value> = a
            .calls
            .into_iter()
            .map(|(id, name, arguments)| {
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
            })
            .collect();
        m["tool_calls"] = json!(calls);
        let finish = if finish == "stop" {
            "tool_calls"
        } else {
            finish
        };
        (m, finish)
    }

    /// A stream's deltas for a parser's events (content, reasoning, a call's id and name
    /// with empty arguments, then its arguments in pieces, as OpenAI streams them).
    fn tool_deltas(&self, index: usize, events: Vec<ToolEvent>) -> Vec<Value> {
        events
            .into_iter()
            .map(|e| {
                let delta = match e {
                    ToolEvent::Text(t) => json!({"content": t}),
                    ToolEvent::Reasoning(t) => json!({"reasoning_content": t}),
                    ToolEvent::Call { index: i, id, name } => json!({"tool_calls": [
                        {"index": i, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                    ToolEvent::Args { index: i, text } => json!({"tool_calls": [
                        {"index": i, "function": {"arguments": text}}]}),
                };
                json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": null})
            })
            .collect()
    }

    fn entry(&self, id: u32, logprob: f32) -> Value {
        let b = self.tok.token_bytes(id);
        json!({"token": String::from_utf8_lossy(&b), "logprob": logprob, "bytes": b})
    }

    /// Log-probabilities of a piece's tokens in the endpoint's shape (null when none were
    /// asked for): chat's `{"content": [{token, logprob, bytes, top_logprobs}]}`, the legacy
    /// `{tokens, token_logprobs, top_logprobs, text_offset}` with offsets counted from
    /// `offset` (the characters of the choice's text so far).
    fn logprobs(&self, lps: &[TokenLogprob], offset: &mut usize) -> Value {
        if lps.is_empty() {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => {
                let content: Vec<Value> = lps
                    .iter()
                    .map(|l| {
                        let mut e = self.entry(l.id, l.logprob);
                        e["top_logprobs"] =
                            l.top.iter().map(|&(i, lp)| self.entry(i, lp)).collect();
                        e
                    })
                    .collect();
                json!({ "content": content })
            }
            Kind::Completion => {
                let mut tokens = Vec::with_capacity(lps.len());
                let mut offsets = Vec::with_capacity(lps.len());
                for l in lps {
                    let t = String::from_utf8_lossy(&self.tok.token_bytes(l.id)).into_owned();
                    offsets.push(*offset);
                    *offset += t.chars().count();
                    tokens.push(t);
                }
                let top: Vec<Value> = lps
                    .iter()
                    .map(|l| {
                        let m: serde_json::Map<String, Value> = l
                            .top
                            .iter()
                            .map(|&(i, lp)| {
                                let t =
                                    String::from_utf8_lossy(&self.tok.token_bytes(i)).into_owned();
                                (t, json!(lp))
                            })
                            .collect();
                        Value::Object(m)
                    })
                    .collect();
                json!({
                    "tokens": tokens,
                    "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            }
        }
    }

    fn chunk(&self, choices: Vec<Value>, usage: Option<Value>, with_usage: bool) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        });
        if with_usage {
            v["usage"] = usage.unwrap_or(Value::Null);
        }
        v
    }
}

/// A request id, unique in this process and not guessable from the outside: a random
/// salt drawn once, then a counter.
fn request_id(prefix: &str) -> String {
    static SALT: OnceLock<u64> = OnceLock::new();
    static N: AtomicU64 = AtomicU64::new(0);
    let salt = *SALT.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish()
    });
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}-{salt:016x}{n:08x}")
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The error a request's end becomes when it did not end by itself.
fn cut_off(generated: usize) -> ApiError {
    ApiError::new(
        ErrorKind::Unavailable,
        format!("the daemon is shutting down: the completion was cancelled after {generated} tokens; send it again"),
    )
}

fn failed(failure: crate::engine::Failure, message: String) -> ApiError {
    ApiError::new(ErrorKind::of_failure(failure), message)
}

/// Submits `n` sequences of every prompt of the call: every prompt is checked first (a bad
/// one is its 400 whatever the queue holds), then places are held for all of them (a call
/// that does not fit the queue is refused whole, 429), then each is queued. Returns each
/// sequence's events, prompt by prompt, and the prompt tokens (each prompt's once).
fn submit_all(
    front: &Frontend,
    api: Api,
    inputs: Vec<super::api::GenerateInput>,
    n: usize,
) -> Result<(Vec<Events>, usize), ApiError> {
    let prepared = inputs
        .into_iter()
        .map(|i| front.check(api, i))
        .collect::<Result<Vec<_>, _>>()?;
    let sequences = prepared.len().saturating_mul(n);
    let mut places = front.reserve(api, sequences)?;
    let mut events = Vec::with_capacity(sequences);
    let mut prompt_tokens = 0;
    for p in prepared {
        let subs = front.submit_in(&mut places, api, p, n)?;
        prompt_tokens += subs.first().map_or(0, |s| s.prompt_tokens);
        events.extend(subs.into_iter().map(|s| s.events));
    }
    Ok((events, prompt_tokens))
}

fn head(front: &Frontend, kind: Kind, n: usize) -> Head {
    Head {
        id: request_id(if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        }),
        created: unix_now(),
        model: front.meta.name.clone(),
        kind,
        tok: front.sched.tokenizer.clone(),
        n: n.max(1),
        answer: None,
    }
}

/// How the call's chat answers are read back (`Frontend::answer_syntax`).
fn answer_of(front: &Frontend, call: &Call, kind: Kind) -> Option<Syntax> {
    let tools = call.inputs.first().and_then(|i| i.tools.as_ref());
    front.answer_syntax(kind == Kind::Chat, tools)
}

/// Submits every prompt of the call; answers with one JSON response or a stream.
async fn run(front: Arc<Frontend>, call: Call, kind: Kind) -> Response {
    let answer = answer_of(&front, &call, kind);
    let (events, prompt_tokens) = match submit_all(&front, Api::Http, call.inputs, call.n) {
        Ok(r) => r,
        Err(e) => return error_response(&e),
    };
    let mut head = head(&front, kind, call.n);
    head.answer = answer;
    if call.stream {
        stream(head, events, call.include_usage)
    } else {
        match complete(head, events, prompt_tokens).await {
            Ok(v) => json_response(StatusCode::OK, &v),
            Err(e) => error_response(&e),
        }
    }
}

/// One OpenAI request answered as `POST url` would be, without streaming: the HTTP status
/// and the JSON body. The gRPC `Complete` call (batch jobs) comes here; `truncate` cuts
/// prompts that do not fit instead of refusing them.
pub async fn call_json(
    models: &Arc<Models>,
    metrics: &Metrics,
    limits: &RequestLimits,
    api: Api,
    url: &str,
    body: &[u8],
    truncate: bool,
) -> (u16, Value) {
    let answer = |e: ApiError| (openai::error_shape(e.kind).0, openai::error_body(&e));
    let refuse = |e: ApiError| {
        metrics.request(api, e.kind.outcome());
        answer(e)
    };
    let (kind, parsed) = match url {
        "/v1/chat/completions" => (Kind::Chat, openai::parse_chat(body)),
        "/v1/completions" => (
            Kind::Completion,
            openai::parse_completion(body, limits.max_messages),
        ),
        other => {
            return refuse(ApiError::invalid(
                Some("url"),
                format!("url {other:?}: /v1/chat/completions or /v1/completions"),
            ))
        }
    };
    let mut call = match parsed {
        Ok(c) => c,
        Err(e) => return refuse(e),
    };
    if call.stream {
        return refuse(ApiError::invalid(
            Some("stream"),
            "stream must be false here: the answer is one JSON body",
        ));
    }
    for i in &mut call.inputs {
        i.truncate = truncate;
    }
    let (served, _hold) = match models.resolve(&call.model, call.keep_alive).await {
        Ok(r) => r,
        Err(e) => return refuse(e),
    };
    let front = &served.front;
    let syntax = answer_of(front, &call, kind);
    let (events, prompt_tokens) = match submit_all(front, api, call.inputs, call.n) {
        Ok(r) => r,
        Err(e) => return answer(e),
    };
    let mut head = head(front, kind, call.n);
    head.answer = syntax;
    match complete(head, events, prompt_tokens).await {
        Ok(v) => (200, v),
        Err(e) => answer(e),
    }
}

/// Waits for every choice to end and builds the whole completion.
async fn complete(
    head: Head,
    events: Vec<Events>,
    prompt_tokens: usize,
) -> Result<Value, ApiError> {
    let mut choices = Vec::with_capacity(events.len());
    let mut completion_tokens = 0;
    let mut cached = CachedTokens::new(events.len(), head.n);
    for (index, mut ev) in events.into_iter().enumerate() {
        let mut text = String::new();
        let mut lps = Vec::new();
        let finish = loop {
            match ev.recv().await {
                // The end token's piece has no text; its log-probability is left out as
                // it is from a stream.
                Some(Event::Piece { text: t, .. }) if t.is_empty() => {}
                Some(Event::Piece {
                    text: t, logprobs, ..
                }) => {
                    text.push_str(&t);
                    lps.extend(logprobs);
                }
                Some(Event::Done(d)) => {
                    completion_tokens += d.generated_token_ids.len();
                    cached.done(index, d.cached_tokens);
                    match openai::finish_reason(d.finish) {
                        Some(f) => break f,
                        None => return Err(cut_off(d.generated_token_ids.len())),
                    }
                }
                Some(Event::Failed { failure, message }) => return Err(failed(failure, message)),
                None => {
                    return Err(ApiError::new(
                        ErrorKind::Internal,
                        "the engine stopped before the request ended",
                    ))
                }
            }
        };
        let logprobs = head.logprobs(&lps, &mut 0);
        choices.push(match head.kind {
            Kind::Chat => {
                let (message, finish) = head.message(text, finish);
                json!({
                    "index": index,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                })
            }
            Kind::Completion => json!({
                "index": index,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish,
            }),
        });
    }
    Ok(json!({
        "id": head.id,
        "object": head.object(false),
        "created": head.created,
        "model": head.model,
        "system_fingerprint": null,
        "choices": choices,
        "usage": openai::usage(prompt_tokens, completion_tokens, cached.total()),
    }))
}

/// A call's prompt tokens served from the prefix cache, as OpenAI counts prompt tokens:
/// each prompt once, for all its `n` choices. A prompt's count is its choices' least: what
/// the cache held for it before the call (its other choices take the prompt's KV from the
/// one that computes it, which Status and each gRPC stream count).
struct CachedTokens {
    n: usize,
    least: Vec<usize>,
}

impl CachedTokens {
    fn new(choices: usize, n: usize) -> CachedTokens {
        let n = n.max(1);
        CachedTokens {
            n,
            least: vec![usize::MAX; choices.div_ceil(n)],
        }
    }

    /// Choice `i` ended with `cached` of its prompt's tokens from the cache.
    fn done(&mut self, i: usize, cached: usize) {
        if let Some(l) = self.least.get_mut(i / self.n) {
            *l = (*l).min(cached);
        }
    }

    fn total(&self) -> usize {
        self.least.iter().filter(|&&l| l != usize::MAX).sum()
    }
}

type SseItem = Result<SseEvent, Infallible>;

fn data(v: &Value) -> SseItem {
    Ok(SseEvent::default().data(v.to_string()))
}

/// Server-sent events: a chunk per piece of text (chat begins with the assistant role),
/// one with each choice's finish reason, the usage chunk when asked for, then `[DONE]`.
/// An error after the stream began is sent as `data: {"error": ...}` before `[DONE]`.
fn stream(head: Head, events: Vec<Events>, include_usage: bool) -> Response {
    let (tx, rx) = mpsc::channel::<SseItem>(64);
    tokio::spawn(pump(head, events, include_usage, tx));
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).into_response()
}

async fn pump(head: Head, events: Vec<Events>, include_usage: bool, tx: mpsc::Sender<SseItem>) {
    let n = events.len();
    let mut map = StreamMap::with_capacity(n);
    for (i, ev) in events.into_iter().enumerate() {
        map.insert(i, ev);
    }
    let send = |v: Value| {
        let tx = tx.clone();
        async move { tx.send(data(&v)).await.is_ok() }
    };
    if head.kind == Kind::Chat {
        let first: Vec<Value> = (0..n)
            .map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))
            .collect();
        if !send(head.chunk(first, None, include_usage)).await {
            return;
        }
    }
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    let mut cached = CachedTokens::new(n, head.n);
    let mut offsets = vec![0usize; n];
    let mut parsers: Vec<Option<ToolParser>> =
        (0..n).map(|_| head.answer.map(ToolParser::new)).collect();
    // Log-probabilities of pieces a parser holds back, for the next delta it sends.
    let mut held: Vec<Vec<TokenLogprob>> = vec![Vec::new(); n];
    let mut error = None;
    loop {
        let next = tokio::select! {
            next = map.next() => next,
            // The client went away: dropping the events evicts every sequence now.
            () = tx.closed() => return,
        };
        let Some((i, ev)) = next else { break };
        let choices = match ev {
            // The end token's piece has no text: nothing to send.
            Event::Piece { text, .. } if text.is_empty() => continue,
            Event::Piece { text, logprobs, .. } => match parsers[i].as_mut() {
                Some(p) => {
                    held[i].extend(logprobs);
                    let mut deltas = head.tool_deltas(i, p.feed(&text));
                    if let Some(d) = deltas.first_mut() {
                        d["logprobs"] =
                            head.logprobs(&std::mem::take(&mut held[i]), &mut offsets[i]);
                    }
                    deltas
                }
                None => {
                    let lp = head.logprobs(&logprobs, &mut offsets[i]);
                    vec![head.choice_delta(i, Some(&text), lp, None)]
                }
            },
            Event::Done(d) => {
                let (mut out, calls) = match parsers[i].as_mut() {
                    Some(p) => (head.tool_deltas(i, p.finish()), p.calls()),
                    None => (Vec::new(), 0),
                };
                if i % head.n == 0 {
                    prompt_tokens += d.prompt_token_ids.len();
                }
                completion_tokens += d.generated_token_ids.len();
                cached.done(i, d.cached_tokens);
                match openai::finish_reason(d.finish) {
                    Some("stop") if calls > 0 => {
                        out.push(head.choice_delta(i, None, Value::Null, Some("tool_calls")))
                    }
                    Some(f) => out.push(head.choice_delta(i, None, Value::Null, Some(f))),
                    None => {
                        error = Some(cut_off(d.generated_token_ids.len()));
                        break;
                    }
                }
                out
            }
            Event::Failed { failure, message } => {
                error = Some(failed(failure, message));
                break;
            }
        };
        for c in choices {
            if !send(head.chunk(vec![c], None, include_usage)).await {
                return;
            }
        }
    }
    // The other choices of a failed request are cancelled with it.
    drop(map);
    if let Some(e) = error {
        if !send(openai::error_body(&e)).await {
            return;
        }
    } else if include_usage {
        let u = openai::usage(prompt_tokens, completion_tokens, cached.total());
        if !send(head.chunk(Vec::new(), Some(u), true)).await {
            return;
        }
    }
    let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
}
