//! What the two wires share: one request shape, one validation, one submit, one error
//! type. `service.rs` (gRPC) and `http.rs` (the OpenAI API) convert their bodies into a
//! `GenerateInput` and an `ApiError` into their own status codes, and nothing else, so a
//! request is accepted or refused for the same reason on both.

use super::metrics::{Api, Metrics};
use crate::engine::scheduler::{Event, Finish, Places, Request, Scheduler, SubmitError};
use crate::engine::sequence::GenerateParams;
use crate::text::grammar::{Grammar, Trigger};
use crate::text::harmony;
use crate::text::sampler::{check_logit_bias, OutputFormat};
use crate::text::tool_parse::Syntax;
use crate::text::tools::{self, ToolPlan, Tools};
use crate::text::{ChatMessage, ChatTemplate, SamplingParams};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

/// What the served model is, for listings.
pub struct ModelMeta {
    pub name: String,
    pub architecture: String,
    pub layers: u32,
    pub hidden: u32,
    pub vocab: u32,
    pub context: u32,
    /// The context the model was trained for (what `--max-context` may go up to).
    pub trained_context: u32,
    pub stored_bytes: u64,
    pub raw_bytes: u64,
    /// Unix seconds when the model was loaded (OpenAI's `created`).
    pub created: u64,
    /// What gRPC requests sample with where they leave a setting unset (the model's
    /// recommended sampling, else `sampler::FAMILIAR`); HTTP keeps OpenAI's defaults.
    pub sampling: crate::text::SamplingParams,
}

/// Why a request was refused or failed; each wire maps a kind to its own code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Bad parameters, an over-long prompt, a body past the limits.
    Invalid,
    /// A model this daemon does not serve.
    ModelNotFound,
    /// No key, or not the right one.
    Unauthenticated,
    /// The request queue is full.
    QueueFull,
    /// The daemon is shutting down or still loading, or the disk did not answer in time.
    Unavailable,
    /// Stored data failed its checksum or could not be decoded (names the layer).
    DataLoss,
    Internal,
}

impl ErrorKind {
    /// How a failed step is answered.
    pub fn of_failure(f: crate::engine::Failure) -> ErrorKind {
        use crate::engine::Failure;
        match f {
            Failure::DataLoss => ErrorKind::DataLoss,
            Failure::Unavailable => ErrorKind::Unavailable,
            Failure::Internal => ErrorKind::Internal,
        }
    }

    /// The outcome label of `sluice_requests_total`.
    pub fn outcome(self) -> &'static str {
        match self {
            ErrorKind::Invalid => "invalid",
            ErrorKind::ModelNotFound => "model_not_found",
            ErrorKind::Unauthenticated => "unauthenticated",
            ErrorKind::QueueFull => "queue_full",
            ErrorKind::Unavailable => "unavailable",
            ErrorKind::DataLoss => "data_loss",
            ErrorKind::Internal => "internal",
        }
    }
}

#[derive(Clone, Debug)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// The request field at fault, where there is one (OpenAI's `param`).
    pub param: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(param: Option<&'static str>, message: impl Into<String>) -> ApiError {
        ApiError {
            kind: ErrorKind::Invalid,
            message: message.into(),
            param,
        }
    }

    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError {
            kind,
            message: message.into(),
            param: None,
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// The prompt of a request, in one of the three forms both wires accept.
pub enum Prompt {
    /// Text, tokenized with the model's BOS where it has one.
    Text(String),
    /// Chat messages, rendered with the model's chat template, and the tools it renders
    /// (OpenAI's tool objects; none: the template sees `None`).
    Messages(Vec<ChatMessage>, Vec<serde_json::Value>),
    /// Token ids as they are (no template, no BOS added).
    Ids(Vec<u32>),
}

impl Prompt {
    /// The request field the prompt came in.
    fn param(&self) -> &'static str {
        match self {
            Prompt::Messages(..) => "messages",
            _ => "prompt",
        }
    }
}

