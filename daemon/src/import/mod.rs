//! Importers: a GGUF file or a Hugging Face model directory, mapped to one architecture
//! config, one tokenizer spec and one canonical tensor layout (Hugging Face names and row
//! order) that the store writer packs into layer units.

// Input from outside (files, requests, the disk) never meets an unwrap or expect here: an
// `expect` on a true invariant carries an #[allow] saying why it holds.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod gguf;
pub mod hf;
pub mod synth;

use crate::dtype::DType;
use crate::store::arch::ArchConfig;
use crate::store::format::{SourceMeta, SpecialTokens, TokenizerSpec, UnitKind};
pub use crate::store::writer::UnitSpec;
use crate::store::writer::{LinkedTensor, ModelHeader, PackSource, TensorLayout};
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    // The I/O error is in the message, so it is not also a `source`: a chain printed
    // with `{:#}` would say it twice.
    #[error("{op} {path}: {err}")]
    Io {
        op: &'static str,
        path: PathBuf,
        err: std::io::Error,
    },
    #[error("{path}{}: {msg}", offset.map(|o| format!(" at offset {o}")).unwrap_or_default())]
    Malformed {
        path: PathBuf,
        offset: Option<u64>,
        msg: String,
    },
    #[error("{path}: {msg}")]
    Unsupported { path: PathBuf, msg: String },
}

impl ImportError {
    pub fn malformed(path: &Path, offset: Option<u64>, msg: impl Into<String>) -> Self {
        ImportError::Malformed {
            path: path.to_path_buf(),
            offset,
            msg: msg.into(),
        }
    }

    pub fn unsupported(path: &Path, msg: impl Into<String>) -> Self {
        ImportError::Unsupported {
            path: path.to_path_buf(),
            msg: msg.into(),
        }
    }
}

/// Where one tensor's bytes are in the source files.
#[derive(Clone, Debug)]
pub struct SourceTensor {
    pub dtype: DType,
    /// Row-major, last dimension contiguous.
    pub shape: Vec<u64>,
    pub file: usize,
    pub offset: u64,
    pub len: u64,
    /// GGUF stores llama q/k rows permuted for interleaved rotary pairs; `Some(heads)` undoes
    /// that on copy so every importer yields the Hugging Face (rotate-half) row order.
    pub unpermute_heads: Option<u32>,
    /// Generated rather than read (`sluiced synth`): the seed of its random weights.
    pub synthetic_seed: Option<u64>,
    /// A generated matrix whose row r is scaled by (r + 1)^-s (`sluiced synth --moe`'s
    /// router: a skewed expert popularity).
    pub synthetic_row_skew: Option<f32>,
    /// Stored in f32 from a source of another dtype, plus a constant (`Widen`). `dtype`
    /// and `len` are then the f32 result's.
    pub widen: Option<Widen>,
    /// Taken out of a larger matrix with a stride (`Strided`): `offset` is that matrix's.
    pub strided: Option<Strided>,
    /// MXFP4 rows put together from OpenAI's layout (`OpenAiMxfp4`): `offset` is the
    /// expert's blocks.
    pub openai_mxfp4: Option<OpenAiMxfp4>,
}

/// An expert's MXFP4 matrix in OpenAI's gpt-oss checkpoint layout, into GGML's: the blocks
/// (`src_rows` rows of `blocks_per_row` x 16 bytes, element 2j in the low nibble of byte j
/// and 2j + 1 in its high one) at the tensor's `offset`, their E8M0 scales (a byte a block)
/// at `scales_offset` of file `scales_file`; output row r is source row `row_start + r x
/// row_step` (gpt-oss interleaves gate and up rows), each block the scale byte and then
/// 16 bytes whose low nibbles are elements 0..15 and high nibbles 16..31 (GGML's
/// `block_mxfp4`). The FP4 codes and the scale mean the same in both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpenAiMxfp4 {
    pub scales_file: usize,
    pub scales_offset: u64,
    pub src_rows: u64,
    pub blocks_per_row: u64,
    pub row_start: u64,
    pub row_step: u64,
}

/// A vector or matrix stored as `add` + w in f32, from a source of dtype `from`: Gemma's
/// norms in a Hugging Face checkpoint (add 1: transformers applies them as x * (1 + w) in
/// f32; llama.cpp's converter writes 1 + w into the GGUF the same way), gpt-oss's
/// attention sinks (add 0: the backends read them as f32).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Widen {
    pub from: DType,
    pub add: f32,
}

/// A tensor of shape [R, C] taken from a row-major source matrix of `src_rows` = C rows
/// and `src_cols` columns (16- or 32-bit elements): out[r][c] = src[c][start + r * step].
/// A transpose (step 1), or every other column transposed (step 2: gpt-oss's interleaved
/// gate and up projections, stored input-major as [hidden, 2 x intermediate]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    pub src_rows: u64,
    pub src_cols: u64,
    pub start: u64,
    pub step: u64,
}

