//! Aligned host buffers that tiles are read into, and the pool that lends them.
//!
//! The memory behind a buffer is a [`HostRegion`]: today page-aligned heap allocations
//! ([`AlignedRegion`]); later Vulkan host-visible staging memory, which only has to implement
//! the trait. The pool registers every region with the io_uring ring once, so reads go straight
//! into them (`read_fixed`) without the kernel pinning pages per request.

use std::alloc::{self, Layout};
use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

/// Alignment of file offsets, lengths and memory for direct I/O. 4 KiB covers the logical block
/// size of common SSDs and filesystems and is the page size.
pub const ALIGN: usize = 4096;

pub(crate) fn align_down(x: u64) -> u64 {
    x & !(ALIGN as u64 - 1)
}

pub(crate) fn align_up(x: u64) -> u64 {
    (x + ALIGN as u64 - 1) & !(ALIGN as u64 - 1)
}

/// The aligned file span `[start, end)` that covers `len` bytes at `offset`.
pub(crate) fn aligned_span(offset: u64, len: usize) -> (u64, u64) {
    (align_down(offset), align_up(offset + len as u64))
}

/// The buffer size that holds a tile of `len` bytes at any offset.
pub fn buffer_size_for_tile(len: usize) -> usize {
    align_up(len as u64) as usize + ALIGN
}

/// Memory that tiles can be read into.
///
/// # Safety
///
/// An implementor guarantees that [`as_ptr`](Self::as_ptr) is aligned to [`ALIGN`] and valid
/// for reads and writes of [`size`](Self::size) bytes (a multiple of [`ALIGN`]), that both stay
/// the same until the region is dropped, and that nothing outside the streamer reads or writes
/// the memory while the region belongs to a [`BufferPool`]: the kernel writes into it
/// asynchronously, and readers get shared slices of it.
pub unsafe trait HostRegion: Send + Sync {
    fn as_ptr(&self) -> *mut u8;
    fn size(&self) -> usize;
}

/// A page-aligned, zero-initialised heap allocation.
pub struct AlignedRegion {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl AlignedRegion {
    /// `len` is rounded up to a multiple of [`ALIGN`].
    pub fn new(len: usize) -> AlignedRegion {
        let len = (align_up(len as u64) as usize).max(ALIGN);
        let layout = Layout::from_size_align(len, ALIGN).expect("buffer size overflows");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedRegion { ptr, layout }
    }
}

impl Drop for AlignedRegion {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: the allocation is owned exclusively and only reached through the pool.
unsafe impl Send for AlignedRegion {}
unsafe impl Sync for AlignedRegion {}

// SAFETY: aligned to ALIGN and valid for `layout.size()` bytes (a multiple of ALIGN) until drop.
unsafe impl HostRegion for AlignedRegion {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn size(&self) -> usize {
        self.layout.size()
    }
}

/// A fixed set of regions lent out one at a time as [`TileBuffer`]s; a buffer returns to the
/// pool when dropped.
pub struct BufferPool {
    regions: Vec<Box<dyn HostRegion>>,
    free: Mutex<Vec<u16>>,
    returned: Condvar,
}

/// Registered buffer indices are 16-bit; io_uring accepts at most 16384 of them.
pub const MAX_BUFFERS: usize = 1 << 14;

impl BufferPool {
    /// `count` heap buffers of `size` bytes each (rounded up to [`ALIGN`]).
    pub fn allocate(count: usize, size: usize) -> Arc<BufferPool> {
        let regions = (0..count)
            .map(|_| Box::new(AlignedRegion::new(size)) as Box<dyn HostRegion>)
            .collect();
        BufferPool::from_regions(regions)
    }

    /// A pool over caller-provided memory (for instance mapped staging memory).
    ///
    /// # Panics
    ///
    /// With no regions, more than [`MAX_BUFFERS`], or a region that breaks the alignment part of
    /// the [`HostRegion`] contract.
    pub fn from_regions(regions: Vec<Box<dyn HostRegion>>) -> Arc<BufferPool> {
        assert!(
            !regions.is_empty() && regions.len() <= MAX_BUFFERS,
            "a buffer pool holds 1 to {MAX_BUFFERS} regions, not {}",
            regions.len()
        );
        for r in &regions {
            assert!(
                (r.as_ptr() as usize).is_multiple_of(ALIGN)
                    && r.size().is_multiple_of(ALIGN)
                    && r.size() > 0,
                "host regions must be non-empty and aligned to {ALIGN} bytes"
            );
        }
        let free = (0..regions.len() as u16).rev().collect();
        Arc::new(BufferPool {
            regions,
            free: Mutex::new(free),
            returned: Condvar::new(),
        })
    }

