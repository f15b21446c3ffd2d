//! Owning wrappers for what the CUDA backend holds: arena ranges (`CudaMem`) with the
//! events of a streaming slot, the pinner that page-locks host buffers, the cuBLAS handle,
//! the one device allocation and pinned host memory. Each frees what it owns when dropped,
//! so nothing leaks on a failed start.

use super::arena::Arena;
use crate::backend::{BackendError, MemBudget};
use crate::hostbuf::HostPinner;
use cudarc::cublas::{result as blas, sys as bsys};
use cudarc::driver::{result, sys, CudaContext, CudaEvent};
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// A device allocation: a range of the backend's arena.
pub struct CudaMem {
    pub(super) ptr: u64,
    pub(super) off: usize,
    pub(super) len: usize,
    pub(super) arena: Arc<Mutex<Arena>>,
    pub(super) budget: Arc<MemBudget>,
    /// Events of a streaming slot (made at its first asynchronous upload).
    pub(super) ev: Option<SlotEvents>,
    /// Its own device allocation, `ptr`, where the backend gives each allocation one
    /// (`SEPARATE_ALLOCS_ENV`); the arena range is then only counted.
    pub(super) _own: Option<DeviceAlloc>,
}

/// Set to 1, the CUDA backend gives every allocation its own cuMemAlloc of exactly its
/// size instead of a range of the one arena (still counted there, so plans and budgets
/// are unchanged): compute-sanitizer's memcheck and initcheck then see an access past a
/// tensor's end as out of bounds, which inside the arena lands in a neighbour unseen.
/// For the sanitizer runs of `scripts/gpu-check.sh`, not for serving (one allocation per
/// tensor costs start-up time and the driver's own padding).
pub const SEPARATE_ALLOCS_ENV: &str = "SLUICE_CUDA_SEPARATE_ALLOCS";

/// Whether `SEPARATE_ALLOCS_ENV` asks for an allocation per tensor.
pub fn separate_allocs() -> bool {
    std::env::var(SEPARATE_ALLOCS_ENV).is_ok_and(|v| v == "1")
}

pub(super) struct SlotEvents {
    pub(super) end: CudaEvent,
    pub(super) consumed: CudaEvent,
    /// Start and end of each part of the upload in flight (the copy's own time, without
    /// the gaps while the host waits for frames); made as needed, reused every upload.
    pub(super) parts: Vec<(CudaEvent, CudaEvent)>,
    /// Parts of the upload in flight.
    pub(super) used: Cell<usize>,
    /// An upload was enqueued and `upload_wait` has not seen it finish.
    pub(super) pending: Cell<bool>,
    pub(super) bytes: Cell<u64>,
}

impl CudaMem {
    /// The device address (for tests that compare backends).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for CudaMem {
    fn drop(&mut self) {
        if let Ok(mut a) = self.arena.lock() {
            a.free(self.off, self.len);
        }
        self.budget.release(Arena::rounded(self.len) as u64);
    }
}

/// Registers host buffers with the driver (cuMemHostRegister): page-locked, mapped for
/// DMA, so copies from them run at the bus's speed and truly asynchronously.
pub(super) struct CudaPinner {
    pub(super) ctx: Arc<CudaContext>,
}

impl HostPinner for CudaPinner {
    fn pin(&self, ptr: *mut u8, len: usize) -> Result<(), String> {
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: ptr..ptr+len is a live page-aligned allocation the caller keeps until unpin.
        let r = unsafe {
            sys::cuMemHostRegister_v2(ptr as *mut c_void, len, sys::CU_MEMHOSTREGISTER_PORTABLE)
        };
        r.result().map_err(|e| format!("cuMemHostRegister: {e}"))
    }

    fn unpin(&self, ptr: *mut u8) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr was registered by pin and is still mapped.
            let _ = unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) };
        }
    }
}

/// A cuBLAS handle, destroyed when dropped.
pub(super) struct Blas(pub(super) bsys::cublasHandle_t, pub(super) Arc<CudaContext>);
// SAFETY: the handle is only used under the backend's mutex.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        let _ = self.1.bind_to_thread();
        // SAFETY: a live handle; the backend synchronized its streams before its fields drop.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// The one device allocation, freed when dropped.
