//! The caller's side of the I/O engine: `IoEngine` (start, request, wait, wait for a
//! decoded prefix, stats), the `Ticket` of a request and the guards that hold a staging
//! slot. Everything that changes engine state is a message to the I/O thread.

use super::event_loop::Loop;
use super::limits::{self, Pools};
use super::pread::PreadReader;
use super::reader::{Msg, Reader, Waker};
use super::tickets::{Shared, TicketState};
use super::uring::UringReader;
use super::workers::{worker, Job};
use super::{IoConfig, IoError, IoStats, ReaderChoice, ReaderKind};
use crate::hostbuf::{AlignedBuf, IO_ALIGN};
use crate::store::Store;
use std::fs::File;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A request for one layer unit. Pass it to `wait`; dropping it unwaited cancels it.
pub struct Ticket {
    id: u64,
    unit: usize,
    /// Bytes the slot holds once loaded: the unit's raw bytes, or the part's.
    len: usize,
    waker: Waker,
    shared: Arc<Shared>,
    consumed: bool,
}

impl Ticket {
    pub fn unit(&self) -> usize {
        self.unit
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if !self.consumed {
            self.shared
                .tickets
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&self.id);
            self.waker.send(Msg::Cancel { ticket: self.id });
        }
    }
}

/// A loaded layer blob in a staging slot; dropping it releases the slot.
pub struct SlotGuard<'a> {
    engine: &'a IoEngine,
    slot: usize,
    unit: usize,
    len: usize,
}

impl SlotGuard<'_> {
    /// The decompressed blob (tensor offsets from the manifest index into it).
    pub fn data(&self) -> &[u8] {
        // SAFETY: the engine hands a slot to exactly one guard and does not touch it until
        // the guard releases it; workers finished writing before the ticket became ready
        // (the Ready state is published under the ticket mutex after their FrameDone).
        unsafe { std::slice::from_raw_parts(self.engine.slots[self.slot].as_ptr(), self.len) }
    }

    pub fn unit(&self) -> usize {
        self.unit
    }

    pub fn slot(&self) -> usize {
        self.slot
    }
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        self.engine.waker.send(Msg::Release { slot: self.slot });
    }
}

impl SlotGuard<'_> {
    /// The same hold on the staging slot without a borrow of the engine, for a consumer
    /// that keeps it across calls (an asynchronous upload still reading it).
    pub fn detach(self) -> HeldSlot {
        let held = HeldSlot {
            waker: self.engine.waker.clone(),
            slots: self.engine.slots.clone(),
            slot: self.slot,
            len: self.len,
        };
        std::mem::forget(self);
        held
    }
}

/// A staging slot held past its guard (see `SlotGuard::detach`); dropping it releases the
/// slot. It keeps the slot memory alive even if the engine stops first.
pub struct HeldSlot {
    waker: Waker,
    slots: Arc<Vec<AlignedBuf>>,
    slot: usize,
    len: usize,
}

impl HeldSlot {
    pub fn data(&self) -> &[u8] {
        // SAFETY: as for SlotGuard::data: the slot is ours until this is dropped.
        unsafe { std::slice::from_raw_parts(self.slots[self.slot].as_ptr(), self.len) }
    }
}

impl Drop for HeldSlot {
    fn drop(&mut self) {
        self.waker.send(Msg::Release { slot: self.slot });
    }
}

/// Free/total counts of the engine's pools (tests check they return to full after errors).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct PoolStatus {
    pub read_buffers_free: usize,
    pub read_buffers: usize,
    pub slots_free: usize,
    pub slots: usize,
    /// Staging slots left pageable because page-locking them was refused (0 where the
    /// backend pins nothing: the CPU backend reads the slots directly).
    pub slots_pageable: usize,
}

/// Reads an engine's pool levels; outlives nothing (after the engine stops it reads the
/// last levels).
#[derive(Clone)]
pub struct PoolGauge {
    shared: Arc<Shared>,
    read_buffers: usize,
    slots: usize,
    slots_pageable: usize,
}

