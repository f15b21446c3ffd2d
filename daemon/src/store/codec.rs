//! Frame codecs and the byte-split filter.
//!
//! `float` (`float/`) splits each float element into its exponent and the rest and
//! Huffman-codes the exponents only; the codecs below work on byte planes.
//!
//! A frame is up to `frame_size` bytes of one dtype of a unit's decompressed blob (a piece of
//! a tensor, or neighbouring vectors whole: `writer::frame_pieces`). For 16- and 32-bit
//! floats the frame is split into byte planes (most significant byte of every element first,
//! then the next, ...): exponents cluster, so the high planes compress well and the low
//! mantissa planes rarely do. Each plane is coded on its own and kept raw when coding does
//! not save at least `KEEP_RAW_SAVING_MIN`; the whole frame is kept raw under the same rule,
//! so quantized weights never pay decompression for nothing.

use super::float::{self, Layout};
use crate::dtype::DType;
use crate::util::xxh3 as xxh3_64;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// A frame or plane is stored compressed only when that saves at least 3 % of its bytes:
/// below that the decompression time costs more than the disk time it saves.
pub const KEEP_RAW_SAVING_MIN: f64 = 0.03;

/// zstd levels accepted by `zstd:N` (negative levels are zstd's "fast" modes).
pub const ZSTD_LEVEL_MIN: i32 = -7;
pub const ZSTD_LEVEL_MAX: i32 = 22;

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Codec {
    None,
    Lz4,
    Zstd {
        level: i32,
    },
    /// Exponents Huffman-coded, sign and mantissa raw (`float`); 16- and 32-bit floats
    /// only (other frames are kept raw).
    Float,
    /// A frame of a linked store (`pack --link`): its stored bytes are a piece of a tensor
    /// as the source file holds it, read from there. Decoding copies them, zero-fills the
    /// rest of the frame (the padding before the next tensor) and, where `head_rows` is not
    /// 0, puts each head's `head_rows` rows of `row_bytes` back from llama.cpp's rotary
    /// order into Hugging Face order (the frame holds whole heads). Never chosen by
    /// `--codec`: the writer makes these frames for `--link` only.
    Source {
        head_rows: u32,
        row_bytes: u32,
    },
    /// The float codec's fast setting (`--codec float-fast`), an encoder's choice only: its
    /// frames are `Float` frames, and stores record them so (`Codec::stored`). A plane
    /// other than the exponents is coded only where that halves it at least, and f32
    /// frames take the `F32` layout, whose sign-and-top-7 byte then stays raw: a plane
    /// that codes to more than 4 bits an element costs a table lookup for every 2.75
    /// elements or fewer, more decode time than its saved bytes take to read from a fast
    /// disk. Gemma 3's norm vectors: 0.405 of their size at 4.0 GB/s a core, against
    /// `Float`'s 0.376 at 2.8 (`sluiced bench-codec`); `--codec auto` weighs the two.
    /// Appended last: the manifest encodes variants by index.
    FloatFast,
}

impl Codec {
    /// The codec frames encoded with this one record: `FloatFast` frames are `Float`'s.
    pub fn stored(self) -> Codec {
        match self {
            Codec::FloatFast => Codec::Float,
            c => c,
        }
    }

    /// One of the float codec's settings.
    pub fn is_float(self) -> bool {
        matches!(self, Codec::Float | Codec::FloatFast)
    }
}

impl fmt::Display for Codec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Codec::None => f.write_str("none"),
            Codec::Lz4 => f.write_str("lz4"),
            Codec::Zstd { level } => write!(f, "zstd:{level}"),
            Codec::Float => f.write_str("float"),
            Codec::FloatFast => f.write_str("float-fast"),
            Codec::Source { head_rows: 0, .. } => f.write_str("link"),
            Codec::Source { .. } => f.write_str("link (rows in rotary order)"),
        }
    }
}

impl FromStr for Codec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Codec::None),
            "lz4" => Ok(Codec::Lz4),
            "zstd" => Ok(Codec::Zstd { level: 3 }),
            "float" => Ok(Codec::Float),
            "float-fast" => Ok(Codec::FloatFast),
            _ => {
                let level = s.strip_prefix("zstd:").ok_or_else(|| {
                    format!("unknown codec {s:?}: expected none, lz4, zstd, zstd:N, float, float-fast (or auto when packing)")
                })?;
                let level: i32 = level
                    .parse()
                    .map_err(|_| format!("codec {s:?}: zstd level {level:?} is not an integer"))?;
                if !(ZSTD_LEVEL_MIN..=ZSTD_LEVEL_MAX).contains(&level) {
                    return Err(format!(
                        "codec {s:?}: zstd level must be in {ZSTD_LEVEL_MIN}..={ZSTD_LEVEL_MAX}"
                    ));
                }
                Ok(Codec::Zstd { level })
            }
        }
    }
}

/// How one plane of a frame is stored.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plane {
    pub stored_len: u32,
    /// Coded with the frame's codec; otherwise the raw plane bytes.
    pub compressed: bool,
}

/// Why a frame failed to decode. The caller adds file, layer, frame and offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameFault {
    Checksum {
        expected: u64,
        found: u64,
    },
    Decompress(String),
    Length {
        expected: u64,
        found: u64,
    },
    /// The stored bytes could not be read (short file, EIO).
    Read(String),
}

impl fmt::Display for FrameFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameFault::Checksum { expected, found } => write!(
                f,
                "checksum mismatch (xxh3 expected {expected:016x}, found {found:016x}): the data on disk is corrupt"
            ),
            FrameFault::Decompress(msg) => write!(f, "decompression failed: {msg}"),
            FrameFault::Length { expected, found } => {
                write!(f, "length mismatch: expected {expected} bytes, got {found}")
            }
            FrameFault::Read(msg) => write!(f, "read failed: {msg}"),
        }
    }
}

