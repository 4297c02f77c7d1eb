//! Where a model computes: `cpu`, `vulkan` (the preferred Vulkan device) or `vulkan:N` (device N
//! of `spillwayd devices`), shared by `spillwayd run`, `spillwayd serve --device` and the
//! `device` of `LoadModel`; opening the Vulkan device one names, with errors that say what the
//! machine has.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::gpu::forward::{GpuModel, GpuModelOptions};
use crate::gpu::{Device, GpuError, Instance};
use crate::model::Model;

/// A device as the command line and `LoadModel` name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    #[default]
    Cpu,
    /// `None`: the preferred device.
    Vulkan(Option<usize>),
}

impl FromStr for DeviceChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("`{s}` is not a device: use cpu, vulkan or vulkan:N");
        match s.split_once(':') {
            None if s == "cpu" => Ok(DeviceChoice::Cpu),
            None if s == "vulkan" => Ok(DeviceChoice::Vulkan(None)),
            Some(("vulkan", n)) => n
                .parse()
                .map(|n| DeviceChoice::Vulkan(Some(n)))
                .map_err(|_| bad()),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceChoice::Cpu => f.write_str("cpu"),
            DeviceChoice::Vulkan(None) => f.write_str("vulkan"),
            DeviceChoice::Vulkan(Some(n)) => write!(f, "vulkan:{n}"),
        }
    }
}

/// Why a Vulkan device could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// No loader, no driver or no device at all: nothing Vulkan can run here.
    #[error("Vulkan is not usable on this machine ({0}); install a Vulkan driver or use cpu")]
    Unavailable(GpuError),
    /// Devices exist, but not the one named.
    #[error("no such device; this machine has {}: {}", .devices.len(), list(.devices))]
    NoSuchDevice { index: usize, devices: Vec<String> },
    #[error("opening the Vulkan device: {0}")]
    Other(GpuError),
}

fn list(devices: &[String]) -> String {
    if devices.is_empty() {
        "none".to_string()
    } else {
        devices.join(", ")
    }
}

/// `vulkan:N (NAME)`: how a device is shown in logs, reports and `Status`.
pub fn describe(device: &Device) -> String {
    let info = device.info();
    format!("vulkan:{} ({})", info.index, info.name)
}

/// Opens device `index` of this machine, or the preferred one.
pub fn open_vulkan(index: Option<usize>) -> Result<Arc<Device>, OpenError> {
    let instance = Instance::new().map_err(OpenError::Unavailable)?;
    match Device::open(instance.clone(), index) {
        Ok(d) => Ok(d),
        Err(GpuError::NoSuchDevice { index, count: 0 }) => {
            Err(OpenError::Unavailable(GpuError::NoSuchDevice {
                index,
                count: 0,
            }))
        }
        Err(GpuError::NoSuchDevice { index, .. }) => Err(OpenError::NoSuchDevice {
            index,
            devices: instance
                .devices()
                .unwrap_or_default()
                .iter()
                .map(|d| format!("vulkan:{} ({})", d.index, d.name))
                .collect(),
        }),
        Err(e @ GpuError::NoDevice) => Err(OpenError::Unavailable(e)),
        Err(e) => Err(OpenError::Other(e)),
    }
}

/// Uploads `model` to `device`; a load that ran out of the budget says what the model needs
/// (the budget checks before the upload say it themselves).
pub fn load_gpu_model(
    device: &Arc<Device>,
    model: &Arc<Model>,
    options: &GpuModelOptions,
) -> Result<GpuModel, (GpuError, String)> {
    GpuModel::new(device, model, options).map_err(|e| {
        let message = match &e {
            GpuError::OverBudget { .. } => {
                let need = GpuModel::device_bytes(model, options);
                format!(
                    "{e}: the model needs {} bytes of device memory ({} of weights, {} of KV \
                     cache, {} of activations) plus alignment and upload staging",
                    need.total(),
                    need.weights,
                    need.kv_cache,
                    need.activations
                )
            }
            e => e.to_string(),
        };
        (e, message)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_as_written() {
        for s in ["cpu", "vulkan", "vulkan:3"] {
            assert_eq!(s.parse::<DeviceChoice>().unwrap().to_string(), s);
        }
        for s in ["gpu", "vulkan:", "vulkan:x", "cpu:0", ""] {
            assert!(s.parse::<DeviceChoice>().is_err(), "{s}");
        }
    }
}
