//! The `float` codec: a float frame split into byte planes, its exponents in one, the
//! planes entropy-coded with a length-limited canonical Huffman code in four interleaved
//! streams where that pays, the rest (sign and mantissa, nearly random in trained
//! weights) kept raw otherwise.
//!
//! Why: a bf16 weight's 8 exponent bits carry about 2.6 bits of information and its sign
//! and mantissa nearly 8. zstd and lz4 spend their time looking for matches that are not
//! there; the plain byte split cuts bf16's exponent in two (the high byte holds the sign
//! and 7 exponent bits, the low byte the last one). Here each element's exponent goes to
//! one plane and its sign and mantissa to the other; the decoder's work is one table
//! lookup per element, four streams at a time so their lookups overlap, the element put
//! back together as it is written.
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
//!
//! A coded plane's stored bytes: a layout byte, a mode byte (0: Huffman; 1: every
//! element has one exponent, the next byte), then for Huffman the number of symbols used
//! (u16), their (symbol, length) pairs, the byte lengths of the first three streams (u32
//! each; the fourth runs to the end) and the streams; mode 2 (format 8) names one of the
//! store's shared codes instead of carrying its own (`SharedCode`): the code's index
//! (u8), the first three streams' byte lengths as LEB128 varints, and the streams; mode 3
//! (format 10) is a sparse plane, a base symbol and the exceptions to it
//! (`sparse_bytes`), where that is no larger than the Huffman code.
//! Stream s codes elements [s * q, min((s + 1) * q, n)) with q = ceil(n / 4), LSB first.
//! Every read is bounds checked and a stream decodes exactly its element count whatever
//! its bytes, so damaged input decodes to wrong bytes (which the frame checksum catches)
//! and never past a buffer.

use serde::{Deserialize, Serialize};

/// The longest code: the decoding table has 2^11 entries (4 KiB, in L1).
const MAX_LEN: u32 = 11;
const TABLE: usize = 1 << MAX_LEN;
const STREAMS: usize = 4;

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

    fn from_tag(t: u8) -> Option<Layout> {
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
const BITS_CHUNK: usize = 32;
const BITS_CHUNK_BYTES: usize = 3 * BITS_CHUNK / 8;

/// `F16Bits`: where element `i` of `n` sits in the bit planes: the byte of its sign (bit 9
/// is `g` bytes on, bit 8 `2g`), `g`, and its bit.
#[inline(always)]
fn bits_at(i: usize, n: usize) -> (usize, usize, u32) {
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

/// The elements of `layout` from their planes (as `split` makes them) into `dst`.
pub fn join(layout: Layout, planes: [&[u8]; PLANES_MAX], dst: &mut [u8]) {
    join_as(layout, planes, dst, Simd::Detect)
}

/// `join`, choosing the code path.
pub fn join_as(layout: Layout, planes: [&[u8]; PLANES_MAX], dst: &mut [u8], simd: Simd) {
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Detect && std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        unsafe { join_avx2(layout, planes, dst) };
        return;
    }
    join_any(layout, planes, dst);
}

/// `join` compiled for AVX2 (32-byte vectors where the portable build has 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn join_avx2(layout: Layout, planes: [&[u8]; PLANES_MAX], dst: &mut [u8]) {
    fn from(p: &[u8], at: usize) -> &[u8] {
        &p[at.min(p.len())..]
    }
    match layout {
        Layout::F16Bits => {
            // SAFETY: this function's contract (AVX2).
            let done = unsafe { f16_bits_avx2(planes, dst) };
            f16_bits_from(done, planes, dst);
        }
        Layout::F32 => {
            // SAFETY: this function's contract (AVX2).
            let done = unsafe { f32_avx2(planes, dst) };
            join_any(layout, planes.map(|p| from(p, done)), &mut dst[4 * done..]);
        }
        Layout::F32Top => {
            // SAFETY: this function's contract (AVX2).
            let done = unsafe { f32_top_avx2(planes, dst) };
            // (done is a multiple of 32: the nibble plane's byte done / 2 starts an element.)
            let [e, r0, r1, r2, r3] = planes;
            let rest = [
                from(e, done),
                from(r0, done),
                from(r1, done / 2),
                from(r2, done),
                from(r3, done),
            ];
            join_any(layout, rest, &mut dst[4 * done..]);
        }
        _ => join_any(layout, planes, dst),
    }
}

/// `F32`: the whole blocks of 32 elements that `planes` and `dst` all hold, joined by
/// AVX2 (the top halves made as bf16's join makes an element, the bytes then interleaved
/// into 16-bit halves and the halves into elements); returns the elements done.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn f32_avx2(planes: [&[u8]; PLANES_MAX], dst: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    const BLOCK: usize = 32;
    let [e, r0, r1, r2, _] = planes;
    let blocks = (dst.len() / 4)
        .min(e.len())
        .min(r0.len())
        .min(r1.len())
        .min(r2.len())
        / BLOCK;
    // SAFETY: every load and store below is inside block c < blocks of its buffer (32
    // bytes of each plane, 128 of dst), which the minimum above bounds.
    unsafe {
        let load = |p: &[u8], at: usize| _mm256_loadu_si256(p.as_ptr().add(at) as *const __m256i);
        let (top, low7) = (_mm256_set1_epi8(0x80u8 as i8), _mm256_set1_epi8(0x7f));
        for c in 0..blocks {
            let at = c * BLOCK;
            let (x, a, b, s) = (load(e, at), load(r0, at), load(r1, at), load(r2, at));
            // Byte 2: the exponent's low bit over the mantissa's top 7; byte 3: the sign
            // over the exponent's top 7 (16-bit shifts, each byte masked to its own bits).
            let b2 = _mm256_or_si256(
                _mm256_and_si256(_mm256_slli_epi16(x, 7), top),
                _mm256_and_si256(s, low7),
            );
            let b3 = _mm256_or_si256(
                _mm256_and_si256(s, top),
                _mm256_and_si256(_mm256_srli_epi16(x, 1), low7),
            );
            store_f32s(dst.as_mut_ptr().add(4 * at), [a, b, b2, b3]);
        }
    }
    blocks * BLOCK
}

/// `F32Top`: as `f32_avx2` (blocks of 32 elements; the nibble plane's 16 bytes a block
/// spread to a byte an element).
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn f32_top_avx2(planes: [&[u8]; PLANES_MAX], dst: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    const BLOCK: usize = 32;
    let [e, t, nib, mid, low] = planes;
    let blocks = (dst.len() / 4)
        .min(e.len())
        .min(t.len())
        .min(nib.len() / (BLOCK / 2) * BLOCK)
        .min(mid.len())
        .min(low.len())
        / BLOCK;
    // SAFETY: every load and store below is inside block c < blocks of its buffer (32
    // bytes of e, t, mid and low, 16 of nib, 128 of dst), which the minimum above bounds.
    unsafe {
        let load = |p: &[u8], at: usize| _mm256_loadu_si256(p.as_ptr().add(at) as *const __m256i);
        let byte = |b: u8| _mm256_set1_epi8(b as i8);
        for c in 0..blocks {
            let at = c * BLOCK;
            let (x, s, a, b) = (load(e, at), load(t, at), load(low, at), load(mid, at));
            let pairs = _mm_loadu_si128(nib.as_ptr().add(at / 2) as *const __m128i);
            let (lo4, hi4) = (
                _mm_and_si128(pairs, _mm_set1_epi8(0xf)),
                _mm_and_si128(_mm_srli_epi16(pairs, 4), _mm_set1_epi8(0xf)),
            );
            // Element 2j's nibble is pair j's low half, 2j + 1's its high half.
            let nibbles =
                _mm256_set_m128i(_mm_unpackhi_epi8(lo4, hi4), _mm_unpacklo_epi8(lo4, hi4));
            // Byte 2: the exponent's low bit, the mantissa's top 3, then its next 4; byte
            // 3: the sign over the exponent's top 7 (16-bit shifts, bytes masked).
            let s4 = _mm256_slli_epi16(s, 4);
            let b2 = _mm256_or_si256(
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_slli_epi16(x, 7), byte(0x80)),
                    _mm256_and_si256(s4, byte(0x70)),
                ),
                nibbles,
            );
            let b3 = _mm256_or_si256(
                _mm256_and_si256(s4, byte(0x80)),
                _mm256_and_si256(_mm256_srli_epi16(x, 1), byte(0x7f)),
            );
            store_f32s(dst.as_mut_ptr().add(4 * at), [a, b, b2, b3]);
        }
    }
    blocks * BLOCK
}

/// 32 f32 elements to `o` from their four bytes' vectors (byte k of element i at lane
/// byte i of `bytes[k]`).
///
/// # Safety
/// The CPU has AVX2; `o` has 128 bytes of room.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn store_f32s(o: *mut u8, bytes: [std::arch::x86_64::__m256i; 4]) {
    use std::arch::x86_64::*;
    let [a, b, b2, b3] = bytes;
    // Per 128-bit lane: elements 0..8 of the lane in the lo halves, 8..16 in hi.
    let (lo_a, lo_b) = (_mm256_unpacklo_epi8(a, b), _mm256_unpackhi_epi8(a, b));
    let (hi_a, hi_b) = (_mm256_unpacklo_epi8(b2, b3), _mm256_unpackhi_epi8(b2, b3));
    let w0 = _mm256_unpacklo_epi16(lo_a, hi_a); // elements 0..4 | 16..20
    let w1 = _mm256_unpackhi_epi16(lo_a, hi_a); // 4..8 | 20..24
    let w2 = _mm256_unpacklo_epi16(lo_b, hi_b); // 8..12 | 24..28
    let w3 = _mm256_unpackhi_epi16(lo_b, hi_b); // 12..16 | 28..32
    let o = o as *mut __m256i;
    // SAFETY: the caller's: 128 bytes at o.
    unsafe {
        _mm256_storeu_si256(o, _mm256_permute2x128_si256::<0x20>(w0, w1));
        _mm256_storeu_si256(o.add(1), _mm256_permute2x128_si256::<0x20>(w2, w3));
        _mm256_storeu_si256(o.add(2), _mm256_permute2x128_si256::<0x31>(w0, w1));
        _mm256_storeu_si256(o.add(3), _mm256_permute2x128_si256::<0x31>(w2, w3));
    }
}

