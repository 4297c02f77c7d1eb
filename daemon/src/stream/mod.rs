//! Streaming weights from the SSD: the tile reader and the expert cache.
//!
//! What is here:
//! - [`TileReader`] reads byte ranges ("tiles") of one model file into aligned host buffers
//!   from a [`BufferPool`]. Backend A is io_uring with O_DIRECT: aligned supersets of unaligned
//!   tiles, chunks (1 MiB by default) kept up to a queue depth (32) in flight, buffers registered
//!   with the ring (`read_fixed`). Backend B is a pread thread pool, used when io_uring cannot
//!   be set up (ENOSYS, EPERM, seccomp) or the filesystem refuses O_DIRECT (then through the
//!   page cache); the reason is logged once. [`BackendChoice`] forces either.
//! - Demand reads overtake queued prefetches chunk by chunk (what is in flight completes);
//!   prefetches are cancelled or promoted by the caller's tag. Completion comes through a
//!   [`ReadHandle`] that blocks on `wait`.
//! - Faults are [`StreamError`]s naming file, offset and length: a short read, an I/O error,
//!   the file truncated, rewritten or replaced since open (checked with `fstat` and `stat` on
//!   every request), cancellation. A failed read's buffer goes back to the pool, never out as a
//!   partly filled tile; the reader keeps serving other requests. [`fault`] injects EIO,
//!   short reads and late reads (`SPILLWAY_FAULT_STORAGE`) into that same path.
//! - [`ExpertCache`] keeps experts keyed by (layer, expert) in those buffers under a byte
//!   budget, with LRU or LFU-with-aging replacement, pins (a held `Arc<Expert>`), per-layer
//!   hit, miss, eviction and prefetch counters, `get_or_load` (demand) and `prefetch`.
//!
//! - [`open_expert_cache`] builds an [`ExpertCache`] over a model's file under a RAM budget:
//!   the RAM tier of the experts a GPU model computes on the CPU (`--ram-budget`).
//!
//! Not done yet:
//! - The CPU engine and the planner's streamed dense tensors still read the memory map; only
//!   the GPU model's CPU experts go through the cache.
//! - Buffers are heap memory. [`HostRegion`] is the seam for Vulkan host-visible staging memory
//!   (map it, implement the trait, build the pool with [`BufferPool::from_regions`]); the
//!   transfer-queue copy into VRAM cache slots and the timeline semaphores ordering those copies
//!   before the dispatches are not written.
//! - One reader serves one file; a split model needs a reader per shard, each with its own
//!   ring and queue, so demand-before-prefetch holds per shard only.
//! - The cache is a single RAM tier; the VRAM tier and learned policies belong with the engine
//!   and the scheduler's cache model.

mod buffer;
mod cache;
mod error;
pub mod fault;
mod file;
mod model_experts;
mod policy;
mod pread;
mod reader;
mod request;
mod schedule;
mod uring;

#[cfg(test)]
mod tests;

pub use buffer::{buffer_size_for_tile, AlignedRegion, BufferPool, HostRegion, TileBuffer, ALIGN};
pub use cache::{Expert, ExpertCache, ExpertLocator, ExpertRead, Extent};
pub use error::StreamError;
pub use fault::StorageFaults;
#[cfg(test)]
pub(crate) use model_experts::open_expert_cache_with;
pub use model_experts::{expert_bytes, minimum_ram_budget, open_expert_cache, ram_tier_bytes};
pub(crate) use policy::Residency;
pub use policy::{ExpertKey, LayerStats, ReplacementPolicy};
pub use reader::{Backend, BackendChoice, ReaderOptions, TileReader};
pub use request::{Priority, ReadHandle, ReadTimes, Tile, TileRequest};
