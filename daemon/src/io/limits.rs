//! The engine's limits and the relations between them, each with the reason it must
//! hold, checked once at start against the store it will read.

use super::IoConfig;
use crate::hostbuf::IO_ALIGN;
use crate::store::Manifest;

/// Reads return their byte count as an i32 (io_uring's cqe result): keep requests well below.
const REQUEST_BYTES_MAX: usize = 1 << 30;

/// Buffer sizes the checked limits imply.
pub(super) struct Sizes {
    /// Stored bytes of the largest frame (a worker's scratch for frames spanning reads).
    pub(super) frame_stored_max: usize,
    /// Bytes of a staging slot: the largest decompressed unit this engine will load.
    pub(super) slot_bytes: usize,
}

/// Checks `cfg` against the store; the message says which limit and what to change.
pub(super) fn check(cfg: &IoConfig, m: &Manifest) -> Result<Sizes, String> {
    if cfg.request_bytes == 0
        || !cfg.request_bytes.is_multiple_of(IO_ALIGN)
        || cfg.request_bytes > REQUEST_BYTES_MAX
    {
        return Err(format!(
            "request size {} must be a non-zero multiple of {IO_ALIGN} (O_DIRECT)",
            cfg.request_bytes
        ));
    }
    if cfg.queue_depth == 0 || cfg.queue_depth > super::QUEUE_DEPTH_MAX {
        return Err(format!(
            "queue depth {} must be in 1..={}",
            cfg.queue_depth,
            super::QUEUE_DEPTH_MAX
        ));
    }
    if cfg.staging_slots == 0 || cfg.workers == 0 || cfg.pread_threads == 0 {
        return Err("staging slots, workers and pread threads must each be at least 1".into());
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
        return Err(format!(
            "{} read buffers of {} bytes cannot hold the largest frame ({frame_stored_max} stored bytes): need at least {buffers_needed}",
            cfg.read_buffers, cfg.request_bytes
        ));
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
    Ok(Sizes {
        frame_stored_max,
        slot_bytes,
    })
}