/// `F16Bits`: the whole chunks of 32 elements that `planes` and `dst` all hold, joined by
/// AVX2 (each bit plane's 4 bytes spread to a byte an element by a shuffle and a compare;
/// the high bytes made, then interleaved with the low ones); returns the elements done.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn f16_bits_avx2(planes: [&[u8]; PLANES_MAX], dst: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let [e, lo, bits, ..] = planes;
    let n = dst.len() / 2;
    let chunks = (n / BITS_CHUNK)
        .min(e.len() / BITS_CHUNK)
        .min(lo.len() / BITS_CHUNK)
        .min(bits.len() / BITS_CHUNK_BYTES);
    // SAFETY: every load and store below is inside chunk c < chunks of its buffer
    // (32 bytes of e and lo, 12 of bits, 64 of dst), which the minimum above bounds.
    unsafe {
        // Byte k / 8 of the 4 to element k (each 128-bit lane holds the broadcast word).
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        let expand = |word: *const u8, to: i8| {
            let w = _mm256_set1_epi32(std::ptr::read_unaligned(word as *const i32));
            let b = _mm256_and_si256(_mm256_shuffle_epi8(w, spread), bit);
            _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(to))
        };
        for c in 0..chunks {
            let (at, bt) = (c * BITS_CHUNK, c * BITS_CHUNK_BYTES);
            let ev = _mm256_loadu_si256(e.as_ptr().add(at) as *const __m256i);
            let lv = _mm256_loadu_si256(lo.as_ptr().add(at) as *const __m256i);
            let b = bits.as_ptr().add(bt);
            let exp = _mm256_and_si256(_mm256_slli_epi16(ev, 2), _mm256_set1_epi8(0x7c));
            let hi = _mm256_or_si256(
                _mm256_or_si256(exp, expand(b, 0x80u8 as i8)),
                _mm256_or_si256(expand(b.add(4), 2), expand(b.add(8), 1)),
            );
            let (a, z) = (_mm256_unpacklo_epi8(lv, hi), _mm256_unpackhi_epi8(lv, hi));
            let o = dst.as_mut_ptr().add(2 * at) as *mut __m256i;
            _mm256_storeu_si256(o, _mm256_permute2x128_si256::<0x20>(a, z));
            _mm256_storeu_si256(o.add(1), _mm256_permute2x128_si256::<0x31>(a, z));
        }
    }
    chunks * BITS_CHUNK
}

/// `F16Bits`: elements `from..` of `dst` from their planes, one at a time (a byte a plane
/// lacks reads as zero).
fn f16_bits_from(from: usize, planes: [&[u8]; PLANES_MAX], dst: &mut [u8]) {
    let [e, lo, bits, ..] = planes;
    let n = dst.len() / 2;
    let bit_of = |at: usize, b: u32| (bits.get(at).copied().unwrap_or(0) >> b) & 1;
    for (i, o) in dst.chunks_exact_mut(2).enumerate().skip(from) {
        let (at, g, b) = bits_at(i, n);
        o[0] = lo.get(i).copied().unwrap_or(0);
        o[1] = (bit_of(at, b) << 7)
            | ((e.get(i).copied().unwrap_or(0) & 0x1f) << 2)
            | (bit_of(at + g, b) << 1)
            | bit_of(at + 2 * g, b);
    }
}

