//! What a physical device offers beyond Vulkan 1.2 compute, detected once per device:
//! `spillwayd devices` prints it, the kernels pick variants by it (subgroup arithmetic,
//! cooperative matrices), and the memory budget bounds what a model without `--vram-budget` plans
//! to place in VRAM ([`super::Device::memory_budget`]).

use std::ffi::CStr;

use ash::vk;

/// Features and extensions of one physical device that Spillway looks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Capabilities {
    /// f16 arithmetic in shaders (`shaderFloat16`).
    pub float16: bool,
    /// 8-bit integer arithmetic in shaders (`shaderInt8`).
    pub int8: bool,
    /// 16- and 8-bit values in storage buffers.
    pub storage_16bit: bool,
    pub storage_8bit: bool,
    /// Subgroup arithmetic (`subgroupAdd`, `subgroupMax`) in compute shaders: the `Subgroup`
    /// kernel variants.
    pub subgroup_arithmetic: bool,
    /// The subgroup size a pipeline runs with can be asked for (Vulkan 1.3 or
    /// `VK_EXT_subgroup_size_control`).
    pub subgroup_size_control: bool,
    /// Integer dot-product instructions (Vulkan 1.3 or `VK_KHR_shader_integer_dot_product`).
    pub integer_dot_product: bool,
    /// `VK_KHR_cooperative_matrix` with 16×16×16 f16 × f16 → f32 products at subgroup scope,
    /// and f16 arithmetic: the `CoopMat` kernel variants (prompts' matrix products).
    pub cooperative_matrix: bool,
    /// `VK_EXT_memory_budget`: how much of each heap this process may still take.
    pub memory_budget: bool,
    /// A queue family for transfers only, beside the compute one (copies that could overlap
    /// compute).
    pub transfer_queue: bool,
}

/// Detects the capabilities of `pd`, a physical device of `instance` that supports Vulkan 1.2.
pub(super) fn detect(
    entry: &ash::Entry,
    instance: &ash::Instance,
    pd: vk::PhysicalDevice,
) -> Capabilities {
    // SAFETY: `pd` belongs to `instance`.
    let extensions =
        unsafe { instance.enumerate_device_extension_properties(pd) }.unwrap_or_default();
    let has = |name: &CStr| {
        extensions
            .iter()
            .any(|e| e.extension_name_as_c_str() == Ok(name))
    };
    let mut subgroup = vk::PhysicalDeviceSubgroupProperties::default();
    let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut subgroup);
    // SAFETY: as above; the chained struct outlives the call.
    unsafe { instance.get_physical_device_properties2(pd, &mut props2) };
    let api = props2.properties.api_version;

    let mut f11 = vk::PhysicalDeviceVulkan11Features::default();
    let mut f12 = vk::PhysicalDeviceVulkan12Features::default();
    let mut f13 = vk::PhysicalDeviceVulkan13Features::default();
    let mut features = vk::PhysicalDeviceFeatures2::default()
        .push_next(&mut f11)
        .push_next(&mut f12);
    // Vulkan 1.3's feature struct may only be chained where the device has 1.3.
    let v13 = api >= vk::API_VERSION_1_3;
    if v13 {
        features = features.push_next(&mut f13);
    }
    // SAFETY: `pd` belongs to `instance`; the chained structs outlive the call.
    unsafe { instance.get_physical_device_features2(pd, &mut features) };

    // SAFETY: as above.
    let families = unsafe { instance.get_physical_device_queue_family_properties(pd) };
    let transfer_queue = families.iter().any(|f| {
        f.queue_flags.contains(vk::QueueFlags::TRANSFER)
            && !f
                .queue_flags
                .intersects(vk::QueueFlags::COMPUTE | vk::QueueFlags::GRAPHICS)
    });
    let on = |b: vk::Bool32| b == vk::TRUE;
    Capabilities {
        float16: on(f12.shader_float16),
        int8: on(f12.shader_int8),
        storage_16bit: on(f11.storage_buffer16_bit_access),
        storage_8bit: on(f12.storage_buffer8_bit_access),
        subgroup_arithmetic: subgroup
            .supported_operations
            .contains(vk::SubgroupFeatureFlags::ARITHMETIC)
            && subgroup
                .supported_stages
                .contains(vk::ShaderStageFlags::COMPUTE),
        subgroup_size_control: (v13 && on(f13.subgroup_size_control))
            || has(c"VK_EXT_subgroup_size_control"),
        integer_dot_product: (v13 && on(f13.shader_integer_dot_product))
            || has(c"VK_KHR_shader_integer_dot_product"),
        cooperative_matrix: has(c"VK_KHR_cooperative_matrix")
            && on(f12.shader_float16)
            && on(f12.vulkan_memory_model)
            && cooperative_f16_16x16x16(entry, instance, pd),
        memory_budget: has(c"VK_EXT_memory_budget"),
        transfer_queue,
    }
}

/// Whether `pd` (which has `VK_KHR_cooperative_matrix`) enables the feature and multiplies
/// 16×16×16 f16 blocks into f32 at subgroup scope, the shape `matvec_batch.comp` uses.
fn cooperative_f16_16x16x16(
    entry: &ash::Entry,
    instance: &ash::Instance,
    pd: vk::PhysicalDevice,
) -> bool {
    let mut coop = vk::PhysicalDeviceCooperativeMatrixFeaturesKHR::default();
    let mut features = vk::PhysicalDeviceFeatures2::default().push_next(&mut coop);
    // SAFETY: `pd` belongs to `instance`, whose device has the extension; the chained struct
    // outlives the call.
    unsafe { instance.get_physical_device_features2(pd, &mut features) };
    if coop.cooperative_matrix != vk::TRUE {
        return false;
    }
    let ext = ash::khr::cooperative_matrix::Instance::new(entry, instance);
    // SAFETY: as above.
    let shapes = unsafe { ext.get_physical_device_cooperative_matrix_properties(pd) };
    let f16 = vk::ComponentTypeKHR::FLOAT16;
    let f32 = vk::ComponentTypeKHR::FLOAT32;
    shapes.unwrap_or_default().iter().any(|s| {
        (s.m_size, s.n_size, s.k_size) == (16, 16, 16)
            && (s.a_type, s.b_type) == (f16, f16)
            && (s.c_type, s.result_type) == (f32, f32)
            && s.scope == vk::ScopeKHR::SUBGROUP
    })
}

/// Bytes of the device-local heaps that this process may still take, as the driver reports them
/// (`VK_EXT_memory_budget`: the heap's budget less what the process holds there), or `None`
/// where the device lacks the extension.
pub(super) fn device_local_budget(
    instance: &ash::Instance,
    pd: vk::PhysicalDevice,
    caps: &Capabilities,
) -> Option<u64> {
    if !caps.memory_budget {
        return None;
    }
    let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
    let mut props = vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
    // SAFETY: `pd` belongs to `instance` and supports the extension; the chained struct outlives
    // the call.
    unsafe { instance.get_physical_device_memory_properties2(pd, &mut props) };
    let heaps = props.memory_properties.memory_heaps;
    let n = props.memory_properties.memory_heap_count as usize;
    Some(
        (0..n)
            .filter(|&i| heaps[i].flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
            .map(|i| budget.heap_budget[i].saturating_sub(budget.heap_usage[i]))
            .sum(),
    )
}
