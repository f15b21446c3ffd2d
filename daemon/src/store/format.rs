//! Store format version 11: the manifest and its on-disk framing.
//!
//! `manifest.bin` = magic `SLUICE\0\x01` | format version (u32 LE) | payload length (u64 LE)
//! | payload (postcard; from version 6 a zstd frame of it) | xxh3-64 of everything before
//! it (u64 LE).
//!
//! The payload of version 1 is the `Manifest`; version 2 appends the `ArchExt` (the
//! config of the architectures added since: q/k norm, sliding-window layers, ...) after
//! it; version 3 then the mixture of experts (`Option<MoeConfig>`); version 4 then the
//! clamped SwiGLU's constants (`Option<SwigluClamp>`, gpt-oss); version 5 has the payload
//! of 4 and frames may use the `float` codec (a codec an older sluiced cannot decode, so
//! it refuses the store by its version); version 6 appends the linked source
//! (`Option<Link>`, `pack --link`) and compresses the payload (a GGUF's vocabulary is
//! megabytes of strings: a linked store must cost well under 1 % of its source); version 7
//! has the payload of 6 and its f16 frames may use the `float` codec's `F16Bits` layout
//! (exponent-only symbols; an older sluiced would fail on the frame, so the version
//! refuses the store up front); version 8 appends the shared codes of the float codec
//! (`Vec<float::SharedCode>`), which its small frames' planes may name (mode 2, which
//! an older sluiced cannot decode); version 9 has the payload of 8 and its f32 frames may
//! use the float codec's `F32Top` layout (five planes, which an older sluiced would refuse
//! frame by frame); version 10 has the payload of 9 and its float-coded planes may be
//! sparse (mode 3, which an older sluiced would fail on mid-stream); version 11 appends
//! what the source says of itself (`SourceMeta`: the quantization a GGUF declares, the
//! sampling the model's authors recommend). Stores of versions 1 to 10 still open, with
//! the defaults of a Llama-family model, no experts, no clamp, no link, no shared codes
//! and no source metadata.

use super::arch::{ArchConfig, ArchExt, MoeConfig, SwigluClamp};
use super::codec::{Codec, Plane};
use super::float::{SharedCode, SHARED_CODES_MAX};
use super::StoreError;
use crate::dtype::DType;
use crate::util::xxh3 as xxh3_64;
use serde::{Deserialize, Serialize};
use std::ops::Range;
use std::path::Path;

pub const MAGIC: [u8; 8] = *b"SLUICE\0\x01";
pub const FORMAT_VERSION: u32 = 11;
/// The oldest format this sluiced still reads.
pub const FORMAT_VERSION_MIN: u32 = 1;
pub const MANIFEST_FILE: &str = "manifest.bin";
pub const WEIGHTS_FILE: &str = "weights.bin";
/// Every blob starts at a multiple of this in weights.bin, so it can be read with O_DIRECT.
pub const BLOB_ALIGN: u64 = 4096;
/// Every tensor starts at a multiple of this inside its decompressed blob (device copies
/// and vector loads want aligned bases).
pub const TENSOR_ALIGN: u64 = 256;
/// Largest decompressed blob we accept (a sanity bound against crafted manifests: the
/// largest layer unit of a 405B model is ~4 GiB).
pub const BLOB_RAW_BYTES_MAX: u64 = 16 << 30;
/// Largest frame we accept.
pub const FRAME_RAW_BYTES_MAX: u32 = 64 << 20;
const HEADER_LEN: usize = 8 + 4 + 8;
/// zstd level of a format-6 payload (2 MB of Gemma 3's vocabulary in about 0.1 s).
const PAYLOAD_ZSTD_LEVEL: i32 = 9;
const MANIFEST_BYTES_MAX: u64 = 1 << 30;

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum UnitKind {
    /// Token embedding table (also the output head when embeddings are tied).
    Embedding,
    /// Decoder layer i.
    Decoder(u32),
    /// Final norm and, when untied, the output projection.
    Head,
}

impl std::fmt::Display for UnitKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UnitKind::Embedding => f.write_str("embedding"),
            UnitKind::Decoder(i) => write!(f, "layer {i}"),
            UnitKind::Head => f.write_str("head"),
        }
    }
}

/// One compressed frame of a blob.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Absolute offset of the stored bytes in weights.bin.
    pub file_offset: u64,
    /// Offset of the decompressed bytes in the layer's blob.
    pub raw_offset: u64,
    pub raw_len: u32,
    /// xxh3-64 of the decompressed bytes.
    pub checksum: u64,
    /// Codec of the planes marked compressed; `None` when the frame is stored raw.
    pub codec: Codec,
    /// One plane, or 2/4 byte planes (most significant byte first) for split floats.
    pub planes: Vec<Plane>,
}

impl Frame {
    pub fn stored_len(&self) -> u64 {
        self.planes.iter().map(|p| p.stored_len as u64).sum()
    }
}