impl PoolGauge {
    pub fn read(&self) -> PoolStatus {
        PoolStatus {
            read_buffers_free: self.shared.free_read_buffers.load(Ordering::Acquire),
            read_buffers: self.read_buffers,
            slots_free: self.shared.free_slots.load(Ordering::Acquire),
            slots: self.slots,
            slots_pageable: self.slots_pageable,
        }
    }
}

pub struct IoEngine {
    store: Arc<Store>,
    kind: ReaderKind,
    direct: bool,
    why: String,
    cfg: IoConfig,
    waker: Waker,
    shared: Arc<Shared>,
    slots: Arc<Vec<AlignedBuf>>,
    /// The staging slots are registered with the ring (reads land there by READ_FIXED).
    slots_registered: bool,
    next_ticket: AtomicU64,
    threads: Vec<std::thread::JoinHandle<()>>,
}

fn open_weights(path: &std::path::Path, direct: bool) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// Opens `path` for reads with O_DIRECT when the file system takes it (opened and a block
/// read back), else without; says which.
pub fn open_direct(path: &std::path::Path) -> std::io::Result<(File, bool)> {
    match open_weights(path, true).and_then(|f| probe_direct(&f).map(|_| f)) {
        Ok(f) => Ok((f, true)),
        Err(_) => Ok((open_weights(path, false)?, false)),
    }
}

/// Reads the first block with O_DIRECT: some file systems accept the flag at open and
/// refuse the reads.
fn probe_direct(file: &File) -> std::io::Result<()> {
    let mut b = AlignedBuf::new(IO_ALIGN).ok_or_else(|| std::io::Error::other("out of memory"))?;
    std::os::unix::fs::FileExt::read_at(file, b.as_mut_slice(), 0).map(|_| ())
}

/// Maps a setup failure's message to an error naming the weights file.
fn setup_err(path: &std::path::Path) -> impl Fn(String) -> IoError + '_ {
    move |msg| IoError::Setup {
        path: path.to_path_buf(),
        msg,
    }
}

/// The reader chosen and what the caller side keeps of that choice.
struct Started {
    kind: ReaderKind,
    direct: bool,
    why: String,
    reader: Box<dyn Reader>,
    waker: Waker,
    rx: std::sync::mpsc::Receiver<Msg>,
    threads: Vec<std::thread::JoinHandle<()>>,
    slots_registered: bool,
}

impl IoEngine {
    /// Opens the store's weights.bin and starts the engine.
    pub fn new(store: Arc<Store>, cfg: IoConfig) -> Result<IoEngine, IoError> {
        let path = store.weights_path().to_path_buf();
        let setup = setup_err(&path);
        let mut why = Vec::new();
        let mut direct = false;
        let mut file = None;
        if cfg.direct {
            match open_weights(&path, true).and_then(|f| probe_direct(&f).map(|_| f)) {
                Ok(f) => {
                    direct = true;
                    file = Some(f);
                }
                Err(e) => why.push(format!(
                    "O_DIRECT refused ({e}), reading through the page cache"
                )),
            }
        }
        let file = match file {
            Some(f) => f,
            None => open_weights(&path, false).map_err(|e| setup(format!("open: {e}")))?,
        };
        let mut choice = cfg.reader;
        if choice == ReaderChoice::Auto && !direct {
            why.push("io_uring is used with O_DIRECT only".into());
            choice = ReaderChoice::Pread;
        }
        Self::start(store, file, direct, choice, cfg, why)
    }

    /// Starts the engine on an already open file (tests use this to inject a failing
    /// descriptor). `direct` says whether the file was opened with O_DIRECT.
    pub fn with_file(
        store: Arc<Store>,
        file: File,
        direct: bool,
        cfg: IoConfig,
    ) -> Result<IoEngine, IoError> {
        let choice = cfg.reader;
        Self::start(store, file, direct, choice, cfg, Vec::new())
    }

