//! Page-aligned host buffers, allocated once at start, below both the I/O engine (read
//! buffers, staging slots) and the backends (the CPU arena, pinned staging). O_DIRECT needs the buffer address,
//! the file offset and the length aligned to the device's logical block size; 4096 covers
//! every device we meet. The CUDA backend page-locks these same allocations (`pin`), so the
//! decompression workers write straight into memory the GPU's copy engine reads by DMA.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

pub const IO_ALIGN: usize = 4096;

/// Buffers from this size up are mapped straight from the kernel: page-aligned, zero, and
/// backed by memory only as they are touched. (The allocator's over-aligned `alloc_zeroed`
/// memsets every byte up front: gigabytes of staging slots touched at start for nothing.)
const MMAP_MIN: usize = 1 << 20;

/// Page-locks host memory for a device's DMA engine (the CUDA backend registers it with
/// cuMemHostRegister). A buffer is pinned once, at start, and unpinned before it is freed.
pub trait HostPinner: Send + Sync {
    /// Pins `len` bytes at `ptr` (page-aligned). The error says what to change.
    fn pin(&self, ptr: *mut u8, len: usize) -> Result<(), String>;
    /// Unpins a region `pin` accepted.
    fn unpin(&self, ptr: *mut u8);
}

/// A shared `HostPinner` that configuration structs can carry (Debug and Clone).
#[derive(Clone)]
pub struct Pinner(pub std::sync::Arc<dyn HostPinner>);

impl std::fmt::Debug for Pinner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Pinner")
    }
}

/// The soft memory-lock limit in bytes (None: unlimited), for error messages.
pub fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct it is given.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } == 0;
    if !ok || r.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(r.rlim_cur)
    }
}

/// What to change when pinning `bytes` failed under memory-lock limit `limit`.
pub fn memlock_hint(bytes: u64, limit: Option<u64>) -> String {
    match limit {
        Some(l) if l < bytes => format!(
            "; the memory-lock limit (RLIMIT_MEMLOCK) is {l} bytes: set LimitMEMLOCK=infinity in the sluiced unit file (deploy/sluiced.service) or raise `ulimit -l`"
        ),
        _ => String::new(),
    }
}

/// A zeroed, 4096-aligned buffer of fixed length.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    pinned: Option<Pinner>,
}

// SAFETY: AlignedBuf owns its allocation like a Box<[u8]>; sharing rules are those of the
// byte slice it hands out.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` bytes rounded up to IO_ALIGN. Returns None when the allocator refuses.
    pub fn new(len: usize) -> Option<AlignedBuf> {
        let len = len.max(1).div_ceil(IO_ALIGN) * IO_ALIGN;
        if len >= MMAP_MIN {
            // SAFETY: an anonymous private mapping of `len` bytes; checked for MAP_FAILED.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return None;
            }
            return Some(AlignedBuf {
                ptr: NonNull::new(p as *mut u8)?,
                len,
                pinned: None,
            });
        }
        let layout = Layout::from_size_align(len, IO_ALIGN).ok()?;
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(AlignedBuf {
            ptr,
            len,
            pinned: None,
        })
    }

    /// Page-locks the buffer for DMA until it is dropped. The error names the size and,
    /// when the memory-lock limit is below it, the limit and the unit-file setting.
    pub fn pin(&mut self, pinner: &Pinner) -> Result<(), String> {
        if self.pinned.is_some() {
            return Ok(());
        }
        pinner.0.pin(self.ptr.as_ptr(), self.len).map_err(|e| {
            format!(
                "page-locking a host buffer of {} bytes: {e}{}",
                self.len,
                memlock_hint(self.len as u64, memlock_limit())
            )
        })?;
        self.pinned = Some(pinner.clone());
        Ok(())
    }

    pub fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes, initialised (zeroed) at allocation.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Makes every page resident now (a zero written to each), so the first writes into
    /// the buffer do not fault page by page.
    pub fn prefault(&mut self) {
        for at in (0..self.len).step_by(4096) {
            // SAFETY: `at` is inside the allocation; &mut self is exclusive. Volatile: the
            // store must happen although the byte is already zero.
            unsafe { std::ptr::write_volatile(self.ptr.as_ptr().add(at), 0) };
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(p) = self.pinned.take() {
            p.0.unpin(self.ptr.as_ptr());
        }
        if self.len >= MMAP_MIN {
            // SAFETY: mapped in new() with exactly this length.
            unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
            return;
        }
        let layout =
            Layout::from_size_align(self.len, IO_ALIGN).expect("layout was valid at allocation");
        // SAFETY: allocated in new() with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}