/// A tensor inside a decompressed blob.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Canonical (Hugging Face) name, e.g. `model.layers.3.self_attn.q_proj.weight`.
    pub name: String,
    pub dtype: DType,
    /// Row-major; the last dimension is contiguous (PyTorch order, GGUF's reversed).
    pub shape: Vec<u64>,
    /// Offset in the decompressed blob, a multiple of TENSOR_ALIGN.
    pub offset: u64,
    pub len: u64,
}

/// One layer unit: a contiguous blob in weights.bin.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct LayerUnit {
    pub kind: UnitKind,
    /// Offset of the blob in weights.bin, a multiple of BLOB_ALIGN.
    pub file_offset: u64,
    /// Stored bytes of the blob (sum of its frames; the file pads to BLOB_ALIGN after it).
    pub stored_len: u64,
    /// Bytes of the decompressed blob (the device slot size it needs).
    pub raw_len: u64,
    pub frames: Vec<Frame>,
    pub tensors: Vec<TensorEntry>,
}

impl LayerUnit {
    /// True when the stored blob is the raw blob, byte for byte: every frame one plane kept
    /// raw, at its raw offset from the blob's start (never a linked unit's). Such a unit can be read straight into
    /// its staging slot, with nothing left to do but check the frames' checksums.
    pub fn stored_as_raw(&self) -> bool {
        self.stored_len == self.raw_len
            && self.frames.iter().all(|f| {
                matches!(f.planes.as_slice(), [p] if !p.compressed && p.stored_len == f.raw_len)
                    && f.file_offset == self.file_offset + f.raw_offset
                    // A linked frame is read where the source holds it, through a buffer.
                    && !matches!(f.codec, Codec::Source { .. })
            })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Stored bytes of the unit's largest frame.
    pub fn frame_stored_max(&self) -> u64 {
        self.frames
            .iter()
            .map(|f| f.stored_len())
            .max()
            .unwrap_or(0)
    }

    /// Bytes a staging slot needs for frames `frames` of this unit: their raw bytes, or read
    /// straight into the slot (`direct`, a unit stored as raw) their stored span from its
    /// first byte to the end rounded up to BLOB_ALIGN (the read's O_DIRECT tail).
    pub fn part_span(&self, frames: Range<usize>, direct: bool) -> u64 {
        let (Some(first), Some(last)) = (
            self.frames.get(frames.start),
            self.frames.get(frames.end.wrapping_sub(1)),
        ) else {
            return 0;
        };
        if direct {
            (last.file_offset + last.stored_len()).div_ceil(BLOB_ALIGN) * BLOB_ALIGN
                - first.file_offset
        } else {
            last.raw_offset + last.raw_len as u64 - first.raw_offset
        }
    }

    /// Splits the rows of `t` (a tensor of this unit, `row_bytes` a row) into parts of whole
    /// frames, disjoint and in order, that each fit a staging slot of `cap` bytes
    /// (`part_span`); a part holds the rows whose bytes lie wholly inside it, and the rows
    /// that straddle two parts are the seams, returned beside them (a few rows, read on
    /// their own). Read straight into the slot (`direct`), every part starts at a frame
    /// whose file offset is BLOB_ALIGN-aligned (O_DIRECT). None when the frames cannot be
    /// cut that way (a slot smaller than a frame).
    pub fn row_parts(
        &self,
        t: &TensorEntry,
        row_bytes: u64,
        cap: u64,
        direct: bool,
    ) -> Option<(Vec<RowPart>, Vec<u64>)> {
        let rows = t.len.checked_div(row_bytes)?;
        let fs = &self.frames;
        let end = t.offset + t.len;
        let starts = |f: &Frame| !direct || f.file_offset.is_multiple_of(BLOB_ALIGN);
        // The frames that hold the tensor's bytes.
        let mut a = fs.partition_point(|f| f.raw_offset + f.raw_len as u64 <= t.offset);
        let last = fs.partition_point(|f| f.raw_offset < end);
        let mut parts: Vec<RowPart> = Vec::new();
        let mut seams = Vec::new();
        let mut covered = 0u64;
        while a < last {
            if !starts(fs.get(a)?) {
                return None;
            }
            // As many frames as fit, ending where the next part can start.
            let mut b = None;
            for e in a + 1..=last {
                if self.part_span(a..e, direct) > cap {
                    break;
                }
                if e == last || fs.get(e).is_none_or(starts) {
                    b = Some(e);
                }
            }
            let b = b?;
            let raw_base = fs[a].raw_offset;
            let raw_end = fs[b - 1].raw_offset + fs[b - 1].raw_len as u64;
            let first = raw_base
                .saturating_sub(t.offset)
                .div_ceil(row_bytes)
                .min(rows);
            let after = (raw_end.min(end) - t.offset) / row_bytes;
            seams.extend(covered..first);
            if after > first {
                parts.push(RowPart {
                    frames: a..b,
                    raw_base,
                    raw_len: raw_end - raw_base,
                    rows: first..after,
                });
                covered = after;
            } else {
                covered = covered.max(first);
            }
            a = b;
        }
        seams.extend(covered..rows);
        Some((parts, seams))
    }

    /// The experts of a mixture's layer, in order: each one's frames (its gate, up and down
    /// projections, which the writer lays out together, the first at a BLOB_ALIGN raw
    /// offset) and raw range. Empty for a unit without experts; None when the experts'
    /// tensors are not in that layout (a store this code did not write), which the
    /// streaming code then reads whole.
    pub fn experts(&self) -> Option<Vec<ExpertRange>> {
        let mut out: Vec<ExpertRange> = Vec::new();
        let mut i = 0;
        while i < self.tensors.len() {
            let Some((e, part)) = expert_of(&self.tensors[i].name) else {
                i += 1;
                continue;
            };
            if part != "gate_proj.weight" || e as usize != out.len() {
                return None;
            }
            // The expert's run: its tensors one after another, the three projections in
            // order (each with its bias after it, where the model has them).
            let run = self.tensors[i..]
                .iter()
                .take_while(|t| expert_of(&t.name).is_some_and(|(f, _)| f == e))
                .count();
            let parts: Vec<&str> = self.tensors[i..i + run]
                .iter()
                .filter_map(|t| expert_of(&t.name).map(|(_, p)| p))
                .collect();
            let weights: Vec<&str> = parts
                .iter()
                .copied()
                .filter(|p| p.ends_with(".weight"))
                .collect();
            let biased = ["gate_proj.weight", "gate_proj.bias", "up_proj.weight"];
            if weights != ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
                || !(parts.len() == 3
                    || parts
                        == [
                            biased[0],
                            biased[1],
                            biased[2],
                            "up_proj.bias",
                            "down_proj.weight",
                            "down_proj.bias",
                        ])
            {
                return None;
            }
            let start = self.tensors[i].offset;
            // To the next tensor (or the blob's end): the padding after it is its own.
            let end = self.tensors.get(i + run).map_or(self.raw_len, |t| t.offset);
            let first = self.frames.partition_point(|f| f.raw_offset < start);
            let last = self.frames.partition_point(|f| f.raw_offset < end);
            if self.frames.get(first).is_none_or(|f| f.raw_offset != start) {
                return None;
            }
            out.push(ExpertRange {
                frames: first..last,
                raw: start..end,
            });
            i += run;
        }
        Some(out)
    }

    /// Index of the tensor whose region (its bytes and the padding after them) holds
    /// `raw_offset`.
    pub fn tensor_at(&self, raw_offset: u64) -> Option<usize> {
        let i = self.tensors.partition_point(|t| t.offset <= raw_offset);
        i.checked_sub(1)
    }
}

/// One expert of a mixture's layer unit: its frames, and the raw bytes they hold.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ExpertRange {
    pub frames: Range<usize>,
    pub raw: Range<u64>,
}

