//! Page-aligned host buffers, allocated once at start, below both the I/O engine (read
//! buffers, staging slots) and the backends (the CPU arena, pinned staging). O_DIRECT needs the buffer address,
//! the file offset and the length aligned to the device's logical block size; 4096 covers
//! every device we meet. The CUDA backend page-locks these same allocations (`pin`), so the
//! decompression workers write straight into memory the GPU's copy engine reads by DMA.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

pub const IO_ALIGN: usize = 4096;

/// Buffers from this size up are mapped straight from the kernel: page-aligned, zero, and
/// backed by memory only as they are touched (a huge page at a time where `map` asked for
/// them). (The allocator's over-aligned `alloc_zeroed` memsets every byte up front:
/// gigabytes of staging slots touched at start for nothing.)
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
    /// Mapped from the kernel (unmapped on drop), not from the allocator.
    mapped: bool,
    pinned: Option<Pinner>,
}

/// Transparent huge pages: large mappings start on this boundary and ask for them.
const HUGE_PAGE: usize = 2 << 20;

/// Maps `len` bytes (a multiple of IO_ALIGN) of zeroed anonymous memory. With `huge`, and
/// from HUGE_PAGE up, the mapping starts on a huge-page boundary and asks for transparent
/// huge pages (MADV_HUGEPAGE; where the kernel has none, or none free, it stays on 4 KiB
/// pages). A read into 4 KiB pages the allocator hands out scattered is one scatter-gather
/// segment per page: the block layer can then neither merge neighbouring reads (a request
/// holds at most `max_segments`, 254 on this project's virtio disk) nor send large ones,
/// and on that disk the same streamed pass read at 1.0-1.4 GB/s in 512 KiB requests against
/// 2.1-2.3 in merged 1.9 MiB ones once the slots were physically contiguous.
///
/// Only for memory that is all touched (the I/O pools, faulted in at start): a huge page is
/// backed whole at its first touch, so a buffer used in part (the CPU arena's KV cache and
/// workspace, sized for the longest context) would take memory the host budget leaves to
/// the page cache (SmolLM2 at batch 8 in a 96 MiB cgroup then re-read its executable's
/// pages: 2.3 GB a step).
fn map(len: usize, huge: bool) -> Option<NonNull<u8>> {
    let huge = huge && len >= HUGE_PAGE;
    // Room to slide the start up to the next huge-page boundary.
    let span = if huge {
        len.checked_add(HUGE_PAGE - IO_ALIGN)?
    } else {
        len
    };
    // SAFETY: an anonymous private mapping of `span` bytes; checked for MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    let base = p as usize;
    let start = if huge {
        base.next_multiple_of(HUGE_PAGE)
    } else {
        base
    };
    let (head, tail) = (start - base, span - (start - base) - len);
    // SAFETY: both ranges are page-aligned parts of the mapping just made, outside
    // [start, start + len); unmapping them leaves exactly that range mapped.
    unsafe {
        if head > 0 {
            libc::munmap(p, head);
        }
        if tail > 0 {
            libc::munmap((start + len) as *mut libc::c_void, tail);
        }
    }
    if huge {
        // Advice only: EINVAL where the kernel has no transparent huge pages is fine.
        // SAFETY: the range is the mapping's own.
        unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) };
    }
    NonNull::new(start as *mut u8)
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
            return Some(AlignedBuf {
                ptr: map(len, false)?,
                len,
                mapped: true,
                pinned: None,
            });
        }
        let layout = Layout::from_size_align(len, IO_ALIGN).ok()?;
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(AlignedBuf {
            ptr,
            len,
            mapped: false,
            pinned: None,
        })
    }

    /// `n` buffers of `len` bytes (rounded up to IO_ALIGN) cut from one mapping, back to
    /// back, on huge pages where the kernel gives them (see `map`): for a pool that is
    /// faulted in whole (read buffers, staging slots), however small each buffer. Each
    /// buffer unmaps its own part when dropped.
    pub fn many(n: usize, len: usize) -> Option<Vec<AlignedBuf>> {
        let len = len.max(1).div_ceil(IO_ALIGN) * IO_ALIGN;
        if n == 0 {
            return Some(Vec::new());
        }
        let total = len.checked_mul(n)?;
        if total < MMAP_MIN {
            return (0..n).map(|_| AlignedBuf::new(len)).collect();
        }
        let base = map(total, true)?;
        Some(
            (0..n)
                .map(|i| AlignedBuf {
                    // SAFETY: `i * len + len <= total`: inside the mapping.
                    ptr: unsafe { NonNull::new_unchecked(base.as_ptr().add(i * len)) },
                    len,
                    mapped: true,
                    pinned: None,
                })
                .collect(),
        )
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

    /// Gives the whole pages inside `range` back to the kernel (MADV_DONTNEED): they read
    /// as zero afterwards and take memory again only when next written. For a mapped
    /// buffer whose contents there are no longer needed (a finished sequence's part of
    /// the CPU arena's KV cache); allocator memory and pinned buffers are left as they
    /// are. Returns the bytes given back.
    pub fn discard(&mut self, range: std::ops::Range<usize>) -> usize {
        if !self.mapped || self.pinned.is_some() || range.end > self.len {
            return 0;
        }
        let page = IO_ALIGN;
        let (lo, hi) = (range.start.next_multiple_of(page), range.end / page * page);
        if lo >= hi {
            return 0;
        }
        // SAFETY: [lo, hi) is page-aligned and inside this buffer's own mapping (`mapped`,
        // `range.end <= len`); &mut self is exclusive, so no reference into it is live.
        let r = unsafe {
            libc::madvise(
                self.ptr.as_ptr().add(lo) as *mut libc::c_void,
                hi - lo,
                libc::MADV_DONTNEED,
            )
        };
        if r == 0 {
            hi - lo
        } else {
            0
        }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if let Some(p) = self.pinned.take() {
            p.0.unpin(self.ptr.as_ptr());
        }
        if self.mapped {
            // SAFETY: mapped in new() or many() with exactly this length at this address
            // (a part of a shared mapping is unmapped on its own).
            unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
            return;
        }
        let layout =
            Layout::from_size_align(self.len, IO_ALIGN).expect("layout was valid at allocation");
        // SAFETY: allocated in new() with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The VmFlags line of the mapping that holds `addr` in /proc/self/smaps.
    fn vm_flags(addr: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("smaps");
        let mut inside = false;
        for line in smaps.lines() {
            if let Some((range, _)) = line.split_once(' ') {
                if let Some((lo, hi)) = range.split_once('-') {
                    if let (Ok(lo), Ok(hi)) =
                        (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                    {
                        inside = (lo..hi).contains(&addr);
                        continue;
                    }
                }
            }
            if inside {
                if let Some(flags) = line.strip_prefix("VmFlags:") {
                    return flags.to_string();
                }
            }
        }
        panic!("no mapping holds {addr:#x}")
    }

    fn asks_for_huge_pages(ptr: *mut u8) -> bool {
        vm_flags(ptr as usize).split_whitespace().any(|f| f == "hg")
    }

    #[test]
    fn a_pool_starts_on_a_huge_page_and_asks_for_huge_pages_a_single_buffer_does_not() {
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists();
        for len in [HUGE_PAGE, HUGE_PAGE + IO_ALIGN, 3 * HUGE_PAGE + 12345] {
            let mut pool = AlignedBuf::many(1, len).expect("pool");
            let b = &mut pool[0];
            assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0, "{len}");
            assert_eq!(b.len(), len.div_ceil(IO_ALIGN) * IO_ALIGN);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice().fill(7);
            assert!(b.as_slice().iter().all(|&x| x == 7));
            // The advice takes where the kernel has transparent huge pages.
            if thp {
                assert!(asks_for_huge_pages(b.as_ptr()), "pool of {len}");
            }
            // A buffer that may be used in part (the CPU arena) stays on 4 KiB pages.
            let one = AlignedBuf::new(len).expect("buffer");
            assert_eq!(one.as_ptr() as usize % IO_ALIGN, 0);
            assert!(!asks_for_huge_pages(one.as_ptr()), "single buffer of {len}");
        }
    }

    #[test]
    fn a_pool_is_one_mapping_cut_back_to_back_and_each_part_frees_alone() {
        for (n, len) in [
            (5usize, 2220032usize),
            (64, 512 << 10),
            (3, 100),
            (1, 4 << 20),
        ] {
            let mut pool = AlignedBuf::many(n, len).expect("pool");
            let each = len.div_ceil(IO_ALIGN) * IO_ALIGN;
            assert_eq!(pool.len(), n);
            for (i, b) in pool.iter_mut().enumerate() {
                assert_eq!(b.len(), each);
                assert_eq!(b.as_ptr() as usize % IO_ALIGN, 0);
                assert!(b.as_slice().iter().all(|&x| x == 0), "part {i} zeroed");
                b.as_mut_slice().fill(i as u8 + 1);
            }
            if n * each >= MMAP_MIN {
                let base = pool[0].as_ptr() as usize;
                assert_eq!(base % HUGE_PAGE, 0, "{n} x {len}");
                for (i, b) in pool.iter().enumerate() {
                    assert_eq!(b.as_ptr() as usize, base + i * each, "back to back");
                }
            }
            // Every part kept its own bytes; dropping one leaves its neighbours mapped.
            if n > 2 {
                pool.remove(1);
            }
            for b in &pool {
                let first = b.as_slice()[0];
                assert!(b.as_slice().iter().all(|&x| x == first));
            }
        }
        assert!(AlignedBuf::many(0, 4096).expect("empty pool").is_empty());
    }

    /// Which of the `n` pages from `ptr` are resident (mincore).
    fn resident(ptr: *mut u8, n: usize) -> Vec<bool> {
        let mut v = vec![0u8; n];
        // SAFETY: ptr is page-aligned and maps n pages; v holds one byte per page.
        let r = unsafe { libc::mincore(ptr as *mut libc::c_void, n * IO_ALIGN, v.as_mut_ptr()) };
        assert_eq!(r, 0, "mincore");
        v.iter().map(|&b| b & 1 == 1).collect()
    }

    #[test]
    fn discard_gives_back_the_whole_pages_inside_the_range_and_they_read_zero() {
        let pages = MMAP_MIN / IO_ALIGN + 64;
        let mut b = AlignedBuf::new(pages * IO_ALIGN).expect("buffer");
        b.as_mut_slice().fill(9);
        assert!(resident(b.as_ptr(), pages).iter().all(|&r| r));
        // From inside page 3 to inside page 10: pages 4..10 go, 3 and 10 keep their bytes.
        let given = b.discard(3 * IO_ALIGN + 100..10 * IO_ALIGN + 5);
        assert_eq!(given, 6 * IO_ALIGN);
        let res = resident(b.as_ptr(), pages);
        for (p, &r) in res.iter().enumerate() {
            assert_eq!(r, !(4..10).contains(&p), "page {p}");
        }
        let bytes = b.as_slice();
        for (p, page) in bytes.chunks(IO_ALIGN).enumerate() {
            let want = if (4..10).contains(&p) { 0 } else { 9 };
            assert!(page.iter().all(|&x| x == want), "page {p}");
        }
        // Written again, the pages come back; a range past the end gives nothing back.
        b.as_mut_slice()[5 * IO_ALIGN] = 1;
        assert!(resident(b.as_ptr(), pages)[5]);
        assert_eq!(b.discard(0..(pages + 1) * IO_ALIGN), 0);
        assert_eq!(b.discard(100..200), 0, "no whole page inside");
        // Allocator memory (below MMAP_MIN) is never handed back from under the allocator.
        let mut small = AlignedBuf::new(8 * IO_ALIGN).expect("small buffer");
        small.as_mut_slice().fill(3);
        assert_eq!(small.discard(0..8 * IO_ALIGN), 0);
        assert!(small.as_slice().iter().all(|&x| x == 3));
    }
}
