//! What the I/O thread and its readers exchange: the messages every other thread sends
//! it, the waker that delivers them, and the `Reader` trait that io_uring and the pread
//! pool implement (so the loop is the same for both).

use crate::store::codec::FrameFault;
use std::os::fd::AsRawFd;
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;
use std::time::Duration;

/// Messages to the engine thread. Everything that changes engine state goes through here,
/// so one thread owns the bookkeeping.
pub(super) enum Msg {
    /// Load frames `frames` of `unit` (all of them for a whole unit).
    Request {
        ticket: u64,
        unit: usize,
        frames: std::ops::Range<usize>,
        /// Read before the requests already waiting (an expert a running layer needs),
        /// after the urgent ones already waiting.
        urgent: bool,
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
        /// The job's piece list, emptied, for the next job (nothing is allocated per frame).
        pieces: Vec<(usize, usize)>,
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
    pub(super) tx: SyncSender<Msg>,
    pub(super) eventfd: Option<Arc<EventFd>>,
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

/// Where a read lands: inside read buffer `n`, or inside staging slot `n` (a unit stored
/// as raw). The io_uring reader registers both with the ring where it can.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Target {
    ReadBuf(usize),
    Slot(usize),
}

/// The read side: io_uring or the pread pool.
pub(super) trait Reader: Send {
    /// Queues one read of `len` bytes at `offset` to `ptr`, inside `target`.
    fn push(
        &mut self,
        op: usize,
        target: Target,
        ptr: *mut u8,
        len: usize,
        offset: u64,
    ) -> std::io::Result<()>;
    /// Submits what was pushed and blocks until at least one completion or message, or
    /// until `timeout` (None: no limit) has passed with neither; completions go to `done`
    /// as (op, bytes or -errno), messages to `msgs`.
    fn wait(
        &mut self,
        rx: &Receiver<Msg>,
        msgs: &mut Vec<Msg>,
        done: &mut Vec<(usize, i32)>,
        timeout: Option<Duration>,
    ) -> std::io::Result<()>;
}