/// (expert, part) of an expert's tensor name
/// (`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}`): the part is
/// the name after the expert index (`gate_proj.weight`, ...).
pub fn expert_of(name: &str) -> Option<(u32, &str)> {
    let (_, rest) = name.split_once(".mlp.experts.")?;
    let (e, part) = rest.split_once('.')?;
    let (proj, kind) = part.split_once('.')?;
    (matches!(proj, "gate_proj" | "up_proj" | "down_proj") && matches!(kind, "weight" | "bias"))
        .then_some(())?;
    Some((e.parse().ok()?, part))
}

/// Rows `rows` of a tensor, read as frames `frames` of its unit: the part's bytes are the
/// unit's raw bytes `raw_base..raw_base + raw_len`, and the rows those bytes hold whole
/// (see `LayerUnit::row_parts`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RowPart {
    pub frames: Range<usize>,
    pub raw_base: u64,
    pub raw_len: u64,
    pub rows: Range<u64>,
}

/// The tokenizer as the source declared it; text/ builds the runtime tokenizer from it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum TokenizerSpec {
    /// A Hugging Face `tokenizer.json`, verbatim.
    HfJson(String),
    /// A GGUF vocabulary.
    Gguf(GgufVocab),
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: "gpt2" (byte-level BPE) or "llama" (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: pre-tokenizer type, e.g. "smollm", "llama-bpe", "qwen2".
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    pub merges: Vec<String>,
    pub scores: Vec<f32>,
    pub add_space_prefix: bool,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// Every token that ends generation: eos, end-of-turn tokens the chat template uses.
    pub end_tokens: Vec<u32>,
    pub pad: Option<u32>,
    pub unk: Option<u32>,
    /// Prepend BOS when tokenizing a prompt.
    pub add_bos: bool,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Manifest {
    pub arch: ArchConfig,
    pub tokenizer: TokenizerSpec,
    pub chat_template: Option<String>,
    pub special: SpecialTokens,
    /// In forward order: embedding, decoder layers 0..n, head.
    pub units: Vec<LayerUnit>,
    /// Length weights.bin must have.
    pub weights_len: u64,
    /// Codec and frame size the store was packed with (frames record their own codec).
    pub codec: Codec,
    pub frame_size: u32,
    /// What the store was packed from (file name), for inspect.
    pub source: String,
    /// Format 6's: the file a linked store's frames point into (`pack --link`), which then
    /// stands in for weights.bin; None for a store that holds its own weights.
    #[serde(skip)]
    pub link: Option<Link>,
    /// Format 8's: the float codec's codes shared by the store's small frames
    /// (`float::SharedCode`); a plane names one by its index here.
    #[serde(skip)]
    pub codes: Vec<SharedCode>,
    /// Format 11's: what the source file says of itself beyond its weights.
    #[serde(skip)]
    pub meta: SourceMeta,
}

/// What a source file says of the model beyond its weights and tokenizer.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct SourceMeta {
    /// The quantization the file declares for itself, as llama.cpp names it ("Q4_K_M";
    /// a GGUF's `general.file_type`): a mix's name, where its tensors' types differ.
    pub file_type: Option<String>,
    /// The sampling the model's authors recommend.
    pub sampling: RecommendedSampling,
}

