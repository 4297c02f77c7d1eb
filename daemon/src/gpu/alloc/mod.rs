//! Our device-memory sub-allocator: large blocks per memory type, carved into buffers by first
//! fit, under a hard VRAM budget. Drivers allow few allocations (`maxMemoryAllocationCount` can
//! be 4096) and allocate slowly, so buffers share blocks; a budget lets a big GPU behave as a
//! small one, so every block on a device-local heap counts against it whole. A buffer over half a
//! block gets a block of its own size, so that no block's remainder is stranded.

mod ranges;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ash::vk;
use parking_lot::Mutex;

use super::device::Device;
use super::error::{map_vk, GpuError, MemoryKind, Result};

use ranges::BlockRanges;

pub mod fault;
pub use ranges::Budget;

/// What a buffer's memory is for; each use has a preference list of memory types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryUse {
    /// Weights, activations, the KV cache: device-local, preferably not host-visible (the
    /// host-visible device-local heap is small on discrete GPUs without resizable BAR).
    DeviceLocal,
    /// Host-visible and coherent, preferably in system RAM and cached by the CPU: staging for
    /// uploads and readback. Uncached memory is write-combined at best (and plain uncached
    /// under some hypervisors): the host's copies into it and reads from it run at a fraction
    /// of memory speed.
    Staging,
    /// Host-visible memory the GPU reads fast: the device-local host-visible heap when the GPU
    /// exposes one (resizable BAR, integrated GPUs), else staging memory.
    DeviceMapped,
}

/// Bytes of Vulkan memory blocks every allocator of this process holds, of any type and on
/// any device (`Status` reports it, so a failed or unloaded model can be seen to give all back).
static PROCESS_BYTES: AtomicU64 = AtomicU64::new(0);

/// Vulkan memory this process holds now, all allocators and devices together.
pub fn process_bytes() -> u64 {
    PROCESS_BYTES.load(Ordering::SeqCst)
}

const DL: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::DEVICE_LOCAL;
const HV: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::HOST_VISIBLE;
const HC: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::HOST_COHERENT;
const HV_HC: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::from_raw(HV.as_raw() | HC.as_raw());
const HV_HC_CACHED: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::from_raw(
    HV_HC.as_raw() | vk::MemoryPropertyFlags::HOST_CACHED.as_raw(),
);
const DL_HV_HC: vk::MemoryPropertyFlags =
    vk::MemoryPropertyFlags::from_raw(DL.as_raw() | HV.as_raw() | HC.as_raw());

impl MemoryUse {
    /// (required flags, flags that must be absent), best first.
    fn preferences(self) -> &'static [(vk::MemoryPropertyFlags, vk::MemoryPropertyFlags)] {
        const NONE: vk::MemoryPropertyFlags = vk::MemoryPropertyFlags::empty();
        match self {
            MemoryUse::DeviceLocal => &[(DL, HV), (DL, NONE), (NONE, NONE)],
            MemoryUse::Staging => &[(HV_HC_CACHED, DL), (HV_HC, DL), (HV_HC, NONE)],
            MemoryUse::DeviceMapped => &[(DL_HV_HC, NONE), (HV_HC, NONE)],
        }
    }
}

/// The memory type for `usage` among `types` (the device's list) allowed by `type_bits`.
pub fn choose_memory_type(
    types: &[vk::MemoryType],
    type_bits: u32,
    usage: MemoryUse,
) -> Option<u32> {
    usage.preferences().iter().find_map(|&(want, avoid)| {
        (0..types.len() as u32).find(|&i| {
            let f = types[i as usize].property_flags;
            type_bits & (1 << i) != 0 && f.contains(want) && !f.intersects(avoid)
        })
    })
}

/// Block size for new blocks; bigger requests get a block of their own size.
pub const DEFAULT_BLOCK_BYTES: u64 = 64 << 20;

/// Staging at least this large takes a block of its own size where the VRAM budget counts it
/// (a model's upload staging: one expert's bytes under a budget).
const STAGING_OWN_BLOCK_BYTES: u64 = 64 << 10;

/// Blocks of device-local memory that the host maps ([`MemoryUse::DeviceMapped`]) where that
/// is a memory type of its own: its buffers are step words and counters.
pub const MAPPED_BLOCK_BYTES: u64 = 1 << 20;

