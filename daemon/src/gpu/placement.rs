//! Where a model's weights live when the whole model does not fit the VRAM budget.
//!
//! A dense model runs its first layers on the CPU and the rest on the GPU: as many of the last
//! layers as the budget holds go to VRAM with the output head (read every token, and the
//! largest matrix of small models), and the CPU's layers hand each token's hidden state over
//! once ([`Placement::cpu_layers`]). Where the budget also holds a slot of one layer and a
//! prompt chunk's activations ([`Placement::stream_slot`]), the CPU's layers take long prompt
//! chunks on the GPU through it (`gpu::forward::stream`), for one or more resident layers
//! fewer. The smallest budget is one layer on the GPU.
//!
//! Everything but the routed experts goes to VRAM first: attention, norms, routers, embeddings
//! and output, Qwen2-MoE's shared experts, the KV cache and the scratch. What the budget leaves
//! becomes expert slots: the same number in every MoE layer, each holding one whole expert (its
//! gate, up and down rows), slot `i` holding expert `i` at load. A routed expert found in a slot
//! runs on the GPU; a miss runs on the CPU ([`MoeMiss::Cpu`], the default: for one token at
//! decode, the CPU's pass over the expert's bytes in RAM costs less than copying them over
//! PCIe) or is fetched into a slot the cache policy gives up ([`MoeMiss::Fetch`]), or is read
//! by the GPU over the bus from a copy of every expert in system RAM ([`MoeMiss::Pcie`]).
//!
//! The smallest budget that runs a MoE model ([`MinimumBudget`]) is its non-expert weights, KV
//! cache and scratch, one expert slot per MoE layer, the upload staging where it counts against
//! the budget, and a margin for the driver's alignment of each buffer.
//!
//! Where a few slots for the experts not resident and a prompt chunk's activations take at
//! most a quarter of the room the budget leaves for experts ([`Placement::stream_slot`] with
//! [`Placement::prompt_expert_slots`]), a prompt chunk runs its missing experts on the GPU
//! through them (`gpu::forward::stream_experts`), each once per chunk, for fewer resident
//! experts. (A fixed share, not the scheduler's predicted gain and loss; with
//! `GpuModelOptions::prompt_expert_slots` given, any share that fits.)
//!
//! The budget's slots are spread over the MoE layers by an [`ExpertLayout`]: evenly (the
//! default), by whole layers as llama.cpp's `--n-cpu-moe` does, one per layer, or as the
//! scheduler's plan gives them (`--expert-layout planned`).
//!
//! Partial: the CPU-or-fetch choice is the `--moe-miss` switch, not the plan's; the initial
//! residents of a layer with `s` slots are experts `0..s`, not the most used (the planner has
//! no routing statistics to choose by; the slots then follow demand, `forward::promote`); a dense model's CPU layers go through VRAM (the stream
//! slot) for prompt chunks only, never for decode steps, and the split is the budget's, not
//! the scheduler's predictors'.

use std::fmt;
use std::str::FromStr;

use super::error::{GpuError, Result};
use super::footprint::{
    expert_stream_bytes, moe_chunk_bytes, split_bytes, stream_slot_bytes, DeviceBytes,
};
use super::forward::{experts_streamable, prompt_expert_slots, streamable};
use crate::model::{Ffn, Model, MoeWeights};

/// What happens to a routed expert that is not in a VRAM slot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MoeMiss {
    /// Chosen from the bus, the RAM left and the share of the experts the VRAM budget holds
    /// ([`MoeMiss::resolve`]): [`MoeMiss::Pcie`] where the GPU reads system RAM over a bus and
    /// the slots are not too few, [`MoeMiss::Split`] (one sequence) or [`MoeMiss::Cpu`] where
    /// they are, [`MoeMiss::Cpu`] without a bus or the RAM for the bus's copy of the experts
    /// (`bench/RESULTS.md`).
    #[default]
    Auto,
    /// Computed on the CPU from the memory-mapped file while the GPU runs the resident ones.
    Cpu,
    /// Copied into a slot (evicting by the cache policy), then run on the GPU.
    Fetch,
    /// Run on the GPU from system RAM: every routed expert is also kept there, in memory the
    /// GPU reads over the bus, and a step's experts without a slot are read from it by the
    /// same dispatches as the resident ones. The step stays one submission, routed on the
    /// device, with no host turn between layers.
    Pcie,
    /// Both at once: every routed expert is also in system RAM for the GPU, the step is a
    /// chain routed on the host ([`Cpu`](MoeMiss::Cpu)'s), and each layer's misses are shared
    /// between the CPU (from the memory map) and the GPU (over the bus), in the proportion
    /// measured to give the fastest steps (`gpu::forward::split`). Single decode steps only:
    /// a model under it takes one sequence at a time.
    Split,
}

