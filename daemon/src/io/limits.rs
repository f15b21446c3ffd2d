//! The engine's limits and the relations between them, each with the reason it must
//! hold, checked once at start against the store it will read; and the buffers they imply,
//! allocated then.

use super::IoConfig;
use crate::hostbuf::{AlignedBuf, IO_ALIGN};
use crate::store::Manifest;
use std::sync::Arc;

/// Reads return their byte count as an i32 (io_uring's cqe result): keep requests well below.
const REQUEST_BYTES_MAX: usize = 1 << 30;

/// Buffer sizes the checked limits imply.
pub(super) struct Sizes {
    /// Stored bytes of the largest frame (a worker's scratch for frames spanning reads).
    pub(super) frame_stored_max: usize,
    /// Bytes of a staging slot: the largest decompressed unit this engine will load.
    pub(super) slot_bytes: usize,
    /// Frames and read chunks of the largest unit (per-slot bookkeeping is sized once).
    pub(super) frames_per_unit_max: usize,
    pub(super) chunks_per_unit_max: usize,
}

impl Sizes {
    /// Messages that can be outstanding to the I/O thread at once: every read's
    /// completion, every frame's FrameDone, a Release per slot, and callers' requests and
    /// cancels (a full channel makes a caller wait for the loop to drain it).
    pub(super) fn message_capacity(&self, cfg: &IoConfig) -> usize {
        cfg.queue_depth + cfg.staging_slots * (self.frames_per_unit_max + 2) + 1024
    }

    /// Read-buffer pieces one frame's stored bytes may span.
    pub(super) fn pieces_per_frame_max(&self, cfg: &IoConfig) -> usize {
        (self.frame_stored_max + 2 * IO_ALIGN).div_ceil(cfg.request_bytes) + 1
    }

    /// Frames that can wait for a worker at once: every frame of every loading unit.
    pub(super) fn job_capacity(&self, cfg: &IoConfig) -> usize {
        cfg.staging_slots * self.frames_per_unit_max + 1
    }
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
    // A store whose every unit is stored as raw reads into the staging slots and needs
    // none.
    let frame_stored_max = m.frame_stored_len_max() as usize;
    let buffers_needed = if cfg.read_into_slots && m.units.iter().all(|u| u.stored_as_raw()) {
        0
    } else {
        (frame_stored_max + 2 * IO_ALIGN).div_ceil(cfg.request_bytes) + 1
    };
    if cfg.read_buffers < buffers_needed {
        return Err(format!(
            "{} read buffers of {} bytes cannot hold the largest frame ({frame_stored_max} stored bytes): need at least {buffers_needed}",
            cfg.read_buffers, cfg.request_bytes
        ));
    }
    let largest = match &cfg.units {
        None => m.units.iter().map(|u| u.raw_len).max().unwrap_or(0),
        Some(us) => us
            .iter()
            .filter_map(|&u| m.units.get(u))
            .map(|u| u.raw_len)
            .max()
            .unwrap_or(0),
    } as usize;
    // Slots may be smaller than the largest unit: that unit is then requested in parts.
    let slot_bytes = cfg.slot_bytes.unwrap_or(largest);
    if slot_bytes == 0 && largest > 0 {
        return Err("staging slots of 0 bytes".into());
    }
    let frames_per_unit_max = m.units.iter().map(|u| u.frames.len()).max().unwrap_or(0);
    let chunks_per_unit_max = m
        .units
        .iter()
        .map(|u| {
            // Cut where frames end, each frame may start chunks of its own (`frame_chunks`);
            // otherwise requests back to back.
            let by_frames: usize = u
                .frames
                .iter()
                .map(|f| (f.stored_len() as usize + 2 * IO_ALIGN).div_ceil(cfg.request_bytes))
                .sum();
            let back_to_back = ((u.stored_len as usize).div_ceil(IO_ALIGN) * IO_ALIGN)
                .div_ceil(cfg.request_bytes)
                + 1;
            by_frames.max(back_to_back)
        })
        .max()
        .unwrap_or(0);
    Ok(Sizes {
        frame_stored_max,
        slot_bytes,
        frames_per_unit_max,
        chunks_per_unit_max,
    })
}

/// Every buffer the engine uses, allocated once at start.
pub(super) struct Pools {
    pub(super) read_bufs: Arc<Vec<AlignedBuf>>,
    pub(super) slots: Arc<Vec<AlignedBuf>>,
}

impl Pools {
    pub(super) fn allocate(cfg: &IoConfig, sizes: &Sizes) -> Result<Pools, String> {
        // Each pool is one mapping, on huge pages where the kernel gives them: reads into
        // it are a few large scatter-gather segments, not one per 4 KiB page.
        let alloc = |n: usize, len: usize, what: &str| -> Result<Vec<AlignedBuf>, String> {
            AlignedBuf::many(n, len)
                .ok_or_else(|| format!("cannot allocate {n} {what} of {len} bytes"))
        };
        let mut read_bufs = alloc(cfg.read_buffers, cfg.request_bytes, "read buffers")?;
        let mut slots = alloc(cfg.staging_slots, sizes.slot_bytes, "staging slots")?;
        // Fault every page in now: the first pass would otherwise take a page fault (and a
        // zeroed page) every 4 KiB of reads and decoded frames, on the I/O and worker
        // threads (bench-io's first pass ran at a third of the later ones). The plan counts
        // these bytes as held from the start either way.
        for b in read_bufs.iter_mut().chain(slots.iter_mut()) {
            b.prefault();
        }
        if let Some(p) = &cfg.pinner {
            // Some container runtimes refuse cuMemHostRegister. Pageable slots still work:
            // the driver stages a copy from pageable memory before cuMemcpyHtoDAsync
            // returns, so a slot may be reused as soon as its upload is enqueued; only the
            // copy is slower. Once one slot is refused the others are not tried.
            for s in &mut slots {
                if let Err(e) = s.pin(p) {
                    tracing::warn!(
                        "staging slots stay pageable: {e}; uploads from them are staged by the driver (slower, still correct)"
                    );
                    break;
                }
            }
        }
        Ok(Pools {
            read_bufs: Arc::new(read_bufs),
            slots: Arc::new(slots),
        })
    }
}
