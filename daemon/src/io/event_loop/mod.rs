//! The I/O thread's loop: it owns requests, read chunks, read buffers and staging slots,
//! issues reads oldest request first, hands frames whose reads have landed to the
//! workers, frees each buffer once its frames are decoded, and publishes progress.

// The expects here are on the loop's own bookkeeping (an op's unit stays active until the
// op completes; a chunk holds its buffer until its frames are done), never on what the
// disk or a caller sent: a broken invariant is a bug to stop on, not an input to refuse.
#![allow(clippy::expect_used)]

use super::limits::{Pools, Sizes};
use super::reader::{Msg, Reader, Target};
use super::tickets::{Shared, TicketState};
use super::workers::Job;
use super::{IoConfig, IoError};
use crate::hostbuf::{AlignedBuf, IO_ALIGN};
use crate::store::codec::FrameFault;
use crate::store::Store;
use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;
use std::time::Instant;

mod requests;
pub(super) use requests::FRAME_CUT_REQUEST_MIN;
use requests::{
    back_to_back_chunks, frame_chunks, Active, Chunk, FrameState, Op, SlotState, Standing, Waiting,
};

pub(super) struct Loop {
    store: Arc<Store>,
    cfg: IoConfig,
    reader: Box<dyn Reader>,
    shared: Arc<Shared>,
    read_bufs: Arc<Vec<AlignedBuf>>,
    free_bufs: Vec<usize>,
    slots: Arc<Vec<AlignedBuf>>,
    /// Per unit: stored as raw, so read straight into its slot (`IoConfig::read_into_slots`).
    into_slot: Vec<bool>,
    /// A linked store (`pack --link`): frames lie where the source has their tensors, not
    /// back to back.
    linked: bool,
    /// Bytes of the file read (at open).
    file_len: u64,
    slot_state: Vec<SlotState>,
    active: Vec<Option<Active>>,
    /// Active slots in admission order: older requests' reads go first.
    order: VecDeque<usize>,
    /// Requests waiting for a staging slot (the urgent ones first).
    queue: VecDeque<Waiting>,
    ops: Vec<Option<Op>>,
    free_ops: Vec<usize>,
    in_flight: usize,
    /// Bytes of the chunks whose reads are out (`IoConfig::in_flight_bytes` bounds it).
    bytes_in_flight: usize,
    jobs: SyncSender<Job>,
    /// Per staging slot, the chunk and frame lists its next unit reuses.
    spare: Vec<(Vec<Chunk>, Vec<FrameState>)>,
    /// Emptied piece lists back from the workers, for the next jobs.
    spare_pieces: Vec<Vec<(usize, usize)>>,
    /// `order` copied for `submit` to walk while it changes.
    order_scratch: Vec<usize>,
    /// Messages (and completions) one wait can return at most.
    msg_capacity: usize,
    shutting_down: bool,
    buf_starved_since: Option<Instant>,
    slot_starved_since: Option<Instant>,
    path: std::path::PathBuf,
}

/// Marks the engine stopped and wakes waiters however the loop ends (a panic included).
struct StopOnDrop(Arc<Shared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.stopped.store(true, Ordering::Release);
        let _g = self.0.tickets.lock();
        self.0.ready.notify_all();
    }
}

