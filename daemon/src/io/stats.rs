//! The I/O engine's counters (atomics the loop and workers add to) and the snapshot
//! callers read.

use serde::Serialize;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Counters since the engine started (or since `reset_stats`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct IoStats {
    /// Bytes read from the file (blobs rounded out to 4096).
    pub read_bytes: u64,
    pub read_ops: u64,
    /// Reads that returned fewer bytes than asked and were resubmitted.
    pub short_reads: u64,
    /// Seconds with at least one read in flight (the current stretch included).
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
    /// Staging slots loading or held by a caller at once, at most.
    pub slots_busy_max: u64,
}

impl IoStats {
    /// These counters and an earlier engine's together (`engine::replace`: the pipeline
    /// built again): sums, the larger maximum, the queue depth weighted by busy time.
    pub fn plus(&self, o: &IoStats) -> IoStats {
        let busy = self.read_busy_s + o.read_busy_s;
        IoStats {
            read_bytes: self.read_bytes + o.read_bytes,
            read_ops: self.read_ops + o.read_ops,
            short_reads: self.short_reads + o.short_reads,
            read_busy_s: busy,
            decoded_stored_bytes: self.decoded_stored_bytes + o.decoded_stored_bytes,
            decompressed_bytes: self.decompressed_bytes + o.decompressed_bytes,
            decompress_busy_s: self.decompress_busy_s + o.decompress_busy_s,
            wait_stall_s: self.wait_stall_s + o.wait_stall_s,
            buffer_stall_s: self.buffer_stall_s + o.buffer_stall_s,
            slot_stall_s: self.slot_stall_s + o.slot_stall_s,
            units_done: self.units_done + o.units_done,
            units_failed: self.units_failed + o.units_failed,
            reads_stalled: self.reads_stalled + o.reads_stalled,
            queue_depth_avg: (self.queue_depth_avg * self.read_busy_s
                + o.queue_depth_avg * o.read_busy_s)
                / busy.max(1e-12),
            slots_busy_max: self.slots_busy_max.max(o.slots_busy_max),
        }
    }
}

/// When the counters' clock started (the loop's times are nanoseconds since).
pub(super) struct Epoch(Instant);

impl Default for Epoch {
    fn default() -> Self {
        Epoch(Instant::now())
    }
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
    pub(super) slots_busy_max: AtomicU64,
    /// Sum over time of reads in flight (ns x reads), for the average queue depth, up to
    /// `depth_since_ns`; reads in flight since then.
    pub(super) inflight_ns: AtomicU64,
    pub(super) depth: AtomicU64,
    pub(super) depth_since_ns: AtomicU64,
    /// When the current stretch with reads in flight began, plus 1 (0: none in flight):
    /// a snapshot counts it, so figures are right mid-stream, not only once the disk idles.
    pub(super) busy_since_ns: AtomicU64,
    pub(super) epoch: Epoch,
}

impl Counters {
    /// Nanoseconds since the counters' epoch.
    pub(super) fn now_ns(&self) -> u64 {
        self.epoch.0.elapsed().as_nanos() as u64
    }

    pub(super) fn snapshot(&self) -> IoStats {
        let c = self;
        let s = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e9;
        let now = c.now_ns();
        let since = c.busy_since_ns.load(Ordering::Relaxed);
        let busy_ns = c.read_busy_ns.load(Ordering::Relaxed)
            + if since > 0 {
                now.saturating_sub(since - 1)
            } else {
                0
            };
        let inflight_ns = c.inflight_ns.load(Ordering::Relaxed)
            + c.depth.load(Ordering::Relaxed)
                * now.saturating_sub(c.depth_since_ns.load(Ordering::Relaxed));
        IoStats {
            read_bytes: c.read_bytes.load(Ordering::Relaxed),
            read_ops: c.read_ops.load(Ordering::Relaxed),
            short_reads: c.short_reads.load(Ordering::Relaxed),
            read_busy_s: busy_ns as f64 / 1e9,
            decoded_stored_bytes: c.decoded_stored_bytes.load(Ordering::Relaxed),
            decompressed_bytes: c.decompressed_bytes.load(Ordering::Relaxed),
            decompress_busy_s: s(&c.decompress_busy_ns),
            wait_stall_s: s(&c.wait_stall_ns),
            buffer_stall_s: s(&c.buffer_stall_ns),
            slot_stall_s: s(&c.slot_stall_ns),
            units_done: c.units_done.load(Ordering::Relaxed),
            units_failed: c.units_failed.load(Ordering::Relaxed),
            reads_stalled: c.reads_stalled.load(Ordering::Relaxed),
            queue_depth_avg: inflight_ns as f64 / (busy_ns as f64).max(1.0),
            slots_busy_max: c.slots_busy_max.load(Ordering::Relaxed),
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
            &c.slots_busy_max,
            &c.inflight_ns,
        ] {
            a.store(0, Ordering::Relaxed);
        }
        // A stretch in flight now counts from here.
        let now = c.now_ns();
        c.depth_since_ns.store(now, Ordering::Relaxed);
        if c.busy_since_ns.load(Ordering::Relaxed) > 0 {
            c.busy_since_ns.store(now + 1, Ordering::Relaxed);
        }
    }
}
