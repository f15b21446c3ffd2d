//! `sluiced run`'s generation: one `Sequence` in KV slot 0 (or `--parallel N` of them in
//! slots 0..N, one pass per step for all) driven to its end, one step at a time, with the
//! text as it becomes final and the timings.

use super::draft::SpecStats;
use super::draft_model::DraftModel;
use super::prefix::PrefixCache;
use super::sequence::{Finish, GenerateParams, SeqLimits, Sequence};
use super::step::StepBuilder;
use super::EngineError;
use crate::backend::Backend;
use crate::model::SeqStep;
use crate::pipeline::Pipeline;
use crate::text::Tokenizer;
use serde::Serialize;
use std::time::Instant;

#[derive(Clone, Debug, Serialize)]
pub struct GenerateOutput {
    pub prompt_token_ids: Vec<u32>,
    /// Every sampled token, the end token included when one ended generation.
    pub generated_token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: Finish,
    pub prefill_s: f64,
    pub decode_s: f64,
    /// Decode steps run (each after the first sampled token).
    pub decode_steps: usize,
    /// Passes of the batch once every prompt was in (each serves every sequence still
    /// running).
    pub decode_passes: usize,
    /// Speculative decoding's counts for this sequence (zeros without drafting).
    pub speculative: SpecStats,
    /// A draft model's time and passes over the batch's run (zeros without one).
    pub draft_s: f64,
    pub draft_passes: u64,
    /// Prompt tokens whose KV came from another sequence's (the prefix cache: `--parallel`
    /// sequences share their prompt's).
    pub cached_tokens: usize,
}

/// How many sequences of the prompt run together, and whether they share its KV.
#[derive(Clone, Copy, Debug)]
pub struct Batch {
    pub n: usize,
    /// The prefix cache: the sequences after the first take the prompt's KV from it.
    pub prefix_cache: bool,
}

/// `n` sequences, sharing the prompt's KV.
impl From<usize> for Batch {
    fn from(n: usize) -> Batch {
        Batch {
            n,
            prefix_cache: true,
        }
    }
}

impl GenerateOutput {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_token_ids.len() as f64 / self.prefill_s.max(1e-9)
    }

    /// Tokens the decode steps yielded: every generated token after the first (which the
    /// last prefill step gives).
    pub fn decode_tokens(&self) -> usize {
        self.generated_token_ids.len().saturating_sub(1)
    }

    pub fn decode_tokens_per_s(&self) -> f64 {
        self.decode_tokens() as f64 / self.decode_s.max(1e-9)
    }
}

/// Generates from `prompt` (token ids) in KV slot 0, calling `on_text` with each new piece.
pub fn generate<B: Backend>(
    runner: &mut Pipeline<B>,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    on_text: impl FnMut(&str),
) -> Result<GenerateOutput, EngineError> {
    let mut outs = generate_parallel(runner, tok, prompt, params, 1, on_text)?;
    outs.pop()
        .ok_or_else(|| EngineError::Invalid("no sequence ran".into()))
}

/// `sluiced run --parallel N`: `n` sequences of the same prompt in KV slots 0..n, stepped
/// together (each pass serves every sequence still running: prefill chunks within the
/// step's token budget, then one decode row each). Sequence `i` samples with seed
/// `params.sampling.seed + i`, so sampled texts differ and greedy ones agree. `on_text`
/// sees sequence 0's text. Every output carries the batch's wall times: prefill until
/// every prompt is in, decode from then to the end (so the batch's decode rate is the sum
/// of `decode_steps` over `decode_s`).
pub fn generate_parallel<B: Backend>(
    runner: &mut Pipeline<B>,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    n: usize,
    on_text: impl FnMut(&str),
) -> Result<Vec<GenerateOutput>, EngineError> {
    generate_with(runner, None, tok, prompt, params, n, on_text)
}

