//! The I/O engine's counters (atomics the loop and workers add to) and the snapshot
//! callers read.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters since the engine started (or since `reset_stats`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct IoStats {
    /// Bytes read from the file (blobs rounded out to 4096).
    pub read_bytes: u64,
    pub read_ops: u64,
    /// Reads that returned fewer bytes than asked and were resubmitted.
    pub short_reads: u64,
    /// Seconds with at least one read in flight.
    pub read_busy_s: f64,
    /// Stored bytes of the frames decoded, and the raw bytes they produced.
    pub decoded_stored_bytes: u64,
    pub decompressed_bytes: u64,
    /// Seconds the workers spent decoding, summed over workers.
    pub decompress_busy_s: f64,
    /// Seconds callers spent blocked in `wait`.
    pub wait_stall_s: f64,
    /// Seconds reads waited for a free read buffer (decompression holding them).
    pub buffer_stall_s: f64,
    /// Seconds requests waited for a free staging slot (the consumer holding them).
    pub slot_stall_s: f64,
    pub units_done: u64,
    pub units_failed: u64,
    /// Reads the disk did not answer within `read_timeout` (their units failed).
    pub reads_stalled: u64,
    /// Reads in flight on average while any was (the queue depth achieved).
    pub queue_depth_avg: f64,
}

#[derive(Default)]
pub(super) struct Counters {
    pub(super) read_bytes: AtomicU64,
    pub(super) read_ops: AtomicU64,
    pub(super) short_reads: AtomicU64,
    pub(super) read_busy_ns: AtomicU64,
    pub(super) decoded_stored_bytes: AtomicU64,
    pub(super) decompressed_bytes: AtomicU64,
    pub(super) decompress_busy_ns: AtomicU64,
    pub(super) wait_stall_ns: AtomicU64,
    pub(super) buffer_stall_ns: AtomicU64,
    pub(super) slot_stall_ns: AtomicU64,
    pub(super) units_done: AtomicU64,
    pub(super) units_failed: AtomicU64,
    pub(super) reads_stalled: AtomicU64,
    /// Sum over time of reads in flight (ns x reads), for the average queue depth.
    pub(super) inflight_ns: AtomicU64,
}

impl Counters {
    pub(super) fn snapshot(&self) -> IoStats {
        let c = self;
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
            reads_stalled: c.reads_stalled.load(Ordering::Relaxed),
            queue_depth_avg: c.inflight_ns.load(Ordering::Relaxed) as f64
                / 1e9
                / s(&c.read_busy_ns).max(1e-9),
        }
    }

    pub(super) fn reset(&self) {
        let c = self;
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
            &c.reads_stalled,
            &c.inflight_ns,
        ] {
            a.store(0, Ordering::Relaxed);
        }
    }
}