#[inline(always)]
fn join_any(layout: Layout, planes: [&[u8]; PLANES_MAX], dst: &mut [u8]) {
    let [e, r0, r1, r2, r3] = planes;
    match layout {
        Layout::Bf16 => {
            // Fixed-size blocks (the compiler vectorizes them), then the tail.
            let bf16 = |o: &mut [u8], x: u8, r: u8| {
                o[0] = (x << 7) | (r & 0x7f);
                o[1] = (r & 0x80) | (x >> 1);
            };
            let mut blocks = dst.chunks_exact_mut(64);
            let (e32, r32) = (e.chunks_exact(32), r0.chunks_exact(32));
            for ((o, x), r) in blocks.by_ref().zip(e32).zip(r32) {
                for i in 0..32 {
                    bf16(&mut o[2 * i..2 * i + 2], x[i], r[i]);
                }
            }
            let done = dst.len() / 64 * 32;
            let (et, rt) = (&e[done.min(e.len())..], &r0[done.min(r0.len())..]);
            for ((o, &x), &r) in dst[done * 2..].chunks_exact_mut(2).zip(et).zip(rt) {
                bf16(o, x, r);
            }
        }
        Layout::F16 => {
            // Four elements a byte of the top mantissa bits.
            let quads = dst.chunks_exact_mut(8).zip(e.chunks_exact(4));
            for ((o, x), (r, &t)) in quads.zip(r0.chunks_exact(4).zip(r1)) {
                for k in 0..4 {
                    o[2 * k] = r[k];
                    o[2 * k + 1] = (x[k] << 2) | ((t >> (2 * k)) & 3);
                }
            }
            let done = dst.len() / 8 * 4;
            for i in done..dst.len() / 2 {
                let t = r1.get(i / 4).copied().unwrap_or(0);
                dst[2 * i] = r0.get(i).copied().unwrap_or(0);
                dst[2 * i + 1] = (e.get(i).copied().unwrap_or(0) << 2) | ((t >> (2 * (i % 4))) & 3);
            }
        }
        Layout::F16Bits => f16_bits_from(0, planes, dst),
        Layout::F32 => {
            let rest = r0.iter().zip(r1).zip(r2);
            for ((o, &x), ((&a, &b), &c)) in dst.chunks_exact_mut(4).zip(e).zip(rest) {
                let v = ((c as u32 & 0x80) << 24)
                    | ((x as u32) << 23)
                    | ((c as u32 & 0x7f) << 16)
                    | ((b as u32) << 8)
                    | a as u32;
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        Layout::F32Top => {
            // A plane a byte short reads as zero there.
            let at = |p: &[u8], i: usize| p.get(i).copied().unwrap_or(0) as u32;
            for (i, o) in dst.chunks_exact_mut(4).enumerate() {
                let t = at(r0, i);
                let v = (t & 8) << 28
                    | at(e, i) << 23
                    | (t & 7) << 20
                    | (at(r1, i / 2) >> (4 * (i % 2)) & 0xf) << 16
                    | at(r2, i) << 8
                    | at(r3, i);
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// Code lengths (0: unused) of a Huffman code for `hist` whose longest code has at most
/// `MAX_LEN` bits: Huffman's merge on the counts, halved (never below 1) until the
/// longest code fits.
fn code_lengths(hist: &[u64; 256]) -> [u8; 256] {
    let mut counts: Vec<(u64, usize)> = hist
        .iter()
        .enumerate()
        .filter(|(_, &c)| c > 0)
        .map(|(s, &c)| (c, s))
        .collect();
    let mut lens = [0u8; 256];
    if counts.len() == 1 {
        lens[counts[0].1] = 1;
        return lens;
    }
    loop {
        // Two-queue Huffman: leaves sorted by count, merged nodes in creation order (their
        // counts never decrease). Nodes are indices: leaves 0..n, merges after.
        counts.sort_unstable();
        let n = counts.len();
        let mut parent = vec![0usize; 2 * n - 1];
        let mut weight: Vec<u64> = counts.iter().map(|c| c.0).collect();
        let (mut leaf, mut merged) = (0usize, n);
        let mut take = |weight: &Vec<u64>, next: usize| -> usize {
            let use_leaf = leaf < n && (merged >= next || weight[leaf] <= weight[merged]);
            if use_leaf {
                leaf += 1;
                leaf - 1
            } else {
                merged += 1;
                merged - 1
            }
        };
        for next in n..2 * n - 1 {
            let a = take(&weight, next);
            let b = take(&weight, next);
            weight.push(weight[a] + weight[b]);
            parent[a] = next;
            parent[b] = next;
        }
        // Depths from the root (the last node) down: a parent always comes after.
        let mut depth = vec![0u32; 2 * n - 1];
        for i in (0..2 * n - 2).rev() {
            depth[i] = depth[parent[i]] + 1;
        }
        if depth[..n].iter().all(|&d| d <= MAX_LEN) {
            for (i, &(_, s)) in counts.iter().enumerate() {
                lens[s] = depth[i] as u8;
            }
            return lens;
        }
        for c in &mut counts {
            c.0 = (c.0 / 2).max(1);
        }
    }
}

/// Canonical codes for `lens`, bit-reversed for LSB-first writing: (code, length).
fn canonical(lens: &[u8; 256]) -> [(u32, u8); 256] {
    // DEFLATE's construction: the first code of each length, then symbols in order.
    let mut count = [0u32; MAX_LEN as usize + 2];
    for &l in lens.iter().filter(|&&l| l > 0) {
        count[(l as usize).min(MAX_LEN as usize + 1)] += 1;
    }
    let mut next = [0u32; MAX_LEN as usize + 2];
    let mut code = 0u32;
    for l in 1..next.len() {
        code = (code + count[l - 1]) << 1;
        next[l] = code;
    }
    let mut codes = [(0u32, 0u8); 256];
    for (s, &l) in lens.iter().enumerate() {
        if l > 0 && l as u32 <= MAX_LEN {
            let c = next[l as usize];
            next[l as usize] += 1;
            codes[s] = (c.reverse_bits() >> (32 - l as u32), l);
        }
    }
    codes
}

/// LSB-first bit writer.
struct Bits<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    n: u32,
}

impl Bits<'_> {
    #[inline(always)]
    fn put(&mut self, code: u32, len: u8) {
        self.acc |= (code as u64) << self.n;
        self.n += len as u32;
        if self.n >= 32 {
            self.out.extend_from_slice(&(self.acc as u32).to_le_bytes());
            self.acc >>= 32;
            self.n -= 32;
        }
    }

    fn finish(mut self) {
        while self.n > 0 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.n = self.n.saturating_sub(8);
        }
    }
}

/// A plane takes a code of its own over a shared one only when that saves more than this
/// many bytes: its decoder then builds the code's tables first, which takes as long as
/// decoding a few thousand symbols (64 bytes are 9 ns of a 7 GB/s disk; a table build
/// is 2-4 us of a core).
const OWN_CODE_SAVING_MIN: u64 = 64;

/// Codes one byte plane of a frame of `layout` (`exps`: its symbols) into `out`, header
/// and streams, with a code of its own.
pub fn encode_plane(layout: Layout, exps: &[u8], out: &mut Vec<u8>) {
    encode_plane_with(layout, 0, exps, out, &[]);
}

/// `encode_plane` for plane `plane` of its frame, which may instead name one of the
/// store's `shared` codes (mode 2): the one whose header and bits come to fewer bytes.
pub fn encode_plane_with(
    layout: Layout,
    plane: usize,
    exps: &[u8],
    out: &mut Vec<u8>,
    shared: &[SharedEncoding],
) {
    out.clear();
    out.push(layout.tag());
    let mut hist = [0u64; 256];
    for &e in exps {
        hist[e as usize] += 1;
    }
    let used = hist.iter().filter(|&&c| c > 0).count();
    if used <= 1 {
        out.push(1);
        out.push(exps.first().copied().unwrap_or(0));
        return;
    }
    let bits = |lens: &[u8; 256]| -> u64 {
        hist.iter()
            .zip(lens)
            .map(|(&c, &l)| c * l as u64)
            .sum::<u64>()
    };
    let lens = code_lengths(&hist);
    let own = own_code_bytes(used as u64, bits(&lens));
    let best = shared
        .iter()
        .filter(|c| c.layout == layout && c.plane as usize == plane)
        .filter(|c| hist.iter().zip(&c.lens).all(|(&h, &l)| h == 0 || l > 0))
        .map(|c| (shared_code_bytes(bits(&c.lens)), c))
        .min_by_key(|&(bytes, _)| bytes);
    let coded = best.map_or(own, |(bytes, _)| bytes.min(own));
    let base = (0..256)
        .max_by_key(|&s| (hist[s], usize::MAX - s))
        .unwrap_or(0) as u8;
    if sparse_bytes(exps, base) <= coded {
        out.push(3);
        out.push(base);
        let mut next = 0usize;
        for (i, &e) in exps.iter().enumerate().filter(|&(_, &e)| e != base) {
            let mut gap = i - next;
            while gap >= SPARSE_SKIP {
                out.push(SPARSE_SKIP as u8);
                gap -= SPARSE_SKIP;
            }
            out.extend_from_slice(&[gap as u8, e]);
            next = i + 1;
        }
        return;
    }
    if let Some((_, c)) = best.filter(|&(bytes, _)| bytes <= own + OWN_CODE_SAVING_MIN) {
        out.push(2);
        out.push(c.index);
        let sizes_at = out.len();
        let sizes = write_streams(exps, &c.codes, out);
        let mut varints = Vec::with_capacity(3 * 5);
        for &len in &sizes[..STREAMS - 1] {
            put_varint(&mut varints, len);
        }
        out.splice(sizes_at..sizes_at, varints);
        return;
    }
    out.push(0);
    let codes = canonical(&lens);
    out.extend_from_slice(&(used as u16).to_le_bytes());
    for (s, &l) in lens.iter().enumerate() {
        if l > 0 {
            out.extend_from_slice(&[s as u8, l]);
        }
    }
    let lens_at = out.len();
    out.extend_from_slice(&[0u8; 4 * (STREAMS - 1)]);
    let sizes = write_streams(exps, &codes, out);
    for (s, &len) in sizes[..STREAMS - 1].iter().enumerate() {
        out[lens_at + 4 * s..lens_at + 4 * s + 4].copy_from_slice(&len.to_le_bytes());
    }
}

/// A sparse plane's (mode 3) gap byte that only skips: this many elements of the base
/// symbol, and no exception after them.
const SPARSE_SKIP: usize = 255;

/// A plane's bytes in mode 3 (sparse): the mode, the base symbol, then per element that is
/// not the base (an exception) the count of base elements before it since the last one (a
/// byte below `SPARSE_SKIP`, after as many `SPARSE_SKIP` bytes as it takes) and its
/// symbol. A plane of few exceptions (the low mantissa bytes of f32 norms made from bf16
/// ones: a few percent of their elements have any) costs about two bytes an exception,
/// under the bit a Huffman code spends on every element, and decodes as a fill and a
/// scatter.
fn sparse_bytes(exps: &[u8], base: u8) -> u64 {
    let (mut bytes, mut next) = (2u64, 0usize);
    for (i, _) in exps.iter().enumerate().filter(|&(_, &e)| e != base) {
        bytes += 2 + ((i - next) / SPARSE_SKIP) as u64;
        next = i + 1;
    }
    bytes
}

/// A plane's bytes with a code of its own, `bits` of symbols: the mode, the symbol count
/// and table (2 bytes a symbol), the fixed stream sizes and the streams.
fn own_code_bytes(used: u64, bits: u64) -> u64 {
    1 + 2 + 2 * used + 4 * (STREAMS as u64 - 1) + bits.div_ceil(8)
}

/// A plane's bytes naming a shared code, `bits` of symbols: the mode, the code's index,
/// three varint stream sizes (about two bytes each) and the streams.
fn shared_code_bytes(bits: u64) -> u64 {
    2 + 2 * (STREAMS as u64 - 1) + bits.div_ceil(8)
}

/// Appends the four streams of `exps` coded with `codes` to `out`; returns their byte
/// lengths.
fn write_streams(exps: &[u8], codes: &[(u32, u8); 256], out: &mut Vec<u8>) -> [u32; STREAMS] {
    let q = exps.len().div_ceil(STREAMS);
    let mut sizes = [0u32; STREAMS];
    for (s, size) in sizes.iter_mut().enumerate() {
        let start = out.len();
        let part = &exps[(s * q).min(exps.len())..((s + 1) * q).min(exps.len())];
        let mut w = Bits {
            out: &mut *out,
            acc: 0,
            n: 0,
        };
        for &e in part {
            let (c, l) = codes[e as usize];
            w.put(c, l);
        }
        w.finish();
        *size = (out.len() - start) as u32;
    }
    sizes
}

fn put_varint(out: &mut Vec<u8>, mut v: u32) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A LEB128 u32 at `buf[*at..]`, moving `at` past it; None when cut short or too long.
fn take_varint(buf: &[u8], at: &mut usize) -> Option<u32> {
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

/// A code the small float frames of a store share (format 8): made at pack time from the
/// census of all of them (`shared_codes`), kept in the manifest, its decoding tables built
/// once when the store opens (`SharedTables`). A frame of a few thousand elements pays
/// for a code of its own in header bytes (two per symbol: more than coding saves on a
/// norm vector's sign and mantissa) and in the time to build its tables (more than its
/// symbols take); one code for all of them pays once, as a compressor of the whole
/// model's bytes does.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct SharedCode {
    /// The layout's tag (`Layout::tag`) and the plane of it (0: the exponents) the code
    /// was made for.
    pub layout: u8,
    pub plane: u8,
    /// (symbol, code length) of each symbol the code has, symbols ascending.
    pub lens: Vec<(u8, u8)>,
}

impl SharedCode {
    fn from_lens(layout: Layout, plane: usize, lens: &[u8; 256]) -> SharedCode {
        SharedCode {
            layout: layout.tag(),
            plane: plane as u8,
            lens: (0..=255u8)
                .filter(|&s| lens[s as usize] > 0)
                .map(|s| (s, lens[s as usize]))
                .collect(),
        }
    }

    /// Its layout and code lengths, checked: a known layout and one of its planes, each
    /// symbol once, lengths of 1 to `MAX_LEN` bits making a complete prefix code.
    pub fn check(&self) -> Result<(Layout, [u8; 256]), String> {
        let layout = Layout::from_tag(self.layout)
            .ok_or_else(|| format!("unknown layout {}", self.layout))?;
        if self.plane as usize >= layout.planes() {
            return Err(format!(
                "plane {} of {layout:?}, which has {}",
                self.plane,
                layout.planes()
            ));
        }
        let mut lens = [0u8; 256];
        for &(s, l) in &self.lens {
            if l == 0 || l as u32 > MAX_LEN {
                return Err(format!("code length {l} for symbol {s}"));
            }
            if lens[s as usize] != 0 {
                return Err(format!("symbol {s} twice"));
            }
            lens[s as usize] = l;
        }
        let kraft: u32 = lens
            .iter()
            .filter(|&&l| l > 0)
            .map(|&l| 1u32 << (MAX_LEN - l as u32))
            .sum();
        if self.lens.len() < 2 || kraft != TABLE as u32 {
            return Err("the code lengths are not a complete prefix code".into());
        }
        Ok((layout, lens))
    }
}

/// Shared codes of one layout's plane at most.
pub const SHARED_CODES_PER_PLANE: usize = 8;

/// The shared codes of plane `plane` of `layout` from the symbol counts of each small
/// frame (`frames`): the norm vectors of one model differ (one kind sits near 1, another
/// near 0.1), and one code for all of them serves some worse than codes of their own.
/// So the frames are grouped, k-means style with coded bytes as the distance: first one
/// group of all; then a group seeded with the frame the codes serve worst, each frame
/// moved to the code that costs it fewest bytes and each code remade from its frames, kept
/// while that lowers the total (the frames' bytes, a code of its own and
/// `OWN_CODE_SAVING_MIN` for a frame no code serves within that, and each code's bytes
/// in the manifest), up to `SHARED_CODES_PER_PLANE` codes. Deterministic.
pub fn shared_codes(layout: Layout, plane: usize, frames: &[[u64; 256]]) -> Vec<SharedCode> {
    let used = |h: &[u64; 256]| h.iter().filter(|&&c| c > 0).count() as u64;
    let frames: Vec<&[u64; 256]> = frames.iter().filter(|h| used(h) >= 2).collect();
    if frames.is_empty() {
        return Vec::new();
    }
    let bits = |h: &[u64; 256], lens: &[u8; 256]| -> u64 {
        h.iter().zip(lens).map(|(&c, &l)| c * l as u64).sum()
    };
    // What `encode_plane_with` counts: a code of its own, or a shared one's header.
    let own: Vec<u64> = frames
        .iter()
        .map(|h| own_code_bytes(used(h), bits(h, &code_lengths(h))))
        .collect();
    let shared_cost = |h: &[u64; 256], lens: &[u8; 256]| -> Option<u64> {
        h.iter()
            .zip(lens)
            .all(|(&c, &l)| c == 0 || l > 0)
            .then(|| shared_code_bytes(bits(h, lens)))
    };
    let make = |members: &mut dyn Iterator<Item = usize>| -> [u8; 256] {
        let mut sum = [0u64; 256];
        for i in members {
            sum.iter_mut().zip(frames[i]).for_each(|(s, &c)| *s += c);
        }
        code_lengths(&sum)
    };
    // A frame's plane without a shared code: a code of its own (and the table build it
    // costs, in bytes), or kept raw where that is less.
    let alone: Vec<u64> = frames
        .iter()
        .zip(&own)
        .map(|(h, &own)| (own + OWN_CODE_SAVING_MIN).min(h.iter().sum()))
        .collect();
    // The total bytes of `codes`, each frame's code (None: none) and its excess over a
    // code of its own.
    let total = |codes: &[[u8; 256]]| -> (u64, Vec<Option<usize>>, Vec<u64>) {
        let mut sum: u64 = codes
            .iter()
            .map(|l| 4 + 2 * l.iter().filter(|&&x| x > 0).count() as u64)
            .sum();
        let (mut pick, mut excess) = (Vec::with_capacity(frames.len()), Vec::new());
        for ((h, &own), &alone) in frames.iter().zip(&own).zip(&alone) {
            let best = codes
                .iter()
                .enumerate()
                .filter_map(|(k, l)| shared_cost(h, l).map(|c| (c, k)))
                .min();
            match best.filter(|&(c, _)| c <= alone) {
                Some((c, k)) => {
                    sum += c;
                    pick.push(Some(k));
                    excess.push(c.saturating_sub(own));
                }
                None => {
                    sum += alone;
                    pick.push(None);
                    excess.push(alone.saturating_sub(own));
                }
            }
        }
        (sum, pick, excess)
    };
    let mut codes = vec![make(&mut (0..frames.len()))];
    let (mut best, mut pick, mut excess) = total(&codes);
    // No code at all where one costs more than it saves (a few tiny frames).
    if best >= alone.iter().sum::<u64>() {
        return Vec::new();
    }
    while codes.len() < SHARED_CODES_PER_PLANE {
        // The first frame of the largest excess seeds a new code.
        let Some((seed, _)) = excess
            .iter()
            .enumerate()
            .filter(|&(_, &e)| e > 0)
            .max_by_key(|&(i, &e)| (e, std::cmp::Reverse(i)))
        else {
            break;
        };
        let mut trial = codes.clone();
        trial.push(make(&mut std::iter::once(seed)));
        for _ in 0..4 {
            let (_, p, _) = total(&trial);
            for (k, code) in trial.iter_mut().enumerate() {
                let mut members = (0..frames.len()).filter(|&i| p[i] == Some(k)).peekable();
                if members.peek().is_some() {
                    *code = make(&mut members);
                }
            }
        }
        let (t, p, e) = total(&trial);
        if t >= best {
            break;
        }
        (codes, best, pick, excess) = (trial, t, p, e);
    }
    // Only the codes some frame takes.
    codes
        .iter()
        .enumerate()
        .filter(|&(k, _)| pick.contains(&Some(k)))
        .map(|(_, lens)| SharedCode::from_lens(layout, plane, lens))
        .collect()
}

/// A shared code as the encoder uses it: its index in the manifest, what it is for, and
/// its lengths and codes.
pub struct SharedEncoding {
    index: u8,
    layout: Layout,
    plane: u8,
    lens: [u8; 256],
    codes: [(u32, u8); 256],
}

/// The encoder's form of each of `codes` (at most 256; a code that does not check is
/// left out, and no frame names it).
pub fn shared_encodings(codes: &[SharedCode]) -> Vec<SharedEncoding> {
    codes
        .iter()
        .take(SHARED_CODES_MAX)
        .enumerate()
        .filter_map(|(i, c)| {
            let (layout, lens) = c.check().ok()?;
            Some(SharedEncoding {
                index: i as u8,
                layout,
                plane: c.plane,
                lens,
                codes: canonical(&lens),
            })
        })
        .collect()
}

/// Shared codes a store may have (a frame names one in a byte).
pub const SHARED_CODES_MAX: usize = 256;

/// The decoding tables of a store's shared codes, built once (with the multi-symbol part:
/// a short plane then decodes as fast as a long one).
#[derive(Default)]
pub struct SharedTables {
    codes: Vec<(Layout, Box<Tables>)>,
}

impl SharedTables {
    pub fn new(codes: &[SharedCode]) -> Result<SharedTables, String> {
        if codes.len() > SHARED_CODES_MAX {
            return Err(format!(
                "{} shared codes, at most {SHARED_CODES_MAX}",
                codes.len()
            ));
        }
        let codes = codes
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let (layout, lens) = c.check().map_err(|e| format!("shared code {i}: {e}"))?;
                let mut t = Box::new(Tables {
                    single: [0; TABLE],
                    multi: [0; TABLE],
                    mask: 0,
                    multi_pays: false,
                });
                fill_single(&mut t, &lens, MAX_LEN);
                fill_multi(&mut t);
                Ok((layout, t))
            })
            .collect::<Result<_, String>>()?;
        Ok(SharedTables { codes })
    }

    pub fn len(&self) -> usize {
        self.codes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.codes.is_empty()
    }

    /// Host bytes of the tables.
    pub fn bytes(&self) -> usize {
        self.codes.len() * TABLES_BYTES
    }
}

/// A stream's bits from bit `bp` of the plane's streams, LSB first, with at least 57 of
/// them its own (the top `bp & 7` bits are zeros). A stream reads on into the next one's
/// bytes, and zeros past the last: its symbols are decoded from its own bits, and only
/// those it still needs are kept from a window that reaches past them, so the bits that
/// follow a stream change nothing a valid stream decodes to. One bound for the four
/// streams spares the loops a register each.
#[inline(always)]
fn peek(buf: &[u8], bp: usize) -> u64 {
    let b = bp >> 3;
    let w = if b + 8 <= buf.len() {
        // SAFETY: b + 8 <= buf.len(): an unaligned read of 8 bytes inside `buf`.
        u64::from_le(unsafe { std::ptr::read_unaligned(buf.as_ptr().add(b) as *const u64) })
    } else {
        let mut w = [0u8; 8];
        let rest = buf.get(b..).unwrap_or(&[]);
        w[..rest.len()].copy_from_slice(rest);
        u64::from_le_bytes(w)
    };
    w >> (bp & 7)
}

/// A round's word of a stream's bits (`peek`) with a 1 in its top bit, above them: the
/// round's lookups shift the word right by the bits they use, and its leading zeros then
/// count them, so the loops keep no bit count of their own.
#[inline(always)]
fn round_word(buf: &[u8], bp: usize) -> u64 {
    peek(buf, bp) | 1 << 63
}

/// The last bit of a round word (`round_word`) at which a lookup may start: its 11-bit
/// window then ends at bit 56, inside the 57 bits that are the stream's at least. (A round
/// of the loops starts its last lookup at bit 44 at most: 4 x 11 or 5 x 11 bits a round.)
const WORD_LOOKUP_LAST: u32 = 57 - MAX_LEN;

/// The layout a coded plane names (its first byte).
pub fn plane_layout(coded: &[u8]) -> Result<Layout, String> {
    let &tag = coded
        .first()
        .ok_or_else(|| "float codec: an empty coded plane".to_string())?;
    Layout::from_tag(tag).ok_or_else(|| format!("float codec: unknown layout {tag}"))
}

/// Host bytes of one plane's decoding tables (`PlaneCache`, and each shared code's).
pub const TABLES_BYTES: usize = std::mem::size_of::<Tables>();

/// Decodes one coded plane of `n` symbols (`encode_plane`'s bytes, with no shared code)
/// into `out[..n]` (`out` has 8 bytes of room past them at least). The error says what in
/// the bytes is wrong.
pub fn decode_plane(
    coded: &[u8],
    n: usize,
    out: &mut [u8],
    cache: &mut PlaneCache,
) -> Result<(), String> {
    decode_plane_as(coded, n, out, cache, &SharedTables::default(), Simd::Detect)
}

/// The decoding tables of the last code a plane decoder saw: the frames of a tensor often
/// share one code, and building the tables costs as much as a few thousand symbols.
pub struct PlaneCache {
    lens: [u8; 256],
    /// Built with the multi-symbol part too.
    multi: bool,
    tables: Option<Box<Tables>>,
}

impl Default for PlaneCache {
    fn default() -> Self {
        PlaneCache {
            lens: [0; 256],
            multi: false,
            tables: None,
        }
    }
}

/// Whether the decoder may use the CPU's extensions (BMI2, AVX2) where it has them, or
/// must run the portable code (the tests check that both agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    Detect,
    Portable,
}

