//! The decoder's side of a coded plane: its header read and checked, per mode
//! (`PlaneMode`), and its streams handed to the hot loop (`streams.rs`) with the decoding
//! tables of its code: the store's shared ones, or its own, kept for the next plane of
//! the same code (`PlaneCache`).

use super::error::FloatError;
use super::huffman::{fill_multi, fill_single, is_complete, Tables, MAX_LEN};
use super::layout::Layout;
use super::plane::{take_varint, PlaneMode, SPARSE_SKIP, STREAMS};
use super::shared::SharedTables;
use super::streams::{symbols, Streams};
use super::Simd;

/// Planes shorter than this decode a symbol a lookup (`Tables::single`): building the
/// multi-symbol table costs more than it saves there.
pub(super) const MULTI_MIN: usize = 1 << 14;

/// The layout a coded plane names (its first byte).
pub fn plane_layout(coded: &[u8]) -> Result<Layout, FloatError> {
    let Some(&tag) = coded.first() else {
        return Err(FloatError::EmptyPlane);
    };
    match Layout::from_tag(tag) {
        Some(layout) => Ok(layout),
        None => Err(FloatError::UnknownLayout { tag }),
    }
}

/// Decodes one coded plane of `n` symbols (`encode_plane`'s bytes, with no shared code)
/// into `out[..n]` (`out` has 8 bytes of room past them at least). The error says what in
/// the bytes is wrong.
pub fn decode_plane(
    coded: &[u8],
    n: usize,
    out: &mut [u8],
    cache: &mut PlaneCache,
) -> Result<(), FloatError> {
    decode_plane_as(coded, n, out, cache, &SharedTables::default(), Simd::Detect)
}

