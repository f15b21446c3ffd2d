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

use super::draft::{DraftAsk, DraftConfig, SeqDraft};
use crate::model::{SeqStep, TREE_ROOT};
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
    /// Speculative decoding: the drafter that proposes tokens for each step to verify
    /// (None: one token a step).
    pub draft: Option<DraftConfig>,
    /// Harmony's structural tokens (`<|channel|>`, `<|message|>`, ...) are written into
    /// the text, for a chat answer's parser (`text::harmony`); otherwise special tokens
    /// are left out.
    pub markers: bool,
}

impl GenerateParams {
    /// Greedy decoding of `max_tokens` tokens at most, nothing else asked (`ignore_eos`:
    /// past end tokens too).
    pub fn greedy(max_tokens: usize, ignore_eos: bool) -> GenerateParams {
        GenerateParams {
            max_tokens,
            sampling: SamplingParams {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 0,
                ..SamplingParams::default()
            },
            stop: Vec::new(),
            ignore_eos,
            logprobs: None,
            logit_bias: Vec::new(),
            format: Default::default(),
            draft: None,
            markers: false,
        }
    }
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
    /// Prompt tokens whose KV came from the prefix cache rather than a prefill.
    pub cached_tokens: usize,
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
    /// Speculative decoding's state, when the request drafts.
    draft: Option<SeqDraft>,
    /// The KV copies the next step makes first: the accepted path of the last verified
    /// tree, from the rows its nodes ran at to the positions of their depths.
    kv_moves: Vec<(u32, u32)>,
    /// Positions of its slot written so far, rejected drafts' rows included (where a
    /// ring's contents end: `Decoder::can_resume`).
    written: usize,
    /// Prompt tokens taken from the prefix cache (`resume_at`).
    cached: usize,
    /// Prefilling waits for another sequence that is computing the same prefix
    /// (`PrefixCache::before_step`): it takes no step meanwhile.
    pub(super) waiting: bool,
}

impl AsMut<Sequence> for Sequence {
    fn as_mut(&mut self) -> &mut Sequence {
        self
    }
}

impl AsRef<Sequence> for Sequence {
    fn as_ref(&self) -> &Sequence {
        self
    }
}

/// A sequence's text and drafting state, for the draft model that proposes its tokens.
pub struct ModelDraft<'a> {
    pub slot: usize,
    prompt: &'a [u32],
    generated: &'a [u32],
    pub draft: &'a mut SeqDraft,
    /// Tokens to propose for the next step.
    pub want: usize,
}

