//! Loading what stays put when a pipeline starts: resident units (on a unified backend
//! straight into their allocation) and the host cache's copies.

use super::{gather, PipelineError};
use crate::backend::Backend;
use crate::hostbuf::AlignedBuf;
use crate::io::{IoConfig, IoEngine, IoError, Ticket};
use crate::plan::{Placement, Plan};
use crate::store::Store;
use std::collections::VecDeque;
use std::sync::Arc;

/// Resident units and host-cached copies, loaded through their own I/O engine with two
/// staging slots of the largest such unit, dropped once loaded: the streaming engine's
/// slots (prefetch + 1 of them, in host memory, later page-locked) are sized for the
/// streamed units only.
#[allow(clippy::type_complexity)] // (device copy per unit, host copy per unit)
pub(super) fn load_kept<B: Backend>(
    backend: &B,
    store: &Arc<Store>,
    plan: &Plan,
    io_cfg: &IoConfig,
) -> Result<(Vec<Option<B::Mem>>, Vec<Option<AlignedBuf>>), PipelineError> {
    let n = store.units().len();
    let kept: Vec<usize> = (0..n)
        .filter(|&u| {
            matches!(
                plan.placement(u),
                Placement::Resident | Placement::HostCached
            )
        })
        .collect();
    let loader = IoEngine::new(
        store.clone(),
        IoConfig {
            staging_slots: 2,
            units: Some(kept.clone()),
            pinner: backend.pinner(),
            ..io_cfg.clone()
        },
    )?;
    let mut resident: Vec<Option<B::Mem>> = (0..n).map(|_| None).collect();
    let mut host_cache: Vec<Option<AlignedBuf>> = (0..n).map(|_| None).collect();
    // Load what stays put, two units in flight.
    let mut pending = VecDeque::new();
    let mut next = 0;
    for _ in 0..kept.len() {
        while next < kept.len() && pending.len() < 2 {
            pending.push_back(loader.request(kept[next])?);
            next += 1;
        }
        let ticket: Ticket = pending.pop_front().expect("requested above");
        let u = ticket.unit();
        let slot = loader.wait(ticket)?;
        let kind = store.units()[u].kind;
        match plan.placement(u) {
            Placement::Resident => {
                let mut mem = backend.alloc(slot.data().len(), &format!("weights of {kind}"))?;
                backend.upload(&mut mem, slot.data())?;
                resident[u] = Some(mem);
            }
            Placement::HostCached => {
                let mut buf =
                    AlignedBuf::new(slot.data().len()).ok_or(PipelineError::HostCacheAlloc {
                        unit: kind,
                        bytes: slot.data().len() as u64,
                    })?;
                if let Some(p) = backend.pinner() {
                    // Pinned copies upload at full speed; unpinned ones still work.
                    if let Err(e) = buf.pin(&p) {
                        tracing::warn!("host cache of {kind} stays pageable: {e}");
                    }
                }
                buf.as_mut_slice()[..slot.data().len()].copy_from_slice(slot.data());
                host_cache[u] = Some(buf);
            }
            Placement::Streamed | Placement::Host | Placement::OtherDevice => {
                unreachable!("filtered above")
            }
        }
    }
    drop(loader);
    Ok((resident, host_cache))
}

/// Resident units on a unified backend (device memory is host memory): every frame is
/// read (O_DIRECT where the file system takes it, else with its pages dropped after) into
/// a per-thread bounce buffer and decoded straight into the unit's allocation, by
/// `workers` threads taking frames in turn. No staging slot, no second copy, nothing left
/// in the page cache: the host holds the arena and a frame per thread.
pub(super) fn load_resident_direct<B: Backend>(
    backend: &B,
    store: &Arc<Store>,
    plan: &Plan,
    workers: usize,
) -> Result<Vec<Option<B::Mem>>, PipelineError> {
    use crate::store::codec::FrameFault;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let path = store.weights_path();
    let (file, direct) = crate::io::open_direct(path)
        .map_err(|e| IoError::Data(crate::store::StoreError::io("open", path, e)))?;
    let m = store.manifest();
    let bounce_len = gather::bounce_len(m.frame_stored_len_max());
    let raw_max = m.frame_raw_len_max() as usize;
    let n = store.units().len();
    let mut resident: Vec<Option<B::Mem>> = (0..n).map(|_| None).collect();
    for (u, unit) in store.units().iter().enumerate() {
        if plan.placement(u) != Placement::Resident {
            continue;
        }
        let mut mem = backend.alloc(unit.raw_len as usize, &format!("weights of {}", unit.kind))?;
        let dst = backend
            .host_bytes_mut(&mut mem)
            .expect("a unified backend's memory is host bytes");
        /// Disjoint frame ranges of one unit, written from several threads.
        struct Dst(*mut u8, usize);
        // SAFETY: each frame's raw range is written by the one thread that took it.
        unsafe impl Sync for Dst {}
        impl Dst {
            /// SAFETY: no other live slice may overlap d..d+len.
            #[allow(clippy::mut_from_ref)]
            unsafe fn range(&self, d: usize, len: usize) -> &mut [u8] {
                assert!(d + len <= self.1, "frame inside its unit (validated)");
                // SAFETY: inside the allocation; exclusivity is the caller's.
                unsafe { std::slice::from_raw_parts_mut(self.0.add(d), len) }
            }
        }
        let out = Dst(dst.as_mut_ptr(), dst.len());
        let next = AtomicUsize::new(0);
        let first_err: std::sync::Mutex<Option<(usize, FrameFault)>> = Default::default();
        std::thread::scope(|sc| {
            for _ in 0..workers.max(1).min(unit.frames.len().max(1)) {
                sc.spawn(|| {
                    let fail = |fi: usize, fault: FrameFault| {
                        let mut e = first_err.lock().unwrap_or_else(|p| p.into_inner());
                        if e.as_ref().is_none_or(|(f, _)| fi < *f) {
                            *e = Some((fi, fault));
                        }
                    };
                    let (Some(mut bounce), Ok(mut dec)) =
                        (AlignedBuf::new(bounce_len), store.frame_decoder(raw_max))
                    else {
                        fail(0, FrameFault::Read("cannot allocate a frame buffer".into()));
                        return;
                    };
                    loop {
                        let fi = next.fetch_add(1, Ordering::Relaxed);
                        let Some(f) = unit.frames.get(fi) else { break };
                        let src = match gather::read_frame(&file, f, &mut bounce) {
                            Ok(src) => src,
                            Err(fault) => {
                                fail(fi, fault);
                                return;
                            }
                        };
                        let (d, dl) = (f.raw_offset as usize, f.raw_len as usize);
                        // SAFETY: frames of a unit cover disjoint raw ranges inside it
                        // (validated with the manifest); this thread alone took frame fi.
                        let dst = unsafe { out.range(d, dl) };
                        if let Err(fault) = dec.decode(f.codec, &f.planes, f.checksum, src, dst) {
                            fail(fi, fault);
                            return;
                        }
                    }
                });
            }
        });
        if let Some((fi, fault)) = first_err.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(IoError::Data(store.frame_error(u, fi, fault)).into());
        }
        resident[u] = Some(mem);
    }
    if !direct {
        crate::hostmem::drop_cached(&file);
    }
    Ok(resident)
}
