//! The logical device, its compute queue and a command pool for one-shot submissions.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::Arc;

use ash::vk;
use parking_lot::Mutex;

use super::capabilities::{device_local_budget, Capabilities};
use super::driver_fault::DriverObject;
use super::error::{map_vk, GpuError, Result};
use super::instance::{DeviceInfo, Instance};
use super::lost::{LossPoint, LossState};
use super::token_fault::Armed;

pub struct Device {
    pub(crate) raw: ash::Device,
    pub(super) queue: Mutex<vk::Queue>,
    pub(super) pool: Mutex<vk::CommandPool>,
    pub(crate) memory: vk::PhysicalDeviceMemoryProperties,
    pub(crate) limits: vk::PhysicalDeviceLimits,
    pub(crate) subgroup_size: u32,
    /// Timeline semaphores (core in Vulkan 1.2, optional on some drivers) are enabled.
    pub(super) timeline_semaphores: bool,
    /// Valid bits of the compute queue's timestamps; 0: it has none.
    pub(crate) timestamp_valid_bits: u32,
    /// `shaderIntegerDotProduct` enabled.
    int_dot: bool,
    /// And the device says it runs packed 4 × 8-bit signed dot products in hardware
    /// (`integerDotProduct4x8BitPackedSignedAccelerated`), not emulated (lavapipe emulates them).
    int_dot_fast: bool,
    info: DeviceInfo,
    /// Lost (really, or by injection): every later submission fails with `DeviceLost`.
    loss: LossState,
    /// An injected refusal of a driver object, waiting for its next request (`super::driver_fault`).
    refusal: Armed,
    physical: vk::PhysicalDevice,
    // Dropped after `Drop::drop` destroyed the device: the instance must outlive it.
    instance: Arc<Instance>,
}