struct Block {
    memory: vk::DeviceMemory,
    /// Start of the mapping when the memory type is host-visible.
    mapped: Option<std::ptr::NonNull<u8>>,
    ranges: BlockRanges,
    counted: bool,
}

struct State {
    /// Per memory type index, its blocks (a freed block leaves `None` so ids stay put).
    blocks: Vec<Vec<Option<Block>>>,
    budget: Budget,
    /// Bytes of the allocations alive, whatever blocks hold them.
    allocated: u64,
}

/// The sub-allocator of one device.
pub struct Allocator {
    device: Arc<Device>,
    block_bytes: u64,
    state: Mutex<State>,
}

// SAFETY: the raw mapping pointers are only dereferenced through `Allocation`s, each covering a
// disjoint range; the state is behind a mutex.
unsafe impl Send for Allocator {}
unsafe impl Sync for Allocator {}

/// A range of a block, returned to it on drop.
pub struct Allocation {
    allocator: Arc<Allocator>,
    type_index: u32,
    block: usize,
    pub(crate) memory: vk::DeviceMemory,
    pub(crate) offset: u64,
    size: u64,
    pub(crate) mapped: Option<std::ptr::NonNull<u8>>,
}

// SAFETY: as `Allocator`: the mapped range belongs to this allocation alone.
unsafe impl Send for Allocation {}
unsafe impl Sync for Allocation {}

impl Allocator {
    /// An allocator whose device-local blocks never add up to more than `vram_budget` bytes.
    pub fn new(device: &Arc<Device>, vram_budget: Option<u64>) -> Arc<Allocator> {
        Allocator::with_block_size(device, vram_budget, DEFAULT_BLOCK_BYTES)
    }

    pub fn with_block_size(
        device: &Arc<Device>,
        vram_budget: Option<u64>,
        block_bytes: u64,
    ) -> Arc<Allocator> {
        let n_types = device.memory.memory_type_count as usize;
        Arc::new(Allocator {
            device: device.clone(),
            block_bytes,
            state: Mutex::new(State {
                blocks: (0..n_types).map(|_| Vec::new()).collect(),
                budget: Budget::new(vram_budget),
                allocated: 0,
            }),
        })
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The budget as it stands.
    pub fn budget(&self) -> Budget {
        self.state.lock().budget
    }

    /// Bytes of the allocations alive (what buffers hold, not the blocks around them).
    pub fn allocated_bytes(&self) -> u64 {
        self.state.lock().allocated
    }

    /// Number of device memory objects held (for tests and status).
    pub fn block_count(&self) -> usize {
        let s = self.state.lock();
        s.blocks.iter().flatten().filter(|b| b.is_some()).count()
    }

    /// Whether buffers of `usage` count against the VRAM budget on this device: host-visible
    /// staging does where all memory is one device-local heap (integrated GPUs, lavapipe).
    pub fn budget_counts(&self, usage: MemoryUse) -> bool {
        let types =
            &self.device.memory.memory_types[..self.device.memory.memory_type_count as usize];
        choose_memory_type(types, u32::MAX, usage).is_none_or(|t| self.counts_against_budget(t))
    }

    /// The memory type of [`MemoryUse::DeviceMapped`] buffers where it is not that of
    /// [`MemoryUse::DeviceLocal`] ones and counts against the budget (a discrete GPU's
    /// resizable BAR; lavapipe has one type for everything).
    /// Budget that device-local blocks leave for [`MemoryUse::DeviceMapped`] buffers where
    /// those have a memory type of their own that counts against it (resizable BAR): one
    /// block of [`MAPPED_BLOCK_BYTES`]; 0 elsewhere.
    pub fn mapped_reserve(&self) -> u64 {
        if self.mapped_apart().is_some() {
            MAPPED_BLOCK_BYTES
        } else {
            0
        }
    }

    fn mapped_apart(&self) -> Option<u32> {
        let types =
            &self.device.memory.memory_types[..self.device.memory.memory_type_count as usize];
        let mapped = choose_memory_type(types, u32::MAX, MemoryUse::DeviceMapped)?;
        let local = choose_memory_type(types, u32::MAX, MemoryUse::DeviceLocal);
        (local != Some(mapped) && self.counts_against_budget(mapped)).then_some(mapped)
    }

    fn counts_against_budget(&self, type_index: u32) -> bool {
        let ty = self.device.memory.memory_types[type_index as usize];
        let heap = self.device.memory.memory_heaps[ty.heap_index as usize];
        heap.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL)
    }

