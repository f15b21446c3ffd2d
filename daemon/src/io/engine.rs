//! The engine thread's loop, the decompression workers, and the caller-facing API.

use super::buffers::{AlignedBuf, IO_ALIGN};
use super::{pread::PreadReader, uring::UringReader};
use super::{EngineChoice, EngineKind, IoConfig, IoError, IoStats};
use crate::store::codec::{FrameDecoder, FrameFault};
use crate::store::Store;
use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// Reads return their byte count as an i32 (io_uring's cqe result): keep requests well below.
const REQUEST_BYTES_MAX: usize = 1 << 30;

/// Messages to the engine thread. Everything that changes engine state goes through here,
/// so one thread owns the bookkeeping.
pub(super) enum Msg {
    Request {
        ticket: u64,
        unit: usize,
    },
    Cancel {
        ticket: u64,
    },
    Release {
        slot: usize,
    },
    FrameDone {
        slot: usize,
        frame: usize,
        fault: Option<FrameFault>,
    },
    /// A pread completion: bytes read, or -errno.
    ReadDone {
        op: usize,
        res: i32,
    },
    Shutdown,
}

/// Sends to the engine thread and wakes it (io_uring waits on an eventfd).
#[derive(Clone)]
pub(super) struct Waker {
    tx: Sender<Msg>,
    eventfd: Option<Arc<EventFd>>,
}

impl Waker {
    pub(super) fn send(&self, msg: Msg) {
        if self.tx.send(msg).is_ok() {
            if let Some(e) = &self.eventfd {
                e.signal();
            }
        }
    }
}

pub(super) struct EventFd(pub(super) std::os::fd::OwnedFd);

impl EventFd {
    pub(super) fn new() -> std::io::Result<EventFd> {
        // SAFETY: plain syscall; the result is checked before it is wrapped.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor we own.
        Ok(EventFd(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }))
    }

    pub(super) fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd; EAGAIN (counter full) is fine.
        unsafe {
            libc::write(
                self.0.as_raw_fd(),
                &one as *const u64 as *const libc::c_void,
                8,
            )
        };
    }

    pub(super) fn drain(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads 8 bytes into a live u64; EAGAIN when already zero is fine.
        unsafe {
            libc::read(
                self.0.as_raw_fd(),
                &mut v as *mut u64 as *mut libc::c_void,
                8,
            )
        };
    }
}

/// The read side: io_uring or the pread pool.
pub(super) trait Reader: Send {
    /// Queues one read of `len` bytes at `offset` into read buffer `buf` at `ptr`.
    fn push(
        &mut self,
        op: usize,
        buf: usize,
        ptr: *mut u8,
        len: usize,
        offset: u64,
    ) -> std::io::Result<()>;
    /// Submits what was pushed and blocks until at least one completion or message;
    /// completions go to `done` as (op, bytes or -errno), messages to `msgs`.
    fn wait(
        &mut self,
        rx: &Receiver<Msg>,
        msgs: &mut Vec<Msg>,
        done: &mut Vec<(usize, i32)>,
    ) -> std::io::Result<()>;
}

#[derive(Debug)]
enum TicketState {
    Queued,
    /// Loading into `slot`; the first `ready` bytes of the blob are decoded.
    Loading {
        slot: usize,
        ready: usize,
    },
    Ready {
        slot: usize,
    },
    Failed(IoError),
    /// Failed, and `wait_progress` returned the error; the consumer still holds the
    /// ticket (and may still be copying the prefix).
    FailureReported,
}

#[derive(Default)]
struct Counters {
    read_bytes: AtomicU64,
    read_ops: AtomicU64,
    short_reads: AtomicU64,
    read_busy_ns: AtomicU64,
    decoded_stored_bytes: AtomicU64,
    decompressed_bytes: AtomicU64,
    decompress_busy_ns: AtomicU64,
    wait_stall_ns: AtomicU64,
    buffer_stall_ns: AtomicU64,
    slot_stall_ns: AtomicU64,
    units_done: AtomicU64,
    units_failed: AtomicU64,
    /// Sum over time of reads in flight (ns x reads), for the average queue depth.
    inflight_ns: AtomicU64,
}

