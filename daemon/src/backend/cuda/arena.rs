//! Sub-allocation inside the one device allocation the CUDA backend makes at start: every
//! role (KV cache, workspace, streaming slots, resident layers, backend scratch) is a range
//! of it, so nothing calls cuMemAlloc after start and the plan's arithmetic is the truth.
//! First fit over a free list kept sorted by offset, neighbours merged on free.

use std::collections::BTreeMap;

/// Offsets handed out are multiples of this (cuBLAS and vector loads want 256 bytes).
pub const ARENA_ALIGN: usize = 256;

#[derive(Debug)]
pub struct Arena {
    size: usize,
    /// Free ranges: offset -> length.
    free: BTreeMap<usize, usize>,
}

impl Arena {
    pub fn new(size: usize) -> Arena {
        let size = size / ARENA_ALIGN * ARENA_ALIGN;
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(0, size);
        }
        Arena { size, free }
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Bytes a request of `bytes` occupies.
    pub fn rounded(bytes: usize) -> usize {
        bytes.max(1).div_ceil(ARENA_ALIGN) * ARENA_ALIGN
    }

    /// The offset of `rounded(bytes)` free bytes, or None when no free range is that large.
    pub fn alloc(&mut self, bytes: usize) -> Option<usize> {
        let need = Self::rounded(bytes);
        let (&off, &len) = self.free.iter().find(|(_, &len)| len >= need)?;
        self.free.remove(&off);
        if len > need {
            self.free.insert(off + need, len - need);
        }
        Some(off)
    }

    /// Returns the range `alloc(bytes)` gave at `off`.
    pub fn free(&mut self, off: usize, bytes: usize) {
        let mut off = off;
        let mut len = Self::rounded(bytes);
        debug_assert!(off + len <= self.size, "freeing outside the arena");
        // Merge with the free range that ends where this one starts...
        if let Some((&p, &plen)) = self.free.range(..off).next_back() {
            debug_assert!(p + plen <= off, "double free at {off}");
            if p + plen == off {
                self.free.remove(&p);
                off = p;
                len += plen;
            }
        }
        // ...and with the one that starts where it ends.
        if let Some(nlen) = self.free.remove(&(off + len)) {
            len += nlen;
        }
        self.free.insert(off, len);
    }

    /// Free bytes (possibly in pieces).
    pub fn free_bytes(&self) -> usize {
        self.free.values().sum()
    }

    /// The largest single allocation that would succeed now.
    pub fn largest_free(&self) -> usize {
        self.free.values().copied().max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_alignment_and_merging() {
        let mut a = Arena::new(10 * ARENA_ALIGN + 17);
        assert_eq!(a.size(), 10 * ARENA_ALIGN);
        let x = a.alloc(1).unwrap();
        let y = a.alloc(ARENA_ALIGN + 1).unwrap();
        let z = a.alloc(3 * ARENA_ALIGN).unwrap();
        assert_eq!((x, y, z), (0, ARENA_ALIGN, 3 * ARENA_ALIGN));
        assert_eq!(a.free_bytes(), 4 * ARENA_ALIGN);
        assert!(a.alloc(5 * ARENA_ALIGN).is_none());
        // Freeing the middle leaves a hole of two units that first fit reuses.
        a.free(y, ARENA_ALIGN + 1);
        assert_eq!(a.alloc(2 * ARENA_ALIGN), Some(ARENA_ALIGN));
        a.free(ARENA_ALIGN, 2 * ARENA_ALIGN);
        // Freeing both neighbours merges everything back into one range.
        a.free(x, 1);
        a.free(z, 3 * ARENA_ALIGN);
        assert_eq!(a.largest_free(), 10 * ARENA_ALIGN);
        assert_eq!(a.alloc(10 * ARENA_ALIGN), Some(0));
        assert_eq!(a.free_bytes(), 0);
    }

    #[test]
    fn random_alloc_free_never_overlaps() {
        let mut a = Arena::new(1 << 20);
        let mut live: Vec<(usize, usize)> = Vec::new();
        let mut rng = crate::util::rng::Rng::new(12345);
        for _ in 0..5000 {
            let s = rng.next_u64();
            if !(s >> 40).is_multiple_of(3) || live.is_empty() {
                let bytes = ((s >> 20) % 20000) as usize + 1;
                if let Some(off) = a.alloc(bytes) {
                    let r = Arena::rounded(bytes);
                    for &(o, b) in &live {
                        let rb = Arena::rounded(b);
                        assert!(off + r <= o || o + rb <= off, "overlap");
                    }
                    assert!(off + r <= a.size());
                    live.push((off, bytes));
                }
            } else {
                let i = ((s >> 16) as usize) % live.len();
                let (o, b) = live.swap_remove(i);
                a.free(o, b);
            }
        }
        for (o, b) in live.drain(..) {
            a.free(o, b);
        }
        assert_eq!(a.largest_free(), 1 << 20);
    }
}