/// Result of encoding one frame: the encoding to record and where its bytes are.
pub struct Encoded<'a> {
    pub codec: Codec,
    pub planes: Vec<Plane>,
    pub bytes: &'a [u8],
}

/// Reusable per-thread encoder state (packing only; not on the serving path).
pub struct FrameEncoder {
    codec: Codec,
    zstd: Option<zstd::bulk::Compressor<'static>>,
    plane: Vec<u8>,
    coded: Vec<u8>,
    out: Vec<u8>,
    /// The float codec's byte planes.
    float_planes: [Vec<u8>; float::PLANES_MAX],
    /// The store's shared codes a float plane may name (`set_shared`).
    shared: Vec<float::SharedEncoding>,
}

impl FrameEncoder {
    pub fn new(codec: Codec) -> std::io::Result<Self> {
        if let Codec::Source { .. } = codec {
            return Err(std::io::Error::other(
                "linked frames are the source's bytes: `pack --link` makes them, no encoder does",
            ));
        }
        let zstd = match codec {
            Codec::Zstd { level } => Some(zstd::bulk::Compressor::new(level)?),
            _ => None,
        };
        Ok(FrameEncoder {
            codec,
            zstd,
            plane: Vec::new(),
            coded: Vec::new(),
            out: Vec::new(),
            float_planes: Default::default(),
            shared: Vec::new(),
        })
    }

    /// The store's shared codes (`CodeCensus::codes`): a float plane names one where that
    /// takes fewer bytes than a code of its own.
    pub fn set_shared(&mut self, codes: &[float::SharedCode]) {
        self.shared = float::shared_encodings(codes);
    }

    /// Encodes `raw`, elements of `dtype`: with the float codec for a float dtype, else
    /// split into the dtype's byte planes (`DType::split_width`, 2 or 4 for floats).
    pub fn encode(&mut self, raw: &[u8], dtype: DType) -> std::io::Result<Encoded<'_>> {
        if self.codec.is_float() {
            return Ok(self.encode_float(raw, dtype, self.codec == Codec::FloatFast));
        }
        self.encode_split(raw, dtype.split_width())
    }

    /// The float codec: the exponent plane coded, then each byte plane of the rest coded
    /// where that saves `KEEP_RAW_SAVING_MIN` of it (the top mantissa byte of norm
    /// weights near 1 does; `fast`: half of it, `Codec::FloatFast`), else raw; the frame
    /// kept raw when the whole does not save that much or the dtype is not a float.
    fn encode_float(&mut self, raw: &[u8], dtype: DType, fast: bool) -> Encoded<'_> {
        let saving = if fast {
            FAST_SAVING_MIN
        } else {
            KEEP_RAW_SAVING_MIN
        };
        if let Some(l) =
            float_layout(dtype, raw, fast).filter(|l| raw.len().is_multiple_of(l.width()))
        {
            float::split(l, raw, &mut self.float_planes);
            self.out.clear();
            let mut planes = Vec::with_capacity(4);
            let mut exps_pay = true;
            for (i, p) in self.float_planes[..l.planes()].iter().enumerate() {
                float::encode_plane_with(l, i, p, &mut self.coded, &self.shared);
                // (The exponents, under the 3 % rule in either setting.)
                let need = if i == 0 { KEEP_RAW_SAVING_MIN } else { saving };
                let pays = (self.coded.len() as f64) <= (p.len() as f64) * (1.0 - need);
                // The exponent plane is always coded (it names the layout): where that
                // does not pay, neither does the codec.
                exps_pay &= i != 0 || pays;
                let coded = i == 0 || pays;
                let bytes: &[u8] = if coded { &self.coded } else { p };
                self.out.extend_from_slice(bytes);
                planes.push(Plane {
                    stored_len: bytes.len() as u32,
                    compressed: coded,
                });
            }
            if exps_pay && worth_keeping(self.out.len(), raw.len()) {
                return Encoded {
                    codec: Codec::Float,
                    planes,
                    bytes: &self.out,
                };
            }
        }
        self.out.clear();
        self.out.extend_from_slice(raw);
        Encoded {
            codec: Codec::None,
            planes: vec![Plane {
                stored_len: raw.len() as u32,
                compressed: false,
            }],
            bytes: &self.out,
        }
    }

    /// Encodes `raw`, split into `split_width` byte planes when that is 2 or 4.
    pub fn encode_split(&mut self, raw: &[u8], split_width: usize) -> std::io::Result<Encoded<'_>> {
        assert!(raw.len() <= u32::MAX as usize, "frame larger than 4 GiB");
        let raw_frame = |out: &mut Vec<u8>| {
            out.clear();
            out.extend_from_slice(raw);
            vec![Plane {
                stored_len: raw.len() as u32,
                compressed: false,
            }]
        };
        if self.codec == Codec::None {
            let planes = raw_frame(&mut self.out);
            return Ok(Encoded {
                codec: Codec::None,
                planes,
                bytes: &self.out,
            });
        }
        let width = if split_width > 1 && raw.len().is_multiple_of(split_width) {
            split_width
        } else {
            1
        };
        let plane_len = raw.len() / width;
        self.out.clear();
        let mut planes = Vec::with_capacity(width);
        for p in 0..width {
            let src: &[u8] = if width == 1 {
                raw
            } else {
                // Plane p holds byte (width-1-p) of every element: high bytes first.
                let byte = width - 1 - p;
                self.plane.clear();
                self.plane.extend(raw.iter().skip(byte).step_by(width));
                &self.plane
            };
            debug_assert_eq!(src.len(), plane_len);
            compress_into(self.codec, self.zstd.as_mut(), src, &mut self.coded)?;
            if worth_keeping(self.coded.len(), src.len()) {
                self.out.extend_from_slice(&self.coded);
                planes.push(Plane {
                    stored_len: self.coded.len() as u32,
                    compressed: true,
                });
            } else {
                self.out.extend_from_slice(src);
                planes.push(Plane {
                    stored_len: src.len() as u32,
                    compressed: false,
                });
            }
        }
        if !worth_keeping(self.out.len(), raw.len()) {
            let planes = raw_frame(&mut self.out);
            return Ok(Encoded {
                codec: Codec::None,
                planes,
                bytes: &self.out,
            });
        }
        Ok(Encoded {
            codec: self.codec,
            planes,
            bytes: &self.out,
        })
    }
}

