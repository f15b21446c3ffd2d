//! Sampling: penalties on tokens already seen, then greedy, or temperature followed by
//! top-k, top-p and min-p (transformers' warper order), drawn with a seeded generator so a
//! seed reproduces a completion. Sampling runs on the host from each sequence's logits row,
//! so every backend samples the same way.

use std::collections::{HashMap, HashSet};

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

impl SamplingParams {
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!(
                "temperature {} must be a finite number >= 0",
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

    fn penalizes(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
    }
}

pub struct Sampler {
    params: SamplingParams,
    state: u64,
    cand: Vec<(f32, u32)>,
    /// With penalties: the logits row after them, the tokens of the prompt and the text so
    /// far, and how often each was generated.
    penalized: Vec<f32>,
    seen: HashSet<u32>,
    counts: HashMap<u32, u32>,
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
            state: params.seed ^ 0x9E3779B97F4A7C15,
            cand: Vec::new(),
            penalized: Vec::new(),
            seen,
            counts: HashMap::new(),
        }
    }

    /// The penalties applied to a copy of `logits` (only the tokens seen change).
    fn penalize(&mut self, logits: &[f32]) {
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
    }

    /// Samples the next token and remembers it for the penalties.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if !self.params.penalizes() {
            return self.draw(logits);
        }
        self.penalize(logits);
        let row = std::mem::take(&mut self.penalized);
        let t = self.draw(&row);
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
        // splitmix64
        self.state = self.state.wrapping_add(0x9E3779B97F4A7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (l / p.temperature, i as u32)),
        );
        let by_logit_desc =
            |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if p.top_k > 0 && p.top_k < self.cand.len() {
            self.cand.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
            self.cand.truncate(p.top_k);
        }
        self.cand.sort_unstable_by(by_logit_desc);
        // Softmax over the survivors (logits become probabilities in place).
        let mx = self.cand[0].0;
        let mut sum = 0.0;
        for c in self.cand.iter_mut() {
            c.0 = (c.0 - mx).exp();
            sum += c.0;
        }
        for c in self.cand.iter_mut() {
            c.0 /= sum;
        }
        if p.top_p > 0.0 && p.top_p < 1.0 {
            let mut acc = 0.0;
            let mut keep = self.cand.len();
            for (i, c) in self.cand.iter().enumerate() {
                acc += c.0;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            self.cand.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * self.cand[0].0;
            let keep = self.cand.iter().take_while(|c| c.0 >= floor).count().max(1);
            self.cand.truncate(keep);
        }
        let total: f32 = self.cand.iter().map(|c| c.0).sum();
        let mut r = self.uniform() * total;
        for c in &self.cand {
            r -= c.0;
            if r < 0.0 {
                return c.1;
            }
        }
        self.cand.last().map_or(0, |c| c.1)
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
}