    /// Waits until a buffer is free.
    pub fn acquire(self: &Arc<Self>) -> TileBuffer {
        let mut free = self.free.lock();
        loop {
            if let Some(index) = free.pop() {
                return TileBuffer {
                    pool: Arc::clone(self),
                    index,
                };
            }
            self.returned.wait(&mut free);
        }
    }

    pub fn try_acquire(self: &Arc<Self>) -> Option<TileBuffer> {
        let index = self.free.lock().pop()?;
        Some(TileBuffer {
            pool: Arc::clone(self),
            index,
        })
    }

    /// Buffers in the pool, lent or not.
    pub fn count(&self) -> usize {
        self.regions.len()
    }

    /// Buffers not lent right now.
    pub fn available(&self) -> usize {
        self.free.lock().len()
    }

    /// The smallest buffer's size: every buffer holds a tile of this span.
    pub fn buffer_size(&self) -> usize {
        self.regions.iter().map(|r| r.size()).min().unwrap_or(0)
    }

    /// Each region as an iovec, in index order, for `register_buffers`.
    pub(crate) fn iovecs(&self) -> Vec<libc::iovec> {
        self.regions
            .iter()
            .map(|r| libc::iovec {
                iov_base: r.as_ptr().cast(),
                iov_len: r.size(),
            })
            .collect()
    }
}

/// One buffer of a [`BufferPool`], owned exclusively until dropped.
pub struct TileBuffer {
    pool: Arc<BufferPool>,
    index: u16,
}

impl TileBuffer {
    pub fn len(&self) -> usize {
        self.pool.regions[self.index as usize].size()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The index the buffer was registered under with io_uring.
    pub(crate) fn index(&self) -> u16 {
        self.index
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.pool.regions[self.index as usize].as_ptr()
    }

    /// Whether the buffer belongs to `pool` (registered indices are only meaningful there).
    pub(crate) fn is_from(&self, pool: &Arc<BufferPool>) -> bool {
        Arc::ptr_eq(&self.pool, pool)
    }

    /// The bytes `range` of the buffer.
    ///
    /// Only for bytes that a completed read has written: the buffer is exclusively ours, so
    /// no one writes them while the slice lives.
    pub(crate) fn slice(&self, start: usize, len: usize) -> &[u8] {
        assert!(start + len <= self.len());
        // SAFETY: in bounds (checked), the memory is valid per the HostRegion contract and
        // initialised (zeroed at allocation or written by a read), and this buffer is the
        // only owner of its region while it lives.
        unsafe { std::slice::from_raw_parts(self.as_ptr().add(start), len) }
    }
}

impl Drop for TileBuffer {
    fn drop(&mut self) {
        self.pool.free.lock().push(self.index);
        self.pool.returned.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_cover_the_tile_with_aligned_bounds() {
        assert_eq!(aligned_span(0, 4096), (0, 4096));
        assert_eq!(aligned_span(100, 10), (0, 4096));
        assert_eq!(aligned_span(4095, 2), (0, 8192));
        assert_eq!(aligned_span(8192, 0), (8192, 8192));
        for (offset, len) in [(1u64, 5000usize), (4095, 4097), (123_456, 1 << 20)] {
            let (s, e) = aligned_span(offset, len);
            assert!((e - s) as usize <= buffer_size_for_tile(len));
        }
    }

    #[test]
    fn buffers_are_aligned_and_come_back_on_drop() {
        let pool = BufferPool::allocate(2, 5000);
        assert_eq!(pool.buffer_size(), 8192);
        let a = pool.acquire();
        let b = pool.try_acquire().unwrap();
        assert_eq!(a.as_ptr() as usize % ALIGN, 0);
        assert!(pool.try_acquire().is_none());
        drop(a);
        assert_eq!(pool.available(), 1);
        drop(b);
        assert_eq!(pool.available(), 2);
    }
}