fn worth_keeping(coded_len: usize, raw_len: usize) -> bool {
    (coded_len as f64) <= (raw_len as f64) * (1.0 - KEEP_RAW_SAVING_MIN)
}

fn compress_into(
    codec: Codec,
    zstd: Option<&mut zstd::bulk::Compressor<'static>>,
    src: &[u8],
    dst: &mut Vec<u8>,
) -> std::io::Result<()> {
    dst.clear();
    match (codec, zstd) {
        (Codec::Lz4, _) => {
            dst.resize(lz4_flex::block::get_maximum_output_size(src.len()), 0);
            let n = lz4_flex::block::compress_into(src, dst)
                .map_err(|e| std::io::Error::other(format!("lz4: {e}")))?;
            dst.truncate(n);
        }
        (Codec::Zstd { .. }, Some(z)) => {
            dst.reserve(zstd::zstd_safe::compress_bound(src.len()));
            z.compress_to_buffer(src, dst)?;
        }
        (codec, _) => unreachable!("compress_into called for {codec}"),
    }
    Ok(())
}

/// The share of a plane `Codec::FloatFast` codes only where coding saves (a plane of more
/// than 4 bits an element stays raw).
const FAST_SAVING_MIN: f64 = 0.5;

/// The float codec's layout for `raw`, elements of `dtype` (None: not a float it codes);
/// `fast`: `Codec::FloatFast`'s.
fn float_layout(dtype: DType, raw: &[u8], fast: bool) -> Option<Layout> {
    match dtype {
        DType::BF16 => Some(Layout::Bf16),
        DType::F16 => Some(Layout::F16Bits),
        DType::F32 if fast => Some(Layout::F32),
        DType::F32 => Some(float::f32_layout(raw, KEEP_RAW_SAVING_MIN)),
        _ => None,
    }
}

/// Float frames of at most this many bytes join the census of a store's shared codes:
/// below it a code of its own costs a frame about 1 % or more in header bytes, and its
/// tables take longer to build than its symbols to decode.
pub const SHARED_FRAME_BYTES_MAX: usize = 256 << 10;

/// The symbol counts of the small float frames of a store, per layout and plane, from
/// which `pack` makes the store's shared codes (`float::SharedCode`).
#[derive(Default)]
pub struct CodeCensus {
    /// Per (layout tag, plane): each frame's symbol counts (at most `CENSUS_FRAMES_MAX`;
    /// frames past them add to one already there).
    frames: BTreeMap<(u8, u8), Vec<[u64; 256]>>,
    layouts: BTreeMap<u8, Layout>,
    planes: [Vec<u8>; float::PLANES_MAX],
    /// Frames counted so far.
    added: usize,
    /// The float settings whose layouts frames are counted in.
    settings: CensusSettings,
}

/// Which float settings' layouts a census counts frames in (`CodeCensus::for_codec`).
#[derive(Default, Clone, Copy, PartialEq, Eq)]
enum CensusSettings {
    #[default]
    Float,
    FloatFast,
    /// Both (`--codec auto`): a frame whose two layouts differ is counted in each.
    Either,
}

/// Frames whose symbol counts the census keeps apart, per layout and plane.
const CENSUS_FRAMES_MAX: usize = 4096;

impl CodeCensus {
    /// A census of the frames of a store packed with `codec` (a float setting), or with
    /// `--codec auto` (None): frames counted as that setting lays them out, or as either.
    pub fn for_codec(codec: Option<Codec>) -> Self {
        let settings = match codec {
            None => CensusSettings::Either,
            Some(Codec::FloatFast) => CensusSettings::FloatFast,
            Some(_) => CensusSettings::Float,
        };
        CodeCensus {
            settings,
            ..CodeCensus::default()
        }
    }

    /// Counts the symbols of one frame (whole elements of `dtype`); frames of other
    /// dtypes, or larger than `SHARED_FRAME_BYTES_MAX`, are left out.
    pub fn add(&mut self, raw: &[u8], dtype: DType) {
        let (Some(l), Some(f)) = (
            float_layout(dtype, raw, false),
            float_layout(dtype, raw, true),
        ) else {
            return;
        };
        match self.settings {
            CensusSettings::Float => self.add_as(l, raw),
            CensusSettings::FloatFast => self.add_as(f, raw),
            CensusSettings::Either => {
                self.add_as(l, raw);
                if f != l {
                    self.add_as(f, raw);
                }
            }
        }
    }