pub struct GenerateInput {
    /// Empty: the daemon's model.
    pub model: String,
    pub prompt: Prompt,
    /// None: the daemon's default, cut to the room the context has left.
    pub max_tokens: Option<u32>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Each generated token's log-probability with this many alternatives (None: off).
    pub logprobs: Option<usize>,
    /// Cut the end of the prompt (text, or the last message's content) until prompt and
    /// max_tokens fit in the context, instead of refusing.
    pub truncate: bool,
    /// Added to these tokens' logits (OpenAI's `logit_bias`), in token order.
    pub logit_bias: Vec<(u32, f32)>,
    /// What the text must be (None: any text).
    pub format: Option<Format>,
    /// Functions the model may call (chat only).
    pub tools: Option<Tools>,
}

/// A constraint on the text, and the request field that asked for it (named when the
/// grammar is refused).
#[derive(Clone, Debug)]
pub struct Format {
    pub grammar: Grammar,
    pub param: &'static str,
}

/// Alternatives per token at most when log-probabilities are asked for (OpenAI's limit).
pub const TOP_LOGPROBS_MAX: usize = 20;

/// Limits on what one request may ask, each refused with its own message.
#[derive(Clone, Copy, Debug)]
pub struct RequestLimits {
    /// Bytes of a request body (HTTP) or message (gRPC).
    pub max_request_bytes: usize,
    /// Chat messages in one request.
    pub max_messages: usize,
    /// Stop strings in one request, and bytes of each.
    pub max_stop: usize,
    pub max_stop_bytes: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_request_bytes: 8 << 20,
            max_messages: 1024,
            max_stop: 16,
            max_stop_bytes: 256,
        }
    }
}

/// Who is using a loaded model: requests in flight, and when the last one ended (its
/// keep-alive counts from then).
pub struct Usage {
    active: std::sync::atomic::AtomicUsize,
    last: std::sync::Mutex<Instant>,
}

impl Default for Usage {
    fn default() -> Self {
        Usage {
            active: Default::default(),
            last: std::sync::Mutex::new(Instant::now()),
        }
    }
}

impl Usage {
    pub fn hold(self: &Arc<Self>) -> Hold {
        self.active
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Hold(self.clone())
    }

    pub fn active(&self) -> usize {
        self.active.load(std::sync::atomic::Ordering::Acquire)
    }