/// The decoding tables of the last code a plane decoder saw: the frames of a tensor often
/// share one code, and building the tables costs as much as a few thousand symbols.
pub struct PlaneCache {
    lens: [u8; 256],
    /// Built with the multi-symbol part too.
    multi: bool,
    pub(super) tables: Option<Box<Tables>>,
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

impl PlaneCache {
    /// The tables of the code of `lens` (with the multi-symbol part for `multi`): the
    /// cached ones where they are of that code (and have that part if it is wanted), else
    /// built over them.
    fn tables_for(&mut self, lens: &[u8; 256], multi: bool) -> &Tables {
        let fresh = self.tables.is_none() || self.lens != *lens || (multi && !self.multi);
        let table = self.tables.get_or_insert_with(Tables::empty);
        if fresh {
            let width = if multi {
                MAX_LEN
            } else {
                lens.iter().copied().max().unwrap_or(1) as u32
            };
            fill_single(table, lens, width);
            if multi {
                fill_multi(table);
            }
            self.lens = *lens;
            self.multi = multi;
        }
        table
    }
}

/// `decode_plane` with the store's shared codes (`PlaneMode::Shared` names one), choosing
/// the code path.
pub fn decode_plane_as(
    coded: &[u8],
    n: usize,
    out: &mut [u8],
    cache: &mut PlaneCache,
    shared: &SharedTables,
    simd: Simd,
) -> Result<(), FloatError> {
    if out.len() < n + 8 {
        return Err(FloatError::NoRoom {
            room: out.len(),
            symbols: n,
        });
    }
    let layout = plane_layout(coded)?;
    let Some((&mode, body)) = coded[1..].split_first() else {
        return Err(FloatError::NoMode);
    };
    match PlaneMode::try_from(mode)? {
        PlaneMode::Huffman => decode_own(body, n, out, cache, simd),
        PlaneMode::Constant => {
            let Some(&e) = body.first() else {
                return Err(FloatError::NoConstant);
            };
            out[..n].fill(e);
            Ok(())
        }
        PlaneMode::Shared => decode_shared(layout, body, n, out, shared, simd),
        PlaneMode::Sparse => decode_sparse(body, n, out),
    }
}

/// A plane with a code of its own (`body`: its bytes past the mode).
fn decode_own(
    body: &[u8],
    n: usize,
    out: &mut [u8],
    cache: &mut PlaneCache,
    simd: Simd,
) -> Result<(), FloatError> {
    let (used, lens) = own_code(body)?;
    let multi = n >= MULTI_MIN;
    let table = cache.tables_for(&lens, multi);
    let at = 2 + 2 * used;
    let Some(sizes) = body.get(at..at + 4 * (STREAMS - 1)) else {
        return Err(FloatError::StreamSizesCut);
    };
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
}

/// A plane's own code (`body`: its bytes past the mode): the number of symbols it has and
/// their code lengths, which must be 1 to `MAX_LEN` bits and make a complete prefix code.
fn own_code(body: &[u8]) -> Result<(usize, [u8; 256]), FloatError> {
    let Some(&[a, b]) = body.first_chunk::<2>() else {
        return Err(FloatError::NoSymbolCount);
    };
    let used = u16::from_le_bytes([a, b]) as usize;
    let Some(pairs) = body.get(2..2 + 2 * used) else {
        return Err(FloatError::SymbolTableCut {
            symbols: used,
            found: body.len() - 2,
        });
    };
    let mut lens = [0u8; 256];
    for p in pairs.chunks_exact(2) {
        if p[1] == 0 || p[1] as u32 > MAX_LEN {
            return Err(FloatError::CodeLength {
                symbol: p[0],
                len: p[1],
            });
        }
        lens[p[0] as usize] = p[1];
    }
    // A complete prefix code (Kraft sum exactly 1): every table entry gets a symbol.
    if !is_complete(&lens) {
        return Err(FloatError::NotPrefixCode);
    }
    Ok((used, lens))
}

/// A plane of `layout` naming one of the store's `shared` codes (`body`: its bytes past
/// the mode).
fn decode_shared(
    layout: Layout,
    body: &[u8],
    n: usize,
    out: &mut [u8],
    shared: &SharedTables,
    simd: Simd,
) -> Result<(), FloatError> {
    let Some(&index) = body.first() else {
        return Err(FloatError::NoSharedCode);
    };
    let Some((made_for, table)) = shared.get(index) else {
        return Err(FloatError::SharedCodeMissing {
            index,
            count: shared.len(),
        });
    };
    if made_for != layout {
        return Err(FloatError::SharedCodeLayout {
            layout,
            index,
            made_for,
        });
    }
    let mut at = 1;
    let mut sizes = [0usize; STREAMS - 1];
    for (stream, size) in sizes.iter_mut().enumerate() {
        let Some(v) = take_varint(body, &mut at) else {
            return Err(FloatError::StreamSizeCut { stream });
        };
        *size = v as usize;
    }
    symbols_of(&body[at..], sizes, n, table, true, out, simd)
}

/// A sparse plane (`body`: its bytes past the mode): the base symbol everywhere, then
/// each exception in its place.
fn decode_sparse(body: &[u8], n: usize, out: &mut [u8]) -> Result<(), FloatError> {
    let Some((&base, mut list)) = body.split_first() else {
        return Err(FloatError::NoBase);
    };
    out[..n].fill(base);
    let mut at = 0usize;
    while let Some((&gap, rest)) = list.split_first() {
        at += gap as usize;
        if gap as usize == SPARSE_SKIP {
            list = rest;
            continue;
        }
        let Some((&e, rest)) = rest.split_first() else {
            return Err(FloatError::SparseCut { element: at });
        };
        if at >= n {
            return Err(FloatError::SparseOutOfRange {
                element: at,
                symbols: n,
            });
        }
        out[at] = e;
        at += 1;
        list = rest;
    }
    Ok(())
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
) -> Result<(), FloatError> {
    let mut bp = [0usize; STREAMS];
    let mut start = 0usize;
    for (stream, b) in bp.iter_mut().enumerate() {
        let len = match sizes.get(stream) {
            Some(&len) => len,
            None => streams.len().saturating_sub(start),
        };
        let Some(end) = start.checked_add(len).filter(|&e| e <= streams.len()) else {
            return Err(FloatError::StreamPastPlane {
                stream,
                start,
                len,
                total: streams.len(),
            });
        };
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
