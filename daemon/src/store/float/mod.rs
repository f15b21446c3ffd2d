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
//! The parts: `layout.rs` (which bits of an element go to which plane, and the split),
//! `join.rs` (the planes back into elements), `huffman.rs` (code lengths, canonical codes,
//! decoding tables), `plane.rs` (a coded plane's modes and bytes), `shared.rs` (the codes
//! a store's small frames share), `encode.rs`, `decode.rs` (a plane's header and modes)
//! and `streams.rs` (the four-stream decoding loop), `error.rs` (`FloatError`). The small
//! helpers a plane's decode calls across these files are `#[inline]`, as they could be
//! inlined when they were one file.
//!
//! Every read is bounds checked and a stream decodes exactly its element count whatever
//! its bytes, so damaged input decodes to wrong bytes (which the frame checksum catches)
//! and never past a buffer.

mod decode;
mod encode;
mod error;
mod huffman;
mod join;
mod layout;
mod plane;
mod shared;
mod streams;
#[cfg(test)]
mod tests;

pub use decode::{decode_plane, decode_plane_as, plane_layout, PlaneCache};
pub use encode::{encode_plane, encode_plane_with};
pub use error::FloatError;
pub use huffman::TABLES_BYTES;
pub use join::{join, join_as};
pub use layout::{f32_layout, split, Layout, PLANES_MAX};
pub use plane::PlaneMode;
pub use shared::{
    shared_codes, shared_encodings, SharedCode, SharedEncoding, SharedTables, SHARED_CODES_MAX,
    SHARED_CODES_PER_PLANE,
};

/// Whether the decoder may use the CPU's extensions (BMI2, AVX2) where it has them, or
/// must run the portable code (the tests check that both agree).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Simd {
    Detect,
    Portable,
}
