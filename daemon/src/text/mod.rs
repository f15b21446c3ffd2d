//! Text: tokenizer, chat template, sampler, incremental detokenization, stop strings.

pub mod detok;
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod json;
pub mod sampler;
pub mod sandbox;
pub mod schema;
pub mod spm;
pub mod template;
pub mod tokenizer;

pub use sampler::{Sampler, SamplingParams, TokenLogprob};
pub use template::{ChatMessage, ChatTemplate};
pub use tokenizer::Tokenizer;