pub struct ImportedModel {
    pub source: PathBuf,
    pub arch: ArchConfig,
    pub tokenizer: TokenizerSpec,
    pub special: SpecialTokens,
    pub chat_template: Option<String>,
    /// The file type the source declares and the sampling it recommends.
    pub meta: SourceMeta,
    pub files: Vec<(PathBuf, Mmap)>,
    /// Canonical name -> source.
    pub tensors: BTreeMap<String, SourceTensor>,
}

/// A tensor name and the shape the config says it must have.
type NamedShape = (String, Vec<u64>);

/// Opens a GGUF file or a Hugging Face model directory.
pub fn open(src: &Path) -> Result<ImportedModel, ImportError> {
    let meta = std::fs::metadata(src).map_err(|e| ImportError::Io {
        op: "open",
        path: src.into(),
        err: e,
    })?;
    if meta.is_dir() {
        return hf::import(src);
    }
    let mut magic = [0u8; 4];
    let n = {
        use std::io::Read;
        let mut f = File::open(src).map_err(|e| ImportError::Io {
            op: "open",
            path: src.into(),
            err: e,
        })?;
        f.read(&mut magic).map_err(|e| ImportError::Io {
            op: "read",
            path: src.into(),
            err: e,
        })?
    };
    if n == 4 && &magic == b"GGUF" {
        return gguf::import(src);
    }
    Err(ImportError::unsupported(
        src,
        "neither a GGUF file (magic \"GGUF\") nor a directory; pack a .gguf file or a Hugging Face model directory (config.json, *.safetensors, tokenizer.json)",
    ))
}

pub(crate) fn mmap_file(path: &Path) -> Result<Mmap, ImportError> {
    let f = File::open(path).map_err(|e| ImportError::Io {
        op: "open",
        path: path.into(),
        err: e,
    })?;
    // SAFETY: the source is opened read-only and only read while packing; a concurrent
    // writer truncating it is outside what we promise (as for every mmap-based loader).
    unsafe { Mmap::map(&f) }.map_err(|e| ImportError::Io {
        op: "mmap",
        path: path.into(),
        err: e,
    })
}

impl ImportedModel {
    /// The raw source bytes of a tensor (before any row un-permutation; the whole source
    /// matrix of a strided one).
    pub fn source_bytes(&self, t: &SourceTensor) -> &[u8] {
        let map = &self.files[t.file].1;
        if let Some(m) = t.openai_mxfp4 {
            let len = m.src_rows * m.blocks_per_row * 16;
            return &map[t.offset as usize..(t.offset + len) as usize];
        }
        let len = match (t.widen, t.strided) {
            (_, Some(s)) => s.src_rows * s.src_cols * t.dtype.block_bytes(),
            (Some(w), None) => t.len / 4 * w.from.block_bytes(),
            (None, None) => t.len,
        };
        &map[t.offset as usize..(t.offset + len) as usize]
    }

    /// Copies a tensor into `dst` in canonical row order.
    pub fn copy_source(&self, t: &SourceTensor, dst: &mut [u8]) {
        if let Some(seed) = t.synthetic_seed {
            synth::fill(t.dtype, &t.shape, seed, dst);
            if let Some(s) = t.synthetic_row_skew {
                synth::skew_rows(t.dtype, &t.shape, s, dst);
            }
            return;
        }
        let src = self.source_bytes(t);
        if let Some(m) = t.openai_mxfp4 {
            let bpr = m.blocks_per_row as usize;
            let scales = &self.files[m.scales_file].1[m.scales_offset as usize..]
                [..m.src_rows as usize * bpr];
            for (r, row) in dst.chunks_exact_mut(bpr * 17).enumerate() {
                let sr = m.row_start as usize + r * m.row_step as usize;
                for (b, out) in row.chunks_exact_mut(17).enumerate() {
                    let at = sr * bpr + b;
                    let q = &src[at * 16..at * 16 + 16];
                    let code = |e: usize| (q[e / 2] >> (4 * (e % 2))) & 0x0F;
                    out[0] = scales[at];
                    for (i, o) in out[1..].iter_mut().enumerate() {
                        *o = code(i) | (code(i + 16) << 4);
                    }
                }
            }
            return;
        }
        if let Some(s) = t.strided {
            let es = t.dtype.block_bytes() as usize;
            let (c_n, cols) = (s.src_rows as usize, s.src_cols as usize);
            for (r, row) in dst.chunks_exact_mut(c_n * es).enumerate() {
                let col = s.start as usize + r * s.step as usize;
                for (c, o) in row.chunks_exact_mut(es).enumerate() {
                    let at = (c * cols + col) * es;
                    o.copy_from_slice(&src[at..at + es]);
                }
            }
            return;
        }
        if let Some(Widen { from, add }) = t.widen {
            let w = from.block_bytes() as usize;
            for (o, c) in dst.chunks_exact_mut(4).zip(src.chunks_exact(w)) {
                let v = match from {
                    DType::F16 => half::f16::from_le_bytes([c[0], c[1]]).to_f32(),
                    DType::BF16 => half::bf16::from_le_bytes([c[0], c[1]]).to_f32(),
                    _ => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                };
                o.copy_from_slice(&(add + v).to_le_bytes());
            }
            return;
        }
        assert_eq!(src.len(), dst.len());
        let Some(heads) = t.unpermute_heads else {
            dst.copy_from_slice(src);
            return;
        };
        let rows = t.shape[0] as usize;
        crate::store::codec::unpermute_rows(src, dst, rows / heads as usize, src.len() / rows);
    }