impl Device {
    /// Opens a device: the one at `index` in [`Instance::devices`], or the preferred one.
    pub fn open(instance: Arc<Instance>, index: Option<usize>) -> Result<Arc<Device>> {
        let (index, physical) = instance.choose(index)?;
        let inst = &instance.raw;
        // SAFETY: `physical` was enumerated from this instance.
        let families = unsafe { inst.get_physical_device_queue_family_properties(physical) };
        let queue_family = families
            .iter()
            .position(|f| f.queue_flags.contains(vk::QueueFlags::COMPUTE))
            .ok_or_else(|| GpuError::Unsupported("no compute queue family".into()))?
            as u32;
        let timestamp_valid_bits = families[queue_family as usize].timestamp_valid_bits;
        let priorities = [1.0f32];
        let queues = [vk::DeviceQueueCreateInfo::default()
            .queue_family_index(queue_family)
            .queue_priorities(&priorities)];
        let mut supported12 = vk::PhysicalDeviceVulkan12Features::default();
        let mut features2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut supported12);
        // SAFETY: `physical` belongs to `inst`; the chained struct outlives the call.
        unsafe { inst.get_physical_device_features2(physical, &mut features2) };
        let timeline_semaphores = supported12.timeline_semaphore == vk::TRUE;
        // Cooperative matrices (prompts' matrix products) need their extension and feature,
        // f16 arithmetic and the Vulkan memory model; `detect` checked all four.
        let described = instance.describe(index, physical);
        let coopmat = described.capabilities.cooperative_matrix;
        // Integer dot products: Vulkan 1.3's feature (the shaders are SPIR-V 1.6, so 1.3 is
        // needed to run them anyway).
        // SAFETY: `physical` belongs to `inst`.
        let api = unsafe { inst.get_physical_device_properties(physical) }.api_version;
        let int_dot = api >= vk::API_VERSION_1_3 && {
            let mut supported13 = vk::PhysicalDeviceVulkan13Features::default();
            let mut features2 = vk::PhysicalDeviceFeatures2::default().push_next(&mut supported13);
            // SAFETY: as above; the device has 1.3, so its feature struct may be chained.
            unsafe { inst.get_physical_device_features2(physical, &mut features2) };
            supported13.shader_integer_dot_product == vk::TRUE
        };
        let mut enabled13 =
            vk::PhysicalDeviceVulkan13Features::default().shader_integer_dot_product(true);
        let mut enabled12 = vk::PhysicalDeviceVulkan12Features::default()
            .timeline_semaphore(timeline_semaphores)
            .shader_float16(coopmat)
            .vulkan_memory_model(coopmat);
        let mut enabled_coop =
            vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default().cooperative_matrix(true);
        let extensions = [ash::khr::cooperative_matrix::NAME.as_ptr()];
        let mut info = vk::DeviceCreateInfo::default()
            .queue_create_infos(&queues)
            .push_next(&mut enabled12);
        if coopmat {
            info = info
                .enabled_extension_names(&extensions)
                .push_next(&mut enabled_coop);
        }
        if int_dot {
            info = info.push_next(&mut enabled13);
        }
        // SAFETY: the create info and the arrays it points to live across the call.
        let raw = unsafe { inst.create_device(physical, &info, None) }.map_err(map_vk)?;
        // SAFETY: the family and index 0 were requested above.
        let queue = unsafe { raw.get_device_queue(queue_family, 0) };
        let pool_info = vk::CommandPoolCreateInfo::default()
            .queue_family_index(queue_family)
            .flags(vk::CommandPoolCreateFlags::RESET_COMMAND_BUFFER);
        // SAFETY: `raw` is a live device.
        let pool = match unsafe { raw.create_command_pool(&pool_info, None) } {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: nothing was created from the device yet.
                unsafe { raw.destroy_device(None) };
                return Err(map_vk(e));
            }
        };
        // SAFETY: `physical` belongs to `inst`.
        let memory = unsafe { inst.get_physical_device_memory_properties(physical) };
        let mut subgroup = vk::PhysicalDeviceSubgroupProperties::default();
        let mut props13 = vk::PhysicalDeviceVulkan13Properties::default();
        let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut subgroup);
        if api >= vk::API_VERSION_1_3 {
            props2 = props2.push_next(&mut props13);
        }
        // SAFETY: as above; the chained structs outlive the call, and Vulkan 1.3's is chained
        // only where the device has 1.3.
        unsafe { inst.get_physical_device_properties2(physical, &mut props2) };
        let limits = props2.properties.limits;
        let int_dot_fast =
            int_dot && props13.integer_dot_product4x8_bit_packed_signed_accelerated == vk::TRUE;
        let info = described;
        Ok(Arc::new(Device {
            raw,
            queue: Mutex::new(queue),
            pool: Mutex::new(pool),
            memory,
            limits,
            subgroup_size: subgroup.subgroup_size,
            timeline_semaphores,
            timestamp_valid_bits,
            int_dot,
            int_dot_fast,
            info,
            loss: LossState::default(),
            refusal: Armed::default(),
            physical,
            instance,
        }))
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Shared memory a compute workgroup may declare, in bytes.
    pub fn max_shared_memory(&self) -> u32 {
        self.limits.max_compute_shared_memory_size
    }

    /// Largest range one storage-buffer binding may cover (128 MiB on lavapipe).
    pub fn max_storage_buffer_range(&self) -> u64 {
        self.limits.max_storage_buffer_range.into()
    }

    pub fn subgroup_size(&self) -> u32 {
        self.subgroup_size
    }

    /// Whether integer dot products are enabled (the `IntDot` shader variants).
    pub fn integer_dot_product(&self) -> bool {
        self.int_dot
    }

    /// Whether the device runs packed 8-bit dot products in hardware: where it emulates them,
    /// the `IntDot` variants are slower than the f32 ones.
    pub fn integer_dot_product_accelerated(&self) -> bool {
        self.int_dot_fast
    }

    /// Whether cooperative matrices are enabled (the `CoopMat` shader variants).
    pub fn cooperative_matrix(&self) -> bool {
        self.info.capabilities.cooperative_matrix
    }

    /// Whether compute shaders may use subgroup arithmetic (the `Subgroup` shader variants).
    pub fn subgroup_arithmetic(&self) -> bool {
        self.info.capabilities.subgroup_arithmetic
    }

    /// Records commands with `record`, submits them and waits for them to finish.
    pub fn run_once(&self, record: impl FnOnce(vk::CommandBuffer)) -> Result<()> {
        self.try_run_once(|cmd| {
            record(cmd);
            Ok(())
        })
    }

    /// As [`Device::run_once`], but a recording that fails is not submitted.
    pub fn try_run_once<T>(
        &self,
        record: impl FnOnce(vk::CommandBuffer) -> Result<T>,
    ) -> Result<T> {
        // Held for this whole call.
        let pool = self.pool.lock();
        let cmd = self.allocate_commands(&pool, 1)?[0];
        let result = self.record_submit_wait(cmd, record, || ());
        // SAFETY: the fence wait (or a failure before submit) means `cmd` is not pending.
        unsafe { self.raw.free_command_buffers(*pool, &[cmd]) };
        result.map(|(value, ())| value)
    }

    /// As [`Device::try_run_once`], running `meanwhile` on this thread between the submission
    /// and the wait, so host work (CPU experts) overlaps the device's. `meanwhile` does not run
    /// when the recording or the submission fails; a panic in it is re-raised after the wait.
    pub fn try_run_overlapped<T, R>(
        &self,
        record: impl FnOnce(vk::CommandBuffer) -> Result<T>,
        meanwhile: impl FnOnce() -> R,
    ) -> Result<(T, R)> {
        // Held for this whole call.
        let pool = self.pool.lock();
        let cmd = self.allocate_commands(&pool, 1)?[0];
        let result = self.record_submit_wait(cmd, record, meanwhile);
        // SAFETY: the fence wait (or a failure before submit) means `cmd` is not pending.
        unsafe { self.raw.free_command_buffers(*pool, &[cmd]) };
        result
    }

    fn record_submit_wait<T, R>(
        &self,
        cmd: vk::CommandBuffer,
        record: impl FnOnce(vk::CommandBuffer) -> Result<T>,
        meanwhile: impl FnOnce() -> R,
    ) -> Result<(T, R)> {
        let begin = vk::CommandBufferBeginInfo::default()
            .flags(vk::CommandBufferUsageFlags::ONE_TIME_SUBMIT);
        // SAFETY: `cmd` is a freshly allocated primary command buffer of this device.
        unsafe { self.raw.begin_command_buffer(cmd, &begin) }.map_err(map_vk)?;
        let recorded = record(cmd);
        // SAFETY: recording began above.
        unsafe { self.raw.end_command_buffer(cmd) }.map_err(map_vk)?;
        let value = recorded?;
        let done = Completion::new(self)?;
        let cmds = [cmd];
        let values = [1u64];
        let mut timeline =
            vk::TimelineSemaphoreSubmitInfo::default().signal_semaphore_values(&values);
        let mut submit = vk::SubmitInfo::default().command_buffers(&cmds);
        let signal;
        if let Completion::Timeline(s) = done {
            signal = [s];
            submit = submit.signal_semaphores(&signal).push_next(&mut timeline);
        }
        let submitted = if self.loss.lost_at(LossPoint::Submit) {
            Err(vk::Result::ERROR_DEVICE_LOST)
        } else {
            let queue = self.queue.lock();
            // SAFETY: the queue is externally synchronised by its mutex; `cmd` is executable;
            // the info's arrays live across the call.
            unsafe { self.raw.queue_submit(*queue, &[submit], done.fence()) }
        };
        // The device runs while the host does its part; the wait below happens even if that
        // part panics, so `cmd` and its completion's signal are never freed while pending.
        let host = submitted
            .is_ok()
            .then(|| catch_unwind(AssertUnwindSafe(meanwhile)));
        let result = submitted.and_then(|()| done.wait(self));
        // An injected loss at the wait shows once the work is done, as a real one may.
        let result = result.and_then(|()| {
            if self.loss.lost_at(LossPoint::Wait) {
                Err(vk::Result::ERROR_DEVICE_LOST)
            } else {
                Ok(())
            }
        });
        // The wait finished (or the submit failed): neither object is in use.
        done.destroy(self);
        let host = host.map(|h| h.unwrap_or_else(|panic| resume_unwind(panic)));
        result.map_err(|r| self.map_result(r))?;
        Ok((value, host.expect("ran after a successful submission")))
    }

    /// What the device offers beyond Vulkan 1.2 compute.
    pub fn capabilities(&self) -> &Capabilities {
        &self.info.capabilities
    }

    /// Bytes of device-local memory this process may still take, as the driver reports them
    /// now (`VK_EXT_memory_budget`); `None` where the device does not say.
    pub fn memory_budget(&self) -> Option<u64> {
        device_local_budget(&self.instance.raw, self.physical, &self.info.capabilities)
    }

    /// Whether the device was lost: nothing more runs on it, and its owner must open a new one.
    pub fn is_lost(&self) -> bool {
        self.loss.is_lost()
    }

    /// Injects a loss of this device at its next `point` (`super::lost`).
    pub(crate) fn arm_loss(&self, point: LossPoint) {
        self.loss.arm(point);
    }

    /// `DeviceLost` when the device is lost at `point` (an armed loss taking effect there).
    pub(crate) fn check_lost(&self, point: LossPoint) -> Result<()> {
        if self.loss.lost_at(point) {
            Err(GpuError::DeviceLost)
        } else {
            Ok(())
        }
    }

    /// Injects the driver's refusal of the next `what` this device is asked for
    /// (`super::driver_fault`).
    pub(crate) fn arm_refusal(&self, what: DriverObject) {
        self.refusal.arm(what as u8);
    }

    /// Out of device memory when an injected refusal of `what` takes effect now.
    pub(super) fn check_refusal(&self, what: DriverObject) -> Result<()> {
        if self.refusal.take(what as u8) {
            tracing::warn!("fault injection: the driver refuses {what:?}");
            return Err(map_vk(vk::Result::ERROR_OUT_OF_DEVICE_MEMORY));
        }
        Ok(())
    }

    /// `count` primary command buffers from the device's command pool, whose lock the caller
    /// holds (`pool`, for as long as it records into them).
    pub(super) fn allocate_commands(
        &self,
        pool: &parking_lot::MutexGuard<'_, vk::CommandPool>,
        count: u32,
    ) -> Result<Vec<vk::CommandBuffer>> {
        self.check_refusal(DriverObject::CommandBuffers)?;
        let alloc = vk::CommandBufferAllocateInfo::default()
            .command_pool(**pool)
            .level(vk::CommandBufferLevel::PRIMARY)
            .command_buffer_count(count);
        // SAFETY: the pool is externally synchronised by its mutex, which the caller holds.
        unsafe { self.raw.allocate_command_buffers(&alloc) }.map_err(|e| self.map_result(e))
    }

    /// Maps a Vulkan result, remembering a loss the driver reported.
    pub(crate) fn map_result(&self, r: vk::Result) -> GpuError {
        if r == vk::Result::ERROR_DEVICE_LOST {
            self.loss.mark_lost();
        }
        map_vk(r)
    }

    /// Alignment of storage-buffer binding offsets.
    pub fn storage_offset_alignment(&self) -> u64 {
        self.limits.min_storage_buffer_offset_alignment.max(4)
    }

    /// Index of a memory type allowed by `type_bits` with all of `flags`, if any.
    pub(crate) fn memory_type(
        &self,
        type_bits: u32,
        flags: vk::MemoryPropertyFlags,
    ) -> Option<u32> {
        (0..self.memory.memory_type_count).find(|&i| {
            type_bits & (1 << i) != 0
                && self.memory.memory_types[i as usize]
                    .property_flags
                    .contains(flags)
        })
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: every object created from this device holds an `Arc<Device>`, so none is alive;
        // waiting idle ensures no submitted work still uses the pool.
        unsafe {
            let _ = self.raw.device_wait_idle();
            self.raw.destroy_command_pool(*self.pool.get_mut(), None);
            self.raw.destroy_device(None);
        }
    }
}

