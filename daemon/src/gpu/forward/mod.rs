//! A model's decode step on the GPU: weights uploaded to device-local memory once, the KV cache
//! kept there in f16, and each token's whole forward pass (embedding, every layer, output norm
//! and head) recorded into one command buffer, with barriers only where a dispatch reads what an
//! earlier one wrote. The token id and its position are read by the kernels from a small
//! host-visible buffer, so a step that is one submission is recorded once and replayed for every
//! token ([`super::replay`]). The products of the attention output and of the FFN's down matrix
//! are added to the residual stream in their own dispatch (`Recorder::matvec_add`). It follows `engine::forward` operation by operation, so its logits track
//! the CPU engine's; it differs in that activations stay f32 in the matrix-vector products (the
//! CPU quantizes them to Q8_0/Q8_K, as ggml's CPU backend does).
//!
//! MoE layers (`qwen2moe`, `qwen3moe`, Mixtral-style `llama`) are in [`super::moe`]. With every
//! routed expert in VRAM they are routed on the device and the step stays one command buffer;
//! otherwise the step is one command buffer per MoE layer plus one, since the routing is decided
//! on the host from the router logits read back (the offloading below needs them). A MoE model larger than the VRAM budget keeps only some
//! routed experts in VRAM ([`super::placement`]); a routed expert that is not there is computed
//! on the CPU while the GPU runs the resident ones of the same layer ([`super::cpu_experts`]:
//! the layer then takes one more command buffer, whose first dispatch adds the CPU's sum), or
//! fetched into a VRAM slot first ([`super::expert_cache`]).
//!
//! With profiling on ([`GpuModel::set_profiling`], [`profile`]) the step writes GPU timestamps
//! around each op group of each layer; off, it writes none.
//!
//! A prompt runs in chunks of tokens ([`prefill`]). The KV cache may hold several sequences
//! ([`GpuModelOptions::sequences`]), and a decode step may take one token of each in one pass
//! of the chunk path ([`batch`], [`GpuModel::eval_batch`]).
//!
//! A dense model larger than the VRAM budget runs its first layers on the CPU
//! ([`super::cpu_layers`]) and the rest here: the step then starts from the hidden state the
//! CPU wrote to a host-visible buffer instead of the embedding, and is otherwise the same
//! recording, replayed. Partial: no weights are streamed through VRAM.

mod batch;
mod bus_rows;
mod chained;
mod decode;
mod gate_up;
mod load;
mod options;
mod prefill;
mod profile;
mod promote;
mod prompt_misses;
mod split;
mod step_costs;
mod stream;
mod stream_experts;

pub use batch::MAX_STEP_TOKENS;
pub use options::{GpuModelOptions, SMALL_PRODUCT_WEIGHTS};
pub use prefill::PREFILL_CHUNK;
pub(crate) use prefill::{batch_bytes, logits_bytes, moe_rows};
pub use profile::{GpuProfileRow, GpuStepProfile};
pub use promote::{PromotionTime, PROMOTE_SHARE};
pub use step_costs::StepBatching;
pub use stream::STREAM_MIN_TOKENS;
pub(crate) use stream::{readback_bytes, streamable};
pub(crate) use stream_experts::experts_streamable;
pub(in crate::gpu) use stream_experts::prompt_expert_slots;

use gate_up::GateUp;

use std::sync::Arc;
use std::time::Instant;

use super::alloc::{Allocator, MemoryUse};
use super::buffer::Buffer;
use super::cpu_experts::CpuExperts;
use super::cpu_layers::CpuLayers;
use super::device::Device;
use super::error::{GpuError, Result};
use super::expert_cache::{ExpertStats, LayerExpertStats, LayerSlots, SlotExpert};
use super::footprint::{device_bytes, DeviceBytes};
use super::moe::{GpuMoe, LayerRouting, MoeScratch};
use super::ops::{
    attention_counters, attention_scratch_floats, rope_table, upload_f32, AttentionArgs, Fused,
    GpuMatrix, RopeArgs, StepWord,
};
use super::ops_attention::{attention_grid, Unroped};
use super::placement::{plan, MinimumBudget, MoeMiss, Placement};
use super::record::{Kernels, RecordStats, Recorder};
use super::replay::Replay;
use super::upload::Uploader;
use crate::engine::routing::RoutedExpert;
use crate::model::{Config, Ffn, Matrix, Model};
use crate::stream::open_expert_cache;

