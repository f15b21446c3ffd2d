//! `sluiced bench-codec`: every frame codec on the same bytes in one run — the frames of
//! a store, or of a safetensors file or a GGUF cut as `pack` cuts them, grouped by dtype —
//! with the stored ratio and the compress and decompress rates of one core.

use serde::Serialize;
use sluice::dtype::DType;
use sluice::import::gguf;
use sluice::store::auto::measure_codec;
use sluice::store::codec::Codec;
use sluice::store::format::{TensorEntry, MANIFEST_FILE};
use sluice::store::writer;
use sluice::store::writer::PackSource;
use sluice::store::{Store, StoreError};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// Decoding repeats until it has run this long; the fastest pass counts.
const DECODE_TIME_MIN: Duration = Duration::from_millis(300);

/// How a group's bytes are cut into frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Framing {
    /// A store's own frames.
    Store,
    /// The frames `pack` would cut (a model file sluice imports): a unit's vectors of one
    /// dtype share a frame.
    Pack,
    /// Each tensor cut on its own (a file sluice does not import as a model).
    Tensor,
}

/// The frames of one dtype, their bytes end to end, and each frame's length.
pub struct Group {
    pub dtype: DType,
    pub bytes: Vec<u8>,
    pub frames: Vec<usize>,
    /// Tensors whose bytes are in the frames.
    pub tensors: usize,
    pub framing: Framing,
}

/// The groups by dtype, each taking frames while they fit in `max_bytes` (its first
/// frame whatever its size).
struct Groups {
    map: BTreeMap<&'static str, Group>,
    max_bytes: u64,
}

impl Groups {
    fn fits(&self, dtype: DType, len: u64) -> bool {
        self.map
            .get(dtype.name())
            .is_none_or(|g| g.frames.is_empty() || g.bytes.len() as u64 + len <= self.max_bytes)
    }

    fn add(&mut self, dtype: DType, bytes: &[u8], tensors: usize, framing: Framing) {
        if !self.fits(dtype, bytes.len() as u64) {
            return;
        }
        let g = self.map.entry(dtype.name()).or_insert_with(|| Group {
            dtype,
            bytes: Vec::new(),
            frames: Vec::new(),
            tensors: 0,
            framing,
        });
        g.bytes.extend_from_slice(bytes);
        g.frames.push(bytes.len());
        g.tensors += tensors;
    }
}

