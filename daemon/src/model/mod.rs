//! The Llama-family model: architecture config (importers fill it; the forward pass reads it).

pub mod config;

pub use config::{Arch, ArchConfig, RopeScaling};
