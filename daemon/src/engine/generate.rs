//! Generation for one sequence: chunked prefill, then decode steps with sampling, end
//! tokens, stop strings, incremental text and timings.

use super::EngineError;
use crate::backend::Backend;
use crate::model::SeqStep;
use crate::pipeline::Pipeline;
use crate::text::detok::{Detokenizer, StopMatcher};
use crate::text::{Sampler, SamplingParams, Tokenizer};
use serde::Serialize;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Generate past end tokens (benchmarks); they are then ordinary tokens.
    pub ignore_eos: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end token (eos, end of turn).
    Stop,
    Length,
    StopString,
    /// The context limit.
    Context,
}

#[derive(Clone, Debug, Serialize)]
pub struct GenerateOutput {
    pub prompt_token_ids: Vec<u32>,
    /// Every sampled token, the end token included when one ended generation.
    pub generated_token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
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
    params.sampling.validate().map_err(EngineError::Invalid)?;
    let opts = *runner.options();
    if prompt.is_empty() {
        return Err(EngineError::Invalid("the prompt is empty".into()));
    }
    if prompt.len() >= opts.max_context {
        return Err(EngineError::Invalid(format!(
            "the prompt has {} tokens; the context holds {}",
            prompt.len(),
            opts.max_context
        )));
    }
    let mut logits = Vec::new();
    let t0 = Instant::now();
    let mut pos = 0;
    for chunk in prompt.chunks(opts.max_batch_tokens) {
        runner.step(
            &[SeqStep {
                slot: 0,
                pos,
                tokens: chunk.to_vec(),
            }],
            &mut logits,
        )?;
        pos += chunk.len();
    }
    let mut sampler = Sampler::new(params.sampling);
    let mut next = sampler.sample(&logits);
    let prefill_s = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut detok = Detokenizer::default();
    let mut stops = StopMatcher::new(params.stop.clone());
    let mut generated = Vec::new();
    let mut text = String::new();
    let mut steps = 0;
    let finish = loop {
        generated.push(next);
        if tok.is_end(next) && !params.ignore_eos {
            break FinishReason::Stop;
        }
        let (out, stopped) = stops.push(&detok.push(tok, next));
        if !out.is_empty() {
            on_text(&out);
            text.push_str(&out);
        }
        if stopped {
            break FinishReason::StopString;
        }
        if generated.len() >= params.max_tokens {
            break FinishReason::Length;
        }
        if pos + 1 > opts.max_context {
            break FinishReason::Context;
        }
        runner.step(
            &[SeqStep {
                slot: 0,
                pos,
                tokens: vec![next],
            }],
            &mut logits,
        )?;
        pos += 1;
        steps += 1;
        next = sampler.sample(&logits);
    };
    if finish != FinishReason::StopString {
        let (tail, _) = stops.push(&detok.flush(tok));
        let tail = tail + &stops.finish();
        if !tail.is_empty() {
            on_text(&tail);
            text.push_str(&tail);
        }
    }
    Ok(GenerateOutput {
        prompt_token_ids: prompt.to_vec(),
        generated_token_ids: generated,
        text,
        finish_reason: finish,
        prefill_s,
        decode_s: t1.elapsed().as_secs_f64(),
        decode_steps: steps,
    })
}
