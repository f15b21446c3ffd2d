//! The I/O engine: moves layer blobs from NVMe into staging slots.
//!
//! One thread owns the reads (an io_uring with O_DIRECT reads into registered buffers, or a
//! pread thread pool when io_uring or O_DIRECT is unavailable) and all the bookkeeping;
//! a pool of worker threads checksums and decompresses each frame straight into its final
//! place in the layer's staging slot. Reads are sized for the device, not for frames: a
//! blob is read in `request_bytes` pieces and frames are decoded out of the read buffers
//! wherever they fall, a frame spanning two reads included. A unit stored as raw (packed
//! with `--codec none`) skips the read buffers: its pieces are read straight into their
//! place in the staging slot and the workers only check each frame's checksum there.
//!
//! Every buffer (read buffers, staging slots, decoder scratch) is allocated once in
//! `IoEngine::new`; a full pool is back-pressure, never an allocation.
//!
//! A consumer may take a unit whole (`wait`) or as its decoded prefix grows
//! (`wait_progress`), to start copying it to the device before its last frame is done.
//!
//! The disk sees the loads in the order they are needed: at most `IoConfig::in_flight_bytes`
//! of reads are out (`IN_FLIGHT_BYTES_DEFAULT`), with read buffers past it holding what waits
//! for a worker, and a request behind the oldest sends its reads only as the oldest's last
//! are out (`FOLLOW_BYTES_DEFAULT`). With the cap, `bench-io`'s decoded rate against its bound
//! went from 0.63-0.87 to 0.72-0.97 on 1 GiB bf16 stores (float, zstd:1, lz4).

// Input from outside (files, requests, the disk) never meets an unwrap or expect here: an
// `expect` on a true invariant carries an #[allow] saying why it holds.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

mod api;
pub mod bench;
mod event_loop;
mod faults;
pub mod files;
mod limits;
#[cfg(test)]
mod loop_tests;
mod pread;
mod reader;
mod stats;
mod tickets;
mod uring;
mod workers;

pub use api::{open_direct, HeldSlot, IoEngine, PoolGauge, PoolStatus, SlotGuard, Ticket};
pub use stats::IoStats;

use crate::store::StoreError;
use serde::Serialize;
use std::fmt;

/// The reader the I/O engine runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReaderKind {
    Uring,
    Pread,
}

impl fmt::Display for ReaderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReaderKind::Uring => "uring",
            ReaderKind::Pread => "pread",
        })
    }
}

/// The reader asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReaderChoice {
    /// io_uring with O_DIRECT when both work, else the pread pool (one log line says why).
    Auto,
    Uring,
    Pread,
}

impl std::str::FromStr for ReaderChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(ReaderChoice::Auto),
            "uring" | "io_uring" => Ok(ReaderChoice::Uring),
            "pread" => Ok(ReaderChoice::Pread),
            _ => Err(format!(
                "unknown I/O engine {s:?}: expected auto, uring or pread"
            )),
        }
    }
}

/// Limits of the I/O engine. Relations between them are checked in `IoEngine::new`.
#[derive(Clone, Debug)]
pub struct IoConfig {
    /// Which reader does the reads (`--engine` of bench-io).
    pub reader: ReaderChoice,
    /// Read with O_DIRECT (bypassing the page cache) when the file system allows it.
    pub direct: bool,
    /// Reads in flight at most.
    pub queue_depth: usize,
    /// Bytes per read request (a multiple of 4096).
    pub request_bytes: usize,
    /// Bytes of reads in flight at most (one read goes out whatever its size): see
    /// `IN_FLIGHT_BYTES_DEFAULT`.
    pub in_flight_bytes: usize,
    /// Reads of a request behind the oldest unfinished one go out only while fewer bytes
    /// than this are in flight: see `FOLLOW_BYTES_DEFAULT`.
    pub follow_bytes: usize,
    /// Read buffers of `request_bytes` each; at least `queue_depth` keeps the queue full,
    /// and those past `in_flight_bytes` hold what has landed until a worker decodes it.
    pub read_buffers: usize,
    /// Staging slots, each the size of the largest decompressed layer blob.
    pub staging_slots: usize,
    /// Only these units will be requested (None: any): staging slots are sized for the
    /// largest of them, so a large resident unit does not size the streaming slots.
    pub units: Option<Vec<usize>>,
    /// Bytes of a staging slot, when not the largest of `units`: a unit larger than this is
    /// requested in parts (`IoEngine::request_part`).
    pub slot_bytes: Option<usize>,
    /// Decompression worker threads.
    pub workers: usize,
    /// Threads of the pread pool (its queue depth).
    pub pread_threads: usize,
    /// Decode frames (checksum + decompress). Off only to measure raw read speed.
    pub decompress: bool,
    /// Units stored as raw (`--codec none`) are read straight into their staging slot: no
    /// read buffer, no copy, only the checksums are checked, and their reads in flight are
    /// bounded by `queue_depth` alone. Off: through read buffers like every other unit.
    pub read_into_slots: bool,
    /// Registers the staging slots with io_uring (READ_FIXED into them, their pages pinned
    /// once) where the kernel allows, for units read straight into them. Off: plain READs,
    /// which pin and unpin their pages on every request.
    pub register_slots: bool,
    /// Page-locks the staging slots at start (the CUDA backend's copy stream reads them).
    pub pinner: Option<crate::hostbuf::Pinner>,
    /// A read the disk has not answered for this long fails the requests waiting on its
    /// unit (`IoError::Stalled`) instead of holding them for ever; None: wait for ever.
    pub read_timeout: Option<std::time::Duration>,
}