impl Loop {
    pub(super) fn new(
        store: Arc<Store>,
        cfg: IoConfig,
        reader: Box<dyn Reader>,
        shared: Arc<Shared>,
        pools: &Pools,
        jobs: SyncSender<Job>,
        sizes: &Sizes,
    ) -> Loop {
        let (read_bufs, slots) = (pools.read_bufs.clone(), pools.slots.clone());
        let path = store.weights_path().to_path_buf();
        let into_slot = store
            .units()
            .iter()
            .map(|u| cfg.read_into_slots && u.stored_as_raw())
            .collect();
        Loop {
            into_slot,
            linked: store.manifest().link.is_some(),
            file_len: store.weights_len(),
            store,
            reader,
            shared,
            read_bufs,
            free_bufs: (0..cfg.read_buffers).rev().collect(),
            slots,
            slot_state: vec![SlotState::Free; cfg.staging_slots],
            active: (0..cfg.staging_slots).map(|_| None).collect(),
            // Room for what a caller keeps outstanding (a slot's worth of loads ahead and
            // as many again), so steady streaming allocates nothing here.
            order: VecDeque::with_capacity(cfg.staging_slots),
            queue: VecDeque::with_capacity(2 * cfg.staging_slots + 16),
            ops: (0..cfg.queue_depth).map(|_| None).collect(),
            free_ops: (0..cfg.queue_depth).rev().collect(),
            in_flight: 0,
            bytes_in_flight: 0,
            jobs,
            spare: (0..cfg.staging_slots)
                .map(|_| {
                    (
                        Vec::with_capacity(sizes.chunks_per_unit_max),
                        Vec::with_capacity(sizes.frames_per_unit_max),
                    )
                })
                .collect(),
            spare_pieces: (0..sizes.job_capacity(&cfg))
                .map(|_| Vec::with_capacity(sizes.pieces_per_frame_max(&cfg)))
                .collect(),
            msg_capacity: sizes.message_capacity(&cfg),
            order_scratch: Vec::with_capacity(cfg.staging_slots),
            shutting_down: false,
            buf_starved_since: None,
            slot_starved_since: None,
            path,
            cfg,
        }
    }