    /// Memory for `req` of the given use.
    pub fn allocate(
        self: &Arc<Self>,
        req: vk::MemoryRequirements,
        usage: MemoryUse,
    ) -> Result<Allocation> {
        let types =
            &self.device.memory.memory_types[..self.device.memory.memory_type_count as usize];
        let type_index =
            choose_memory_type(types, req.memory_type_bits, usage).ok_or_else(|| {
                GpuError::Unsupported(format!("no memory type for {usage:?} buffers"))
            })?;
        if fault::allocation_fails() {
            return Err(GpuError::OutOfMemory(MemoryKind::Device));
        }
        let align = req.alignment.max(1).next_power_of_two();
        let mut state = self.state.lock();
        let pool = &mut state.blocks[type_index as usize];
        let found = pool.iter_mut().enumerate().find_map(|(i, b)| {
            let b = b.as_mut()?;
            let off = b.ranges.alloc(req.size, align)?;
            Some((i, off, b.memory, b.mapped))
        });
        let (block, offset, memory, base) = match found {
            Some(f) => f,
            None => {
                // Staging of 64 KiB or more where the budget counts it takes a block of its
                // own size: a shared block would hold the budget for its empty part, which a
                // large weight buffer after it (an embedding table) could not use.
                let exact = usage == MemoryUse::Staging
                    && req.size >= STAGING_OWN_BLOCK_BYTES
                    && self.counts_against_budget(type_index);
                let i = self.new_block(&mut state, type_index, req.size, exact)?;
                let b = state.blocks[type_index as usize][i]
                    .as_mut()
                    .expect("just made");
                let off = b
                    .ranges
                    .alloc(req.size, align)
                    .expect("the block fits the request");
                (i, off, b.memory, b.mapped)
            }
        };
        state.allocated += req.size;
        // SAFETY: `offset + size` lies inside the block, which the mapping covers whole.
        let mapped = base.map(|p| unsafe { p.add(offset as usize) });
        Ok(Allocation {
            allocator: self.clone(),
            type_index,
            block,
            memory,
            offset,
            size: req.size,
            mapped,
        })
    }

    /// Allocates (and maps, when host-visible) a new block able to hold `request` bytes; its
    /// slot index.
    fn new_block(
        &self,
        state: &mut State,
        type_index: u32,
        request: u64,
        exact: bool,
    ) -> Result<usize> {
        let counted = self.counts_against_budget(type_index);
        // A request over half a block gets a block of its own size: in a block of the usual
        // size, the rest would be too small for another like it and lost to the budget (48
        // layers of 50 MB expert stacks left 14 MB each in 64 MiB blocks, two of their 8 GiB).
        // Device-local memory the host maps (a discrete GPU's resizable BAR) is another memory
        // type, so its buffers (step words, counters: a few bytes) take blocks of their own:
        // small ones, and the device-local blocks leave room in the budget for one. Without
        // that, a budget's last device-local block took all the budget left and a model whose
        // every buffer fitted failed on its first mapped one (on the H200; lavapipe has one
        // memory type for everything).
        let apart = self.mapped_apart();
        let mapped_type = apart == Some(type_index);
        let preferred = if mapped_type {
            MAPPED_BLOCK_BYTES.max(request)
        } else if exact || request > self.block_bytes / 2 {
            request
        } else {
            self.block_bytes
        };
        let reserve = if counted && apart.is_some_and(|t| t != type_index) {
            MAPPED_BLOCK_BYTES
        } else {
            0
        };
        let size = if counted {
            let size = state.budget.block_size(request, preferred).ok_or_else(|| {
                GpuError::OverBudget {
                    requested: request,
                    held: state.budget.held(),
                    budget: state.budget.limit().unwrap_or(u64::MAX),
                }
            })?;
            let left = state.budget.remaining();
            size.min(left.saturating_sub(reserve)).max(request)
        } else {
            request.max(preferred)
        };
        if fault::block_fails() {
            return Err(GpuError::OutOfMemory(MemoryKind::Device));
        }
        let dev = &self.device.raw;
        let info = vk::MemoryAllocateInfo::default()
            .allocation_size(size)
            .memory_type_index(type_index);
        // SAFETY: a valid allocation info for this device's memory types.
        let memory = unsafe { dev.allocate_memory(&info, None) }.map_err(map_vk)?;
        PROCESS_BYTES.fetch_add(size, Ordering::SeqCst);
        let host_visible = self.device.memory.memory_types[type_index as usize]
            .property_flags
            .contains(HV);
        // Host-visible blocks are always mapped: a later request of another use may share them.
        let mapped = if host_visible {
            // SAFETY: `memory` is host-visible and not mapped yet; it stays mapped until freed.
            match unsafe { dev.map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty()) }
            {
                Ok(p) => std::ptr::NonNull::new(p.cast::<u8>()),
                Err(e) => {
                    // SAFETY: nothing uses the memory yet.
                    unsafe { dev.free_memory(memory, None) };
                    PROCESS_BYTES.fetch_sub(size, Ordering::SeqCst);
                    return Err(map_vk(e));
                }
            }
        } else {
            None
        };
        if counted {
            state
                .budget
                .take(size)
                .expect("block_size kept within the budget");
        }
        let block = Block {
            memory,
            mapped,
            ranges: BlockRanges::new(size),
            counted,
        };
        let pool = &mut state.blocks[type_index as usize];
        match pool.iter().position(Option::is_none) {
            Some(i) => {
                pool[i] = Some(block);
                Ok(i)
            }
            None => {
                pool.push(Some(block));
                Ok(pool.len() - 1)
            }
        }
    }

    fn release(&self, a: &Allocation) {
        let mut state = self.state.lock();
        state.allocated -= a.size;
        let slot = &mut state.blocks[a.type_index as usize][a.block];
        let b = slot.as_mut().expect("an allocation's block is alive");
        b.ranges.free(a.offset, a.size);
        if b.ranges.is_empty() {
            // Empty blocks go back to the driver at once, so the budget sees only what is used.
            let b = slot.take().expect("checked above");
            if b.counted {
                state.budget.give_back(b.ranges.size());
            }
            // SAFETY: no allocation (hence no buffer) uses the block any more; freeing unmaps.
            unsafe { self.device.raw.free_memory(b.memory, None) };
            PROCESS_BYTES.fetch_sub(b.ranges.size(), Ordering::SeqCst);
        }
    }
}