struct Shared {
    tickets: Mutex<HashMap<u64, TicketState>>,
    ready: Condvar,
    stopped: AtomicBool,
    counters: Counters,
    free_read_buffers: AtomicUsize,
    free_slots: AtomicUsize,
}

impl Shared {
    fn publish(&self, ticket: u64, state: TicketState) {
        let mut t = self.tickets.lock().expect("ticket lock");
        if let Some(s) = t.get_mut(&ticket) {
            *s = state;
        }
        drop(t);
        self.ready.notify_all();
    }
}

/// A request for one layer unit. Pass it to `wait`; dropping it unwaited cancels it.
pub struct Ticket {
    id: u64,
    unit: usize,
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
                .expect("ticket lock")
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStatus {
    pub read_buffers_free: usize,
    pub read_buffers: usize,
    pub slots_free: usize,
    pub slots: usize,
}

pub struct IoEngine {
    store: Arc<Store>,
    kind: EngineKind,
    direct: bool,
    why: String,
    cfg: IoConfig,
    waker: Waker,
    shared: Arc<Shared>,
    slots: Arc<Vec<AlignedBuf>>,
    next_ticket: AtomicU64,
    threads: Vec<std::thread::JoinHandle<()>>,
}

/// Raw pointers handed to workers. Their validity is argued where jobs are made.
struct Job {
    slot: usize,
    unit: usize,
    frame: usize,
    pieces: Vec<(*const u8, usize)>,
    dst: *mut u8,
}
// SAFETY: the pointers target read buffers and a staging slot that the engine thread keeps
// alive and untouched until the worker's FrameDone arrives (see `dispatch`).
unsafe impl Send for Job {}

fn open_weights(path: &std::path::Path, direct: bool) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut o = std::fs::OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// Reads the first block with O_DIRECT: some file systems accept the flag at open and
/// refuse the reads.
fn probe_direct(file: &File) -> std::io::Result<()> {
    let mut b = AlignedBuf::new(IO_ALIGN).ok_or_else(|| std::io::Error::other("out of memory"))?;
    std::os::unix::fs::FileExt::read_at(file, b.as_mut_slice(), 0).map(|_| ())
}

impl IoEngine {
    /// Opens the store's weights.bin and starts the engine.
    pub fn new(store: Arc<Store>, cfg: IoConfig) -> Result<IoEngine, IoError> {
        let path = store.weights_path().to_path_buf();
        let setup = |msg: String| IoError::Setup {
            path: path.clone(),
            msg,
        };
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
        let mut choice = cfg.engine;
        if choice == EngineChoice::Auto && !direct {
            why.push("io_uring is used with O_DIRECT only".into());
            choice = EngineChoice::Pread;
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
        let choice = cfg.engine;
        Self::start(store, file, direct, choice, cfg, Vec::new())
    }

    fn start(
        store: Arc<Store>,
        file: File,
        direct: bool,
        choice: EngineChoice,
        cfg: IoConfig,
        mut why: Vec<String>,
    ) -> Result<IoEngine, IoError> {
        let path = store.weights_path().to_path_buf();
        let setup = |msg: String| IoError::Setup {
            path: path.clone(),
            msg,
        };
        let m = store.manifest();
        // Limits and their relations, each with the reason it must hold.
        if cfg.request_bytes == 0
            || !cfg.request_bytes.is_multiple_of(IO_ALIGN)
            || cfg.request_bytes > REQUEST_BYTES_MAX
        {
            return Err(setup(format!(
                "request size {} must be a non-zero multiple of {IO_ALIGN} (O_DIRECT)",
                cfg.request_bytes
            )));
        }
        if cfg.queue_depth == 0 || cfg.queue_depth > super::QUEUE_DEPTH_MAX {
            return Err(setup(format!(
                "queue depth {} must be in 1..={}",
                cfg.queue_depth,
                super::QUEUE_DEPTH_MAX
            )));
        }
        if cfg.staging_slots == 0 || cfg.workers == 0 || cfg.pread_threads == 0 {
            return Err(setup(
                "staging slots, workers and pread threads must each be at least 1".into(),
            ));
        }
        // A frame is decoded only once every read it overlaps has landed, and reads are
        // issued in order: the largest frame (plus the alignment slack at both ends) must
        // fit in the read buffers at once, or the engine could wait forever.
        let frame_stored_max = m
            .units
            .iter()
            .flat_map(|u| &u.frames)
            .map(|f| f.stored_len())
            .max()
            .unwrap_or(0) as usize;
        let buffers_needed = (frame_stored_max + 2 * IO_ALIGN).div_ceil(cfg.request_bytes) + 1;
        if cfg.read_buffers < buffers_needed {
            return Err(setup(format!(
                "{} read buffers of {} bytes cannot hold the largest frame ({frame_stored_max} stored bytes): need at least {buffers_needed}",
                cfg.read_buffers, cfg.request_bytes
            )));
        }
        let slot_bytes = match &cfg.units {
            None => m.units.iter().map(|u| u.raw_len).max().unwrap_or(0),
            Some(us) => us
                .iter()
                .filter_map(|&u| m.units.get(u))
                .map(|u| u.raw_len)
                .max()
                .unwrap_or(0),
        } as usize;
        let alloc = |n: usize, len: usize, what: &str| -> Result<Vec<AlignedBuf>, IoError> {
            (0..n)
                .map(|_| {
                    AlignedBuf::new(len)
                        .ok_or_else(|| setup(format!("cannot allocate {n} {what} of {len} bytes")))
                })
                .collect()
        };
        let read_bufs = Arc::new(alloc(cfg.read_buffers, cfg.request_bytes, "read buffers")?);
        let mut slots = alloc(cfg.staging_slots, slot_bytes, "staging slots")?;
        if let Some(p) = &cfg.pinner {
            for s in &mut slots {
                s.pin(p).map_err(|e| setup(format!("staging slots: {e}")))?;
            }
        }
        let slots = Arc::new(slots);

        let (tx, rx) = channel::<Msg>();
        let shared = Arc::new(Shared {
            tickets: Mutex::new(HashMap::new()),
            ready: Condvar::new(),
            stopped: AtomicBool::new(false),
            counters: Counters::default(),
            free_read_buffers: AtomicUsize::new(cfg.read_buffers),
            free_slots: AtomicUsize::new(cfg.staging_slots),
        });

        // The reader: io_uring, or the pread pool when asked or when io_uring fails.
        let mut reader: Option<Box<dyn Reader>> = None;
        let mut eventfd = None;
        let mut kind = EngineKind::Pread;
        if matches!(choice, EngineChoice::Auto | EngineChoice::Uring) {
            match UringReader::new(&file, &read_bufs, cfg.queue_depth) {
                Ok((r, efd)) => {
                    reader = Some(Box::new(r));
                    eventfd = Some(efd);
                    kind = EngineKind::Uring;
                }
                Err(e) if choice == EngineChoice::Uring => {
                    return Err(setup(format!("io_uring: {e}")))
                }
                Err(e) => why.push(format!("io_uring unavailable ({e})")),
            }
        }
        let waker = Waker { tx, eventfd };
        let mut threads = Vec::new();
        let reader = match reader {
            Some(r) => r,
            None => {
                let (r, handles) = PreadReader::new(&file, cfg.pread_threads, waker.clone())
                    .map_err(|e| setup(format!("pread pool: {e}")))?;
                threads.extend(handles);
                Box::new(r)
            }
        };
        let why = why.join("; ");
        if kind == EngineKind::Pread && !why.is_empty() {
            tracing::info!(path = %path.display(), "I/O engine: pread thread pool: {why}");
        } else {
            tracing::debug!(path = %path.display(), %kind, direct, "I/O engine started");
        }

        // Decompression workers share one job queue.
        let (job_tx, job_rx) = channel::<Job>();
        let job_rx = Arc::new(Mutex::new(job_rx));
        let frame_raw_max = m.frame_raw_len_max() as usize;
        for i in 0..cfg.workers {
            let (job_rx, store, waker, shared) =
                (job_rx.clone(), store.clone(), waker.clone(), shared.clone());
            let mut dec =
                FrameDecoder::new(frame_raw_max).map_err(|e| setup(format!("decoder: {e}")))?;
            let mut joined = vec![0u8; frame_stored_max];
            let h = std::thread::Builder::new()
                .name(format!("sluice-decomp-{i}"))
                .spawn(move || worker(job_rx, store, waker, shared, &mut dec, &mut joined))
                .map_err(|e| setup(format!("spawn worker: {e}")))?;
            threads.push(h);
        }

        let lp = Loop {
            store: store.clone(),
            cfg: cfg.clone(),
            reader,
            shared: shared.clone(),
            read_bufs,
            free_bufs: (0..cfg.read_buffers).rev().collect(),
            slots: slots.clone(),
            slot_state: vec![SlotState::Free; cfg.staging_slots],
            active: (0..cfg.staging_slots).map(|_| None).collect(),
            order: VecDeque::new(),
            queue: VecDeque::new(),
            ops: (0..cfg.queue_depth).map(|_| None).collect(),
            free_ops: (0..cfg.queue_depth).rev().collect(),
            in_flight: 0,
            in_flight_since: Instant::now(),
            jobs: job_tx,
            shutting_down: false,
            busy_since: None,
            buf_starved_since: None,
            slot_starved_since: None,
            path: path.clone(),
        };
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
            next_ticket: AtomicU64::new(1),
            threads,
        })
    }

