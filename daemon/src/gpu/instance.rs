//! The Vulkan loader, instance and the listing and choice of physical devices.

use std::sync::Arc;

use ash::vk;

use super::capabilities::{detect, device_local_budget, Capabilities};
use super::error::{map_vk, GpuError, Result};

/// The loaded Vulkan library and an instance; destroyed when the last `Arc` goes.
pub struct Instance {
    pub(crate) raw: ash::Instance,
    // Keeps the loader library mapped until after `Drop::drop` destroyed the instance.
    pub(crate) entry: ash::Entry,
}

/// What a physical device is, as listed to users.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    pub kind: DeviceKind,
    pub api_version: String,
    pub driver: String,
    pub device_local_bytes: u64,
    /// Of those, what this process may still take, where the driver says
    /// (`VK_EXT_memory_budget`).
    pub device_local_budget: Option<u64>,
    pub capabilities: Capabilities,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub enum DeviceKind {
    // Declared in order of preference.
    Discrete,
    Integrated,
    Virtual,
    Cpu,
    Other,
}

impl Instance {
    /// Loads `libvulkan.so.1` at run time and creates an instance for Vulkan up to 1.3: the
    /// kernels are SPIR-V 1.6 and the integer dot products a 1.3 feature, which a device may
    /// only be asked for when the instance names 1.3 (devices of 1.2 still enumerate; a 1.1+
    /// loader accepts a higher version than it knows).
    pub fn new() -> Result<Arc<Instance>> {
        // SAFETY: loading the system Vulkan loader runs its initialisers; this is the documented
        // way to use a loader that may be absent.
        let entry =
            unsafe { ash::Entry::load() }.map_err(|e| GpuError::LoaderMissing(e.to_string()))?;
        let app = vk::ApplicationInfo::default()
            .application_name(c"spillway")
            .api_version(vk::API_VERSION_1_3);
        let info = vk::InstanceCreateInfo::default().application_info(&app);
        // SAFETY: `info` and what it points to live across the call.
        let raw = unsafe { entry.create_instance(&info, None) }.map_err(map_vk)?;
        Ok(Arc::new(Instance { raw, entry }))
    }

    /// Physical devices that support Vulkan 1.2, in the loader's order.
    pub(crate) fn physical_devices(&self) -> Result<Vec<vk::PhysicalDevice>> {
        // SAFETY: the instance is alive for the call.
        let all = unsafe { self.raw.enumerate_physical_devices() }.map_err(map_vk)?;
        Ok(all
            .into_iter()
            .filter(|&pd| {
                // SAFETY: `pd` was just enumerated from this instance.
                let props = unsafe { self.raw.get_physical_device_properties(pd) };
                props.api_version >= vk::API_VERSION_1_2
            })
            .collect())
    }

    /// Every usable device, for `spillwayd devices` and for choosing one.
    pub fn devices(&self) -> Result<Vec<DeviceInfo>> {
        let pds = self.physical_devices()?;
        Ok(pds
            .iter()
            .enumerate()
            .map(|(index, &pd)| self.describe(index, pd))
            .collect())
    }

    pub(crate) fn describe(&self, index: usize, pd: vk::PhysicalDevice) -> DeviceInfo {
        let mut driver = vk::PhysicalDeviceDriverProperties::default();
        let mut props2 = vk::PhysicalDeviceProperties2::default().push_next(&mut driver);
        // SAFETY: `pd` belongs to this instance; the chained struct outlives the call.
        unsafe { self.raw.get_physical_device_properties2(pd, &mut props2) };
        let props = props2.properties;
        // SAFETY: as above.
        let mem = unsafe { self.raw.get_physical_device_memory_properties(pd) };
        let device_local_bytes = mem.memory_heaps[..mem.memory_heap_count as usize]
            .iter()
            .filter(|h| h.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL))
            .map(|h| h.size)
            .sum();
        let kind = match props.device_type {
            vk::PhysicalDeviceType::DISCRETE_GPU => DeviceKind::Discrete,
            vk::PhysicalDeviceType::INTEGRATED_GPU => DeviceKind::Integrated,
            vk::PhysicalDeviceType::VIRTUAL_GPU => DeviceKind::Virtual,
            vk::PhysicalDeviceType::CPU => DeviceKind::Cpu,
            _ => DeviceKind::Other,
        };
        let v = props.api_version;
        let capabilities = detect(&self.entry, &self.raw, pd);
        DeviceInfo {
            index,
            name: c_chars(&props.device_name),
            kind,
            api_version: format!(
                "{}.{}.{}",
                vk::api_version_major(v),
                vk::api_version_minor(v),
                vk::api_version_patch(v)
            ),
            driver: format!(
                "{} {}",
                c_chars(&driver.driver_name),
                c_chars(&driver.driver_info)
            ),
            device_local_bytes,
            device_local_budget: device_local_budget(&self.raw, pd, &capabilities),
            capabilities,
        }
    }

    /// The device to use: the one named, or the most capable kind (discrete, then integrated,
    /// then virtual, then CPU implementations such as lavapipe).
    pub(crate) fn choose(&self, wanted: Option<usize>) -> Result<(usize, vk::PhysicalDevice)> {
        let pds = self.physical_devices()?;
        if let Some(index) = wanted {
            return pds
                .get(index)
                .map(|&pd| (index, pd))
                .ok_or(GpuError::NoSuchDevice {
                    index,
                    count: pds.len(),
                });
        }
        pds.iter()
            .enumerate()
            .min_by_key(|&(i, &pd)| (self.describe(i, pd).kind, i))
            .map(|(i, &pd)| (i, pd))
            .ok_or(GpuError::NoDevice)
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        // SAFETY: every child object holds an `Arc<Instance>` (through its device), so none is
        // alive when the last reference drops.
        unsafe { self.raw.destroy_instance(None) };
    }
}

fn c_chars(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars
        .iter()
        .take_while(|&&c| c != 0)
        // `c_char` is i8 on x86-64 and u8 on aarch64.
        .map(|&c| c.to_ne_bytes()[0])
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
