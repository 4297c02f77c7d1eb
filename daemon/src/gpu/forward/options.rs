//! The settings of a [`GpuModel`](super::GpuModel): budgets, the context, where experts go, and the switches
//! that turn each of the decode step's techniques off for comparisons.

use super::step_costs::StepBatching;
#[allow(unused_imports)] // for the documentation's links
use super::{chained, promote, step_costs, stream, stream_experts, GpuModel, STREAM_MIN_TOKENS};
use crate::gpu::placement::{ExpertLayout, MoeMiss};
#[allow(unused_imports)]
use crate::gpu::{device::Device, record::Recorder};
use crate::stream::ReplacementPolicy;

/// Settings of a [`GpuModel`](super::GpuModel).
#[derive(Debug, Clone)]
pub struct GpuModelOptions {
    /// Hard ceiling on device memory held (`--vram-budget`); `None`: the device's own.
    pub vram_budget: Option<u64>,
    /// KV cache positions; 0 means the model's context length, capped at 4096.
    pub context: usize,
    /// What happens to a routed expert that is not in VRAM (`--moe-miss`).
    pub moe_miss: MoeMiss,
    /// How the expert slots the budget holds are spread over the layers (`--expert-layout`).
    pub expert_layout: ExpertLayout,
    /// Which resident expert a fetch replaces.
    pub expert_policy: ReplacementPolicy,
    /// CPU threads for experts computed on the CPU, the caller's included; 0: every core.
    pub threads: usize,
    /// Route MoE layers on the host (a read-back per layer) even when every expert is in VRAM
    /// and the device could route them: the path offloading takes, for comparisons.
    pub host_routing: bool,
    /// RAM for the routed experts computed on the CPU (`--ram-budget`): a cache that reads
    /// misses from the model file; `None`: they are read through the memory map.
    pub ram_budget: Option<u64>,
    /// With experts on the CPU, run a step as one chain of command buffers that the host
    /// releases layer by layer ([`chained`](super::chained)); `false`: one submission and fence wait per part,
    /// for comparisons.
    pub chain: bool,
    /// How a chain's host and device hand parts to each other
    /// ([`Handoff`](crate::gpu::chain::Handoff)): `SPILLWAY_CHAIN_HANDOFF`'s, by default.
    pub handoff: crate::gpu::chain::Handoff,
    /// With misses split between the CPU and the bus ([`MoeMiss::Split`](crate::gpu::placement::MoeMiss::Split)),
    /// the share of each layer's misses the CPU takes, fixed; `None`: measured step by step
    /// ([`split`](super::split)). With `bus_rows`, the share of each product's rows the CPU
    /// computes.
    pub split_cpu_share: Option<f32>,
    /// A dense model's layers on the CPU (over the VRAM budget) share each decode step's
    /// products with the GPU, which reads its rows of them from a copy in system RAM over the
    /// bus (`gpu/forward/bus_rows.rs`); `false`: the CPU computes them alone. The copy is
    /// those layers' size in RAM besides the memory map.
    pub bus_rows: bool,
    /// Record a step that is one submission (a dense model, or every expert in VRAM) once and
    /// submit that recording for every token ([`crate::gpu::replay`]), and likewise the parts of
    /// a chained step ([`crate::gpu::record::ChainReplay`]); `false`: record each step anew, for
    /// comparisons.
    pub replay: bool,
    /// Multiply prompts' chunks in the device's matrix units where it has cooperative matrices;
    /// `false`: the f32 kernel, for comparisons.
    pub coopmat: bool,
    /// Multiply Q4_0 and Q8_0 weights with integer dot products where the device has them, the inputs
    /// quantized to 8 bits as the CPU engine quantizes them, so that the logits follow the CPU
    /// engine's (and llama.cpp's) more closely; `false`: f32 dots, for comparisons. Where the
    /// device emulates them ([`Device::integer_dot_product_accelerated`](crate::gpu::Device::integer_dot_product_accelerated): lavapipe) they are
    /// slower than f32 dots, and still used.
    pub int_dot: bool,
    /// With `int_dot`, quantize a product's inputs once into a scratch buffer that every
    /// product reading them shares ([`crate::gpu::Kernels::set_q8_scratch`]) rather than in
    /// each of its workgroups; `false`: in the product, for comparisons.
    pub q8_inputs: bool,
    /// With `q8_inputs`, products of fewer weights than this quantize their inputs themselves
    /// ([`crate::gpu::Kernels::set_q8_min_weights`]); 0: none. By default
    /// [`SMALL_PRODUCT_WEIGHTS`]: on an H100 a MoE layer's attention products then have no
    /// dispatch before them that only quantizes (`bench/RESULTS.md`, 2026-12-06).
    pub q8_min_weights: usize,
    /// Do a decode step's QK-norm, RoPE and KV-cache append in the attention's dispatch
    /// ([`Recorder::attention_rope`](crate::gpu::record::Recorder::attention_rope)): one dependent dispatch fewer a layer; `false`: a RoPE
    /// dispatch, then attention, for comparisons.
    pub rope_in_attention: bool,
    /// A dense model's layers on the CPU (over the VRAM budget) take prompt chunks of at least
    /// [`STREAM_MIN_TOKENS`](super::STREAM_MIN_TOKENS) tokens on the GPU, in turn through a slot of one layer's VRAM
    /// ([`stream`](super::stream)): the budget then holds one resident layer fewer. A MoE model over its
    /// budget runs a prompt chunk's missing experts on the GPU through a few slots they take in
    /// turn ([`stream_experts`](super::stream_experts)), for fewer resident experts. `false`: prompts run those layers
    /// on the CPU, and a MoE model's prompts go token by token.
    pub stream_prompts: bool,
    /// With `stream_prompts`, how many experts a MoE model's prompt takes through VRAM at a
    /// time; 0: as many as 64 MiB holds.
    pub prompt_expert_slots: usize,
    /// With misses on the CPU, bring the experts used most into VRAM slots between steps in
    /// place of residents used less ([`promote`](super::promote)); `false`: the slots keep the experts they
    /// were loaded with, for comparisons.
    pub promote_experts: bool,
    /// Take a prompt chunk's attention in the flash-attention kernel
    /// ([`Recorder::attention_prefill`](crate::gpu::record::Recorder::attention_prefill)) where its heads fit it; `false`: the decode kernel over
    /// the chunk's tokens, for comparisons.
    pub flash_attention: bool,
    /// The prompts' cooperative-matrix product tile; `None`: the tuned one
    /// ([`crate::gpu::MatMulTile::TUNED`], or shallower where shared memory is short).
    pub matmul_tile: Option<crate::gpu::MatMulTile>,
    /// Sequences the KV cache holds, each of `context` positions, for decode steps that take
    /// one token of several at once ([`GpuModel::eval_batch`](super::GpuModel::eval_batch)); 0 or 1: one. A dense model
    /// with its first layers on the CPU holds one whatever this says.
    pub sequences: usize,
    /// Products over at most this many tokens (a batched decode step, a short prompt) take the
    /// several-column matrix-vector kernel, which reads each weight once for all of them
    /// ([`crate::gpu::Kernels::set_matvec_cols`]); 0: the tiled kernel, for comparisons.
    pub matvec_cols: usize,
    /// Whether a decode step of several sequences runs batched or a sequence at a time,
    /// whichever is measured cheaper ([`step_costs`](super::step_costs)), or batched wherever the model can.
    pub step_batching: StepBatching,
    /// Whether a newly admitted request's prompt may go into the running requests' steps
    /// ([`GpuModel::mixed_step_tokens`](super::GpuModel::mixed_step_tokens)); `false`: prompts
    /// run apart (`spillwayd serve --prompt-steps false`, for comparisons).
    pub prompt_steps: bool,
    /// Run a MoE layer's experts for a few tokens (a batched decode step) by entry, every
    /// token's k in one dispatch as a decode step runs one token's, where every expert is
    /// resident ([`GpuModel::moe_by_entry`](super::GpuModel)); `false`: laid out by expert as
    /// a prompt chunk's are, for comparisons.
    pub moe_by_entry: bool,
}

