//! The float layouts: which bits of an element go to which byte plane (`Layout`), and a
//! frame split into its planes (`split`). Joining them back is `join.rs`'s.
//!
//! Layouts (the element's bits → planes; `Layout::plane_len`):
//! - bf16: exponent = bits 7..15 (8 bits); sign << 7 | mantissa (7 bits).
//! - f16 (`F16Bits`, what the encoder writes): the exponent (bits 10..15, 5 bits); the
//!   mantissa's low byte; then the sign and the mantissa's top two bits as bit planes, in
//!   chunks of 32 elements: per chunk, g = ceil(elements / 8) bytes of signs, g of bit 9, g
//!   of bit 8 (element j of the chunk at bit j % 8 of byte j / 8; g is 4 but in a frame's
//!   last chunk). Exponent-only symbols carry about 2.6 bits each, so a table lookup
//!   decodes as many of them as bf16's, and the bit planes join in a few vector ops.
//! - f16 (`F16`, format 6 and earlier; still read): sign << 5 | exponent (6 bits); the
//!   mantissa's low byte; its top two bits, four elements a byte (element i at bits
//!   2 (i % 4)).
//! - f32 (`F32`): exponent = bits 23..31; then sign << 23 | mantissa (23 bits) as three
//!   planes, low byte first.
//! - f32 (`F32Top`, format 9, for frames whose mantissa top is skewed: norm vectors near
//!   a centre): the exponent; sign << 3 | the mantissa's top 3 bits (4-bit symbols, about
//!   2.5 bits of information in a norm vector, so a lookup decodes several); its next 4
//!   bits, two elements a byte (element i at bits 4 (i % 2)); its middle byte; its low
//!   byte. `F32`'s sign-and-top-7 byte of such frames codes to about 6.5 bits, a symbol a
//!   lookup; here it costs about 0.2 bits an element more and half the lookups
//!   (`f32_layout` chooses).

/// How a frame's elements split into an exponent symbol and the rest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Bf16,
    F16,
    F32,
    F16Bits,
    F32Top,
}

/// Planes of a frame at most (`F32Top`'s).
pub const PLANES_MAX: usize = 5;

impl Layout {
    pub fn tag(self) -> u8 {
        match self {
            Layout::Bf16 => 1,
            Layout::F16 => 2,
            Layout::F32 => 3,
            Layout::F16Bits => 4,
            Layout::F32Top => 5,
        }
    }

    #[inline]
    pub(super) fn from_tag(t: u8) -> Option<Layout> {
        match t {
            1 => Some(Layout::Bf16),
            2 => Some(Layout::F16),
            3 => Some(Layout::F32),
            4 => Some(Layout::F16Bits),
            5 => Some(Layout::F32Top),
            _ => None,
        }
    }

    /// Bytes of one element.
    pub fn width(self) -> usize {
        match self {
            Layout::Bf16 | Layout::F16 | Layout::F16Bits => 2,
            Layout::F32 | Layout::F32Top => 4,
        }
    }

    /// Byte planes of a frame (the exponents' and the rest's).
    pub fn planes(self) -> usize {
        match self {
            Layout::Bf16 => 2,
            Layout::F16 | Layout::F16Bits => 3,
            Layout::F32 => 4,
            Layout::F32Top => 5,
        }
    }

    /// The layouts a float-codec frame of `planes` planes may have (the coded exponent
    /// plane's first byte says which).
    pub fn with_planes(planes: usize) -> &'static [Layout] {
        match planes {
            2 => &[Layout::Bf16],
            3 => &[Layout::F16Bits, Layout::F16],
            4 => &[Layout::F32],
            5 => &[Layout::F32Top],
            _ => &[],
        }
    }

    /// Bytes of plane `i` of a frame of `n` elements.
    pub fn plane_len(self, i: usize, n: usize) -> usize {
        match (self, i) {
            (Layout::F16, 2) => n.div_ceil(4),
            (Layout::F16Bits, 2) => 3 * n.div_ceil(8),
            (Layout::F32Top, 2) => n.div_ceil(2),
            _ => n,
        }
    }
}

/// `F16Bits`: elements a chunk of the bit planes, and its bytes when whole.
pub(super) const BITS_CHUNK: usize = 32;
pub(super) const BITS_CHUNK_BYTES: usize = 3 * BITS_CHUNK / 8;

