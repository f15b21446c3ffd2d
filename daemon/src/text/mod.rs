//! Text: tokenizer, chat template, sampler, incremental detokenization, stop strings.

pub mod answer;
pub mod detok;
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod grammar;
pub mod harmony;
pub mod sampler;
pub mod sandbox;
pub mod spm;
pub mod template;
pub mod tokenizer;
pub mod tool_parse;
pub mod tools;

pub use sampler::{Sampler, SamplingParams, TokenLogprob};
pub use template::{ChatMessage, ChatTemplate};
pub use tokenizer::Tokenizer;
