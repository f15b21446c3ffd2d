//! `sluiced run`'s generation: one `Sequence` in KV slot 0 driven to its end, one step
//! at a time, with the text as it becomes final and the timings.

use super::sequence::{Finish, GenerateParams, SeqLimits, Sequence};
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
}

impl GenerateOutput {
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_token_ids.len() as f64 / self.prefill_s.max(1e-9)
    }

    pub fn decode_tokens_per_s(&self) -> f64 {
        self.decode_steps as f64 / self.decode_s.max(1e-9)
    }
}

/// Generates from `prompt` (token ids) in KV slot 0, calling `on_text` with each new piece.
pub fn generate<B: Backend>(
    runner: &mut Pipeline<B>,
    tok: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_text: impl FnMut(&str),
) -> Result<GenerateOutput, EngineError> {
    let opts = *runner.options();
    let limits = SeqLimits {
        max_context: opts.max_context,
        vocab: tok.vocab(),
    };
    let mut seq =
        Sequence::new(prompt.to_vec(), params.clone(), 0, limits).map_err(EngineError::Invalid)?;
    let mut logits = Vec::new();
    let mut text = String::new();
    let t0 = Instant::now();
    let mut decode_start = None;
    let mut step = SeqStep {
        slot: 0,
        pos: 0,
        tokens: Vec::with_capacity(opts.max_batch_tokens),
    };
    while seq.fill_step(opts.max_batch_tokens, &mut step) {
        runner.step(std::slice::from_ref(&step), &mut logits)?;
        let piece = seq.advance(step.tokens.len(), &logits, tok, 0);
        if decode_start.is_none() && !seq.generated().is_empty() {
            decode_start = Some(Instant::now());
        }
        if let Some(p) = piece {
            on_text(&p.text);
            text.push_str(&p.text);
        }
    }
    let t1 = decode_start.unwrap_or_else(Instant::now);
    let prefill_s = (t1 - t0).as_secs_f64();
    let decode_steps = seq.decode_steps();
    // `fill_step` returns false only once the sequence has finished.
    let (tail, done) = seq.close(Finish::Length, tok);
    if let Some(p) = tail {
        if !p.text.is_empty() {
            on_text(&p.text);
            text.push_str(&p.text);
        }
    }
    Ok(GenerateOutput {
        prompt_token_ids: done.prompt_token_ids,
        generated_token_ids: done.generated_token_ids,
        text,
        finish_reason: done.finish,
        prefill_s,
        decode_s: t1.elapsed().as_secs_f64(),
        decode_steps,
    })
}