/// One codec on one group.
#[derive(Clone, Debug, Serialize)]
pub struct CodecFigures {
    pub codec: String,
    /// Stored bytes over raw bytes.
    pub ratio: f64,
    /// Raw bytes per second of one core, in GB/s (1e9).
    pub compress_gbps: f64,
    pub decompress_gbps: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct GroupFigures {
    pub dtype: String,
    pub framing: Framing,
    pub tensors: usize,
    pub frames: usize,
    pub bytes: u64,
    pub codecs: Vec<CodecFigures>,
}

/// The frames of `src` (a store directory, a model file sluice imports, or any other
/// `.safetensors` file or `.gguf`), grouped by dtype, at most `max_bytes` of each (whole
/// frames in order; at least one): a store's own frames, else those `pack` would cut with
/// frames of `frame_size` (`Framing`).
pub fn load(src: &Path, max_bytes: u64, frame_size: u32) -> Result<Vec<Group>, String> {
    let mut groups = Groups {
        map: BTreeMap::new(),
        max_bytes,
    };
    let name = src.to_string_lossy();
    // Tensors starting in the frame at `at` of `len` bytes.
    let starting = |tensors: &[TensorEntry], at: u64, len: u64| {
        tensors
            .iter()
            .filter(|t| t.offset >= at && t.offset < at + len)
            .count()
    };
    if src.join(MANIFEST_FILE).is_file() {
        let store = Store::open(src).map_err(|e| e.to_string())?;
        let file = store.open_weights().map_err(|e| e.to_string())?;
        let mut dec = store
            .frame_decoder(store.manifest().frame_size as usize)
            .map_err(|e| format!("a frame decoder: {e}"))?;
        let (mut stored, mut raw) = (Vec::new(), Vec::new());
        for (i, u) in store.units().iter().enumerate() {
            // A unit none of whose frames a group still takes is not read (a large
            // store's groups fill in its first layers).
            let dtype_at = |f: &sluice::store::format::Frame| {
                u.tensor_at(f.raw_offset).map(|t| u.tensors[t].dtype)
            };
            if !u
                .frames
                .iter()
                .any(|f| dtype_at(f).is_some_and(|d| groups.fits(d, f.raw_len as u64)))
            {
                continue;
            }
            raw.resize(u.raw_len as usize, 0);
            store
                .read_unit(&file, i, &mut stored, &mut raw, &mut dec)
                .map_err(|e: StoreError| e.to_string())?;
            for f in &u.frames {
                let Some(t) = u.tensor_at(f.raw_offset) else {
                    continue;
                };
                let (at, len) = (f.raw_offset, f.raw_len as u64);
                groups.add(
                    u.tensors[t].dtype,
                    &raw[at as usize..(at + len) as usize],
                    starting(&u.tensors, at, len),
                    Framing::Store,
                );
            }
        }
        return Ok(groups.map.into_values().collect());
    }
    if let Ok((model, units)) = sluice::import::open(src)
        .map_err(|e| e.to_string())
        .and_then(|m| m.units().map(|u| (m, u)).map_err(|e| e.to_string()))
    {
        let mut blob = Vec::new();
        for spec in &units {
            let writer::PackedUnit {
                tensors,
                raw_len,
                frames,
            } = writer::packed_frames(&model, spec, Codec::Float, frame_size, src)
                .map_err(|e| e.to_string())?;
            if !frames.iter().any(|&(_, len, d)| groups.fits(d, len)) {
                continue;
            }
            blob.clear();
            blob.resize(raw_len as usize, 0);
            // Only the tensors of frames a group still takes are read.
            let mut copied = vec![false; tensors.len()];
            for (at, len, dtype) in frames {
                if !groups.fits(dtype, len) {
                    continue;
                }
                for (i, t) in tensors.iter().enumerate() {
                    if !copied[i] && t.offset < at + len && t.offset + t.len > at {
                        let dst = &mut blob[t.offset as usize..(t.offset + t.len) as usize];
                        model.copy_tensor(&t.name, dst);
                        copied[i] = true;
                    }
                }
                groups.add(
                    dtype,
                    &blob[at as usize..(at + len) as usize],
                    starting(&tensors, at, len),
                    Framing::Pack,
                );
            }
        }
        return Ok(groups.map.into_values().collect());
    }
    let mut add_tensor = |dtype: DType, bytes: &[u8]| {
        for (i, f) in bytes.chunks(frame_size as usize).enumerate() {
            groups.add(dtype, f, (i == 0) as usize, Framing::Tensor);
        }
    };
    let f = std::fs::File::open(src).map_err(|e| format!("{name}: {e}"))?;
    // SAFETY: read-only map of a file this process does not modify; a file truncated
    // underneath would fault, as any reader of a model file being rewritten.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| format!("{name}: {e}"))?;
    if map.starts_with(b"GGUF") {
        let g = gguf::parse(&map, src).map_err(|e| e.to_string())?;
        for t in &g.tensors {
            let Some(dt) = DType::from_ggml(t.ggml_type) else {
                continue;
            };
            let n: u64 = t.dims.iter().product();
            let Some(len) = dt.row_bytes(n) else {
                continue;
            };
            let at = (g.data_start + t.offset) as usize;
            let bytes = map
                .get(at..at + len as usize)
                .ok_or_else(|| format!("{name}: tensor {} past the file's end", t.name))?;
            add_tensor(dt, bytes);
        }
    } else {
        let st = safetensors::SafeTensors::deserialize(&map)
            .map_err(|e| format!("{name}: not a GGUF, and as safetensors: {e}"))?;
        let mut names: Vec<(usize, String)> = st
            .tensors()
            .into_iter()
            .map(|(n, v)| (v.data().as_ptr() as usize, n))
            .collect();
        names.sort();
        for (_, n) in names {
            let v = st.tensor(&n).map_err(|e| format!("{name}: {n}: {e}"))?;
            let dt = match v.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::F16 => DType::F16,
                safetensors::Dtype::BF16 => DType::BF16,
                _ => continue,
            };
            add_tensor(dt, v.data());
        }
    }
    if groups.map.is_empty() {
        return Err(format!("{name}: no tensors of a dtype sluice stores"));
    }
    Ok(groups.map.into_values().collect())
}

/// Every codec of `codecs` on the frames of `g`. Each frame decodes back to its bytes,
/// checked by its checksum.
pub fn measure(g: &Group, codecs: &[Codec], frame_size: usize) -> Result<GroupFigures, String> {
    let mut frames: Vec<&[u8]> = Vec::with_capacity(g.frames.len());
    let mut at = 0;
    for &len in &g.frames {
        frames.push(&g.bytes[at..at + len]);
        at += len;
    }
    let mut out = Vec::new();
    for &codec in codecs {
        let (ratio, compress_gbps, decompress_gbps) =
            measure_codec(codec, &frames, g.dtype, frame_size, DECODE_TIME_MIN)
                .map_err(|e| format!("{codec}: {e}"))?;
        out.push(CodecFigures {
            codec: codec.to_string(),
            ratio,
            compress_gbps,
            decompress_gbps,
        });
    }
    Ok(GroupFigures {
        dtype: g.dtype.name().to_string(),
        framing: g.framing,
        tensors: g.tensors,
        frames: g.frames.len(),
        bytes: g.bytes.len() as u64,
        codecs: out,
    })
}