    fn start(
        store: Arc<Store>,
        file: File,
        direct: bool,
        choice: ReaderChoice,
        cfg: IoConfig,
        mut why: Vec<String>,
    ) -> Result<IoEngine, IoError> {
        let path = store.weights_path().to_path_buf();
        let setup = setup_err(&path);
        let sizes = limits::check(&cfg, store.manifest()).map_err(&setup)?;
        let pools = Pools::allocate(&cfg, &sizes).map_err(&setup)?;
        let (tx, rx) = sync_channel::<Msg>(sizes.message_capacity(&cfg));
        // The reader: io_uring, or the pread pool when asked or when io_uring fails.
        let mut uring = None;
        // Only where a unit is read straight into a slot.
        let into_slots = cfg.read_into_slots && store.units().iter().any(|u| u.stored_as_raw());
        let slots_to_register: &[AlignedBuf] = if cfg.register_slots && into_slots {
            &pools.slots
        } else {
            &[]
        };
        if matches!(choice, ReaderChoice::Auto | ReaderChoice::Uring) {
            match UringReader::new(&file, &pools.read_bufs, slots_to_register, cfg.queue_depth) {
                Ok(r) => uring = Some(r),
                Err(e) if choice == ReaderChoice::Uring => {
                    return Err(setup(format!("io_uring: {e}")))
                }
                Err(e) => why.push(format!("io_uring unavailable ({e})")),
            }
        }
        let mut threads = Vec::new();
        let mut slots_registered = false;
        let (reader, waker, kind): (Box<dyn Reader>, Waker, ReaderKind) = match uring {
            Some((r, eventfd)) => {
                slots_registered = r.slots_registered();
                (
                    Box::new(r),
                    Waker {
                        tx,
                        eventfd: Some(eventfd),
                    },
                    ReaderKind::Uring,
                )
            }
            None => {
                let waker = Waker { tx, eventfd: None };
                let (r, handles) =
                    PreadReader::new(&file, cfg.pread_threads, cfg.queue_depth, waker.clone())
                        .map_err(|e| setup(format!("pread pool: {e}")))?;
                threads.extend(handles);
                (Box::new(r), waker, ReaderKind::Pread)
            }
        };
        // A test setting: faults injected under the reader (see faults.rs).
        let reader = super::faults::FaultyReader::wrap(reader);
        let why = why.join("; ");
        if kind == ReaderKind::Pread && !why.is_empty() {
            tracing::info!(path = %path.display(), "I/O engine: pread thread pool: {why}");
        } else {
            tracing::debug!(path = %path.display(), %kind, direct, "I/O engine started");
        }
        let started = Started {
            kind,
            direct,
            why,
            reader,
            waker,
            rx,
            threads,
            slots_registered,
        };
        Self::run_threads(store, cfg, sizes, pools, started)
    }

