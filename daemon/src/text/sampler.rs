//! Sampling: penalties on tokens already seen, then the request's logit biases, then (JSON
//! mode) every token that would leave the text no prefix of a JSON object masked out, then
//! greedy, or temperature followed by top-k, top-p and min-p (transformers' warper order),
//! drawn with a seeded generator so a seed reproduces a completion. Sampling runs on the
//! host from each sequence's logits row, so every backend samples the same way.

use super::json::JsonState;
use super::schema::{Schema, SchemaState};
use super::tokenizer::{TokenKind, TokenTexts};
use crate::util::rng::Rng;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

/// What the generated text must be.
#[derive(Clone, Debug, Default)]
pub enum OutputFormat {
    #[default]
    Text,
    /// One JSON object, then the end (OpenAI's `response_format: {"type": "json_object"}`).
    JsonObject,
    /// One instance of a JSON schema, then the end (`{"type": "json_schema"}`).
    JsonSchema(Arc<Schema>),
}

impl OutputFormat {
    pub fn is_text(&self) -> bool {
        matches!(self, OutputFormat::Text)
    }
}

/// Which first bytes can continue a constrained text, directly and after each whitespace
/// byte: a token whose lead byte cannot is masked without running it through the
/// automaton. (A token that fits after a run of whitespace fits after the run's first
/// byte: whitespace between tokens only counts toward its limits, and in a string only a
/// space is text. Not so inside a literal, a key or an enum value with spaces in it: there
/// only the first byte is gated.)
struct Gate {
    direct: [bool; 256],
    after: [[bool; 256]; 4],
    literal: bool,
}

const WS: [u8; 4] = [b' ', b'\n', b'\t', b'\r'];

impl Gate {
    fn of(c: &Constraint) -> Gate {
        let mut g = Gate {
            direct: [false; 256],
            after: [[false; 256]; 4],
            literal: c.in_literal(),
        };
        for b in 0..=255u8 {
            g.direct[b as usize] = c.fits(&[b]);
            for (w, ws) in WS.iter().enumerate() {
                g.after[w][b as usize] = c.fits(&[*ws, b]);
            }
        }
        g
    }

    /// False only where `bytes` cannot fit.
    fn may_fit(&self, bytes: &[u8]) -> bool {
        let Some(&first) = bytes.first() else {
            return true;
        };
        let Some(w) = WS.iter().position(|&c| c == first) else {
            return self.direct[first as usize];
        };
        if self.literal {
            return self.direct[first as usize];
        }
        match bytes.iter().find(|c| !WS.contains(c)) {
            Some(&lead) => self.after[w][lead as usize],
            // Whitespace only: run it.
            None => true,
        }
    }
}

/// Where the text stands in what it must be.
#[derive(Clone, Debug)]
enum Constraint {
    Json(JsonState),
    Schema(Arc<Schema>, SchemaState),
}

impl Constraint {
    fn is_done(&self) -> bool {
        match self {
            Constraint::Json(j) => j.is_done(),
            Constraint::Schema(_, s) => s.is_done(),
        }
    }

    fn in_plain_string(&self) -> bool {
        match self {
            Constraint::Json(j) => j.in_plain_string(),
            Constraint::Schema(_, s) => s.in_plain_string(),
        }
    }

    /// Matching a literal text (true/false/null, a key, an enum value).
    fn in_literal(&self) -> bool {
        match self {
            Constraint::Json(j) => j.in_literal(),
            Constraint::Schema(_, s) => s.in_literal(),
        }
    }

    fn fits(&self, bytes: &[u8]) -> bool {
        match self {
            Constraint::Json(j) => j.feed(bytes).is_some(),
            Constraint::Schema(schema, s) => s.feed(schema, bytes).is_some(),
        }
    }

    /// The state after `bytes` (unchanged where they do not fit).
    fn fed(self, bytes: &[u8]) -> Constraint {
        match self {
            Constraint::Json(j) => Constraint::Json(j.feed(bytes).unwrap_or(j)),
            Constraint::Schema(schema, s) => {
                let next = s.feed(&schema, bytes).unwrap_or(s);
                Constraint::Schema(schema, next)
            }
        }
    }
}

/// OpenAI's range of a logit bias: -100 bans a token in effect, 100 all but forces it.
pub const LOGIT_BIAS_MAX: f32 = 100.0;

/// Tokens one request may bias at most (OpenAI takes 300).
pub const LOGIT_BIAS_TOKENS_MAX: usize = 1024;

