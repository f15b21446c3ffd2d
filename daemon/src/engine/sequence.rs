//! One sequence's life: validated at admission, prefilled in chunks, then one token per
//! step, sampled, detokenized, checked against end tokens, stop strings and limits, and
//! closed with the text still held back. `sluiced run` (`generate`) and the daemon's
//! scheduler both drive this one type, so they cannot disagree on when a sequence ends.
//!
//! ```text
//!   new ──> Prefill ──(last chunk ran: sample)──> Decode(pending) ──(step ran: sample)─┐
//!                                     │                 ^                             │
//!                                     │                 └──────── not finished ───────┘
//!                                     └─ end token / stop string / max tokens / context ──> Finished
//! ```

use crate::model::SeqStep;
use crate::text::detok::{Detokenizer, StopMatcher};
use crate::text::sampler::OutputFormat;
use crate::text::{Sampler, SamplingParams, TokenLogprob, Tokenizer};
use serde::Serialize;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Generate past end tokens (benchmarks); they are then ordinary tokens.
    pub ignore_eos: bool,
    /// Each generated token's log-probability with this many alternatives (None: off).
    pub logprobs: Option<usize>,
    /// Added to these tokens' logits before sampling (OpenAI's `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
    /// What the text must be (JSON mode: one object, then the end).
    pub format: OutputFormat,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    /// An end token (eos, end of turn).
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The text reached a stop string (the text ends before it).
    StopString,
    /// The context is full.
    Context,
    /// Cancelled (shutdown past its grace period).
    Cancelled,
}

/// What a sequence is checked against when it is made.
#[derive(Clone, Copy, Debug)]
pub struct SeqLimits {
    /// Positions of the KV cache (prompt and generated tokens).
    pub max_context: usize,
    pub vocab: u32,
}

/// Checks a request before it takes a KV slot; the message says what is wrong.
pub fn validate(prompt: &[u32], params: &GenerateParams, limits: SeqLimits) -> Result<(), String> {
    if prompt.is_empty() {
        return Err("the prompt is empty".into());
    }
    if prompt.len() >= limits.max_context {
        return Err(format!(
            "the prompt has {} tokens; the context holds {} (prompt plus generated tokens)",
            prompt.len(),
            limits.max_context
        ));
    }
    if let Some(bad) = prompt.iter().find(|&&t| t >= limits.vocab) {
        return Err(format!(
            "token id {bad} is past the vocabulary ({})",
            limits.vocab
        ));
    }
    crate::text::sampler::check_logit_bias(&params.logit_bias, limits.vocab)?;
    params.sampling.validate()
}

/// New text and the token ids that produced it since the last piece.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Piece {
    pub text: String,
    pub token_ids: Vec<u32>,
    /// One per token id when log-probabilities were asked for, else empty.
    pub logprobs: Vec<TokenLogprob>,
}

/// A sequence's totals once it has ended.
#[derive(Clone, Debug, Serialize)]
pub struct Done {
    pub finish: Finish,
    pub prompt_token_ids: Vec<u32>,
    pub generated_token_ids: Vec<u32>,
    pub time_to_first_token_s: f64,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    pub bytes_streamed: u64,
}

pub struct Sequence {
    prompt: Vec<u32>,
    params: GenerateParams,
    max_context: usize,
    /// KV-cache slot.
    slot: usize,
    prefilled: usize,
    /// Tokens in the KV cache.
    pos: usize,
    /// The last sampled token, to run in the next step (decoding).
    pending: Option<u32>,
    generated: Vec<u32>,
    unsent_ids: Vec<u32>,
    unsent_logprobs: Vec<TokenLogprob>,
    sampler: Sampler,
    detok: Detokenizer,
    stops: StopMatcher,
    finished: Option<Finish>,
    t_admit: Instant,
    t_first: Option<Instant>,
    decode_steps: usize,
    bytes_streamed: u64,
}

impl Sequence {
    /// Validates the request (see `validate`) and makes a sequence in KV slot `slot`.
    pub fn new(
        prompt: Vec<u32>,
        params: GenerateParams,
        slot: usize,
        limits: SeqLimits,
    ) -> Result<Sequence, String> {
        validate(&prompt, &params, limits)?;
        Ok(Sequence {
            sampler: Sampler::with_prompt(params.sampling, &prompt)
                .constrained(&params.logit_bias, &params.format),
            stops: StopMatcher::new(params.stop.clone()),
            prompt,
            params,
            max_context: limits.max_context,
            slot,
            prefilled: 0,
            pos: 0,
            pending: None,
            generated: Vec::new(),
            unsent_ids: Vec::new(),
            unsent_logprobs: Vec::new(),
            detok: Detokenizer::default(),
            finished: None,
            t_admit: Instant::now(),
            t_first: None,
            decode_steps: 0,
            bytes_streamed: 0,
        })
    }

    pub fn slot(&self) -> usize {
        self.slot
    }

