//! The store's fuzz targets (cargo-fuzz in `fuzz/`, built with the `fuzz` feature; the
//! committed corpora also run as a plain test, `fuzzing::tests`): a manifest, and one
//! stored frame of every codec with its round trip. Any input may be refused; none may
//! panic, hang or allocate without bound.

use crate::dtype::DType;
use crate::store::codec::{CodeCensus, Codec, FrameDecoder, FrameEncoder, Plane};
use crate::store::float::SharedTables;
use std::path::Path;
use std::sync::Arc;

/// A manifest: with a first byte 0, the rest is a whole manifest.bin (header, payload,
/// checksum); otherwise the rest is a decompressed payload of the format that byte picks,
/// decoded and validated as if its checksum held (mutations of a whole file almost never
/// get past the checksum to the fields and `validate`).
pub fn manifest(data: &[u8]) {
    use crate::store::format::{Manifest, FORMAT_VERSION, FORMAT_VERSION_MIN};
    let path = Path::new("manifest.bin");
    match data.split_first() {
        Some((0, file)) => {
            let _ = Manifest::decode(file, path);
        }
        Some((&v, payload)) => {
            let versions = FORMAT_VERSION - FORMAT_VERSION_MIN + 1;
            let version = FORMAT_VERSION_MIN + (u32::from(v) - 1) % versions;
            let _ = Manifest::decode_payload(version, payload, path);
        }
        None => {}
    }
}

/// One stored frame: the first 8 bytes choose the codec, the byte planes, which planes are
/// coded, the raw length and the checksum; the rest are the stored bytes. The decoder must
/// refuse or fill exactly the frame. Then the rest is encoded and must decode back to itself.
pub fn frame(data: &[u8]) {
    let Some((head, body)) = data.split_first_chunk::<8>() else {
        return;
    };
    let codec = [
        Codec::None,
        Codec::Lz4,
        Codec::Zstd { level: 1 },
        Codec::Float,
        // A linked frame: heads of 2 to 16 rows of 1 to 64 bytes (or none).
        Codec::Source {
            head_rows: u32::from(head[1] >> 4 & 0x7) * 2,
            row_bytes: u32::from(head[2] & 0x3f) + 1,
        },
    ][head[0] as usize % 5];
    let width = [1usize, 2, 3, 4][head[1] as usize % 4];
    let raw_len = (u16::from_le_bytes([head[2], head[3]]) as usize).min(1 << 14);
    let checksum = u64::from(u32::from_le_bytes([head[4], head[5], head[6], head[7]]));
    // The stored bytes split into `width` planes at proportional cuts.
    let mut planes = Vec::with_capacity(width);
    let mut at = 0usize;
    for i in 0..width {
        let end = if i + 1 == width {
            body.len()
        } else {
            body.len() * (i + 1) / width
        };
        planes.push(Plane {
            stored_len: (end - at) as u32,
            compressed: head[0] & (0x10 << i) != 0,
        });
        at = end;
    }
    // The float codec takes the frame as elements of a float dtype; its shared codes are
    // made from the frame's own bytes (a plane may name one: mode 2).
    let dtype = [DType::Q8_0, DType::BF16, DType::F16, DType::F32][head[1] as usize % 4];
    let raw = &body[..body.len().min(1 << 14)];
    let mut census = CodeCensus::default();
    census.add(&raw[..raw.len() / 4 * 4], dtype);
    let codes = census.codes();
    let Ok(tables) = SharedTables::new(&codes) else {
        panic!("the census made shared codes that do not check: {codes:?}");
    };
    let tables = Arc::new(tables);
    let Ok(dec) = FrameDecoder::new(raw_len) else {
        return;
    };
    let mut dec = dec.with_shared(tables.clone());
    let mut dst = vec![0u8; raw_len];
    let _ = dec.decode(codec, &planes, checksum, body, &mut dst);

    // The round trip: whatever the encoder makes of the bytes decodes back to them.
    let Ok(mut enc) = FrameEncoder::new(codec) else {
        return;
    };
    enc.set_shared(&codes);
    let e = if codec == Codec::Float {
        enc.encode(&raw[..raw.len() / 4 * 4], dtype)
    } else {
        enc.encode_split(raw, [1, 2, 4][head[1] as usize % 3])
    };
    let Ok(e) = e else {
        return;
    };
    let raw = if codec == Codec::Float {
        &raw[..raw.len() / 4 * 4]
    } else {
        raw
    };
    let (codec, planes, bytes) = (e.codec, e.planes.clone(), e.bytes.to_vec());
    let sum = crate::util::xxh3(raw);
    let Ok(dec) = FrameDecoder::new(raw.len()) else {
        return;
    };
    let mut dec = dec.with_shared(tables);
    let mut back = vec![0u8; raw.len()];
    let r = dec.decode(codec, &planes, sum, &bytes, &mut back);
    assert!(
        r.is_ok() && back == raw,
        "a frame sluice encoded did not decode to its bytes: {r:?}"
    );
}