impl ModelDraft<'_> {
    /// The prompt, then every token generated (the pending one last).
    pub fn text(&self) -> impl Iterator<Item = u32> + '_ {
        self.prompt.iter().chain(self.generated).copied()
    }
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
        let draft = params.draft.map(|cfg| SeqDraft::new(&cfg, &prompt));
        Ok(Sequence {
            draft,
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
            kv_moves: Vec::new(),
            written: 0,
            cached: 0,
            waiting: false,
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

    /// Token `i` of its text: the prompt, then every token generated.
    pub fn token(&self, i: usize) -> Option<u32> {
        match i.checked_sub(self.prompt.len()) {
            None => Some(self.prompt[i]),
            Some(g) => self.generated.get(g).copied(),
        }
    }

    /// Positions of its KV cache that hold its text's K and V: its position, short of an
    /// accepted tree path whose KV has not moved into place yet.
    pub fn kv_valid(&self) -> usize {
        self.kv_moves
            .iter()
            .map(|m| m.1 as usize)
            .min()
            .unwrap_or(self.pos)
            .min(self.pos)
    }

    /// Positions of its slot written so far (`Decoder::can_resume`).
    pub fn written(&self) -> usize {
        self.written
    }

    /// Still prefilling its prompt, not ended.
    pub fn prefilling(&self) -> bool {
        self.finished.is_none() && self.pending.is_none() && self.prefilled < self.prompt.len()
    }

    /// Prompt tokens in its KV cache.
    pub fn prefilled(&self) -> usize {
        self.prefilled
    }

    /// Prompt tokens taken from the prefix cache.
    pub fn cached(&self) -> usize {
        self.cached
    }

    /// Its KV cache holds the prompt's first `at` tokens (copied or kept from another
    /// sequence's: the prefix cache), so prefilling goes on from there. `at` is past what
    /// it holds and short of the whole prompt: the last prompt token always runs, for its
    /// logits. `written`: what its slot now counts as written (the source's, where a ring's
    /// contents end: `LayerCache::held_runs`), at least `at`.
    pub fn resume_at(&mut self, at: usize, written: usize) {
        debug_assert!(self.prefilling() && at > self.prefilled && at < self.prompt.len());
        self.cached += at - self.prefilled;
        self.prefilled = at;
        self.pos = at;
        self.written = written.max(at);
    }

    /// Decode steps run (each after the first sampled token; one step may emit several
    /// tokens when it verified drafts).
    pub fn decode_steps(&self) -> usize {
        self.decode_steps
    }

    /// A decoding sequence's claim on its next step's drafted rows; None when it does not
    /// draft or is not decoding.
    pub fn draft_ask(&self) -> Option<DraftAsk> {
        let d = self.draft.as_ref()?;
        self.pending.map(|_| d.ask())
    }

    /// The chance that node `k` of its proposal is accepted (0 without one).
    pub fn draft_chance(&self, k: usize) -> f64 {
        self.draft.as_ref().map_or(0.0, |d| d.chance(k))
    }

    /// A decoding sequence's drafting by a draft model (None: it does not draft with one,
    /// or is not decoding).
    pub fn model_draft(&mut self) -> Option<ModelDraft<'_>> {
        let d = self.draft.as_mut().filter(|d| d.by_model())?;
        self.pending?;
        let want = d.want;
        Some(ModelDraft {
            slot: self.slot,
            prompt: &self.prompt,
            generated: &self.generated,
            draft: d,
            want,
        })
    }

    /// Drops the proposal for the next step (its drafter failed).
    pub fn clear_proposal(&mut self) {
        if let Some(d) = &mut self.draft {
            d.proposal.clear();
            d.want = 0;
        }
    }

    /// Drafted tokens that went into steps and those accepted (0, 0 without drafting).
    pub fn drafted(&self) -> (u64, u64) {
        self.draft
            .as_ref()
            .map_or((0, 0), |d| (d.drafted, d.accepted))
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
    /// token when decoding (and its drafted tokens after it to verify, as many as the
    /// budget leaves room for), else the next chunk of its prompt. None when it has ended
    /// or the budget is spent.
    pub fn next_step(&self, budget: usize) -> Option<SeqStep> {
        let mut step = SeqStep::default();
        self.fill_step(budget, &mut step).then_some(step)
    }

    /// `next_step` into a step the caller reuses (its token list keeps its capacity, so a
    /// step loop allocates nothing); false where `next_step` gives None.
    pub fn fill_step(&self, budget: usize, out: &mut SeqStep) -> bool {
        if self.finished.is_some() || budget == 0 || (self.waiting && self.pending.is_none()) {
            return false;
        }
        out.tokens.clear();
        out.verify = false;
        out.prompt = self.pending.is_none();
        out.parents.clear();
        out.kv_moves.clear();
        match self.pending {
            Some(t) => {
                out.tokens.push(t);
                out.kv_moves.extend_from_slice(&self.kv_moves);
                if let Some(d) = &self.draft {
                    let p = &d.proposal;
                    let n = p.len().min(budget - 1);
                    out.tokens.extend_from_slice(&p.tokens[..n]);
                    out.verify = n > 0;
                    if p.branches_in(n) {
                        // Rows: the pending token, then the nodes; a node's parent row is
                        // its parent node's plus one, or the pending token's (0).
                        out.parents.push(TREE_ROOT);
                        out.parents
                            .extend((0..n).map(|k| p.parent(k).wrapping_add(1)));
                    }
                }
            }
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
    /// `logits` (its last row; every row of a verified span): once the prompt is in,
    /// samples the next token and applies the finish rules, in this order: end token,
    /// stop string, max tokens, context. A verified span goes on to its next row while
    /// the token sampled equals the draft that row ran, so every token emitted is the
    /// sampler's own draw from the logits of the text before it. Returns the text that
    /// became final, if any.
    pub fn advance(
        &mut self,
        ran: usize,
        logits: &[f32],
        tok: &Tokenizer,
        bytes_streamed: u64,
    ) -> Option<Piece> {
        self.bytes_streamed += bytes_streamed;
        self.written = self.written.max(self.pos + ran);
        let piece = if self.pending.take().is_none() {
            self.pos += ran;
            self.prefilled += ran;
            if self.prefilled < self.prompt.len() {
                return None;
            }
            self.emit(logits, tok)
        } else {
            self.decode_steps += 1;
            self.kv_moves.clear();
            self.verify_rows(ran, logits, tok)
        };
        if let (Some(d), true) = (&mut self.draft, self.pending.is_some()) {
            // The span after the pending token stays inside the context, and what it can
            // yield inside max_tokens.
            let rows = self.max_context.saturating_sub(self.pos + 1);
            let room = rows.min(
                self.params
                    .max_tokens
                    .saturating_sub(self.generated.len() + 1),
            );
            d.propose(room, rows);
        }
        piece
    }

    /// A decode step's rows (`ran` of them, several when it verified drafts): sampled from
    /// the pending token's row on, each time going on to the row of the draft that is the
    /// token sampled (in a tree, the child of the row that has it) while there is one.
    /// The rows of an accepted path in a tree ran at other positions than their depths:
    /// their KV moves there at the start of the next step.
    fn verify_rows(&mut self, ran: usize, logits: &[f32], tok: &Tokenizer) -> Option<Piece> {
        let vocab = logits.len() / ran;
        let mut piece: Option<Piece> = None;
        let (mut accepted, mut rejected) = (0, false);
        // The row being sampled: the pending token's, then the accepted drafts' rows.
        let mut j = 0;
        loop {
            let row = &logits[j * vocab..(j + 1) * vocab];
            if j != accepted {
                // This row's K and V (at pos, before the increment) belong at the depth's.
                let at = (self.pos - accepted) as u32;
                self.kv_moves.push((at + j as u32, at + accepted as u32));
            }
            self.pos += 1;
            if let Some(p) = self.emit(row, tok) {
                match &mut piece {
                    None => piece = Some(p),
                    Some(all) => {
                        all.text.push_str(&p.text);
                        all.token_ids.extend(p.token_ids);
                        all.logprobs.extend(p.logprobs);
                    }
                }
            }
            let (Some(last), Some(d)) = (self.generated.last().copied(), &self.draft) else {
                break;
            };
            // Row j ran node j - 1 of the proposal (the pending token for j = 0).
            let node = (j as u16).wrapping_sub(1);
            if self.finished.is_some() {
                break;
            }
            match d.proposal.child(node, ran - 1, last) {
                Some(c) => j = c + 1,
                None => {
                    // Drafts were on offer here and the sampled token was none of them.
                    rejected = (0..ran - 1).any(|c| d.proposal.parent(c) == node);
                    break;
                }
            }
            accepted += 1;
            // The next row runs this token: it is in, not pending.
            self.pending = None;
        }
        if let (Some(d), true) = (&mut self.draft, ran > 1) {
            d.verified(ran - 1, accepted, rejected);
        }
        piece
    }

    /// Samples a token from `logits` (a row) and applies the finish rules: the token is
    /// then pending, or the sequence has finished. Returns the text that became final.
    fn emit(&mut self, logits: &[f32], tok: &Tokenizer) -> Option<Piece> {
        let token = self.sampler.sample(logits);
        self.t_first.get_or_insert_with(Instant::now);
        self.generated.push(token);
        self.unsent_ids.push(token);
        if let Some(d) = &mut self.draft {
            d.extend(&[token]);
        }
        if let Some(top) = self.params.logprobs {
            self.unsent_logprobs
                .push(crate::text::sampler::logprobs(logits, token, top));
        }
        if tok.is_end(token) && !self.params.ignore_eos {
            self.finished = Some(Finish::Stop);
            return None;
        }
        // A harmony chat answer carries its structural tokens as text, for its parser.
        let marker = tok
            .harmony()
            .filter(|_| self.params.markers)
            .and_then(|h| h.marker(token));
        let text = match marker {
            Some(m) => self.detok.flush(tok) + m,
            None => self.detok.push(tok, token),
        };
        let (text, stopped) = self.stops.push(&text);
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
            // Every token after the first, however many a step yielded.
            decode_tokens_per_s: self.generated.len().saturating_sub(1) as f64 / decode.max(1e-9),
            bytes_streamed: self.bytes_streamed,
            cached_tokens: self.cached,
            prompt_token_ids: self.prompt,
            generated_token_ids: self.generated,
        };
        (tail, done)
    }
}
