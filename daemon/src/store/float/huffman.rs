//! Length-limited canonical Huffman codes: the code lengths of a histogram
//! (`code_lengths`), their canonical codes (`canonical`), and the decoding tables of a
//! complete code (`Tables`: a symbol a lookup, and up to five).

/// The longest code: the decoding table has 2^11 entries (4 KiB, in L1).
pub(super) const MAX_LEN: u32 = 11;
pub(super) const TABLE: usize = 1 << MAX_LEN;

/// Code lengths (0: unused) of a Huffman code for `hist` whose longest code has at most
/// `MAX_LEN` bits: Huffman's merge on the counts, halved (never below 1) until the
/// longest code fits.
pub(super) fn code_lengths(hist: &[u64; 256]) -> [u8; 256] {
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
pub(super) fn canonical(lens: &[u8; 256]) -> [(u32, u8); 256] {
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

/// Whether `lens` (0: unused; each at most `MAX_LEN`) make a complete prefix code: a
/// Kraft sum of exactly 1, so every table entry gets a symbol.
#[inline]
pub(super) fn is_complete(lens: &[u8; 256]) -> bool {
    let kraft: u32 = lens
        .iter()
        .filter(|&&l| l > 0)
        .map(|&l| 1u32 << (MAX_LEN - l as u32))
        .sum();
    kraft == TABLE as u32
}

/// The decoding tables of a complete code: per 11-bit window, its first symbol and that
/// code's length (`single`: length | symbol << 8), and as many whole codes as fit in the
/// window, up to five (`multi`: their total length in bits 0..6, the symbols in bytes
/// 1..6, their count in bits 61..64; `multi_symbols`, `multi_count`). The length is in the
/// low bits so the decoder shifts its bits by the entry itself (a shift takes only the
/// amount's low 6 bits, x86's own): one operation fewer on the chain of dependent lookups
/// that bounds a stream's rate.
pub(super) struct Tables {
    pub(super) single: [u16; TABLE],
    pub(super) multi: [u64; TABLE],
    /// `single` is filled for windows of this mask's bits (the code's longest length, or
    /// all 11 with `multi`): a short plane's few symbols need a small table.
    pub(super) mask: usize,
    /// `multi`'s lookups yield enough symbols to pay for its size (`fill_multi`).
    pub(super) multi_pays: bool,
}

impl Tables {
    /// Tables of no code yet (`fill_single` fills them).
    pub(super) fn empty() -> Box<Tables> {
        Box::new(Tables {
            single: [0; TABLE],
            multi: [0; TABLE],
            mask: 0,
            multi_pays: false,
        })
    }
}

/// Host bytes of one plane's decoding tables (`PlaneCache`, and each shared code's).
pub const TABLES_BYTES: usize = std::mem::size_of::<Tables>();

/// Symbols of one `multi` entry at most.
pub(super) const MULTI_SYMBOLS: u32 = 5;

/// A `multi` entry's symbol count.
#[inline(always)]
pub(super) fn multi_count(e: u64) -> usize {
    (e >> 61) as usize
}

/// A `multi` entry's symbols, in its low bytes (the bytes past its count are garbage).
#[inline(always)]
pub(super) fn multi_symbols(e: u64) -> u64 {
    e >> 8
}

/// The single-symbol table of `lens` into `t` for windows of `width` bits, at least the
/// longest code (its `multi` untouched).
pub(super) fn fill_single(t: &mut Tables, lens: &[u8; 256], width: u32) {
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
pub(super) fn fill_multi(t: &mut Tables) {
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