/// The first of the step buffer's three words holding the attention's grid at the step's
/// position ([`attention_grid`]): a replayed step launches only the runs up to it.
const ATTENTION_GRID_WORD: u32 = 3;

struct GpuLayer {
    attn_norm: Buffer,
    wq: GpuMatrix,
    wk: GpuMatrix,
    wv: GpuMatrix,
    wo: GpuMatrix,
    bq: Option<Buffer>,
    bk: Option<Buffer>,
    bv: Option<Buffer>,
    q_norm: Option<Buffer>,
    k_norm: Option<Buffer>,
    ffn_norm: Buffer,
    ffn: GpuFfn,
    k_cache: Buffer,
    v_cache: Buffer,
}

impl GpuLayer {
    /// Uploads `layer`'s attention and norms, with `ffn` (uploaded by the caller) and a KV cache
    /// of `kv_bytes` for keys and for values.
    fn upload(
        model: &Model,
        al: &Arc<Allocator>,
        up: &mut Uploader,
        layer: &crate::model::Layer,
        ffn: GpuFfn,
        kv_bytes: u64,
    ) -> Result<GpuLayer> {
        let a = &layer.attn;
        Ok(GpuLayer {
            attn_norm: upload_f32(al, up, &a.norm)?,
            wq: matrix(model, al, up, &a.wq)?,
            wk: matrix(model, al, up, &a.wk)?,
            wv: matrix(model, al, up, &a.wv)?,
            wo: matrix(model, al, up, &a.wo)?,
            bq: opt_vec(al, up, &a.bq)?,
            bk: opt_vec(al, up, &a.bk)?,
            bv: opt_vec(al, up, &a.bv)?,
            q_norm: opt_vec(al, up, &a.q_norm)?,
            k_norm: opt_vec(al, up, &a.k_norm)?,
            ffn_norm: upload_f32(al, up, &layer.ffn_norm)?,
            ffn,
            k_cache: Buffer::new_in(al, kv_bytes, MemoryUse::DeviceLocal)?,
            v_cache: Buffer::new_in(al, kv_bytes, MemoryUse::DeviceLocal)?,
        })
    }
}

// One per layer, built once: the size difference between the variants costs nothing.
#[allow(clippy::large_enum_variant)]
enum GpuFfn {
    Dense { gate_up: GateUp, down: GpuMatrix },
    Moe(GpuMoe),
}

/// Activations of one token, reused by every layer.
struct Activations {
    x: Buffer,
    xn: Buffer,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    attn: Buffer,
    gate: Buffer,
    up: Buffer,
    scores: Buffer,
    /// The attention's counters ([`attention_counters`]).
    attn_done: Buffer,
    /// Host-visible, written before each step: the token id (word 0), its position (word 1)
    /// and its sequence's first KV-cache row (word 2), which the kernels read when they run
    /// ([`StepWord`]), then the attention's grid at that position (words 3 to 5,
    /// [`ATTENTION_GRID_WORD`]).
    step: Buffer,
    /// Host-visible, read back after each step.
    logits: Buffer,
    /// Present when the model has MoE layers.
    moe: Option<MoeScratch>,
}

/// Where the routed experts of a MoE model run, and what they did.
struct Experts {
    /// Per layer; `None` for dense layers.
    slots: Vec<Option<LayerSlots>>,
    stats: Vec<LayerExpertStats>,
    miss: MoeMiss,
    /// Present when some experts are not in VRAM.
    cpu: Option<CpuExperts>,
    /// Kept for fetches.
    uploader: Option<Uploader>,
    /// Present when misses go to the CPU and the slots follow demand
    /// ([`GpuModelOptions::promote_experts`]).
    promoter: Option<promote::Promoter>,
    /// Bytes of the copy of every routed expert in system RAM that the GPU reads misses from
    /// ([`MoeMiss::Pcie`]), with the token embedding where it went there too; 0 without it.
    host_bytes: u64,
    /// The token embedding's part of `host_bytes`.
    embedding_bytes: u64,
    /// The slots changed since the device's slot map was written (read with [`MoeMiss::Pcie`]
    /// only).
    map_stale: bool,
}