/// Sampling settings a model ships (a Hugging Face `generation_config.json`, a GGUF's
/// `general.sampling.*`); each None where the source says nothing of it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Default)]
pub struct RecommendedSampling {
    pub temperature: Option<f32>,
    pub top_k: Option<u32>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

impl RecommendedSampling {
    /// Whether the source recommends anything at all.
    pub fn is_empty(&self) -> bool {
        *self == RecommendedSampling::default()
    }

    /// The values in the ranges sampling takes (temperature in [0, 2], top_p and min_p in
    /// [0, 1], a repetition penalty in (0, 10]); the name of the first one that is not.
    pub fn check(&self) -> Result<(), String> {
        let bad =
            |name: &str, v: f32| Err(format!("recommended sampling: {name} {v} is out of range"));
        if let Some(t) = self.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
            return bad("temperature", t);
        }
        if let Some(p) = self.top_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return bad("top_p", p);
        }
        if let Some(p) = self.min_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return bad("min_p", p);
        }
        if let Some(r) = self
            .repetition_penalty
            .filter(|r| !(*r > 0.0 && *r <= 10.0))
        {
            return bad("repetition_penalty", r);
        }
        Ok(())
    }
}

/// The source file of a linked store and how to tell it is the same file it was packed
/// from: its length, modification time and the checksums of sampled ranges.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct Link {
    /// The file's absolute path (its bytes: a Unix path need not be UTF-8).
    pub path: Vec<u8>,
    pub len: u64,
    /// Modification time when packed: seconds and nanoseconds since the epoch.
    pub mtime_s: i64,
    pub mtime_ns: u32,
    pub samples: Vec<LinkSample>,
}

/// xxh3-64 of `len` bytes of the source at `offset`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkSample {
    pub offset: u64,
    pub len: u32,
    pub checksum: u64,
}

impl Link {
    pub fn path(&self) -> std::path::PathBuf {
        use std::os::unix::ffi::OsStrExt;
        std::path::PathBuf::from(std::ffi::OsStr::from_bytes(&self.path))
    }
}

impl Manifest {
    pub fn raw_bytes(&self) -> u64 {
        self.units.iter().map(|u| u.raw_len).sum()
    }

    pub fn stored_bytes(&self) -> u64 {
        self.units.iter().map(|u| u.stored_len).sum()
    }

    /// Stored bytes of the largest frame.
    pub fn frame_stored_len_max(&self) -> u64 {
        self.units
            .iter()
            .flat_map(|u| &u.frames)
            .map(|f| f.stored_len())
            .max()
            .unwrap_or(0)
    }

    pub fn frame_raw_len_max(&self) -> u32 {
        self.units
            .iter()
            .flat_map(|u| &u.frames)
            .map(|f| f.raw_len)
            .max()
            .unwrap_or(0)
    }

    /// Encodes manifest.bin.
    pub fn encode(&self) -> Result<Vec<u8>, String> {
        let pc = |e: postcard::Error| e.to_string();
        let mut payload = postcard::to_stdvec(self).map_err(pc)?;
        payload.extend_from_slice(&postcard::to_stdvec(&self.arch.ext).map_err(pc)?);
        payload.extend_from_slice(&postcard::to_stdvec(&self.arch.moe).map_err(pc)?);
        payload.extend_from_slice(&postcard::to_stdvec(&self.arch.swiglu).map_err(pc)?);
        payload.extend_from_slice(&postcard::to_stdvec(&self.link).map_err(pc)?);
        payload.extend_from_slice(&postcard::to_stdvec(&self.codes).map_err(pc)?);
        payload.extend_from_slice(&postcard::to_stdvec(&self.meta).map_err(pc)?);
        let payload = zstd::bulk::compress(&payload, PAYLOAD_ZSTD_LEVEL)
            .map_err(|e| format!("compress the manifest: {e}"))?;
        let mut out = Vec::with_capacity(HEADER_LEN + payload.len() + 8);
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        out.extend_from_slice(&payload);
        let sum = xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        Ok(out)
    }

