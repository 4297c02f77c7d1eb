//! Descriptor sets of one recording, from pools it owns.

use std::sync::Arc;

use ash::vk;

use crate::gpu::device::Device;
use crate::gpu::driver_fault::DriverObject;
use crate::gpu::error::{map_vk, Result};

/// Descriptor pools of one recording, destroyed with it.
pub(crate) struct DescriptorArena {
    pools: Vec<vk::DescriptorPool>,
    device: Arc<Device>,
}

impl DescriptorArena {
    pub(crate) fn new(device: &Arc<Device>) -> DescriptorArena {
        DescriptorArena {
            pools: Vec::new(),
            device: device.clone(),
        }
    }
}

const SETS_PER_POOL: u32 = 256;
const MAX_BINDINGS: u32 = 8;

impl DescriptorArena {
    pub(super) fn set(&mut self, layout: vk::DescriptorSetLayout) -> Result<vk::DescriptorSet> {
        let dev = &self.device.raw;
        let layouts = [layout];
        if let Some(&pool) = self.pools.last() {
            let info = vk::DescriptorSetAllocateInfo::default()
                .descriptor_pool(pool)
                .set_layouts(&layouts);
            // SAFETY: the arena owns `pool` and is used by one thread (it is `&mut`).
            match unsafe { dev.allocate_descriptor_sets(&info) } {
                Ok(s) => return Ok(s[0]),
                Err(vk::Result::ERROR_OUT_OF_POOL_MEMORY | vk::Result::ERROR_FRAGMENTED_POOL) => {}
                Err(e) => return Err(map_vk(e)),
            }
        }
        let sizes = [vk::DescriptorPoolSize::default()
            .ty(vk::DescriptorType::STORAGE_BUFFER)
            .descriptor_count(SETS_PER_POOL * MAX_BINDINGS)];
        let info = vk::DescriptorPoolCreateInfo::default()
            .max_sets(SETS_PER_POOL)
            .pool_sizes(&sizes);
        self.device.check_refusal(DriverObject::DescriptorPool)?;
        // SAFETY: a valid create info; the pool is destroyed in `Drop`.
        let pool = unsafe { dev.create_descriptor_pool(&info, None) }.map_err(map_vk)?;
        self.pools.push(pool);
        let info = vk::DescriptorSetAllocateInfo::default()
            .descriptor_pool(pool)
            .set_layouts(&layouts);
        // SAFETY: as above, from the fresh pool.
        Ok(unsafe { dev.allocate_descriptor_sets(&info) }.map_err(map_vk)?[0])
    }
}

impl Drop for DescriptorArena {
    fn drop(&mut self) {
        for &pool in &self.pools {
            // SAFETY: the recording that used these sets has completed (or was never
            // submitted); destroying a pool frees its sets.
            unsafe { self.device.raw.destroy_descriptor_pool(pool, None) };
        }
    }
}
