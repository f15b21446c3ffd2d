//! GGUF (v2/v3) importer: metadata, tensor infos, alignment, tokenizer and chat template.
//! Every read is bounds-checked against the file and reported with its offset.

use super::{mmap_file, push_unique, ImportError, ImportedModel, SourceTensor};
use crate::dtype::{ggml_type_name, DType};
use crate::store::arch::{
    every_but_nth, Arch, ArchConfig, ArchExt, MoeConfig, RopeScaling, SwigluClamp,
};
use crate::store::format::{GgufVocab, RecommendedSampling, SourceMeta, SpecialTokens};
use crate::store::{end_of_turn_tokens, format::TokenizerSpec};
use std::collections::BTreeMap;
use std::path::Path;

const GGUF_ALIGNMENT_DEFAULT: u64 = 32;
const TENSOR_DIMS_MAX: u32 = 4;

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v as u64),
            Value::U16(v) => Some(v as u64),
            Value::U32(v) => Some(v as u64),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v as f64),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::Str(_) => "string",
            Value::Array(_) => "array",
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }
}

pub struct TensorInfo {
    pub name: String,
    /// GGUF order: dims[0] is contiguous.
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Relative to the start of the data section.
    pub offset: u64,
}

/// A parsed GGUF header.
pub struct Gguf {
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    pub data_start: u64,
    pub alignment: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn err(&self, msg: impl Into<String>) -> ImportError {
        ImportError::malformed(self.path, Some(self.pos as u64), msg)
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], ImportError> {
        if self.buf.len() - self.pos < n {
            return Err(self.err(format!(
                "truncated: {what} needs {n} bytes, {} remain in the file ({} bytes)",
                self.buf.len() - self.pos,
                self.buf.len()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self, what: &str) -> Result<u8, ImportError> {
        Ok(self.take(1, what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16, ImportError> {
        Ok(u16::from_le_bytes(crate::util::array(self.take(2, what)?)))
    }
    fn u32(&mut self, what: &str) -> Result<u32, ImportError> {
        Ok(u32::from_le_bytes(crate::util::array(self.take(4, what)?)))
    }
    fn u64(&mut self, what: &str) -> Result<u64, ImportError> {
        Ok(u64::from_le_bytes(crate::util::array(self.take(8, what)?)))
    }

    /// A count of items that each take at least `item_bytes_min` bytes: bounded by what is
    /// left in the file, so a corrupt count is an error, not a huge allocation.
    fn count(&mut self, what: &str, item_bytes_min: usize) -> Result<usize, ImportError> {
        let at = self.pos;
        let n = self.u64(what)?;
        let left = (self.buf.len() - self.pos) as u64;
        if n.saturating_mul(item_bytes_min as u64) > left {
            self.pos = at;
            return Err(self.err(format!(
                "{what} is {n}, more than the {left} bytes left in the file can hold"
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String, ImportError> {
        let n = self.count(what, 1)?;
        let at = self.pos;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| {
            ImportError::malformed(
                self.path,
                Some(at as u64),
                format!("{what} is not valid UTF-8"),
            )
        })
    }

    fn value(&mut self, ty: u32, key: &str, depth: u32) -> Result<Value, ImportError> {
        Ok(match ty {
            0 => Value::U8(self.u8(key)?),
            1 => Value::I8(self.u8(key)? as i8),
            2 => Value::U16(self.u16(key)?),
            3 => Value::I16(self.u16(key)? as i16),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(self.u32(key)? as i32),
            6 => Value::F32(f32::from_bits(self.u32(key)?)),
            7 => match self.u8(key)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(self.err(format!("{key}: bool value {b}"))),
            },
            8 => Value::Str(self.string(key)?),
            9 => {
                if depth > 0 {
                    return Err(self.err(format!("{key}: nested arrays are not supported")));
                }
                let item_ty = self.u32(key)?;
                let n = self.count(key, 1)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(item_ty, key, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(self.u64(key)? as i64),
            12 => Value::F64(f64::from_bits(self.u64(key)?)),
            t => return Err(self.err(format!("{key}: unknown metadata value type {t}"))),
        })
    }
}

/// Parses the GGUF header and tensor infos of `buf`; checks that every tensor's data lies
/// inside the file.
pub fn parse(buf: &[u8], path: &Path) -> Result<Gguf, ImportError> {
    let mut c = Cursor { buf, pos: 0, path };
    let magic = c.take(4, "magic")?;
    if magic != b"GGUF" {
        return Err(ImportError::malformed(
            path,
            Some(0),
            format!("bad magic {magic:02x?}, expected \"GGUF\""),
        ));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(ImportError::unsupported(
            path,
            format!("GGUF version {version}; sluice reads versions 2 and 3"),
        ));
    }
    let n_tensors = c.count("tensor count", 8 + 4 + 4 + 8)?;
    let n_kv = c.count("metadata count", 8 + 4 + 1)?;
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = c.string("metadata key")?;
        let ty = c.u32(&key)?;
        let v = c.value(ty, &key, 0)?;
        metadata.insert(key, v);
    }
    let mut tensors = Vec::with_capacity(n_tensors);
    for _ in 0..n_tensors {
        let name = c.string("tensor name")?;
        let at = c.pos;
        let n_dims = c.u32(&name)?;
        if n_dims == 0 || n_dims > TENSOR_DIMS_MAX {
            return Err(ImportError::malformed(
                path,
                Some(at as u64),
                format!("tensor {name}: {n_dims} dimensions"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&name)?);
        }
        let ggml_type = c.u32(&name)?;
        let offset = c.u64(&name)?;
        tensors.push(TensorInfo {
            name,
            dims,
            ggml_type,
            offset,
        });
    }
    let alignment = match metadata.get("general.alignment") {
        None => GGUF_ALIGNMENT_DEFAULT,
        Some(v) => match v.as_u64() {
            Some(a) if a.is_power_of_two() => a,
            _ => {
                return Err(ImportError::malformed(
                    path,
                    None,
                    format!("general.alignment {v:?} is not a power of two"),
                ))
            }
        },
    };
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let file_len = buf.len() as u64;
    // Each tensor's bytes, to find two that share any.
    let mut spans: Vec<(u64, u64, &str)> = Vec::with_capacity(tensors.len());
    for t in &tensors {
        if t.offset % alignment != 0 {
            return Err(ImportError::malformed(
                path,
                None,
                format!(
                    "tensor {}: data offset {} is not {alignment}-aligned",
                    t.name, t.offset
                ),
            ));
        }
        // Unknown types are reported by the importer with their name; here only sizes.
        if let Some(dt) = DType::from_ggml(t.ggml_type) {
            let shape: Vec<u64> = t.dims.iter().rev().copied().collect();
            let len = dt.tensor_bytes(&shape).ok_or_else(|| {
                ImportError::malformed(
                    path,
                    None,
                    format!(
                        "tensor {}: dims {:?}: a row of {} elements is not a whole number of {} blocks ({} elements each)",
                        t.name,
                        t.dims,
                        t.dims.first().copied().unwrap_or(0),
                        dt.ggml_name(),
                        dt.block_elems()
                    ),
                )
            })?;
            let start = data_start.checked_add(t.offset);
            let end = start.and_then(|s| s.checked_add(len));
            match (start, end) {
                (Some(start), Some(end)) if end <= file_len => {
                    spans.push((start, end, &t.name));
                }
                _ => {
                    return Err(ImportError::malformed(
                        path,
                        start,
                        format!("truncated: tensor {} ({dt}, {len} bytes) ends past the end of the file ({file_len} bytes)", t.name),
                    ))
                }
            }
        }
    }
    spans.sort_unstable();
    if let Some(w) = spans.windows(2).find(|w| w[1].0 < w[0].1) {
        return Err(ImportError::malformed(
            path,
            Some(w[1].0),
            format!(
                "tensors {} (bytes {}..{}) and {} (from {}) overlap",
                w[0].2, w[0].0, w[0].1, w[1].2, w[1].0
            ),
        ));
    }
    Ok(Gguf {
        version,
        metadata,
        tensors,
        data_start,
        alignment,
    })
}

struct Meta<'a> {
    m: &'a BTreeMap<String, Value>,
    path: &'a Path,
}

impl Meta<'_> {
    /// An array of i32 (GGUF may store small ids as any integer type); missing: empty.
    fn i32_array(&self, key: &str) -> Result<Vec<i32>, ImportError> {
        self.array_opt(key)?
            .unwrap_or(&[])
            .iter()
            .map(|v| match v {
                Value::I32(x) => Ok(*x),
                v => v
                    .as_u64()
                    .and_then(|x| i32::try_from(x).ok())
                    .ok_or_else(|| {
                        ImportError::malformed(
                            self.path,
                            None,
                            format!("{key}: item {v:?} is not an i32"),
                        )
                    }),
            })
            .collect()
    }

    /// An array of numbers as f32; missing: empty.
    fn f32_array(&self, key: &str) -> Result<Vec<f32>, ImportError> {
        self.array_opt(key)?
            .unwrap_or(&[])
            .iter()
            .map(|v| {
                v.as_f64().map(|x| x as f32).ok_or_else(|| {
                    ImportError::malformed(self.path, None, format!("{key}: item is not a number"))
                })
            })
            .collect()
    }

    fn get(&self, key: &str) -> Option<&Value> {
        self.m.get(key)
    }
    fn u32_opt(&self, key: &str) -> Result<Option<u32>, ImportError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    ImportError::malformed(
                        self.path,
                        None,
                        format!(
                            "metadata {key} is {} {v:?}, expected an unsigned integer",
                            v.type_name()
                        ),
                    )
                }),
        }
    }
    fn u32(&self, key: &str) -> Result<u32, ImportError> {
        self.u32_opt(key)?.ok_or_else(|| {
            ImportError::malformed(self.path, None, format!("metadata {key} is missing"))
        })
    }
    fn f32_opt(&self, key: &str) -> Result<Option<f32>, ImportError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| {
                ImportError::malformed(
                    self.path,
                    None,
                    format!("metadata {key} is {}, expected a number", v.type_name()),
                )
            }),
        }
    }
    fn str_opt(&self, key: &str) -> Result<Option<&str>, ImportError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Str(s)) => Ok(Some(s)),
            Some(v) => Err(ImportError::malformed(
                self.path,
                None,
                format!("metadata {key} is {}, expected a string", v.type_name()),
            )),
        }
    }
    fn bool_opt(&self, key: &str) -> Result<Option<bool>, ImportError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ImportError::malformed(
                self.path,
                None,
                format!("metadata {key} is {}, expected a bool", v.type_name()),
            )),
        }
    }
    fn array_opt(&self, key: &str) -> Result<Option<&[Value]>, ImportError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(ImportError::malformed(
                self.path,
                None,
                format!("metadata {key} is {}, expected an array", v.type_name()),
            )),
        }
    }
    fn strings(&self, key: &str) -> Result<Vec<String>, ImportError> {
        let Some(a) = self.array_opt(key)? else {
            return Ok(Vec::new());
        };
        a.iter()
            .map(|v| match v {
                Value::Str(s) => Ok(s.clone()),
                v => Err(ImportError::malformed(
                    self.path,
                    None,
                    format!("metadata {key}: item is {}, expected string", v.type_name()),
                )),
            })
            .collect()
    }
}