/// Where a step's next command buffer starts.
enum Resume {
    /// The token's embedding.
    Start,
    /// Layer `layer`'s experts in VRAM slots, then its shared expert. With `cpu` experts the
    /// command buffer ends there, and the CPU computes those from `xn` while it runs.
    Experts {
        layer: usize,
        gpu: Vec<SlotExpert>,
        cpu: Vec<RoutedExpert>,
        shared_gate: Option<f32>,
        xn: Vec<f32>,
    },
    /// The CPU experts' sum of `layer`, waiting in the host-visible scratch.
    CpuSum { layer: usize },
}

/// Where the host's time went in a step with experts on the CPU: a chained step ([`chained`])
/// from its submission on, or a step of separate submissions; or in a step of a dense model
/// with its first layers on the CPU, those layers' time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostTime {
    /// The whole step (a chain's after its submission).
    pub step_ns: u64,
    /// Waiting for the device (a router's logits, the resident experts, the last part); with
    /// separate submissions, recording and submitting them too.
    pub wait_ns: u64,
    /// Computing experts on the CPU (the device runs the resident ones meanwhile).
    pub cpu_experts_ns: u64,
    /// Running a dense model's first layers on the CPU (before the device's part).
    pub cpu_layers_ns: u64,
    /// Recording (unless kept) and submitting a chain's parts, before `step_ns` starts.
    pub submit_ns: u64,
}

impl HostTime {
    /// `f`, its time added to [`HostTime::wait_ns`].
    fn waiting<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = std::time::Instant::now();
        let out = f();
        self.wait_ns += t.elapsed().as_nanos() as u64;
        out
    }
}