/// `decode_plane` with the store's shared codes (mode 2 names one), choosing the code
/// path.
pub fn decode_plane_as(
    coded: &[u8],
    n: usize,
    out: &mut [u8],
    cache: &mut PlaneCache,
    shared: &SharedTables,
    simd: Simd,
) -> Result<(), String> {
    let bad = |what: &str| format!("float codec: {what}");
    if out.len() < n + 8 {
        return Err(bad(&format!(
            "{} bytes of room for a plane of {n} symbols",
            out.len()
        )));
    }
    let layout = plane_layout(coded)?;
    let body = &coded[1..];
    let (&mode, body) = body.split_first().ok_or_else(|| bad("no mode"))?;
    match mode {
        1 => {
            let &e = body.first().ok_or_else(|| bad("no constant symbol"))?;
            out[..n].fill(e);
            return Ok(());
        }
        2 => {
            let &i = body.first().ok_or_else(|| bad("no shared code"))?;
            let (code_layout, table) = shared.codes.get(i as usize).ok_or_else(|| {
                bad(&format!(
                    "the plane names shared code {i}, and the store has {}",
                    shared.codes.len()
                ))
            })?;
            if *code_layout != layout {
                return Err(bad(&format!(
                    "a plane of {layout:?} names shared code {i}, made for {code_layout:?}"
                )));
            }
            let mut at = 1;
            let mut sizes = [0usize; STREAMS - 1];
            for (s, size) in sizes.iter_mut().enumerate() {
                *size = take_varint(body, &mut at)
                    .ok_or_else(|| bad(&format!("stream {s}'s size cut short")))?
                    as usize;
            }
            symbols_of(&body[at..], sizes, n, table, true, out, simd).map_err(|e| bad(&e))?;
            return Ok(());
        }
        3 => {
            let (&base, mut list) = body.split_first().ok_or_else(|| bad("no base symbol"))?;
            out[..n].fill(base);
            let mut at = 0usize;
            while let Some((&gap, rest)) = list.split_first() {
                at += gap as usize;
                if gap as usize == SPARSE_SKIP {
                    list = rest;
                    continue;
                }
                let (&e, rest) = rest
                    .split_first()
                    .ok_or_else(|| bad("a sparse plane ends inside an exception"))?;
                if at >= n {
                    return Err(bad(&format!(
                        "a sparse plane's exception at element {at} of {n}"
                    )));
                }
                out[at] = e;
                at += 1;
                list = rest;
            }
            return Ok(());
        }
        0 => {}
        m => return Err(bad(&format!("unknown mode {m}"))),
    }
    let used = u16::from_le_bytes([
        *body.first().ok_or_else(|| bad("no symbol count"))?,
        *body.get(1).ok_or_else(|| bad("no symbol count"))?,
    ]) as usize;
    let pairs = body
        .get(2..2 + 2 * used)
        .ok_or_else(|| bad("symbol table cut short"))?;
    let mut lens = [0u8; 256];
    for p in pairs.chunks_exact(2) {
        if p[1] == 0 || p[1] as u32 > MAX_LEN {
            return Err(bad(&format!("code length {} for symbol {}", p[1], p[0])));
        }
        lens[p[0] as usize] = p[1];
    }
    // A complete prefix code (Kraft sum exactly 1): every table entry gets a symbol.
    let kraft: u32 = lens
        .iter()
        .filter(|&&l| l > 0)
        .map(|&l| 1u32 << (MAX_LEN - l as u32))
        .sum();
    if kraft != TABLE as u32 {
        return Err(bad("the code lengths are not a complete prefix code"));
    }
    let multi = n >= MULTI_MIN;
    let fresh = cache.tables.is_none() || cache.lens != lens || (multi && !cache.multi);
    let table = cache.tables.get_or_insert_with(|| {
        Box::new(Tables {
            single: [0; TABLE],
            multi: [0; TABLE],
            mask: 0,
            multi_pays: false,
        })
    });
    if fresh {
        let width = if multi {
            MAX_LEN
        } else {
            lens.iter().copied().max().unwrap_or(1) as u32
        };
        fill_single(table, &lens, width);
        if multi {
            fill_multi(table);
        }
        cache.lens = lens;
        cache.multi = multi;
    }
    let table = &**table;
    let at = 2 + 2 * used;
    let sizes = body
        .get(at..at + 4 * (STREAMS - 1))
        .ok_or_else(|| bad("stream sizes cut short"))?;
    let sizes: [usize; STREAMS - 1] =
        std::array::from_fn(|s| u32::from_le_bytes(crate::util::array(&sizes[4 * s..])) as usize);
    symbols_of(
        &body[at + 4 * (STREAMS - 1)..],
        sizes,
        n,
        table,
        multi,
        out,
        simd,
    )
    .map_err(|e| bad(&e))
}