    /// Checks that every tensor the architecture needs is present with the right shape and
    /// no unexpected one is, and groups them into layer units in forward order.
    pub fn units(&self) -> Result<Vec<UnitSpec>, ImportError> {
        let a = &self.arch;
        let named = |t: crate::store::spec::TensorSpec| (t.name, t.shape);
        let mut expected: Vec<(UnitKind, Vec<NamedShape>)> = Vec::new();
        expected.push((UnitKind::Embedding, vec![named(a.embedding_spec())]));
        for i in 0..a.n_layers {
            expected.push((UnitKind::Decoder(i), a.layer_tensors(i)));
        }
        let head = a.head_spec();
        let head = std::iter::once(head.norm).chain(head.lm_head);
        expected.push((UnitKind::Head, head.map(named).collect()));

        let mut units = Vec::with_capacity(expected.len());
        let mut used = 0usize;
        for (kind, tensors) in expected {
            let mut names = Vec::with_capacity(tensors.len());
            for (name, shape) in tensors {
                let t = self.tensors.get(&name).ok_or_else(|| {
                    ImportError::malformed(
                        &self.source,
                        None,
                        format!(
                            "tensor {name} is missing ({kind} of a {} model with {} layers)",
                            a.arch, a.n_layers
                        ),
                    )
                })?;
                if t.shape != shape {
                    return Err(ImportError::malformed(
                        &self.source,
                        None,
                        format!(
                            "tensor {name} has shape {:?}, the config needs {shape:?}",
                            t.shape
                        ),
                    ));
                }
                if shape.len() == 1 && t.dtype.is_quantized() {
                    return Err(ImportError::unsupported(
                        &self.source,
                        format!(
                            "tensor {name} is {} but vectors must be f32, f16 or bf16",
                            t.dtype
                        ),
                    ));
                }
                names.push(name);
                used += 1;
            }
            units.push(UnitSpec {
                kind,
                tensors: names,
            });
        }
        if used != self.tensors.len() {
            let all: std::collections::BTreeSet<&str> = units
                .iter()
                .flat_map(|u| u.tensors.iter().map(|s| s.as_str()))
                .collect();
            let extra: Vec<&str> = self
                .tensors
                .keys()
                .map(|s| s.as_str())
                .filter(|n| !all.contains(n))
                .take(5)
                .collect();
            return Err(ImportError::unsupported(
                &self.source,
                format!("unexpected tensors for a {} model: {} (sluice would ignore weights the model needs)", a.arch, extra.join(", ")),
            ));
        }
        Ok(units)
    }
}

impl PackSource for ImportedModel {
    fn header(&self) -> ModelHeader {
        ModelHeader {
            arch: self.arch.clone(),
            tokenizer: self.tokenizer.clone(),
            special: self.special.clone(),
            chat_template: self.chat_template.clone(),
            meta: self.meta.clone(),
            source: self
                .source
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        }
    }

    fn tensor(&self, name: &str) -> Option<TensorLayout> {
        self.tensors.get(name).map(|t| TensorLayout {
            dtype: t.dtype,
            shape: t.shape.clone(),
            len: t.len,
        })
    }

    fn copy_tensor(&self, name: &str, dst: &mut [u8]) {
        // `pack` asks `tensor` for every name before copying it.
        let t = &self.tensors[name];
        self.copy_source(t, dst);
    }

    fn link_file(&self) -> Result<PathBuf, String> {
        match self.files.as_slice() {
            [(path, _)] => Ok(path.clone()),
            [] => Err(format!(
                "{} has no weights file (generated weights)",
                self.source.display()
            )),
            more => Err(format!(
                "{} keeps its weights in {} files and a linked store reads one file",
                self.source.display(),
                more.len()
            )),
        }
    }

    fn linked(&self, name: &str) -> Result<LinkedTensor, String> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| format!("no tensor {name}"))?;
        let changed = if t.synthetic_seed.is_some() {
            Some("generated, not read")
        } else if t.widen.is_some() {
            Some("widened to f32 on import")
        } else if t.strided.is_some() {
            Some("transposed on import")
        } else if t.openai_mxfp4.is_some() {
            Some("rearranged from OpenAI's MXFP4 layout on import")
        } else if t.file != 0 {
            Some("in another file")
        } else {
            None
        };
        if let Some(why) = changed {
            return Err(format!("tensor {name} is {why}"));
        }
        let head_rows = match t.unpermute_heads {
            // `map_tensors` checked that the rows split into these heads of pairs.
            Some(heads) => (t.shape[0] / heads as u64) as u32,
            None => 0,
        };
        Ok(LinkedTensor {
            offset: t.offset,
            head_rows,
        })
    }
}

pub(crate) fn push_unique(v: &mut Vec<u32>, id: Option<u32>) {
    if let Some(id) = id {
        if !v.contains(&id) {
            v.push(id);
        }
    }
}