/// Logit biases name tokens of the vocabulary, each by a number in [-100, 100], at most
/// `LOGIT_BIAS_TOKENS_MAX` of them; the message says which does not.
pub fn check_logit_bias(bias: &[(u32, f32)], vocab: u32) -> Result<(), String> {
    let max = LOGIT_BIAS_MAX;
    if bias.len() > LOGIT_BIAS_TOKENS_MAX {
        return Err(format!(
            "logit_bias names {} tokens; at most {LOGIT_BIAS_TOKENS_MAX}",
            bias.len()
        ));
    }
    for &(t, b) in bias {
        if t >= vocab {
            return Err(format!(
                "logit_bias names token {t}; the vocabulary has {vocab} (ids 0 to {})",
                vocab.saturating_sub(1)
            ));
        }
        if !(-max..=max).contains(&b) {
            return Err(format!(
                "logit_bias {b} for token {t} must be in [-{max}, {max}]"
            ));
        }
    }
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy (argmax).
    pub temperature: f32,
    /// 0: off.
    pub top_k: usize,
    /// 1 (or 0): off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    pub seed: u64,
    /// transformers' and llama.cpp's rule for every token of the prompt and the text so
    /// far: a positive logit is divided by it, a negative one multiplied. 1: off.
    pub repetition_penalty: f32,
    /// OpenAI's: subtracted once from the logit of every token generated so far. 0: off.
    pub presence_penalty: f32,
    /// OpenAI's: subtracted from a token's logit once per time it was generated. 0: off.
    pub frequency_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
        }
    }
}

/// What sampling takes where neither the model nor the caller says otherwise: llama.cpp's
/// and Ollama's defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05) and a mild
/// repetition penalty, so that a first story does not loop the way greedy decoding does.
/// `sluiced run`, `sluice generate`, `chat` and `batch` and gRPC requests use it for every
/// setting they do not give; the HTTP API keeps OpenAI's defaults.
pub const FAMILIAR: SamplingParams = SamplingParams {
    temperature: 0.8,
    top_k: 40,
    top_p: 0.95,
    min_p: 0.05,
    seed: 0,
    repetition_penalty: 1.05,
    presence_penalty: 0.0,
    frequency_penalty: 0.0,
};

