//! The ticket table: the one place the I/O thread tells callers how their requests stand.

use super::stats::Counters;
use super::IoError;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize};
use std::sync::{Condvar, Mutex};

#[derive(Debug)]
pub(super) enum TicketState {
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

/// What the caller side and the I/O thread share: each ticket's state (published by the
/// loop under the mutex, waited on by callers), the stop flag, counters and pool levels.
pub(super) struct Shared {
    pub(super) tickets: Mutex<HashMap<u64, TicketState>>,
    pub(super) ready: Condvar,
    pub(super) stopped: AtomicBool,
    pub(super) counters: Counters,
    pub(super) free_read_buffers: AtomicUsize,
    pub(super) free_slots: AtomicUsize,
}

impl Shared {
    pub(super) fn new(read_buffers: usize, slots: usize) -> Shared {
        Shared {
            tickets: Mutex::new(HashMap::new()),
            ready: Condvar::new(),
            stopped: AtomicBool::new(false),
            counters: Counters::default(),
            free_read_buffers: AtomicUsize::new(read_buffers),
            free_slots: AtomicUsize::new(slots),
        }
    }

    pub(super) fn publish(&self, ticket: u64, state: TicketState) {
        let mut t = self
            .tickets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(s) = t.get_mut(&ticket) {
            *s = state;
        }
        drop(t);
        self.ready.notify_all();
    }
}
