//! The on-disk model store: manifest, frames, codecs, writer (pack), reader, verify.

// Input from outside (files, requests, the disk) never meets an unwrap or expect here: an
// `expect` on a true invariant carries an #[allow] saying why it holds.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod arch;
pub mod auto;
pub mod codec;
pub mod float;
pub mod format;
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod inspect;
pub mod link;
pub mod quantize;
pub mod reader;
pub mod source;
pub mod spec;
pub mod verify;
pub mod writer;

pub use arch::{Arch, ArchConfig, RopeScaling};
pub use codec::{Codec, FrameDecoder, FrameFault};
pub use format::{LayerUnit, Manifest, TensorEntry, UnitKind};
pub use reader::Store;

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    // The I/O error is in the message, so it is not also a `source`: a chain printed
    // with `{:#}` would say it twice.
    #[error("{op} {path}: {err}")]
    Io {
        op: &'static str,
        path: PathBuf,
        err: std::io::Error,
    },
    #[error("{path}: not a sluice manifest (starts with {found:02x?}, expected \"SLUICE\\0\\x01\"); point at a directory written by `sluiced pack`")]
    BadMagic { path: PathBuf, found: Vec<u8> },
    #[error("{path}: store format version {found}, this sluiced reads versions {} to {}; repack the model with this sluiced", format::FORMAT_VERSION_MIN, format::FORMAT_VERSION)]
    Version { path: PathBuf, found: u32 },
    #[error(
        "{path}: manifest truncated: needs {expected} bytes, file has {found}; repack the model"
    )]
    ManifestTruncated {
        path: PathBuf,
        expected: u64,
        found: u64,
    },
    #[error("{path}: manifest checksum mismatch (stored {stored:016x}, computed {computed:016x}): the file is corrupt; repack the model")]
    ManifestChecksum {
        path: PathBuf,
        stored: u64,
        computed: u64,
    },
    #[error("{path}: invalid manifest: {msg}")]
    Invalid { path: PathBuf, msg: String },
    /// Not a store's fault: the path is something else, or the request is not possible
    /// as asked (the message says what to do).
    #[error("{path}: {msg}")]
    Refused { path: PathBuf, msg: String },
    #[error("{path}: {found} bytes, but the manifest needs {expected} ({unit} ends at offset {unit_end}): the file is truncated; copy or repack it")]
    WeightsTruncated {
        path: PathBuf,
        found: u64,
        expected: u64,
        unit: String,
        unit_end: u64,
    },
    #[error(
        "{path}: {unit}, frame {frame} at offset {offset} ({stored_len} stored bytes): {fault}"
    )]
    Frame {
        path: PathBuf,
        unit: String,
        frame: usize,
        offset: u64,
        stored_len: u64,
        fault: FrameFault,
    },
}

impl StoreError {
    pub fn io(op: &'static str, path: &Path, err: std::io::Error) -> Self {
        StoreError::Io {
            op,
            path: path.to_path_buf(),
            err,
        }
    }

    pub fn invalid(path: &Path, msg: impl Into<String>) -> Self {
        StoreError::Invalid {
            path: path.to_path_buf(),
            msg: msg.into(),
        }
    }

    /// True for faults in the stored data (checksum, decompression): DATA_LOSS for a server.
    pub fn is_data_loss(&self) -> bool {
        matches!(
            self,
            StoreError::Frame { .. } | StoreError::WeightsTruncated { .. }
        )
    }
}

/// Finds the end-of-turn tokens a chat template uses among the vocabulary, so generation
/// stops at them as well as at eos (at import, and for a template given at run time).
/// Harmony's (gpt-oss) are `<|return|>` and `<|call|>`: its `<|end|>` ends a message.
pub fn end_of_turn_tokens(
    template: Option<&str>,
    lookup: impl Fn(&str) -> Option<u32>,
) -> Vec<u32> {
    const END_OF_TURN: [&str; 6] = [
        "<|im_end|>",
        "<|eot_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
    ];
    let Some(t) = template else { return Vec::new() };
    let harmony = t.contains("<|channel|>") && t.contains("<|return|>");
    let ends: &[&str] = if harmony {
        &["<|return|>", "<|call|>"]
    } else {
        &END_OF_TURN
    };
    ends.iter()
        .filter(|s| t.contains(*s))
        .filter_map(|s| lookup(s))
        .collect()
}