pub(super) struct DeviceAlloc {
    pub(super) ptr: u64,
    pub(super) ctx: Arc<CudaContext>,
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_sync; no work uses it (streams synchronized first).
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Page-locked host memory from cuMemHostAlloc, freed when dropped.
pub(super) struct PinnedHost {
    pub(super) ptr: *mut c_void,
    pub(super) ctx: Arc<CudaContext>,
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_host; no copy reads it (streams synchronized first).
        let _ = unsafe { result::free_host(self.ptr) };
    }
}

/// Maps a driver error of `what` on `device` to a `BackendError`.
pub(super) fn dev_err<'a>(
    device: &'a str,
    what: &'a str,
) -> impl Fn(result::DriverError) -> BackendError + 'a {
    move |e| BackendError::device(what, device, e)
}

/// The one device allocation the arena's ranges lie in, or, with an allocation per tensor
/// (`SEPARATE_ALLOCS_ENV`), a token one: the arena then only counts.
pub(super) struct ArenaBase {
    pub(super) alloc: DeviceAlloc,
    pub(super) separate: bool,
}

impl ArenaBase {
    /// Allocates `bytes` on `ctx` (device `dev`), or one byte in the separate mode.
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        bytes: u64,
        dev: &str,
    ) -> Result<ArenaBase, BackendError> {
        let separate = separate_allocs();
        let n = if separate { 1 } else { bytes.max(1) };
        // SAFETY: a plain device allocation, owned (and freed) by the guard.
        let ptr = unsafe { result::malloc_sync(n as usize) }
            .map_err(|e| BackendError::device(format!("allocating {n} bytes"), dev, e))?;
        if separate {
            tracing::warn!("{SEPARATE_ALLOCS_ENV}=1: every device allocation is its own (for compute-sanitizer), not one arena");
        }
        Ok(ArenaBase {
            alloc: DeviceAlloc {
                ptr,
                ctx: ctx.clone(),
            },
            separate,
        })
    }
}

pub(super) fn carve(
    arena: &Arc<Mutex<Arena>>,
    budget: &Arc<MemBudget>,
    base: &ArenaBase,
    bytes: usize,
    what: &str,
) -> Result<CudaMem, BackendError> {
    let (separate, base) = (base.separate, &base.alloc);
    budget.reserve(Arena::rounded(bytes) as u64, what)?;
    let off = arena
        .lock()
        .map_err(|_| BackendError::Invalid("arena lock poisoned".into()))?
        .alloc(bytes);
    match off {
        Some(off) => {
            let own = if separate {
                let alloc = || -> Result<DeviceAlloc, String> {
                    base.ctx.bind_to_thread().map_err(|e| e.to_string())?;
                    // SAFETY: a plain device allocation, owned (and freed) by the guard.
                    let ptr =
                        unsafe { result::malloc_sync(bytes.max(1)) }.map_err(|e| e.to_string())?;
                    Ok(DeviceAlloc {
                        ptr,
                        ctx: base.ctx.clone(),
                    })
                };
                match alloc() {
                    Ok(a) => Some(a),
                    Err(e) => {
                        if let Ok(mut a) = arena.lock() {
                            a.free(off, bytes);
                        }
                        budget.release(Arena::rounded(bytes) as u64);
                        return Err(BackendError::Alloc {
                            what: format!(
                                "{what} (its own allocation, {SEPARATE_ALLOCS_ENV}=1: {e})"
                            ),
                            bytes: bytes as u64,
                        });
                    }
                }
            } else {
                None
            };
            Ok(CudaMem {
                ptr: own.as_ref().map_or(base.ptr + off as u64, |a| a.ptr),
                off,
                len: bytes,
                arena: arena.clone(),
                budget: budget.clone(),
                ev: None,
                _own: own,
            })
        }
        None => {
            budget.release(Arena::rounded(bytes) as u64);
            Err(BackendError::Alloc {
                what: format!("{what} (the device allocation is fragmented)"),
                bytes: bytes as u64,
            })
        }
    }
}