/// Maps a GGUF tensor name to the canonical (Hugging Face) name of `arch`'s recipe.
fn canonical_name(gguf: &str, arch: Arch) -> Option<String> {
    let r = arch.recipe();
    Some(match gguf {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        _ => {
            let rest = gguf.strip_prefix("blk.")?;
            let (layer, tail) = rest.split_once('.')?;
            let layer: u32 = layer.parse().ok()?;
            let hf = match tail {
                // gpt-oss's norm before its mixture (transformers' post_attention_layernorm).
                "post_attention_norm.weight" if arch == Arch::GptOss => {
                    format!("{}.weight", r.ffn_norm)
                }
                "attn_output.bias" if r.o_bias => "self_attn.o_proj.bias".into(),
                "attn_sinks.weight" if r.attn_sinks => "self_attn.sinks".into(),
                "ffn_gate_inp.bias" if r.moe_bias => "mlp.gate.bias".into(),
                "attn_norm.weight" => format!("{}.weight", r.attn_norm),
                "ffn_norm.weight" => format!("{}.weight", r.ffn_norm),
                "post_attention_norm.weight" => format!("{}.weight", r.post_attn_norm?),
                "post_ffw_norm.weight" => format!("{}.weight", r.post_ffn_norm?),
                "attn_q_norm.weight" if r.qk_norm => "self_attn.q_norm.weight".into(),
                "attn_k_norm.weight" if r.qk_norm => "self_attn.k_norm.weight".into(),
                other => match other {
                    "attn_q.weight" => "self_attn.q_proj.weight",
                    "attn_k.weight" => "self_attn.k_proj.weight",
                    "attn_v.weight" => "self_attn.v_proj.weight",
                    "attn_q.bias" => "self_attn.q_proj.bias",
                    "attn_k.bias" => "self_attn.k_proj.bias",
                    "attn_v.bias" => "self_attn.v_proj.bias",
                    "attn_output.weight" => "self_attn.o_proj.weight",
                    "ffn_gate.weight" => "mlp.gate_proj.weight",
                    "ffn_up.weight" => "mlp.up_proj.weight",
                    "ffn_down.weight" => "mlp.down_proj.weight",
                    "ffn_gate_inp.weight" => "mlp.gate.weight",
                    // Older Mixtral GGUFs: an expert's matrices as tensors of their own.
                    other => {
                        let (proj, rest) = other.split_once('.')?;
                        let (e, w) = rest.split_once('.')?;
                        let proj = match (proj, w) {
                            ("ffn_gate", "weight") => "gate_proj",
                            ("ffn_up", "weight") => "up_proj",
                            ("ffn_down", "weight") => "down_proj",
                            _ => return None,
                        };
                        let e: u32 = e.parse().ok()?;
                        return Some(format!(
                            "model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                        ));
                    }
                }
                .to_string(),
            };
            format!("model.layers.{layer}.{hf}")
        }
    })
}

/// A layer's experts merged in one tensor (`blk.N.ffn_{gate,up,down}_exps.weight`, dims
/// [cols, rows, experts], and gpt-oss's `.bias`, dims [rows, experts]): (layer, the
/// part's store name after the expert index).
fn merged_experts(gguf: &str) -> Option<(u32, &'static str)> {
    let (layer, tail) = gguf.strip_prefix("blk.")?.split_once('.')?;
    let part = match tail {
        "ffn_gate_exps.weight" => "gate_proj.weight",
        "ffn_up_exps.weight" => "up_proj.weight",
        "ffn_down_exps.weight" => "down_proj.weight",
        "ffn_gate_exps.bias" => "gate_proj.bias",
        "ffn_up_exps.bias" => "up_proj.bias",
        "ffn_down_exps.bias" => "down_proj.bias",
        _ => return None,
    };
    Some((layer.parse().ok()?, part))
}

/// A GGUF file, mapped: `import_bytes` on its bytes, the model keeping the mapping.
pub fn import(path: &Path) -> Result<ImportedModel, ImportError> {
    let map = mmap_file(path)?;
    let p = import_bytes(&map, path)?;
    Ok(ImportedModel {
        source: path.to_path_buf(),
        arch: p.arch,
        tokenizer: p.tokenizer,
        special: p.special,
        chat_template: p.chat_template,
        meta: p.meta,
        files: vec![(path.to_path_buf(), map)],
        tensors: p.tensors,
    })
}

/// What `import_bytes` reads from a GGUF: an `ImportedModel` but for the file it maps.
pub struct Imported {
    pub arch: ArchConfig,
    pub tokenizer: TokenizerSpec,
    pub special: SpecialTokens,
    pub chat_template: Option<String>,
    /// `general.file_type` and `general.sampling.*`.
    pub meta: SourceMeta,
    /// Canonical name -> source (file 0: the GGUF).
    pub tensors: BTreeMap<String, SourceTensor>,
}

/// `import` of a GGUF's bytes, `path` naming them in errors: the header, the architecture
/// and its config, the tensor map and the tokenizer (the fuzzer runs this on bytes in
/// memory).
pub(crate) fn import_bytes(map: &[u8], path: &Path) -> Result<Imported, ImportError> {
    let g = parse(map, path)?;
    let meta = Meta {
        m: &g.metadata,
        path,
    };
    let arch_name = meta.str_opt("general.architecture")?.ok_or_else(|| {
        ImportError::malformed(path, None, "metadata general.architecture is missing")
    })?;
    let (arch, permuted_qk) = match arch_name {
        // llama.cpp's converter permutes llama q/k rows for interleaved rotary pairs; Mistral
        // and Mixtral checkpoints are converted as "llama" too (Mixtral with experts).
        "llama" if meta.u32_opt("llama.expert_count")?.unwrap_or(0) > 0 => (Arch::Mixtral, true),
        "llama" => (Arch::Llama, true),
        "qwen2" => (Arch::Qwen2, false),
        "qwen3" => (Arch::Qwen3, false),
        "gemma3" => (Arch::Gemma3, false),
        "qwen3moe" => (Arch::Qwen3Moe, false),
        "gpt-oss" => (Arch::GptOss, false),
        other => return Err(ImportError::unsupported(path, format!("architecture {other:?}; sluice supports llama (Llama 2/3, Mistral, Mixtral, SmolLM2), qwen2, qwen3, gemma3, qwen3moe and gpt-oss"))),
    };
    let p = arch_name;
    let n_heads = meta.u32(&format!("{p}.attention.head_count"))?;
    let hidden = meta.u32(&format!("{p}.embedding_length"))?;
    let head_dim = match meta.u32_opt(&format!("{p}.attention.key_length"))? {
        Some(d) => d,
        None => meta
            .u32_opt(&format!("{p}.rope.dimension_count"))?
            .unwrap_or(hidden.checked_div(n_heads).unwrap_or(0)),
    };

    let n_kv_heads = meta
        .u32_opt(&format!("{p}.attention.head_count_kv"))?
        .unwrap_or(n_heads);
    let heads = Heads {
        q: n_heads,
        kv: n_kv_heads,
        permuted_qk,
    };
    let (tensors, rope_freqs) = map_tensors(&g, map, path, arch, heads)?;
    let arch_cfg = arch_config(
        &meta,
        &tensors,
        rope_freqs,
        (arch, arch_name),
        hidden,
        heads,
        head_dim,
    )?;
    let (tokenizer, special, chat_template) = tokenizer(&meta, arch_cfg.vocab)?;
    Ok(Imported {
        arch: arch_cfg,
        tokenizer,
        special,
        chat_template,
        meta: source_meta(&meta, path),
        tensors,
    })
}

/// llama.cpp's name of a `general.file_type` (its `llama_ftype`, less `MOSTLY_`): the
/// quantization a GGUF declares for itself, which names the mix ("Q4_K_M") even where
/// most tensors are of another type (Gemma 3 270M's 640-wide rows take Q5_0, not Q4_K).
pub fn file_type_name(t: u32) -> Option<&'static str> {
    Some(match t {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        38 => "MXFP4_MOE",
        _ => return None,
    })
}

/// What a GGUF says of itself beyond the weights: its file type and the sampling its
/// maker recommends (`general.sampling.*`, as llama.cpp reads them). A value of the wrong
/// type or out of range is left out with a warning: it changes no weight, and the model
/// still packs.
fn source_meta(meta: &Meta, path: &Path) -> SourceMeta {
    let warn = |key: &str, e: &dyn std::fmt::Display| {
        tracing::warn!("{}: {key}: {e}; left out", path.display());
    };
    let f = |key: &str| match meta.f32_opt(key) {
        Ok(v) => v,
        Err(e) => {
            warn(key, &e);
            None
        }
    };
    let file_type = match meta.u32_opt("general.file_type") {
        Ok(t) => t.and_then(file_type_name).map(str::to_string),
        Err(e) => {
            warn("general.file_type", &e);
            None
        }
    };
    let top_k = match meta.u32_opt("general.sampling.top_k") {
        Ok(k) => k,
        Err(e) => {
            warn("general.sampling.top_k", &e);
            None
        }
    };
    let mut sampling = RecommendedSampling {
        temperature: f("general.sampling.temp"),
        top_k,
        top_p: f("general.sampling.top_p"),
        min_p: f("general.sampling.min_p"),
        repetition_penalty: f("general.sampling.penalty_repeat"),
    };
    if let Err(e) = sampling.check() {
        warn("general.sampling", &e);
        sampling = RecommendedSampling::default();
    }
    SourceMeta {
        file_type,
        sampling,
    }
}

/// Attention heads, and whether llama.cpp's converter permuted the q/k rows.
#[derive(Clone, Copy)]
struct Heads {
    q: u32,
    kv: u32,
    permuted_qk: bool,
}

/// The GGML types sluice reads, as GGUF tools name them.
fn supported_names() -> String {
    let names: Vec<String> = crate::dtype::ALL_DTYPES
        .iter()
        .map(|d| d.ggml_name())
        .collect();
    names.join(", ")
}

/// Every tensor under its Hugging Face name, dtypes checked, llama q/k rows marked for
/// un-permutation; `rope_freqs.weight` (llama3 scaling) taken out as numbers.
#[allow(clippy::type_complexity)] // (tensors by name, rope frequency factors)
fn map_tensors(
    g: &Gguf,
    map: &[u8],
    path: &Path,
    arch: Arch,
    heads: Heads,
) -> Result<(BTreeMap<String, SourceTensor>, Option<Vec<f32>>), ImportError> {
    let (n_heads, n_kv_heads, permuted_qk) = (heads.q, heads.kv, heads.permuted_qk);
    let mut tensors = BTreeMap::new();
    let mut rope_freqs: Option<Vec<f32>> = None;
    for t in &g.tensors {
        let dtype = DType::from_ggml(t.ggml_type).ok_or_else(|| {
            ImportError::unsupported(
                path,
                format!(
                    "tensor {} has GGML type {} ({}); sluice supports {}: requantize with llama-quantize to one of those (Q4_K_M is a good default)",
                    t.name,
                    t.ggml_type,
                    ggml_type_name(t.ggml_type),
                    supported_names()
                ),
            )
        })?;
        let shape: Vec<u64> = t.dims.iter().rev().copied().collect();
        let len = dtype.tensor_bytes(&shape).ok_or_else(|| {
            ImportError::malformed(path, None, format!("tensor {}: dims {:?}", t.name, t.dims))
        })?;
        let offset = g.data_start + t.offset;
        if t.name == "rope_freqs.weight" {
            if dtype != DType::F32 {
                return Err(ImportError::unsupported(
                    path,
                    format!("rope_freqs.weight is {dtype}, expected f32"),
                ));
            }
            let b = &map[offset as usize..(offset + len) as usize];
            rope_freqs = Some(
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(crate::util::array(c)))
                    .collect(),
            );
            continue;
        }
        if let Some((layer, part)) = merged_experts(&t.name) {
            // [experts, rows, cols] (a bias: [experts, rows]): each expert's matrix is whole
            // rows of whole blocks, one after the other, so each is a byte range of its own.
            let (n, each) = match (&shape[..], part.ends_with(".bias")) {
                (&[n, rows, cols], false) if n > 0 => (n, vec![rows, cols]),
                (&[n, rows], true) if n > 0 => (n, vec![rows]),
                _ => {
                    return Err(ImportError::malformed(
                        path,
                        None,
                        format!(
                            "tensor {}: dims {:?} are not [cols, rows, experts] ([rows, experts] for a bias)",
                            t.name, t.dims
                        ),
                    ))
                }
            };
            let piece = len / n;
            for e in 0..n {
                let name = format!("model.layers.{layer}.mlp.experts.{e}.{part}");
                let st = SourceTensor {
                    dtype,
                    shape: each.clone(),
                    file: 0,
                    offset: offset + e * piece,
                    len: piece,
                    unpermute_heads: None,
                    synthetic_seed: None,
                    synthetic_row_skew: None,
                    widen: None,
                    strided: None,
                    openai_mxfp4: None,
                };
                if tensors.insert(name, st).is_some() {
                    return Err(ImportError::malformed(
                        path,
                        None,
                        format!("tensor {} appears twice", t.name),
                    ));
                }
            }
            continue;
        }
        let name = canonical_name(&t.name, arch).ok_or_else(|| {
            ImportError::unsupported(
                path,
                format!("unexpected tensor {} for a {arch} model", t.name),
            )
        })?;
        let unpermute_heads = if permuted_qk && name.contains(".self_attn.q_proj.") {
            Some(n_heads)
        } else if permuted_qk && name.contains(".self_attn.k_proj.") {
            Some(n_kv_heads)
        } else {
            None
        };
        if let Some(heads) = unpermute_heads {
            let rows = shape[0];
            if heads == 0 || !rows.is_multiple_of(heads as u64 * 2) {
                return Err(ImportError::malformed(
                    path,
                    None,
                    format!(
                        "tensor {}: {rows} rows do not split into {heads} heads of rotary pairs",
                        t.name
                    ),
                ));
            }
        }
        if tensors
            .insert(
                name.clone(),
                SourceTensor {
                    dtype,
                    shape,
                    file: 0,
                    offset,
                    len,
                    unpermute_heads,
                    synthetic_seed: None,
                    synthetic_row_skew: None,
                    widen: None,
                    strided: None,
                    openai_mxfp4: None,
                },
            )
            .is_some()
        {
            return Err(ImportError::malformed(
                path,
                None,
                format!("tensor {} appears twice", t.name),
            ));
        }
    }

    Ok((tensors, rope_freqs))
}