/// Products of fewer weights than this quantize their inputs in their own workgroups
/// ([`GpuModelOptions::q8_min_weights`]; an expert-indexed product counts every chosen
/// expert's rows): the attention products of the Llama-3-8B and Qwen3-30B-A3B shapes (4096 ×
/// 4096 and smaller) and the 30B's down products of 8 experts, not the FFN products or the
/// experts' gate and up. Measured on an H100 (`bench/RESULTS.md`, 2026-12-06): the 30B shape's
/// decode 2–5% faster (three dependent dispatches a layer fewer), the 8B's unchanged; with the
/// experts' gate and up in place too, 5% slower. The scheduler's step model counts dispatches
/// by the same figure.
pub const SMALL_PRODUCT_WEIGHTS: usize = spillway_sched::model::GPU_SMALL_PRODUCT_WEIGHTS;

impl Default for GpuModelOptions {
    fn default() -> GpuModelOptions {
        GpuModelOptions {
            vram_budget: None,
            context: 0,
            moe_miss: MoeMiss::default(),
            expert_layout: ExpertLayout::default(),
            expert_policy: ReplacementPolicy::Lru,
            threads: 0,
            host_routing: false,
            ram_budget: None,
            chain: true,
            handoff: crate::gpu::chain::Handoff::configured(),
            split_cpu_share: None,
            bus_rows: false,
            replay: true,
            coopmat: true,
            int_dot: true,
            q8_inputs: true,
            q8_min_weights: SMALL_PRODUCT_WEIGHTS,
            rope_in_attention: true,
            flash_attention: true,
            stream_prompts: true,
            prompt_expert_slots: 0,
            promote_experts: true,
            matmul_tile: None,
            sequences: 1,
            matvec_cols: crate::gpu::ops_batch::MAX_MATVEC_COLS as usize,
            step_batching: StepBatching::Measured,
            prompt_steps: true,
            moe_by_entry: true,
        }
    }
}