    /// Spawns the decompression workers and the I/O thread around a chosen reader.
    fn run_threads(
        store: Arc<Store>,
        cfg: IoConfig,
        sizes: limits::Sizes,
        pools: Pools,
        started: Started,
    ) -> Result<IoEngine, IoError> {
        let path = store.weights_path().to_path_buf();
        let setup = setup_err(&path);
        let Started {
            kind,
            direct,
            why,
            reader,
            waker,
            rx,
            mut threads,
            slots_registered,
        } = started;
        let shared = Arc::new(Shared::new(cfg.read_buffers, cfg.staging_slots));
        // Decompression workers share one job queue.
        let (job_tx, job_rx) = sync_channel::<Job>(sizes.job_capacity(&cfg));
        let job_rx = Arc::new(Mutex::new(job_rx));
        let frame_raw_max = store.manifest().frame_raw_len_max() as usize;
        for i in 0..cfg.workers {
            let (job_rx, store, waker, shared) =
                (job_rx.clone(), store.clone(), waker.clone(), shared.clone());
            let mut dec = store
                .frame_decoder(frame_raw_max)
                .map_err(|e| setup(format!("decoder: {e}")))?;
            let mut joined = vec![0u8; sizes.frame_stored_max];
            let h = std::thread::Builder::new()
                .name(format!("sluice-decomp-{i}"))
                .spawn(move || worker(job_rx, store, waker, shared, &mut dec, &mut joined))
                .map_err(|e| setup(format!("spawn worker: {e}")))?;
            threads.push(h);
        }
        let slots = pools.slots.clone();
        let lp = Loop::new(
            store.clone(),
            cfg.clone(),
            reader,
            shared.clone(),
            &pools,
            job_tx,
            &sizes,
        );
        let io_thread = std::thread::Builder::new()
            .name("sluice-io".into())
            .spawn(move || lp.run(rx))
            .map_err(|e| setup(format!("spawn I/O thread: {e}")))?;
        threads.insert(0, io_thread);
        Ok(IoEngine {
            store,
            kind,
            direct,
            why,
            cfg,
            waker,
            shared,
            slots,
            slots_registered,
            next_ticket: AtomicU64::new(1),
            threads,
        })
    }

    /// Starts the engine around a reader the caller made (the loop's tests script one).
    #[cfg(test)]
    pub(super) fn with_reader(
        store: Arc<Store>,
        cfg: IoConfig,
        make: impl FnOnce(&[AlignedBuf]) -> Box<dyn Reader>,
    ) -> Result<IoEngine, IoError> {
        let path = store.weights_path().to_path_buf();
        let setup = setup_err(&path);
        let sizes = limits::check(&cfg, store.manifest()).map_err(&setup)?;
        let pools = Pools::allocate(&cfg, &sizes).map_err(&setup)?;
        let (tx, rx) = sync_channel::<Msg>(sizes.message_capacity(&cfg));
        let started = Started {
            kind: ReaderKind::Pread,
            direct: false,
            why: String::new(),
            reader: make(&pools.read_bufs),
            waker: Waker { tx, eventfd: None },
            rx,
            threads: Vec::new(),
            slots_registered: false,
        };
        Self::run_threads(store, cfg, sizes, pools, started)
    }

    pub fn kind(&self) -> ReaderKind {
        self.kind
    }

    /// Whether the staging slots are registered with io_uring (reads of units stored as
    /// raw land in them by READ_FIXED).
    pub fn slots_registered(&self) -> bool {
        self.slots_registered
    }

    /// Whether reads bypass the page cache.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Why the engine is not io_uring with O_DIRECT (empty when it is).
    pub fn fallback_reason(&self) -> &str {
        &self.why
    }

    pub fn config(&self) -> &IoConfig {
        &self.cfg
    }

    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Queues unit `unit` for loading. Requests are served in the order they are made.
    pub fn request(&self, unit: usize) -> Result<Ticket, IoError> {
        let units = self.store.units().len();
        if unit >= units {
            return Err(IoError::NoSuchUnit { unit, units });
        }
        let u = &self.store.units()[unit];
        if u.raw_len as usize > self.slot_bytes() {
            return Err(self.setup_error(format!(
                "{} ({} bytes) is larger than a staging slot ({} bytes): request it in parts",
                u.kind,
                u.raw_len,
                self.slot_bytes()
            )));
        }
        self.queue(unit, 0..u.frames.len(), u.raw_len as usize, false)
    }

    /// Queues frames `frames` of unit `unit` for loading into one staging slot: the slot
    /// then holds the unit's raw bytes from the first frame's raw offset on (see
    /// `LayerUnit::row_parts`, which chooses parts that fit).
    pub fn request_part(&self, unit: usize, frames: Range<usize>) -> Result<Ticket, IoError> {
        self.part(unit, frames, false)
    }