    /// Decodes and validates manifest.bin; `path` is for error messages.
    pub fn decode(bytes: &[u8], path: &Path) -> Result<Manifest, StoreError> {
        let p = || path.to_path_buf();
        if bytes.len() < HEADER_LEN + 8 {
            return Err(StoreError::ManifestTruncated {
                path: p(),
                expected: (HEADER_LEN + 8) as u64,
                found: bytes.len() as u64,
            });
        }
        if bytes[..8] != MAGIC {
            return Err(StoreError::BadMagic {
                path: p(),
                found: bytes[..8].to_vec(),
            });
        }
        let version = u32::from_le_bytes(crate::util::array(&bytes[8..12]));
        if !(FORMAT_VERSION_MIN..=FORMAT_VERSION).contains(&version) {
            return Err(StoreError::Version {
                path: p(),
                found: version,
            });
        }
        let len = u64::from_le_bytes(crate::util::array(&bytes[12..20]));
        if len > MANIFEST_BYTES_MAX {
            return Err(StoreError::invalid(
                path,
                format!("payload length {len} is implausible"),
            ));
        }
        let end = HEADER_LEN as u64 + len;
        if (bytes.len() as u64) < end + 8 {
            return Err(StoreError::ManifestTruncated {
                path: p(),
                expected: end + 8,
                found: bytes.len() as u64,
            });
        }
        let end = end as usize;
        let stored = u64::from_le_bytes(crate::util::array(&bytes[end..end + 8]));
        let computed = xxh3_64(&bytes[..end]);
        if stored != computed {
            return Err(StoreError::ManifestChecksum {
                path: p(),
                stored,
                computed,
            });
        }
        if bytes.len() != end + 8 {
            return Err(StoreError::invalid(
                path,
                format!(
                    "{} trailing bytes after the checksum",
                    bytes.len() - end - 8
                ),
            ));
        }
        let unpacked;
        let payload = if version >= 6 {
            unpacked = unzstd(&bytes[HEADER_LEN..end]).map_err(|e| {
                StoreError::invalid(path, format!("payload does not decompress: {e}"))
            })?;
            &unpacked[..]
        } else {
            &bytes[HEADER_LEN..end]
        };
        Manifest::decode_payload(version, payload, path)
    }

    /// A manifest from its payload as format `version` writes it (decompressed): the
    /// fields, the extensions later formats append, then `validate`. (`decode` after the
    /// header and checksum; the fuzzer calls it directly, which no checksum would let
    /// mutated payloads reach.)
    pub(crate) fn decode_payload(
        version: u32,
        payload: &[u8],
        path: &Path,
    ) -> Result<Manifest, StoreError> {
        let bad =
            |e: postcard::Error| StoreError::invalid(path, format!("payload does not decode: {e}"));
        let (mut m, rest): (Manifest, _) = postcard::take_from_bytes(payload).map_err(bad)?;
        let rest = if version >= 2 {
            let (ext, rest): (ArchExt, _) = postcard::take_from_bytes(rest).map_err(bad)?;
            m.arch.ext = ext;
            rest
        } else {
            rest
        };
        let rest = if version >= 3 {
            let (moe, rest): (Option<MoeConfig>, _) =
                postcard::take_from_bytes(rest).map_err(bad)?;
            m.arch.moe = moe;
            rest
        } else {
            rest
        };
        let rest = if version >= 4 {
            let (swiglu, rest): (Option<SwigluClamp>, _) =
                postcard::take_from_bytes(rest).map_err(bad)?;
            m.arch.swiglu = swiglu;
            rest
        } else {
            rest
        };
        let rest = if version >= 6 {
            let (link, rest): (Option<Link>, _) = postcard::take_from_bytes(rest).map_err(bad)?;
            m.link = link;
            rest
        } else {
            rest
        };
        let rest = if version >= 8 {
            let (codes, rest): (Vec<SharedCode>, _) =
                postcard::take_from_bytes(rest).map_err(bad)?;
            m.codes = codes;
            rest
        } else {
            rest
        };
        let rest = if version >= 11 {
            let (meta, rest): (SourceMeta, _) = postcard::take_from_bytes(rest).map_err(bad)?;
            m.meta = meta;
            rest
        } else {
            rest
        };
        if !rest.is_empty() {
            return Err(StoreError::invalid(
                path,
                format!("{} bytes after the payload of format {version}", rest.len()),
            ));
        }
        m.validate().map_err(|msg| StoreError::invalid(path, msg))?;
        Ok(m)
    }