impl MoeMiss {
    /// The policy [`MoeMiss::Auto`] stands for (others are themselves), from what `at` says
    /// of the device, the model and the memory left:
    /// - No bus, or not RAM enough for a copy of every routed expert within the RAM budget
    ///   and half the headroom (the model file's pages and everything else want the rest):
    ///   [`MoeMiss::Cpu`].
    /// - Slots for under [`FEW_SLOTS`] of the routed experts: nearly every expert a token
    ///   chooses misses, and the bus alone is the slowest way to take them where the CPU's
    ///   memory reads faster than the bus carries (on the H100 machines, 25 GB/s over the bus
    ///   against 50-85 from the CPU's memory). [`MoeMiss::Split`] shares them and measures
    ///   the share; it takes one sequence at a time, so with more, [`MoeMiss::Cpu`].
    /// - Otherwise [`MoeMiss::Pcie`]: with many hits the step stays one submission, with no
    ///   host turn between layers (2.8-2.9x llama.cpp at 3.5 and 8 GiB on an H100).
    pub fn resolve(self, at: &MissContext) -> MoeMiss {
        if self != MoeMiss::Auto {
            return self;
        }
        if !at.bus_fits() {
            MoeMiss::Cpu
        } else if at.coverage.is_some_and(|c| c < FEW_SLOTS) {
            match at.sequences {
                0 | 1 => MoeMiss::Split,
                _ => MoeMiss::Cpu,
            }
        } else {
            MoeMiss::Pcie
        }
    }

    /// Where [`MoeMiss::Auto`] resolved to `self` and loading failed with `error`, the policy to
    /// load with instead, if any:
    /// - `split` the device cannot run (no chained steps, or experts it cannot read over the
    ///   bus): `pcie`, which needs no chain (and falls back in turn);
    /// - `pcie` the device cannot run: the CPU;
    /// - the CPU's placement over the budget where the bus may take the misses (`bus_fits`,
    ///   [`MissContext::bus_fits`]): `pcie`, whose placement keeps the embedding in system
    ///   RAM too. (`split`'s placement is `pcie`'s: over the budget, both are.)
    pub fn auto_fallback(self, error: &GpuError, bus_fits: bool) -> Option<MoeMiss> {
        match (self, error) {
            (MoeMiss::Split, GpuError::Unsupported(_)) => Some(MoeMiss::Pcie),
            (MoeMiss::Pcie, GpuError::Unsupported(_)) => Some(MoeMiss::Cpu),
            (MoeMiss::Cpu, GpuError::BelowMinimumBudget { .. }) if bus_fits => Some(MoeMiss::Pcie),
            _ => None,
        }
    }
}

/// The share of a model's routed experts under which VRAM slots are too few for `auto` to
/// read the misses over the bus alone ([`MoeMiss::resolve`]). The 30B shape's 1 GiB budget
/// holds about 1% of its experts, 3.5 GiB about 17%.
pub const FEW_SLOTS: f64 = 1.0 / 16.0;

/// What [`MoeMiss::resolve`] weighs.
#[derive(Debug, Clone, Copy, Default)]
pub struct MissContext {
    /// Whether the device reads host-visible memory apart from its own (a discrete GPU).
    pub bus: bool,
    /// Bytes of every routed expert.
    pub experts: u64,
    /// The user's ceiling on the RAM the experts take.
    pub ram_budget: Option<u64>,
    /// The RAM the process may still take (cgroup and machine), where known.
    pub headroom: Option<u64>,
    /// The share of the routed experts' bytes the VRAM budget holds beside everything else
    /// the model keeps there, where a budget is known.
    pub coverage: Option<f64>,
    /// Sequences a step may take.
    pub sequences: usize,
}