    fn add_as(&mut self, l: Layout, raw: &[u8]) {
        if raw.is_empty()
            || raw.len() > SHARED_FRAME_BYTES_MAX
            || !raw.len().is_multiple_of(l.width())
        {
            return;
        }
        float::split(l, raw, &mut self.planes);
        self.layouts.insert(l.tag(), l);
        self.added += 1;
        for (i, p) in self.planes[..l.planes()].iter().enumerate() {
            let frames = self.frames.entry((l.tag(), i as u8)).or_default();
            let at = if frames.len() < CENSUS_FRAMES_MAX {
                frames.push([0; 256]);
                frames.len() - 1
            } else {
                self.added % CENSUS_FRAMES_MAX
            };
            for &b in p {
                frames[at][b as usize] += 1;
            }
        }
    }

    /// The codes of each plane (`float::shared_codes`), at most
    /// `float::SHARED_CODES_MAX` in all.
    pub fn codes(&self) -> Vec<float::SharedCode> {
        self.frames
            .iter()
            .filter_map(|(&(tag, plane), f)| {
                Some(float::shared_codes(
                    *self.layouts.get(&tag)?,
                    plane as usize,
                    f,
                ))
            })
            .flatten()
            .take(float::SHARED_CODES_MAX)
            .collect()
    }
}

/// Reusable per-thread decoder state: one scratch buffer for split planes, allocated once
/// at the frame size and reused for every frame.
pub struct FrameDecoder {
    scratch: Vec<u8>,
    /// The float codec's planes' last decoding tables (made at the first float frame).
    float_cache: [float::PlaneCache; float::PLANES_MAX],
    /// The store's shared codes' tables (`with_shared`; none by default).
    shared: Arc<float::SharedTables>,
    zstd: zstd::bulk::Decompressor<'static>,
}

/// Bytes a decoder's scratch has past the frame: the float codec decodes each coded plane
/// with 8 bytes of room after it.
const SCRATCH_PAD: usize = 64;

impl FrameDecoder {
    /// Host bytes one decoder holds beyond its frame-sized scratch, at most: the pad and
    /// the float codec's tables (the memory plan counts them per worker).
    pub const EXTRA_BYTES: u64 = (SCRATCH_PAD + float::PLANES_MAX * float::TABLES_BYTES) as u64;

    pub fn new(frame_size_max: usize) -> std::io::Result<Self> {
        Ok(FrameDecoder {
            scratch: vec![0; frame_size_max + SCRATCH_PAD],
            float_cache: Default::default(),
            shared: Arc::default(),
            zstd: zstd::bulk::Decompressor::new()?,
        })
    }

    /// This decoder with the tables of its store's shared codes (`Store::shared_tables`):
    /// a float plane that names one fails to decode without them.
    pub fn with_shared(mut self, shared: Arc<float::SharedTables>) -> Self {
        self.shared = shared;
        self
    }

    /// Decodes one frame from its stored bytes straight into `dst` (its final place in the
    /// layer's staging slot) and checks the checksum of the result.
    pub fn decode(
        &mut self,
        codec: Codec,
        planes: &[Plane],
        checksum: u64,
        stored: &[u8],
        dst: &mut [u8],
    ) -> Result<(), FrameFault> {
        let stored_total: u64 = planes.iter().map(|p| p.stored_len as u64).sum();
        if stored_total != stored.len() as u64 {
            return Err(FrameFault::Length {
                expected: stored_total,
                found: stored.len() as u64,
            });
        }
        if codec == Codec::Float {
            self.decode_float(planes, stored, dst)?;
            return check(checksum, dst);
        }
        if let Codec::Source {
            head_rows,
            row_bytes,
        } = codec
        {
            decode_source(planes, stored, dst, head_rows as usize, row_bytes as usize)?;
            return check(checksum, dst);
        }
        let width = planes.len();
        if width == 1 {
            let p = planes[0];
            if p.compressed {
                let n = decompress_into(codec, &mut self.zstd, stored, dst)?;
                if n != dst.len() {
                    return Err(FrameFault::Length {
                        expected: dst.len() as u64,
                        found: n as u64,
                    });
                }
            } else {
                if stored.len() != dst.len() {
                    return Err(FrameFault::Length {
                        expected: dst.len() as u64,
                        found: stored.len() as u64,
                    });
                }
                dst.copy_from_slice(stored);
            }
        } else {
            if !matches!(width, 2 | 4) || !dst.len().is_multiple_of(width) {
                return Err(FrameFault::Decompress(format!(
                    "{width} byte planes for a frame of {} bytes",
                    dst.len()
                )));
            }
            let plane_len = dst.len() / width;
            if self.scratch.len() < dst.len() {
                // Only reached when a caller sized the decoder below its frames; the memory
                // plan sizes it from the manifest's largest frame.
                self.scratch.resize(dst.len(), 0);
            }
            // Gather each plane's raw bytes: decompressed into scratch, or straight from the
            // stored bytes when the plane was kept raw.
            let mut sources: [(usize, bool); 4] = [(0, false); 4];
            let mut at = 0usize;
            for (i, p) in planes.iter().enumerate() {
                let s = &stored[at..at + p.stored_len as usize];
                if p.compressed {
                    let region = &mut self.scratch[i * plane_len..(i + 1) * plane_len];
                    let n = decompress_into(codec, &mut self.zstd, s, region)?;
                    if n != plane_len {
                        return Err(FrameFault::Length {
                            expected: plane_len as u64,
                            found: n as u64,
                        });
                    }
                    sources[i] = (i * plane_len, true);
                } else {
                    if s.len() != plane_len {
                        return Err(FrameFault::Length {
                            expected: plane_len as u64,
                            found: s.len() as u64,
                        });
                    }
                    sources[i] = (at, false);
                }
                at += p.stored_len as usize;
            }
            let plane = |i: usize| -> &[u8] {
                let (off, in_scratch) = sources[i];
                if in_scratch {
                    &self.scratch[off..off + plane_len]
                } else {
                    &stored[off..off + plane_len]
                }
            };
            if width == 2 {
                let (hi, lo) = (plane(0), plane(1));
                for ((out, &h), &l) in dst.chunks_exact_mut(2).zip(hi).zip(lo) {
                    out[0] = l;
                    out[1] = h;
                }
            } else {
                let (b3, b2, b1, b0) = (plane(0), plane(1), plane(2), plane(3));
                for (i, out) in dst.chunks_exact_mut(4).enumerate() {
                    out[0] = b0[i];
                    out[1] = b1[i];
                    out[2] = b2[i];
                    out[3] = b3[i];
                }
            }
        }
        check(checksum, dst)
    }
}

