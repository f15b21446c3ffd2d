//! The decompression workers: each takes a frame whose reads have landed, checks its
//! checksum and decodes it straight into its place in the staging slot.

use super::reader::{Msg, Waker};
use super::tickets::Shared;
use crate::store::codec::FrameDecoder;
use crate::store::Store;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Raw pointers handed to workers. Their validity is argued where jobs are made.
pub(super) struct Job {
    pub(super) slot: usize,
    pub(super) unit: usize,
    pub(super) frame: usize,
    /// (address, length) of each read-buffer piece of the frame's stored bytes.
    pub(super) pieces: Vec<(usize, usize)>,
    pub(super) dst: *mut u8,
    /// The frame was read straight into `dst` (a unit stored as raw): only its checksum is
    /// left to check, and `pieces` is empty (a spare list, handed back).
    pub(super) in_place: bool,
}
// SAFETY: the pointers target read buffers and a staging slot that the engine thread keeps
// alive and untouched until the worker's FrameDone arrives (see `dispatch`).
unsafe impl Send for Job {}

pub(super) fn worker(
    jobs: Arc<Mutex<Receiver<Job>>>,
    store: Arc<Store>,
    waker: Waker,
    shared: Arc<Shared>,
    dec: &mut FrameDecoder,
    joined: &mut [u8],
) {
    loop {
        let job = match jobs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .recv()
        {
            Ok(j) => j,
            Err(_) => return,
        };
        let t0 = Instant::now();
        let f = &store.units()[job.unit].frames[job.frame];
        let stored_len = f.stored_len() as usize;
        if job.in_place {
            // SAFETY: as below; the read that filled the region has completed, and nothing
            // writes it until FrameDone is handled.
            let raw = unsafe { std::slice::from_raw_parts(job.dst, f.raw_len as usize) };
            let fault = crate::store::codec::check(f.checksum, raw).err();
            finish(&shared, &waker, job, t0, stored_len, f.raw_len, fault);
            continue;
        }
        // SAFETY: see Job: the read buffers and the slot region stay valid and unaliased
        // until FrameDone is handled; the slot region is this frame's alone.
        let dst = unsafe { std::slice::from_raw_parts_mut(job.dst, f.raw_len as usize) };
        let stored: &[u8] = if job.pieces.len() == 1 {
            // SAFETY: as above.
            unsafe { std::slice::from_raw_parts(job.pieces[0].0 as *const u8, job.pieces[0].1) }
        } else {
            // A frame spanning reads is joined into this worker's scratch: the one copy
            // the engine makes, for frames larger than a read or read in small requests
            // (large requests end where frames end, `event_loop::frame_chunks`).
            let mut at = 0;
            for &(p, n) in &job.pieces {
                let p = p as *const u8;
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
        finish(&shared, &waker, job, t0, stored_len, f.raw_len, fault);
    }
}

/// Counts a frame's work and tells the engine it is back.
fn finish(
    shared: &Shared,
    waker: &Waker,
    job: Job,
    t0: Instant,
    stored_len: usize,
    raw_len: u32,
    fault: Option<crate::store::codec::FrameFault>,
) {
    let c = &shared.counters;
    c.decompress_busy_ns
        .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    if fault.is_none() {
        c.decoded_stored_bytes
            .fetch_add(stored_len as u64, Ordering::Relaxed);
        c.decompressed_bytes
            .fetch_add(u64::from(raw_len), Ordering::Relaxed);
    }
    // The piece list goes back for the engine's next job (the hot path allocates none).
    let mut pieces = job.pieces;
    pieces.clear();
    waker.send(Msg::FrameDone {
        slot: job.slot,
        frame: job.frame,
        fault,
        pieces,
    });
}