impl MissContext {
    /// Whether misses may be read over the bus: there is one, and the RAM budget and half the
    /// headroom hold a copy of every routed expert.
    pub fn bus_fits(&self) -> bool {
        let room = self
            .ram_budget
            .unwrap_or(u64::MAX)
            .min(self.headroom.map_or(0, |h| h / 2));
        self.bus && self.experts <= room
    }
}

impl FromStr for MoeMiss {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(MoeMiss::Auto),
            "cpu" => Ok(MoeMiss::Cpu),
            "fetch" => Ok(MoeMiss::Fetch),
            "pcie" => Ok(MoeMiss::Pcie),
            "split" => Ok(MoeMiss::Split),
            _ => Err(format!(
                "`{s}` is not a miss policy: use cpu, fetch, pcie or split"
            )),
        }
    }
}

impl fmt::Display for MoeMiss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MoeMiss::Auto => "auto",
            MoeMiss::Cpu => "cpu",
            MoeMiss::Fetch => "fetch",
            MoeMiss::Pcie => "pcie",
            MoeMiss::Split => "split",
        })
    }
}

/// How a MoE model's expert slots are spread over its MoE layers when not every routed expert
/// fits the budget. Every layout keeps at least one slot in every MoE layer and holds no more
/// slots in all than [`ExpertLayout::Even`] does under the same budget.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ExpertLayout {
    /// The same number of slots in every MoE layer.
    #[default]
    Even,
    /// Whole layers' experts in VRAM, from the last layer back, the other layers one slot each:
    /// the layer split of llama.cpp's `--n-cpu-moe`.
    Layers,
    /// One slot per layer: nearly every routed expert on the CPU, the budget left unused.
    Cpu,
    /// Slots per MoE layer as given (the scheduler's plan), in layer order, scaled down to the
    /// slots the budget holds when they add up to more.
    Given(Vec<usize>),
}

impl FromStr for ExpertLayout {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "even" => Ok(ExpertLayout::Even),
            "layers" => Ok(ExpertLayout::Layers),
            "cpu" => Ok(ExpertLayout::Cpu),
            _ => Err(format!(
                "`{s}` is not an expert layout: use even, layers or cpu"
            )),
        }
    }
}

/// Upload staging while everything fits: big batches load fastest.
pub(super) const FULL_STAGING_BYTES: u64 = 16 << 20;

/// Bytes of one routed expert in each of a layer's three stacks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ExpertShape {
    pub gate: u64,
    pub up: u64,
    pub down: u64,
    pub n_expert: usize,
    pub moe_layers: usize,
}

impl ExpertShape {
    /// The largest of `model`'s MoE layers (they are all alike in the architectures we read);
    /// `None` for a dense model.
    pub fn of(model: &Model) -> Option<ExpertShape> {
        let bytes = |m: &MoeWeights| {
            let b = |w| model.expert(w, 0).data.len() as u64;
            (b(&m.gate), b(&m.up), b(&m.down), m.gate.n_mat)
        };
        let mut shape: Option<ExpertShape> = None;
        for l in &model.layers {
            let Ffn::Moe(m) = &l.ffn else { continue };
            let (gate, up, down, n) = bytes(m);
            let s = shape.get_or_insert(ExpertShape {
                gate,
                up,
                down,
                n_expert: n,
                moe_layers: 0,
            });
            s.gate = s.gate.max(gate);
            s.up = s.up.max(up);
            s.down = s.down.max(down);
            s.n_expert = s.n_expert.max(n);
            s.moe_layers += 1;
        }
        shape
    }

    pub fn expert_bytes(&self) -> u64 {
        self.gate + self.up + self.down
    }

    /// Device memory of `slots` slots in every MoE layer, as the stacks' buffers round it.
    pub fn slot_bytes(&self, slots: usize) -> u64 {
        let n = slots as u64;
        let stack = |b: u64| (n * b).max(4).next_multiple_of(4);
        self.moe_layers as u64 * (stack(self.gate) + stack(self.up) + stack(self.down))
    }

    /// Staging for loading and for fetching one expert at a time: one expert's bytes, at least
    /// 256 KiB (fewer submissions while loading) and at most the full staging.
    pub fn staging_bytes(&self) -> u64 {
        self.staging_bytes_for(1)
    }

    /// Staging for copying `experts` experts at once (a prompt's expert slots,
    /// `gpu::forward::stream_experts`), within the same bounds.
    pub fn staging_bytes_for(&self, experts: usize) -> u64 {
        (experts as u64 * self.expert_bytes())
            .next_multiple_of(4)
            .clamp(256 << 10, FULL_STAGING_BYTES)
    }
}

