//! Compute pipelines built from the shader table, and one-shot dispatches of them.

use std::sync::Arc;

use ash::vk;
use parking_lot::Mutex;
use spillway_shaders::{spirv, ShaderId};

use super::buffer::Buffer;
use super::device::Device;
use super::error::{map_vk, GpuError, Result};

/// A compute pipeline whose bindings 0..n are storage buffers and which takes `push_bytes` of
/// push constants.
pub struct ComputePipeline {
    pub(crate) raw: vk::Pipeline,
    pub(crate) layout: vk::PipelineLayout,
    pub(crate) set_layout: vk::DescriptorSetLayout,
    pool: Mutex<vk::DescriptorPool>,
    module: vk::ShaderModule,
    pub(crate) n_buffers: u32,
    pub(crate) push_bytes: u32,
    device: Arc<Device>,
}

impl ComputePipeline {
    /// Builds the pipeline of `shader`. `spec` gives the values of specialization constants 0..n
    /// (for example a workgroup size that must equal the subgroup size).
    pub fn new(
        device: &Arc<Device>,
        shader: ShaderId,
        n_buffers: u32,
        push_bytes: u32,
        spec: &[u32],
    ) -> Result<ComputePipeline> {
        let dev = &device.raw;
        let words = shader.info().words();
        let bindings: Vec<_> = (0..n_buffers)
            .map(|b| {
                vk::DescriptorSetLayoutBinding::default()
                    .binding(b)
                    .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                    .descriptor_count(1)
                    .stage_flags(vk::ShaderStageFlags::COMPUTE)
            })
            .collect();
        let ranges = [vk::PushConstantRange::default()
            .stage_flags(vk::ShaderStageFlags::COMPUTE)
            .size(push_bytes)];
        let pool_sizes = [vk::DescriptorPoolSize::default()
            .ty(vk::DescriptorType::STORAGE_BUFFER)
            .descriptor_count(n_buffers.max(1) * 4)];
        let map_entries: Vec<_> = (0..spec.len() as u32)
            .map(|i| {
                vk::SpecializationMapEntry::default()
                    .constant_id(i)
                    .offset(i * 4)
                    .size(4)
            })
            .collect();
        let spec_data: Vec<u8> = spec.iter().flat_map(|v| v.to_le_bytes()).collect();
        let spec_info = vk::SpecializationInfo::default()
            .map_entries(&map_entries)
            .data(&spec_data);

        // SAFETY: every create-info below and the arrays it points to live across its call; each
        // object is destroyed by `Drop` (or the guard below on failure) before the device.
        unsafe {
            let mut p = ComputePipeline {
                raw: vk::Pipeline::null(),
                layout: vk::PipelineLayout::null(),
                set_layout: vk::DescriptorSetLayout::null(),
                pool: Mutex::new(vk::DescriptorPool::null()),
                module: vk::ShaderModule::null(),
                n_buffers,
                push_bytes,
                device: device.clone(),
            };
            p.module = dev
                .create_shader_module(&vk::ShaderModuleCreateInfo::default().code(&words), None)
                .map_err(map_vk)?;
            p.set_layout = dev
                .create_descriptor_set_layout(
                    &vk::DescriptorSetLayoutCreateInfo::default().bindings(&bindings),
                    None,
                )
                .map_err(map_vk)?;
            let set_layouts = [p.set_layout];
            let mut layout_info = vk::PipelineLayoutCreateInfo::default().set_layouts(&set_layouts);
            if push_bytes > 0 {
                layout_info = layout_info.push_constant_ranges(&ranges);
            }
            p.layout = dev
                .create_pipeline_layout(&layout_info, None)
                .map_err(map_vk)?;
            *p.pool.get_mut() = dev
                .create_descriptor_pool(
                    &vk::DescriptorPoolCreateInfo::default()
                        .flags(vk::DescriptorPoolCreateFlags::FREE_DESCRIPTOR_SET)
                        .max_sets(4)
                        .pool_sizes(&pool_sizes),
                    None,
                )
                .map_err(map_vk)?;
            let mut stage = vk::PipelineShaderStageCreateInfo::default()
                .stage(vk::ShaderStageFlags::COMPUTE)
                .module(p.module)
                .name(c"main");
            if !spec.is_empty() {
                stage = stage.specialization_info(&spec_info);
            }
            let info = [vk::ComputePipelineCreateInfo::default()
                .stage(stage)
                .layout(p.layout)];
            p.raw = dev
                .create_compute_pipelines(vk::PipelineCache::null(), &info, None)
                .map_err(|(_, e)| map_vk(e))?[0];
            Ok(p)
        }
    }

    /// The pipeline of a variant of the shader table, with the bindings of its op and the push
    /// constants its SPIR-V declares.
    pub fn for_shader(device: &Arc<Device>, shader: ShaderId) -> Result<ComputePipeline> {
        ComputePipeline::for_shader_spec(device, shader, &[])
    }

