//! The Llama-family model: architecture config (importers fill it) and the forward pass.

pub mod llama;
pub mod rope;

pub use crate::store::arch::{Arch, ArchConfig, RopeScaling};
pub use llama::{Llama, ModelError, ModelOptions, SeqStep};
pub use rope::{inv_freq, rope_table};