/// The smallest VRAM budget that runs a model, by what it holds: for a MoE model one expert
/// slot per layer, for a dense one its last layer (the others on the CPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MinimumBudget {
    /// Weights other than routed experts: attention, norms, routers, embeddings and output,
    /// shared experts, the RoPE table (for a dense model: its last layer's, the output's and
    /// the RoPE table).
    pub non_expert: u64,
    pub kv_cache: u64,
    pub activations: u64,
    /// One expert slot in every MoE layer.
    pub one_slot_per_layer: u64,
    /// Upload staging, where host-visible memory counts against the budget (0 elsewhere).
    pub staging: u64,
    /// For the driver's alignment of each buffer.
    pub margin: u64,
}

impl MinimumBudget {
    pub fn total(&self) -> u64 {
        self.non_expert
            + self.kv_cache
            + self.activations
            + self.one_slot_per_layer
            + self.staging
            + self.margin
    }
}

/// Where a model's routed experts go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// Expert slots per MoE layer the budget holds when spread evenly: `n_expert` when all
    /// are resident (0 for dense models). [`Placement::slots_of`] gives a layer's own count.
    pub slots: usize,
    pub n_expert: usize,
    /// How the slots are spread over the MoE layers.
    pub layout: ExpertLayout,
    /// The model's MoE layers, by index.
    pub moe_layers: Vec<usize>,
    /// Staging for uploads, kept after loading when experts are fetched.
    pub staging_bytes: u64,
    /// Set when not every expert (or layer) is resident.
    pub minimum: Option<MinimumBudget>,
    /// A dense model's first layers that run on the CPU (0: every layer on the GPU).
    pub cpu_layers: usize,
    /// Prompt chunks take what is not in VRAM through slots of it: a dense model's CPU
    /// layers, in turn through a slot of one layer (`gpu::forward::stream`); a MoE model's
    /// missing experts, a group at a time through [`Placement::prompt_expert_slots`] slots
    /// (`gpu::forward::stream_experts`).
    pub stream_slot: bool,
    /// With `stream_slot`, the slots for a MoE model's missing experts (0 otherwise).
    pub prompt_expert_slots: usize,
}

impl Placement {
    /// Whether some routed experts are not in VRAM.
    pub fn is_partial(&self) -> bool {
        self.slots < self.n_expert
    }

    /// Whether a decode step can take one token of several sequences in one pass with this
    /// placement ([`crate::gpu::forward::GpuModel::eval_batch`]): every layer on the GPU, and
    /// every routed expert in VRAM, read by the GPU from system RAM (`miss` [`MoeMiss::Pcie`])
    /// or run on the CPU over the step's tokens that chose it ([`MoeMiss::Cpu`]).
    pub fn batches_steps(&self, miss: MoeMiss) -> bool {
        self.cpu_layers == 0 && (!self.is_partial() || matches!(miss, MoeMiss::Pcie | MoeMiss::Cpu))
    }

    /// Slots of every MoE layer, in the order of [`Placement::moe_layers`].
    pub fn per_layer(&self) -> Vec<usize> {
        let (l, n, s) = (self.moe_layers.len(), self.n_expert, self.slots);
        if !self.is_partial() || l == 0 {
            return vec![s; l];
        }
        let capacity = s * l;
        match &self.layout {
            ExpertLayout::Even => vec![s; l],
            ExpertLayout::Cpu => vec![1; l],
            ExpertLayout::Layers => {
                let full = if n > 1 {
                    ((capacity - l) / (n - 1)).min(l)
                } else {
                    l
                };
                (0..l).map(|i| if i >= l - full { n } else { 1 }).collect()
            }
            ExpertLayout::Given(want) => {
                let want: Vec<usize> = (0..l)
                    .map(|i| want.get(i).copied().unwrap_or(s).clamp(1, n))
                    .collect();
                let total: usize = want.iter().sum();
                if total <= capacity {
                    return want;
                }
                // Scale the slots above one down, so the total fits.
                let (extra, room) = (total - l, capacity - l);
                want.iter().map(|&w| 1 + (w - 1) * room / extra).collect()
            }
        }
    }