/// `F16Bits`: where element `i` of `n` sits in the bit planes: the byte of its sign (bit 9
/// is `g` bytes on, bit 8 `2g`), `g`, and its bit.
#[inline(always)]
pub(super) fn bits_at(i: usize, n: usize) -> (usize, usize, u32) {
    let (c, j) = (i / BITS_CHUNK, i % BITS_CHUNK);
    let g = (n - c * BITS_CHUNK).min(BITS_CHUNK).div_ceil(8);
    (c * BITS_CHUNK_BYTES + j / 8, g, (j % 8) as u32)
}

/// Splits `raw` (whole elements of `layout`) into its byte planes: `planes[0]` the
/// exponent symbols, then the rest's (the module's layouts).
pub fn split(layout: Layout, raw: &[u8], planes: &mut [Vec<u8>; PLANES_MAX]) {
    planes.iter_mut().for_each(Vec::clear);
    let [e, r0, r1, r2, r3] = planes;
    match layout {
        Layout::Bf16 => {
            for x in raw.chunks_exact(2) {
                let v = u16::from_le_bytes([x[0], x[1]]);
                e.push((v >> 7) as u8);
                r0.push(((v >> 8) as u8 & 0x80) | (v as u8 & 0x7f));
            }
        }
        Layout::F16 => {
            for (i, x) in raw.chunks_exact(2).enumerate() {
                e.push(x[1] >> 2);
                r0.push(x[0]);
                if i % 4 == 0 {
                    r1.push(0);
                }
                if let Some(top) = r1.last_mut() {
                    *top |= (x[1] & 3) << (2 * (i % 4));
                }
            }
        }
        Layout::F16Bits => {
            let n = raw.len() / 2;
            r1.resize(Layout::F16Bits.plane_len(2, n), 0);
            for (i, x) in raw.chunks_exact(2).enumerate() {
                e.push((x[1] >> 2) & 0x1f);
                r0.push(x[0]);
                let (at, g, bit) = bits_at(i, n);
                r1[at] |= (x[1] >> 7) << bit;
                r1[at + g] |= ((x[1] >> 1) & 1) << bit;
                r1[at + 2 * g] |= (x[1] & 1) << bit;
            }
        }
        Layout::F32 => {
            for x in raw.chunks_exact(4) {
                let v = u32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                e.push((v >> 23) as u8);
                r0.push(v as u8);
                r1.push((v >> 8) as u8);
                r2.push(((v >> 24) as u8 & 0x80) | ((v >> 16) as u8 & 0x7f));
            }
        }
        Layout::F32Top => {
            for (i, x) in raw.chunks_exact(4).enumerate() {
                let v = u32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                e.push((v >> 23) as u8);
                r0.push(((v >> 28) as u8 & 8) | ((v >> 20) as u8 & 7));
                let nibble = (v >> 16) as u8 & 0xf;
                if i % 2 == 0 {
                    r1.push(nibble);
                } else if let Some(pair) = r1.last_mut() {
                    *pair |= nibble << 4;
                }
                r2.push((v >> 8) as u8);
                r3.push(v as u8);
            }
        }
    }
}

/// The layout of an f32 frame: `F32Top` where its top symbol and 4 raw bits code (save
/// `keep_raw_saving` of a byte, the share a coded plane must save) and cost within half a
/// bit an element of the sign-and-top-7 byte's own code, else `F32`. Entropies of the
/// frame's own histogram; the same bytes always give the same layout (pack's census and
/// its encoder agree).
pub fn f32_layout(raw: &[u8], keep_raw_saving: f64) -> Layout {
    let mut hist = [0u32; 256];
    for x in raw.chunks_exact(4) {
        hist[((x[3] & 0x80) | (x[2] & 0x7f)) as usize] += 1;
    }
    let n = raw.len() / 4;
    if n == 0 {
        return Layout::F32;
    }
    let entropy = |counts: &mut dyn Iterator<Item = u32>| -> f64 {
        counts
            .filter(|&c| c > 0)
            .map(|c| {
                let p = c as f64 / n as f64;
                -p * p.log2()
            })
            .sum()
    };
    let byte = entropy(&mut hist.iter().copied());
    let top = entropy(&mut hist.chunks_exact(16).map(|c| c.iter().sum()));
    let pays = top + 4.0 <= 8.0 * (1.0 - keep_raw_saving) && top + 4.0 <= byte + 0.5;
    if pays {
        Layout::F32Top
    } else {
        Layout::F32
    }
}
