//! Page-aligned host buffers, allocated once at start. O_DIRECT needs the buffer address,
//! the file offset and the length aligned to the device's logical block size; 4096 covers
//! every device we meet. The CUDA backend will page-lock these same allocations.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

pub const IO_ALIGN: usize = 4096;

/// Buffers from this size up are mapped straight from the kernel: page-aligned, zero, and
/// backed by memory only as they are touched. (The allocator's over-aligned `alloc_zeroed`
/// memsets every byte up front: gigabytes of staging slots touched at start for nothing.)
const MMAP_MIN: usize = 1 << 20;

/// A zeroed, 4096-aligned buffer of fixed length.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
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
            });
        }
        let layout = Layout::from_size_align(len, IO_ALIGN).ok()?;
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(AlignedBuf { ptr, len })
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
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
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
