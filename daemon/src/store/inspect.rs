//! Summaries of a store for `sluiced inspect`: per-unit and per-dtype sizes and ratios.

use super::arch::ArchConfig;
use super::format::{Manifest, TokenizerSpec};
use crate::dtype::DType;
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Serialize, Debug)]
pub struct UnitSummary {
    pub name: String,
    pub tensors: usize,
    pub frames: usize,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    pub ratio: f64,
}

#[derive(Serialize, Debug)]
pub struct DTypeSummary {
    pub dtype: DType,
    pub tensors: usize,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    pub ratio: f64,
    /// Frames of this dtype stored compressed (the rest are kept raw by the 3 % rule).
    pub frames_compressed: usize,
    pub frames: usize,
}

#[derive(Serialize, Debug)]
pub struct TokenizerSummary {
    pub kind: String,
    pub tokens: usize,
    pub merges: usize,
    pub pre: Option<String>,
}

#[derive(Serialize, Debug)]
pub struct Summary {
    pub source: String,
    pub config: ArchConfig,
    /// The mixture of experts (None: dense MLPs), which the config's own fields leave out.
    pub moe: Option<super::arch::MoeConfig>,
    pub tokenizer: TokenizerSummary,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub end_tokens: Vec<u32>,
    pub add_bos: bool,
    pub chat_template: bool,
    pub codec: String,
    pub frame_size: u32,
    pub frames: usize,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
    pub ratio: f64,
    pub units: Vec<UnitSummary>,
    pub dtypes: Vec<DTypeSummary>,
    /// The source file a linked store reads its weights from (`pack --link`).
    pub linked: Option<String>,
    /// The float codec's shared codes (format 8) and their bytes in the manifest.
    pub shared_codes: usize,
    pub shared_code_bytes: u64,
}

fn ratio(stored: u64, raw: u64) -> f64 {
    if raw == 0 {
        1.0
    } else {
        stored as f64 / raw as f64
    }
}

pub fn summarize(m: &Manifest) -> Summary {
    let mut dtypes: BTreeMap<DType, DTypeSummary> = BTreeMap::new();
    let mut units = Vec::with_capacity(m.units.len());
    for u in &m.units {
        for t in &u.tensors {
            let d = dtypes.entry(t.dtype).or_insert(DTypeSummary {
                dtype: t.dtype,
                tensors: 0,
                raw_bytes: 0,
                stored_bytes: 0,
                ratio: 1.0,
                frames_compressed: 0,
                frames: 0,
            });
            d.tensors += 1;
        }
        for f in &u.frames {
            // A frame holds one dtype (a piece of one tensor, or a unit's neighbouring
            // vectors whole): the tensor whose region holds its start has it.
            let Some(t) = u.tensor_at(f.raw_offset) else {
                continue;
            };
            let Some(d) = dtypes.get_mut(&u.tensors[t].dtype) else {
                continue; // every tensor's type was inserted above
            };
            d.raw_bytes += f.raw_len as u64;
            d.stored_bytes += f.stored_len();
            d.frames += 1;
            d.frames_compressed += f.planes.iter().any(|p| p.compressed) as usize;
        }
        units.push(UnitSummary {
            name: u.kind.to_string(),
            tensors: u.tensors.len(),
            frames: u.frames.len(),
            raw_bytes: u.raw_len,
            stored_bytes: u.stored_len,
            ratio: ratio(u.stored_len, u.raw_len),
        });
    }
    let dtypes = dtypes
        .into_values()
        .map(|mut d| {
            d.ratio = ratio(d.stored_bytes, d.raw_bytes);
            d
        })
        .collect();
    let tokenizer = match &m.tokenizer {
        TokenizerSpec::HfJson(_) => TokenizerSummary {
            kind: "tokenizer.json".into(),
            tokens: 0,
            merges: 0,
            pre: None,
        },
        TokenizerSpec::Gguf(v) => TokenizerSummary {
            kind: match v.model.as_str() {
                "llama" => "gguf llama (SentencePiece)".into(),
                "gpt2" => "gguf gpt2 (byte-level BPE)".into(),
                other => format!("gguf {other}"),
            },
            tokens: v.tokens.len(),
            merges: v.merges.len(),
            pre: v.pre.clone(),
        },
    };
    let (raw, stored) = (m.raw_bytes(), m.stored_bytes());
    Summary {
        source: m.source.clone(),
        config: m.arch.clone(),
        moe: m.arch.moe.clone(),
        tokenizer,
        bos: m.special.bos,
        eos: m.special.eos,
        end_tokens: m.special.end_tokens.clone(),
        add_bos: m.special.add_bos,
        chat_template: m.chat_template.is_some(),
        codec: m.codec.to_string(),
        frame_size: m.frame_size,
        frames: m.units.iter().map(|u| u.frames.len()).sum(),
        raw_bytes: raw,
        stored_bytes: stored,
        ratio: ratio(stored, raw),
        units,
        dtypes,
        linked: m.link.as_ref().map(|l| l.path().display().to_string()),
        shared_codes: m.codes.len(),
        shared_code_bytes: postcard::to_stdvec(&m.codes).map_or(0, |b| b.len() as u64),
    }
}

/// One tensor of a store as `sluiced inspect --tensors` lists it: where it is, its type and
/// shape, and the XXH3-64 of its decoded bytes (two stores hold the same tensor exactly
/// when these agree).
#[derive(Serialize, Debug, PartialEq, Eq)]
pub struct TensorDigest {
    pub unit: String,
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub bytes: u64,
    pub xxh3: String,
}

/// Every tensor of `store`, in blob order, read and decoded unit by unit (each frame's
/// checksum checked on the way); `on_unit` gets each unit's stored bytes as it is done.
pub fn tensor_digests(
    store: &super::Store,
    mut on_unit: impl FnMut(u64),
) -> Result<Vec<TensorDigest>, super::StoreError> {
    let file = store.open_weights()?;
    let m = store.manifest();
    let mut dec = store
        .frame_decoder(m.frame_raw_len_max() as usize)
        .map_err(|e| super::StoreError::io("make a frame decoder for", store.dir(), e))?;
    let (mut stored, mut raw) = (Vec::new(), Vec::new());
    let mut out = Vec::new();
    for (i, u) in m.units.iter().enumerate() {
        raw.resize(u.raw_len as usize, 0);
        store.read_unit(&file, i, &mut stored, &mut raw, &mut dec)?;
        for t in &u.tensors {
            let bytes = &raw[t.offset as usize..(t.offset + t.len) as usize];
            out.push(TensorDigest {
                unit: u.kind.to_string(),
                name: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                bytes: t.len,
                xxh3: format!("{:016x}", crate::util::xxh3(bytes)),
            });
        }
        on_unit(u.stored_len);
    }
    Ok(out)
}