impl FrameDecoder {
    /// A float-codec frame into `dst`: each plane decoded (or taken raw), then joined.
    fn decode_float(
        &mut self,
        planes: &[Plane],
        stored: &[u8],
        dst: &mut [u8],
    ) -> Result<(), FrameFault> {
        let bad = |what: String| FrameFault::Decompress(format!("float codec: {what}"));
        let first = planes.first().ok_or_else(|| bad("no planes".into()))?;
        if !first.compressed {
            return Err(bad("the exponent plane is not coded".into()));
        }
        let layout = float::plane_layout(&stored[..first.stored_len as usize])
            .map_err(|e| bad(e.to_string()))?;
        let w = layout.width();
        if planes.len() != layout.planes() || !dst.len().is_multiple_of(w) {
            return Err(bad(format!(
                "{} planes for a frame of {} bytes of {layout:?}",
                planes.len(),
                dst.len()
            )));
        }
        let n = dst.len() / w;
        // Coded planes decode into the scratch, each with 8 bytes of room after it (an
        // f16 frame whose three planes are all coded needs more than a frame: the scratch
        // grows once then).
        let need: usize = (0..planes.len())
            .filter(|&i| planes[i].compressed)
            .map(|i| layout.plane_len(i, n) + 8)
            .sum();
        if self.scratch.len() < need {
            self.scratch.resize(need, 0);
        }
        let mut free: &mut [u8] = &mut self.scratch;
        let mut decoded: [&[u8]; float::PLANES_MAX] = [&[]; float::PLANES_MAX];
        let mut at = 0usize;
        for (i, p) in planes.iter().enumerate() {
            let bytes = &stored[at..at + p.stored_len as usize];
            let m = layout.plane_len(i, n);
            if p.compressed {
                let (mine, rest) = std::mem::take(&mut free).split_at_mut(m + 8);
                float::decode_plane_as(
                    bytes,
                    m,
                    mine,
                    &mut self.float_cache[i],
                    &self.shared,
                    float::Simd::Detect,
                )
                .map_err(|e| bad(e.to_string()))?;
                decoded[i] = &mine[..m];
                free = rest;
            } else if bytes.len() != m {
                return Err(FrameFault::Length {
                    expected: m as u64,
                    found: bytes.len() as u64,
                });
            } else {
                decoded[i] = bytes;
            }
            at += p.stored_len as usize;
        }
        float::join(layout, decoded, dst);
        Ok(())
    }
}

/// Checks a frame's raw bytes against its checksum (a frame read straight into its place
/// needs nothing else).
pub fn check(checksum: u64, raw: &[u8]) -> Result<(), FrameFault> {
    let found = xxh3_64(raw);
    if found != checksum {
        return Err(FrameFault::Checksum {
            expected: checksum,
            found,
        });
    }
    Ok(())
}

/// A linked frame (`Codec::Source`): the source's bytes, rows put back in order, and zeros
/// to the frame's end.
fn decode_source(
    planes: &[Plane],
    stored: &[u8],
    dst: &mut [u8],
    head_rows: usize,
    row_bytes: usize,
) -> Result<(), FrameFault> {
    let bad = |msg: String| Err(FrameFault::Decompress(msg));
    if !matches!(planes, [p] if !p.compressed) {
        return bad(format!("a linked frame of {} planes", planes.len()));
    }
    if stored.len() > dst.len() {
        return bad(format!(
            "a linked frame of {} source bytes for {} raw bytes",
            stored.len(),
            dst.len()
        ));
    }
    let (data, pad) = dst.split_at_mut(stored.len());
    pad.fill(0);
    if head_rows == 0 {
        data.copy_from_slice(stored);
        return Ok(());
    }
    let head = head_rows * row_bytes;
    if !head_rows.is_multiple_of(2) || head == 0 || !stored.len().is_multiple_of(head) {
        return bad(format!(
            "a linked frame of {} bytes is not whole heads of {head_rows} rows of {row_bytes} bytes",
            stored.len()
        ));
    }
    unpermute_rows(stored, data, head_rows, row_bytes);
    Ok(())
}

/// Heads of `head_rows` rows of `row_bytes` from llama.cpp's rotary order (a head's row
/// 2j + r) into Hugging Face's (row r x head_rows/2 + j): what llama.cpp's converter
/// permuted for llama q/k projections, undone. `src` and `dst` are whole heads.
pub fn unpermute_rows(src: &[u8], dst: &mut [u8], head_rows: usize, row_bytes: usize) {
    let half = head_rows / 2;
    let head = head_rows * row_bytes;
    for (s, d) in src.chunks_exact(head).zip(dst.chunks_exact_mut(head)) {
        for j in 0..half {
            for r in 0..2 {
                let from = (2 * j + r) * row_bytes;
                let to = (r * half + j) * row_bytes;
                d[to..to + row_bytes].copy_from_slice(&s[from..from + row_bytes]);
            }
        }
    }
}