    /// When the model was loaded or its last request ended.
    pub fn idle_since(&self) -> Instant {
        *self.last.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A model in use: it is not unloaded while a hold on it lives.
pub struct Hold(Arc<Usage>);

impl Drop for Hold {
    fn drop(&mut self) {
        // The time first, so whoever sees the count reach zero sees when it did.
        *self.0.last.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        self.0
            .active
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// The shared front of both wires.
pub struct Frontend {
    pub usage: Arc<Usage>,
    pub sched: Scheduler,
    pub meta: ModelMeta,
    pub template: Option<Arc<ChatTemplate>>,
    pub max_tokens_default: u32,
    pub limits: RequestLimits,
    pub metrics: Arc<Metrics>,
    /// Speculative decoding for every request of this model (`--draft`), or None.
    pub draft: Option<crate::engine::draft::DraftConfig>,
    /// What drafts, as `--draft` named it: `ngram`, `self:TYPE` or the draft model's store
    /// ("" without drafting).
    pub drafter: String,
}

/// A request `Frontend::check` found valid, tokenized, not yet queued.
pub struct Prepared {
    prompt_ids: Vec<u32>,
    params: GenerateParams,
    truncated: bool,
    /// When the request was received (time to first token counts from here).
    t0: Instant,
}

/// An accepted request: its prompt's length, whether it was cut to fit, and its events.
pub struct Submitted {
    pub prompt_tokens: usize,
    pub truncated: bool,
    pub events: Events,
}

/// A sampling setting out of its range, as the 400 that names it (the message begins with
/// the parameter's name).
fn sampling_error(m: String) -> ApiError {
    let param = [
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ]
    .into_iter()
    .find(|p| m.starts_with(p));
    ApiError::invalid(param, m)
}

impl Frontend {
    /// Whether this model's chat answers are harmony (gpt-oss): its vocabulary has
    /// harmony's tokens and its template writes them.
    pub fn harmony(&self) -> bool {
        self.sched.tokenizer.harmony().is_some()
            && self
                .template
                .as_ref()
                .is_some_and(|t| t.source().contains(harmony::CHANNEL))
    }

    /// How a chat answer is read back (None: as plain text): the calls' format when the
    /// request offers tools (the same choice `constrain` makes), and a harmony model's
    /// channels with or without tools.
    pub fn answer_syntax(&self, chat: bool, tools: Option<&Tools>) -> Option<Syntax> {
        let src = self.template.as_ref().map_or("", |t| t.source());
        let special = |name: &str| self.sched.tokenizer.token_id(name);
        let offered = tools.and_then(|t| tools::syntax(t, src, &special).ok().flatten());
        match (offered, tools) {
            (Some((format, parallel)), Some(t)) => Some(Syntax {
                format,
                parallel,
                forced: t.forced(),
                tools: true,
            }),
            _ if chat && self.harmony() => Some(Syntax {
                format: tools::ToolFormat::Harmony,
                parallel: false,
                forced: false,
                tools: false,
            }),
            _ => None,
        }
    }

    /// What the text is held to: the tools' grammar (the messages and the tools the
    /// template renders are set for them), else the request's constraint, compiled for
    /// the model's vocabulary. A grammar llguidance refuses is a 400 naming its field.
    fn constrain(
        &self,
        prompt: &mut Prompt,
        tools: Option<&Tools>,
        format: Option<&Format>,
    ) -> Result<OutputFormat, ApiError> {
        let src = self.template.as_ref().map_or("", |t| t.source());
        let harmony = matches!(prompt, Prompt::Messages(..)) && self.harmony();
        if let Prompt::Messages(messages, _) = prompt {
            tools::calls_as_text(src, messages);
        }
        let Some(tools) = tools else {
            return self.output_format(format, harmony);
        };
        let Prompt::Messages(messages, template_tools) = prompt else {
            return Err(ApiError::invalid(Some("tools"), "tools need chat messages"));
        };
        let special = |name: &str| self.sched.tokenizer.token_id(name);
        let plan = tools::plan(tools, src, &special, messages)
            .map_err(|(field, m)| ApiError::invalid(Some(field), m))?;
        let Some(ToolPlan {
            template_tools: rendered,
            grammar: Some(grammar),
            trigger,
            ..
        }) = plan
        else {
            return self.output_format(format, harmony);
        };
        if let Some(f) = format {
            return Err(ApiError::invalid(
                Some(f.param),
                format!(
                    "{} and tools both constrain the text: give one (or tool_choice \"none\")",
                    f.param
                ),
            ));
        }
        *template_tools = rendered;
        let grammars = self
            .sched
            .tokenizer
            .grammars()
            .map_err(|m| ApiError::invalid(Some("tools"), m))?;
        match trigger {
            Some(t) => grammars.compile_lazy(&grammar, t),
            None => grammars.compile(&grammar),
        }
        .map(|c| OutputFormat::Constrained(Box::new(c)))
        .map_err(|m| ApiError::invalid(Some("tools"), format!("tools: {m}")))
    }

    /// A request's constraint compiled for the model's vocabulary; a grammar llguidance
    /// refuses is a 400 naming the field that gave it. A harmony chat answer is held to it
    /// from its final channel's body on (the analysis before it is free), and cannot end
    /// before.
    fn output_format(&self, f: Option<&Format>, harmony: bool) -> Result<OutputFormat, ApiError> {
        let Some(f) = f else {
            return Ok(OutputFormat::Text);
        };
        self.sched
            .tokenizer
            .grammars()
            .and_then(|g| match harmony {
                true => g.compile_after(&f.grammar, Trigger::Text(harmony::FINAL)),
                false => g.compile(&f.grammar),
            })
            .map(|c| OutputFormat::Constrained(Box::new(c)))
            .map_err(|m| ApiError::invalid(Some(f.param), format!("{}: {m}", f.param)))
    }

    pub fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model.is_empty() || model == self.meta.name {
            Ok(())
        } else {
            Err(ApiError {
                kind: ErrorKind::ModelNotFound,
                message: format!(
                    "the model {model:?} is not served here; this daemon serves {:?} (GET /v1/models, `sluice models`)",
                    self.meta.name
                ),
                param: Some("model"),
            })
        }
    }

    /// What to say about the context the model supports beyond the served one.
    fn larger_context(&self) -> String {
        let (served, trained) = (self.meta.context, self.meta.trained_context);
        if trained > served {
            format!(
                " (the model supports {trained}: `sluiced serve --max-context {trained}`, or less)"
            )
        } else {
            String::new()
        }
    }

    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, ApiError> {
        self.prompt_ids_within(prompt, None)
    }

    /// The bytes of text beyond which a prompt cannot fit the context, whatever its
    /// tokens (`Tokenizer::longest_token_bytes`, with a margin of 4 for normalization).
    fn text_bytes_max(&self) -> usize {
        let longest = self.sched.tokenizer.longest_token_bytes();
        self.sched
            .max_context
            .saturating_mul(longest)
            .saturating_mul(4)
    }

    /// The refusal of a text of `bytes` past `text_bytes_max`.
    fn longer_than_context(&self, param: &'static str, bytes: usize) -> ApiError {
        let longest = self.sched.tokenizer.longest_token_bytes();
        ApiError::invalid(
            Some(param),
            format!(
                "the prompt is {bytes} bytes, at least {} tokens (no token is longer than {longest} bytes); the context holds {} (prompt plus generated tokens): shorten the prompt",
                bytes / 4 / longest,
                self.sched.max_context
            ),
        )
    }

    /// `prompt_ids`; a text (a prompt, or messages rendered) longer than `bytes_max` is
    /// refused before it is tokenized.
    fn prompt_ids_within(
        &self,
        prompt: &Prompt,
        bytes_max: Option<usize>,
    ) -> Result<Vec<u32>, ApiError> {
        let too_long = |param: &'static str, text: &str| match bytes_max {
            Some(max) if text.len() > max => Err(self.longer_than_context(param, text.len())),
            _ => Ok(()),
        };
        let tok = &self.sched.tokenizer;
        let ids = match prompt {
            Prompt::Ids(ids) => ids.clone(),
            Prompt::Messages(msgs, tools) => {
                if msgs.is_empty() {
                    return Err(ApiError::invalid(Some("messages"), "messages is empty"));
                }
                if msgs.len() > self.limits.max_messages {
                    return Err(ApiError::invalid(
                        Some("messages"),
                        format!(
                            "{} messages; at most {} are accepted in one request",
                            msgs.len(),
                            self.limits.max_messages
                        ),
                    ));
                }
                let t = self.template.as_ref().ok_or_else(|| {
                    ApiError::invalid(
                        Some("messages"),
                        "this model has no chat template: send a prompt (completions) instead of messages, or give the model one (a Jinja file): `sluiced pack SRC --name NAME --chat-template FILE`, the file saved as chat_template.jinja in the store's directory, or `sluiced serve --chat-template FILE` for its --model",
                    )
                })?;
                let text = t
                    .render_with_tools(msgs, tools, true)
                    .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
                too_long("messages", &text)?;
                tok.encode(&text, false)
                    .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?
            }
            Prompt::Text(text) => {
                if text.is_empty() {
                    return Err(ApiError::invalid(Some("prompt"), "the prompt is empty"));
                }
                too_long("prompt", text)?;
                tok.encode(text, true)
                    .map_err(|e| ApiError::invalid(Some("prompt"), e.to_string()))?
            }
        };
        if ids.is_empty() {
            return Err(ApiError::invalid(Some("prompt"), "the prompt is empty"));
        }
        Ok(ids)
    }

    /// Validates `input`, tokenizes it and queues it. A prompt the context cannot hold, a
    /// `max_tokens` past the room it leaves, and every other bad parameter are refused
    /// here, before the request takes a place in the queue: a full queue answers only
    /// requests that could run.
    pub fn submit(&self, api: Api, input: GenerateInput) -> Result<Submitted, ApiError> {
        let p = self.check(api, input)?;
        self.queue(None, api, p, 1)?
            .pop()
            .ok_or_else(|| ApiError::new(ErrorKind::Internal, "no request was submitted"))
    }

    /// Everything about `input` that can be refused without the engine, refused now: its
    /// fields and their ranges, the model's name, the chat template's rendering, the
    /// prompt's length against the context and `max_tokens`, the scheduler's own checks.
    /// Takes no place in the queue; a refusal is counted.
    pub fn check(&self, api: Api, input: GenerateInput) -> Result<Prepared, ApiError> {
        let t0 = Instant::now();
        let r = self
            .prepare(input)
            .and_then(|(prompt_ids, params, truncated)| {
                self.sched
                    .check(&prompt_ids, &params)
                    .map_err(submit_error)?;
                Ok(Prepared {
                    prompt_ids,
                    params,
                    truncated,
                    t0,
                })
            });
        if let Err(e) = &r {
            self.metrics.request(api, e.kind.outcome());
        }
        r
    }

    /// Holds places in the queue for a call of `n` sequences, all or none
    /// (`Scheduler::reserve`); `submit_in` queues each checked prompt's in them.
    pub fn reserve(&self, api: Api, n: usize) -> Result<Places<'_>, ApiError> {
        self.sched.reserve(n).map_err(|e| {
            let e = submit_error(e);
            self.metrics.request(api, e.kind.outcome());
            e
        })
    }

    /// `n` sequences of one checked prompt (`n` choices) queued into places `reserve`
    /// held: the prompt was read and tokenized once, and sequence i samples with its seed
    /// plus i (a seeded call repeats, and its choices differ).
    pub fn submit_in(
        &self,
        places: &mut Places<'_>,
        api: Api,
        prepared: Prepared,
        n: usize,
    ) -> Result<Vec<Submitted>, ApiError> {
        self.queue(Some(places), api, prepared, n)
    }

    fn queue(
        &self,
        mut places: Option<&mut Places<'_>>,
        api: Api,
        p: Prepared,
        n: usize,
    ) -> Result<Vec<Submitted>, ApiError> {
        let prompt_tokens = p.prompt_ids.len();
        let r = (0..n as u64)
            .map(|i| {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let mut params = p.params.clone();
                params.sampling.seed = params.sampling.seed.wrapping_add(i);
                let req = Request {
                    prompt_ids: p.prompt_ids.clone(),
                    params,
                    events: tx,
                };
                match places.as_deref_mut() {
                    Some(pl) => pl.submit(req),
                    None => self.sched.submit(req),
                }
                .map_err(submit_error)?;
                Ok(Submitted {
                    prompt_tokens,
                    truncated: p.truncated,
                    events: Events {
                        _hold: self.usage.hold(),
                        rx,
                        metrics: self.metrics.clone(),
                        api,
                        t_submit: p.t0,
                        t_last: None,
                        ended: false,
                    },
                })
            })
            .collect::<Result<Vec<_>, ApiError>>();
        if let Err(e) = &r {
            self.metrics.request(api, e.kind.outcome());
        }
        r
    }

    /// The prompt cut to at most `target` tokens: the longest prefix of its text (or of
    /// the last message's content) that fits, found by bisection over characters; token
    /// ids are cut directly.
    fn truncated(&self, prompt: &mut Prompt, target: usize) -> Result<Vec<u32>, ApiError> {
        let full = match prompt {
            Prompt::Ids(ids) => {
                ids.truncate(target);
                return Ok(ids.clone());
            }
            Prompt::Text(t) => std::mem::take(t),
            Prompt::Messages(m, _) => match m.last_mut() {
                Some(last) => std::mem::take(&mut last.content),
                None => return Err(ApiError::invalid(Some("messages"), "messages is empty")),
            },
        };
        let set = |prompt: &mut Prompt, text: &str| match prompt {
            Prompt::Text(t) => *t = text.to_string(),
            Prompt::Messages(m, _) => {
                if let Some(last) = m.last_mut() {
                    last.content = text.to_string();
                }
            }
            Prompt::Ids(_) => {}
        };
        let bounds: Vec<usize> = full
            .char_indices()
            .map(|(i, _)| i)
            .chain([full.len()])
            .collect();
        // The largest k whose prefix of k characters fits.
        let (mut lo, mut hi) = (0usize, bounds.len() - 1);
        let mut best = None;
        while lo <= hi {
            let mid = (lo + hi) / 2;
            set(prompt, &full[..bounds[mid]]);
            // An empty text is a valid cut here, though not a valid prompt by itself.
            let ids = match self.prompt_ids(prompt) {
                Ok(ids) => ids,
                Err(_) if mid == 0 => Vec::new(),
                Err(e) => return Err(e),
            };
            if ids.len() <= target {
                best = Some((mid, ids));
                lo = mid + 1;
            } else if mid == 0 {
                break;
            } else {
                hi = mid - 1;
            }
        }
        match best {
            Some((k, ids)) if !ids.is_empty() => {
                set(prompt, &full[..bounds[k]]);
                Ok(ids)
            }
            _ => Err(ApiError::invalid(
                None,
                format!("the prompt does not fit in {target} tokens even with its text cut to nothing (the template and the other messages take more)"),
            )),
        }
    }

    /// Stop strings within the limits: how many, and the bytes of each.
    fn check_stop(&self, stop: &[String]) -> Result<(), ApiError> {
        if stop.len() > self.limits.max_stop {
            return Err(ApiError::invalid(
                Some("stop"),
                format!(
                    "{} stop strings; at most {} are accepted",
                    stop.len(),
                    self.limits.max_stop
                ),
            ));
        }
        if let Some(s) = stop
            .iter()
            .find(|s| s.is_empty() || s.len() > self.limits.max_stop_bytes)
        {
            return Err(ApiError::invalid(
                Some("stop"),
                format!(
                    "stop string {s:?} must be 1 to {} bytes",
                    self.limits.max_stop_bytes
                ),
            ));
        }
        Ok(())
    }

    fn prepare(&self, input: GenerateInput) -> Result<(Vec<u32>, GenerateParams, bool), ApiError> {
        self.check_model(&input.model)?;
        input.sampling.validate().map_err(sampling_error)?;
        self.check_stop(&input.stop)?;
        let prompt_param = input.prompt.param();
        check_logit_bias(&input.logit_bias, self.meta.vocab)
            .map_err(|m| ApiError::invalid(Some("logit_bias"), m))?;
        if input.logprobs.is_some_and(|n| n > TOP_LOGPROBS_MAX) {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                format!("at most {TOP_LOGPROBS_MAX} alternatives per token"),
            ));
        }
        let mut prompt = input.prompt;
        let markers = matches!(prompt, Prompt::Messages(..)) && self.harmony();
        let format = self.constrain(&mut prompt, input.tools.as_ref(), input.format.as_ref())?;
        // A prompt far past the context is refused (or, to be truncated, cut) by its bytes
        // before it is tokenized.
        let bytes_max = self.text_bytes_max();
        let mut ids = if input.truncate {
            cut_text(&mut prompt, bytes_max);
            self.prompt_ids(&prompt)?
        } else {
            self.prompt_ids_within(&prompt, Some(bytes_max))?
        };
        let context = self.sched.max_context;
        let want = input
            .max_tokens
            .map_or(self.max_tokens_default as usize, |n| n as usize)
            .max(1);
        let mut truncated = false;
        if input.truncate && ids.len() + want > context {
            if want >= context {
                return Err(ApiError::invalid(
                    Some("max_tokens"),
                    format!(
                        "max_tokens {want} leaves no room for a prompt in a context of {context}"
                    ),
                ));
            }
            ids = self.truncated(&mut prompt, context - want)?;
            truncated = true;
        }
        if ids.len() >= context {
            return Err(ApiError::invalid(
                Some(prompt_param),
                format!(
                    "the prompt has {} tokens; the context holds {context} (prompt plus generated tokens): shorten the prompt{}",
                    ids.len(),
                    self.larger_context()
                ),
            ));
        }
        let room = context - ids.len();
        let max_tokens = match input.max_tokens {
            Some(0) => {
                return Err(ApiError::invalid(
                    Some("max_tokens"),
                    "max_tokens must be at least 1",
                ))
            }
            Some(n) if n as usize > room => {
                return Err(ApiError::invalid(
                    Some("max_tokens"),
                    format!(
                        "the context holds {context} tokens; the prompt has {} and max_tokens asks for {n} more: at most {room} fit{}",
                        ids.len(),
                        self.larger_context()
                    ),
                ))
            }
            Some(n) => n as usize,
            None => (self.max_tokens_default as usize).min(room),
        };
        Ok((
            ids,
            GenerateParams {
                max_tokens,
                sampling: input.sampling,
                stop: input.stop,
                ignore_eos: false,
                logprobs: input.logprobs,
                logit_bias: input.logit_bias,
                format,
                draft: self.draft,
                markers,
            },
            truncated,
        ))
    }
}