pub const QUEUE_DEPTH_DEFAULT: usize = 64;
pub const REQUEST_BYTES_DEFAULT: usize = 4 << 20;
/// Bytes of reads in flight at most by default (`IoConfig::in_flight_bytes`), however many
/// reads and read buffers there are. A disk serves the reads it holds side by side (a
/// virtual disk, an NVMe across its channels), so the more bytes are queued, the later
/// the first of them lands, and that one is what a worker or a layer waits for. 32 MiB is
/// many times an NVMe's bandwidth-delay product (about a megabyte at 7 GB/s); read
/// buffers beyond it hold what has landed until a worker decodes it, so the disk does not
/// stop while the workers catch up. Measured on the 2-core VM's virtio disk (2.4 GB/s;
/// 48 reads of 4 MiB sent together all landed within 2 ms of each other, 75 ms later):
/// `bench-io` on 1 GiB bf16 stores, 64 read buffers, decoded GB/s with 256 MiB in flight
/// and with 32 MiB, three alternating rounds: float 2.12-2.42 and 2.46-3.12, zstd:1
/// 1.25-1.26 and 1.32-1.44, lz4 1.45-1.74 and 1.97-2.04; `bench-stream` on SmolLM2
/// stored raw, the streamed pass 14 % shorter.
pub const IN_FLIGHT_BYTES_DEFAULT: usize = 32 << 20;
/// Bytes in flight below which the reads of the next request (a load behind the one a
/// layer waits for) may join the oldest's (`IoConfig::follow_bytes`). The oldest request
/// keeps the whole `in_flight_bytes`; the next starts as the oldest's last reads are out,
/// so the disk stays busy and serves the loads in the order they are needed instead of
/// side by side (two 2 MiB loads sent together land together, and the layer that waited
/// for the first waits for both). Measured on SmolLM2 stored raw, `bench-stream
/// --host-memory 64MiB` (27 layers streamed), four alternating rounds: streamed pass
/// median 35.0 ms with every load's reads sent at once, 27.6 ms with two loads out and
/// this order; at 96 MiB 18.8 and 16.3; the 1.2 GB Q8_0 store at 512 MiB (47 MB units)
/// the same within noise.
pub const FOLLOW_BYTES_DEFAULT: usize = 2 << 20;
pub const QUEUE_DEPTH_MAX: usize = 4096;
/// How long one read may go unanswered. An NVMe read of 4 MiB takes milliseconds even
/// behind a full queue; tens of seconds is a device in error recovery, a dying disk or a
/// hung network file system.
pub const READ_TIMEOUT_DEFAULT: std::time::Duration = std::time::Duration::from_secs(30);

/// Reads in flight (and read buffers) for one sequence at a time (`sluiced run`):
/// 16 x 4 MiB = 64 MiB of read buffers keeps a single stream's disk busy.
pub const QUEUE_DEPTH_SINGLE: usize = 16;
/// Reads in flight for the daemon and `bench-stream`, whose passes serve a batch:
/// 32 x 4 MiB = 128 MiB of read buffers.
pub const QUEUE_DEPTH_SERVING: usize = 32;

impl IoConfig {
    /// The preset of `sluiced run`: `QUEUE_DEPTH_SINGLE` reads in flight.
    pub fn single_stream() -> IoConfig {
        IoConfig {
            queue_depth: QUEUE_DEPTH_SINGLE,
            read_buffers: QUEUE_DEPTH_SINGLE,
            ..Default::default()
        }
    }

    /// The preset of `sluiced serve` and `bench-stream`: `QUEUE_DEPTH_SERVING` reads in
    /// flight.
    pub fn serving() -> IoConfig {
        IoConfig {
            queue_depth: QUEUE_DEPTH_SERVING,
            read_buffers: QUEUE_DEPTH_SERVING,
            ..Default::default()
        }
    }
}

impl Default for IoConfig {
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        IoConfig {
            reader: ReaderChoice::Auto,
            direct: true,
            queue_depth: QUEUE_DEPTH_DEFAULT,
            in_flight_bytes: IN_FLIGHT_BYTES_DEFAULT,
            follow_bytes: FOLLOW_BYTES_DEFAULT,
            request_bytes: REQUEST_BYTES_DEFAULT,
            read_buffers: QUEUE_DEPTH_DEFAULT,
            staging_slots: 3,
            units: None,
            slot_bytes: None,
            // One core is left for the engine thread that runs the layers.
            workers: cores.saturating_sub(1).max(1),
            pread_threads: 16,
            decompress: true,
            read_into_slots: true,
            register_slots: true,
            pinner: None,
            read_timeout: Some(READ_TIMEOUT_DEFAULT),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum IoError {
    /// Bad stored data or a failed read: DATA_LOSS for the requests that needed the layer.
    #[error(transparent)]
    Data(#[from] StoreError),
    #[error("I/O engine setup for {path}: {msg}")]
    Setup {
        path: std::path::PathBuf,
        msg: String,
    },
    #[error("unit {unit} does not exist (the store has {units})")]
    NoSuchUnit { unit: usize, units: usize },
    /// The disk did not answer a read within `read_timeout`: UNAVAILABLE for the requests
    /// that needed the unit (the disk may recover; nothing stored is known to be bad).
    #[error("{path}: {what} (read_timeout {limit_s} s); the requests that needed it were failed, and its read buffer and staging slot stay held until the disk answers")]
    Stalled {
        path: std::path::PathBuf,
        what: String,
        limit_s: f64,
    },
    #[error("the I/O engine has stopped")]
    Stopped,
    #[error("this load failed and its error was already returned by wait_progress")]
    FailureReported,
}

impl IoError {
    pub fn is_data_loss(&self) -> bool {
        matches!(self, IoError::Data(e) if e.is_data_loss())
    }

    /// A condition that may pass (a stalled disk, an engine shutting down): a client may
    /// send the request again.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, IoError::Stalled { .. } | IoError::Stopped)
    }
}
