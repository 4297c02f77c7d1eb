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
mod chained;
mod gate_up;
mod load;
mod prefill;
mod profile;
mod promote;
mod step_costs;
mod stream;
mod stream_experts;

pub use batch::MAX_STEP_TOKENS;
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
use super::ops_attention::Unroped;
use super::placement::{plan, ExpertLayout, MinimumBudget, MoeMiss, Placement};
use super::record::{Kernels, RecordStats, Recorder};
use super::replay::Replay;
use super::upload::Uploader;
use crate::engine::routing::RoutedExpert;
use crate::model::{Config, Ffn, Matrix, Model};
use crate::stream::{open_expert_cache, ReplacementPolicy};

/// Settings of a [`GpuModel`].
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
    /// releases layer by layer ([`chained`]); `false`: one submission and fence wait per part,
    /// for comparisons.
    pub chain: bool,
    /// Record a step that is one submission (a dense model, or every expert in VRAM) once and
    /// submit that recording for every token ([`super::replay`]); `false`: record each step
    /// anew, for comparisons.
    pub replay: bool,
    /// Multiply prompts' chunks in the device's matrix units where it has cooperative matrices;
    /// `false`: the f32 kernel, for comparisons.
    pub coopmat: bool,
    /// Multiply Q4_0 and Q8_0 weights with integer dot products where the device has them, the inputs
    /// quantized to 8 bits as the CPU engine quantizes them, so that the logits follow the CPU
    /// engine's (and llama.cpp's) more closely; `false`: f32 dots, for comparisons. Where the
    /// device emulates them ([`Device::integer_dot_product_accelerated`]: lavapipe) they are
    /// slower than f32 dots, and still used.
    pub int_dot: bool,
    /// With `int_dot`, quantize a product's inputs once into a scratch buffer that every
    /// product reading them shares ([`crate::gpu::Kernels::set_q8_scratch`]) rather than in
    /// each of its workgroups; `false`: in the product, for comparisons.
    pub q8_inputs: bool,
    /// Do a decode step's QK-norm, RoPE and KV-cache append in the attention's dispatch
    /// ([`Recorder::attention_rope`]): one dependent dispatch fewer a layer; `false`: a RoPE
    /// dispatch, then attention, for comparisons.
    pub rope_in_attention: bool,
    /// A dense model's layers on the CPU (over the VRAM budget) take prompt chunks of at least
    /// [`STREAM_MIN_TOKENS`] tokens on the GPU, in turn through a slot of one layer's VRAM
    /// ([`stream`]): the budget then holds one resident layer fewer. A MoE model over its
    /// budget runs a prompt chunk's missing experts on the GPU through a few slots they take in
    /// turn ([`stream_experts`]), for fewer resident experts. `false`: prompts run those layers
    /// on the CPU, and a MoE model's prompts go token by token.
    pub stream_prompts: bool,
    /// With `stream_prompts`, how many experts a MoE model's prompt takes through VRAM at a
    /// time; 0: as many as 64 MiB holds.
    pub prompt_expert_slots: usize,
    /// With misses on the CPU, bring the experts used most into VRAM slots between steps in
    /// place of residents used less ([`promote`]); `false`: the slots keep the experts they
    /// were loaded with, for comparisons.
    pub promote_experts: bool,
    /// Take a prompt chunk's attention in the flash-attention kernel
    /// ([`Recorder::attention_prefill`]) where its heads fit it; `false`: the decode kernel over
    /// the chunk's tokens, for comparisons.
    pub flash_attention: bool,
    /// The prompts' cooperative-matrix product tile; `None`: the tuned one
    /// ([`crate::gpu::MatMulTile::TUNED`], or shallower where shared memory is short).
    pub matmul_tile: Option<crate::gpu::MatMulTile>,
    /// Sequences the KV cache holds, each of `context` positions, for decode steps that take
    /// one token of several at once ([`GpuModel::eval_batch`]); 0 or 1: one. A dense model
    /// with its first layers on the CPU holds one whatever this says.
    pub sequences: usize,
    /// Products over at most this many tokens (a batched decode step, a short prompt) take the
    /// several-column matrix-vector kernel, which reads each weight once for all of them
    /// ([`crate::gpu::Kernels::set_matvec_cols`]); 0: the tiled kernel, for comparisons.
    pub matvec_cols: usize,
    /// Whether a decode step of several sequences runs batched or a sequence at a time,
    /// whichever is measured cheaper ([`step_costs`]), or batched wherever the model can.
    pub step_batching: StepBatching,
}

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
            replay: true,
            coopmat: true,
            int_dot: true,
            q8_inputs: true,
            rope_in_attention: true,
            flash_attention: true,
            stream_prompts: true,
            prompt_expert_slots: 0,
            promote_experts: true,
            matmul_tile: None,
            sequences: 1,
            matvec_cols: crate::gpu::ops_batch::MAX_MATVEC_COLS as usize,
            step_batching: StepBatching::Measured,
        }
    }
}

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
    /// ([`StepWord`]).
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
    last_stats: RecordStats,
    last_routing: Vec<LayerRouting>,
    placement: Placement,
    /// Present for MoE models.
    experts: Option<Experts>,
    /// MoE layers are routed on the device: the step is one submission.
    routes_on_device: bool,
    /// Some routed experts run on the CPU and the step is a chain ([`chained`]).
    chained: bool,
    last_host_time: Option<HostTime>,
    /// Present while profiling ([`GpuModel::set_profiling`]).
    profiler: Option<profile::StepQueries>,
    /// Steps are one submission and are replayed from one recording ([`super::replay`]).
    replays: bool,
    /// The recording, made at the first step that uses it.
    replay: Option<Replay>,
    last_profile: Option<GpuStepProfile>,
    /// A prompt chunk's activations, made at the first prompt ([`prefill`]).
    batch: Option<prefill::Batch>,
    /// The VRAM budget refused the memory for `batch`: prompts go token by token.
    batch_refused: bool,
    /// See [`GpuModelOptions::step_batching`].
    step_batching: StepBatching,
    /// What batched and single steps of several sequences cost here ([`step_costs`]).
    step_costs: step_costs::StepCosts,
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

    /// Bytes and tiles the RAM tier's reader has read from the SSD (see
    /// [`crate::stream::TileReader::delivered`]); `None` without a RAM budget.
    pub fn ram_delivered(&self) -> Option<(u64, u64)> {
        self.experts.as_ref()?.cpu.as_ref()?.ram_delivered()
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

    /// Evaluates `token` at the next position; the logits of the token after it.
    pub fn eval(&mut self, token: u32) -> Result<Vec<f32>> {
        self.eval_from(token, None)
    }

    /// [`GpuModel::eval`]; with the first layers on the CPU, `hidden` is their output for
    /// `token` when the caller ran them already (a prompt's tokens at once), else they run now.
    fn eval_from(&mut self, token: u32, hidden: Option<&[f32]>) -> Result<Vec<f32>> {
        self.check_tokens(&[token])?;
        let started = Instant::now();
        self.count_for_loss(1);
        let row = match (self.front.as_mut(), hidden) {
            (Some(_), Some(x)) => {
                self.input_rows.buffer.write_f32(x);
                0
            }
            (Some(front), None) => {
                let t = Instant::now();
                let x = front.run(&[token], self.positions[self.seq])?;
                self.input_rows.buffer.write_f32(&x);
                self.front_time = t.elapsed();
                0
            }
            (None, _) => token,
        };
        let mut step = row.to_le_bytes().to_vec();
        step.extend_from_slice(&(self.pos() as u32).to_le_bytes());
        step.extend_from_slice(&self.seq_row(self.seq).to_le_bytes());
        self.act.step.write(&step);
        let profiling = self.profiler.is_some();
        if profiling {
            self.profile_before();
        }
        let replaying = self.replays && !profiling;
        if replaying {
            // Copies from system RAM go ahead of the step, in its submission.
            self.flush_staged_promotions()?;
        } else if !self.chained {
            self.flush_promotions()?;
        }
        self.write_slot_map();
        let (logits, host) = if replaying {
            (self.eval_replay()?, None)
        } else if self.chained {
            let logits = self.eval_chained()?;
            (logits, self.last_host_time)
        } else {
            let logits = self.eval_parts()?;
            (logits, self.last_host_time)
        };
        let host = match self.front {
            Some(_) => Some(HostTime {
                cpu_layers_ns: self.front_time.as_nanos() as u64,
                ..host.unwrap_or_default()
            }),
            None => host,
        };
        if profiling {
            self.profile_after(host)?;
        }
        self.positions[self.seq] += 1;
        self.promote_experts(started.elapsed())?;
        Ok(logits)
    }

    /// [`GpuModel::eval`] of a step that is one submission, from its recording (made now the
    /// first time).
    fn eval_replay(&mut self) -> Result<Vec<f32>> {
        if self.replay.is_none() {
            let mut paused_at = None;
            let replay = self
                .kernels
                .record_replay(|rec| self.record_part(rec, &Resume::Start, &mut paused_at))?;
            debug_assert!(paused_at.is_none(), "a replayed step is one submission");
            self.replay = Some(replay);
        }
        let copies = self.host_copies_recording()?;
        let replay = self.replay.as_ref().expect("recorded above");
        replay.run_after(copies.as_ref())?;
        self.last_stats = replay.stats();
        self.last_routing = if self.routes_on_device {
            self.device_routings()
        } else {
            Vec::new()
        };
        self.last_host_time = None;
        Ok(self.act.logits.read_f32(self.config.n_vocab))
    }

    /// [`GpuModel::eval`] as one submission per part: from the start or a MoE layer's experts
    /// to the next MoE router on the host, or to the logits.
    fn eval_parts(&mut self) -> Result<Vec<f32>> {
        let mut stats = RecordStats::default();
        let mut routings: Vec<LayerRouting> = Vec::new();
        let mut resume = Resume::Start;
        let mut time = HostTime::default();
        let (start, mut cpu_ran) = (Instant::now(), false);
        loop {
            let mut paused_at = None;
            let cpu_job = match &resume {
                Resume::Experts { layer, cpu, xn, .. } if !cpu.is_empty() => {
                    Some((*layer, cpu.as_slice(), xn.as_slice()))
                }
                _ => None,
            };
            let cpu = self.experts.as_ref().and_then(|e| e.cpu.as_ref());
            cpu_ran |= cpu_job.is_some();
            // The CPU's experts run between this part's submission and its completion.
            let (part_start, mut cpu_ns) = (Instant::now(), 0);
            let (part, cpu_sum) = self.kernels.record_overlapped(
                |rec| self.record_part(rec, &resume, &mut paused_at),
                || {
                    cpu_job.map(|(layer, experts, xn)| {
                        let cpu = cpu.expect("a partial placement has CPU experts");
                        let t = Instant::now();
                        let sum = cpu.weighted_sum(layer, xn, experts);
                        cpu_ns = t.elapsed().as_nanos() as u64;
                        sum
                    })
                },
            )?;
            time.cpu_experts_ns += cpu_ns;
            time.wait_ns += (part_start.elapsed().as_nanos() as u64).saturating_sub(cpu_ns);
            let cpu_sum = cpu_sum.transpose()?;
            stats.dispatches += part.dispatches;
            stats.barriers += part.barriers;
            stats.submits += part.submits;
            if let Some(sum) = cpu_sum {
                let Resume::Experts { layer, .. } = resume else {
                    unreachable!("CPU experts run after a routing")
                };
                let scratch = self.act.moe.as_mut().expect("MoE scratch");
                scratch.cpu_sum.write_f32(&sum);
                resume = Resume::CpuSum { layer };
                continue;
            }
            let Some(il) = paused_at else { break };
            let cfg = self
                .config
                .moe
                .as_ref()
                .expect("MoE layers have a MoE config");
            let routing = self.moe_layer(il).route(il, cfg, self.moe_scratch());
            resume = self.place_experts(&routing)?;
            routings.push(routing);
        }
        if self.routes_on_device {
            routings = self.device_routings();
        }
        self.last_stats = stats;
        self.last_routing = routings;
        time.step_ns = start.elapsed().as_nanos() as u64;
        self.last_host_time = cpu_ran.then_some(time);
        Ok(self.act.logits.read_f32(self.config.n_vocab))
    }

    /// Records one command buffer of a step: from `resume` to the next MoE router (setting
    /// `paused_at` to its layer) or to the logits.
    fn record_part(
        &self,
        rec: &mut Recorder<'_>,
        resume: &Resume,
        paused_at: &mut Option<usize>,
    ) -> Result<()> {
        let c = &self.config;
        let (a, e) = (&self.act, c.n_embd as u32);
        let from = match resume {
            Resume::Start => {
                self.record_embedding(rec)?;
                0
            }
            Resume::Experts {
                layer,
                gpu,
                cpu,
                shared_gate,
                ..
            } => {
                rec.after_earlier_submissions();
                let moe = self.moe_layer(*layer);
                moe.record_experts(rec, gpu, *shared_gate, (&a.xn, &a.x), self.moe_scratch())?;
                if !cpu.is_empty() {
                    return Ok(());
                }
                layer + 1
            }
            Resume::CpuSum { layer } => {
                rec.after_earlier_submissions();
                rec.scale_add(&a.x, &self.moe_scratch().cpu_sum, 1.0, e)?;
                layer + 1
            }
        };
        self.record_from(rec, from, paused_at)
    }

    /// Records layers `from..` up to the next MoE router on the host (setting `paused_at` to
    /// its layer), or to the logits.
    fn record_from(
        &self,
        rec: &mut Recorder<'_>,
        from: usize,
        paused_at: &mut Option<usize>,
    ) -> Result<()> {
        let c = &self.config;
        let (a, e, eps) = (&self.act, c.n_embd as u32, c.rms_eps);
        for (il, l) in self.layers.iter().enumerate().skip(from) {
            self.mark(rec, profile::attention(il));
            self.record_attention(rec, l)?;
            self.mark(rec, profile::ffn(il));
            let norm_fused = match &l.ffn {
                GpuFfn::Dense { gate_up, .. } => matches!(gate_up, GateUp::Stacked(_)),
                GpuFfn::Moe(_) => self.routes_on_device,
            };
            if !norm_fused {
                rec.rms_norm(&a.x, &l.ffn_norm, &a.xn, e, 1, eps)?;
            }
            match &l.ffn {
                GpuFfn::Dense {
                    gate_up: GateUp::Stacked(gate_up),
                    down,
                } => {
                    // RMSNorm, gate, up and SwiGLU in one dispatch.
                    let fused = Fused {
                        norm: Some((&l.ffn_norm, eps)),
                        glu: true,
                        ..Fused::default()
                    };
                    rec.matvec_fused(gate_up, &a.x, &a.gate, fused)?;
                    rec.matvec_add(down, &a.gate, &a.x)?;
                }
                GpuFfn::Dense {
                    gate_up: GateUp::Apart { gate, up },
                    down,
                } => {
                    rec.matvec(gate, &a.xn, &a.gate)?;
                    rec.matvec(up, &a.xn, &a.up)?;
                    rec.swiglu(&a.gate, &a.up, gate.n_out as u32)?;
                    rec.matvec_add(down, &a.gate, &a.x)?;
                }
                GpuFfn::Moe(moe) if self.routes_on_device => {
                    let cfg = c.moe.as_ref().expect("MoE layers have a MoE config");
                    let io = (&a.x, (&l.ffn_norm, eps), &a.xn);
                    moe.record_routed(rec, (il, cfg), io, self.moe_scratch())?;
                }
                GpuFfn::Moe(moe) => {
                    let s = self.moe_scratch();
                    if self.placement.is_partial() {
                        // The same norm again, into memory the CPU experts read.
                        rec.rms_norm(&a.x, &l.ffn_norm, &s.xn_host, e, 1, eps)?;
                    }
                    moe.record_router(rec, &a.xn, s)?;
                    *paused_at = Some(il);
                    return Ok(());
                }
            }
        }
        let group = profile::head(self.layers.len());
        self.mark(rec, group);
        let head = self.output.as_ref().unwrap_or(&self.input_rows);
        let normed = Fused {
            norm: Some((&self.output_norm, eps)),
            ..Fused::default()
        };
        rec.matvec_fused(head, &a.x, &a.logits, normed)?;
        self.mark_end(rec);
        Ok(())
    }

    /// The token's embedding row into `x`: the first thing a step records (after resetting
    /// the profile's queries when profiling).
    fn record_embedding(&self, rec: &mut Recorder<'_>) -> Result<()> {
        self.mark_start(rec);
        rec.get_rows(&self.input_rows, self.step_word(0), &self.act.x)?;
        Ok(())
    }

    /// The routings the device logged in the last step, counted as hits of resident experts.
    fn device_routings(&mut self) -> Vec<LayerRouting> {
        let cfg = self.config.moe.expect("MoE layers have a MoE config");
        let log = self.moe_scratch().read_log(&cfg, self.config.n_layer);
        let per_layer = super::ops::route_log_floats(cfg.n_expert, cfg.n_expert_used);
        let routings: Vec<LayerRouting> = self
            .layers
            .iter()
            .enumerate()
            .filter_map(|(il, l)| match &l.ffn {
                GpuFfn::Moe(m) => Some(m.logged_routing(il, &cfg, &log[il * per_layer..])),
                GpuFfn::Dense { .. } => None,
            })
            .collect();
        let ex = self
            .experts
            .as_mut()
            .expect("MoE models track their experts");
        for r in &routings {
            let slots = ex.slots[r.layer].as_mut().expect("a MoE layer has slots");
            let token = slots.place(&r.experts, ex.miss, &mut ex.stats[r.layer]);
            debug_assert!(
                token.cpu.is_empty() && token.fetch.is_empty(),
                "all resident"
            );
        }
        routings
    }

    /// Writes the slots of every MoE layer to the device's slot map where the GPU reads misses
    /// from system RAM and they changed (at load, and after promotions): before a step, once
    /// the copies into the slots are done.
    fn write_slot_map(&mut self) {
        let (Some(ex), Some(scratch)) = (self.experts.as_mut(), self.act.moe.as_mut()) else {
            return;
        };
        if !ex.map_stale || ex.host_bytes == 0 {
            return;
        }
        for (il, slots) in ex.slots.iter().enumerate() {
            if let Some(slots) = slots {
                scratch.write_slot_map(il, slots.slot_table());
            }
        }
        ex.map_stale = false;
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

    /// Where `routing`'s experts run: slots, fetches (copied here, before the GPU part is
    /// recorded) and the CPU; counted per layer.
    fn place_experts(&mut self, routing: &LayerRouting) -> Result<Resume> {
        let il = routing.layer;
        let GpuModel {
            experts,
            layers,
            model,
            act,
            config,
            ..
        } = self;
        let ex = experts.as_mut().expect("MoE models track their experts");
        let stats = &mut ex.stats[il];
        let slots = ex.slots[il].as_mut().expect("a MoE layer has slots");
        let token = slots.place(&routing.experts, ex.miss, stats);
        if !token.fetch.is_empty() {
            let (GpuFfn::Moe(moe), Ffn::Moe(weights)) = (&layers[il].ffn, &model.layers[il].ffn)
            else {
                unreachable!("layer {il} is MoE");
            };
            let up = ex.uploader.as_mut().expect("fetching keeps an uploader");
            for &(slot, expert) in &token.fetch {
                stats.bytes_uploaded += moe.fill_slot(model, weights, up, slot, expert)?;
            }
            up.flush()?;
        }
        let xn = if token.cpu.is_empty() {
            Vec::new()
        } else {
            let s = act.moe.as_ref().expect("MoE scratch");
            s.xn_host.read_f32(config.n_embd)
        };
        Ok(Resume::Experts {
            layer: il,
            gpu: token.gpu,
            cpu: token.cpu,
            shared_gate: routing.shared_gate,
            xn,
        })
    }

    /// Attention of layer `l` at the current position, its output added to `x`.
    fn record_attention(&self, rec: &mut Recorder<'_>, l: &GpuLayer) -> Result<()> {
        let (c, a) = (&self.config, &self.act);
        let pos = self.step_word(1);
        let (qw, kvw) = (c.q_width() as u32, c.kv_width() as u32);
        let eps = c.rms_eps;
        let rope = |n_heads| self.rope_args(n_heads);
        let attn_args = self.attention_args();
        // The attention norm is done by each of the three products on its own.
        let normed = Fused {
            norm: Some((&l.attn_norm, eps)),
            ..Fused::default()
        };
        rec.matvec_fused(&l.wq, &a.x, &a.q, normed)?;
        rec.matvec_fused(&l.wk, &a.x, &a.k, normed)?;
        rec.matvec_fused(&l.wv, &a.x, &a.v, normed)?;
        for (x, b, n) in [(&a.q, &l.bq, qw), (&a.k, &l.bk, kvw), (&a.v, &l.bv, kvw)] {
            if let Some(b) = b {
                rec.add(x, b, n)?;
            }
        }
        let caches = (&l.k_cache, &l.v_cache);
        let scratch = (&a.scores, &a.attn_done);
        // The fused kernel takes a QK-norm of both Q and K or of neither (as every supported
        // architecture has it); anything else takes the separate RoPE dispatch.
        if self.rope_in_attention && l.q_norm.is_some() == l.k_norm.is_some() {
            let new = Unroped {
                q: &a.q,
                k: &a.k,
                v: &a.v,
                qk_norm: l.q_norm.as_ref().zip(l.k_norm.as_ref()),
            };
            let rope_q = (&self.rope, rope(c.n_head));
            rec.attention_rope(new, rope_q, caches, scratch, &a.attn, attn_args, pos)?;
        } else {
            rec.rope(&a.q, l.q_norm.as_ref(), &self.rope, rope(c.n_head), pos)?;
            // K's RoPE goes straight into the cache, with V beside it.
            let (k_norm, k_rope) = (l.k_norm.as_ref(), rope(c.n_head_kv));
            rec.rope_store((&a.k, &a.v), k_norm, &self.rope, k_rope, pos, caches)?;
            rec.attention(&a.q, caches, scratch, &a.attn, attn_args, pos)?;
        }
        rec.matvec_add(&l.wo, &a.attn, &a.x)
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

    /// Counts `n` tokens about to be evaluated for the device-loss injection
    /// ([`super::lost`]), arming the loss where one of them is the chosen token.
    fn count_for_loss(&self, n: usize) {
        for _ in 0..n {
            if let Some(point) = super::lost::token_loses_device() {
                self.allocator.device().arm_loss(point);
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
    /// KV-cache row).
    fn step_word(&self, index: u32) -> StepWord<'_> {
        StepWord {
            buffer: &self.act.step,
            index,
        }
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
