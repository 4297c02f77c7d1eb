//! The Vulkan backend, through `ash`. The loader is loaded at run time, so a machine without
//! Vulkan still runs everything else. Unsafe Vulkan calls live in this module only, each with its
//! safety contract; above it callers see safe RAII types that destroy themselves in `Drop` and
//! hold an `Arc` of what they were created from.
//!
//! Layers, bottom up: instance and device choice; the memory sub-allocator under a VRAM budget
//! ([`alloc`]); buffers and staging uploads; pipelines from the shader table, cached per variant,
//! and recordings of many dispatches with barriers only on real dependencies ([`record`]); the
//! ops of a decode step ([`ops`]); a model's whole decode step on the GPU ([`forward`]), with
//! MoE layers routed on the host between command buffers ([`moe`]); under a VRAM budget, a MoE
//! model's routed experts partly in VRAM slots ([`placement`], [`expert_cache`]) and the rest
//! computed on the CPU at the same time ([`cpu_experts`]) or fetched into slots; a dense model's
//! first layers on the CPU when the budget holds only the rest ([`cpu_layers`]). Not yet: the
//! transfer queue, weights streamed through VRAM.

#![deny(unsafe_op_in_unsafe_fn)]

pub mod alloc;
mod buffer;
pub mod capabilities;
pub mod chain;
pub mod cpu_experts;
pub mod cpu_layers;
mod device;
pub mod driver_fault;
mod error;
pub mod expert_cache;
pub mod footprint;
pub mod forward;
mod instance;
pub mod lost;
mod matmul_tile;
pub mod matrix;
pub mod matvec_shape;
pub mod moe;
mod moe_groups;
pub mod ops;
pub mod ops_attention;
pub mod ops_batch;
pub mod ops_moe;
pub mod ops_q8;
mod pipeline;
pub mod placement;
pub mod record;
pub mod replay;
mod token_fault;
pub mod upload;

pub use alloc::{Allocator, Budget, MemoryUse};
pub use buffer::Buffer;
pub use device::Device;
pub use error::{map_vk, GpuError, MemoryKind};
pub use instance::{DeviceInfo, DeviceKind, Instance};
pub use matmul_tile::MatMulTile;
pub use pipeline::ComputePipeline;
pub use record::{ChainReplay, Kernels, RecordStats, Recorder, TimedReplay};
pub use upload::Uploader;

/// Set (to anything but `0`) where a Vulkan device must exist, as in CI: GPU tests then fail
/// instead of skipping when none is found.
pub const REQUIRE_VULKAN_ENV: &str = "SPILLWAY_REQUIRE_VULKAN";

/// The preferred Vulkan device for a test or benchmark, or `None` (with a line on stderr) where
/// the machine has none. Where [`REQUIRE_VULKAN_ENV`] is set a missing device panics instead,
/// so that CI cannot pass by skipping every GPU test.
pub fn device_or_skip() -> Option<std::sync::Arc<Device>> {
    match Instance::new().and_then(|i| Device::open(i, None)) {
        Ok(d) => Some(d),
        Err(e) => {
            let required = std::env::var(REQUIRE_VULKAN_ENV).is_ok_and(|v| v != "0");
            assert!(
                !required,
                "{REQUIRE_VULKAN_ENV} is set but no Vulkan device: {e}"
            );
            eprintln!("skipping: no Vulkan device ({e})");
            None
        }
    }
}