fn decompress_into(
    codec: Codec,
    zstd: &mut zstd::bulk::Decompressor<'static>,
    src: &[u8],
    dst: &mut [u8],
) -> Result<usize, FrameFault> {
    match codec {
        Codec::Lz4 => lz4_flex::block::decompress_into(src, dst)
            .map_err(|e| FrameFault::Decompress(format!("lz4: {e}"))),
        Codec::Zstd { .. } => zstd
            .decompress_to_buffer(src, dst)
            .map_err(|e| FrameFault::Decompress(format!("zstd: {e}"))),
        Codec::None | Codec::Float | Codec::FloatFast | Codec::Source { .. } => {
            Err(FrameFault::Decompress(format!(
                "a byte plane marked compressed in a frame stored with codec {codec}"
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floats_f32(n: usize) -> Vec<u8> {
        // Pseudo-random small values like trained weights: clustered exponents, noisy
        // mantissas (a sum of uniforms is roughly normal).
        let mut rng = crate::util::rng::Rng::new(0x2545F4914F6CDD1D);
        let mut uniform = move || rng.unit_f64() as f32;
        (0..n)
            .flat_map(|_| ((uniform() + uniform() + uniform() - 1.5) * 0.05).to_le_bytes())
            .collect()
    }

    #[test]
    fn every_codec_and_split_width_round_trips() {
        let raw = floats_f32(16 * 1024);
        for codec in [
            Codec::None,
            Codec::Lz4,
            Codec::Zstd { level: 1 },
            Codec::Zstd { level: 3 },
        ] {
            for width in [1, 2, 4] {
                let mut enc = FrameEncoder::new(codec).expect("test setup");
                let e = enc.encode_split(&raw, width).expect("test setup");
                let (c, planes, stored) = (e.codec, e.planes.clone(), e.bytes.to_vec());
                let mut dec = FrameDecoder::new(raw.len()).expect("test setup");
                let mut out = vec![0u8; raw.len()];
                dec.decode(c, &planes, xxh3_64(&raw), &stored, &mut out)
                    .expect("test setup");
                assert_eq!(out, raw, "codec {codec} width {width}");
            }
        }
    }

    /// Bytes of `n` elements of a float dtype like trained weights, with the special
    /// values among them: zeros of both signs, denormals, infinities, NaNs with payloads.
    fn weights_of(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
        let specials: [u32; 8] = [
            0x0000_0000,
            0x8000_0000,
            0x0000_0001,
            0x8040_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_1234,
            0xff81_0000,
        ];
        let mut rng = crate::util::rng::Rng::new(seed);
        let mut next = move || rng.next_u64();
        let vals: Vec<u32> = (0..n)
            .map(|i| {
                let r = next();
                if i % 7 == 3 {
                    specials[(r % 8) as usize]
                } else {
                    (((r >> 11) as f32 / (1u64 << 53) as f32 - 0.5) * 0.05).to_bits()
                }
            })
            .collect();
        match dtype {
            DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
            DType::BF16 => vals
                .iter()
                .flat_map(|v| ((v >> 16) as u16).to_le_bytes())
                .collect(),
            DType::F16 => vals
                .iter()
                .flat_map(|v| {
                    half::f16::from_bits((v >> 16) as u16)
                        .to_bits()
                        .to_le_bytes()
                })
                .collect(),
            _ => (0..n * dtype.block_bytes() as usize / dtype.block_elems() as usize)
                .map(|_| next() as u8)
                .collect(),
        }
    }

    #[test]
    fn every_dtype_codec_and_frame_size_round_trips() {
        let codecs = [
            Codec::None,
            Codec::Lz4,
            Codec::Zstd { level: 1 },
            Codec::Zstd { level: 3 },
            Codec::Float,
            Codec::FloatFast,
        ];
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::Q8_0, DType::Q4K] {
            let per = dtype.block_elems() as usize;
            for elems in [1usize, 2, 3, 5, 64, 1000, 4096, 65536] {
                let n = elems.div_ceil(per) * per;
                let raw = weights_of(dtype, n, elems as u64);
                for codec in codecs {
                    let mut enc = FrameEncoder::new(codec).expect("test setup");
                    let e = enc.encode(&raw, dtype).expect("encodes");
                    let (c, planes, stored) = (e.codec, e.planes.clone(), e.bytes.to_vec());
                    let mut dec = FrameDecoder::new(raw.len()).expect("test setup");
                    let mut out = vec![0u8; raw.len()];
                    dec.decode(c, &planes, xxh3_64(&raw), &stored, &mut out)
                        .unwrap_or_else(|e| panic!("{dtype:?} x {n} {codec}: {e}"));
                    assert_eq!(out, raw, "{dtype:?} x {n} with {codec}");
                    if codec.is_float() && dtype.split_width() > 1 && n >= 4096 {
                        assert_eq!(c, Codec::Float, "{dtype:?} x {n}: the float codec pays");
                    }
                    // Frames record what decodes them: float-fast's are float frames.
                    assert_ne!(c, Codec::FloatFast);
                }
            }
        }
        // Every element with one exponent, and all-zero frames.
        let same: Vec<u8> = (0..4096u32)
            .flat_map(|i| (0x3f80_0000u32 | (i * 2654435761) & 0x807f_ffff).to_le_bytes())
            .collect();
        for raw in [same, vec![0u8; 8192]] {
            let mut enc = FrameEncoder::new(Codec::Float).expect("test setup");
            let e = enc.encode(&raw, DType::F32).expect("encodes");
            let (c, planes, stored) = (e.codec, e.planes.clone(), e.bytes.to_vec());
            let mut dec = FrameDecoder::new(raw.len()).expect("test setup");
            let mut out = vec![0u8; raw.len()];
            dec.decode(c, &planes, xxh3_64(&raw), &stored, &mut out)
                .expect("decodes");
            assert_eq!(out, raw);
        }
    }

    /// f16 frames written before format 7 (sign and exponent as one symbol, the top
    /// mantissa bits packed four a byte) still decode; new ones use the bit planes.
    #[test]
    fn f16_frames_of_both_layouts_decode() {
        let raw = weights_of(DType::F16, 4099, 7);
        let mut enc = FrameEncoder::new(Codec::Float).expect("test setup");
        let e = enc.encode(&raw, DType::F16).expect("encodes");
        assert_eq!(e.codec, Codec::Float);
        assert_eq!(
            float::plane_layout(&e.bytes[..e.planes[0].stored_len as usize]),
            Ok(float::Layout::F16Bits)
        );
        let mut planes: [Vec<u8>; float::PLANES_MAX] = Default::default();
        float::split(float::Layout::F16, &raw, &mut planes);
        let mut stored = Vec::new();
        float::encode_plane(float::Layout::F16, &planes[0], &mut stored);
        let mut frame = vec![Plane {
            stored_len: stored.len() as u32,
            compressed: true,
        }];
        for p in &planes[1..3] {
            stored.extend_from_slice(p);
            frame.push(Plane {
                stored_len: p.len() as u32,
                compressed: false,
            });
        }
        let mut dec = FrameDecoder::new(raw.len()).expect("test setup");
        let mut out = vec![0u8; raw.len()];
        dec.decode(Codec::Float, &frame, xxh3_64(&raw), &stored, &mut out)
            .expect("the format 6 layout decodes");
        assert_eq!(out, raw);
    }

    #[test]
    fn split_planes_compress_floats_better_than_whole_frames() {
        let raw = floats_f32(64 * 1024);
        let mut enc = FrameEncoder::new(Codec::Zstd { level: 1 }).expect("test setup");
        let whole = enc.encode_split(&raw, 1).expect("test setup").bytes.len();
        let split = enc.encode_split(&raw, 4).expect("test setup").bytes.len();
        assert!(split < whole, "split {split} >= whole {whole}");
    }

    #[test]
    fn incompressible_frames_are_kept_raw() {
        // Pseudo-random noise does not compress: the frame must be stored raw, codec none.
        let mut rng = crate::util::rng::Rng::new(0x9E3779B97F4A7C15);
        let raw: Vec<u8> = (0..65536).map(|_| rng.next_u64() as u8).collect();
        let mut enc = FrameEncoder::new(Codec::Zstd { level: 3 }).expect("test setup");
        let e = enc.encode_split(&raw, 1).expect("test setup");
        assert_eq!(e.codec, Codec::None);
        assert_eq!(
            e.planes,
            vec![Plane {
                stored_len: 65536,
                compressed: false
            }]
        );
        assert_eq!(e.bytes, &raw[..]);
    }

    /// f32 norm weights as a GGUF holds them: near 1, bf16 precision (`floats_f32`'s
    /// values, spread six times wider around 1).
    fn norm_frame(n: usize) -> Vec<u8> {
        floats_f32(n)
            .chunks_exact(4)
            .flat_map(|b| {
                let v = 1.0 + f32::from_le_bytes(crate::util::array(b)) * 6.0;
                (v.to_bits() & 0xffff_0000).to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn float_fast_keeps_norm_vectors_sign_and_top_byte_raw_and_writes_float_frames() {
        assert_eq!("float-fast".parse::<Codec>(), Ok(Codec::FloatFast));
        assert_eq!(Codec::FloatFast.to_string(), "float-fast");
        assert_eq!(Codec::FloatFast.stored(), Codec::Float);
        // Norm vectors as in the test below: `float` takes the top split, whose 4-bit
        // top symbols code to about 3 bits (several lookups' worth an element); the fast
        // setting takes `F32`, codes the exponents and keeps the sign-and-top-7 byte
        // (about 6.5 bits coded: less than half saved) raw.
        for n in [256usize, 576, 4099] {
            let raw = norm_frame(n);
            let size = |codec: Codec| -> usize {
                let mut enc = FrameEncoder::new(codec).expect("test setup");
                enc.encode(&raw, DType::F32).expect("encodes").bytes.len()
            };
            let mut enc = FrameEncoder::new(Codec::FloatFast).expect("test setup");
            let e = enc.encode(&raw, DType::F32).expect("encodes");
            let (c, planes, stored) = (e.codec, e.planes.clone(), e.bytes.to_vec());
            assert_eq!(c, Codec::Float, "{n}");
            assert_eq!(planes.len(), 4, "{n}");
            let exps = &stored[..planes[0].stored_len as usize];
            assert_eq!(float::plane_layout(exps), Ok(Layout::F32));
            assert!(
                planes[0].compressed && !planes[3].compressed,
                "{n}: {planes:?}"
            );
            let mut dec = FrameDecoder::new(raw.len()).expect("test setup");
            let mut out = vec![0u8; raw.len()];
            dec.decode(c, &planes, xxh3_64(&raw), &stored, &mut out)
                .expect("decodes");
            assert_eq!(out, raw, "{n}");
            let (float, fast) = (size(Codec::Float), stored.len());
            assert!(
                float < fast && fast < raw.len(),
                "{n}: float {float}, fast {fast}"
            );
        }
    }

    #[test]
    fn norm_vectors_take_the_top_split_and_a_flipped_byte_is_caught() {
        for n in [256usize, 576, 4099] {
            let raw = norm_frame(n);
            let mut enc = FrameEncoder::new(Codec::Float).expect("test setup");
            let e = enc.encode(&raw, DType::F32).expect("test setup");
            let (c, planes, stored) = (e.codec, e.planes.clone(), e.bytes.to_vec());
            assert_eq!(c, Codec::Float);
            assert_eq!(planes.len(), 5, "{n}");
            let exps = &stored[..planes[0].stored_len as usize];
            assert_eq!(float::plane_layout(exps), Ok(Layout::F32Top));
            let mut dec = FrameDecoder::new(raw.len()).expect("test setup");
            let mut out = vec![0u8; raw.len()];
            dec.decode(c, &planes, xxh3_64(&raw), &stored, &mut out)
                .expect("decodes");
            assert_eq!(out, raw, "{n}");
            // A flip in a stream's padding bits decodes to the same bytes; every other
            // one is an error, never wrong data.
            let mut caught = 0;
            for pos in 0..stored.len() {
                let mut bad = stored.clone();
                bad[pos] ^= 0x20;
                match dec.decode(c, &planes, xxh3_64(&raw), &bad, &mut out) {
                    Err(_) => caught += 1,
                    Ok(()) => assert_eq!(out, raw, "{n}: flip at {pos} decoded wrong data"),
                }
            }
            assert!(
                caught * 100 >= stored.len() * 95,
                "{n}: {caught} of {} flips caught",
                stored.len()
            );
        }
        // Trained weights keep the four planes of F32.
        let raw = floats_f32(4096);
        let mut enc = FrameEncoder::new(Codec::Float).expect("test setup");
        assert_eq!(
            enc.encode(&raw, DType::F32)
                .expect("test setup")
                .planes
                .len(),
            4
        );
    }

    #[test]
    fn a_flipped_byte_is_a_checksum_or_decompress_fault_never_wrong_data() {
        let raw = floats_f32(4096);
        for codec in [
            Codec::None,
            Codec::Lz4,
            Codec::Zstd { level: 3 },
            Codec::Float,
        ] {
            let mut enc = FrameEncoder::new(codec).expect("test setup");
            let e = enc.encode(&raw, DType::F32).expect("test setup");
            let (c, planes, stored) = (e.codec, e.planes.clone(), e.bytes.to_vec());
            let mut dec = FrameDecoder::new(raw.len()).expect("test setup");
            for pos in (0..stored.len()).step_by(97) {
                let mut bad = stored.clone();
                bad[pos] ^= 0x20;
                let mut out = vec![0u8; raw.len()];
                let r = dec.decode(c, &planes, xxh3_64(&raw), &bad, &mut out);
                assert!(r.is_err(), "codec {codec}: flip at {pos} went unnoticed");
            }
        }
    }

    #[test]
    fn codec_names_parse_and_print() {
        for s in ["none", "lz4", "zstd:1", "zstd:19", "zstd:-3", "float"] {
            assert_eq!(s.parse::<Codec>().expect("test setup").to_string(), s);
        }
        assert_eq!(
            "zstd".parse::<Codec>().expect("test setup"),
            Codec::Zstd { level: 3 }
        );
        assert!("zstd:99".parse::<Codec>().is_err());
        assert!("brotli"
            .parse::<Codec>()
            .unwrap_err()
            .contains("unknown codec"));
    }

    /// A linked frame decodes to the source's bytes, its rows put back in Hugging Face
    /// order where llama.cpp permuted them (the reference: the permutation written out
    /// from its definition, row (h, 2j + r) holds row (h, r x d/2 + j)), and zeros after;
    /// a frame not of whole heads, longer than its place or flipped is an error.
    #[test]
    fn linked_frames_unpermute_whole_heads_and_zero_their_padding() {
        let (heads, d, row) = (3usize, 8usize, 12usize);
        let src: Vec<u8> = (0..heads * d * row).map(|i| (i * 31 % 253) as u8).collect();
        let mut want = vec![0u8; src.len() + 100];
        for h in 0..heads {
            for j in 0..d / 2 {
                for r in 0..2 {
                    let from = (h * d + 2 * j + r) * row;
                    let to = (h * d + r * (d / 2) + j) * row;
                    want[to..to + row].copy_from_slice(&src[from..from + row]);
                }
            }
        }
        let planes = [Plane {
            stored_len: src.len() as u32,
            compressed: false,
        }];
        let codec = Codec::Source {
            head_rows: d as u32,
            row_bytes: row as u32,
        };
        let mut dec = FrameDecoder::new(want.len()).expect("test setup");
        let mut out = vec![0xAAu8; want.len()];
        dec.decode(codec, &planes, xxh3_64(&want), &src, &mut out)
            .expect("decodes");
        assert_eq!(out, want);
        // As they are: a copy and zeros.
        let plain = Codec::Source {
            head_rows: 0,
            row_bytes: 0,
        };
        let mut as_is = src.clone();
        as_is.resize(want.len(), 0);
        out.fill(0xAA);
        dec.decode(plain, &planes, xxh3_64(&as_is), &src, &mut out)
            .expect("decodes");
        assert_eq!(out, as_is);
        // Half a head; more bytes than the frame; a flipped byte.
        let half = [Plane {
            stored_len: (d / 2 * row) as u32,
            compressed: false,
        }];
        let e = dec
            .decode(codec, &half, 0, &src[..d / 2 * row], &mut out)
            .expect_err("half a head");
        assert!(e.to_string().contains("whole heads"), "{e}");
        assert!(dec.decode(plain, &planes, 0, &src, &mut out[..10]).is_err());
        let mut bad = src.clone();
        bad[5] ^= 1;
        let e = dec
            .decode(codec, &planes, xxh3_64(&want), &bad, &mut out)
            .expect_err("flipped");
        assert!(matches!(e, FrameFault::Checksum { .. }), "{e}");
        // Nothing encodes them.
        assert!(FrameEncoder::new(codec).is_err());
        assert!("link".parse::<Codec>().is_err());
    }
}