/// A model on one GPU, with the KV cache of one sequence or of several
/// ([`GpuModelOptions::sequences`]): the calls that take no sequence act on the selected one
/// ([`GpuModel::select`]).
pub struct GpuModel {
    model: Arc<Model>,
    kernels: Arc<Kernels>,
    allocator: Arc<Allocator>,
    config: Config,
    /// The rows a step's first dispatch gathers into `x`: the embedding table, or, when the
    /// first layers run on the CPU ([`GpuModel::cpu_layers`]), a host-visible matrix of one
    /// row into which the host writes the token's hidden state (step word 0 is then 0).
    input_rows: GpuMatrix,
    /// `None` when the output is tied to the embedding and the embedding is `input_rows`.
    output: Option<GpuMatrix>,
    /// A dense model's first layers, when they run on the CPU; the layers here are the rest.
    front: Option<CpuLayers>,
    /// How long `front` took in the last step or prompt chunk.
    front_time: std::time::Duration,
    /// The GPU's rows of `front`'s products in decode steps, read over the bus
    /// ([`GpuModelOptions::bus_rows`]).
    bus_rows: Option<bus_rows::BusRows>,
    /// The VRAM slot that `front`'s layers take in turn for a long prompt chunk.
    stream: Option<stream::StreamSlot>,
    /// Prompt chunks that took `front`'s layers through `stream`.
    streamed_chunks: u64,
    /// The VRAM slots a MoE model's missing experts take in turn for a prompt chunk.
    expert_stream: Option<stream_experts::ExpertStream>,
    output_norm: Buffer,
    layers: Vec<GpuLayer>,
    rope: Buffer,
    act: Activations,
    capacity: usize,
    /// Tokens evaluated in each sequence; its KV cache rows start at `seq * capacity`.
    positions: Vec<usize>,
    /// The sequence that [`GpuModel::eval`] and [`GpuModel::eval_prompt`] extend.
    seq: usize,
    /// Decode steps that took several sequences' tokens in one pass ([`GpuModel::eval_batch`]),
    /// and those of them replayed from a recording.
    batched_steps: u64,
    replayed_batches: u64,
    /// Single decode steps replayed from a recording ([`GpuModel::replayed_steps`]).
    replayed_steps: u64,
    /// Of `batched_steps`, those run as a chain (`prefill::step_chain`).
    chained_batches: u64,
    last_stats: RecordStats,
    last_routing: Vec<LayerRouting>,
    placement: Placement,
    /// Present for MoE models.
    experts: Option<Experts>,
    /// MoE layers are routed on the device: the step is one submission.
    routes_on_device: bool,
    /// Some routed experts run on the CPU and the step is a chain ([`chained`]).
    chained: bool,
    /// How a chain's parts are handed between the host and the device.
    handoff: crate::gpu::chain::Handoff,
    /// With misses split between the CPU and the bus: the CPU's share.
    split: Option<split::SplitShare>,
    last_host_time: Option<HostTime>,
    /// Present while profiling ([`GpuModel::set_profiling`]).
    profiler: Option<profile::StepQueries>,
    /// Steps are one submission and are replayed from one recording ([`super::replay`]).
    replays: bool,
    /// The recording, made at the first step that uses it.
    replay: Option<Replay>,
    /// The same step recorded with the profile's timestamps, made at the first profiled step
    /// and dropped with the profiler's queries, so that a profiled step is the replayed one.
    profiled_replay: Option<Replay>,
    last_profile: Option<GpuStepProfile>,
    /// Chained steps are submitted from one recording of their parts, kept
    /// ([`crate::gpu::record::ChainReplay`]); unprofiled steps only.
    chain_replays: bool,
    /// That recording, made at the first chained step that uses it.
    chain_replay: Option<crate::gpu::record::ChainReplay>,
    /// A prompt chunk's activations, made at the first prompt ([`prefill`]).
    batch: Option<prefill::Batch>,
    /// The smallest chunk, in tokens, whose memory the VRAM budget refused: chunks as large
    /// are not tried again (prompts go token by token, steps a sequence at a time).
    batch_refused: Option<usize>,
    /// See [`GpuModelOptions::step_batching`].
    step_batching: StepBatching,
    /// See [`GpuModelOptions::prompt_steps`].
    prompt_steps: bool,
    /// See [`GpuModelOptions::moe_by_entry`].
    moe_by_entry: bool,
    /// What batched and single steps of several sequences cost here ([`step_costs`]).
    step_costs: step_costs::StepCosts,
    /// Where prompt chunks' misses run, where they can stream or go to the CPU.
    prompt_misses: prompt_misses::PromptMisses,
    /// Prompt chunks whose misses ran on the CPU.
    cpu_prompt_chunks: u64,
    /// Of those, the ones run as a chain.
    chained_prompt_chunks: u64,
    /// See [`GpuModelOptions::rope_in_attention`].
    rope_in_attention: bool,
    /// See [`GpuModelOptions::flash_attention`].
    flash_attention: bool,
}

fn matrix(
    model: &Model,
    alloc: &Arc<Allocator>,
    up: &mut Uploader,
    m: &Matrix,
) -> Result<GpuMatrix> {
    let r = model.mat(m);
    GpuMatrix::upload(alloc, up, r.ty, r.n_in, r.n_out, r.data)
}

fn opt_vec(
    alloc: &Arc<Allocator>,
    up: &mut Uploader,
    v: &Option<Vec<f32>>,
) -> Result<Option<Buffer>> {
    v.as_deref().map(|v| upload_f32(alloc, up, v)).transpose()
}

