//! The Llama-family model: architecture config (importers fill it) and the forward pass.

pub mod config;
pub mod llama;

pub use config::{Arch, ArchConfig, RopeScaling};
pub use llama::{Llama, ModelError, ModelOptions, SeqStep};