/// The `n` symbols of `streams` (four streams, the first three of `sizes` bytes, the last
/// to the end) into `out[..n]`.
fn symbols_of(
    streams: &[u8],
    sizes: [usize; STREAMS - 1],
    n: usize,
    table: &Tables,
    multi: bool,
    out: &mut [u8],
    simd: Simd,
) -> Result<(), String> {
    let mut bp = [0usize; STREAMS];
    let mut start = 0usize;
    for (s, b) in bp.iter_mut().enumerate() {
        let len = match sizes.get(s) {
            Some(&len) => len,
            None => streams.len().saturating_sub(start),
        };
        let end = start
            .checked_add(len)
            .filter(|&e| e <= streams.len())
            .ok_or_else(|| format!("stream {s} runs past the plane"))?;
        *b = 8 * start;
        start = end;
    }
    let q = n.div_ceil(STREAMS);
    let first = |s: usize| (s * q).min(n);
    let at = [first(0), first(1), first(2), first(3)];
    let ends = [first(1), first(2), first(3), n];
    let s = Streams {
        buf: streams,
        bp,
        at,
        ends,
    };
    symbols(s, table, multi && table.multi_pays, out, simd);
    Ok(())
}

/// The decoding tables of a complete code: per 11-bit window, its first symbol and that
/// code's length (`single`: length | symbol << 8), and as many whole codes as fit in the
/// window, up to five (`multi`: their total length in bits 0..6, the symbols in bytes
/// 1..6, their count in bits 61..64; `multi_symbols`, `multi_count`). The length is in the
/// low bits so the decoder shifts its bits by the entry itself (a shift takes only the
/// amount's low 6 bits, x86's own): one operation fewer on the chain of dependent lookups
/// that bounds a stream's rate.
struct Tables {
    single: [u16; TABLE],
    multi: [u64; TABLE],
    /// `single` is filled for windows of this mask's bits (the code's longest length, or
    /// all 11 with `multi`): a short plane's few symbols need a small table.
    mask: usize,
    /// `multi`'s lookups yield enough symbols to pay for its size (`fill_multi`).
    multi_pays: bool,
}

/// Symbols of one `multi` entry at most.
const MULTI_SYMBOLS: u32 = 5;

/// A `multi` entry's symbol count.
#[inline(always)]
fn multi_count(e: u64) -> usize {
    (e >> 61) as usize
}

/// A `multi` entry's symbols, in its low bytes (the bytes past its count are garbage).
#[inline(always)]
fn multi_symbols(e: u64) -> u64 {
    e >> 8
}

/// Planes shorter than this decode a symbol a lookup (`single_table`): building the
/// multi-symbol table costs more than it saves there.
const MULTI_MIN: usize = 1 << 14;

/// The single-symbol table of `lens` into `t` for windows of `width` bits, at least the
/// longest code (its `multi` untouched).
fn fill_single(t: &mut Tables, lens: &[u8; 256], width: u32) {
    let size = 1usize << width.min(MAX_LEN);
    t.mask = size - 1;
    t.multi_pays = false;
    for (s, &(code, len)) in canonical(lens).iter().enumerate() {
        if len == 0 {
            continue;
        }
        let mut i = code as usize;
        while i < size {
            t.single[i] = (s as u16) << 8 | len as u16;
            i += 1 << len;
        }
    }
}

/// Symbols a `multi` lookup yields on average (over windows of random bits, which is how
/// the code's own symbol frequencies fall) below which it decodes with `single`: a code
/// of long codes packs a second symbol in few windows, and its 16 KiB of `multi` entries
/// spill from L1 where `single`'s 4 KiB stay (an `F32` sign-and-top-7 code of norm-like
/// frames, about 6.5 bits a symbol, yields about 1.2 a lookup).
const MULTI_PAYS_MIN: u32 = 3 * TABLE as u32 / 2;

/// The multi-symbol table from `t.single`, and whether it pays.
fn fill_multi(t: &mut Tables) {
    let mut yielded = 0u32;
    for w in 0..TABLE {
        let (mut word, mut used, mut count) = (0u64, 0u32, 0u32);
        while count < MULTI_SYMBOLS {
            let e = t.single[w >> used];
            let len = (e & 0xff) as u32;
            // The next code is known only if all its bits are inside the window.
            if used + len > MAX_LEN {
                break;
            }
            word |= ((e >> 8) as u64) << (8 * count);
            used += len;
            count += 1;
        }
        t.multi[w] = used as u64 | word << 8 | (count as u64) << 61;
        yielded += count;
    }
    t.multi_pays = yielded >= MULTI_PAYS_MIN;
}

/// Stream s's symbols into `out[at[s]..ends[s]]`. With `multi` (planes of `MULTI_MIN`
/// symbols or more, and shared codes, where the code's `multi` table pays): rounds of four
/// table lookups a stream from one word of its bits (4 x 11 <= 57 bits), each up to five
/// symbols, written as one 8-byte word (the bytes past its symbols land on the stream's
/// next ones, written over later), the four streams in turn while each has room for a
/// round and a word; then a lookup a stream, in turn, for the streams that still have room
/// for a word; then each stream's tail, still up to five symbols a lookup. Otherwise
/// a symbol a lookup, five a stream a round (5 x 11 <= 57 bits), the streams in turn as far
/// as all go, then each one's tail.
fn symbols(s: Streams<'_>, t: &Tables, multi: bool, out: &mut [u8], simd: Simd) {
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Detect
        && std::is_x86_feature_detected!("bmi2")
        && std::is_x86_feature_detected!("lzcnt")
    {
        // SAFETY: the CPU has BMI2 and LZCNT (checked just above).
        unsafe { symbols_bmi2(s, t, multi, out) };
        return;
    }
    symbols_any(s, t, multi, out);
}

/// A plane's four streams: their bytes, each one's bit position in them, and each one's
/// next and end element.
struct Streams<'a> {
    buf: &'a [u8],
    bp: [usize; STREAMS],
    at: [usize; STREAMS],
    ends: [usize; STREAMS],
}

/// `symbols` where the CPU has BMI2 and LZCNT: shifts by a register amount (SHRX) that
/// leave CL alone and take the amount's low 6 bits as they are, and a leading-zero count
/// without a branch for zero.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "bmi2,lzcnt")]
unsafe fn symbols_bmi2(s: Streams<'_>, t: &Tables, multi: bool, out: &mut [u8]) {
    symbols_any(s, t, multi, out);
}

