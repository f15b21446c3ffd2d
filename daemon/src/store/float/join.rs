//! A frame's elements put back together from their planes (`join`): a portable loop per
//! layout, and AVX2 copies of the `F16Bits`, `F32` and `F32Top` joins chosen at run time.

use super::layout::{bits_at, Layout, BITS_CHUNK, BITS_CHUNK_BYTES, PLANES_MAX};
use super::Simd;

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