    pub fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    pub fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Decode steps run (each after the first sampled token).
    pub fn decode_steps(&self) -> usize {
        self.decode_steps
    }

    /// Set once the sequence has ended; it then takes no more steps.
    pub fn finished(&self) -> Option<Finish> {
        self.finished
    }

    /// Has a sampled token waiting to run (decode rows go first in a step).
    pub fn is_decoding(&self) -> bool {
        self.pending.is_some()
    }

    /// The sequence's part of the next step with at most `budget` tokens: its pending
    /// token when decoding, else the next chunk of its prompt. None when it has ended or
    /// the budget is spent.
    pub fn next_step(&self, budget: usize) -> Option<SeqStep> {
        let mut step = SeqStep {
            slot: 0,
            pos: 0,
            tokens: Vec::new(),
        };
        self.fill_step(budget, &mut step).then_some(step)
    }

    /// `next_step` into a step the caller reuses (its token list keeps its capacity, so a
    /// step loop allocates nothing); false where `next_step` gives None.
    pub fn fill_step(&self, budget: usize, out: &mut SeqStep) -> bool {
        if self.finished.is_some() || budget == 0 {
            return false;
        }
        out.tokens.clear();
        match self.pending {
            Some(t) => out.tokens.push(t),
            None if self.prefilled < self.prompt.len() => {
                let n = (self.prompt.len() - self.prefilled).min(budget);
                out.tokens
                    .extend_from_slice(&self.prompt[self.prefilled..self.prefilled + n]);
            }
            None => return false,
        }
        out.slot = self.slot;
        out.pos = self.pos;
        true
    }

    /// Takes the result of a step that ran `ran` of this sequence's tokens and produced
    /// `logits` (its last row): once the prompt is in, samples the next token and applies
    /// the finish rules, in this order: end token, stop string, max tokens, context.
    /// Returns the text that became final, if any.
    pub fn advance(
        &mut self,
        ran: usize,
        logits: &[f32],
        tok: &Tokenizer,
        bytes_streamed: u64,
    ) -> Option<Piece> {
        self.bytes_streamed += bytes_streamed;
        self.pos += ran;
        if self.pending.take().is_some() {
            self.decode_steps += 1;
        } else {
            self.prefilled += ran;
            if self.prefilled < self.prompt.len() {
                return None;
            }
        }
        let texts = (!self.params.format.is_text()).then(|| tok.texts());
        let token = self.sampler.sample_in(logits, texts);
        self.t_first.get_or_insert_with(Instant::now);
        self.generated.push(token);
        self.unsent_ids.push(token);
        if let Some(top) = self.params.logprobs {
            self.unsent_logprobs
                .push(crate::text::sampler::logprobs(logits, token, top));
        }
        if tok.is_end(token) && !self.params.ignore_eos {
            self.finished = Some(Finish::Stop);
            return None;
        }
        let (text, stopped) = self.stops.push(&self.detok.push(tok, token));
        let piece = (!text.is_empty()).then(|| Piece {
            text,
            token_ids: std::mem::take(&mut self.unsent_ids),
            logprobs: std::mem::take(&mut self.unsent_logprobs),
        });
        if stopped {
            self.finished = Some(Finish::StopString);
        } else if self.generated.len() >= self.params.max_tokens {
            self.finished = Some(Finish::Length);
        } else if self.pos + 1 > self.max_context {
            self.finished = Some(Finish::Context);
        } else {
            self.pending = Some(token);
        }
        piece
    }

    /// Ends the sequence (with `why` when it has not ended by itself): the text held back
    /// for a possible stop string or an incomplete character is released, unless a stop
    /// string ended it or it was cancelled, and the totals are returned.
    pub fn close(mut self, why: Finish, tok: &Tokenizer) -> (Option<Piece>, Done) {
        let finish = self.finished.unwrap_or(why);
        let mut tail = None;
        if !matches!(finish, Finish::StopString | Finish::Cancelled) {
            let (text, _) = self.stops.push(&self.detok.flush(tok));
            let text = text + &self.stops.finish();
            if !text.is_empty() || !self.unsent_ids.is_empty() {
                tail = Some(Piece {
                    text,
                    token_ids: std::mem::take(&mut self.unsent_ids),
                    logprobs: std::mem::take(&mut self.unsent_logprobs),
                });
            }
        }
        let now = Instant::now();
        let first = self.t_first.unwrap_or(now);
        let prefill = (first - self.t_admit).as_secs_f64();
        let decode = (now - first).as_secs_f64();
        let done = Done {
            finish,
            time_to_first_token_s: prefill,
            prefill_tokens_per_s: self.prompt.len() as f64 / prefill.max(1e-9),
            decode_tokens_per_s: self.decode_steps as f64 / decode.max(1e-9),
            bytes_streamed: self.bytes_streamed,
            prompt_token_ids: self.prompt,
            generated_token_ids: self.generated,
        };
        (tail, done)
    }
}
