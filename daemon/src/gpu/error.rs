//! Vulkan results collapsed into the few errors callers act on.

use ash::vk;

use super::placement::MinimumBudget;

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("the Vulkan loader (libvulkan.so.1) could not be loaded: {0}")]
    LoaderMissing(String),
    #[error("no Vulkan device found")]
    NoDevice,
    #[error("Vulkan device {index} does not exist ({count} found)")]
    NoSuchDevice { index: usize, count: usize },
    #[error("out of {0} memory")]
    OutOfMemory(MemoryKind),
    /// Out of device memory by our own ceiling (`--vram-budget`), not the driver's.
    #[error("out of device memory: {requested} bytes more would pass the VRAM budget of {budget} ({held} held)")]
    OverBudget {
        requested: u64,
        held: u64,
        budget: u64,
    },
    /// A model whose smallest footprint does not fit the budget, found before loading it: for a
    /// MoE model its non-expert weights, KV cache, scratch and one expert slot per layer; for a
    /// dense one its last layer, output and scratch (the other layers on the CPU).
    #[error(
        "the model needs at least {} bytes ({}) of device memory, more than the VRAM budget of \
         {budget} bytes ({}): {} of weights other than routed experts (for a dense model: its last \
         layer's and the output's, the earlier layers on the CPU), {} of KV cache, {} of \
         activations and scratch, {} for one expert slot per MoE layer, {} of upload staging and \
         {} of alignment margin (a shorter context needs less KV cache); with every weight in \
         VRAM it needs {needed} bytes ({})",
        minimum.total(),
        mib(minimum.total()),
        mib(*budget),
        mib(minimum.non_expert),
        mib(minimum.kv_cache),
        mib(minimum.activations),
        mib(minimum.one_slot_per_layer),
        mib(minimum.staging),
        mib(minimum.margin),
        mib(*needed)
    )]
    BelowMinimumBudget {
        budget: u64,
        needed: u64,
        minimum: Box<MinimumBudget>,
    },
    #[error("the Vulkan device was lost")]
    DeviceLost,
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("Vulkan call failed: {0}")]
    Other(vk::Result),
    /// The layers a dense model runs on the CPU failed (an embedding it cannot read).
    #[error("the model's layers on the CPU: {0}")]
    CpuLayers(Box<crate::model::ModelError>),
    /// Reading routed experts from the model file into the RAM tier failed.
    #[error("reading experts from the model file: {0}")]
    Storage(#[from] crate::stream::StreamError),
}

impl GpuError {
    /// Whether memory ran out, the driver's or our budget's.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            GpuError::OutOfMemory(_)
                | GpuError::OverBudget { .. }
                | GpuError::BelowMinimumBudget { .. }
                | GpuError::Storage(crate::stream::StreamError::RamBelowMinimum { .. })
        )
    }
}

impl From<crate::model::ModelError> for GpuError {
    fn from(e: crate::model::ModelError) -> GpuError {
        GpuError::CpuLayers(Box::new(e))
    }
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    Host,
    Device,
}

impl std::fmt::Display for MemoryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            MemoryKind::Host => "host",
            MemoryKind::Device => "device",
        })
    }
}

/// The one mapping from `VkResult` codes to [`GpuError`].
pub fn map_vk(r: vk::Result) -> GpuError {
    match r {
        vk::Result::ERROR_OUT_OF_HOST_MEMORY => GpuError::OutOfMemory(MemoryKind::Host),
        // A pool or heap too fragmented for the request is out of memory too.
        vk::Result::ERROR_OUT_OF_DEVICE_MEMORY
        | vk::Result::ERROR_TOO_MANY_OBJECTS
        | vk::Result::ERROR_FRAGMENTATION
        | vk::Result::ERROR_FRAGMENTED_POOL
        | vk::Result::ERROR_OUT_OF_POOL_MEMORY => GpuError::OutOfMemory(MemoryKind::Device),
        vk::Result::ERROR_DEVICE_LOST => GpuError::DeviceLost,
        vk::Result::ERROR_FEATURE_NOT_PRESENT
        | vk::Result::ERROR_EXTENSION_NOT_PRESENT
        | vk::Result::ERROR_LAYER_NOT_PRESENT
        | vk::Result::ERROR_INCOMPATIBLE_DRIVER
        | vk::Result::ERROR_FORMAT_NOT_SUPPORTED => GpuError::Unsupported(format!("{r:?}")),
        other => GpuError::Other(other),
    }
}

pub type Result<T> = std::result::Result<T, GpuError>;