/// The finish reason's outcome label.
pub fn finish_outcome(f: Finish) -> &'static str {
    match f {
        Finish::Stop => "stop",
        Finish::Length => "length",
        Finish::StopString => "stop_string",
        Finish::Context => "context",
        Finish::Cancelled => "cancelled",
    }
}

/// A request's events as the engine sends them, measured on the way to the wire: time to
/// the first text, time per later token, the outcome. A request whose client goes away
/// before its end counts as `disconnected`; dropping this evicts its sequence.
pub struct Events {
    /// The model stays loaded while its events are read.
    _hold: Hold,
    rx: UnboundedReceiver<Event>,
    metrics: Arc<Metrics>,
    api: Api,
    t_submit: Instant,
    t_last: Option<Instant>,
    ended: bool,
}

impl Events {
    fn observe(&mut self, ev: &Event) {
        let now = Instant::now();
        match ev {
            Event::Piece { token_ids, .. } => {
                match self.t_last {
                    None => {
                        self.metrics
                            .first_token((now - self.t_submit).as_secs_f64());
                        if token_ids.len() > 1 {
                            self.metrics.next_tokens(0.0, token_ids.len() - 1);
                        }
                    }
                    Some(t) => self
                        .metrics
                        .next_tokens((now - t).as_secs_f64(), token_ids.len()),
                }
                self.t_last = Some(now);
            }
            Event::Done(d) => {
                self.ended = true;
                self.metrics
                    .tokens(d.prompt_token_ids.len(), d.generated_token_ids.len());
                self.metrics.request(self.api, finish_outcome(d.finish));
                self.metrics.finished((now - self.t_submit).as_secs_f64());
            }
            Event::Failed { failure, .. } => {
                self.ended = true;
                self.metrics
                    .request(self.api, ErrorKind::of_failure(*failure).outcome());
            }
        }
    }

