//! The device memory pool's book-keeping (first-fit over one allocation, in f32 elements),
//! shared by the CPU device and the CUDA device: each owns one allocation of the plan's bytes and
//! hands out aligned ranges of it.

use std::collections::{BTreeMap, HashMap};

use crate::DevBuf;

/// Every buffer starts at a multiple of this many elements from a 64-byte aligned base, so
/// every buffer is aligned to 64 bytes (a cache line; the widest SIMD load).
pub const ALIGN_ELEMS: usize = 16;

/// The allocator's book-keeping, in elements. Invariants: free blocks and live allocations
/// tile `0..len` exactly; no two free blocks are adjacent (freeing coalesces); every offset and
/// length is a multiple of [`ALIGN_ELEMS`].
pub(crate) struct Pool {
    /// Free blocks, offset -> length, in address order.
    free: BTreeMap<usize, usize>,
    /// Live allocations, offset -> aligned length.
    live: HashMap<usize, usize>,
    /// Sum of the live aligned lengths.
    pub(crate) in_use: usize,
    /// Highest `in_use` seen.
    pub(crate) peak: usize,
}

impl Pool {
    pub(crate) fn new(len: usize) -> Self {
        let mut free = BTreeMap::new();
        if len > 0 {
            free.insert(0, len);
        }
        Pool { free, live: HashMap::new(), in_use: 0, peak: 0 }
    }

    /// First fit: the lowest-addressed free block that holds `aligned` elements.
    pub(crate) fn alloc(&mut self, aligned: usize) -> Option<usize> {
        let (&off, &len) = self.free.iter().find(|&(_, &len)| len >= aligned)?;
        self.free.remove(&off);
        if len > aligned {
            self.free.insert(off + aligned, len - aligned);
        }
        self.live.insert(off, aligned);
        self.in_use += aligned;
        self.peak = self.peak.max(self.in_use);
        Some(off)
    }

    /// Returns `b` (exactly as `alloc` returned it) and merges it with free neighbours.
    pub(crate) fn free(&mut self, b: DevBuf) {
        let aligned = self.live.remove(&b.off).unwrap_or_else(|| {
            panic!("free of {b:?}, which is not a live allocation (freed twice, or a sub-buffer?)")
        });
        assert_eq!(
            aligned,
            b.len.next_multiple_of(ALIGN_ELEMS),
            "free of {b:?}: the allocation at that offset has {aligned} (aligned) elements"
        );
        self.in_use -= aligned;
        let (mut off, mut len) = (b.off, aligned);
        if let Some(next) = self.free.remove(&(off + len)) {
            len += next;
        }
        let prev = self.free.range(..off).next_back().map(|(&o, &l)| (o, l));
        if let Some((prev_off, prev_len)) = prev.filter(|&(o, l)| o + l == off) {
            self.free.remove(&prev_off);
            off = prev_off;
            len += prev_len;
        }
        self.free.insert(off, len);
    }
}