    /// `request_part` for a load the running compute waits for (an expert its layer routed
    /// to): it gets a staging slot and its reads before every request that is not urgent.
    pub fn request_part_urgent(
        &self,
        unit: usize,
        frames: Range<usize>,
    ) -> Result<Ticket, IoError> {
        self.part(unit, frames, true)
    }

    fn part(&self, unit: usize, frames: Range<usize>, urgent: bool) -> Result<Ticket, IoError> {
        let units = self.store.units().len();
        if unit >= units {
            return Err(IoError::NoSuchUnit { unit, units });
        }
        let u = &self.store.units()[unit];
        if frames.is_empty() || frames.end > u.frames.len() {
            return Err(self.setup_error(format!(
                "frames {frames:?} of {}, which has {}",
                u.kind,
                u.frames.len()
            )));
        }
        // Read straight into the slot, a part starts O_DIRECT-aligned and its rounded-up
        // tail fits the slot; otherwise it goes through read buffers (the engine's rule).
        let first = &u.frames[frames.start];
        let direct = self.cfg.read_into_slots
            && u.stored_as_raw()
            && first.file_offset.is_multiple_of(IO_ALIGN as u64)
            && u.part_span(frames.clone(), true) <= self.slot_bytes() as u64;
        let span = u.part_span(frames.clone(), direct);
        if span > self.slot_bytes() as u64 || (!direct && self.cfg.read_buffers == 0) {
            return Err(self.setup_error(format!(
                "frames {frames:?} of {} need {span} bytes of a staging slot of {}{}",
                u.kind,
                self.slot_bytes(),
                if direct || self.cfg.read_buffers > 0 {
                    ""
                } else {
                    " read straight into it (the engine has no read buffers)"
                }
            )));
        }
        let len = u.part_span(frames.clone(), false) as usize;
        self.queue(unit, frames, len, urgent)
    }

    fn slot_bytes(&self) -> usize {
        self.slots.first().map_or(0, |s| s.len())
    }

    fn setup_error(&self, msg: String) -> IoError {
        IoError::Setup {
            path: self.store.weights_path().to_path_buf(),
            msg,
        }
    }

    fn queue(
        &self,
        unit: usize,
        frames: Range<usize>,
        len: usize,
        urgent: bool,
    ) -> Result<Ticket, IoError> {
        if let Some(us) = &self.cfg.units {
            if !us.contains(&unit) {
                return Err(IoError::Setup {
                    path: self.store.weights_path().to_path_buf(),
                    msg: format!("unit {unit} was not among the units this engine's staging slots were sized for"),
                });
            }
        }
        if self.shared.stopped.load(Ordering::Acquire) {
            return Err(IoError::Stopped);
        }
        let id = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        self.shared
            .tickets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(id, TicketState::Queued);
        self.waker.send(Msg::Request {
            ticket: id,
            unit,
            frames,
            urgent,
        });
        Ok(Ticket {
            id,
            unit,
            len,
            waker: self.waker.clone(),
            shared: self.shared.clone(),
            consumed: false,
        })
    }

    /// Blocks until the ticket's unit is in a staging slot, or its load failed.
    pub fn wait(&self, mut ticket: Ticket) -> Result<SlotGuard<'_>, IoError> {
        ticket.consumed = true;
        let t0 = Instant::now();
        let mut tickets = self
            .shared
            .tickets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let result = loop {
            match tickets.get(&ticket.id) {
                Some(TicketState::Queued | TicketState::Loading { .. }) => {
                    if self.shared.stopped.load(Ordering::Acquire) {
                        tickets.remove(&ticket.id);
                        break Err(IoError::Stopped);
                    }
                    tickets = self
                        .shared
                        .ready
                        .wait(tickets)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                Some(TicketState::Ready { slot }) => {
                    let slot = *slot;
                    tickets.remove(&ticket.id);
                    break Ok(SlotGuard {
                        engine: self,
                        slot,
                        unit: ticket.unit,
                        len: ticket.len,
                    });
                }
                Some(TicketState::Failed(_)) => match tickets.remove(&ticket.id) {
                    Some(TicketState::Failed(e)) => {
                        // Dropping the ticket tells the engine it may free a slot it kept
                        // for a failed unit whose decoded prefix was handed out.
                        ticket.consumed = false;
                        break Err(e);
                    }
                    _ => unreachable!("matched Failed above"),
                },
                Some(TicketState::FailureReported) => {
                    tickets.remove(&ticket.id);
                    ticket.consumed = false;
                    break Err(IoError::FailureReported);
                }
                None => break Err(IoError::Stopped),
            }
        };
        drop(tickets);
        self.count_stall(t0);
        result
    }

