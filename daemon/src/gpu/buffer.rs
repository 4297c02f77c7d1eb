//! Storage buffers: either with memory of their own (`new_host_visible`, for small test and
//! readback buffers) or carved from the sub-allocator (`new_in`). Device-local buffers are not
//! mapped; they are filled by `upload::Uploader`.

use std::sync::Arc;

use ash::vk;

use super::alloc::{Allocation, Allocator, MemoryUse};
use super::device::Device;
use super::error::{map_vk, GpuError, Result};

enum Backing {
    Own(vk::DeviceMemory),
    // Held for its `Drop`, which returns the range to its block.
    Pooled(#[allow(dead_code)] Allocation),
}

pub struct Buffer {
    pub(crate) raw: vk::Buffer,
    // Dropped after `Drop::drop` destroyed the buffer: the range returns to its block then.
    backing: Backing,
    mapped: *mut u8,
    size: u64,
    device: Arc<Device>,
}

const USAGE: vk::BufferUsageFlags = vk::BufferUsageFlags::from_raw(
    vk::BufferUsageFlags::STORAGE_BUFFER.as_raw()
        | vk::BufferUsageFlags::INDIRECT_BUFFER.as_raw()
        | vk::BufferUsageFlags::TRANSFER_SRC.as_raw()
        | vk::BufferUsageFlags::TRANSFER_DST.as_raw(),
);

// SAFETY: the mapping is owned by this buffer; access goes through `&self`/`&mut self`.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    /// A host-visible storage buffer of `size` bytes (at least 4), zero-filled.
    pub fn new_host_visible(device: &Arc<Device>, size: u64) -> Result<Buffer> {
        let flags = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        let buffer = Buffer::new_own(device, size, |bits| device.memory_type(bits, flags))?;
        // SAFETY: the mapping covers the buffer's `size` bytes.
        unsafe { std::ptr::write_bytes(buffer.mapped, 0, buffer.size as usize) };
        Ok(buffer)
    }

    /// A storage buffer of `size` bytes (at least 4) with memory of its own in system RAM,
    /// mapped, where the device has such memory ([`MemoryUse::Staging`]'s preferences:
    /// host-visible, coherent, cached by the CPU, not device-local): weights the GPU reads over
    /// the bus. Not counted against a VRAM budget (on a device whose every memory type is
    /// device-local, as lavapipe's, it is the same memory as the rest). Not zero-filled: the
    /// caller writes it whole.
    pub fn new_host_memory(device: &Arc<Device>, size: u64) -> Result<Buffer> {
        let types = &device.memory.memory_types[..device.memory.memory_type_count as usize];
        Buffer::new_own(device, size, |bits| {
            super::alloc::choose_memory_type(types, bits, MemoryUse::Staging)
        })
    }

    /// A mapped buffer of `size` bytes with a memory object of its own, of the type `choose`
    /// picks among the allowed ones (a bit mask).
    fn new_own(
        device: &Arc<Device>,
        size: u64,
        choose: impl FnOnce(u32) -> Option<u32>,
    ) -> Result<Buffer> {
        let size = size.max(4);
        let info = vk::BufferCreateInfo::default()
            .size(size)
            .usage(USAGE)
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        let dev = &device.raw;
        // SAFETY: `dev` is live and `info` valid.
        let raw = unsafe { dev.create_buffer(&info, None) }.map_err(map_vk)?;
        // SAFETY: `raw` was created from `dev`.
        let req = unsafe { dev.get_buffer_memory_requirements(raw) };
        let Some(type_index) = choose(req.memory_type_bits) else {
            // SAFETY: nothing is bound to `raw` yet.
            unsafe { dev.destroy_buffer(raw, None) };
            return Err(GpuError::Unsupported(
                "no host-visible coherent memory type".into(),
            ));
        };
        let alloc = vk::MemoryAllocateInfo::default()
            .allocation_size(req.size)
            .memory_type_index(type_index);
        // SAFETY: valid allocation info for this device; on each failure what was made is undone.
        unsafe {
            let memory = dev.allocate_memory(&alloc, None).map_err(|e| {
                dev.destroy_buffer(raw, None);
                map_vk(e)
            })?;
            let bound = dev.bind_buffer_memory(raw, memory, 0).and_then(|()| {
                dev.map_memory(memory, 0, vk::WHOLE_SIZE, vk::MemoryMapFlags::empty())
            });
            let mapped = match bound {
                Ok(p) => p.cast::<u8>(),
                Err(e) => {
                    dev.destroy_buffer(raw, None);
                    dev.free_memory(memory, None);
                    return Err(map_vk(e));
                }
            };
            Ok(Buffer {
                raw,
                backing: Backing::Own(memory),
                mapped,
                size,
                device: device.clone(),
            })
        }
    }