impl GpuModel {
    pub fn config(&self) -> &Config {
        &self.config
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// How many of the model's first layers run on the CPU (a dense model over the VRAM
    /// budget); 0 when every layer is on the GPU. [`GpuModel::config`] then describes the rest.
    pub fn cpu_layers(&self) -> usize {
        self.front.as_ref().map_or(0, CpuLayers::n_layers)
    }

    /// The KV cache of the layers on the CPU ([`GpuModel::cpu_layers`]); `None` without them.
    pub fn cpu_kv_cache(&self) -> Option<&crate::engine::KvCache> {
        self.front.as_ref().map(CpuLayers::kv)
    }

    /// Whether the layers on the CPU take long prompt chunks on the GPU, through a slot of one
    /// layer's VRAM ([`GpuModelOptions::stream_prompts`]).
    pub fn streams_prompts(&self) -> bool {
        self.stream.is_some()
    }

    /// Prompt chunks whose layers on the CPU ran on the GPU through the slot, since loading.
    pub fn streamed_chunks(&self) -> u64 {
        self.streamed_chunks
    }

    /// How long the layers on the CPU ([`GpuModel::cpu_layers`]) took in the last step or
    /// prompt chunk, their hidden states' copy to the device included; `None` without them.
    pub fn last_cpu_layers_time(&self) -> Option<std::time::Duration> {
        self.front.as_ref().map(|_| self.front_time)
    }

    /// Device memory held, budget included.
    pub fn allocator(&self) -> &Arc<Allocator> {
        &self.allocator
    }

    /// The RAM tier of the CPU's experts under a RAM budget: lookups per layer (hits, misses
    /// read from the file, evictions) and the RAM its buffers take; `None` without one.
    pub fn ram_tier(&self) -> Option<(Vec<crate::stream::LayerStats>, u64)> {
        self.experts.as_ref()?.cpu.as_ref()?.ram_stats()
    }

    /// The RAM tier of the CPU's experts, shared; `None` without a RAM budget.
    pub fn ram_experts(&self) -> Option<Arc<crate::engine::RamExperts>> {
        self.experts.as_ref()?.cpu.as_ref()?.ram_experts()
    }

    /// Bytes and tiles the RAM tier's reader has read from the SSD (see
    /// [`crate::stream::TileReader::delivered`]); `None` without a RAM budget.
    pub fn ram_delivered(&self) -> Option<(u64, u64)> {
        self.experts.as_ref()?.cpu.as_ref()?.ram_delivered()
    }

    /// With misses split between the CPU and the bus, the share of a layer's misses the CPU
    /// takes now; `None` otherwise.
    pub fn split_cpu_share(&self) -> Option<f32> {
        self.split.as_ref().map(split::SplitShare::share)
    }

    /// With the CPU's layers sharing their products' rows with the GPU
    /// ([`GpuModelOptions::bus_rows`]), the share of each group of products' rows the CPU
    /// computes now; `None` otherwise.
    pub fn bus_rows_cpu_shares(
        &self,
    ) -> Option<[(crate::engine::row_help::LayerProducts, f32); 4]> {
        self.bus_rows.as_ref().map(bus_rows::BusRows::cpu_shares)
    }

    /// Where the host's time went in the last step, when it was a chain (some experts on the
    /// CPU); `None` otherwise.
    pub fn last_host_time(&self) -> Option<HostTime> {
        self.last_host_time
    }

    /// Dispatches, barriers and submissions of the last step.
    pub fn last_stats(&self) -> RecordStats {
        self.last_stats
    }

    /// The routing of every MoE layer in the last step, in layer order (empty for dense
    /// models). When the device routed them ([`GpuModel::routes_on_device`]) they are read from
    /// its log after the step, without another submission.
    pub fn last_routing(&self) -> &[LayerRouting] {
        &self.last_routing
    }

    /// Whether Q4_0 and Q8_0 products take the integer-dot-product kernels ([`GpuModelOptions::int_dot`]
    /// and the device has them).
    pub fn uses_int_dot(&self) -> bool {
        self.kernels.uses_int_dot()
    }

    /// Whether MoE layers are routed on the device, so that a step is one submission: every
    /// routed expert is in VRAM and each expert stack fits one binding. Otherwise each MoE
    /// layer's router logits are read back and routed on the host.
    pub fn routes_on_device(&self) -> bool {
        self.routes_on_device
    }

    /// Where the routed experts live: slots per layer, and the minimum budget when partial.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Where the routed experts ran since loading, per layer (`None` for dense models).
    pub fn expert_stats(&self) -> Option<ExpertStats> {
        let e = self.experts.as_ref()?;
        let per_layer = self.placement.per_layer();
        Some(ExpertStats {
            miss: e.miss,
            // The mean over the layers, for layouts that give them different counts.
            slots: per_layer.iter().sum::<usize>() / per_layer.len().max(1),
            n_expert: self.placement.n_expert,
            layers: e.stats.clone(),
        })
    }

    /// Bytes of system RAM holding every routed expert for the GPU to read its misses from
    /// ([`MoeMiss::Pcie`]), and the token embedding where it went there too; 0 otherwise.
    pub fn host_expert_bytes(&self) -> u64 {
        self.experts.as_ref().map_or(0, |e| e.host_bytes)
    }

    /// Bytes of the token embedding in system RAM (with misses over PCIe, where the output is
    /// not tied to it); 0 where it is in VRAM.
    pub fn host_embedding_bytes(&self) -> u64 {
        self.experts.as_ref().map_or(0, |e| e.embedding_bytes)
    }

    /// Checks that `tokens` fit the vocabulary and the context from the current position, and
    /// that the device is not lost: before anything of them is evaluated.
    fn check_tokens(&self, tokens: &[u32]) -> Result<()> {
        let c = &self.config;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= c.n_vocab) {
            return Err(GpuError::Unsupported(format!(
                "token {t} is outside the vocabulary of {}",
                c.n_vocab
            )));
        }
        if self.pos() + tokens.len() > self.capacity {
            return Err(GpuError::Unsupported(format!(
                "the context of {} positions is full",
                self.capacity
            )));
        }
        if self.allocator.device().is_lost() {
            return Err(GpuError::DeviceLost);
        }
        Ok(())
    }

