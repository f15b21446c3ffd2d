//! Uploads into device memory: the synchronous `upload` for what stays resident, and the
//! asynchronous, frame-by-frame upload of a streaming slot on the copy stream, ordered
//! after the compute that last read the slot and timed by per-part events; plus the plain
//! pinned copy the benchmark compares the copy stream with; and the download of logits.

use super::device::CudaBackend;
use super::handles::{dev_err, CudaMem, DeviceAlloc, PinnedHost, SlotEvents};
use crate::backend::BackendError;
use cudarc::driver::{result, sys};
use std::cell::Cell;

impl CudaBackend {
    /// `Backend::download_f32`: a device-to-host copy on the compute stream (after the
    /// ops before it), waited for.
    pub(super) fn download(
        &self,
        src: &CudaMem,
        offset: usize,
        out: &mut [f32],
    ) -> Result<(), String> {
        if (offset + out.len()) * 4 > src.len {
            return Err(format!(
                "{} f32 at {offset} past an allocation of {} bytes",
                out.len(),
                src.len
            ));
        }
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: the range is inside src (checked); the stream is synchronized before
        // `out` is read.
        unsafe {
            result::memcpy_dtoh_async(out, src.ptr + (offset * 4) as u64, self.compute.cu_stream())
        }
        .map_err(|e| e.to_string())?;
        self.compute.synchronize().map_err(|e| e.to_string())
    }

    /// A plain page-locked cuMemcpyHtoD of `bytes` (the reference the copy stream's
    /// bandwidth is compared with): median GB/s of `reps` copies.
    pub fn plain_h2d_gbps(&self, bytes: usize, reps: usize) -> Result<f64, BackendError> {
        self.ctx
            .bind_to_thread()
            .map_err(dev_err(&self.info.name, "bind"))?;
        // SAFETY: pinned host and device buffers of `bytes`, owned (and freed) by the guards.
        let host = PinnedHost {
            ptr: unsafe { result::malloc_host(bytes, 0) }
                .map_err(dev_err(&self.info.name, "pinned buffer"))?,
            ctx: self.ctx.clone(),
        };
        let dev = DeviceAlloc {
            ptr: unsafe { result::malloc_sync(bytes) }
                .map_err(dev_err(&self.info.name, "device buffer"))?,
            ctx: self.ctx.clone(),
        };
        // SAFETY: host is `bytes` long; touching it first keeps page faults out of the timing.
        let src = unsafe { std::slice::from_raw_parts_mut(host.ptr as *mut u8, bytes) };
        src.fill(1);
        let mut rates = Vec::with_capacity(reps + 1);
        for _ in 0..reps.max(1) + 1 {
            let t = std::time::Instant::now();
            // SAFETY: dev and src are both `bytes` long; the copy is synchronous.
            unsafe { result::memcpy_htod_sync(dev.ptr, &src[..]) }
                .map_err(dev_err(&self.info.name, "cuMemcpyHtoD"))?;
            rates.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        rates.remove(0); // the first copy warms the mapping
        rates.sort_by(|a, b| a.total_cmp(b));
        Ok(rates[rates.len() / 2])
    }

    pub(super) fn begin_upload(&self, dst: &mut CudaMem) -> Result<(), BackendError> {
        self.ctx
            .bind_to_thread()
            .map_err(dev_err(&self.info.name, "bind"))?;
        if dst.ev.is_none() {
            let ev = |flags| {
                self.ctx
                    .new_event(Some(flags))
                    .map_err(dev_err(&self.info.name, "event"))
            };
            dst.ev = Some(SlotEvents {
                end: ev(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)?,
                consumed: ev(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?,
                parts: Vec::new(),
                used: Cell::new(0),
                pending: Cell::new(false),
                bytes: Cell::new(0),
            });
        }
        if dst.ev.as_ref().is_some_and(|e| e.pending.get()) {
            // Its previous upload was never waited for: account for it now.
            self.wait_upload(dst)?;
        }
        let ev = dst.ev.as_ref().expect("made above");
        // The slot's previous unit must have finished computing (an event never recorded
        // counts as complete).
        self.copy
            .wait(&ev.consumed)
            .map_err(dev_err(&self.info.name, "copy stream wait"))?;
        ev.bytes.set(0);
        ev.used.set(0);
        Ok(())
    }

    pub(super) fn upload_slot_part(
        &self,
        dst: &mut CudaMem,
        offset: usize,
        src: &[u8],
    ) -> Result<(), BackendError> {
        crate::backend::check_upload(dst.len, offset, src.len())?;
        self.ctx
            .bind_to_thread()
            .map_err(dev_err(&self.info.name, "bind"))?;
        let Some(ev) = dst.ev.as_mut() else {
            return Err(BackendError::Invalid(
                "upload_part before upload_begin".into(),
            ));
        };
        let i = ev.used.get();
        if i == ev.parts.len() {
            let timed = || {
                self.ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(dev_err(&self.info.name, "event"))
            };
            ev.parts.push((timed()?, timed()?));
        }
        ev.parts[i]
            .0
            .record(&self.copy)
            .map_err(dev_err(&self.info.name, "event"))?;
        // SAFETY: the range is inside dst (checked); the caller keeps src unchanged until
        // upload_wait.
        unsafe { result::memcpy_htod_async(dst.ptr + offset as u64, src, self.copy.cu_stream()) }
            .map_err(dev_err(&self.info.name, "cuMemcpyHtoDAsync"))?;
        ev.parts[i]
            .1
            .record(&self.copy)
            .map_err(dev_err(&self.info.name, "event"))?;
        ev.used.set(i + 1);
        ev.bytes.set(ev.bytes.get() + src.len() as u64);
        Ok(())
    }

    pub(super) fn end_upload(&self, dst: &mut CudaMem) -> Result<(), BackendError> {
        let Some(ev) = dst.ev.as_ref() else {
            return Err(BackendError::Invalid(
                "upload_end before upload_begin".into(),
            ));
        };
        ev.end
            .record(&self.copy)
            .map_err(dev_err(&self.info.name, "event"))?;
        // Ops enqueued from now on read the slot only after the copies.
        self.compute
            .wait(&ev.end)
            .map_err(dev_err(&self.info.name, "compute stream wait"))?;
        ev.pending.set(true);
        Ok(())
    }

    pub(super) fn wait_upload(&self, dst: &CudaMem) -> Result<(), BackendError> {
        let Some(ev) = &dst.ev else { return Ok(()) };
        if !ev.pending.get() {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(dev_err(&self.info.name, "bind"))?;
        ev.end
            .synchronize()
            .map_err(dev_err(&self.info.name, "waiting for an upload"))?;
        ev.pending.set(false);
        let mut ms = 0f64;
        for (a, b) in &ev.parts[..ev.used.get()] {
            ms += a
                .elapsed_ms(b)
                .map_err(dev_err(&self.info.name, "copy timing"))? as f64;
        }
        ev.used.set(0);
        if let Ok(mut c) = self.copies.lock() {
            c.uploads += 1;
            c.bytes += ev.bytes.get();
            c.seconds += ms / 1e3;
        }
        Ok(())
    }

    pub(super) fn mark_consumed(&self, mem: &CudaMem) {
        if let Some(ev) = &mem.ev {
            let r = self
                .ctx
                .bind_to_thread()
                .and_then(|_| ev.consumed.record(&self.compute))
                .map_err(|e| e.to_string());
            self.record("marking a slot consumed", r);
        }
    }
}
