//! Storage buffers. For now every buffer is host-visible and coherent, so tests can fill and read
//! it directly; the device-local sub-allocator and staging copies come with the weight streamer.

use std::sync::Arc;

use ash::vk;

use super::device::Device;
use super::error::{map_vk, GpuError, Result};

pub struct Buffer {
    pub(crate) raw: vk::Buffer,
    memory: vk::DeviceMemory,
    mapped: *mut u8,
    size: u64,
    device: Arc<Device>,
}

// SAFETY: the mapping is owned by this buffer; access goes through `&self`/`&mut self`.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    /// A host-visible storage buffer of `size` bytes (at least 4), zero-filled.
    pub fn new_host_visible(device: &Arc<Device>, size: u64) -> Result<Buffer> {
        let size = size.max(4);
        let info = vk::BufferCreateInfo::default()
            .size(size)
            .usage(
                vk::BufferUsageFlags::STORAGE_BUFFER
                    | vk::BufferUsageFlags::TRANSFER_SRC
                    | vk::BufferUsageFlags::TRANSFER_DST,
            )
            .sharing_mode(vk::SharingMode::EXCLUSIVE);
        let dev = &device.raw;
        // SAFETY: `dev` is live and `info` valid.
        let raw = unsafe { dev.create_buffer(&info, None) }.map_err(map_vk)?;
        // SAFETY: `raw` was created from `dev`.
        let req = unsafe { dev.get_buffer_memory_requirements(raw) };
        let flags = vk::MemoryPropertyFlags::HOST_VISIBLE | vk::MemoryPropertyFlags::HOST_COHERENT;
        let Some(type_index) = device.memory_type(req.memory_type_bits, flags) else {
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
            std::ptr::write_bytes(mapped, 0, size as usize);
            Ok(Buffer {
                raw,
                memory,
                mapped,
                size,
                device: device.clone(),
            })
        }
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// The buffer's bytes. Only call while no submitted GPU work writes to it.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping covers `size` bytes and lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.mapped, self.size as usize) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, and `&mut self` makes this the only view.
        unsafe { std::slice::from_raw_parts_mut(self.mapped, self.size as usize) }
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
        // (`Device::run_once` waits on a fence); the memory is unmapped by freeing it.
        unsafe {
            self.device.raw.destroy_buffer(self.raw, None);
            self.device.raw.free_memory(self.memory, None);
        }
    }
}