/// The architecture config from the `{arch}.*` metadata and the tensors present.
/// `p` is the metadata's architecture name (`general.architecture`), the keys' prefix.
fn arch_config(
    meta: &Meta<'_>,
    tensors: &BTreeMap<String, SourceTensor>,
    rope_freqs: Option<Vec<f32>>,
    (arch, p): (Arch, &str),
    hidden: u32,
    heads: Heads,
    head_dim: u32,
) -> Result<ArchConfig, ImportError> {
    let path = meta.path;
    let (n_heads, n_kv_heads) = (heads.q, heads.kv);
    let embd = tensors
        .get("model.embed_tokens.weight")
        .ok_or_else(|| ImportError::malformed(path, None, "tensor token_embd.weight is missing"))?;
    let vocab = embd.shape[0] as u32;
    let rope_scaling = match (rope_freqs, meta.str_opt(&format!("{p}.rope.scaling.type"))?) {
        (Some(f), _) => Some(RopeScaling::FreqFactors(f)),
        (None, Some("linear")) => Some(RopeScaling::Linear {
            factor: meta
                .f32_opt(&format!("{p}.rope.scaling.factor"))?
                .unwrap_or(1.0),
        }),
        // As llama.cpp runs it (llama_context, ggml's rope_yarn): correction dims rounded
        // outward (GGUF has no `truncate`), the magnitude 1 + 0.1 ln(factor) times
        // `rope.scaling.attn_factor`.
        (None, Some("yarn")) => {
            let key = |k: &str| format!("{p}.rope.scaling.{k}");
            let factor = meta.f32_opt(&key("factor"))?.unwrap_or(1.0);
            if meta.f32_opt(&key("yarn_log_multiplier"))?.unwrap_or(0.0) != 0.0 {
                return Err(ImportError::unsupported(
                    path,
                    "YaRN with a log multiplier (DeepSeek's mscale_all_dim) is not supported",
                ));
            }
            let mscale = if factor <= 1.0 {
                1.0
            } else {
                1.0 + 0.1 * factor.ln()
            };
            Some(RopeScaling::Yarn {
                factor,
                original_max_position: meta
                    .u32_opt(&key("original_context_length"))?
                    .unwrap_or(4096),
                beta_fast: meta.f32_opt(&key("yarn_beta_fast"))?.unwrap_or(32.0),
                beta_slow: meta.f32_opt(&key("yarn_beta_slow"))?.unwrap_or(1.0),
                attention_factor: mscale * meta.f32_opt(&key("attn_factor"))?.unwrap_or(1.0),
                truncate: true,
            })
        }
        (None, None | Some("none")) => None,
        (None, Some(other)) => {
            return Err(ImportError::unsupported(
                path,
                format!("rope scaling type {other:?}; sluice supports linear, llama3 and yarn"),
            ))
        }
    };
    let arch_cfg = ArchConfig {
        arch,
        name: meta
            .str_opt("general.name")?
            .unwrap_or_default()
            .to_string(),
        n_layers: meta.u32(&format!("{p}.block_count"))?,
        hidden,
        n_heads,
        n_kv_heads,
        head_dim,
        intermediate: meta.u32(&format!("{p}.feed_forward_length"))?,
        vocab,
        max_context: meta
            .u32_opt(&format!("{p}.context_length"))?
            .unwrap_or(4096),
        rope_theta: meta
            .f32_opt(&format!("{p}.rope.freq_base"))?
            .unwrap_or(10000.0),
        rope_scaling,
        rms_eps: meta
            .f32_opt(&format!("{p}.attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5),
        tied_embeddings: !tensors.contains_key("lm_head.weight"),
        qkv_bias: tensors.contains_key("model.layers.0.self_attn.q_proj.bias"),
        sliding_window: meta.u32_opt(&format!("{p}.attention.sliding_window"))?,
        ext: Default::default(),
        moe: match arch {
            // As llama.cpp reads them (src/models/qwen3moe.cpp, llama.cpp's llama graph):
            // every layer a mixture, softmax gating, the top k renormalized.
            Arch::Qwen3Moe | Arch::Mixtral | Arch::GptOss => Some(MoeConfig {
                n_experts: meta.u32(&format!("{p}.expert_count"))?,
                top_k: meta.u32(&format!("{p}.expert_used_count"))?,
                intermediate: match meta.u32_opt(&format!("{p}.expert_feed_forward_length"))? {
                    Some(n) => n,
                    None => meta.u32(&format!("{p}.feed_forward_length"))?,
                },
                norm_topk_prob: true,
                dense_layers: Vec::new(),
            }),
            _ => None,
        },
        swiglu: None,
    };
    let mut arch_cfg = arch_cfg;
    if arch == Arch::GptOss {
        // As llama.cpp reads gpt-oss (src/models/openai-moe.cpp): sliding-window layers
        // and full ones alternating from layer 0 (swa pattern 2), the clamped SwiGLU with
        // alpha 1.702 and limit 7 (llama-graph's SWIGLU_OAI_MOE).
        arch_cfg.ext.sliding_layers = (0..arch_cfg.n_layers).step_by(2).collect();
        arch_cfg.swiglu = Some(SwigluClamp {
            alpha: 1.702,
            limit: 7.0,
        });
    }
    if arch == Arch::Gemma3 {
        // As llama.cpp reads a Gemma 3 GGUF (src/models/gemma3.cpp): five sliding-window
        // layers to one global (or the file's pattern), the sliding ones with RoPE base
        // freq_base_swa (10 000); scores scaled by
        // query_pre_attn_scalar ^ -0.5, which is the head dim except in the 27B model
        // (62 layers: hidden / heads). The norms in the file already hold 1 + w.
        let pre_attn = match arch_cfg.n_layers {
            62 => hidden / n_heads.max(1),
            _ => head_dim,
        };
        if let Some(cap) = meta.f32_opt(&format!("{p}.final_logit_softcapping"))? {
            if cap != 0.0 {
                return Err(ImportError::unsupported(
                    path,
                    format!(
                        "{p}.final_logit_softcapping = {cap}: logit soft-capping is not supported"
                    ),
                ));
            }
        }
        let pattern = meta
            .u32_opt(&format!("{p}.attention.sliding_window_pattern"))?
            .unwrap_or(6);
        let local = meta
            .f32_opt(&format!("{p}.rope.freq_base_swa"))?
            .unwrap_or(10000.0);
        let sliding = every_but_nth(arch_cfg.n_layers, pattern);
        arch_cfg.ext = ArchExt::gemma3(hidden, pre_attn as f64, sliding, local);
    }
    arch_cfg
        .validate()
        .map_err(|e| ImportError::malformed(path, None, format!("architecture metadata: {e}")))?;
    Ok(arch_cfg)
}

/// The vocabulary, special tokens and chat template from the `tokenizer.*` metadata.
fn tokenizer(
    meta: &Meta<'_>,
    vocab: u32,
) -> Result<(TokenizerSpec, SpecialTokens, Option<String>), ImportError> {
    let path = meta.path;
    let model = meta
        .str_opt("tokenizer.ggml.model")?
        .ok_or_else(|| {
            ImportError::malformed(
                path,
                None,
                "metadata tokenizer.ggml.model is missing: the GGUF has no tokenizer",
            )
        })?
        .to_string();
    let tokens = meta.strings("tokenizer.ggml.tokens")?;
    if tokens.is_empty() {
        return Err(ImportError::malformed(
            path,
            None,
            "metadata tokenizer.ggml.tokens is missing or empty",
        ));
    }
    if tokens.len() as u64 > vocab as u64 {
        return Err(ImportError::malformed(
            path,
            None,
            format!("{} tokens but the embedding has {vocab} rows", tokens.len()),
        ));
    }
    let token_types = meta.i32_array("tokenizer.ggml.token_type")?;
    let scores = meta.f32_array("tokenizer.ggml.scores")?;
    for (what, n) in [("token_type", token_types.len()), ("scores", scores.len())] {
        if n != 0 && n != tokens.len() {
            return Err(ImportError::malformed(
                path,
                None,
                format!(
                    "tokenizer.ggml.{what} has {n} entries for {} tokens",
                    tokens.len()
                ),
            ));
        }
    }
    let n_tokens = tokens.len() as u32;
    let token_id = |key: &str| -> Result<Option<u32>, ImportError> {
        match meta.u32_opt(key)? {
            Some(id) if id >= n_tokens => Err(ImportError::malformed(
                path,
                None,
                format!("{key} = {id}, past the {n_tokens} tokens"),
            )),
            v => Ok(v),
        }
    };
    let chat_template = meta.str_opt("tokenizer.chat_template")?.map(str::to_string);
    let bos = token_id("tokenizer.ggml.bos_token_id")?;
    let eos = token_id("tokenizer.ggml.eos_token_id")?;
    let mut end_tokens = Vec::new();
    push_unique(&mut end_tokens, eos);
    push_unique(&mut end_tokens, token_id("tokenizer.ggml.eot_token_id")?);
    push_unique(&mut end_tokens, token_id("tokenizer.ggml.eom_token_id")?);
    for id in end_of_turn_tokens(chat_template.as_deref(), |s| {
        tokens.iter().position(|t| t == s).map(|i| i as u32)
    }) {
        push_unique(&mut end_tokens, Some(id));
    }
    let special = SpecialTokens {
        bos,
        eos,
        end_tokens,
        pad: token_id("tokenizer.ggml.padding_token_id")?,
        unk: token_id("tokenizer.ggml.unknown_token_id")?,
        // llama.cpp's default: SentencePiece vocabularies add BOS, BPE ones do not.
        add_bos: meta
            .bool_opt("tokenizer.ggml.add_bos_token")?
            .unwrap_or(model == "llama"),
    };
    let tokenizer = TokenizerSpec::Gguf(GgufVocab {
        pre: meta.str_opt("tokenizer.ggml.pre")?.map(str::to_string),
        merges: meta.strings("tokenizer.ggml.merges")?,
        add_space_prefix: meta
            .bool_opt("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(model == "llama"),
        model,
        tokens,
        token_types,
        scores,
    });
    Ok((tokenizer, special, chat_template))
}
