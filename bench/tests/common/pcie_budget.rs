//! A VRAM budget under which a tiny MoE model keeps only some routed experts in VRAM, the
//! others read by the GPU from system RAM (`MoeMiss::Pcie`), shared by the tests of prompt
//! chunks and of batched decode steps over the budget.

use std::sync::Arc;

use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::{footprint, Device};
use spillway_daemon::model::Model;

/// `options` (misses over PCIe, a short context) with a VRAM budget of the model's minimum,
/// four prompt chunks' MoE scratch at its context, 1 MiB more where the budget counts the
/// upload staging, and two expert slots a layer. A device whose staging is system RAM may
/// still hold the whole tiny model at it: the caller checks the placement.
pub fn partial_pcie(
    dev: &Arc<Device>,
    model: &Model,
    options: &GpuModelOptions,
) -> GpuModelOptions {
    let minimum = GpuModel::minimum_budget(dev, model, options).unwrap();
    let staging = if minimum.staging > 0 { 1 << 20 } else { 0 };
    let chunk = footprint::moe_chunk_bytes(model, options.context);
    let budget = minimum.total() + 4 * chunk + staging + 2 * minimum.one_slot_per_layer;
    GpuModelOptions {
        vram_budget: Some(budget),
        ..options.clone()
    }
}
