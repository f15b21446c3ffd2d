//! `sluiced bench-codec`: every frame codec on the same bytes in one run — the tensors of
//! a store, a safetensors file or a GGUF, grouped by dtype, cut into frames as `pack` cuts
//! them — with the stored ratio and the compress and decompress rates of one core.

use serde::Serialize;
use sluice::dtype::DType;
use sluice::import::gguf;
use sluice::store::auto::measure_codec;
use sluice::store::codec::Codec;
use sluice::store::{Store, StoreError};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// Decoding repeats until it has run this long; the fastest pass counts.
const DECODE_TIME_MIN: Duration = Duration::from_millis(300);

/// The tensors of one dtype, their bytes end to end, each tensor's length.
pub struct Group {
    pub dtype: DType,
    pub bytes: Vec<u8>,
    pub lens: Vec<usize>,
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
    pub tensors: usize,
    pub bytes: u64,
    pub codecs: Vec<CodecFigures>,
}

/// Reads the tensors of `src` (a store directory, a `.safetensors` file or a `.gguf`),
/// grouped by dtype, at most `max_bytes` of each (whole tensors, in file order; at least
/// one).
pub fn load(src: &Path, max_bytes: u64) -> Result<Vec<Group>, String> {
    let mut groups: BTreeMap<&'static str, Group> = BTreeMap::new();
    let mut add = |dtype: DType, bytes: &[u8]| {
        let g = groups.entry(dtype.name()).or_insert_with(|| Group {
            dtype,
            bytes: Vec::new(),
            lens: Vec::new(),
        });
        if g.lens.is_empty() || (g.bytes.len() + bytes.len()) as u64 <= max_bytes {
            g.bytes.extend_from_slice(bytes);
            g.lens.push(bytes.len());
        }
    };
    let name = src.to_string_lossy();
    if src.is_dir() {
        let store = Store::open(src).map_err(|e| e.to_string())?;
        let file = store.open_weights().map_err(|e| e.to_string())?;
        let mut dec = store
            .frame_decoder(store.manifest().frame_size as usize)
            .map_err(|e| format!("a frame decoder: {e}"))?;
        let (mut stored, mut raw) = (Vec::new(), Vec::new());
        for (i, u) in store.units().iter().enumerate() {
            raw.resize(u.raw_len as usize, 0);
            store
                .read_unit(&file, i, &mut stored, &mut raw, &mut dec)
                .map_err(|e: StoreError| e.to_string())?;
            for t in &u.tensors {
                add(
                    t.dtype,
                    &raw[t.offset as usize..(t.offset + t.len) as usize],
                );
            }
        }
    } else {
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
                add(dt, bytes);
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
                add(dt, v.data());
            }
        }
    }
    if groups.is_empty() {
        return Err(format!("{name}: no tensors of a dtype sluice stores"));
    }
    Ok(groups.into_values().collect())
}

/// Every codec of `codecs` on `g`, its tensors cut into frames of `frame_size` bytes (a
/// tensor's tail is a frame of its own, as `pack` cuts them). Each frame decodes back to
/// its bytes, checked by its checksum.
pub fn measure(g: &Group, codecs: &[Codec], frame_size: usize) -> Result<GroupFigures, String> {
    let mut frames: Vec<(usize, usize)> = Vec::new();
    let mut at = 0;
    for &len in &g.lens {
        let mut o = 0;
        while o < len {
            let n = (len - o).min(frame_size);
            frames.push((at + o, n));
            o += n;
        }
        at += len;
    }
    let frames: Vec<&[u8]> = frames.iter().map(|&(o, n)| &g.bytes[o..o + n]).collect();
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
        tensors: g.lens.len(),
        bytes: g.bytes.len() as u64,
        codecs: out,
    })
}
