//! The model: the architecture config (importers fill it; its recipes say which tensors
//! a layer of each architecture has) and the decoder every architecture runs.

pub mod decoder;
pub mod layout;
pub mod moe;
pub mod rope;

pub use crate::backend::KvDtype;
pub use crate::store::arch::{Activation, Arch, ArchConfig, ArchExt, Recipe, RopeScaling};
pub use decoder::{Decoder, ModelError, ModelOptions, SeqStep, TREE_ROOT};
pub use rope::{inv_freq, rope_table};
