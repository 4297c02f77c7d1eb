//! Bookkeeping of one memory block's free ranges, and the VRAM budget: pure logic, testable
//! without a device.

/// Free ranges of a block, sorted by offset and never adjacent (freed neighbours merge).
#[derive(Debug, Clone)]
pub(crate) struct BlockRanges {
    size: u64,
    free: Vec<(u64, u64)>,
}

impl BlockRanges {
    pub(crate) fn new(size: u64) -> BlockRanges {
        BlockRanges {
            size,
            free: vec![(0, size)],
        }
    }

    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// Whether nothing is allocated.
    pub(crate) fn is_empty(&self) -> bool {
        self.free == [(0, self.size)]
    }

    /// First fit of `size` bytes at a multiple of `align` (a power of two); the offset.
    pub(crate) fn alloc(&mut self, size: u64, align: u64) -> Option<u64> {
        debug_assert!(align.is_power_of_two() && size > 0);
        let (i, start) = self.free.iter().enumerate().find_map(|(i, &(off, len))| {
            let start = off.next_multiple_of(align);
            (start + size <= off + len).then_some((i, start))
        })?;
        let (off, len) = self.free[i];
        let end = start + size;
        // The range splits into what is left before and after the allocation.
        let mut rest = Vec::with_capacity(2);
        if start > off {
            rest.push((off, start - off));
        }
        if end < off + len {
            rest.push((end, off + len - end));
        }
        self.free.splice(i..=i, rest);
        Some(start)
    }

    /// Returns `[offset, offset + size)`, which `alloc` handed out.
    ///
    /// # Panics
    /// If the range overlaps a free range or leaves the block (a double free).
    pub(crate) fn free(&mut self, offset: u64, size: u64) {
        let end = offset + size;
        assert!(end <= self.size, "free past the end of a block");
        let i = self.free.partition_point(|&(o, _)| o < offset);
        let overlaps_prev = i > 0 && {
            let (o, l) = self.free[i - 1];
            o + l > offset
        };
        let overlaps_next = i < self.free.len() && self.free[i].0 < end;
        assert!(!overlaps_prev && !overlaps_next, "double free of a range");
        self.free.insert(i, (offset, size));
        // Merge with the next, then with the previous neighbour.
        if i + 1 < self.free.len() && self.free[i].0 + self.free[i].1 == self.free[i + 1].0 {
            self.free[i].1 += self.free[i + 1].1;
            self.free.remove(i + 1);
        }
        if i > 0 && self.free[i - 1].0 + self.free[i - 1].1 == self.free[i].0 {
            self.free[i - 1].1 += self.free[i].1;
            self.free.remove(i);
        }
    }
}

/// A hard ceiling on the device memory the allocator holds (`--vram-budget`): blocks are
/// counted whole, from allocation to release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    limit: Option<u64>,
    held: u64,
}

impl Budget {
    /// `None`: no ceiling beyond what the device has.
    pub fn new(limit: Option<u64>) -> Budget {
        Budget { limit, held: 0 }
    }

    pub fn limit(&self) -> Option<u64> {
        self.limit
    }

    /// Device-memory bytes held now.
    pub fn held(&self) -> u64 {
        self.held
    }

    /// Bytes that may still be taken.
    pub fn remaining(&self) -> u64 {
        self.limit.map_or(u64::MAX, |l| l.saturating_sub(self.held))
    }

    /// Takes `bytes`, or says by how much the ceiling would be passed.
    pub fn take(&mut self, bytes: u64) -> Result<(), u64> {
        if bytes > self.remaining() {
            return Err(bytes - self.remaining());
        }
        self.held += bytes;
        Ok(())
    }

    pub fn give_back(&mut self, bytes: u64) {
        debug_assert!(bytes <= self.held);
        self.held -= bytes;
    }

    /// The size of a new block for a request of `request` bytes: `preferred`, shrunk to what the
    /// budget leaves, never below the request itself. `None` if even the request does not fit.
    pub fn block_size(&self, request: u64, preferred: u64) -> Option<u64> {
        let left = self.remaining();
        (request <= left).then(|| preferred.max(request).min(left.max(request)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_respects_alignment_and_reuses_freed_space() {
        let mut b = BlockRanges::new(1024);
        assert_eq!(b.alloc(10, 1), Some(0));
        assert_eq!(b.alloc(100, 64), Some(64));
        assert_eq!(b.alloc(1, 256), Some(256));
        // The gap [10, 64) takes a small aligned request.
        assert_eq!(b.alloc(32, 16), Some(16));
        b.free(64, 100);
        assert_eq!(b.alloc(90, 64), Some(64));
        assert_eq!(b.alloc(2000, 1), None);
    }

    #[test]
    fn freeing_everything_merges_back_to_one_range() {
        let mut b = BlockRanges::new(300);
        let offs: Vec<u64> = (0..3).map(|_| b.alloc(100, 4).unwrap()).collect();
        assert_eq!(b.alloc(1, 1), None, "the block is full");
        // Free out of order: middle, last, first.
        b.free(offs[1], 100);
        b.free(offs[2], 100);
        assert!(!b.is_empty());
        b.free(offs[0], 100);
        assert!(b.is_empty());
        assert_eq!(b.alloc(300, 1), Some(0));
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_is_caught() {
        let mut b = BlockRanges::new(64);
        let o = b.alloc(16, 16).unwrap();
        b.free(o, 16);
        b.free(o, 16);
    }

    #[test]
    fn budget_is_a_hard_ceiling() {
        let mut b = Budget::new(Some(1000));
        assert_eq!(b.block_size(100, 600), Some(600));
        b.take(600).unwrap();
        // A new block shrinks to what is left, but never below the request.
        assert_eq!(b.block_size(100, 600), Some(400));
        assert_eq!(b.block_size(500, 600), None);
        assert_eq!(b.take(500), Err(100));
        assert_eq!(b.held(), 600);
        b.give_back(600);
        assert_eq!(b.remaining(), 1000);
        let unlimited = Budget::new(None);
        assert_eq!(unlimited.block_size(10, 64), Some(64));
    }
}
