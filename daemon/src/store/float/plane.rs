//! A coded plane's bytes: its mode (`PlaneMode`), the four streams its symbols are cut
//! into, and what each mode costs in bytes (the encoder's choice, and the shared codes'
//! census, weigh the same sums).
//!
//! A coded plane's stored bytes: a layout byte (`Layout::tag`), a mode byte, then
//! - `Huffman` (0): the number of symbols used (u16), their (symbol, length) pairs, the
//!   byte lengths of the first three streams (u32 each; the fourth runs to the end) and
//!   the streams;
//! - `Constant` (1): every element has one symbol, the next byte;
//! - `Shared` (2, format 8): names one of the store's shared codes instead of carrying
//!   its own (`SharedCode`): the code's index (u8), the first three streams' byte lengths
//!   as LEB128 varints, and the streams;
//! - `Sparse` (3, format 10): a base symbol and the exceptions to it (`sparse_bytes`),
//!   where that is no larger than the Huffman code.
//!
//! Stream s codes elements [s * q, min((s + 1) * q, n)) with q = ceil(n / 4), LSB first.

use super::error::FloatError;

/// Streams a coded plane's symbols are cut into (their lookups overlap).
pub(super) const STREAMS: usize = 4;

/// How a coded plane stores its symbols: its second byte, these numbers on disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum PlaneMode {
    /// A canonical Huffman code of the plane's own, its (symbol, length) table in the
    /// plane's header.
    Huffman = 0,
    /// Every element is one symbol.
    Constant = 1,
    /// One of the store's shared codes, named by its index (format 8).
    Shared = 2,
    /// A base symbol and the exceptions to it (format 10).
    Sparse = 3,
}

impl TryFrom<u8> for PlaneMode {
    type Error = FloatError;

    #[inline]
    fn try_from(mode: u8) -> Result<PlaneMode, FloatError> {
        match mode {
            0 => Ok(PlaneMode::Huffman),
            1 => Ok(PlaneMode::Constant),
            2 => Ok(PlaneMode::Shared),
            3 => Ok(PlaneMode::Sparse),
            _ => Err(FloatError::UnknownMode { mode }),
        }
    }
}

/// A plane takes a code of its own over a shared one only when that saves more than this
/// many bytes: its decoder then builds the code's tables first, which takes as long as
/// decoding a few thousand symbols (64 bytes are 9 ns of a 7 GB/s disk; a table build
/// is 2-4 us of a core).
pub(super) const OWN_CODE_SAVING_MIN: u64 = 64;

/// A sparse plane's (`PlaneMode::Sparse`) gap byte that only skips: this many elements of the base
/// symbol, and no exception after them.
pub(super) const SPARSE_SKIP: usize = 255;

/// A plane's bytes in `PlaneMode::Sparse`: the mode, the base symbol, then per element that is
/// not the base (an exception) the count of base elements before it since the last one (a
/// byte below `SPARSE_SKIP`, after as many `SPARSE_SKIP` bytes as it takes) and its
/// symbol. A plane of few exceptions (the low mantissa bytes of f32 norms made from bf16
/// ones: a few percent of their elements have any) costs about two bytes an exception,
/// under the bit a Huffman code spends on every element, and decodes as a fill and a
/// scatter.
pub(super) fn sparse_bytes(exps: &[u8], base: u8) -> u64 {
    let (mut bytes, mut next) = (2u64, 0usize);
    for (i, _) in exps.iter().enumerate().filter(|&(_, &e)| e != base) {
        bytes += 2 + ((i - next) / SPARSE_SKIP) as u64;
        next = i + 1;
    }
    bytes
}

/// A plane's bytes with a code of its own, `bits` of symbols: the mode, the symbol count
/// and table (2 bytes a symbol), the fixed stream sizes and the streams.
pub(super) fn own_code_bytes(used: u64, bits: u64) -> u64 {
    1 + 2 + 2 * used + 4 * (STREAMS as u64 - 1) + bits.div_ceil(8)
}

/// A plane's bytes naming a shared code, `bits` of symbols: the mode, the code's index,
/// three varint stream sizes (about two bytes each) and the streams.
pub(super) fn shared_code_bytes(bits: u64) -> u64 {
    2 + 2 * (STREAMS as u64 - 1) + bits.div_ceil(8)
}

/// `v` as a LEB128 varint onto `out`.
pub(super) fn put_varint(out: &mut Vec<u8>, mut v: u32) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A LEB128 u32 at `buf[*at..]`, moving `at` past it; None when cut short or too long.
#[inline]
pub(super) fn take_varint(buf: &[u8], at: &mut usize) -> Option<u32> {
    let mut v = 0u64;
    for shift in (0..35).step_by(7) {
        let b = *buf.get(*at)?;
        *at += 1;
        v |= ((b & 0x7f) as u64) << shift;
        if b & 0x80 == 0 {
            return u32::try_from(v).ok();
        }
    }
    None
}