    pub(super) fn run(mut self, rx: Receiver<Msg>) {
        let _stop = StopOnDrop(self.shared.clone());
        let mut msgs = Vec::with_capacity(self.msg_capacity);
        let mut done = Vec::with_capacity(self.cfg.queue_depth);
        loop {
            for m in msgs.drain(..) {
                self.handle(m);
            }
            for (op, res) in done.drain(..) {
                self.complete(op, res);
            }
            self.admit();
            self.submit();
            self.expire();
            self.account();
            if self.shutting_down
                && self.in_flight == 0
                && self.active.iter().flatten().all(|a| a.at_worker == 0)
            {
                return;
            }
            let timeout = self
                .next_deadline()
                .map(|d| d.saturating_duration_since(Instant::now()));
            if let Err(e) = self.reader.wait(&rx, &mut msgs, &mut done, timeout) {
                // The ring itself failed: nothing can be read any more. Fail everything
                // that waits, and stop.
                tracing::error!(path = %self.path.display(), "I/O engine stopped: {e}");
                return;
            }
        }
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Request {
                ticket,
                unit,
                frames,
                urgent,
            } => {
                if self.shutting_down {
                    self.shared
                        .publish(ticket, TicketState::Failed(IoError::Stopped));
                } else {
                    let at = if urgent {
                        self.queue.iter().take_while(|q| q.urgent).count()
                    } else {
                        self.queue.len()
                    };
                    let since = Instant::now();
                    let waiting = Waiting {
                        ticket,
                        unit,
                        frames,
                        since,
                        urgent,
                    };
                    self.queue.insert(at, waiting);
                }
            }
            Msg::Cancel { ticket } => {
                self.queue.retain(|q| q.ticket != ticket);
                if let Some(slot) = self
                    .slot_state
                    .iter()
                    .position(|&s| s == SlotState::Held(ticket))
                {
                    self.free_slot(slot);
                }
                let found = self
                    .active
                    .iter()
                    .position(|a| a.as_ref().is_some_and(|a| a.ticket == ticket));
                if let Some(slot) = found {
                    self.abort(slot, None);
                }
            }
            Msg::Release { slot } => {
                debug_assert!(matches!(self.slot_state[slot], SlotState::Held(_)));
                self.free_slot(slot);
            }
            Msg::FrameDone {
                slot,
                frame,
                fault,
                pieces,
            } => {
                self.spare_pieces.push(pieces);
                self.frame_done(slot, frame, fault)
            }
            Msg::ReadDone { op, res } => self.complete(op, res),
            Msg::Shutdown => {
                self.shutting_down = true;
                for q in std::mem::take(&mut self.queue) {
                    self.shared
                        .publish(q.ticket, TicketState::Failed(IoError::Stopped));
                }
                for slot in 0..self.active.len() {
                    if self.active[slot].is_some() {
                        self.abort(slot, Some(IoError::Stopped));
                    }
                }
            }
        }
    }

    fn free_slot(&mut self, slot: usize) {
        self.slot_state[slot] = SlotState::Free;
        self.shared.free_slots.fetch_add(1, Ordering::AcqRel);
    }

    fn free_buf(&mut self, buf: usize) {
        self.free_bufs.push(buf);
        self.shared.free_read_buffers.fetch_add(1, Ordering::AcqRel);
    }

    /// Gives queued requests free slots and lays out their reads.
    fn admit(&mut self) {
        while !self.queue.is_empty() {
            let Some(slot) = self.slot_state.iter().position(|&s| s == SlotState::Free) else {
                break;
            };
            let Some(q) = self.queue.pop_front() else {
                unreachable!("not empty")
            };
            let (ticket, unit, part, urgent) = (q.ticket, q.unit, q.frames, q.urgent);
            self.slot_state[slot] = SlotState::Loading;
            self.shared.free_slots.fetch_sub(1, Ordering::AcqRel);
            let busy = self
                .slot_state
                .iter()
                .filter(|&&s| s != SlotState::Free)
                .count();
            self.shared
                .counters
                .slots_busy_max
                .fetch_max(busy as u64, Ordering::Relaxed);
            let u = &self.store.units()[unit];
            let align = IO_ALIGN as u64;
            // Blobs start 4096-aligned, a part's first frame maybe not (it then starts at
            // the block before); the end is rounded up (the file is padded).
            // (A unit of no frames has nothing to read.)
            let (file_first, file_end, raw_base) = match (
                u.frames.get(part.start),
                part.end.checked_sub(1).and_then(|l| u.frames.get(l)),
            ) {
                (Some(f), Some(l)) => (f.file_offset, l.file_offset + l.stored_len(), f.raw_offset),
                _ => (u.file_offset, u.file_offset, 0),
            };
            let (start, end) = (file_first / align * align, file_end.div_ceil(align) * align);
            // Read straight into the slot, byte `start` lands at its first byte: the part
            // must start aligned. Slots are whole pages (AlignedBuf), so the rounded-up end
            // fits where the raw blob does.
            let direct = self.into_slot[unit]
                && start == file_first
                && end - start <= self.slots[slot].len() as u64;
            let req = self.cfg.request_bytes as u64;
            let (mut chunks, mut frames) = std::mem::take(&mut self.spare[slot]);
            chunks.clear();
            frames.clear();
            // A unit read into its slot is cut in requests back to back: its frames need no
            // joining, and a block read twice would land twice where a worker may be
            // checking it. So are units read in small requests, where a block read twice
            // costs more of the disk than the joins cost a worker.
            if self.linked || (!direct && req >= FRAME_CUT_REQUEST_MIN as u64) {
                frame_chunks(&u.frames, part.clone(), req, &mut chunks);
            } else {
                back_to_back_chunks(&u.frames, part.clone(), start..end, req, &mut chunks);
            }
            // Frames outside the part count as done: the decoded prefix starts at the part.
            frames.resize(u.frames.len(), FrameState::Done);
            frames[part.clone()].fill(FrameState::Waiting);
            self.active[slot] = Some(Active {
                ticket,
                unit,
                urgent,
                raw_base,
                direct,
                chunks,
                next_chunk: 0,
                frames,
                frames_left: part.len(),
                prefix: part.start,
                progressed: false,
                at_worker: 0,
                ops: 0,
                standing: Standing::Loading,
                progress: Instant::now(),
            });
            // An urgent request's reads go before the others', after older urgent ones.
            let at = if urgent {
                self.order
                    .iter()
                    .take_while(|&&s| self.active[s].as_ref().is_some_and(|a| a.urgent))
                    .count()
            } else {
                self.order.len()
            };
            self.order.insert(at, slot);
            self.maybe_finish(slot);
        }
    }

    /// Issues reads, oldest request first, while buffers and queue slots last.
    fn submit(&mut self) {
        let mut order = std::mem::take(&mut self.order_scratch);
        order.clear();
        order.extend(self.order.iter().copied());
        // The oldest request with reads to send or out may fill `in_flight_bytes`; those
        // behind it start only below `follow_bytes` (`FOLLOW_BYTES_DEFAULT`).
        let mut cap = self.cfg.in_flight_bytes;
        'outer: for &slot in &order {
            loop {
                let Some(a) = self.active[slot].as_mut() else {
                    continue 'outer;
                };
                if a.aborted() || a.next_chunk >= a.chunks.len() {
                    if !a.aborted() && a.ops > 0 {
                        cap = cap.min(self.cfg.follow_bytes);
                    }
                    continue 'outer;
                }
                if self.free_ops.is_empty() {
                    break 'outer;
                }
                // Bytes in flight are bounded too (the first read goes whatever its size):
                // the disk serves what it holds side by side, so fewer bytes out land the
                // oldest request's reads sooner.
                let len = a.chunks[a.next_chunk].len;
                if self.bytes_in_flight > 0 && self.bytes_in_flight + len > cap {
                    break 'outer;
                }
                // A unit stored as raw reads into its slot; others need a read buffer.
                let buf = if a.direct {
                    None
                } else {
                    match self.free_bufs.pop() {
                        Some(b) => Some(b),
                        None => break 'outer,
                    }
                };
                let Some(op) = self.free_ops.pop() else {
                    unreachable!("checked non-empty")
                };
                if buf.is_some() {
                    self.shared.free_read_buffers.fetch_sub(1, Ordering::AcqRel);
                }
                let c = a.next_chunk;
                a.next_chunk += 1;
                a.ops += 1;
                a.progress = Instant::now();
                let chunk = &mut a.chunks[c];
                chunk.buf = buf;
                let offset = chunk.offset;
                self.bytes_in_flight += len;
                self.ops[op] = Some(Op {
                    slot,
                    chunk: c,
                    done: 0,
                    since: Instant::now(),
                    bytes: len,
                });
                self.push_read(op, 0, len, offset);
            }
        }
        self.order_scratch = order;
    }

    /// Reads `len` bytes at `offset` to byte `at` of op `op`'s chunk: in its read buffer,
    /// or for a unit stored as raw, in its place in the staging slot.
    fn push_read(&mut self, op: usize, at: usize, len: usize, offset: u64) {
        let o = self.ops[op]
            .as_ref()
            .expect("a read is pushed for a live op");
        let a = self.active[o.slot]
            .as_ref()
            .expect("an op's unit stays active until its completion");
        let chunk = &a.chunks[o.chunk];
        let (target, base, cap) = match chunk.buf {
            Some(b) => (
                Target::ReadBuf(b),
                self.read_bufs[b].as_ptr(),
                self.read_bufs[b].len(),
            ),
            None => {
                debug_assert!(a.direct, "a chunk without a buffer reads into its slot");
                // The first chunk starts at the slot's first byte (admit checks it).
                let into = (chunk.offset - a.chunks[0].offset) as usize;
                let slot = &self.slots[o.slot];
                assert!(into <= slot.len(), "chunk past its slot");
                // SAFETY: `into` is inside the slot (asserted).
                (
                    Target::Slot(o.slot),
                    unsafe { slot.as_ptr().add(into) },
                    slot.len() - into,
                )
            }
        };
        // Assert the O_DIRECT preconditions before every submission.
        assert!(at + len <= cap, "read past its buffer");
        debug_assert!(
            offset.is_multiple_of(IO_ALIGN as u64) || at != 0,
            "unaligned read offset"
        );
        // SAFETY: `at + len` is inside the buffer or slot (asserted); a buffer stays with this
        // op until its completion is handled, and a Loading slot is written by nothing else
        // (chunks are disjoint) and not handed out until every read of it is back.
        let ptr = unsafe { base.add(at) };
        let now = Instant::now();
        if self.in_flight == 0 {
            let c = &self.shared.counters;
            c.busy_since_ns.store(c.now_ns() + 1, Ordering::Relaxed);
        }
        if let Some(o) = self.ops[op].as_mut() {
            // A resubmitted rest is progress: its own wait starts now.
            o.since = now;
        }
        self.note_depth();
        self.in_flight += 1;
        self.set_depth();
        self.shared
            .counters
            .read_ops
            .fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.reader.push(op, target, ptr, len, offset) {
            // Could not even queue it: complete it as failed right here.
            self.one_less_in_flight();
            self.complete_with(op, -e.raw_os_error().unwrap_or(libc::EIO));
        }
    }

    /// Adds the time at the current depth to the queue-depth integral (call before the
    /// depth changes; `set_depth` after).
    fn note_depth(&mut self) {
        let c = &self.shared.counters;
        let now = c.now_ns();
        let dt = now.saturating_sub(c.depth_since_ns.load(Ordering::Relaxed));
        c.inflight_ns
            .fetch_add(dt * self.in_flight as u64, Ordering::Relaxed);
        c.depth_since_ns.store(now, Ordering::Relaxed);
    }

    fn set_depth(&self) {
        self.shared
            .counters
            .depth
            .store(self.in_flight as u64, Ordering::Relaxed);
    }

    fn complete(&mut self, op: usize, res: i32) {
        self.one_less_in_flight();
        self.complete_with(op, res);
    }

    /// A read is back (or was never queued): the depth and busy time follow.
    fn one_less_in_flight(&mut self) {
        self.note_depth();
        self.in_flight -= 1;
        self.set_depth();
        if self.in_flight == 0 {
            let c = &self.shared.counters;
            let since = c.busy_since_ns.swap(0, Ordering::Relaxed);
            if since > 0 {
                c.read_busy_ns
                    .fetch_add(c.now_ns().saturating_sub(since - 1), Ordering::Relaxed);
            }
        }
    }

    fn complete_with(&mut self, op: usize, res: i32) {
        let Some(mut o) = self.ops[op].take() else {
            debug_assert!(false, "completion for a free op {op}");
            return;
        };
        let slot = o.slot;
        let a = self.active[slot]
            .as_mut()
            .expect("an op's unit stays active until its completion");
        let chunk = &a.chunks[o.chunk];
        let (offset, len) = (chunk.offset, chunk.len);
        // A chunk's aligned end may pass the end of a linked source (a store's own file is
        // padded): the bytes up to the end are all it has to deliver.
        let need = len.min(self.file_len.saturating_sub(offset) as usize);
        if res > 0 && !a.aborted() && (o.done + res as usize) < need {
            // Short read: ask for the rest into the same buffer.
            o.done += res as usize;
            self.shared
                .counters
                .short_reads
                .fetch_add(1, Ordering::Relaxed);
            self.shared
                .counters
                .read_bytes
                .fetch_add(res as u64, Ordering::Relaxed);
            let done = o.done;
            self.ops[op] = Some(o);
            self.push_read(op, done, len - done, offset + done as u64);
            return;
        }
        self.free_ops.push(op);
        self.bytes_in_flight -= o.bytes;
        a.ops -= 1;
        let chunk_idx = o.chunk;
        if res <= 0 || a.aborted() {
            let a = self.active[slot].as_mut().expect("active");
            a.chunks[chunk_idx].done = true;
            if !a.aborted() {
                let what = if res == 0 {
                    format!("read at offset {} returned end of file after {} of {len} bytes: weights.bin is shorter than the manifest says", offset + o.done as u64, o.done)
                } else {
                    format!(
                        "read of {len} bytes at offset {offset} failed: {}",
                        std::io::Error::from_raw_os_error(-res)
                    )
                };
                let unit = a.unit;
                let frame = a.chunks[chunk_idx]
                    .frames
                    .start
                    .min(self.store.units()[unit].frames.len().saturating_sub(1));
                let err = self.store.frame_error(unit, frame, FrameFault::Read(what));
                self.abort(slot, Some(IoError::Data(err)));
            }
            self.release_chunks(slot, chunk_idx..chunk_idx + 1);
            self.maybe_finish(slot);
            return;
        }
        self.shared
            .counters
            .read_bytes
            .fetch_add(res as u64, Ordering::Relaxed);
        a.chunks[chunk_idx].done = true;
        a.progress = Instant::now();
        // Dispatch every frame of this chunk whose reads have all landed. Without decoding
        // a frame completes right here, so every chunk its frames span may free too.
        let frames = a.chunks[chunk_idx].frames.clone();
        let span = |f: usize| Self::chunks_of(a, f);
        let touched = match (frames.clone().next(), frames.clone().last()) {
            (Some(lo), Some(hi)) => span(lo).start.min(chunk_idx)..span(hi).end.max(chunk_idx + 1),
            _ => chunk_idx..chunk_idx + 1,
        };
        for f in frames {
            self.dispatch(slot, f);
        }
        self.release_chunks(slot, touched);
        self.maybe_finish(slot);
    }

    /// The chunks frame `f` of `a` is read by (their frame ranges never go down, in either
    /// layout).
    fn chunks_of(a: &Active, f: usize) -> Range<usize> {
        let first = a.chunks.partition_point(|c| c.frames.end <= f);
        let last = a.chunks.partition_point(|c| c.frames.start <= f);
        first..last.max(first)
    }

    fn dispatch(&mut self, slot: usize, f: usize) {
        let a = self.active[slot].as_mut().expect("active");
        if a.aborted() || a.frames[f] != FrameState::Waiting {
            return;
        }
        let frame = &self.store.units()[a.unit].frames[f];
        let (fo, fl) = (frame.file_offset, frame.stored_len());
        let range = Self::chunks_of(a, f);
        if !a.chunks[range.clone()].iter().all(|c| c.done) {
            return;
        }
        if !self.cfg.decompress {
            a.frames[f] = FrameState::Done;
            a.frames_left -= 1;
            return;
        }
        let mut pieces = self.spare_pieces.pop().unwrap_or_default();
        pieces.clear();
        // A unit stored as raw was read into place: the frame's bytes are its raw bytes.
        let in_place = a.direct;
        for c in a.chunks[range].iter().filter(|_| !in_place) {
            let lo = fo.max(c.offset);
            let hi = (fo + fl).min(c.offset + c.len as u64);
            if hi <= lo {
                continue;
            }
            let buf = &self.read_bufs[c
                .buf
                .expect("done chunk holds its buffer until its frames are done")];
            // SAFETY: lo - c.offset + (hi - lo) <= c.len <= buffer length; the buffer is kept
            // (not reused, not freed) until this frame's FrameDone, by release_chunks.
            pieces.push((
                unsafe { buf.as_ptr().add((lo - c.offset) as usize) } as usize,
                (hi - lo) as usize,
            ));
        }
        // SAFETY: raw_offset - raw_base + raw_len <= the part's raw bytes <= slot length
        // (validated manifest; `request`/`request_part` check the part fits); frames cover
        // disjoint raw ranges, and the slot is Loading (no caller holds it) until every
        // frame is back.
        let at = (frame.raw_offset - a.raw_base) as usize;
        assert!(
            at + frame.raw_len as usize <= self.slots[slot].len(),
            "frame past its slot"
        );
        let dst = unsafe { self.slots[slot].as_ptr().add(at) };
        a.frames[f] = FrameState::AtWorker;
        a.at_worker += 1;
        let job = Job {
            slot,
            unit: a.unit,
            frame: f,
            pieces,
            dst,
            in_place,
        };
        if let Err(std::sync::mpsc::SendError(job)) = self.jobs.send(job) {
            // Workers are gone (only at teardown): treat as a failed frame.
            self.spare_pieces.push(job.pieces);
            self.frame_done(
                slot,
                f,
                Some(FrameFault::Decompress(
                    "decompression workers stopped".into(),
                )),
            );
        }
    }

    fn frame_done(&mut self, slot: usize, f: usize, fault: Option<FrameFault>) {
        let a = self.active[slot]
            .as_mut()
            .expect("a frame's unit stays active until it is back");
        debug_assert!(a.frames[f] == FrameState::AtWorker);
        a.frames[f] = FrameState::Done;
        a.at_worker -= 1;
        let range = Self::chunks_of(a, f);
        match fault {
            None => {
                a.frames_left -= 1;
                let before = a.prefix;
                while a.prefix < a.frames.len() && a.frames[a.prefix] == FrameState::Done {
                    a.prefix += 1;
                }
                if a.prefix > before && a.frames_left > 0 && !a.aborted() {
                    let last = &self.store.units()[a.unit].frames[a.prefix - 1];
                    let ready = (last.raw_offset + last.raw_len as u64 - a.raw_base) as usize;
                    a.progressed = true;
                    self.shared
                        .publish(a.ticket, TicketState::Loading { slot, ready });
                }
            }
            Some(fault) => {
                let unit = a.unit;
                let err = self.store.frame_error(unit, f, fault);
                self.abort(slot, Some(IoError::Data(err)));
            }
        }
        self.release_chunks(slot, range);
        self.maybe_finish(slot);
    }

    /// Returns the buffers of chunks whose frames no longer need them.
    fn release_chunks(&mut self, slot: usize, range: Range<usize>) {
        for c in range {
            let Some(a) = self.active[slot].as_mut() else {
                return;
            };
            let ch = &a.chunks[c];
            if ch.buf.is_none() || !ch.done {
                continue;
            }
            let settled = a.frames[ch.frames.clone()]
                .iter()
                .all(|&s| s == FrameState::Done || (a.aborted() && s == FrameState::Waiting));
            if settled {
                let b = a.chunks[c].buf.take().expect("checked");
                self.free_buf(b);
            }
        }
    }

    /// Ends the unit in `slot`: its chunk and frame lists go back for the slot's next unit.
    fn retire(&mut self, slot: usize) {
        if let Some(a) = self.active[slot].take() {
            self.spare[slot] = (a.chunks, a.frames);
        }
        self.order.retain(|&s| s != slot);
    }

    /// Fails (err = Some) or cancels (None) the unit in `slot`.
    fn abort(&mut self, slot: usize, err: Option<IoError>) {
        let Some(a) = self.active[slot].as_mut() else {
            return;
        };
        if a.aborted() {
            return;
        }
        a.standing = Standing::Aborted;
        let ticket = a.ticket;
        let n = a.chunks.len();
        if let Some(e) = err {
            self.shared
                .counters
                .units_failed
                .fetch_add(1, Ordering::Relaxed);
            self.shared.publish(ticket, TicketState::Failed(e));
        }
        self.release_chunks(slot, 0..n);
        self.maybe_finish(slot);
    }

    /// Completes or cleans up the unit in `slot` once nothing of it is outstanding.
    fn maybe_finish(&mut self, slot: usize) {
        let Some(a) = self.active[slot].as_ref() else {
            return;
        };
        if a.aborted() {
            if a.ops == 0 && a.at_worker == 0 {
                assert!(
                    a.chunks.iter().all(|c| c.buf.is_none()),
                    "a finished unit still holds read buffers"
                );
                let (ticket, progressed) = (a.ticket, a.progressed);
                self.retire(slot);
                // A failed unit whose prefix was handed out keeps its slot until the
                // ticket is dropped (its Cancel frees a Held slot): a copy may still be
                // reading the prefix. A cancelled ticket is already gone from the map.
                let consumer_alive = progressed
                    && self
                        .shared
                        .tickets
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .contains_key(&ticket);
                if consumer_alive {
                    self.slot_state[slot] = SlotState::Held(ticket);
                } else {
                    self.free_slot(slot);
                }
            }
            return;
        }
        if a.frames_left == 0 && a.ops == 0 {
            assert!(
                a.chunks.iter().all(|c| c.buf.is_none()),
                "a finished unit still holds read buffers"
            );
            let ticket = a.ticket;
            self.retire(slot);
            self.slot_state[slot] = SlotState::Held(ticket);
            self.shared
                .counters
                .units_done
                .fetch_add(1, Ordering::Relaxed);
            let waiting = self
                .shared
                .tickets
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .contains_key(&ticket);
            if waiting {
                self.shared.publish(ticket, TicketState::Ready { slot });
            } else {
                // Cancelled while its last frame was at a worker.
                self.free_slot(slot);
            }
        }
    }

    /// When the oldest unanswered read (or, while stalled reads hold buffers and slots, the
    /// oldest request starved of them) runs past `read_timeout`; None: nothing can expire.
    fn next_deadline(&self) -> Option<Instant> {
        let limit = self.cfg.read_timeout?;
        let reads = self
            .ops
            .iter()
            .flatten()
            .filter(|o| self.active[o.slot].as_ref().is_some_and(|a| !a.aborted()))
            .map(|o| o.since + limit);
        let starved = self.stalled_reads_out().then(|| {
            let queued = self.queue.front().map(|q| q.since);
            let active = self
                .active
                .iter()
                .flatten()
                .filter(|a| Self::starved(a))
                .map(|a| a.progress);
            queued.into_iter().chain(active).min().map(|t| t + limit)
        });
        reads.chain(starved.flatten()).min()
    }

    /// Some unit failed for a stalled read still has that read out: its read buffer, queue
    /// entry and staging slot are held as long as the disk takes, and the requests that
    /// wait for those may wait as long.
    fn stalled_reads_out(&self) -> bool {
        self.active
            .iter()
            .flatten()
            .any(|a| a.standing == Standing::Stalled && a.ops > 0)
    }

    /// A unit with reads still to send and none out: it waits for a read buffer or a
    /// queue entry.
    fn starved(a: &Active) -> bool {
        !a.aborted() && a.ops == 0 && a.next_chunk < a.chunks.len()
    }

    /// Fails the units whose reads the disk has not answered within `read_timeout`, and
    /// the requests that waited that long for a slot such a unit holds. A stalled read
    /// keeps its buffer and its slot (the kernel may still write into them): they come back
    /// when the disk answers, like any read of an aborted unit.
    fn expire(&mut self) {
        let Some(limit) = self.cfg.read_timeout else {
            return;
        };
        let now = Instant::now();
        for op in 0..self.ops.len() {
            let Some(o) = &self.ops[op] else {
                continue;
            };
            let waited = now - o.since;
            if waited < limit {
                continue;
            }
            let slot = o.slot;
            let a = self.active[slot]
                .as_mut()
                .expect("an op's unit stays active until its completion");
            if a.aborted() {
                continue;
            }
            let c = &a.chunks[o.chunk];
            let what = format!(
                "read of {} bytes at offset {} ({}) has not completed after {:.1} s",
                c.len - o.done,
                c.offset + o.done as u64,
                self.store.units()[a.unit].kind,
                waited.as_secs_f64()
            );
            self.shared
                .counters
                .reads_stalled
                .fetch_add(1, Ordering::Relaxed);
            tracing::warn!(path = %self.path.display(), "{what}: failing the requests that need it");
            let err = IoError::Stalled {
                path: self.path.clone(),
                what,
                limit_s: limit.as_secs_f64(),
            };
            self.abort(slot, Some(err));
            // Its read is still out (so the unit is still active), holding a buffer.
            if let Some(a) = self.active[slot].as_mut() {
                a.standing = Standing::Stalled;
            }
        }
        if !self.stalled_reads_out() {
            return;
        }
        for slot in 0..self.active.len() {
            let Some(a) = self.active[slot].as_ref() else {
                continue;
            };
            let waited = now - a.progress;
            if !Self::starved(a) || waited < limit {
                continue;
            }
            let err = IoError::Stalled {
                path: self.path.clone(),
                what: format!(
                    "{} waited {:.1} s for {}, held by reads the disk has not answered",
                    self.store.units()[a.unit].kind,
                    waited.as_secs_f64(),
                    if a.direct {
                        "a place in the read queue"
                    } else {
                        "a read buffer"
                    }
                ),
                limit_s: limit.as_secs_f64(),
            };
            self.abort(slot, Some(err));
        }
        while let Some(&Waiting {
            ticket,
            unit,
            since,
            ..
        }) = self.queue.front()
        {
            let waited = now - since;
            if waited < limit {
                break;
            }
            self.queue.pop_front();
            let err = IoError::Stalled {
                path: self.path.clone(),
                what: format!(
                    "{} waited {:.1} s for a staging slot, held by a read the disk has not answered",
                    self.store.units()[unit].kind,
                    waited.as_secs_f64()
                ),
                limit_s: limit.as_secs_f64(),
            };
            self.shared
                .counters
                .units_failed
                .fetch_add(1, Ordering::Relaxed);
            self.shared.publish(ticket, TicketState::Failed(err));
        }
    }

    /// Stall accounting: time with reads waiting for buffers, requests waiting for slots.
    fn account(&mut self) {
        let now = Instant::now();
        let wants_buf = self.order.iter().any(|&s| {
            self.active[s]
                .as_ref()
                .is_some_and(|a| !a.aborted() && !a.direct && a.next_chunk < a.chunks.len())
        });
        // Only when the queue has room: a full queue is the disk's pace, not a stall.
        let buf_starved = wants_buf && self.free_bufs.is_empty() && !self.free_ops.is_empty();
        let slot_starved = !self.queue.is_empty();
        let c = &self.shared.counters;
        match (buf_starved, self.buf_starved_since) {
            (true, None) => self.buf_starved_since = Some(now),
            (false, Some(t)) => {
                c.buffer_stall_ns
                    .fetch_add((now - t).as_nanos() as u64, Ordering::Relaxed);
                self.buf_starved_since = None;
            }
            _ => {}
        }
        match (slot_starved, self.slot_starved_since) {
            (true, None) => self.slot_starved_since = Some(now),
            (false, Some(t)) => {
                c.slot_stall_ns
                    .fetch_add((now - t).as_nanos() as u64, Ordering::Relaxed);
                self.slot_starved_since = None;
            }
            _ => {}
        }
    }
}
