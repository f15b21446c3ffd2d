//! The encoder: a plane's symbols coded in the mode that comes to the fewest bytes
//! (`encode_plane_with`: a code of its own, a shared one, sparse or constant).

use super::huffman::{canonical, code_lengths};
use super::layout::Layout;
use super::plane::{
    own_code_bytes, put_varint, shared_code_bytes, sparse_bytes, PlaneMode, OWN_CODE_SAVING_MIN,
    SPARSE_SKIP, STREAMS,
};
use super::shared::SharedEncoding;

/// Codes one byte plane of a frame of `layout` (`exps`: its symbols) into `out`, header
/// and streams, with a code of its own.
pub fn encode_plane(layout: Layout, exps: &[u8], out: &mut Vec<u8>) {
    encode_plane_with(layout, 0, exps, out, &[]);
}

/// `encode_plane` for plane `plane` of its frame, which may instead name one of the
/// store's `shared` codes (`PlaneMode::Shared`): the one whose header and bits come to
/// fewer bytes.
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
        out.push(PlaneMode::Constant as u8);
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
        put_sparse(exps, base, out);
    } else if let Some((_, c)) = best.filter(|&(bytes, _)| bytes <= own + OWN_CODE_SAVING_MIN) {
        put_shared(exps, c, out);
    } else {
        put_own(exps, used, &lens, out);
    }
}

/// `exps` as a sparse plane (`PlaneMode::Sparse`, `sparse_bytes`) onto `out`.
fn put_sparse(exps: &[u8], base: u8, out: &mut Vec<u8>) {
    out.push(PlaneMode::Sparse as u8);
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
}

/// `exps` coded with shared code `c` (`PlaneMode::Shared`) onto `out`.
fn put_shared(exps: &[u8], c: &SharedEncoding, out: &mut Vec<u8>) {
    out.push(PlaneMode::Shared as u8);
    out.push(c.index);
    let sizes_at = out.len();
    let sizes = write_streams(exps, &c.codes, out);
    let mut varints = Vec::with_capacity(3 * 5);
    for &len in &sizes[..STREAMS - 1] {
        put_varint(&mut varints, len);
    }
    out.splice(sizes_at..sizes_at, varints);
}

/// `exps` coded with its own code of `used` symbols of lengths `lens`
/// (`PlaneMode::Huffman`) onto `out`.
fn put_own(exps: &[u8], used: usize, lens: &[u8; 256], out: &mut Vec<u8>) {
    out.push(PlaneMode::Huffman as u8);
    let codes = canonical(lens);
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