    /// Counts `n` tokens about to be evaluated for the faults injected at a token
    /// ([`super::lost`], [`super::driver_fault`]), arming one where one of them is its token.
    fn count_for_faults(&self, n: usize) {
        let device = self.allocator.device();
        for _ in 0..n {
            if let Some(point) = super::lost::token_loses_device() {
                device.arm_loss(point);
            }
            if let Some(what) = super::driver_fault::token_refuses() {
                device.arm_refusal(what);
            }
        }
    }

    /// RoPE of `n_heads` heads of this model (QK-norm with its eps).
    fn rope_args(&self, n_heads: usize) -> RopeArgs {
        let c = &self.config;
        RopeArgs {
            layout: c.rope_layout,
            n_heads: n_heads as u32,
            head_dim: c.head_dim as u32,
            n_rot: c.n_rot as u32,
            eps: c.rms_eps,
        }
    }

    /// This model's attention over its KV cache.
    fn attention_args(&self) -> AttentionArgs {
        let c = &self.config;
        AttentionArgs {
            n_heads: c.n_head as u32,
            n_kv_heads: c.n_head_kv as u32,
            head_dim: c.head_dim as u32,
            capacity: self.capacity as u32,
        }
    }

    /// Word `index` of the step buffer: 0 the token id, 1 its position (2 its sequence's first
    /// KV-cache row, 3 to 5 the attention's grid).
    fn step_word(&self, index: u32) -> StepWord<'_> {
        StepWord {
            buffer: &self.act.step,
            index,
        }
    }

    /// The indices of the MoE layers, in order.
    fn moe_layer_indices(&self) -> Vec<usize> {
        (0..self.layers.len())
            .filter(|&il| matches!(self.layers[il].ffn, GpuFfn::Moe(_)))
            .collect()
    }

    fn moe_layer(&self, il: usize) -> &GpuMoe {
        match &self.layers[il].ffn {
            GpuFfn::Moe(m) => m,
            GpuFfn::Dense { .. } => unreachable!("layer {il} is dense"),
        }
    }

    fn moe_scratch(&self) -> &MoeScratch {
        self.act
            .moe
            .as_ref()
            .expect("a model with MoE layers has MoE scratch")
    }
}
