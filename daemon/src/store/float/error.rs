//! What is wrong with a coded plane or a shared code (`FloatError`).

use super::layout::Layout;

/// A coded plane that does not decode, or a shared code that does not check, and what in
/// its bytes is wrong. The text names no codec: a frame's fault (`FrameFault`) adds
/// "float codec: ", a manifest's the shared code's index. The decoder makes one only on
/// its error paths (`let ... else`, not `ok_or`): the `SharedCode` variant boxes, so an
/// eager value costs a drop on every plane (a few percent of small frames' decode time).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FloatError {
    #[error("an empty coded plane")]
    EmptyPlane,
    #[error("unknown layout {tag}")]
    UnknownLayout { tag: u8 },
    #[error("unknown mode {mode}")]
    UnknownMode { mode: u8 },
    #[error("{room} bytes of room for a plane of {symbols} symbols")]
    NoRoom { room: usize, symbols: usize },
    #[error("no mode")]
    NoMode,
    #[error("no constant symbol")]
    NoConstant,
    #[error("no shared code")]
    NoSharedCode,
    #[error("the plane names shared code {index}, and the store has {count}")]
    SharedCodeMissing { index: u8, count: usize },
    #[error("a plane of {layout:?} names shared code {index}, made for {made_for:?}")]
    SharedCodeLayout {
        layout: Layout,
        index: u8,
        made_for: Layout,
    },
    #[error("stream {stream}'s size cut short")]
    StreamSizeCut { stream: usize },
    #[error("stream sizes cut short")]
    StreamSizesCut,
    #[error("stream {stream} runs past the plane ({len} bytes from byte {start} of {total})")]
    StreamPastPlane {
        stream: usize,
        start: usize,
        len: usize,
        total: usize,
    },
    #[error("no base symbol")]
    NoBase,
    #[error("a sparse plane ends inside an exception (element {element})")]
    SparseCut { element: usize },
    #[error("a sparse plane's exception at element {element} of {symbols}")]
    SparseOutOfRange { element: usize, symbols: usize },
    #[error("no symbol count")]
    NoSymbolCount,
    #[error("symbol table cut short: {symbols} symbols take {} bytes, {found} left", 2 * .symbols)]
    SymbolTableCut { symbols: usize, found: usize },
    #[error("code length {len} for symbol {symbol}")]
    CodeLength { symbol: u8, len: u8 },
    #[error("symbol {symbol} twice")]
    SymbolTwice { symbol: u8 },
    #[error("the code lengths are not a complete prefix code")]
    NotPrefixCode,
    #[error("plane {plane} of {layout:?}, which has {planes}")]
    NoSuchPlane {
        plane: u8,
        layout: Layout,
        planes: usize,
    },
    #[error("{count} shared codes, at most {max}")]
    TooManySharedCodes { count: usize, max: usize },
    #[error("shared code {index}: {error}")]
    SharedCode {
        index: usize,
        error: Box<FloatError>,
    },
}