/// `generate_parallel` with a draft model proposing each sequence's tokens before each
/// step (`params.draft` of kind `Model`; `draft` in the same KV slots).
pub fn generate_with<B: Backend>(
    runner: &mut Pipeline<B>,
    mut draft: Option<&mut DraftModel<B>>,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    batch: impl Into<Batch>,
    mut on_text: impl FnMut(&str),
) -> Result<Vec<GenerateOutput>, EngineError> {
    let opts = *runner.options();
    let batch: Batch = batch.into();
    let n = batch.n;
    if n == 0 || n > opts.kv_slots {
        return Err(EngineError::Invalid(format!(
            "{n} parallel sequences with {} KV slots",
            opts.kv_slots
        )));
    }
    let limits = SeqLimits {
        max_context: opts.max_context,
        vocab: tok.vocab(),
    };
    let mut seqs = Vec::with_capacity(n);
    for i in 0..n {
        let mut p = params.clone();
        p.sampling.seed = p.sampling.seed.wrapping_add(i as u64);
        seqs.push(Sequence::new(prompt.to_vec(), p, i, limits).map_err(EngineError::Invalid)?);
    }
    let mut texts = vec![String::new(); n];
    let mut logits = Vec::new();
    let t0 = Instant::now();
    let mut decode_start = None;
    let mut steps: Vec<SeqStep> = Vec::with_capacity(n);
    let mut spec = vec![SpecStats::default(); n];
    let mut builder = StepBuilder::new(runner.backend.unified());
    // Which sequence each step of the pass belongs to.
    let mut owner = Vec::with_capacity(n);
    let mut decode_passes = 0;
    let mut prefix = PrefixCache::new(opts.kv_slots, batch.prefix_cache);
    loop {
        prefix.before_step(runner, &mut seqs);
        if let Some(d) = draft.as_deref_mut() {
            d.propose(runner, &mut seqs)?;
        }
        let k = builder.build(n, |i| &seqs[i], &opts, &mut steps, &mut owner);
        if k == 0 {
            break;
        }
        runner.step(&steps[..k], &mut logits)?;
        builder.ran(&steps[..k], runner.last_pass());
        decode_passes += usize::from(decode_start.is_some());
        let vocab = tok.vocab() as usize;
        let mut row = 0;
        for (k, &i) in owner.iter().enumerate() {
            let (ran, rows) = (steps[k].tokens.len(), steps[k].logit_rows());
            let (before, decoding) = (seqs[i].generated().len(), seqs[i].is_decoding());
            let piece = seqs[i].advance(ran, &logits[row * vocab..(row + rows) * vocab], tok, 0);
            row += rows;
            if decoding {
                spec[i].record(ran - 1, seqs[i].generated().len() - before);
            }
            if let Some(p) = piece {
                if i == 0 {
                    on_text(&p.text);
                }
                texts[i].push_str(&p.text);
            }
        }
        if decode_start.is_none()
            && seqs
                .iter()
                .all(|s| !s.generated().is_empty() || s.finished().is_some())
        {
            decode_start = Some(Instant::now());
        }
    }
    let t1 = decode_start.unwrap_or_else(Instant::now);
    let ran = Ran {
        prefill_s: (t1 - t0).as_secs_f64(),
        decode_s: t1.elapsed().as_secs_f64(),
        decode_passes,
        draft_s: draft.as_ref().map_or(0.0, |d| d.seconds),
        draft_passes: draft.as_ref().map_or(0, |d| d.passes),
    };
    Ok(outputs(seqs, texts, &spec, ran, tok, on_text))
}

/// What a batch's run measured, which every sequence's output carries.
struct Ran {
    prefill_s: f64,
    decode_s: f64,
    decode_passes: usize,
    draft_s: f64,
    draft_passes: u64,
}

/// Each sequence closed (its held-back text released to `texts` and, for sequence 0,
/// `on_text`) into its output.
fn outputs(
    seqs: Vec<Sequence>,
    mut texts: Vec<String>,
    spec: &[SpecStats],
    ran: Ran,
    tok: &Tokenizer,
    mut on_text: impl FnMut(&str),
) -> Vec<GenerateOutput> {
    let mut outs = Vec::with_capacity(seqs.len());
    for (i, seq) in seqs.into_iter().enumerate() {
        let decode_steps = seq.decode_steps();
        let cached_tokens = seq.cached();
        // `fill_step` returns false only once the sequence has finished.
        let (tail, done) = seq.close(Finish::Length, tok);
        if let Some(p) = tail {
            if !p.text.is_empty() {
                if i == 0 {
                    on_text(&p.text);
                }
                texts[i].push_str(&p.text);
            }
        }
        outs.push(GenerateOutput {
            prompt_token_ids: done.prompt_token_ids,
            generated_token_ids: done.generated_token_ids,
            text: std::mem::take(&mut texts[i]),
            finish_reason: done.finish,
            prefill_s: ran.prefill_s,
            decode_s: ran.decode_s,
            decode_steps,
            decode_passes: ran.decode_passes,
            speculative: spec[i],
            draft_s: ran.draft_s,
            draft_passes: ran.draft_passes,
            cached_tokens,
        });
    }
    outs
}