    /// Blocks until at least `at_least` bytes at the start of the ticket's unit are decoded
    /// (frames finish in any order; this is the contiguous prefix), or the unit is complete
    /// (`Ok(None)`: `wait` then returns it at once), or its load failed. The prefix stays
    /// valid and unchanged while the ticket lives, even if a later frame fails: the slot is
    /// then kept until the ticket is dropped, so a copy still reading the prefix is safe.
    pub fn wait_progress<'a>(
        &'a self,
        ticket: &'a Ticket,
        at_least: usize,
    ) -> Result<Option<&'a [u8]>, IoError> {
        let t0 = Instant::now();
        let mut tickets = self
            .shared
            .tickets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let result = loop {
            match tickets.get(&ticket.id) {
                Some(TicketState::Loading { slot, ready }) if *ready >= at_least => {
                    // SAFETY: the first `ready` bytes of the slot were written by workers
                    // whose FrameDone the engine handled before publishing (under this
                    // mutex); no frame writes there again, and the slot is not freed or
                    // reused while the ticket lives (see `maybe_finish`).
                    let data = unsafe {
                        std::slice::from_raw_parts(self.slots[*slot].as_ptr() as *const u8, *ready)
                    };
                    break Ok(Some(data));
                }
                Some(TicketState::Ready { .. }) => break Ok(None),
                Some(TicketState::Queued | TicketState::Loading { .. }) => {
                    if self.shared.stopped.load(Ordering::Acquire) {
                        break Err(IoError::Stopped);
                    }
                    tickets = self
                        .shared
                        .ready
                        .wait(tickets)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                Some(TicketState::Failed(_) | TicketState::FailureReported) => {
                    // The entry stays until the ticket is dropped: the engine keeps the
                    // slot while it is there.
                    match tickets.insert(ticket.id, TicketState::FailureReported) {
                        Some(TicketState::Failed(e)) => break Err(e),
                        _ => break Err(IoError::FailureReported),
                    }
                }
                None => break Err(IoError::Stopped),
            }
        };
        drop(tickets);
        self.count_stall(t0);
        result
    }

    fn count_stall(&self, since: Instant) {
        self.shared
            .counters
            .wait_stall_ns
            .fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// Releases a slot (the same as dropping the guard).
    pub fn release(&self, guard: SlotGuard<'_>) {
        drop(guard);
    }

    pub fn stats(&self) -> IoStats {
        self.shared.counters.snapshot()
    }

    pub fn reset_stats(&self) {
        self.shared.counters.reset()
    }

    pub fn pool_status(&self) -> PoolStatus {
        self.pool_gauge().read()
    }

    /// A handle that reads the pools' levels from another thread (the daemon's status).
    pub fn pool_gauge(&self) -> PoolGauge {
        PoolGauge {
            shared: self.shared.clone(),
            read_buffers: self.cfg.read_buffers,
            slots: self.cfg.staging_slots,
            slots_pageable: match self.cfg.pinner {
                Some(_) => self.slots.iter().filter(|s| !s.is_pinned()).count(),
                None => 0,
            },
        }
    }
}

impl Drop for IoEngine {
    fn drop(&mut self) {
        self.waker.send(Msg::Shutdown);
        // The I/O thread waits for every read in flight (the kernel may still write into
        // the buffers) and every frame at a worker, then drops the job queue so workers end.
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}