    /// Checks every relation the readers rely on, so that a well-checksummed but wrong
    /// manifest (a bug, a crafted file) is an error here and never an out-of-bounds access
    /// or a huge allocation later.
    pub fn validate(&self) -> Result<(), String> {
        self.meta.sampling.check()?;
        if let Some(t) = self.meta.file_type.as_ref().filter(|t| t.len() > 64) {
            return Err(format!("a file type of {} bytes (at most 64)", t.len()));
        }
        self.arch
            .validate()
            .map_err(|e| format!("architecture config: {e}"))?;
        if !self.codes.is_empty() && self.link.is_some() {
            return Err(
                "a linked store with shared codes (its frames are the source's bytes)".into(),
            );
        }
        if self.codes.len() > SHARED_CODES_MAX {
            return Err(format!(
                "{} shared codes, at most {SHARED_CODES_MAX}",
                self.codes.len()
            ));
        }
        for (i, c) in self.codes.iter().enumerate() {
            c.check().map_err(|e| format!("shared code {i}: {e}"))?;
        }
        if self.frame_size == 0 || self.frame_size > FRAME_RAW_BYTES_MAX {
            return Err(format!("frame size {} out of range", self.frame_size));
        }
        let link = self.link.as_ref();
        if let Some(l) = link {
            if self.weights_len != l.len {
                return Err(format!(
                    "linked to {} bytes of {}, but the weights are {} bytes",
                    l.len,
                    l.path().display(),
                    self.weights_len
                ));
            }
        }
        let mut file_end = 0u64;
        for (ui, u) in self.units.iter().enumerate() {
            let at = |msg: String| format!("unit {ui} ({}): {msg}", u.kind);
            // A linked store's frames lie wherever the source holds their tensors; a
            // store's own blobs are aligned and in order.
            if link.is_none() && u.file_offset % BLOB_ALIGN != 0 {
                return Err(at(format!(
                    "blob offset {} is not {BLOB_ALIGN}-aligned",
                    u.file_offset
                )));
            }
            if link.is_none() && u.file_offset < file_end {
                return Err(at(format!(
                    "blob at {} overlaps the previous one",
                    u.file_offset
                )));
            }
            if u.raw_len > BLOB_RAW_BYTES_MAX {
                return Err(at(format!(
                    "raw length {} over {BLOB_RAW_BYTES_MAX}",
                    u.raw_len
                )));
            }
            let mut raw_at = 0u64;
            let mut file_at = u.file_offset;
            let mut stored = 0u64;
            for (fi, f) in u.frames.iter().enumerate() {
                let at = |msg: String| at(format!("frame {fi}: {msg}"));
                if f.raw_offset != raw_at {
                    return Err(at(format!(
                        "raw offset {} != expected {raw_at}",
                        f.raw_offset
                    )));
                }
                if link.is_none() && f.file_offset != file_at {
                    return Err(at(format!(
                        "file offset {} != expected {file_at}",
                        f.file_offset
                    )));
                }
                if f.raw_len == 0 || f.raw_len > FRAME_RAW_BYTES_MAX {
                    return Err(at(format!("raw length {} out of range", f.raw_len)));
                }
                raw_at += f.raw_len as u64;
                file_at += f.stored_len();
                stored += f.stored_len();
                match (link, f.codec) {
                    (
                        Some(_),
                        Codec::Source {
                            head_rows,
                            row_bytes,
                        },
                    ) => {
                        let n = match f.planes.as_slice() {
                            [p] if !p.compressed => p.stored_len as u64,
                            _ => return Err(at("a linked frame is one raw plane".into())),
                        };
                        if n == 0
                            || n > f.raw_len as u64
                            || f.raw_len as u64 - n >= BLOB_ALIGN
                            || f.file_offset
                                .checked_add(n)
                                .is_none_or(|e| e > self.weights_len)
                        {
                            return Err(at(format!(
                                "{n} source bytes at offset {} for {} raw bytes in a source of {}",
                                f.file_offset, f.raw_len, self.weights_len
                            )));
                        }
                        let head = head_rows as u64 * row_bytes as u64;
                        if head_rows != 0
                            && (!head_rows.is_multiple_of(2) || head == 0 || n % head != 0)
                        {
                            return Err(at(format!(
                                "{n} bytes are not whole heads of {head_rows} rows of {row_bytes} bytes"
                            )));
                        }
                        continue;
                    }
                    (Some(_), c) => {
                        return Err(at(format!("a linked store's frame has codec {c}")));
                    }
                    (None, c @ Codec::Source { .. }) => {
                        return Err(at(format!("codec {c} in a store that links no source")));
                    }
                    (None, Codec::FloatFast) => {
                        return Err(at(
                            "codec float-fast recorded in a frame (its frames are float frames)"
                                .into(),
                        ));
                    }
                    (None, _) => {}
                }
                let w = f.planes.len();
                // Byte-split planes: 1, 2 or 4 equal ones; the float codec: 2 to 5 of its
                // own sizes (its decoder checks them against the layout its bytes name).
                let split_ok = matches!(w, 1 | 2 | 4) && (f.raw_len as usize).is_multiple_of(w);
                let float_ok = f.codec == Codec::Float
                    && (2..=super::float::PLANES_MAX).contains(&w)
                    && (f.raw_len as usize).is_multiple_of(2);
                if !split_ok && !float_ok {
                    return Err(at(format!("{w} planes for {} raw bytes", f.raw_len)));
                }
                if f.codec == Codec::None && f.planes.iter().any(|p| p.compressed) {
                    return Err(at("compressed plane in a raw frame".into()));
                }
                frame_planes_fit(f).map_err(at)?;
            }
            if raw_at != u.raw_len {
                return Err(at(format!(
                    "frames cover {raw_at} raw bytes of {}",
                    u.raw_len
                )));
            }
            if stored != u.stored_len {
                return Err(at(format!(
                    "frames hold {stored} stored bytes, unit says {}",
                    u.stored_len
                )));
            }
            let mut t_end = 0u64;
            for t in &u.tensors {
                let bytes = t.dtype.tensor_bytes(&t.shape);
                if bytes != Some(t.len) {
                    return Err(at(format!(
                        "tensor {} {:?} {} has {} bytes, its shape needs {:?}",
                        t.name, t.shape, t.dtype, t.len, bytes
                    )));
                }
                if t.offset % TENSOR_ALIGN != 0 || t.offset < t_end {
                    return Err(at(format!(
                        "tensor {} at misaligned or overlapping offset {}",
                        t.name, t.offset
                    )));
                }
                t_end = t
                    .offset
                    .checked_add(t.len)
                    .ok_or_else(|| at("tensor end overflows".into()))?;
                if t_end > u.raw_len {
                    return Err(at(format!(
                        "tensor {} ends at {t_end}, past the blob ({})",
                        t.name, u.raw_len
                    )));
                }
            }
            if link.is_none() {
                file_end = file_at;
            }
        }
        if self.weights_len < file_end {
            return Err(format!(
                "weights length {} is shorter than its blobs ({file_end})",
                self.weights_len
            ));
        }
        Ok(())
    }
}