    pub async fn recv(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await?;
        self.observe(&ev);
        Some(ev)
    }
}

impl tokio_stream::Stream for Events {
    type Item = Event;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Event>> {
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(ev)) => {
                self.observe(&ev);
                Poll::Ready(Some(ev))
            }
            other => other,
        }
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        if !self.ended {
            self.metrics.request(self.api, "disconnected");
        }
    }
}

/// Cuts a prompt's text (or its last message's content, the part truncation cuts) to at
/// most `max` bytes, at a character boundary: no prefix longer fits the context, so
/// truncation finds the same cut in less text.
fn cut_text(prompt: &mut Prompt, max: usize) {
    let text = match prompt {
        Prompt::Text(t) => t,
        Prompt::Messages(m, _) => match m.last_mut() {
            Some(last) => &mut last.content,
            None => return,
        },
        Prompt::Ids(_) => return,
    };
    if text.len() > max {
        let mut at = max;
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        text.truncate(at);
    }
}

/// A refusal of the scheduler as the API answers it.
fn submit_error(e: SubmitError) -> ApiError {
    match e {
        SubmitError::QueueFull(_) => ApiError::new(ErrorKind::QueueFull, e.to_string()),
        SubmitError::ShuttingDown => ApiError::new(ErrorKind::Unavailable, e.to_string()),
        SubmitError::Invalid(m) => ApiError::invalid(None, m),
    }
}
