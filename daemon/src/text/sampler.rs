//! Sampling: penalties on tokens already seen, then the request's logit biases, then (a
//! constraint: JSON mode, a schema, a regex or a grammar) every token that cannot continue
//! the text masked out, then greedy, or temperature followed by top-k, top-p and min-p
//! (transformers' warper order), drawn with a seeded generator so a seed reproduces a
//! completion. Sampling runs on the host from each sequence's logits row, so every backend
//! samples the same way.

use super::grammar::Constraint;
use crate::util::rng::Rng;
use std::collections::{HashMap, HashSet};

/// What the generated text must be.
#[derive(Clone, Debug, Default)]
pub enum OutputFormat {
    #[default]
    Text,
    /// A grammar compiled for the model's vocabulary (`Grammars::compile`): each sequence
    /// starts from its own copy.
    Constrained(Box<Constraint>),
}

impl OutputFormat {
    pub fn is_text(&self) -> bool {
        matches!(self, OutputFormat::Text)
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
    /// A constraint: where the text so far stands in it.
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
            OutputFormat::Constrained(c) => Some((**c).clone()),
        };
        self
    }

    /// Under a constraint: the text so far is whole (an end token may come).
    pub fn constraint_done(&mut self) -> Option<bool> {
        self.constraint.as_mut().map(Constraint::is_done)
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

    /// Samples the next token (under the constraint, if there is one) and remembers it
    /// for the penalties and the constraint.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let constrained = self.constraint.is_some();
        if !self.params.penalizes() && self.bias.is_empty() && !constrained {
            return self.draw(logits);
        }
        self.shape(logits);
        let mut row = std::mem::take(&mut self.penalized);
        let t = match self.constraint.take() {
            Some(mut c) => {
                let t = self.draw_constrained(&mut row, &mut c, logits);
                c.consume(t);
                self.constraint = Some(c);
                t
            }
            None => self.draw(&row),
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

    /// A constrained draw: among the tokens that keep the text a prefix of what it must
    /// be (end tokens once it is whole). Greedy tries the best token first and masks the
    /// row only when it does not fit; sampling masks the row, so the draw is the model's
    /// distribution restricted to what fits, then the usual warpers.
    fn draw_constrained(&mut self, row: &mut [f32], c: &mut Constraint, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            let best = argmax(row);
            if c.allows(best) {
                return best;
            }
        }
        if !c.mask(row) {
            // Nothing in the vocabulary continues the text: end it where an end token
            // exists (the text is then not whole, as at max_tokens), else go on
            // unconstrained.
            return c.first_end().unwrap_or_else(|| argmax(logits));
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
    use crate::text::grammar::{Grammar, Grammars, TokenKind, TokenTexts};

    /// `g` compiled for vocabulary `v`.
    fn compiled(v: &TokenTexts, g: Grammar) -> OutputFormat {
        let grammars = Grammars::new(v, |id| format!("<special{id}>")).expect("vocabulary");
        OutputFormat::Constrained(Box::new(grammars.compile(&g).expect("compiles")))
    }

    /// A vocabulary of these text pieces, then one end token (id `pieces.len()`).
    fn pieces_vocab(pieces: &[&str]) -> TokenTexts {
        let tokens: Vec<(&[u8], TokenKind)> = pieces
            .iter()
            .map(|p| (p.as_bytes(), TokenKind::Text))
            .chain([(&b""[..], TokenKind::End)])
            .collect();
        TokenTexts::of(&tokens)
    }

    /// Draws from random logits until an end token or `steps` tokens: the text, and
    /// whether an end token ended it. No special token that is not an end is ever drawn.
    fn walk(s: &mut Sampler, v: &TokenTexts, rng: &mut Rng, steps: usize) -> (Vec<u8>, bool) {
        let mut text = Vec::new();
        for _ in 0..steps {
            let logits: Vec<f32> = (0..v.len())
                .map(|_| rng.below(1000) as f32 / 100.0)
                .collect();
            let t = s.sample(&logits);
            match v.kind(t) {
                TokenKind::End => return (text, true),
                TokenKind::Silent => panic!("a silent token drawn"),
                TokenKind::Text => text.extend_from_slice(v.bytes(t)),
            }
        }
        (text, false)
    }

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
        let text =
            |b: &'static str| -> (&'static [u8], TokenKind) { (b.as_bytes(), TokenKind::Text) };
        let mut v: Vec<(&[u8], TokenKind)> = [
            "{", "}", "[", "]", ",", ":", "\"", "\"k\"", "\":", "1", "0", "-", ".", "true", "nul",
            "l", "x", "cat", " ", "\n  ", "\\", "\\n", "é", "{\"", "\"}", "]}", "'",
        ]
        .into_iter()
        .map(text)
        .collect();
        v.push((&[0xC3], TokenKind::Text));
        v.push((&[0xA9], TokenKind::Text));
        v.push((b"", TokenKind::End));
        v.push((b"<pad>", TokenKind::Silent));
        TokenTexts::of(&v)
    }

    /// Sampled with random logits, every text JSON mode ends is a whole object by
    /// serde_json's reading, a text is whole exactly when serde_json reads an object, and
    /// no special token that is not an end token is ever drawn.
    #[test]
    fn json_mode_makes_objects_and_ends_only_when_one_is_whole() {
        let v = json_vocab();
        let format = compiled(&v, Grammar::JsonObject);
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
            .constrained(&[], &format);
            let (text, ended) = walk(&mut s, &v, &mut rng, 40);
            let parsed =
                serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&text);
            // (No token starts an exponent, so no number is past serde_json's range.)
            let object = parsed.is_ok();
            let done = s.constraint_done() == Some(true);
            assert_eq!(
                done,
                object,
                "seed {seed}: {:?}",
                String::from_utf8_lossy(&text)
            );
            assert!(done || !ended, "seed {seed}");
            assert!(
                !text.starts_with(b" ") && !text.starts_with(b"\n"),
                "no whitespace before the object"
            );
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

    /// The mask and the one-token check (greedy's fast path) agree on every token at every
    /// state of random walks through JSON mode and a schema with spaces inside keys and
    /// enum values, over a vocabulary of whitespace-led pieces.
    #[test]
    fn the_mask_and_the_token_check_agree() {
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "k  k": {"enum": ["a  b", "x y", 7, 71]},
                "s": {"type": "string", "maxLength": 3},
                "n": {"type": "array", "items": {"type": "number", "minimum": -2}}
            },
            "required": ["k  k"]
        });
        let pieces = [
            "{", "}", "[", "]", ",", ":", "\"", " ", "  ", "\n", "\n  ", "\t", " \"", "  \"k",
            "\"k", " k", "k", "  b", " b", "a", "b", "x", " y", "y\"", "7", " 7", "1", " 1", ".",
            "e", " :", " ,", " }", "\n}", " ]", "s", "\"s\"", "\"n\"", " [", "-", "é", "\\n",
            " true", "null",
        ];
        let v = pieces_vocab(&pieces);
        let formats = [
            compiled(&v, Grammar::JsonObject),
            compiled(&v, Grammar::JsonSchema(schema)),
        ];
        let mut rng = Rng::new(3);
        let mut allowed = 0;
        for seed in 0..200u64 {
            let mut s = Sampler::new(SamplingParams {
                temperature: 2.0,
                seed,
                ..Default::default()
            })
            .constrained(&[], &formats[seed as usize % 2]);
            for _ in 0..40 {
                let mut c = s.constraint.clone().unwrap();
                let mut row = vec![0.0f32; v.len()];
                c.mask(&mut row);
                for t in 0..v.len() as u32 {
                    let by_mask = row[t as usize] > f32::NEG_INFINITY;
                    assert_eq!(c.allows(t), by_mask, "token {t} {:?}", v.bytes(t));
                    allowed += usize::from(by_mask);
                }
                if c.is_done() {
                    break;
                }
                let logits: Vec<f32> = (0..v.len()).map(|_| rng.below(100) as f32 / 10.0).collect();
                s.sample(&logits);
            }
        }
        assert!(allowed > 2000, "{allowed} allowed tokens checked");
    }

    /// Whitespace between JSON tokens: spaces and tabs with at most one newline, at most 20
    /// in a row on either side of it (the old automaton's limits, llama.cpp's rule).
    #[test]
    fn json_whitespace_is_bounded() {
        let pieces = ["{", "}", "\"a\"", ":", "1", " ", "\n", "\t"];
        let v = pieces_vocab(&pieces);
        let OutputFormat::Constrained(start) = compiled(&v, Grammar::JsonObject) else {
            unreachable!()
        };
        let id = |p: &str| pieces.iter().position(|q| *q == p).unwrap_or(pieces.len()) as u32;
        let run = |text: &[&str]| {
            let mut c = (*start).clone();
            for p in text {
                if !c.allows(id(p)) {
                    return None;
                }
                c.consume(id(p));
            }
            Some(c)
        };
        assert!(run(&[" "]).is_none(), "no whitespace before the object");
        let mut spaces = vec!["{"];
        spaces.extend([" "; 20]);
        assert!(run(&spaces).is_some());
        spaces.push(" ");
        assert!(run(&spaces).is_none(), "21 spaces");
        assert!(run(&["{", " ", "\n", "\t", "\"a\"", ":", "\n", " ", "1", "}"]).is_some());
        assert!(run(&["{", "\n", "\n"]).is_none(), "a second newline");
        let mut whole = run(&["{", "\"a\"", ":", "1", "}"]).unwrap();
        assert!(whole.is_done());
        let end = pieces.len() as u32;
        assert!(whole.allows(end), "the end token");
        assert!(!run(&["{", "\"a\""]).unwrap().allows(end), "no end inside");
    }

    /// A regex, a Lark grammar and a choice: every sampled text that ends is one their
    /// own rules accept, checked by hand here.
    #[test]
    fn regex_grammar_and_choice_texts_are_what_they_must_be() {
        let pieces = [
            "a", "b", "ab", "ba", "c", "bc", "(", ")", "()", "x", " ", "yes", "no", "y", "n", "e",
            "s", "o",
        ];
        let v = pieces_vocab(&pieces);
        type Check = fn(&str) -> bool;
        let balanced: Check = |t| {
            let mut depth = 0i32;
            t.chars().all(|c| {
                depth += if c == '(' { 1 } else { -1 };
                depth >= 0
            }) && depth == 0
                && t.chars().all(|c| "()".contains(c))
        };
        let cases: [(Grammar, Check); 3] = [
            (Grammar::Regex("[ab]{2,5}c".into()), |t| {
                (3..=6).contains(&t.len())
                    && t.ends_with('c')
                    && t[..t.len() - 1].chars().all(|c| c == 'a' || c == 'b')
            }),
            (
                Grammar::Lark("start: \"(\" start \")\" start | \"\"".into()),
                balanced,
            ),
            (
                Grammar::Choice(vec!["yes".into(), "no".into(), "a b".into()]),
                |t| ["yes", "no", "a b"].contains(&t),
            ),
        ];
        let mut rng = Rng::new(4);
        for (g, check) in cases {
            let format = compiled(&v, g.clone());
            let mut ended = 0;
            for seed in 0..100u64 {
                let mut s = Sampler::new(SamplingParams {
                    temperature: [0.0, 1.0, 2.0][seed as usize % 3],
                    seed,
                    ..Default::default()
                })
                .constrained(&[], &format);
                let (text, end) = walk(&mut s, &v, &mut rng, 30);
                let text = String::from_utf8(text).expect("pieces are text");
                if end {
                    assert!(check(&text), "{g:?}: {text:?}");
                    ended += 1;
                }
            }
            assert!(ended > 30, "{g:?}: {ended} of 100 ended");
        }
    }

    /// A schema keyword llguidance does not enforce is refused, naming it and where it is.
    #[test]
    fn unenforced_keywords_are_named_with_their_place() {
        let v = json_vocab();
        let grammars = Grammars::new(&v, |id| format!("<special{id}>")).unwrap();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {"tags": {"type": "array", "uniqueItems": true}}
        });
        let e = grammars.compile(&Grammar::JsonSchema(schema)).unwrap_err();
        assert!(e.contains("\"uniqueItems\" at /properties/tags"), "{e}");
        let e = grammars.compile(&Grammar::Regex("a(".into())).unwrap_err();
        assert!(e.starts_with("regex is not valid"), "{e}");
        let e = grammars
            .compile(&Grammar::Lark("start: nothing".into()))
            .unwrap_err();
        assert!(e.starts_with("grammar is not valid"), "{e}");
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
        assert_eq!(plain.sample(&logits), lone);
        let mut s = Sampler::new(SamplingParams::default())
            .constrained(&[], &compiled(&v, Grammar::JsonObject));
        let mut text = Vec::new();
        for _ in 0..12 {
            let t = s.sample(&logits);
            if v.kind(t) == TokenKind::End {
                break;
            }
            text.extend_from_slice(v.bytes(t));
        }
        // {" (": cannot start an object); ": ends the key; ": opens a string value with
        // a colon in it; ": no longer fits (nothing follows a value but , or }), {"
        // does and ends the string; } closes the object; the end.
        assert_eq!(String::from_utf8_lossy(&text), "{\"\":\":{\"}");
        assert_eq!(s.constraint_done(), Some(true));
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
        let schema = Grammar::JsonSchema(serde_json::json!({
            "type": "object",
            "properties": {
                "n": {"type": "integer"},
                "k": {"enum": ["x", "y"]},
                "l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
                "o": {"type": "string"},
                "t": {"$ref": "#"}
            },
            "additionalProperties": false,
            "required": ["n", "k", "l"]
        }));
        let pieces = [
            "{", "}", "[", "]", ",", ":", "\"", "\"n\"", "\"k\":", "\"l\"", "\"o\"", "\"t\":", "1",
            "0", "-", ".", "5", "true", "false", "x", "\"y\"", "ab", " ", "\n  ", "é", "{\"",
            // Every byte the schema's texts need alone, as byte-level vocabularies have.
            "k", "l", "n", "o", "t", "y", "r", "u", "e", "f", "a", "s",
        ];
        let v = pieces_vocab(&pieces);
        let format = compiled(&v, schema);
        let mut rng = Rng::new(2);
        let mut whole = 0;
        for seed in 0..300u64 {
            let mut s = Sampler::new(SamplingParams {
                temperature: [0.0, 1.0, 3.0][seed as usize % 3],
                seed,
                ..Default::default()
            })
            .constrained(&[], &format);
            let (text, ended) = walk(&mut s, &v, &mut rng, 80);
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