/// Largest decompressed format-6 payload we accept: a crafted kilobyte must not claim a
/// gigabyte (a 400B model's manifest, 800 000 frames and a 256K vocabulary, is ~40 MB).
const PAYLOAD_RAW_BYTES_MAX: u64 = 256 << 20;

/// A format-6 payload, decompressed: at most `PAYLOAD_RAW_BYTES_MAX` bytes whatever its
/// frame header claims.
fn unzstd(coded: &[u8]) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut out = Vec::new();
    zstd::stream::read::Decoder::new(coded)?
        .take(PAYLOAD_RAW_BYTES_MAX + 1)
        .read_to_end(&mut out)?;
    if out.len() as u64 > PAYLOAD_RAW_BYTES_MAX {
        return Err(std::io::Error::other(format!(
            "more than {PAYLOAD_RAW_BYTES_MAX} bytes"
        )));
    }
    Ok(out)
}

/// A frame's planes against its raw length: a raw plane is exactly its raw bytes, a
/// compressed one non-empty and (by the 3 % rule) smaller. The float codec's frames are
/// checked against each layout of their plane count (the coded exponent plane names the
/// one it is, which its decoder checks).
fn frame_planes_fit(f: &Frame) -> Result<(), String> {
    use super::float::Layout;
    let w = f.planes.len();
    let layouts: &[Layout] = if f.codec == Codec::Float {
        Layout::with_planes(w)
    } else {
        &[]
    };
    if layouts
        .iter()
        .any(|l| !(f.raw_len as usize).is_multiple_of(l.width()))
    {
        return Err(format!(
            "{w} float-codec planes for {} raw bytes",
            f.raw_len
        ));
    }
    let fit = |layout: Option<Layout>| -> Result<(), String> {
        for (i, p) in f.planes.iter().enumerate() {
            let plane_raw = match layout {
                Some(l) => l.plane_len(i, f.raw_len as usize / l.width()) as u32,
                None => f.raw_len / w as u32,
            };
            let ok = if p.compressed {
                p.stored_len > 0 && p.stored_len < plane_raw
            } else {
                p.stored_len == plane_raw
            };
            if !ok {
                return Err(format!(
                    "plane of {} stored bytes for {plane_raw} raw bytes",
                    p.stored_len
                ));
            }
        }
        Ok(())
    };
    if layouts.is_empty() {
        return fit(None);
    }
    layouts
        .iter()
        .map(|&l| fit(Some(l)))
        .reduce(|a, b| a.or(b))
        .unwrap_or(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A unit of raw frames of `frame` bytes holding one f32 tensor of `rows` rows of
    /// `cols`, at `file_offset` in the file.
    fn unit(frame: u32, rows: u64, cols: u64, file_offset: u64) -> (LayerUnit, TensorEntry) {
        let len = rows * cols * 4;
        let t = TensorEntry {
            name: "model.embed_tokens.weight".into(),
            dtype: DType::F32,
            shape: vec![rows, cols],
            offset: 0,
            len,
        };
        let frames = (0..len.div_ceil(frame as u64))
            .map(|i| {
                let raw_len = (len - i * frame as u64).min(frame as u64) as u32;
                Frame {
                    file_offset: file_offset + i * frame as u64,
                    raw_offset: i * frame as u64,
                    raw_len,
                    checksum: 0,
                    codec: Codec::None,
                    planes: vec![Plane {
                        stored_len: raw_len,
                        compressed: false,
                    }],
                }
            })
            .collect();
        let u = LayerUnit {
            kind: UnitKind::Embedding,
            file_offset,
            stored_len: len,
            raw_len: len,
            frames,
            tensors: vec![t.clone()],
        };
        (u, t)
    }

    /// A float-codec frame of three planes may be either f16 layout (format 7's bit planes
    /// or format 6's packed top bits); other plane sizes are refused.
    #[test]
    fn both_f16_layouts_fit_their_frames_and_nothing_else_does() {
        let frame = |sizes: [u32; 3]| Frame {
            file_offset: 0,
            raw_offset: 0,
            raw_len: 2 * 100,
            checksum: 0,
            codec: Codec::Float,
            planes: [(40, true), (sizes[1], false), (sizes[2], false)]
                .into_iter()
                .map(|(stored_len, compressed)| Plane {
                    stored_len: if compressed { sizes[0] } else { stored_len },
                    compressed,
                })
                .collect(),
        };
        // 100 elements: bit planes 3 x ceil(100 / 8) = 39 bytes; packed top bits 25.
        assert_eq!(frame_planes_fit(&frame([40, 100, 39])), Ok(()));
        assert_eq!(frame_planes_fit(&frame([40, 100, 25])), Ok(()));
        let err = frame_planes_fit(&frame([40, 100, 30])).expect_err("neither layout");
        assert!(err.contains("plane of 30 stored bytes"), "{err}");
        assert!(frame_planes_fit(&frame([40, 99, 39])).is_err());
    }

    #[test]
    fn row_parts_are_disjoint_frames_and_the_rows_they_cut_are_seams() {
        // Rows of 12 bytes in frames of 1000: rows 83 (996..1008) and 166 straddle.
        let (u, t) = unit(1000, 250, 3, 0);
        let (parts, seams) = u.row_parts(&t, 12, 2000, false).expect("parts");
        assert_eq!(parts.len(), 2);
        assert_eq!(
            (parts[0].frames.clone(), parts[0].rows.clone()),
            (0..2, 0..166)
        );
        assert_eq!(
            (parts[1].frames.clone(), parts[1].rows.clone()),
            (2..3, 167..250)
        );
        assert_eq!((parts[1].raw_base, parts[1].raw_len), (2000, 1000));
        assert_eq!(seams, vec![166]);
        // A slot smaller than a frame cannot hold a part.
        assert!(u.row_parts(&t, 12, 999, false).is_none());
        // One slot for everything: one part, no seams.
        let (parts, seams) = u.row_parts(&t, 12, 3000, false).expect("parts");
        assert_eq!(
            (parts.len(), parts[0].rows.clone(), seams.len()),
            (1, 0..250, 0)
        );
    }

    #[test]
    fn read_straight_into_slots_row_parts_start_aligned_and_count_the_rounded_tail() {
        // 4096-byte frames from an aligned blob: every frame starts aligned; a part of two
        // frames spans 8192 bytes.
        let (u, t) = unit(4096, 4096, 4, 8192);
        let (parts, seams) = u.row_parts(&t, 16, 8192, true).expect("parts");
        assert_eq!(parts.len(), 8);
        assert!(
            seams.is_empty(),
            "16-byte rows never straddle 4096-byte frames"
        );
        assert!(parts
            .iter()
            .all(|p| p.frames.len() == 2 && p.raw_len == 8192));
        // Frames of 6000 bytes: none past the first starts aligned, so parts read straight
        // into a slot cannot be cut (the one part would be the whole table), buffered
        // ones can.
        let (u, t) = unit(6000, 1500, 4, 0);
        assert!(u.row_parts(&t, 16, 12288, true).is_none());
        let (parts, _) = u.row_parts(&t, 16, 12000, false).expect("buffered parts");
        assert_eq!(parts.len(), 2);
        assert_eq!(
            u.part_span(0..2, true),
            12288,
            "the read's tail rounds up to 4096"
        );
    }
}