    /// [`ComputePipeline::for_shader`] with specialization constants 0..n set to `spec`.
    pub fn for_shader_spec(
        device: &Arc<Device>,
        shader: ShaderId,
        spec: &[u32],
    ) -> Result<ComputePipeline> {
        let info = shader.info();
        let push_bytes = spirv::push_constant_layout(&info.words())
            .and_then(|l| l.last().map(|&(off, size)| off + size))
            .unwrap_or(0);
        ComputePipeline::new(device, shader, info.op.bindings(), push_bytes, spec)
    }

    /// Binds `buffers` to bindings 0..n, pushes `push`, dispatches `groups` workgroups, and waits
    /// for the GPU to finish.
    pub fn dispatch(&self, buffers: &[&Buffer], push: &[u8], groups: [u32; 3]) -> Result<()> {
        if buffers.len() != self.n_buffers as usize || push.len() != self.push_bytes as usize {
            return Err(GpuError::Unsupported(format!(
                "pipeline takes {} buffers and {} push bytes, got {} and {}",
                self.n_buffers,
                self.push_bytes,
                buffers.len(),
                push.len()
            )));
        }
        let max_range = self.device.max_storage_buffer_range();
        if let Some(b) = buffers.iter().find(|b| b.size() > max_range) {
            return Err(GpuError::Unsupported(format!(
                "buffer of {} bytes exceeds maxStorageBufferRange {max_range}; bind it by ranges",
                b.size()
            )));
        }
        let dev = &self.device.raw;
        let pool = self.pool.lock();
        let layouts = [self.set_layout];
        // SAFETY: the pool is externally synchronised by its mutex, held until the set is freed.
        let set = unsafe {
            dev.allocate_descriptor_sets(
                &vk::DescriptorSetAllocateInfo::default()
                    .descriptor_pool(*pool)
                    .set_layouts(&layouts),
            )
        }
        .map_err(map_vk)?[0];
        let infos: Vec<_> = buffers
            .iter()
            .map(|b| {
                vk::DescriptorBufferInfo::default()
                    .buffer(b.raw)
                    .range(vk::WHOLE_SIZE)
            })
            .collect();
        // SAFETY: `set` is not in use by any command buffer yet.
        unsafe { write_storage_buffers(dev, set, &infos) };
        let result = self.device.run_once(|cmd| {
            // SAFETY: `cmd` is recording; the pipeline, layout and set belong to this device.
            unsafe {
                dev.cmd_bind_pipeline(cmd, vk::PipelineBindPoint::COMPUTE, self.raw);
                dev.cmd_bind_descriptor_sets(
                    cmd,
                    vk::PipelineBindPoint::COMPUTE,
                    self.layout,
                    0,
                    &[set],
                    &[],
                );
                if !push.is_empty() {
                    dev.cmd_push_constants(
                        cmd,
                        self.layout,
                        vk::ShaderStageFlags::COMPUTE,
                        0,
                        push,
                    );
                }
                dev.cmd_dispatch(cmd, groups[0], groups[1], groups[2]);
                // Make shader writes visible to host reads of the mapped buffers.
                let barrier = vk::MemoryBarrier::default()
                    .src_access_mask(vk::AccessFlags::SHADER_WRITE)
                    .dst_access_mask(vk::AccessFlags::HOST_READ);
                dev.cmd_pipeline_barrier(
                    cmd,
                    vk::PipelineStageFlags::COMPUTE_SHADER,
                    vk::PipelineStageFlags::HOST,
                    vk::DependencyFlags::empty(),
                    &[barrier],
                    &[],
                    &[],
                );
            }
        });
        // SAFETY: `run_once` waited for the work (or never submitted it).
        let _ = unsafe { dev.free_descriptor_sets(*pool, &[set]) };
        result
    }
}

/// Binds storage buffer `infos[i]` to binding `i` of `set`.
///
/// # Safety
/// `set` was allocated from `dev` and no command buffer that uses it is pending; the ranges lie
/// inside their buffers.
pub(super) unsafe fn write_storage_buffers(
    dev: &ash::Device,
    set: vk::DescriptorSet,
    infos: &[vk::DescriptorBufferInfo],
) {
    let writes: Vec<_> = infos
        .iter()
        .enumerate()
        .map(|(i, info)| {
            vk::WriteDescriptorSet::default()
                .dst_set(set)
                .dst_binding(i as u32)
                .descriptor_type(vk::DescriptorType::STORAGE_BUFFER)
                .buffer_info(std::slice::from_ref(info))
        })
        .collect();
    // SAFETY: as the caller promises.
    unsafe { dev.update_descriptor_sets(&writes, &[]) };
}

impl Drop for ComputePipeline {
    fn drop(&mut self) {
        let dev = &self.device.raw;
        // SAFETY: dispatches wait for completion, so nothing in flight uses these objects;
        // destroying null handles is a no-op when construction stopped part-way.
        unsafe {
            dev.destroy_pipeline(self.raw, None);
            dev.destroy_descriptor_pool(*self.pool.get_mut(), None);
            dev.destroy_pipeline_layout(self.layout, None);
            dev.destroy_descriptor_set_layout(self.set_layout, None);
            dev.destroy_shader_module(self.module, None);
        }
    }
}