/// Sampling settings a caller gave, each None where it gave none (a flag left out, an
/// unset gRPC field): `over` fills them from a model's defaults.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SamplingChoice {
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl SamplingChoice {
    /// These settings where given, `defaults`' elsewhere (the seed and OpenAI's penalties
    /// are always the caller's: they have no model default).
    /// A temperature of 0 given by the caller is plain greedy decoding: the default
    /// repetition penalty does not apply then (only one the caller gives), so greedy
    /// outputs match other implementations' greedy outputs and the HTTP API's.
    pub fn over(&self, defaults: &SamplingParams) -> SamplingParams {
        let greedy = self.temperature == Some(0.0);
        SamplingParams {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_k: self.top_k.unwrap_or(defaults.top_k),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            min_p: self.min_p.unwrap_or(defaults.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(if greedy {
                1.0
            } else {
                defaults.repetition_penalty
            }),
            ..*defaults
        }
    }
}

impl SamplingParams {
    /// A model's default sampling: what it recommends (its manifest's `RecommendedSampling`,
    /// from its generation_config.json or GGUF metadata, as `engine::sampling_defaults`
    /// hands it over), `FAMILIAR` for what it does not say, as
    /// llama.cpp starts from its own defaults and takes the ones a GGUF declares.
    pub fn model_default(rec: &SamplingChoice) -> SamplingParams {
        rec.over(&FAMILIAR)
    }

    /// One line naming the settings, as the CLIs print them.
    pub fn describe(&self) -> String {
        if self.temperature == 0.0 {
            return format!(
                "greedy (temperature 0), repetition_penalty {}",
                self.repetition_penalty
            );
        }
        format!(
            "temperature {} top_k {} top_p {} min_p {} repetition_penalty {} seed {}",
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.repetition_penalty,
            self.seed
        )
    }

    pub fn validate(&self) -> Result<(), String> {
        // OpenAI's range: past 2 the text is noise, and a typo (5 for 0.5) should not pass.
        if !(0.0..=2.0).contains(&self.temperature) {
            return Err(format!(
                "temperature {} must be in [0, 2] (0 is greedy)",
                self.temperature
            ));
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(format!("top_p {} must be in [0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!(
                "repetition_penalty {} must be a finite number > 0 (1 is off)",
                self.repetition_penalty
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} {v} must be in [-2, 2]"));
            }
        }
        Ok(())
    }

    pub fn penalizes(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

pub struct Sampler {
    params: SamplingParams,
    /// The seeded draws.
    rng: Rng,
    cand: Vec<(f32, u32)>,
    /// With penalties: the logits row after them, the tokens of the prompt and the text so
    /// far, and how often each was generated.
    penalized: Vec<f32>,
    seen: HashSet<u32>,
    counts: HashMap<u32, u32>,
    /// Added to token logits (after the penalties).
    bias: Vec<(u32, f32)>,
    /// JSON mode or a schema: where the text so far stands.
    constraint: Option<Constraint>,
}

/// Index of the largest value; the first on ties (as torch.argmax).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        Sampler::with_prompt(params, &[])
    }

    /// A sampler whose repetition penalty also covers `prompt`'s tokens.
    pub fn with_prompt(params: SamplingParams, prompt: &[u32]) -> Sampler {
        let seen = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Sampler {
            params,
            rng: Rng::new(params.seed ^ 0x9E3779B97F4A7C15),
            cand: Vec::new(),
            penalized: Vec::new(),
            seen,
            counts: HashMap::new(),
            bias: Vec::new(),
            constraint: None,
        }
    }

    /// The sampler with logit biases (token, added to its logit) and an output format.
    pub fn constrained(mut self, bias: &[(u32, f32)], format: &OutputFormat) -> Sampler {
        self.bias = bias.to_vec();
        self.constraint = match format {
            OutputFormat::Text => None,
            OutputFormat::JsonObject => Some(Constraint::Json(JsonState::new())),
            OutputFormat::JsonSchema(s) => Some(Constraint::Schema(s.clone(), SchemaState::new())),
        };
        self
    }

    /// JSON mode or a schema: the text so far is whole (an object, an instance).
    pub fn json_done(&self) -> Option<bool> {
        self.constraint.as_ref().map(Constraint::is_done)
    }

    /// The penalties and biases applied to a copy of `logits` (only the tokens they name
    /// change).
    fn shape(&mut self, logits: &[f32]) {
        let p = self.params;
        self.penalized.clear();
        self.penalized.extend_from_slice(logits);
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(l) = self.penalized.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        for (&t, &n) in &self.counts {
            if let Some(l) = self.penalized.get_mut(t as usize) {
                *l -= p.frequency_penalty * n as f32 + p.presence_penalty;
            }
        }
        for &(t, b) in &self.bias {
            if let Some(l) = self.penalized.get_mut(t as usize) {
                *l += b;
            }
        }
    }

    /// Samples the next token of text without constraints (no JSON mode) and remembers it
    /// for the penalties.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        self.sample_in(logits, None)
    }

    /// Samples the next token and remembers it for the penalties and JSON mode, whose
    /// checks need the vocabulary's `texts` (without them it is not applied).
    pub fn sample_in(&mut self, logits: &[f32], texts: Option<&TokenTexts>) -> u32 {
        let constrained = self.constraint.is_some() && texts.is_some();
        if !self.params.penalizes() && self.bias.is_empty() && !constrained {
            return self.draw(logits);
        }
        self.shape(logits);
        let mut row = std::mem::take(&mut self.penalized);
        let t = match (self.constraint.take(), texts) {
            (Some(c), Some(texts)) => {
                let t = self.draw_json(&mut row, &c, texts, logits);
                self.constraint = Some(match texts.kind(t) {
                    TokenKind::Text { .. } => c.fed(texts.bytes(t)),
                    _ => c,
                });
                t
            }
            (c, _) => {
                self.constraint = c;
                self.draw(&row)
            }
        };
        self.penalized = row;
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(t);
        }
        if self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0 {
            *self.counts.entry(t).or_default() += 1;
        }
        t
    }

    fn uniform(&mut self) -> f32 {
        self.rng.unit_f32()
    }

    /// JSON mode's (or a schema's) draw: among the tokens that keep the text a prefix of
    /// what it must be (end tokens once it is whole). Greedy tries the best token first and
    /// masks the row only when it does not fit; sampling masks the row, so the draw is the
    /// model's distribution restricted to what fits, then the usual warpers.
    fn draw_json(
        &mut self,
        row: &mut [f32],
        state: &Constraint,
        texts: &TokenTexts,
        logits: &[f32],
    ) -> u32 {
        let fits = |t: u32, gate: Option<&Gate>| match texts.kind(t) {
            TokenKind::End => state.is_done(),
            TokenKind::Silent => false,
            TokenKind::Text { plain } => {
                let b = texts.bytes(t);
                !state.is_done()
                    && ((plain && state.in_plain_string())
                        || (gate.is_none_or(|g| g.may_fit(b)) && state.fits(b)))
            }
        };
        if self.params.temperature <= 0.0 {
            let best = argmax(row);
            if fits(best, None) {
                return best;
            }
        }
        // Most tokens cannot fit for their first byte (or their first after whitespace):
        // those are masked without running them.
        let gate = Gate::of(state);
        let mut any = false;
        for (t, l) in row.iter_mut().enumerate() {
            if fits(t as u32, Some(&gate)) {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if !any {
            // Nothing in the vocabulary continues the text: end it where an end token
            // exists (the text is then no whole object, as at max_tokens), else go on
            // unconstrained.
            return (0..texts.len() as u32)
                .find(|&t| texts.kind(t) == TokenKind::End)
                .unwrap_or_else(|| argmax(logits));
        }
        self.draw(row)
    }

    /// Temperature, then top-k, top-p and min-p, then a draw. The vocabulary is sorted
    /// only as far as top-p needs (the most likely 64 tokens, then 512, ...): a full sort of
    /// Gemma's 262k logits took 14 ms a token, the whole of a decode step. Without top-k,
    /// top-p or min-p nothing is sorted; the draw walks the tokens in id order.
    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if mx == f32::NEG_INFINITY || mx.is_nan() {
            return argmax(logits);
        }
        let inv = 1.0 / p.temperature;
        // Each token's weight, exp((logit - max) / T): the most likely weighs 1. Tokens
        // masked out (JSON mode, -inf) are left out.
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, &l)| l > f32::NEG_INFINITY)
                .map(|(i, &l)| (((l - mx) * inv).exp(), i as u32)),
        );
        let desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if p.top_k > 0 && p.top_k < self.cand.len() {
            self.cand.select_nth_unstable_by(p.top_k - 1, desc);
            self.cand.truncate(p.top_k);
            self.cand.sort_unstable_by(desc);
        }
        // Probabilities are weights over the top-k's sum; min-p keeps p >= min_p * p_max,
        // a weight of at least min_p.
        let sum: f64 = self.cand.iter().map(|c| f64::from(c.0)).sum();
        if p.min_p > 0.0 {
            self.cand.retain(|c| c.0 >= p.min_p);
        }
        if p.top_p > 0.0 && p.top_p < 1.0 {
            let need = f64::from(p.top_p) * sum;
            let len = self.cand.len();
            let mut m = len.min(64);
            loop {
                if m < len {
                    self.cand.select_nth_unstable_by(m - 1, desc);
                }
                self.cand[..m].sort_unstable_by(desc);
                let mut acc = 0.0f64;
                let cut = self.cand[..m].iter().position(|c| {
                    acc += f64::from(c.0);
                    acc >= need
                });
                if let Some(i) = cut {
                    self.cand.truncate(i + 1);
                    break;
                }
                if m == len {
                    break;
                }
                m = len.min(m * 8);
            }
        }
        let total: f64 = self.cand.iter().map(|c| f64::from(c.0)).sum();
        let mut r = f64::from(self.uniform()) * total;
        for c in &self.cand {
            r -= f64::from(c.0);
            if r < 0.0 {
                return c.1;
            }
        }
        // Rounding: the last token that has any weight.
        self.cand
            .iter()
            .rev()
            .find(|c| c.0 > 0.0)
            .map_or_else(|| argmax(logits), |c| c.1)
    }
}

