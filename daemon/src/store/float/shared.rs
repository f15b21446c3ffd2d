//! The codes a store's small float frames share (format 8): made at pack time from the
//! census of their symbol counts (`shared_codes`), kept in the manifest (`SharedCode`),
//! and built once into the encoder's (`SharedEncoding`) and the decoder's
//! (`SharedTables`) forms.

use super::error::FloatError;
use super::huffman::{canonical, code_lengths, fill_multi, fill_single, is_complete, Tables};
use super::huffman::{MAX_LEN, TABLES_BYTES};
use super::layout::Layout;
use super::plane::{own_code_bytes, shared_code_bytes, OWN_CODE_SAVING_MIN};
use serde::{Deserialize, Serialize};

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
    pub(super) fn from_lens(layout: Layout, plane: usize, lens: &[u8; 256]) -> SharedCode {
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
    pub fn check(&self) -> Result<(Layout, [u8; 256]), FloatError> {
        let layout =
            Layout::from_tag(self.layout).ok_or(FloatError::UnknownLayout { tag: self.layout })?;
        if self.plane as usize >= layout.planes() {
            return Err(FloatError::NoSuchPlane {
                plane: self.plane,
                layout,
                planes: layout.planes(),
            });
        }
        let mut lens = [0u8; 256];
        for &(symbol, len) in &self.lens {
            if len == 0 || len as u32 > MAX_LEN {
                return Err(FloatError::CodeLength { symbol, len });
            }
            if lens[symbol as usize] != 0 {
                return Err(FloatError::SymbolTwice { symbol });
            }
            lens[symbol as usize] = len;
        }
        if self.lens.len() < 2 || !is_complete(&lens) {
            return Err(FloatError::NotPrefixCode);
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
    let census = Census::new(frames);
    if census.frames.is_empty() {
        return Vec::new();
    }
    let mut codes = vec![census.code_of(0..census.frames.len())];
    let mut best = census.grouping(&codes);
    // No code at all where one costs more than it saves (a few tiny frames).
    if best.total >= census.alone.iter().sum::<u64>() {
        return Vec::new();
    }
    while codes.len() < SHARED_CODES_PER_PLANE {
        // The first frame of the largest excess seeds a new code.
        let Some((seed, _)) = best
            .excess
            .iter()
            .enumerate()
            .filter(|&(_, &e)| e > 0)
            .max_by_key(|&(i, &e)| (e, std::cmp::Reverse(i)))
        else {
            break;
        };
        let trial = census.with_code_for(&codes, seed);
        let grouping = census.grouping(&trial);
        if grouping.total >= best.total {
            break;
        }
        (codes, best) = (trial, grouping);
    }
    // Only the codes some frame takes.
    codes
        .iter()
        .enumerate()
        .filter(|&(k, _)| best.pick.contains(&Some(k)))
        .map(|(_, lens)| SharedCode::from_lens(layout, plane, lens))
        .collect()
}

/// The small frames `shared_codes` groups (those of two symbols or more): each one's
/// symbol counts, its bytes with a code of its own (what `encode_plane_with` counts), and
/// its bytes without a shared code (a code of its own and the table build it costs, in
/// bytes, or kept raw where that is less).
struct Census<'a> {
    frames: Vec<&'a [u64; 256]>,
    own: Vec<u64>,
    alone: Vec<u64>,
}

/// How a set of codes serves a census: the total bytes (the frames' and each code's in
/// the manifest), each frame's code (None: none) and its excess over a code of its own.
struct Grouping {
    total: u64,
    pick: Vec<Option<usize>>,
    excess: Vec<u64>,
}

/// Symbols of `h` that occur.
fn symbols_used(h: &[u64; 256]) -> u64 {
    h.iter().filter(|&&c| c > 0).count() as u64
}

/// Bits of the symbols of `h` coded with lengths `lens`.
fn coded_bits(h: &[u64; 256], lens: &[u8; 256]) -> u64 {
    h.iter().zip(lens).map(|(&c, &l)| c * l as u64).sum()
}

/// A frame's bytes naming the shared code of `lens` (None: the code lacks a symbol of it).
fn shared_cost(h: &[u64; 256], lens: &[u8; 256]) -> Option<u64> {
    h.iter()
        .zip(lens)
        .all(|(&c, &l)| c == 0 || l > 0)
        .then(|| shared_code_bytes(coded_bits(h, lens)))
}

impl<'a> Census<'a> {
    fn new(frames: &'a [[u64; 256]]) -> Census<'a> {
        let frames: Vec<&[u64; 256]> = frames.iter().filter(|h| symbols_used(h) >= 2).collect();
        let own: Vec<u64> = frames
            .iter()
            .map(|h| own_code_bytes(symbols_used(h), coded_bits(h, &code_lengths(h))))
            .collect();
        let alone: Vec<u64> = frames
            .iter()
            .zip(&own)
            .map(|(h, &own)| (own + OWN_CODE_SAVING_MIN).min(h.iter().sum()))
            .collect();
        Census { frames, own, alone }
    }

    /// The code of the summed counts of frames `members`.
    fn code_of(&self, members: impl Iterator<Item = usize>) -> [u8; 256] {
        let mut sum = [0u64; 256];
        for i in members {
            sum.iter_mut()
                .zip(self.frames[i])
                .for_each(|(s, &c)| *s += c);
        }
        code_lengths(&sum)
    }

    /// Each frame served by the code of `codes` that costs it fewest bytes, or by none
    /// where none costs it less than `alone`.
    fn grouping(&self, codes: &[[u8; 256]]) -> Grouping {
        let mut total: u64 = codes
            .iter()
            .map(|l| 4 + 2 * l.iter().filter(|&&x| x > 0).count() as u64)
            .sum();
        let (mut pick, mut excess) = (Vec::with_capacity(self.frames.len()), Vec::new());
        for ((h, &own), &alone) in self.frames.iter().zip(&self.own).zip(&self.alone) {
            let best = codes
                .iter()
                .enumerate()
                .filter_map(|(k, l)| shared_cost(h, l).map(|c| (c, k)))
                .min();
            match best.filter(|&(c, _)| c <= alone) {
                Some((c, k)) => {
                    total += c;
                    pick.push(Some(k));
                    excess.push(c.saturating_sub(own));
                }
                None => {
                    total += alone;
                    pick.push(None);
                    excess.push(alone.saturating_sub(own));
                }
            }
        }
        Grouping {
            total,
            pick,
            excess,
        }
    }

    /// `codes` and a new one seeded with frame `seed`, after four rounds of moving each
    /// frame to the code that costs it fewest bytes and remaking each code from its frames.
    fn with_code_for(&self, codes: &[[u8; 256]], seed: usize) -> Vec<[u8; 256]> {
        let mut trial = codes.to_vec();
        trial.push(self.code_of(std::iter::once(seed)));
        for _ in 0..4 {
            let pick = self.grouping(&trial).pick;
            for (k, code) in trial.iter_mut().enumerate() {
                let mut members = (0..self.frames.len())
                    .filter(|&i| pick[i] == Some(k))
                    .peekable();
                if members.peek().is_some() {
                    *code = self.code_of(members);
                }
            }
        }
        trial
    }
}

/// A shared code as the encoder uses it: its index in the manifest, what it is for, and
/// its lengths and codes.
pub struct SharedEncoding {
    pub(super) index: u8,
    pub(super) layout: Layout,
    pub(super) plane: u8,
    pub(super) lens: [u8; 256],
    pub(super) codes: [(u32, u8); 256],
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
    pub fn new(codes: &[SharedCode]) -> Result<SharedTables, FloatError> {
        if codes.len() > SHARED_CODES_MAX {
            return Err(FloatError::TooManySharedCodes {
                count: codes.len(),
                max: SHARED_CODES_MAX,
            });
        }
        let codes = codes
            .iter()
            .enumerate()
            .map(|(index, c)| {
                let (layout, lens) = c.check().map_err(|e| FloatError::SharedCode {
                    index,
                    error: Box::new(e),
                })?;
                let mut t = Tables::empty();
                fill_single(&mut t, &lens, MAX_LEN);
                fill_multi(&mut t);
                Ok((layout, t))
            })
            .collect::<Result<_, FloatError>>()?;
        Ok(SharedTables { codes })
    }

    /// Shared code `index`: the layout it was made for, and its tables.
    #[inline]
    pub(super) fn get(&self, index: u8) -> Option<(Layout, &Tables)> {
        self.codes.get(index as usize).map(|(l, t)| (*l, &**t))
    }

    #[inline]
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