    pub fn kind(&self) -> EngineKind {
        self.kind
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
            .expect("ticket lock")
            .insert(id, TicketState::Queued);
        self.waker.send(Msg::Request { ticket: id, unit });
        Ok(Ticket {
            id,
            unit,
            waker: self.waker.clone(),
            shared: self.shared.clone(),
            consumed: false,
        })
    }

    /// Blocks until the ticket's unit is in a staging slot, or its load failed.
    pub fn wait(&self, mut ticket: Ticket) -> Result<SlotGuard<'_>, IoError> {
        ticket.consumed = true;
        let t0 = Instant::now();
        let mut tickets = self.shared.tickets.lock().expect("ticket lock");
        let result = loop {
            match tickets.get(&ticket.id) {
                Some(TicketState::Queued | TicketState::Loading { .. }) => {
                    if self.shared.stopped.load(Ordering::Acquire) {
                        tickets.remove(&ticket.id);
                        break Err(IoError::Stopped);
                    }
                    tickets = self.shared.ready.wait(tickets).expect("ticket lock");
                }
                Some(TicketState::Ready { slot }) => {
                    let slot = *slot;
                    tickets.remove(&ticket.id);
                    let len = self.store.units()[ticket.unit].raw_len as usize;
                    break Ok(SlotGuard {
                        engine: self,
                        slot,
                        unit: ticket.unit,
                        len,
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
        let mut tickets = self.shared.tickets.lock().expect("ticket lock");
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
                    tickets = self.shared.ready.wait(tickets).expect("ticket lock");
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
        let c = &self.shared.counters;
        let s = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e9;
        IoStats {
            read_bytes: c.read_bytes.load(Ordering::Relaxed),
            read_ops: c.read_ops.load(Ordering::Relaxed),
            short_reads: c.short_reads.load(Ordering::Relaxed),
            read_busy_s: s(&c.read_busy_ns),
            decoded_stored_bytes: c.decoded_stored_bytes.load(Ordering::Relaxed),
            decompressed_bytes: c.decompressed_bytes.load(Ordering::Relaxed),
            decompress_busy_s: s(&c.decompress_busy_ns),
            wait_stall_s: s(&c.wait_stall_ns),
            buffer_stall_s: s(&c.buffer_stall_ns),
            slot_stall_s: s(&c.slot_stall_ns),
            units_done: c.units_done.load(Ordering::Relaxed),
            units_failed: c.units_failed.load(Ordering::Relaxed),
            queue_depth_avg: c.inflight_ns.load(Ordering::Relaxed) as f64
                / 1e9
                / s(&c.read_busy_ns).max(1e-9),
        }
    }

    pub fn reset_stats(&self) {
        let c = &self.shared.counters;
        for a in [
            &c.read_bytes,
            &c.read_ops,
            &c.short_reads,
            &c.read_busy_ns,
            &c.decoded_stored_bytes,
            &c.decompressed_bytes,
            &c.decompress_busy_ns,
            &c.wait_stall_ns,
            &c.buffer_stall_ns,
            &c.slot_stall_ns,
            &c.units_done,
            &c.units_failed,
            &c.inflight_ns,
        ] {
            a.store(0, Ordering::Relaxed);
        }
    }

    pub fn pool_status(&self) -> PoolStatus {
        PoolStatus {
            read_buffers_free: self.shared.free_read_buffers.load(Ordering::Acquire),
            read_buffers: self.cfg.read_buffers,
            slots_free: self.shared.free_slots.load(Ordering::Acquire),
            slots: self.cfg.staging_slots,
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

fn worker(
    jobs: Arc<Mutex<Receiver<Job>>>,
    store: Arc<Store>,
    waker: Waker,
    shared: Arc<Shared>,
    dec: &mut FrameDecoder,
    joined: &mut [u8],
) {
    loop {
        let job = match jobs.lock().expect("job lock").recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        let t0 = Instant::now();
        let f = &store.units()[job.unit].frames[job.frame];
        let stored_len = f.stored_len() as usize;
        // SAFETY: see Job: the read buffers and the slot region stay valid and unaliased
        // until FrameDone is handled; the slot region is this frame's alone.
        let dst = unsafe { std::slice::from_raw_parts_mut(job.dst, f.raw_len as usize) };
        let stored: &[u8] = if job.pieces.len() == 1 {
            // SAFETY: as above.
            unsafe { std::slice::from_raw_parts(job.pieces[0].0, job.pieces[0].1) }
        } else {
            // A frame spanning reads is joined into this worker's scratch: the one copy
            // the engine makes, for a few frames per layer.
            let mut at = 0;
            for &(p, n) in &job.pieces {
                // SAFETY: as above.
                joined[at..at + n].copy_from_slice(unsafe { std::slice::from_raw_parts(p, n) });
                at += n;
            }
            &joined[..at]
        };
        debug_assert_eq!(stored.len(), stored_len);
        let fault = dec
            .decode(f.codec, &f.planes, f.checksum, stored, dst)
            .err();
        let c = &shared.counters;
        c.decompress_busy_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if fault.is_none() {
            c.decoded_stored_bytes
                .fetch_add(stored_len as u64, Ordering::Relaxed);
            c.decompressed_bytes
                .fetch_add(f.raw_len as u64, Ordering::Relaxed);
        }
        waker.send(Msg::FrameDone {
            slot: job.slot,
            frame: job.frame,
            fault,
        });
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    Free,
    Loading,
    /// Ready and handed to the caller of ticket `.0` (or waiting to be).
    Held(u64),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum FrameState {
    Waiting,
    AtWorker,
    Done,
}

struct Chunk {
    offset: u64,
    len: usize,
    buf: Option<usize>,
    done: bool,
    frames: Range<usize>,
}

struct Active {
    ticket: u64,
    unit: usize,
    chunks: Vec<Chunk>,
    next_chunk: usize,
    frames: Vec<FrameState>,
    frames_left: usize,
    /// Frames done from the first one on, without a gap (the decoded prefix).
    prefix: usize,
    /// A decoded prefix was published: a consumer may be copying out of the slot.
    progressed: bool,
    at_worker: usize,
    ops: usize,
    /// Failed or cancelled: nothing more is read or dispatched; the slot is freed once the
    /// reads in flight and the frames at workers are back.
    aborted: bool,
}

struct Op {
    slot: usize,
    chunk: usize,
    /// Bytes of the chunk already read (short reads resubmit the rest).
    done: usize,
}

struct Loop {
    store: Arc<Store>,
    cfg: IoConfig,
    reader: Box<dyn Reader>,
    shared: Arc<Shared>,
    read_bufs: Arc<Vec<AlignedBuf>>,
    free_bufs: Vec<usize>,
    slots: Arc<Vec<AlignedBuf>>,
    slot_state: Vec<SlotState>,
    active: Vec<Option<Active>>,
    /// Active slots in admission order: older requests' reads go first.
    order: VecDeque<usize>,
    queue: VecDeque<(u64, usize)>,
    ops: Vec<Option<Op>>,
    free_ops: Vec<usize>,
    in_flight: usize,
    /// When `in_flight` last changed (for the queue-depth integral).
    in_flight_since: Instant,
    jobs: Sender<Job>,
    shutting_down: bool,
    busy_since: Option<Instant>,
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
    fn run(mut self, rx: Receiver<Msg>) {
        let _stop = StopOnDrop(self.shared.clone());
        let mut msgs = Vec::new();
        let mut done = Vec::new();
        loop {
            for m in msgs.drain(..) {
                self.handle(m);
            }
            for (op, res) in done.drain(..) {
                self.complete(op, res);
            }
            self.admit();
            self.submit();
            self.account();
            if self.shutting_down
                && self.in_flight == 0
                && self.active.iter().flatten().all(|a| a.at_worker == 0)
            {
                return;
            }
            if let Err(e) = self.reader.wait(&rx, &mut msgs, &mut done) {
                // The ring itself failed: nothing can be read any more. Fail everything
                // that waits, and stop.
                tracing::error!(path = %self.path.display(), "I/O engine stopped: {e}");
                return;
            }
        }
    }

    fn handle(&mut self, m: Msg) {
        match m {
            Msg::Request { ticket, unit } => {
                if self.shutting_down {
                    self.shared
                        .publish(ticket, TicketState::Failed(IoError::Stopped));
                } else {
                    self.queue.push_back((ticket, unit));
                }
            }
            Msg::Cancel { ticket } => {
                self.queue.retain(|&(t, _)| t != ticket);
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
            Msg::FrameDone { slot, frame, fault } => self.frame_done(slot, frame, fault),
            Msg::ReadDone { op, res } => self.complete(op, res),
            Msg::Shutdown => {
                self.shutting_down = true;
                for (ticket, _) in std::mem::take(&mut self.queue) {
                    self.shared
                        .publish(ticket, TicketState::Failed(IoError::Stopped));
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
        while let Some(&(ticket, unit)) = self.queue.front() {
            let Some(slot) = self.slot_state.iter().position(|&s| s == SlotState::Free) else {
                break;
            };
            self.queue.pop_front();
            self.slot_state[slot] = SlotState::Loading;
            self.shared.free_slots.fetch_sub(1, Ordering::AcqRel);
            let u = &self.store.units()[unit];
            // The blob starts 4096-aligned; its end is rounded up (the file is padded).
            let (start, end) = (
                u.file_offset,
                (u.file_offset + u.stored_len).div_ceil(IO_ALIGN as u64) * IO_ALIGN as u64,
            );
            let req = self.cfg.request_bytes as u64;
            let mut chunks = Vec::new();
            let mut at = start;
            while at < end {
                let len = (end - at).min(req);
                let lo = u
                    .frames
                    .partition_point(|f| f.file_offset + f.stored_len() <= at);
                let hi = u.frames.partition_point(|f| f.file_offset < at + len);
                chunks.push(Chunk {
                    offset: at,
                    len: len as usize,
                    buf: None,
                    done: false,
                    frames: lo..hi,
                });
                at += len;
            }
            let n = u.frames.len();
            self.active[slot] = Some(Active {
                ticket,
                unit,
                chunks,
                next_chunk: 0,
                frames: vec![FrameState::Waiting; n],
                frames_left: n,
                prefix: 0,
                progressed: false,
                at_worker: 0,
                ops: 0,
                aborted: false,
            });
            self.order.push_back(slot);
            self.maybe_finish(slot);
        }
    }

    /// Issues reads, oldest request first, while buffers and queue slots last.
    fn submit(&mut self) {
        let order: Vec<usize> = self.order.iter().copied().collect();
        'outer: for slot in order {
            loop {
                let Some(a) = self.active[slot].as_mut() else {
                    continue 'outer;
                };
                if a.aborted || a.next_chunk >= a.chunks.len() {
                    continue 'outer;
                }
                if self.free_bufs.is_empty() || self.free_ops.is_empty() {
                    break 'outer;
                }
                let (Some(buf), Some(op)) = (self.free_bufs.pop(), self.free_ops.pop()) else {
                    unreachable!("checked non-empty")
                };
                self.shared.free_read_buffers.fetch_sub(1, Ordering::AcqRel);
                let c = a.next_chunk;
                a.next_chunk += 1;
                a.ops += 1;
                let chunk = &mut a.chunks[c];
                chunk.buf = Some(buf);
                let (offset, len) = (chunk.offset, chunk.len);
                self.ops[op] = Some(Op {
                    slot,
                    chunk: c,
                    done: 0,
                });
                self.push_read(op, buf, 0, len, offset);
            }
        }
    }

    fn push_read(&mut self, op: usize, buf: usize, at: usize, len: usize, offset: u64) {
        let b = &self.read_bufs[buf];
        // Assert the O_DIRECT preconditions before every submission (STYLE.md 4).
        assert!(at + len <= b.len(), "read past its buffer");
        debug_assert!(
            offset.is_multiple_of(IO_ALIGN as u64) || at != 0,
            "unaligned read offset"
        );
        // SAFETY: `at + len` is inside the buffer (asserted); the buffer stays with this op
        // until its completion is handled.
        let ptr = unsafe { b.as_ptr().add(at) };
        if self.in_flight == 0 {
            self.busy_since = Some(Instant::now());
        }
        self.note_depth();
        self.in_flight += 1;
        self.shared
            .counters
            .read_ops
            .fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.reader.push(op, buf, ptr, len, offset) {
            // Could not even queue it: complete it as failed right here.
            self.in_flight -= 1;
            self.complete_with(op, -e.raw_os_error().unwrap_or(libc::EIO));
        }
    }

    /// Adds the time at the current depth to the queue-depth integral.
    fn note_depth(&mut self) {
        let now = Instant::now();
        let dt = (now - self.in_flight_since).as_nanos() as u64;
        self.shared
            .counters
            .inflight_ns
            .fetch_add(dt * self.in_flight as u64, Ordering::Relaxed);
        self.in_flight_since = now;
    }

    fn complete(&mut self, op: usize, res: i32) {
        self.note_depth();
        self.in_flight -= 1;
        if self.in_flight == 0 {
            if let Some(t) = self.busy_since.take() {
                self.shared
                    .counters
                    .read_busy_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        }
        self.complete_with(op, res);
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
        let (buf, offset, len) = (
            chunk.buf.expect("submitted chunk has a buffer"),
            chunk.offset,
            chunk.len,
        );
        if res > 0 && !a.aborted && (o.done + res as usize) < len {
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
            self.push_read(op, buf, done, len - done, offset + done as u64);
            return;
        }
        self.free_ops.push(op);
        a.ops -= 1;
        let chunk_idx = o.chunk;
        if res <= 0 || a.aborted {
            let a = self.active[slot].as_mut().expect("active");
            a.chunks[chunk_idx].done = true;
            if !a.aborted {
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
        // Dispatch every frame of this chunk whose reads have all landed. Without decoding
        // a frame completes right here, so every chunk its frames span may free too.
        let frames = a.chunks[chunk_idx].frames.clone();
        let req = self.cfg.request_bytes as u64;
        let unit_frames = &self.store.units()[a.unit].frames;
        let span = |f: usize| {
            Self::chunks_of(
                a,
                (unit_frames[f].file_offset, unit_frames[f].stored_len()),
                req,
            )
        };
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

    /// Chunks overlapping frame `f` of `a`.
    fn chunks_of(a: &Active, frame_file: (u64, u64), req: u64) -> Range<usize> {
        let base = a.chunks.first().map_or(0, |c| c.offset);
        let (fo, fl) = frame_file;
        let first = ((fo - base) / req) as usize;
        let last = ((fo + fl.max(1) - 1 - base) / req) as usize;
        first..(last + 1).min(a.chunks.len())
    }

    fn dispatch(&mut self, slot: usize, f: usize) {
        let req = self.cfg.request_bytes as u64;
        let a = self.active[slot].as_mut().expect("active");
        if a.aborted || a.frames[f] != FrameState::Waiting {
            return;
        }
        let frame = &self.store.units()[a.unit].frames[f];
        let (fo, fl) = (frame.file_offset, frame.stored_len());
        let range = Self::chunks_of(a, (fo, fl), req);
        if !a.chunks[range.clone()].iter().all(|c| c.done) {
            return;
        }
        if !self.cfg.decompress {
            a.frames[f] = FrameState::Done;
            a.frames_left -= 1;
            return;
        }
        let mut pieces = Vec::with_capacity(range.len());
        for c in &a.chunks[range] {
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
                unsafe { buf.as_ptr().add((lo - c.offset) as usize) } as *const u8,
                (hi - lo) as usize,
            ));
        }
        // SAFETY: raw_offset + raw_len <= unit raw_len <= slot length (validated manifest,
        // slots sized to the largest unit); frames cover disjoint raw ranges, and the slot
        // is Loading (no caller holds it) until every frame is back.
        let dst = unsafe { self.slots[slot].as_ptr().add(frame.raw_offset as usize) };
        a.frames[f] = FrameState::AtWorker;
        a.at_worker += 1;
        let job = Job {
            slot,
            unit: a.unit,
            frame: f,
            pieces,
            dst,
        };
        if self.jobs.send(job).is_err() {
            // Workers are gone (only at teardown): treat as a failed frame.
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
        let req = self.cfg.request_bytes as u64;
        let a = self.active[slot]
            .as_mut()
            .expect("a frame's unit stays active until it is back");
        debug_assert!(a.frames[f] == FrameState::AtWorker);
        a.frames[f] = FrameState::Done;
        a.at_worker -= 1;
        let frame = &self.store.units()[a.unit].frames[f];
        let range = Self::chunks_of(a, (frame.file_offset, frame.stored_len()), req);
        match fault {
            None => {
                a.frames_left -= 1;
                let before = a.prefix;
                while a.prefix < a.frames.len() && a.frames[a.prefix] == FrameState::Done {
                    a.prefix += 1;
                }
                if a.prefix > before && a.frames_left > 0 && !a.aborted {
                    let last = &self.store.units()[a.unit].frames[a.prefix - 1];
                    let ready = (last.raw_offset + last.raw_len as u64) as usize;
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
        let mut freed = Vec::new();
        {
            let Some(a) = self.active[slot].as_mut() else {
                return;
            };
            for c in range {
                let ch = &a.chunks[c];
                if ch.buf.is_none() || !ch.done {
                    continue;
                }
                let settled = a.frames[ch.frames.clone()]
                    .iter()
                    .all(|&s| s == FrameState::Done || (a.aborted && s == FrameState::Waiting));
                if settled {
                    freed.push(a.chunks[c].buf.take().expect("checked"));
                }
            }
        }
        for b in freed {
            self.free_buf(b);
        }
    }

    /// Fails (err = Some) or cancels (None) the unit in `slot`.
    fn abort(&mut self, slot: usize, err: Option<IoError>) {
        let Some(a) = self.active[slot].as_mut() else {
            return;
        };
        if a.aborted {
            return;
        }
        a.aborted = true;
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
        if a.aborted {
            if a.ops == 0 && a.at_worker == 0 {
                assert!(
                    a.chunks.iter().all(|c| c.buf.is_none()),
                    "a finished unit still holds read buffers"
                );
                let (ticket, progressed) = (a.ticket, a.progressed);
                self.active[slot] = None;
                self.order.retain(|&s| s != slot);
                // A failed unit whose prefix was handed out keeps its slot until the
                // ticket is dropped (its Cancel frees a Held slot): a copy may still be
                // reading the prefix. A cancelled ticket is already gone from the map.
                let consumer_alive = progressed
                    && self
                        .shared
                        .tickets
                        .lock()
                        .expect("ticket lock")
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
            self.active[slot] = None;
            self.order.retain(|&s| s != slot);
            self.slot_state[slot] = SlotState::Held(ticket);
            self.shared
                .counters
                .units_done
                .fetch_add(1, Ordering::Relaxed);
            let waiting = self
                .shared
                .tickets
                .lock()
                .expect("ticket lock")
                .contains_key(&ticket);
            if waiting {
                self.shared.publish(ticket, TicketState::Ready { slot });
            } else {
                // Cancelled while its last frame was at a worker.
                self.free_slot(slot);
            }
        }
    }

    /// Stall accounting: time with reads waiting for buffers, requests waiting for slots.
    fn account(&mut self) {
        let now = Instant::now();
        let wants_buf = self.order.iter().any(|&s| {
            self.active[s]
                .as_ref()
                .is_some_and(|a| !a.aborted && a.next_chunk < a.chunks.len())
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