#[inline(always)]
fn symbols_any(s: Streams<'_>, t: &Tables, multi: bool, out: &mut [u8]) {
    let Streams {
        buf,
        mut bp,
        mut at,
        ends,
    } = s;
    debug_assert!(ends.iter().all(|&e| e + 4 <= out.len()));
    let base = out.as_mut_ptr();
    if multi {
        // A round writes at most 4 x 5 symbols a stream, and a word 8 bytes from its start.
        const ROUND: usize = 4 * MULTI_SYMBOLS as usize;
        let step = |w: &mut u64, o: &mut *mut u8| {
            let e = t.multi[(*w as usize) & (TABLE - 1)];
            // SAFETY: *o + 8 <= base + ends[s] <= base + out.len(): the rounds below run
            // only while every stream has ROUND + 8 symbols left or more, and a step
            // advances at most 5 (so the words stay inside the stream's own range, below
            // its neighbour's symbols).
            unsafe {
                std::ptr::write_unaligned(*o as *mut u64, multi_symbols(e).to_le());
                *o = o.add(multi_count(e));
            }
            *w = w.wrapping_shr(e as u32);
        };
        loop {
            // Rounds every stream has room for, checked once for all of them.
            let rounds = (0..STREAMS)
                .map(|s| (ends[s] - at[s]).saturating_sub(8) / ROUND)
                .min()
                .unwrap_or(0);
            if rounds == 0 {
                break;
            }
            let [mut o0, mut o1, mut o2, mut o3] = at.map(|a| base.wrapping_add(a));
            let [mut b0, mut b1, mut b2, mut b3] = bp;
            for _ in 0..rounds {
                let (mut w0, mut w1, mut w2, mut w3) = (
                    round_word(buf, b0),
                    round_word(buf, b1),
                    round_word(buf, b2),
                    round_word(buf, b3),
                );
                for _ in 0..4 {
                    step(&mut w0, &mut o0);
                    step(&mut w1, &mut o1);
                    step(&mut w2, &mut o2);
                    step(&mut w3, &mut o3);
                }
                b0 += w0.leading_zeros() as usize;
                b1 += w1.leading_zeros() as usize;
                b2 += w2.leading_zeros() as usize;
                b3 += w3.leading_zeros() as usize;
            }
            bp = [b0, b1, b2, b3];
            at = [o0, o1, o2, o3].map(|o| o as usize - base as usize);
        }
        // Then a lookup a stream, the streams in turn, for each while it has room for a
        // word. The round loop stops when the stream that decodes fastest nears its end:
        // the streams of a frame of several vectors code parts of different entropy (one
        // a norm of a single exponent, five symbols a lookup, the next of many), and in a
        // frame of norm vectors the others then had up to a third of their symbols left,
        // which a stream alone decodes each lookup waiting for the one before (a tenth of
        // such a plane's decode time). Interleaved, the lookups of the streams still
        // going overlap.
        {
            let mut w = bp.map(|p| round_word(buf, p));
            // A lookup of a stream at `a` with `room` symbols left, 8 or more.
            let step = |w: &mut u64, p: &mut usize, a: &mut usize, room: usize| {
                debug_assert!(room >= 8);
                if w.leading_zeros() > WORD_LOOKUP_LAST {
                    *p += w.leading_zeros() as usize;
                    *w = round_word(buf, *p);
                }
                let e = t.multi[(*w as usize) & (TABLE - 1)];
                // SAFETY: a + 8 <= ends[s] <= out.len(): the callers step a stream only
                // while it has room for a word.
                unsafe {
                    std::ptr::write_unaligned(base.add(*a) as *mut u64, multi_symbols(e).to_le());
                }
                *a += multi_count(e);
                *w = w.wrapping_shr(e as u32);
            };
            // All four while all go, then those still going.
            while (0..STREAMS).all(|s| ends[s] - at[s] >= 8) {
                for s in 0..STREAMS {
                    let room = ends[s] - at[s];
                    step(&mut w[s], &mut bp[s], &mut at[s], room);
                }
            }
            loop {
                let mut going = false;
                for s in 0..STREAMS {
                    let room = ends[s] - at[s];
                    if room >= 8 {
                        going = true;
                        step(&mut w[s], &mut bp[s], &mut at[s], room);
                    }
                }
                if !going {
                    break;
                }
            }
            // Each stream's last symbols, fewer than 8: a lookup at a time, only the symbols
            // it still needs (any more in the window come from bits past the stream's last
            // code, and the stream ends there).
            for s in 0..STREAMS {
                let (mut a, end) = (at[s], ends[s]);
                while a < end {
                    if w[s].leading_zeros() > WORD_LOOKUP_LAST {
                        bp[s] += w[s].leading_zeros() as usize;
                        w[s] = round_word(buf, bp[s]);
                    }
                    let e = t.multi[(w[s] as usize) & (TABLE - 1)];
                    for k in 0..multi_count(e).min(end - a) {
                        // SAFETY: a + k < end <= out.len().
                        unsafe { *base.add(a + k) = (multi_symbols(e) >> (8 * k)) as u8 };
                    }
                    w[s] = w[s].wrapping_shr(e as u32);
                    a += multi_count(e);
                }
            }
        }
        return;
    }
    // A symbol a lookup: the four streams in turn, five symbols each a round, as far as
    // every stream goes; then each one's tail.
    let one = |w: &mut u64| -> u8 {
        // (`mask` is below TABLE: the second mask only spares a bounds check.)
        let e = t.single[(*w as usize) & t.mask & (TABLE - 1)];
        *w = w.wrapping_shr(e as u32);
        (e >> 8) as u8
    };
    const RUN: usize = 5;
    let runs = (0..STREAMS).map(|s| ends[s] - at[s]).min().unwrap_or(0) / RUN;
    let mut o = at.map(|a| base.wrapping_add(a));
    let [mut b0, mut b1, mut b2, mut b3] = bp;
    for _ in 0..runs {
        let (mut w0, mut w1, mut w2, mut w3) = (
            round_word(buf, b0),
            round_word(buf, b1),
            round_word(buf, b2),
            round_word(buf, b3),
        );
        for _ in 0..RUN {
            let (e0, e1, e2, e3) = (one(&mut w0), one(&mut w1), one(&mut w2), one(&mut w3));
            // SAFETY: stream s writes out[at[s] + i] for i < runs x RUN <= ends[s] - at[s],
            // and ends[s] <= out.len().
            unsafe {
                (*o[0], *o[1], *o[2], *o[3]) = (e0, e1, e2, e3);
                o = o.map(|p| p.add(1));
            }
        }
        b0 += w0.leading_zeros() as usize;
        b1 += w1.leading_zeros() as usize;
        b2 += w2.leading_zeros() as usize;
        b3 += w3.leading_zeros() as usize;
    }
    for (s, mut p) in [b0, b1, b2, b3].into_iter().enumerate() {
        let mut w = round_word(buf, p);
        for x in &mut out[at[s] + runs * RUN..ends[s]] {
            if w.leading_zeros() > WORD_LOOKUP_LAST {
                p += w.leading_zeros() as usize;
                w = round_word(buf, p);
            }
            *x = one(&mut w);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One code for plane `plane` of `layout` from the summed symbol counts of its
    /// frames; None for fewer than two symbols.
    fn shared_code(layout: Layout, plane: usize, hist: &[u64; 256]) -> Option<SharedCode> {
        if hist.iter().filter(|&&c| c > 0).count() < 2 {
            return None;
        }
        Some(SharedCode::from_lens(layout, plane, &code_lengths(hist)))
    }

    /// Every plane of `raw` coded, decoded and joined back; returns the exponent plane's
    /// coded bytes.
    fn round_trip(layout: Layout, raw: &[u8]) -> usize {
        let mut planes: [Vec<u8>; PLANES_MAX] = Default::default();
        split(layout, raw, &mut planes);
        let n = raw.len() / layout.width();
        let mut back: [Vec<u8>; PLANES_MAX] = Default::default();
        let mut exp_bytes = 0;
        for i in 0..layout.planes() {
            let m = layout.plane_len(i, n);
            assert_eq!(planes[i].len(), m, "{layout:?} plane {i}");
            let mut coded = Vec::new();
            encode_plane(layout, &planes[i], &mut coded);
            assert_eq!(plane_layout(&coded), Ok(layout));
            back[i] = vec![0u8; m + 8];
            decode_plane(&coded, m, &mut back[i], &mut PlaneCache::default()).expect("decodes");
            assert_eq!(back[i][..m], planes[i][..], "{layout:?} plane {i}");
            let mut portable = vec![0u8; m + 8];
            let mut cache = PlaneCache::default();
            let none = SharedTables::default();
            decode_plane_as(&coded, m, &mut portable, &mut cache, &none, Simd::Portable)
                .expect("decodes");
            assert_eq!(
                portable[..m],
                planes[i][..],
                "{layout:?} plane {i}, portable"
            );
            back[i].truncate(m);
            if i == 0 {
                exp_bytes = coded.len();
            }
        }
        let mut out = vec![0u8; raw.len()];
        join(layout, back.each_ref().map(|b| &b[..]), &mut out);
        assert_eq!(out, raw, "{layout:?}, {} bytes", raw.len());
        let mut portable = vec![0u8; raw.len()];
        let planes = back.each_ref().map(|b| &b[..]);
        join_as(layout, planes, &mut portable, Simd::Portable);
        assert_eq!(portable, raw, "{layout:?}, {} bytes, portable", raw.len());
        exp_bytes
    }

    /// A xorshift64 generator from `seed` (not zero).
    fn xorshift(seed: u64) -> impl FnMut() -> u64 {
        let mut x = seed;
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    fn gaussian_bf16(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed | 1;
        let mut u = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f32 / (1u64 << 53) as f32
        };
        (0..n)
            .flat_map(|_| {
                let v = (u() + u() + u() + u() - 2.0) * 0.02;
                ((v.to_bits() >> 16) as u16).to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn every_layout_round_trips_at_every_length_and_special_value() {
        let specials: [u32; 10] = [
            0x0000_0000,
            0x8000_0000, // -0
            0x0000_0001, // smallest denormal
            0x807f_ffff, // largest negative denormal
            0x7f80_0000, // inf
            0xff80_0000, // -inf
            0x7fc0_0001, // NaN with a payload
            0xffbf_ffff, // signalling NaN, negative
            0x3f80_0000,
            0xbf7f_ffff,
        ];
        for n in [
            0usize, 1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 95, 1000, 4099,
        ] {
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ n as u64;
            let mut vals: Vec<u32> = (0..n)
                .map(|i| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    if i % 5 == 0 {
                        specials[(x % 10) as usize]
                    } else {
                        (((x as f32 / u64::MAX as f32) - 0.5) * 0.1).to_bits()
                    }
                })
                .collect();
            let f32s: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
            round_trip(Layout::F32, &f32s);
            round_trip(Layout::F32Top, &f32s);
            let halves: Vec<u8> = vals
                .iter()
                .flat_map(|v| ((v >> 16) as u16).to_le_bytes())
                .collect();
            round_trip(Layout::Bf16, &halves);
            round_trip(Layout::F16, &halves);
            round_trip(Layout::F16Bits, &halves);
            // Every element with one exponent (the constant mode).
            vals.iter_mut()
                .for_each(|v| *v = 0x3f80_0000 | (*v & 0x807f_ffff));
            let same: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
            round_trip(Layout::F32, &same);
            round_trip(Layout::F32Top, &same);
        }
    }

    #[test]
    fn f32_frames_of_a_skewed_mantissa_top_take_the_top_split() {
        // Norm vectors: values near a centre in bf16 precision, and the same plus one in
        // f32 (as Gemma's converter adds it: the middle byte carries a bit); the top
        // split then costs less than F32's sign-and-top-7 byte, or within half a bit.
        for (n, centre) in [(256, 1.0f32), (576, 1.5), (640, 2.5), (4099, 1.0)] {
            let raw = norm_f32(n, centre, n as u64);
            assert_eq!(f32_layout(&raw, 0.03), Layout::F32Top, "{n} near {centre}");
            let plus_one: Vec<u8> = raw
                .chunks_exact(4)
                .flat_map(|x| (f32::from_le_bytes(crate::util::array(x)) + 1.0).to_le_bytes())
                .collect();
            assert_eq!(
                f32_layout(&plus_one, 0.03),
                Layout::F32Top,
                "{n} near {centre} + 1"
            );
            round_trip(Layout::F32Top, &plus_one);
        }
        // Trained weights' mantissas are nearly random: F32 keeps its layout.
        let weights: Vec<u8> = gaussian_bf16(1 << 14, 4)
            .chunks_exact(2)
            .zip(gaussian_bf16(1 << 14, 5).chunks_exact(2))
            .flat_map(|(h, l)| [l[0], l[1], h[0], h[1]])
            .collect();
        assert_eq!(f32_layout(&weights, 0.03), Layout::F32);
        assert_eq!(f32_layout(&[], 0.03), Layout::F32);
    }

    #[test]
    fn exponents_of_gaussian_weights_code_near_their_entropy() {
        let raw = gaussian_bf16(1 << 19, 3);
        let coded = round_trip(Layout::Bf16, &raw);
        let mut planes: [Vec<u8>; PLANES_MAX] = Default::default();
        split(Layout::Bf16, &raw, &mut planes);
        let e = &planes[0];
        let mut hist = [0u64; 256];
        e.iter().for_each(|&x| hist[x as usize] += 1);
        let n = e.len() as f64;
        let entropy: f64 = hist
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| -(c as f64 / n) * (c as f64 / n).log2())
            .sum();
        let bits = coded as f64 * 8.0 / n;
        assert!(
            bits < entropy + 0.05,
            "{bits:.3} bits an exponent for an entropy of {entropy:.3}"
        );
    }

    #[test]
    fn a_skewed_histogram_keeps_codes_within_the_table() {
        // Fibonacci counts make Huffman's codes as long as the symbols are many.
        let mut hist = [0u64; 256];
        let (mut a, mut b) = (1u64, 1u64);
        for h in hist.iter_mut().take(40) {
            *h = a;
            (a, b) = (b, a + b);
        }
        let lens = code_lengths(&hist);
        assert!(lens.iter().all(|&l| l as u32 <= MAX_LEN));
        let kraft: f64 = lens
            .iter()
            .filter(|&&l| l > 0)
            .map(|&l| 0.5f64.powi(l as i32))
            .sum();
        assert!((kraft - 1.0).abs() < 1e-12, "Kraft sum {kraft}");
        let exps: Vec<u8> = (0..40u8)
            .flat_map(|s| std::iter::repeat_n(s, (hist[s as usize] % 977) as usize + 1))
            .collect();
        let raw: Vec<u8> = exps.iter().flat_map(|&e| [0x55, e]).collect();
        round_trip(Layout::F16, &raw);
    }

    #[test]
    fn one_cache_serves_planes_of_different_codes_and_lengths() {
        // Frames of one decoder come with their own codes: the cached tables are used only
        // for the same code, and rebuilt with the multi-symbol part when a long plane
        // follows a short one of the same code.
        let mut cache = PlaneCache::default();
        let mut out = vec![0u8; MULTI_MIN * 2 + 8];
        let long = gaussian_bf16(MULTI_MIN * 2, 5);
        let mut planes: [Vec<u8>; PLANES_MAX] = Default::default();
        split(Layout::Bf16, &long, &mut planes);
        let short = planes[0][..1000].to_vec();
        let other: Vec<u8> = planes[1].clone();
        // One code for both lengths: four symbols in turn, a 2-bit code each.
        let cycle = |n: usize| -> Vec<u8> { (0..n).map(|i| 120 + (i % 4) as u8).collect() };
        let (few, many) = (cycle(1000), cycle(MULTI_MIN + 100));
        let mut cases = Vec::new();
        for p in [&short, &planes[0], &other, &few, &many, &short, &planes[0]] {
            let mut coded = Vec::new();
            encode_plane(Layout::Bf16, p, &mut coded);
            cases.push((p.clone(), coded));
        }
        for (p, coded) in cases.iter().chain(cases.iter().rev()) {
            decode_plane(coded, p.len(), &mut out, &mut cache).expect("decodes");
            assert_eq!(&out[..p.len()], &p[..]);
        }
    }

    #[test]
    fn long_planes_decode_with_the_table_that_pays_to_their_last_symbol() {
        // A skewed two-symbol plane packs five symbols a lookup; a plane of ~7-bit codes
        // (128 symbols in turn) packs one, so it decodes a symbol a lookup from the
        // small table. Lengths around MULTI_MIN and its multiples of 4 and 20 end the
        // streams' multi-symbol tails with 0 to 7 symbols left after the last whole word.
        let mut rand = xorshift(0x2545_f491_4f6c_dd1d);
        let mut cache = PlaneCache::default();
        for n in
            (MULTI_MIN..MULTI_MIN + 9).chain([MULTI_MIN + 41, MULTI_MIN + 80, 3 * MULTI_MIN + 7])
        {
            let skewed: Vec<u8> = (0..n)
                .map(|_| 60 + rand().is_multiple_of(10) as u8)
                .collect();
            let wide: Vec<u8> = (0..n)
                .map(|i| (i % 128) as u8 ^ (rand() % 2) as u8)
                .collect();
            for (plane, pays) in [(&skewed, true), (&wide, false)] {
                let mut coded = Vec::new();
                encode_plane(Layout::Bf16, plane, &mut coded);
                for simd in [Simd::Detect, Simd::Portable] {
                    let mut out = vec![0xa5u8; n + 8];
                    let none = SharedTables::default();
                    decode_plane_as(&coded, n, &mut out, &mut cache, &none, simd).expect("decodes");
                    assert_eq!(out[..n], plane[..], "n {n}, multi pays {pays}, {simd:?}");
                    let t = cache.tables.as_ref().expect("tables");
                    assert_eq!(t.multi_pays, pays, "n {n}");
                }
            }
        }
    }

    #[test]
    fn streams_that_decode_at_different_rates_each_end_exactly() {
        // A plane of two parts, as a frame of several norm vectors is: one stream's
        // quarter nearly one symbol (five a lookup), the others' of sixteen symbols (about
        // two a lookup). The round loop then stops with the slow streams far from their
        // ends, and they go on interleaved without the fast one; each quarter must decode
        // to its own symbols and no stream may write into its neighbour's. Every position
        // of the fast quarter, shared codes (small planes) and own codes (long ones).
        let mut rand = xorshift(0x9e37_79b9_7f4a_7c15);
        for n in [3072, 3077, MULTI_MIN + 5] {
            let q = n.div_ceil(STREAMS);
            for fast in 0..STREAMS {
                let plane: Vec<u8> = (0..n)
                    .map(|i| match i / q == fast {
                        true => 60 + rand().is_multiple_of(16) as u8,
                        false => 40 + (rand() % 16) as u8,
                    })
                    .collect();
                let mut hist = [0u64; 256];
                plane.iter().for_each(|&b| hist[b as usize] += 1);
                let codes = vec![shared_code(Layout::Bf16, 0, &hist).expect("a code")];
                let shared = SharedTables::new(&codes).expect("checks");
                let mut coded = Vec::new();
                encode_plane_with(
                    Layout::Bf16,
                    0,
                    &plane,
                    &mut coded,
                    &shared_encodings(&codes),
                );
                let mut own = Vec::new();
                encode_plane(Layout::Bf16, &plane, &mut own);
                for (coded, mode) in [(&coded, 2), (&own, 0)] {
                    assert_eq!(coded[1], mode, "n {n}");
                    for simd in [Simd::Detect, Simd::Portable] {
                        let mut out = vec![0xa5u8; n + 8];
                        let mut cache = PlaneCache::default();
                        decode_plane_as(coded, n, &mut out, &mut cache, &shared, simd)
                            .expect("decodes");
                        assert_eq!(
                            out[..n],
                            plane[..],
                            "n {n}, fast stream {fast}, mode {mode}, {simd:?}"
                        );
                    }
                }
            }
        }
    }

    /// Norm-vector-like f32 frames: values near `centre`, bf16 precision (the low planes
    /// zero), as a GGUF's F32 norms are.
    fn norm_f32(n: usize, centre: f32, seed: u64) -> Vec<u8> {
        let g = gaussian_bf16(n, seed);
        g.chunks_exact(2)
            .flat_map(|h| {
                let v =
                    centre + f32::from_bits((u16::from_le_bytes([h[0], h[1]]) as u32) << 16) * 20.0;
                (v.to_bits() & 0xffff_0000).to_le_bytes()
            })
            .collect()
    }

    #[test]
    fn small_planes_name_a_shared_code_and_decode_with_the_store_tables() {
        // A census of 24 small frames of two kinds, as a store's norm vectors.
        let frames: Vec<Vec<u8>> = (0..24u64)
            .map(|i| norm_f32(576 + 64 * (i as usize % 3), [1.0, 0.2][i as usize % 2], i))
            .collect();
        let mut hist: Vec<[u64; 256]> = vec![[0; 256]; 4];
        let mut planes: [Vec<u8>; PLANES_MAX] = Default::default();
        for f in &frames {
            split(Layout::F32, f, &mut planes);
            for (h, p) in hist.iter_mut().zip(&planes) {
                p.iter().for_each(|&b| h[b as usize] += 1);
            }
        }
        // One code for all: the two low planes are all zeros, so none for them.
        let one: Vec<SharedCode> = (0..4)
            .filter_map(|i| shared_code(Layout::F32, i, &hist[i]))
            .collect();
        assert_eq!(one.len(), 2, "{one:?}");
        // Grouped: the frames near 1 and those near 0.2 get codes of their own kind.
        let per_frame = |i: usize| -> Vec<[u64; 256]> {
            frames
                .iter()
                .map(|f| {
                    let mut planes: [Vec<u8>; PLANES_MAX] = Default::default();
                    split(Layout::F32, f, &mut planes);
                    let mut h = [0u64; 256];
                    planes[i].iter().for_each(|&b| h[b as usize] += 1);
                    h
                })
                .collect()
        };
        let codes: Vec<SharedCode> = (0..4)
            .flat_map(|i| shared_codes(Layout::F32, i, &per_frame(i)))
            .collect();
        assert!(
            codes.iter().all(|c| c.plane == 0 || c.plane == 3),
            "{codes:?}"
        );
        assert!(
            codes.len() > 2 && codes.len() <= 2 * SHARED_CODES_PER_PLANE,
            "{codes:?}"
        );
        assert_eq!(
            shared_codes(Layout::F32, 0, &per_frame(0)),
            shared_codes(Layout::F32, 0, &per_frame(0))
        );
        let enc = shared_encodings(&codes);
        let tables = SharedTables::new(&codes).expect("the census's codes check");
        let mut named = 0;
        for f in &frames {
            split(Layout::F32, f, &mut planes);
            for (i, p) in planes.iter().enumerate() {
                let mut coded = Vec::new();
                encode_plane_with(Layout::F32, i, p, &mut coded, &enc);
                named += usize::from(coded[1] == 2);
                let mut own = Vec::new();
                encode_plane(Layout::F32, p, &mut own);
                // Never more than `OWN_CODE_SAVING_MIN` over a code of its own.
                assert!(coded.len() as u64 <= own.len() as u64 + OWN_CODE_SAVING_MIN);
                for simd in [Simd::Detect, Simd::Portable] {
                    let mut out = vec![0u8; p.len() + 8];
                    let mut cache = PlaneCache::default();
                    decode_plane_as(&coded, p.len(), &mut out, &mut cache, &tables, simd)
                        .expect("decodes");
                    assert_eq!(&out[..p.len()], &p[..], "plane {i}, {simd:?}");
                }
                if coded[1] == 2 {
                    // Without the store's tables: an error that says so.
                    let mut out = vec![0u8; p.len() + 8];
                    let e = decode_plane(&coded, p.len(), &mut out, &mut PlaneCache::default())
                        .expect_err("no shared tables");
                    assert!(e.contains("shared code"), "{e}");
                }
            }
        }
        // Both coded planes of every frame name a shared code.
        assert_eq!(named, 2 * frames.len());
        // A plane with a symbol the census never saw takes a code of its own.
        split(Layout::F32, &norm_f32(576, 1.0, 99), &mut planes);
        let mut p = planes[0].clone();
        let unseen = (0..=255u8)
            .find(|&s| hist[0][s as usize] == 0)
            .expect("a free symbol");
        p[7] = unseen;
        let mut coded = Vec::new();
        encode_plane_with(Layout::F32, 0, &p, &mut coded, &enc);
        assert_eq!(coded[1], 0);
        let mut out = vec![0u8; p.len() + 8];
        decode_plane_as(
            &coded,
            p.len(),
            &mut out,
            &mut PlaneCache::default(),
            &tables,
            Simd::Detect,
        )
        .expect("decodes");
        assert_eq!(&out[..p.len()], &p[..]);
        // Named for the wrong layout: refused.
        let mut wrong = Vec::new();
        encode_plane_with(Layout::F32, 3, &planes[3], &mut wrong, &enc);
        assert_eq!(wrong[1], 2);
        wrong[0] = Layout::Bf16.tag();
        let e = decode_plane_as(
            &wrong,
            p.len(),
            &mut out,
            &mut PlaneCache::default(),
            &tables,
            Simd::Detect,
        )
        .expect_err("wrong layout");
        assert!(e.contains("made for"), "{e}");
    }

    #[test]
    fn a_shared_code_that_does_not_check_is_refused() {
        let ok = SharedCode {
            layout: Layout::Bf16.tag(),
            plane: 0,
            lens: vec![(3, 1), (7, 2), (9, 2)],
        };
        assert!(ok.check().is_ok());
        let bad = [
            SharedCode {
                lens: vec![(3, 1), (7, 2)],
                ..ok.clone()
            },
            SharedCode {
                lens: vec![(3, 1), (3, 2), (9, 2)],
                ..ok.clone()
            },
            SharedCode {
                lens: vec![(3, 1), (7, 2), (9, 12)],
                ..ok.clone()
            },
            SharedCode {
                lens: vec![(3, 0), (7, 1), (9, 1)],
                ..ok.clone()
            },
            SharedCode {
                lens: vec![(3, 1)],
                ..ok.clone()
            },
            SharedCode {
                layout: 9,
                ..ok.clone()
            },
            SharedCode {
                plane: 2,
                ..ok.clone()
            },
        ];
        for c in &bad {
            assert!(c.check().is_err(), "{c:?}");
            assert!(SharedTables::new(std::slice::from_ref(c)).is_err(), "{c:?}");
        }
    }

    #[test]
    fn damaged_planes_decode_in_bounds_or_fail() {
        // Both decoders: a symbol a lookup (short planes) and several (long ones).
        for n in [3000, MULTI_MIN + 3001] {
            damaged(n);
        }
    }

    #[test]
    fn planes_of_few_exceptions_code_sparse_and_round_trip() {
        // Exceptions at the ends, gaps on either side of the skip byte, a run of them, and
        // a base symbol that is not zero.
        let n = 3000;
        let cases: [(u8, &[usize]); 4] = [
            (0, &[0, 1, 2, 254, 510, 765, 766, 1021, 2999]),
            (0x40, &[255, 256, 1000, 1001, 1002, 2998]),
            (7, &[2999]),
            (0, &[0]),
        ];
        for (base, at) in cases {
            let mut plane = vec![base; n];
            for (k, &i) in at.iter().enumerate() {
                plane[i] = base ^ (1 + k as u8);
            }
            let mut coded = Vec::new();
            encode_plane(Layout::F32, &plane, &mut coded);
            assert_eq!(coded[1], 3, "mode of a plane with {} exceptions", at.len());
            assert_eq!(coded.len() as u64, 1 + sparse_bytes(&plane, base));
            let mut out = vec![0xaau8; n + 8];
            decode_plane(&coded, n, &mut out, &mut PlaneCache::default()).expect("decodes");
            assert_eq!(out[..n], plane[..], "base {base}, exceptions {at:?}");
        }
        // Where the exceptions are many, the Huffman code is the smaller and is kept.
        let dense: Vec<u8> = (0..n).map(|i| (i % 3 == 0) as u8).collect();
        let mut coded = Vec::new();
        encode_plane(Layout::F32, &dense, &mut coded);
        assert_eq!(coded[1], 0);
        // An exception past the plane's end, or cut in half, is refused.
        let mut out = vec![0u8; 16 + 8];
        for bad in [
            &[5u8, 3, 0, 16, 1][..],
            &[5, 3, 0, 2],
            &[5, 3, 0, 255, 0, 1],
        ] {
            let err = decode_plane(bad, 16, &mut out, &mut PlaneCache::default());
            assert!(err.is_err(), "{bad:?} decoded");
        }
        let at_end = decode_plane(&[5, 3, 0, 15, 9], 16, &mut out, &mut PlaneCache::default());
        assert_eq!(at_end, Ok(()));
        assert_eq!(out[..16], [&[0u8; 15][..], &[9]].concat());
        // Damaged sparse planes decode in bounds or fail.
        let mut plane = vec![0u8; n];
        (0..n).step_by(37).for_each(|i| plane[i] = i as u8 | 1);
        encode_plane(Layout::F32, &plane, &mut coded);
        assert_eq!(coded[1], 3);
        damage(&coded, n, &SharedTables::default());
    }

    fn damaged(n: usize) {
        let raw = gaussian_bf16(n, 9);
        let (mut planes, mut coded): ([Vec<u8>; PLANES_MAX], _) = (Default::default(), Vec::new());
        split(Layout::Bf16, &raw, &mut planes);
        encode_plane(Layout::Bf16, &planes[0], &mut coded);
        damage(&coded, n, &SharedTables::default());
        // A plane naming a shared code (mode 2), decoded with the tables.
        let mut hist = [0u64; 256];
        planes[1].iter().for_each(|&b| hist[b as usize] += 1);
        let codes = vec![shared_code(Layout::Bf16, 1, &hist).expect("a code")];
        encode_plane_with(
            Layout::Bf16,
            1,
            &planes[1],
            &mut coded,
            &shared_encodings(&codes),
        );
        assert_eq!(coded[1], 2);
        damage(&coded, n, &SharedTables::new(&codes).expect("checks"));
    }

    fn damage(coded: &[u8], n: usize, shared: &SharedTables) {
        let mut x = 0x1234_5678u64;
        let (mut out, mut cache) = (vec![0u8; n + 8], PlaneCache::default());
        for round in 0..1500 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let mut bad = coded.to_vec();
            match round % 3 {
                0 => {
                    let at = x as usize % bad.len();
                    bad[at] ^= 1 << ((x >> 32) % 8);
                }
                1 => bad.truncate(x as usize % bad.len()),
                _ => bad.iter_mut().skip(x as usize % 16).for_each(|b| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    *b = x as u8
                }),
            }
            // Wrong bytes or an error, never a panic or a read past a buffer.
            let _ = decode_plane_as(&bad, n, &mut out, &mut cache, shared, Simd::Detect);
        }
    }
}