impl Allocation {
    pub fn size(&self) -> u64 {
        self.size
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        self.allocator.release(self);
    }
}

impl Drop for Allocator {
    fn drop(&mut self) {
        // Every allocation holds an `Arc` of the allocator, so all blocks are already freed.
        debug_assert_eq!(self.block_count(), 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ty(flags: vk::MemoryPropertyFlags) -> vk::MemoryType {
        vk::MemoryType {
            property_flags: flags,
            heap_index: 0,
        }
    }

    #[test]
    fn discrete_gpu_types_are_preferred_per_use() {
        // A typical discrete GPU: VRAM, system RAM, and a small BAR window of VRAM.
        let types = [
            ty(DL),
            ty(HV | HC),
            ty(HV | HC | vk::MemoryPropertyFlags::HOST_CACHED),
            ty(DL | HV | HC),
        ];
        let all = 0b1111;
        assert_eq!(
            choose_memory_type(&types, all, MemoryUse::DeviceLocal),
            Some(0)
        );
        // Staging in cached system RAM: the host writes and reads it at memory speed.
        assert_eq!(choose_memory_type(&types, all, MemoryUse::Staging), Some(2));
        assert_eq!(
            choose_memory_type(&types, 0b1011, MemoryUse::Staging),
            Some(1)
        );
        assert_eq!(
            choose_memory_type(&types, all, MemoryUse::DeviceMapped),
            Some(3)
        );
        // A buffer that may not live in type 0 falls back to the BAR window, then anywhere.
        assert_eq!(
            choose_memory_type(&types, 0b1110, MemoryUse::DeviceLocal),
            Some(3)
        );
        assert_eq!(
            choose_memory_type(&types, 0b0110, MemoryUse::DeviceLocal),
            Some(1)
        );
    }

    #[test]
    fn unified_memory_serves_every_use_from_one_type() {
        // lavapipe and most integrated GPUs: one type with everything.
        let types = [ty(DL | HV | HC)];
        for u in [
            MemoryUse::DeviceLocal,
            MemoryUse::Staging,
            MemoryUse::DeviceMapped,
        ] {
            assert_eq!(choose_memory_type(&types, 1, u), Some(0), "{u:?}");
        }
        assert_eq!(choose_memory_type(&types, 0, MemoryUse::Staging), None);
    }
}