    /// Slots of model layer `layer` (0 for a dense layer).
    pub fn slots_of(&self, layer: usize) -> usize {
        match self.moe_layers.iter().position(|&l| l == layer) {
            Some(i) => self.per_layer()[i],
            None => 0,
        }
    }
}

/// Alignment slack: drivers align each buffer (256 bytes is the largest
/// `minStorageBufferOffsetAlignment` in practice), about 24 buffers per layer and 32 more.
fn margin(n_layer: usize) -> u64 {
    (64 << 10) + 256 * (24 * n_layer as u64 + 32)
}

/// The placement of `model`, needing `needed` with every expert resident, under `budget`;
/// `staging_counts` says whether upload staging counts against it on this device.
/// `capacity`: the KV cache's positions; `reserve`: budget the allocator keeps for
/// host-visible device memory ([`super::Allocator::mapped_reserve`]), part of the margin;
/// `stream`: what is not in VRAM takes prompt chunks through VRAM slots where the budget holds
/// them (`Some`; for a MoE model, the number of slots for missing experts asked, 0 to let the
/// plan choose).
pub(super) fn plan(
    model: &Model,
    (needed, capacity, stream): (&DeviceBytes, usize, Option<usize>),
    budget: Option<u64>,
    (staging_counts, reserve): (bool, u64),
    miss: MoeMiss,
    layout: &ExpertLayout,
) -> Result<Placement> {
    let counted = |b: u64| if staging_counts { b } else { 0 };
    let margin = margin(model.config.n_layer) + reserve;
    let Some(shape) = ExpertShape::of(model) else {
        let dense = |(cpu_layers, stream_slot), minimum| Placement {
            slots: 0,
            n_expert: 0,
            layout: layout.clone(),
            moe_layers: Vec::new(),
            staging_bytes: FULL_STAGING_BYTES,
            minimum,
            cpu_layers,
            stream_slot,
            prompt_expert_slots: 0,
        };
        let extra = counted(FULL_STAGING_BYTES) + margin;
        let Some(budget) = budget.filter(|&b| needed.total() + extra > b) else {
            return Ok(dense((0, false), None));
        };
        // The fewest layers on the CPU that leave the rest within the budget, with a slot for
        // their prompt chunks where one fits (and prompts want it), else without.
        let n = model.layers.len();
        let slot = stream_slot_bytes(model, capacity);
        let fits =
            |cpu: usize, slot| split_bytes(model, capacity, cpu).total() + extra + slot <= budget;
        let with_slot =
            (1..n).find(|&cpu| stream.is_some() && streamable(model, cpu) && fits(cpu, slot));
        let without = (1..n).find(|&cpu| fits(cpu, 0));
        let last = split_bytes(model, capacity, n.saturating_sub(1));
        let minimum = MinimumBudget {
            non_expert: last.weights,
            kv_cache: last.kv_cache,
            activations: last.activations,
            one_slot_per_layer: 0,
            staging: counted(FULL_STAGING_BYTES),
            margin,
        };
        return match (with_slot, without) {
            (Some(cpu), _) => Ok(dense((cpu, true), Some(minimum))),
            (None, Some(cpu)) => Ok(dense((cpu, false), Some(minimum))),
            (None, None) => Err(GpuError::BelowMinimumBudget {
                budget,
                needed: needed.total(),
                minimum: Box::new(minimum),
            }),
        };
    };
    let moe_layers: Vec<usize> = model
        .layers
        .iter()
        .enumerate()
        .filter(|(_, l)| matches!(l.ffn, Ffn::Moe(_)))
        .map(|(i, _)| i)
        .collect();
    let whole = Placement {
        slots: shape.n_expert,
        n_expert: shape.n_expert,
        layout: layout.clone(),
        moe_layers: moe_layers.clone(),
        staging_bytes: FULL_STAGING_BYTES,
        minimum: None,
        cpu_layers: 0,
        stream_slot: false,
        prompt_expert_slots: 0,
    };
    let Some(budget) = budget else {
        return Ok(whole);
    };
    if needed.total() + counted(FULL_STAGING_BYTES) + margin <= budget {
        return Ok(whole);
    }
    let staging = shape.staging_bytes();
    // Misses read over PCIe (all or some of them) keep the token embedding in system RAM too
    // (a row a token crosses the bus), as llama.cpp keeps it on the CPU; tied to the output, it
    // stays.
    let embedding = match miss {
        MoeMiss::Pcie | MoeMiss::Split if model.output != model.token_embd => {
            model.mat(&model.token_embd).data.len() as u64
        }
        _ => 0,
    };
    let minimum = MinimumBudget {
        non_expert: needed.weights - needed.experts - embedding,
        kv_cache: needed.kv_cache,
        activations: needed.activations,
        one_slot_per_layer: shape.slot_bytes(1),
        staging: counted(staging),
        margin,
    };
    if minimum.total() > budget {
        return Err(GpuError::BelowMinimumBudget {
            budget,
            needed: needed.total(),
            minimum: Box::new(minimum),
        });
    }
    // Slots for the missing experts of a prompt chunk, where they take at most a quarter of
    // the room the budget leaves for expert slots (any share when their number was asked for)
    // and leave one resident slot per layer.
    let room = budget - (minimum.total() - minimum.one_slot_per_layer);
    let stream_bytes = |k| {
        let staging = shape.staging_bytes_for(k);
        expert_stream_bytes(model, capacity, k) + counted(staging)
    };
    // With misses read over PCIe a chunk is routed on the device and reads its missing experts
    // there too (no shared expert): it needs room for its activations, not slots, on the same
    // terms. Slots asked for still take their place.
    let no_shared = model.layers.iter().all(|l| match &l.ffn {
        Ffn::Moe(m) => m.shared.is_none(),
        Ffn::Dense { .. } => true,
    });
    let chunk_on_device = miss == MoeMiss::Pcie && no_shared && stream == Some(0);
    let chunk = Some(moe_chunk_bytes(model, capacity))
        .filter(|&b| chunk_on_device && b <= room / 4 && minimum.total() + b <= budget);
    let prompt_slots = stream
        .filter(|_| !chunk_on_device && experts_streamable(model))
        .map(|asked| (asked, prompt_expert_slots(&shape, asked)))
        .filter(|&(asked, k)| {
            let bytes = stream_bytes(k);
            (asked > 0 || bytes <= room / 4) && minimum.total() + bytes <= budget
        })
        .map(|(_, k)| k);
    let prompt = prompt_slots.map_or(0, stream_bytes) + chunk.unwrap_or(0);
    let fixed = minimum.total() - minimum.one_slot_per_layer + prompt;
    let per_slot = shape.slot_bytes(1);
    let slots = (((budget - fixed) / per_slot) as usize).clamp(1, shape.n_expert);
    // Where the budget holds every expert only because the embedding went to system RAM, one
    // slot a layer fewer keeps the placement partial, so that the embedding does go there.
    let slots = if embedding > 0 {
        slots.min(shape.n_expert - 1).max(1)
    } else {
        slots
    };
    let misaligned = [shape.gate, shape.up, shape.down]
        .iter()
        .any(|b| !b.is_multiple_of(4));
    if miss == MoeMiss::Fetch && slots < shape.n_expert && misaligned {
        return Err(GpuError::Unsupported(format!(
            "fetching experts whose stacks take {}/{}/{} bytes per expert (uploads are whole \
             words): use --moe-miss cpu",
            shape.gate, shape.up, shape.down
        )));
    }
    Ok(Placement {
        slots,
        n_expert: shape.n_expert,
        layout: layout.clone(),
        moe_layers,
        staging_bytes: staging,
        minimum: Some(minimum),
        cpu_layers: 0,
        stream_slot: prompt_slots.is_some(),
        prompt_expert_slots: prompt_slots.unwrap_or(0),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Qwen3-30B-A3B shape at 8 GiB (a sparse file: only its header and 1-D tensors are
    /// written, which is all a plan reads): with misses over PCIe the plan places no prompt
    /// slots and leaves room for a chunk's activations beyond its expert slots; with misses on
    /// the CPU it places prompt slots.
    #[test]
    fn misses_over_the_bus_keep_room_for_a_chunk_instead_of_prompt_slots() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("m.gguf");
        let q4_0 = "Q4_0".parse().unwrap();
        crate::synth::SynthModel::from_name("qwen3-30b-a3b", q4_0, 7)
            .unwrap()
            .write(&path, true, |_, _| {})
            .unwrap();
        let model = Model::open(&path).unwrap();
        let capacity = 4096;
        let needed = super::super::footprint::device_bytes(&model, capacity);
        let budget = 8 << 30;
        let plan_for = |miss| {
            let stream = (&needed, capacity, Some(0));
            let layout = ExpertLayout::default();
            plan(&model, stream, Some(budget), (false, 0), miss, &layout).unwrap()
        };
        let pcie = plan_for(MoeMiss::Pcie);
        assert!(pcie.is_partial(), "{pcie:?}");
        assert!(
            !pcie.stream_slot && pcie.prompt_expert_slots == 0,
            "{pcie:?}"
        );
        let m = pcie.minimum.expect("partial");
        let slots = (m.total() - m.one_slot_per_layer) + pcie.slots as u64 * m.one_slot_per_layer;
        let chunk = moe_chunk_bytes(&model, capacity);
        assert!(
            chunk > 0 && slots + chunk <= budget,
            "{slots} + {chunk} of {budget}"
        );
        // Without the chunk's room the same budget would hold more slots.
        assert!(slots + chunk + m.one_slot_per_layer > budget, "{pcie:?}");
        let cpu = plan_for(MoeMiss::Cpu);
        assert!(cpu.stream_slot && cpu.prompt_expert_slots > 0, "{cpu:?}");
    }

    #[test]
    fn miss_policies_parse_and_print() {
        let all = [
            MoeMiss::Auto,
            MoeMiss::Cpu,
            MoeMiss::Fetch,
            MoeMiss::Pcie,
            MoeMiss::Split,
        ];
        for m in all {
            assert_eq!(m.to_string().parse::<MoeMiss>(), Ok(m));
        }
        assert!("gpu".parse::<MoeMiss>().is_err());
        assert_eq!(MoeMiss::default(), MoeMiss::Auto);
    }

    #[test]
    fn auto_reads_misses_over_the_bus_where_there_is_one_and_ram_for_the_experts() {
        const G: u64 = 1 << 30;
        let auto = MoeMiss::Auto;
        let at = |bus, ram_budget, headroom| MissContext {
            bus,
            experts: 15 * G,
            ram_budget,
            headroom,
            coverage: Some(0.5),
            sequences: 1,
        };
        // A discrete GPU with RAM to spare.
        assert_eq!(auto.resolve(&at(true, None, Some(100 * G))), MoeMiss::Pcie);
        // No bus (lavapipe, integrated): the CPU.
        assert_eq!(auto.resolve(&at(false, None, Some(100 * G))), MoeMiss::Cpu);
        // Over half the headroom, or over the RAM budget, or headroom unknown: the CPU.
        assert_eq!(auto.resolve(&at(true, None, Some(29 * G))), MoeMiss::Cpu);
        assert_eq!(
            auto.resolve(&at(true, Some(8 * G), Some(100 * G))),
            MoeMiss::Cpu
        );
        assert_eq!(auto.resolve(&at(true, None, None)), MoeMiss::Cpu);
        assert_eq!(
            auto.resolve(&at(true, Some(16 * G), Some(100 * G))),
            MoeMiss::Pcie
        );
        // A policy given stays.
        for m in [MoeMiss::Cpu, MoeMiss::Fetch, MoeMiss::Pcie, MoeMiss::Split] {
            assert_eq!(m.resolve(&at(false, Some(1), None)), m);
        }
    }

    #[test]
    fn auto_shares_misses_with_the_cpu_where_slots_are_few() {
        const G: u64 = 1 << 30;
        let auto = MoeMiss::Auto;
        let at = |coverage, sequences| MissContext {
            bus: true,
            experts: 15 * G,
            ram_budget: None,
            headroom: Some(100 * G),
            coverage,
            sequences,
        };
        // About 1% of the experts in VRAM: split, or the CPU for steps of several sequences.
        assert_eq!(auto.resolve(&at(Some(0.01), 1)), MoeMiss::Split);
        assert_eq!(auto.resolve(&at(Some(0.0), 0)), MoeMiss::Split);
        assert_eq!(auto.resolve(&at(Some(0.01), 8)), MoeMiss::Cpu);
        // Slots for a sixth of them, or no budget known: over the bus.
        assert_eq!(auto.resolve(&at(Some(0.17), 1)), MoeMiss::Pcie);
        assert_eq!(auto.resolve(&at(Some(FEW_SLOTS), 8)), MoeMiss::Pcie);
        assert_eq!(auto.resolve(&at(None, 1)), MoeMiss::Pcie);
        // Without RAM for the bus's copy, the CPU whatever the slots.
        let no_room = MissContext {
            headroom: Some(20 * G),
            ..at(Some(0.01), 1)
        };
        assert_eq!(auto.resolve(&no_room), MoeMiss::Cpu);
    }

    #[test]
    fn auto_falls_back_to_what_the_device_and_budget_take() {
        let unsupported = GpuError::Unsupported("stacks past one binding".into());
        let below = GpuError::BelowMinimumBudget {
            budget: 1,
            needed: 2,
            minimum: Box::new(MinimumBudget {
                non_expert: 1,
                kv_cache: 1,
                activations: 0,
                one_slot_per_layer: 0,
                staging: 0,
                margin: 0,
            }),
        };
        let lost = GpuError::DeviceLost;
        // A split the device cannot run: the bus alone, which needs no chain; then the CPU.
        assert_eq!(
            MoeMiss::Split.auto_fallback(&unsupported, true),
            Some(MoeMiss::Pcie)
        );
        assert_eq!(
            MoeMiss::Pcie.auto_fallback(&unsupported, true),
            Some(MoeMiss::Cpu)
        );
        assert_eq!(MoeMiss::Cpu.auto_fallback(&unsupported, true), None);
        // The CPU's placement over the budget: the bus's, where the bus may take the misses.
        assert_eq!(
            MoeMiss::Cpu.auto_fallback(&below, true),
            Some(MoeMiss::Pcie)
        );
        assert_eq!(MoeMiss::Cpu.auto_fallback(&below, false), None);
        // The bus's placement (split's too) over the budget is as small as it gets.
        for m in [MoeMiss::Pcie, MoeMiss::Split] {
            assert_eq!(m.auto_fallback(&below, true), None);
        }
        // Other failures are the load's.
        for m in [MoeMiss::Cpu, MoeMiss::Split, MoeMiss::Pcie] {
            assert_eq!(m.auto_fallback(&lost, true), None);
        }
    }

    fn partial(slots: usize, layout: ExpertLayout) -> Placement {
        Placement {
            slots,
            n_expert: 8,
            layout,
            moe_layers: vec![1, 2, 3, 4],
            staging_bytes: 0,
            minimum: None,
            cpu_layers: 0,
            stream_slot: false,
            prompt_expert_slots: 0,
        }
    }

    #[test]
    fn layouts_spread_the_even_slots_without_exceeding_them() {
        let even = partial(3, ExpertLayout::Even);
        assert_eq!(even.per_layer(), [3, 3, 3, 3]);
        assert_eq!((even.slots_of(0), even.slots_of(2)), (0, 3));
        assert_eq!(partial(3, ExpertLayout::Cpu).per_layer(), [1, 1, 1, 1]);
        // 12 slots: one in each layer, and 8 more fill one layer whole, the last.
        assert_eq!(partial(3, ExpertLayout::Layers).per_layer(), [1, 1, 1, 8]);
        assert_eq!(partial(8, ExpertLayout::Layers).per_layer(), [8, 8, 8, 8]);
        let given = partial(3, ExpertLayout::Given(vec![8, 2, 1, 1]));
        assert_eq!(given.per_layer(), [8, 2, 1, 1]);
        // 20 asked of 12: the slots above one are scaled down.
        let over = partial(3, ExpertLayout::Given(vec![8, 8, 2, 2]));
        assert!(
            over.per_layer().iter().sum::<usize>() <= 12,
            "{:?}",
            over.per_layer()
        );
        assert!(over.per_layer().iter().all(|&s| s >= 1));
        for l in ["even", "layers", "cpu"] {
            assert!(l.parse::<ExpertLayout>().is_ok());
        }
        assert!("planned".parse::<ExpertLayout>().is_err());
    }

    #[test]
    fn slots_round_each_stack_to_words_per_layer() {
        let s = ExpertShape {
            gate: 6,
            up: 6,
            down: 10,
            n_expert: 8,
            moe_layers: 2,
        };
        assert_eq!(s.slot_bytes(1), 2 * (8 + 8 + 12));
        assert_eq!(s.slot_bytes(2), 2 * (12 + 12 + 20));
        assert_eq!(s.staging_bytes(), 256 << 10);
    }
}
