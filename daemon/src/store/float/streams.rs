//! The hot loop: a plane's four interleaved streams decoded into its symbols, a table
//! lookup at a time (`Tables`), up to five symbols a lookup where the code's `multi` table
//! pays. A BMI2 copy is chosen at run time.

use super::huffman::{multi_count, multi_symbols, Tables, MAX_LEN, MULTI_SYMBOLS, TABLE};
use super::plane::STREAMS;
use super::Simd;

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

/// A plane's four streams: their bytes, each one's bit position in them, and each one's
/// next and end element.
pub(super) struct Streams<'a> {
    pub(super) buf: &'a [u8],
    pub(super) bp: [usize; STREAMS],
    pub(super) at: [usize; STREAMS],
    pub(super) ends: [usize; STREAMS],
}

/// Stream s's symbols into `out[at[s]..ends[s]]` (`ends[s] + 8 <= out.len()`). With
/// `multi` (planes of `MULTI_MIN` symbols or more, and shared codes, where the code's
/// `multi` table pays): rounds of four table lookups a stream from one word of its bits
/// (4 x 11 <= 57 bits), each up to five symbols, written as one 8-byte word (the bytes
/// past its symbols land on the stream's next ones, written over later), the four streams
/// in turn while each has room for a round and a word; then a lookup a stream, in turn,
/// for the streams that still have room for a word; then each stream's tail, still up to
/// five symbols a lookup. Otherwise a symbol a lookup, five a stream a round (5 x 11 <= 57
/// bits), the streams in turn as far as all go, then each one's tail.
#[inline]
pub(super) fn symbols(s: Streams<'_>, t: &Tables, multi: bool, out: &mut [u8], simd: Simd) {
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

/// `symbols` where the CPU has BMI2 and LZCNT: shifts by a register amount (SHRX) that
/// leave CL alone and take the amount's low 6 bits as they are, and a leading-zero count
/// without a branch for zero.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "bmi2,lzcnt")]
unsafe fn symbols_bmi2(s: Streams<'_>, t: &Tables, multi: bool, out: &mut [u8]) {
    symbols_any(s, t, multi, out);
}

/// `symbols` on the code path of its caller (the steps below are all inlined into it, so
/// `symbols_bmi2`'s copy is compiled for BMI2 whole).
#[inline(always)]
fn symbols_any(mut s: Streams<'_>, t: &Tables, multi: bool, out: &mut [u8]) {
    debug_assert!(s.ends.iter().all(|&e| e + 4 <= out.len()));
    if multi {
        multi_rounds(&mut s, t, out);
        let mut w = s.bp.map(|p| round_word(s.buf, p));
        multi_interleaved(&mut s, &mut w, t, out);
        multi_tails(&mut s, &mut w, t, out);
    } else {
        single(s, t, out);
    }
}

/// `multi`'s rounds: four lookups a stream from one word of its bits, the four streams in
/// turn, while every stream has room for a round and a word.
#[inline(always)]
fn multi_rounds(s: &mut Streams<'_>, t: &Tables, out: &mut [u8]) {
    let (buf, ends) = (s.buf, s.ends);
    let base = out.as_mut_ptr();
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
            .map(|k| (ends[k] - s.at[k]).saturating_sub(8) / ROUND)
            .min()
            .unwrap_or(0);
        if rounds == 0 {
            break;
        }
        let [mut o0, mut o1, mut o2, mut o3] = s.at.map(|a| base.wrapping_add(a));
        let [mut b0, mut b1, mut b2, mut b3] = s.bp;
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
        s.bp = [b0, b1, b2, b3];
        s.at = [o0, o1, o2, o3].map(|o| o as usize - base as usize);
    }
}

/// `multi` after the rounds: a lookup a stream, the streams in turn, for each while it has
/// room for a word (`w`: each stream's round word). The round loop stops when the stream
/// that decodes fastest nears its end: the streams of a frame of several vectors code
/// parts of different entropy (one a norm of a single exponent, five symbols a lookup, the
/// next of many), and in a frame of norm vectors the others then had up to a third of
/// their symbols left, which a stream alone decodes each lookup waiting for the one before
/// (a tenth of such a plane's decode time). Interleaved, the lookups of the streams still
/// going overlap.
#[inline(always)]
fn multi_interleaved(s: &mut Streams<'_>, w: &mut [u64; STREAMS], t: &Tables, out: &mut [u8]) {
    let (buf, ends) = (s.buf, s.ends);
    let base = out.as_mut_ptr();
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
    let (bp, at) = (&mut s.bp, &mut s.at);
    // All four while all go, then those still going.
    while (0..STREAMS).all(|k| ends[k] - at[k] >= 8) {
        for k in 0..STREAMS {
            let room = ends[k] - at[k];
            step(&mut w[k], &mut bp[k], &mut at[k], room);
        }
    }
    loop {
        let mut going = false;
        for k in 0..STREAMS {
            let room = ends[k] - at[k];
            if room >= 8 {
                going = true;
                step(&mut w[k], &mut bp[k], &mut at[k], room);
            }
        }
        if !going {
            break;
        }
    }
}

/// `multi`'s last symbols of each stream, fewer than 8: a lookup at a time, only the
/// symbols it still needs (any more in the window come from bits past the stream's last
/// code, and the stream ends there).
#[inline(always)]
fn multi_tails(s: &mut Streams<'_>, w: &mut [u64; STREAMS], t: &Tables, out: &mut [u8]) {
    let buf = s.buf;
    let base = out.as_mut_ptr();
    for (k, w) in w.iter_mut().enumerate() {
        let (mut a, end) = (s.at[k], s.ends[k]);
        while a < end {
            if w.leading_zeros() > WORD_LOOKUP_LAST {
                s.bp[k] += w.leading_zeros() as usize;
                *w = round_word(buf, s.bp[k]);
            }
            let e = t.multi[(*w as usize) & (TABLE - 1)];
            for j in 0..multi_count(e).min(end - a) {
                // SAFETY: a + j < end <= out.len().
                unsafe { *base.add(a + j) = (multi_symbols(e) >> (8 * j)) as u8 };
            }
            *w = w.wrapping_shr(e as u32);
            a += multi_count(e);
        }
    }
}

/// A symbol a lookup: the four streams in turn, five symbols each a round, as far as
/// every stream goes; then each one's tail.
#[inline(always)]
fn single(s: Streams<'_>, t: &Tables, out: &mut [u8]) {
    let Streams { buf, bp, at, ends } = s;
    let one = |w: &mut u64| -> u8 {
        // (`mask` is below TABLE: the second mask only spares a bounds check.)
        let e = t.single[(*w as usize) & t.mask & (TABLE - 1)];
        *w = w.wrapping_shr(e as u32);
        (e >> 8) as u8
    };
    const RUN: usize = 5;
    let runs = (0..STREAMS).map(|k| ends[k] - at[k]).min().unwrap_or(0) / RUN;
    let mut o = at.map(|a| out.as_mut_ptr().wrapping_add(a));
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
    for (k, mut p) in [b0, b1, b2, b3].into_iter().enumerate() {
        let mut w = round_word(buf, p);
        for x in &mut out[at[k] + runs * RUN..ends[k]] {
            if w.leading_zeros() > WORD_LOOKUP_LAST {
                p += w.leading_zeros() as usize;
                w = round_word(buf, p);
            }
            *x = one(&mut w);
        }
    }
}
