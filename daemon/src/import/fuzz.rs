//! The importers' fuzz targets (cargo-fuzz in `fuzz/`, built with the `fuzz` feature; the
//! committed corpora also run as a plain test, `fuzzing::tests`): a GGUF file and a
//! safetensors header with its config. Any input may be refused; none may panic, hang or
//! allocate without bound.

use crate::import::gguf::Imported;
use std::path::Path;

/// Zero bytes the gguf target appends for tensor data: the seeds are headers, and the tiny
/// models' tensors fit.
pub(crate) const GGUF_DATA_PAD: usize = 384 << 10;

/// A GGUF file's header, metadata and tensor table; then, with zeros for tensor data, the
/// whole import (architecture, config, tensor map, tokenizer): what it read, when it
/// imports (`fuzzing::gguf` then builds its tokenizer).
pub fn gguf(data: &[u8]) -> Option<Imported> {
    let path = Path::new("fuzz.gguf");
    let _ = crate::import::gguf::parse(data, path);
    crate::import::gguf::import_bytes(&with_data_pad(data), path).ok()
}

/// `data` and `GGUF_DATA_PAD` zero bytes after it.
pub(crate) fn with_data_pad(data: &[u8]) -> Vec<u8> {
    let mut file = Vec::with_capacity(data.len() + GGUF_DATA_PAD);
    file.extend_from_slice(data);
    file.resize(data.len() + GGUF_DATA_PAD, 0);
    file
}

/// A safetensors file (its header) and a config.json: the first 0 byte splits them.
pub fn safetensors(data: &[u8]) {
    let (st, config) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let _ = crate::import::hf::check_header_bytes(Path::new("fuzz.safetensors"), st)
        .map(|()| safetensors::SafeTensors::deserialize(st).map(|t| t.tensors().len()));
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(config) {
        let _ = crate::import::hf::arch_of_config(&v, Path::new("config.json"));
    }
}