/// What a one-off submission signals when it completes: a timeline semaphore where the device
/// has them (its counter is read from memory, so a polled wait sees the completion within
/// microseconds), else a fence.
enum Completion {
    Timeline(vk::Semaphore),
    Fence(vk::Fence),
}

impl Completion {
    fn new(device: &Device) -> Result<Completion> {
        let dev = &device.raw;
        if device.timeline_semaphores {
            // Destroyed by `destroy`.
            let semaphore = super::chain::new_timeline(dev).map_err(map_vk)?;
            return Ok(Completion::Timeline(semaphore));
        }
        // SAFETY: `raw` is a live device; destroyed by `destroy`.
        let fence =
            unsafe { dev.create_fence(&vk::FenceCreateInfo::default(), None) }.map_err(map_vk)?;
        Ok(Completion::Fence(fence))
    }

    /// The fence to pass to the submission (null with a timeline semaphore).
    fn fence(&self) -> vk::Fence {
        match *self {
            Completion::Timeline(_) => vk::Fence::null(),
            Completion::Fence(f) => f,
        }
    }

    /// Waits for the submission: polled first, as chains are (a sleeping wait's wake-up can
    /// cost more than the short work these submissions do), then asleep in the driver.
    fn wait(&self, device: &Device) -> std::result::Result<(), vk::Result> {
        match *self {
            Completion::Timeline(s) => super::chain::wait_timeline(&device.raw, s, 1),
            Completion::Fence(f) => super::chain::wait_fence(&device.raw, f),
        }
    }

    fn destroy(self, device: &Device) {
        // SAFETY: the submission that used it completed or was never made.
        unsafe {
            match self {
                Completion::Timeline(s) => device.raw.destroy_semaphore(s, None),
                Completion::Fence(f) => device.raw.destroy_fence(f, None),
            }
        }
    }
}
