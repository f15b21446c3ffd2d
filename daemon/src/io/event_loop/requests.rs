//! What the loop keeps of a request: its staging slot's state, its read chunks and
//! frames while active, its place while it waits for a slot, and its reads in flight; and
//! how a request's frames are cut into read chunks.

use crate::hostbuf::IO_ALIGN;
use std::ops::Range;
use std::time::Instant;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SlotState {
    Free,
    Loading,
    /// Ready and handed to the caller of ticket `.0` (or waiting to be).
    Held(u64),
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum FrameState {
    Waiting,
    AtWorker,
    Done,
}

pub(super) struct Chunk {
    pub(super) offset: u64,
    pub(super) len: usize,
    pub(super) buf: Option<usize>,
    pub(super) done: bool,
    pub(super) frames: Range<usize>,
}

pub(super) struct Active {
    pub(super) ticket: u64,
    pub(super) unit: usize,
    /// Read before requests that were not urgent (`Msg::Request`).
    pub(super) urgent: bool,
    /// Raw offset in the unit of the slot's first byte: 0 for a whole unit, the first
    /// frame's for a part.
    pub(super) raw_base: u64,
    /// The unit is stored as raw: its chunks are read straight into the staging slot (no
    /// read buffer, no copy) and its frames only have their checksums checked.
    pub(super) direct: bool,
    pub(super) chunks: Vec<Chunk>,
    pub(super) next_chunk: usize,
    pub(super) frames: Vec<FrameState>,
    pub(super) frames_left: usize,
    /// Frames done from the first one on, without a gap (the decoded prefix).
    pub(super) prefix: usize,
    /// A decoded prefix was published: a consumer may be copying out of the slot.
    pub(super) progressed: bool,
    pub(super) at_worker: usize,
    pub(super) ops: usize,
    pub(super) standing: Standing,
    /// When it was admitted, or last had a read sent or answered.
    pub(super) progress: Instant,
}

impl Active {
    /// Failed or cancelled (`Standing::Aborted` or `Stalled`).
    pub(super) fn aborted(&self) -> bool {
        self.standing != Standing::Loading
    }
}

/// Where an active request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Standing {
    /// Reading and decoding.
    Loading,
    /// Failed or cancelled: nothing more is read or dispatched; the slot is freed once the
    /// reads in flight and the frames at workers are back.
    Aborted,
    /// Failed because a read ran past `read_timeout` (that read may still be out, holding
    /// its read buffer and the slot).
    Stalled,
}

/// A request waiting for a staging slot.
pub(super) struct Waiting {
    pub(super) ticket: u64,
    pub(super) unit: usize,
    /// The unit's frames it asks for.
    pub(super) frames: Range<usize>,
    pub(super) since: Instant,
    /// Admitted before the requests that are not.
    pub(super) urgent: bool,
}

pub(super) struct Op {
    pub(super) slot: usize,
    pub(super) chunk: usize,
    /// Bytes of the chunk already read (short reads resubmit the rest).
    pub(super) done: usize,
    /// When the read (or the resubmission of its rest) went to the disk.
    pub(super) since: Instant,
    /// Bytes it counts in `Loop::bytes_in_flight` (its chunk's, until it is freed).
    pub(super) bytes: usize,
}

/// Requests at least this large are cut where frames end (`frame_chunks`): the block two
/// requests then both read is at most 0.4 % of the bytes.
pub(in crate::io) const FRAME_CUT_REQUEST_MIN: usize = 256 * IO_ALIGN;

/// Read chunks for frames `part` of a unit, cut where frames end: a frame that starts
/// inside the last chunk and ends within a request of its start joins it (a packed unit's
/// frames lie back to back; a linked unit's tensors, a few bytes of padding apart); any
/// other starts chunks of its own at the block before it (the block it shares with the
/// frame before is read twice: 4 KiB a request). A chunk's frames are then exactly those
/// it reads for, and each frame's chunks are consecutive, in order, and hold its bytes
/// once: a frame no larger than a request lies in one read buffer, and its worker decodes
/// it where it landed instead of first joining its pieces (a copy of about one frame in
/// every request's worth; on this VM's noisy bench-io runs the saving was not
/// measurable).
pub(super) fn frame_chunks(
    frames: &[crate::store::format::Frame],
    part: Range<usize>,
    req: u64,
    chunks: &mut Vec<Chunk>,
) {
    let align = IO_ALIGN as u64;
    for f in part {
        let fr = &frames[f];
        let (fo, fe) = (fr.file_offset, fr.file_offset + fr.stored_len());
        let end = fe.div_ceil(align) * align;
        if let Some(c) = chunks.last_mut() {
            let c_end = c.offset + c.len as u64;
            if fo >= c.offset && fo <= c_end && end - c.offset <= req {
                c.len = c.len.max((end - c.offset) as usize);
                c.frames.end = f + 1;
                continue;
            }
        }
        let mut at = fo / align * align;
        while at < end {
            let len = (end - at).min(req);
            chunks.push(Chunk {
                offset: at,
                len: len as usize,
                buf: None,
                done: false,
                frames: f..f + 1,
            });
            at += len;
        }
    }
}

/// Read chunks for frames `part` of a unit: the aligned bytes `span` cut in requests of
/// `req` back to back, each naming the part's frames it touches (a chunk's aligned ends
/// may touch its neighbours').
pub(super) fn back_to_back_chunks(
    frames: &[crate::store::format::Frame],
    part: Range<usize>,
    span: Range<u64>,
    req: u64,
    chunks: &mut Vec<Chunk>,
) {
    let mut at = span.start;
    while at < span.end {
        let len = (span.end - at).min(req);
        let lo = frames
            .partition_point(|f| f.file_offset + f.stored_len() <= at)
            .max(part.start);
        let hi = frames
            .partition_point(|f| f.file_offset < at + len)
            .min(part.end)
            .max(lo);
        chunks.push(Chunk {
            offset: at,
            len: len as usize,
            buf: None,
            done: false,
            frames: lo..hi,
        });
        at += len;
    }
}