/// A generated token's log-probability under the model's distribution (the logits before
/// temperature and truncation), and the most likely tokens at that position.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub id: u32,
    pub logprob: f32,
    /// Up to the asked number of (token, log-probability), most likely first.
    pub top: Vec<(u32, f32)>,
}

/// `chosen`'s log-softmax over `logits` and the `top` most likely tokens: one pass for the
/// maximum, one for the sum, and a small sorted list for the top (no allocation but the
/// result's).
pub fn logprobs(logits: &[f32], chosen: u32, top: usize) -> TokenLogprob {
    let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from((l - mx).exp())).sum();
    let lse = mx + sum.ln() as f32;
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(top + 1);
    if top > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if best.len() == top && best[top - 1].1 >= l {
                continue;
            }
            // After the last entry at least as large: ties keep the lower id first.
            let at = best.partition_point(|b| b.1 >= l);
            best.insert(at, (i as u32, l));
            best.truncate(top);
        }
    }
    TokenLogprob {
        id: chosen,
        logprob: logits
            .get(chosen as usize)
            .map_or(f32::NEG_INFINITY, |&l| l - lse),
        top: best.into_iter().map(|(i, l)| (i, l - lse)).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::schema::Schema;
    use crate::text::tokenizer::{TokenKind, TokenTexts};

    #[test]
    fn greedy_takes_the_first_maximum() {
        assert_eq!(argmax(&[0.1, 3.0, 3.0, -1.0]), 1);
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&[0.0, 1.0, 5.0]), 2);
    }

    #[test]
    fn filters_leave_only_allowed_tokens_and_seeds_repeat() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
        let mut order: Vec<u32> = (0..100).collect();
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]));
        let top3 = &order[..3];
        let p = SamplingParams {
            temperature: 1.5,
            top_k: 3,
            seed: 7,
            ..Default::default()
        };
        let draws: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..200).map(|_| s.sample(&logits)).collect()
        };
        assert!(draws.iter().all(|d| top3.contains(d)));
        assert!(
            top3.iter().all(|t| draws.contains(t)),
            "all of the top 3 should be drawn at T=1.5"
        );
        let again: Vec<u32> = {
            let mut s = Sampler::new(p);
            (0..200).map(|_| s.sample(&logits)).collect()
        };
        assert_eq!(draws, again);
        // min_p = 1 keeps only the most likely token.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 1.0,
            seed: 3,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&logits) == order[0]));
        // A tiny top_p keeps only the most likely token too.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            seed: 3,
            ..Default::default()
        });
        assert!((0..50).all(|_| s.sample(&logits) == order[0]));
    }

    /// Draws follow softmax(logits / T): each token's share of 40000 draws is within five
    /// standard deviations of its probability (the draw walks tokens in id order).
    #[test]
    fn draws_follow_the_tempered_softmax() {
        let logits = [2.0f32, -1.0, 0.5, 3.0, 0.0, 1.5, -3.0, 2.5];
        for t in [0.5f32, 1.0, 1.7] {
            let w: Vec<f64> = logits
                .iter()
                .map(|&l| (f64::from(l) / f64::from(t)).exp())
                .collect();
            let z: f64 = w.iter().sum();
            let mut s = Sampler::new(SamplingParams {
                temperature: t,
                seed: 11,
                ..Default::default()
            });
            let n = 40_000;
            let mut counts = [0usize; 8];
            for _ in 0..n {
                counts[s.sample(&logits) as usize] += 1;
            }
            for (i, &c) in counts.iter().enumerate() {
                let p = w[i] / z;
                let sd = (n as f64 * p * (1.0 - p)).sqrt();
                assert!(
                    (c as f64 - n as f64 * p).abs() <= 5.0 * sd + 1.0,
                    "T {t} token {i}: {c} draws, expected {:.0}",
                    n as f64 * p
                );
            }
        }
    }

    /// Top-p keeps the smallest set of most likely tokens whose mass reaches it, also when
    /// that set is far past the first 64 tokens sorted; min-p on top of it cuts further.
    #[test]
    fn top_p_keeps_the_smallest_likely_set_however_long() {
        // Nearly flat: 90 % of the mass needs most of the 3000 tokens.
        let logits: Vec<f32> = (0..3000)
            .map(|i| ((i * 7919) % 3000) as f32 * -0.001)
            .collect();
        let mut order: Vec<usize> = (0..3000).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let w: Vec<f64> = logits.iter().map(|&l| f64::from(l).exp()).collect();
        let z: f64 = w.iter().sum();
        let mut acc = 0.0;
        let keep = order
            .iter()
            .position(|&i| {
                acc += w[i] / z;
                acc >= 0.9
            })
            .unwrap()
            + 1;
        assert!(keep > 1000, "{keep}");
        let rank: Vec<usize> = {
            let mut r = vec![0; 3000];
            for (k, &i) in order.iter().enumerate() {
                r[i] = k;
            }
            r
        };
        for min_p in [0.0f32, 0.1, 0.5] {
            // min-p keeps p >= min_p * p_max: at 0.1 top-p cuts first, at 0.5 min-p does.
            let by_min_p = order
                .iter()
                .take_while(|&&i| w[i] / w[order[0]] >= f64::from(min_p))
                .count();
            let cut = keep.min(by_min_p);
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                top_p: 0.9,
                min_p,
                seed: 5,
                ..Default::default()
            });
            let ranks: Vec<usize> = (0..5_000)
                .map(|_| rank[s.sample(&logits) as usize])
                .collect();
            let worst = ranks.iter().copied().max().unwrap();
            assert!(worst < cut, "min_p {min_p}: rank {worst} drawn, {cut} kept");
            assert!(
                worst + 40 >= cut,
                "min_p {min_p}: at most rank {worst} of {cut}"
            );
        }
    }

    /// A vocabulary of JSON's pieces, a few that never fit, an end token and a silent one.
    fn json_vocab() -> TokenTexts {
        let text = |b: &'static str| -> (&'static [u8], TokenKind) {
            let plain = b
                .bytes()
                .all(|c| (0x20..0x7f).contains(&c) && c != b'"' && c != b'\\');
            (b.as_bytes(), TokenKind::Text { plain })
        };
        let mut v: Vec<(&[u8], TokenKind)> = [
            "{", "}", "[", "]", ",", ":", "\"", "\"k\"", "\":", "1", "0", "-", ".", "true", "nul",
            "l", "x", "cat", " ", "\n  ", "\\", "\\n", "é", "{\"", "\"}", "]}", "'",
        ]
        .into_iter()
        .map(text)
        .collect();
        v.push((&[0xC3], TokenKind::Text { plain: false }));
        v.push((&[0xA9], TokenKind::Text { plain: false }));
        v.push((b"", TokenKind::End));
        v.push((b"<pad>", TokenKind::Silent));
        TokenTexts::of(&v)
    }

    /// Sampled with random logits, every text JSON mode makes is a prefix of an object,
    /// and one that reached the end token is a whole object by serde_json's reading.
    #[test]
    fn json_mode_makes_objects_and_ends_only_when_one_is_whole() {
        let v = json_vocab();
        let end = (0..v.len() as u32)
            .find(|&t| v.kind(t) == TokenKind::End)
            .unwrap();
        let mut rng = Rng::new(1);
        let (mut whole, mut cut) = (0, 0);
        for seed in 0..400 {
            let temperature = [0.0, 0.7, 1.0, 2.0][seed % 4];
            let mut s = Sampler::new(SamplingParams {
                temperature,
                top_k: [0, 5][seed % 2],
                seed: seed as u64,
                ..Default::default()
            })
            .constrained(&[], &OutputFormat::JsonObject);
            let mut text = Vec::new();
            let mut ended = false;
            for _ in 0..40 {
                let logits: Vec<f32> = (0..v.len())
                    .map(|_| rng.below(1000) as f32 / 100.0)
                    .collect();
                let t = s.sample_in(&logits, Some(&v));
                assert_ne!(v.kind(t), TokenKind::Silent, "seed {seed}");
                if t == end {
                    ended = true;
                    break;
                }
                text.extend_from_slice(v.bytes(t));
                assert!(
                    JsonState::new().feed(&text).is_some(),
                    "seed {seed}: {:?}",
                    String::from_utf8_lossy(&text)
                );
            }
            let parsed =
                serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&text);
            // (No token starts an exponent, so no number is past serde_json's range.)
            let object = parsed.is_ok();
            let done = s.json_done() == Some(true);
            assert_eq!(
                done,
                object,
                "seed {seed}: {:?}",
                String::from_utf8_lossy(&text)
            );
            assert!(done || !ended, "seed {seed}");
            if ended {
                whole += 1;
            } else {
                cut += 1;
            }
        }
        assert!(
            whole > 40 && cut > 40,
            "{whole} whole, {cut} cut at 40 tokens"
        );
    }

    /// The gate masks no token that fits: at every state of random walks through JSON mode
    /// and a schema with spaces inside keys and enum values, each token of a vocabulary of
    /// whitespace-led pieces is either let through or does not fit.
    #[test]
    fn the_gate_masks_no_token_that_fits() {
        let schema = Schema::compile(&serde_json::json!({
            "type": "object",
            "properties": {
                "k  k": {"enum": ["a  b", "x y", 7, 71]},
                "s": {"type": "string"},
                "n": {"type": "array", "items": {"type": "number"}}
            },
            "required": ["k  k"]
        }))
        .unwrap();
        let pieces = [
            "{", "}", "[", "]", ",", ":", "\"", " ", "  ", "\n", "\n  ", "\t", " \"", "  \"k",
            "\"k", " k", "k", "  b", " b", "a", "b", "x", " y", "y\"", "7", " 7", "1", " 1", ".",
            "e", " :", " ,", " }", "\n}", " ]", "s", "\"s\"", "\"n\"", " [", "-", "é", "\\n",
            " true", "null",
        ];
        let tokens: Vec<(&[u8], TokenKind)> = pieces
            .iter()
            .map(|p| (p.as_bytes(), TokenKind::Text { plain: false }))
            .chain([(&b""[..], TokenKind::End)])
            .collect();
        let v = TokenTexts::of(&tokens);
        let mut rng = Rng::new(3);
        let mut checked = 0;
        for seed in 0..200u64 {
            let format = if seed % 2 == 0 {
                OutputFormat::JsonObject
            } else {
                OutputFormat::JsonSchema(schema.clone())
            };
            let mut s = Sampler::new(SamplingParams {
                temperature: 2.0,
                seed,
                ..Default::default()
            })
            .constrained(&[], &format);
            for _ in 0..40 {
                let c = s.constraint.clone().unwrap();
                if c.is_done() {
                    break;
                }
                let gate = Gate::of(&c);
                for t in 0..v.len() as u32 - 1 {
                    let b = v.bytes(t);
                    assert!(
                        gate.may_fit(b) || !c.fits(b),
                        "{:?} masked at {c:?}",
                        String::from_utf8_lossy(b)
                    );
                    checked += usize::from(c.fits(b));
                }
                let logits: Vec<f32> = (0..v.len()).map(|_| rng.below(100) as f32 / 10.0).collect();
                s.sample_in(&logits, Some(&v));
            }
        }
        assert!(checked > 5000, "{checked} fitting tokens checked");
    }

    /// Greedy JSON mode takes the best token that fits, which is the best token when it
    /// fits; without JSON mode the same logits give the best token.
    #[test]
    fn greedy_json_mode_takes_the_best_token_that_fits() {
        let v = json_vocab();
        let id = |b: &str| {
            (0..v.len() as u32)
                .find(|&t| v.bytes(t) == b.as_bytes() && v.kind(t) != TokenKind::End)
                .unwrap()
        };
        // Preference: a lone continuation byte (it fits nowhere here), then ":, then {",
        // then cat, then }, then the rest.
        let mut logits = vec![0.0f32; v.len()];
        let lone = (0..v.len() as u32).find(|&t| v.bytes(t) == [0xA9]).unwrap();
        logits[lone as usize] = 11.0;
        for (i, b) in ["\":", "{\"", "cat", "}"].into_iter().enumerate() {
            logits[id(b) as usize] = 10.0 - i as f32;
        }
        let mut plain = Sampler::new(SamplingParams::default());
        assert_eq!(plain.sample_in(&logits, Some(&v)), lone);
        let mut s =
            Sampler::new(SamplingParams::default()).constrained(&[], &OutputFormat::JsonObject);
        let mut text = Vec::new();
        for _ in 0..12 {
            let t = s.sample_in(&logits, Some(&v));
            if v.kind(t) == TokenKind::End {
                break;
            }
            text.extend_from_slice(v.bytes(t));
        }
        // {" (": cannot start an object); ": ends the key; ": opens a string value with
        // a colon in it; ": no longer fits (nothing follows a value but , or }), {"
        // does and ends the string; } closes the object; the end.
        assert_eq!(String::from_utf8_lossy(&text), "{\"\":\":{\"}");
        assert_eq!(s.json_done(), Some(true));
    }

    #[test]
    fn logit_bias_moves_the_tokens_it_names_and_only_those() {
        let logits = [0.0f32, 1.0, 2.0, 3.0];
        let greedy = |bias: &[(u32, f32)]| {
            let mut s =
                Sampler::new(SamplingParams::default()).constrained(bias, &OutputFormat::Text);
            s.sample(&logits)
        };
        assert_eq!(greedy(&[]), 3);
        assert_eq!(greedy(&[(3, -100.0)]), 2);
        assert_eq!(greedy(&[(0, 100.0)]), 0);
        assert_eq!(greedy(&[(3, -1.5), (2, 0.4)]), 2);
        assert!(check_logit_bias(&[(3, 100.0), (0, -100.0)], 4).is_ok());
        for (bad, says) in [
            (vec![(4, 1.0)], "token 4"),
            (vec![(1, 100.5)], "[-100, 100]"),
            (vec![(1, f32::NAN)], "[-100, 100]"),
            (vec![(0, 1.0); 1025], "at most 1024"),
        ] {
            let m = check_logit_bias(&bad, 4).expect_err("refused");
            assert!(m.contains(says), "{m}");
        }
        // Sampled: a token biased by -100 is never drawn, the others all are.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 5,
            ..Default::default()
        })
        .constrained(&[(3, -100.0)], &OutputFormat::Text);
        let draws: Vec<u32> = (0..400).map(|_| s.sample(&logits)).collect();
        assert!(!draws.contains(&3));
        assert!((0..3).all(|t| draws.contains(&t)));
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_the_top_tokens_in_order() {
        let logits = [1.0f32, 3.0, 2.0, 3.0, -1.0];
        let lp = super::logprobs(&logits, 2, 3);
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        assert!((lp.logprob as f64 - (2.0 - z.ln())).abs() < 1e-5);
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 2], "most likely first, lower id first on a tie");
        assert!((lp.top[0].1 as f64 - (3.0 - z.ln())).abs() < 1e-5);
        assert!(super::logprobs(&logits, 0, 0).top.is_empty());
    }

    #[test]
    fn penalties_lower_the_tokens_already_seen_by_their_rules() {
        // Token 1 leads; the prompt holds it, so the repetition penalty applies at once.
        let logits = [1.0f32, 4.0, 3.5, -1.0];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::with_prompt(p, &[1, 3]);
        assert_eq!(s.sample(&logits), 2, "4 / 2 = 2 < 3.5");
        assert_eq!(
            s.penalized,
            [1.0, 2.0, 3.5, -2.0],
            "a negative logit is multiplied"
        );
        // Token 2 was generated: now it is penalized too (3.5 / 2 = 1.75), token 1 leads
        // again (2), once each penalty applied once (not again per time seen).
        assert_eq!(s.sample(&logits), 1);
        assert_eq!(s.penalized, [1.0, 2.0, 1.75, -2.0]);
        // Frequency and presence: count * frequency + presence off each generated token.
        let p = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..Default::default()
        };
        let mut s = Sampler::new(p);
        let logits = [3.0f32, 2.0];
        assert_eq!(s.sample(&logits), 0);
        assert_eq!(s.sample(&logits), 0, "3 - 0.75 > 2");
        assert_eq!(s.penalized, [2.25, 2.0]);
        assert_eq!(s.sample(&logits), 1, "3 - 1.25 < 2");
        assert!(SamplingParams {
            repetition_penalty: 0.0,
            ..p
        }
        .validate()
        .is_err());
        assert!(SamplingParams {
            presence_penalty: 2.5,
            ..p
        }
        .validate()
        .is_err());
    }

    /// Sampled with random logits over a vocabulary of pieces, every text that reaches the
    /// end is an instance: checked field by field on serde_json's reading.
    #[test]
    fn sampled_texts_are_instances() {
        let schema = Schema::compile(&serde_json::json!({
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "k": {"enum": ["x", "y"]},
                "l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                "o": {"type": "string"},
                "t": {"$ref": "#"}
            },
            "required": ["n", "k", "l"]
        }))
        .unwrap();
        let pieces = [
            "{", "}", "[", "]", ",", ":", "\"", "\"n\"", "\"k\":", "\"l\"", "\"o\"", "\"t\":", "1",
            "0", "-", ".", "5", "true", "false", "x", "\"y\"", "ab", " ", "\n  ", "é", "{\"",
            // Every byte the schema's texts need alone, as byte-level vocabularies have.
            "k", "l", "n", "o", "t", "y", "r", "u", "e", "f", "a", "s",
        ];
        let mut tokens: Vec<(&[u8], TokenKind)> = pieces
            .iter()
            .map(|p| {
                (
                    p.as_bytes(),
                    TokenKind::Text {
                        plain: p
                            .bytes()
                            .all(|c| (0x20..0x7f).contains(&c) && c != b'"' && c != b'\\'),
                    },
                )
            })
            .collect();
        tokens.push((b"", TokenKind::End));
        let v = TokenTexts::of(&tokens);
        let end = (tokens.len() - 1) as u32;
        let mut rng = Rng::new(2);
        let mut whole = 0;
        for seed in 0..300u64 {
            let mut s = Sampler::new(SamplingParams {
                temperature: [0.0, 1.0, 3.0][seed as usize % 3],
                seed,
                ..Default::default()
            })
            .constrained(&[], &OutputFormat::JsonSchema(schema.clone()));
            let mut text = Vec::new();
            let mut ended = false;
            for _ in 0..80 {
                let logits: Vec<f32> = (0..v.len())
                    .map(|_| rng.below(1000) as f32 / 100.0)
                    .collect();
                let t = s.sample_in(&logits, Some(&v));
                if t == end {
                    ended = true;
                    break;
                }
                text.extend_from_slice(v.bytes(t));
                assert!(
                    crate::text::schema::SchemaState::new()
                        .feed(&schema, &text)
                        .is_some(),
                    "{:?}",
                    String::from_utf8_lossy(&text)
                );
            }
            if !ended {
                continue;
            }
            whole += 1;
            let value: serde_json::Value = serde_json::from_slice(&text)
                .unwrap_or_else(|e| panic!("{e}: {:?}", String::from_utf8_lossy(&text)));
            fn check(v: &serde_json::Value) {
                let o = v.as_object().expect("an object");
                let keys: Vec<&str> = o.keys().map(String::as_str).collect();
                let order = ["n", "k", "l", "o", "t"];
                let mut last = 0;
                for k in &keys {
                    let at = order.iter().position(|o| o == k).expect("a known property");
                    assert!(at >= last, "order: {keys:?}");
                    last = at;
                }
                // (serde_json reads -0 as a float; JSON Schema's integer is any whole number.)
                assert!(o["n"].as_f64().is_some_and(|f| f.fract() == 0.0), "{v}");
                assert!(o["k"] == "x" || o["k"] == "y", "{v}");
                let l = o["l"].as_array().expect("l is a list");
                assert!(
                    l.len() <= 2 && l.iter().all(serde_json::Value::is_boolean),
                    "{v}"
                );
                if let Some(s) = o.get("o") {
                    assert!(s.is_string());
                }
                if let Some(t) = o.get("t") {
                    check(t);
                }
            }
            check(&value);
            // Integers are written without a fraction or an exponent.
            let t = String::from_utf8_lossy(&text);
            for (at, _) in t.match_indices("\"n\":") {
                let num: String = t[at + 4..]
                    .trim_start()
                    .chars()
                    .take_while(|c| "-+0123456789.eE".contains(*c))
                    .collect();
                assert!(!num.contains(['.', 'e', 'E']), "{t}");
            }
        }
        assert!(whole > 30, "{whole} of 300 ended");
    }
}