    /// A storage buffer of `size` bytes (rounded up to whole words) in memory of the sub-allocator
    /// for `usage`. Host-visible ones are zero-filled; device-local ones hold garbage until
    /// written.
    pub fn new_in(allocator: &Arc<Allocator>, size: u64, usage: MemoryUse) -> Result<Buffer> {
        let device = allocator.device();
        let size = size.max(4).next_multiple_of(4);
        let info = vk::BufferCreateInfo::default()
            .size(size)
            .usage(USAGE)
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        let dev = &device.raw;
        // SAFETY: `dev` is live and `info` valid.
        let raw = unsafe { dev.create_buffer(&info, None) }.map_err(map_vk)?;
        // SAFETY: `raw` was created from `dev`.
        let req = unsafe { dev.get_buffer_memory_requirements(raw) };
        let alloc = match allocator.allocate(req, usage) {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: nothing is bound to `raw`.
                unsafe { dev.destroy_buffer(raw, None) };
                return Err(e);
            }
        };
        // SAFETY: the allocation is `req.size` bytes at an offset aligned as `req` asks, of a
        // memory type `req` allows.
        if let Err(e) = unsafe { dev.bind_buffer_memory(raw, alloc.memory, alloc.offset) } {
            // SAFETY: binding failed, so nothing uses `raw`.
            unsafe { dev.destroy_buffer(raw, None) };
            return Err(map_vk(e));
        }
        let mapped = alloc.mapped.map_or(std::ptr::null_mut(), |p| p.as_ptr());
        if !mapped.is_null() {
            // SAFETY: the mapping covers the allocation, which is at least `size` bytes.
            unsafe { std::ptr::write_bytes(mapped, 0, size as usize) };
        }
        Ok(Buffer {
            raw,
            backing: Backing::Pooled(alloc),
            mapped,
            size,
            device: device.clone(),
        })
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Whether the host can read and write the buffer directly.
    pub fn is_mapped(&self) -> bool {
        !self.mapped.is_null()
    }

    /// The buffer's bytes. Only call while no submitted GPU work writes to it.
    ///
    /// # Panics
    /// If the buffer is not host-visible.
    pub fn bytes(&self) -> &[u8] {
        assert!(self.is_mapped(), "the buffer is not host-visible");
        // SAFETY: the mapping covers `size` bytes and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.mapped, self.size as usize) }
    }

    /// # Panics
    /// If the buffer is not host-visible.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        assert!(self.is_mapped(), "the buffer is not host-visible");
        // SAFETY: as `bytes`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.mapped, self.size as usize) }
    }

    /// Copies `values` as little-endian f32 to the start of the buffer.
    pub fn write_f32(&mut self, values: &[f32]) {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write(&bytes);
    }

    /// Copies `data` to the start of the buffer.
    pub fn write(&mut self, data: &[u8]) {
        self.bytes_mut()[..data.len()].copy_from_slice(data);
    }

    /// Reads the first `n` values as little-endian f32.
    pub fn read_f32(&self, n: usize) -> Vec<f32> {
        self.bytes()[..n * 4]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: callers wait for the work that uses a buffer before dropping it
        // (`Device::run_once` waits on a fence); own memory is unmapped by freeing it, pooled
        // memory returns to its block when `backing` drops after this.
        unsafe {
            self.device.raw.destroy_buffer(self.raw, None);
            if let Backing::Own(memory) = self.backing {
                self.device.raw.free_memory(memory, None);
            }
        }
    }
}
