//! sluice: run LLMs larger than accelerator memory by streaming compressed per-layer weight
//! blobs from NVMe. See ARCHITECTURE.md for the map of modules and the data flow.

// Every unsafe operation sits in an `unsafe` block with its SAFETY argument, inside unsafe
// functions too.
#![deny(unsafe_op_in_unsafe_fn)]

pub mod backend;
pub mod dtype;
pub mod engine;
#[doc(hidden)]
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzzing;
pub mod hostbuf;
pub mod hostmem;
pub mod import;
pub mod io;
pub mod model;
pub mod pipeline;
pub mod plan;
pub mod server;
pub mod store;
pub mod text;
pub mod util;
