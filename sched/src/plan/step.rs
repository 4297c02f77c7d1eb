//! The decode-step model the planner optimises: per-unit costs from the predictors, and the
//! predicted time of each layer under a placement.
//!
//! One layer runs in three phases: attention (norms, Q/K/V/O, router), the dense FFN, and the
//! experts (routed and shared). Attention and the dense FFN are chains of dependent products,
//! so GPU and CPU parts of them add up; experts are independent, so GPU and CPU experts run at
//! the same time and the phase takes the longer side. Copies and SSD reads overlap the compute
//! of earlier layers (prefetch), so a layer takes the longest of compute, PCIe and SSD, plus
//! the transfers that prefetch could not start early: the share of routed experts it
//! mispredicted.
//!
//! Expert costs are expectations over routing (each expert weighted by its probability of
//! being used); the expectation of the maximum is higher than the maximum of expectations, so
//! the model is optimistic for layers that swing between bounds. Decode only (batch 1).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::{ModelDesc, TensorDesc, TensorRole, WeightType, GPU_SMALL_PRODUCT_WEIGHTS};
use crate::predict::Work;
use crate::profile::HardwareProfile;
use crate::ByteSize;

use super::pins::Tier;

/// What limits a layer, or the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Bottleneck {
    #[serde(rename = "GPU")]
    Gpu,
    #[serde(rename = "CPU")]
    Cpu,
    #[serde(rename = "PCIe")]
    Pcie,
    #[serde(rename = "SSD")]
    Ssd,
}

impl std::fmt::Display for Bottleneck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Bottleneck::Gpu => "GPU",
            Bottleneck::Cpu => "CPU",
            Bottleneck::Pcie => "PCIe",
            Bottleneck::Ssd => "SSD",
        })
    }
}

/// What the planner places: a whole tensor, or one routed expert: its slices of the layer's
/// expert matrices (gate, up, down), kept together since they are read together.
#[derive(Debug, Clone)]
pub(super) struct Unit {
    /// The tensors it has bytes in; one, except for experts.
    pub tensors: Vec<usize>,
    /// The expert's index in its layer, for routed experts.
    pub expert: Option<u32>,
    /// Index of the layer group (`n_layer` for tensors outside the blocks).
    pub group: usize,
    /// 0: attention, 1: dense FFN, 2: experts.
    pub phase: usize,
    pub bytes: u64,
    /// Probability that a token reads it.
    pub prob: f64,
    pub routed: bool,
    /// Attention, norms, routers, shared experts of a MoE model: into VRAM first.
    pub core: bool,
    pub embedding: bool,
    /// A 1-D weight (a norm): a GPU dispatch reads it, but on the CPU it is applied on the
    /// calling thread, not in a pool job.
    pub norm: bool,
    /// Seconds when read: on the GPU, on the CPU, copied to the GPU, read from the SSD.
    pub gpu: f64,
    pub cpu: f64,
    pub copy: f64,
    pub ssd: f64,
}

/// Breaks the model into units with their costs. `pin_of` gives each tensor's pin, if any:
/// an expert's matrices are only bundled when the same pin (or none) decides them all.
pub(super) fn units(
    model: &ModelDesc,
    profile: &HardwareProfile,
    tile: ByteSize,
    pin_of: &[Option<usize>],
) -> Vec<Unit> {
    let n_layer = model.n_layer as usize;
    let moe = model.experts.is_some();
    let copy = profile.host_to_device();
    let ssd_bw = profile.ssd_bandwidth(tile);
    let tiles = |bytes: u64| bytes.div_ceil(tile.0.max(1)) as f64;
    let mut out: Vec<Unit> = Vec::new();
    // (group, expert, pin) -> index in `out`, to bundle an expert's slices.
    let mut experts: BTreeMap<(usize, u32, Option<usize>), usize> = BTreeMap::new();
    for (ti, t) in model.tensors.iter().enumerate() {
        let group = t.role.layer().map_or(n_layer, |l| l as usize);
        let phase = match t.role {
            TensorRole::Ffn { .. } | TensorRole::Output => 1,
            TensorRole::SharedExpert { .. }
            | TensorRole::Experts { .. }
            | TensorRole::Expert { .. } => 2,
            _ => 0,
        };
        let core = moe
            && matches!(
                t.role,
                TensorRole::Attention { .. }
                    | TensorRole::Norm { .. }
                    | TensorRole::Router { .. }
                    | TensorRole::SharedExpert { .. }
            );
        let slices: Vec<(Option<u32>, u64, f64)> = match t.role {
            TensorRole::Experts { layer } => {
                let n = model.expert_count();
                (0..n)
                    .map(|e| {
                        let bytes = t.bytes / u64::from(n);
                        (Some(e), bytes, model.expert_probability(layer, e))
                    })
                    .collect()
            }
            TensorRole::Expert { layer, index } => {
                vec![(Some(index), t.bytes, model.expert_probability(layer, index))]
            }
            _ => vec![(None, t.bytes, 1.0)],
        };
        for (expert, bytes, prob) in slices {
            let (mut gpu, cpu) = compute_cost(t, bytes, profile);
            if let (Some(r), true) = (&model.experts, t.role.is_routed()) {
                // The GPU runs a layer's chosen experts in one expert-indexed dispatch per
                // matrix: each expert is its share of a product `used` times as tall.
                let used = u64::from(r.used.max(1));
                let (k, n) = t.matrix();
                gpu = profile.gpu_product_marginal(&t.weight_type, k, n * used, bytes * used)
                    / used as f64;
            }
            let embedding = t.role == TensorRole::Embedding;
            // An embedding is read one row per token; it is copied and read as such.
            let moved = if embedding {
                bytes / t.shape.get(1).copied().unwrap_or(1).max(1)
            } else {
                bytes
            };
            let unit = Unit {
                tensors: vec![ti],
                expert,
                group,
                phase,
                bytes,
                prob,
                routed: t.role.is_routed(),
                core,
                embedding,
                norm: matches!(t.role, TensorRole::Norm { .. }),
                gpu,
                cpu,
                copy: copy.marginal(Work::transfer(moved)) + tiles(moved) * copy.fixed_s,
                ssd: moved as f64 / ssd_bw,
            };
            match expert {
                Some(e) => match experts.get(&(group, e, pin_of[ti])) {
                    Some(&i) => {
                        let u = &mut out[i];
                        u.tensors.push(ti);
                        u.bytes += unit.bytes;
                        u.gpu += unit.gpu;
                        u.cpu += unit.cpu;
                        u.copy += unit.copy;
                        u.ssd += unit.ssd;
                    }
                    None => {
                        experts.insert((group, e, pin_of[ti]), out.len());
                        out.push(unit);
                    }
                },
                None => out.push(unit),
            }
        }
    }
    for u in out.iter_mut().filter(|u| u.routed && u.tensors.len() == 3) {
        let (t, k, rows) = expert_shape(model, u);
        if let Some(s) = profile.cpu_expert(t, k, rows, u.bytes) {
            u.cpu = s;
        }
        if let Some(s) = profile.gpu_expert(t, k, rows, u.bytes) {
            u.gpu = s;
        }
    }
    if let Some(u) = tied_output(model, profile) {
        out.push(u);
    }
    out
}

/// A routed expert's (its gate, up and down) type, width and rows, as calibration measured
/// experts: run as the engines run a layer's experts (on the CPU all of them in two pool
/// jobs; on the GPU in two expert-indexed dispatches), which the products' own costs do not
/// describe. Where a profile has no calibrated experts, those costs stand.
fn expert_shape<'m>(model: &'m ModelDesc, u: &Unit) -> (&'m WeightType, u64, u64) {
    let tensors: Vec<&TensorDesc> = u.tensors.iter().map(|&i| &model.tensors[i]).collect();
    let gate = tensors
        .iter()
        .find(|t| t.name.contains("gate"))
        .unwrap_or(&tensors[0]);
    let (a, b) = gate.matrix();
    let rows = if a == model.n_embd { b } else { a };
    (&gate.weight_type, model.n_embd, rows)
}

/// A model without `output.weight` reads its embedding matrix as the output head too (tied
/// embeddings): one whole product per token, on top of the embedding's one-row lookup. It is a
/// unit of its own over the embedding tensor, so that it can go to VRAM while the lookup stays
/// on the CPU.
fn tied_output(model: &ModelDesc, profile: &HardwareProfile) -> Option<Unit> {
    if model.tensors.iter().any(|t| t.role == TensorRole::Output) {
        return None;
    }
    let (ti, t) = model
        .tensors
        .iter()
        .enumerate()
        .find(|(_, t)| t.role == TensorRole::Embedding)?;
    let (k, n) = t.matrix();
    let copy = profile.host_to_device();
    Some(Unit {
        tensors: vec![ti],
        expert: None,
        group: model.n_layer as usize,
        phase: 1,
        bytes: t.bytes,
        prob: 1.0,
        routed: false,
        core: false,
        embedding: false,
        norm: false,
        gpu: profile.gpu_product_marginal(&t.weight_type, k, n, t.bytes),
        cpu: profile.cpu_product_marginal(&t.weight_type, k, n, t.bytes),
        copy: copy.marginal(Work::transfer(t.bytes)) + copy.fixed_s,
        ssd: t.bytes as f64 / profile.ssd_bandwidth(ByteSize(t.bytes)),
    })
}

/// GPU and CPU seconds of one read of `bytes` of `t` (without the dispatch cost).
fn compute_cost(t: &TensorDesc, bytes: u64, profile: &HardwareProfile) -> (f64, f64) {
    match t.role {
        TensorRole::Embedding => {
            let row = Work::transfer(bytes / t.shape.get(1).copied().unwrap_or(1).max(1));
            (
                profile.gpu_stream().marginal(row),
                row.bytes / profile.cpu.memory_bandwidth,
            )
        }
        TensorRole::Norm { .. } => {
            let w = Work::transfer(bytes);
            (
                profile.gpu_stream().marginal(w),
                w.bytes / profile.cpu.memory_bandwidth,
            )
        }
        _ => {
            let (k, n) = t.matrix();
            (
                profile.gpu_product_marginal(&t.weight_type, k, n, bytes),
                profile.cpu_product_marginal(&t.weight_type, k, n, bytes),
            )
        }
    }
}

/// Expected per-token sums of one layer group under a placement.
#[derive(Debug, Clone, Default)]
pub(super) struct Group {
    pub gpu: [f64; 3],
    pub cpu: [f64; 3],
    pub pcie: f64,
    pub ssd: f64,
    /// Transfers after routing is known: not overlapped.
    pub exposed: f64,
    /// Dispatches of the routed experts on the GPU when they run one by one (a layer with
    /// experts outside VRAM): per expert, its products, the activation and the weighted add.
    pub routed_dispatch: f64,
    /// Dispatches of the routed experts when every one is in VRAM: the GPU routes the layer
    /// itself and runs all its chosen experts in one dispatch per expert matrix, then the
    /// activation and the weighted add.
    pub indexed_dispatch: f64,
    /// Routed units of the layer, and how many of them are outside VRAM.
    pub routed_units: usize,
    pub routed_off_vram: f64,
    /// Summed probability of the routed experts on the CPU (for its pool jobs).
    pub routed_cpu: f64,
}

/// Predicted time and limits of one group.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GroupTime {
    pub total_s: f64,
    pub gpu_s: f64,
    pub cpu_s: f64,
    pub pcie_s: f64,
    pub ssd_s: f64,
    pub bound: Bottleneck,
}

impl Group {
    /// The GPU's dispatches for the routed experts, on the path the layer takes.
    fn expert_dispatch(&self) -> f64 {
        if self.routed_units == 0 {
            0.0
        } else if self.routed_off_vram < 0.5 {
            self.indexed_dispatch
        } else {
            self.routed_dispatch
        }
    }

    pub fn time(&self) -> GroupTime {
        // Chains: GPU and CPU parts add up. Experts: the two sides run at once.
        let chain_gpu = self.gpu[0] + self.gpu[1];
        let chain_cpu = self.cpu[0] + self.cpu[1];
        let (eg, ec) = (self.gpu[2] + self.expert_dispatch(), self.cpu[2]);
        let compute = chain_gpu + chain_cpu + eg.max(ec);
        let gpu_lead = chain_gpu + if eg >= ec { eg } else { 0.0 };
        let cpu_lead = chain_cpu + if ec > eg { ec } else { 0.0 };
        let longest = compute.max(self.pcie).max(self.ssd);
        let bound = if longest == compute {
            if gpu_lead >= cpu_lead {
                Bottleneck::Gpu
            } else {
                Bottleneck::Cpu
            }
        } else if longest == self.pcie {
            Bottleneck::Pcie
        } else {
            Bottleneck::Ssd
        };
        GroupTime {
            total_s: longest + self.exposed,
            gpu_s: self.gpu.iter().sum::<f64>() + self.expert_dispatch(),
            cpu_s: self.cpu.iter().sum(),
            pcie_s: self.pcie,
            ssd_s: self.ssd,
            bound,
        }
    }
}

/// Dispatches of a GPU layer that read no weights, by phase: attention over the KV cache,
/// which applies RoPE, QK-norm and the KV store in its dispatch (`record_attention` in
/// `gpu/forward/decode.rs`); a dense FFN's SwiGLU and residual add are fused into its
/// products, and a MoE layer's routing into its router's dispatch. Each costs the profile's
/// `gpu.dispatch_s`.
const GPU_WEIGHTLESS_OPS: [f64; 3] = [1.0, 0.0, 0.0];

/// Dispatches of each routed expert on the GPU beyond its products when experts run one by
/// one: SwiGLU and the weighted add.
const GPU_OPS_PER_EXPERT: f64 = 2.0;

/// Dispatches a decode step records on the GPU for tensor `t` (`gpu/forward/decode.rs`,
/// `gpu/moe/`):
/// - a norm none: it is fused into the products that read it;
/// - an up projection none: it is stacked with its gate into one product, SwiGLU included
///   (for routed experts too: one expert-indexed dispatch runs every chosen expert's gate and
///   up, another their down projections);
/// - any other matrix one, and one more where its inputs are quantized once for integer dot
///   products (Q4_0, Q8_0), it is the first product to read them (K and V read Q's, or
///   quantize in place as Q does) and it is not small ([`GPU_SMALL_PRODUCT_WEIGHTS`]: a gate
///   counts its up matrix's weights too, and routed experts' products the `used` experts a
///   token chooses).
pub(super) fn gpu_dispatches(t: &TensorDesc, used: u32) -> f64 {
    if matches!(t.role, TensorRole::Norm { .. }) || t.name.contains("ffn_up") {
        return 0.0;
    }
    let shares_inputs = t.name.contains("attn_k.") || t.name.contains("attn_v.");
    let (n_in, n_out) = t.matrix();
    let stacked = if t.name.contains("ffn_gate.") || t.name.contains("ffn_gate_exps.") {
        2
    } else {
        1
    };
    let experts = match t.role {
        TensorRole::Experts { .. } | TensorRole::Expert { .. } => u64::from(used.max(1)),
        _ => 1,
    };
    let small = n_in * n_out * stacked * experts < GPU_SMALL_PRODUCT_WEIGHTS as u64;
    let quantized = t.weight_type.gpu_quantizes_inputs() && !shares_inputs && !small;
    if quantized {
        2.0
    } else {
        1.0
    }
}

/// [`State::gpu_key`]: each tensor its own key, but a dense FFN's up projection the key of
/// its layer's gate (`blk.N.ffn_up.weight` → `blk.N.ffn_gate.weight`), with whom it is one
/// stacked product on the GPU. Routed experts are counted per layer instead
/// ([`Group::indexed_dispatch`]).
fn dispatch_keys(model: &ModelDesc) -> Vec<usize> {
    let index: BTreeMap<&str, usize> = model
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    model
        .tensors
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let gate = t.name.replace("ffn_up", "ffn_gate");
            match index.get(gate.as_str()) {
                Some(&g) if g != i => g,
                _ => i,
            }
        })
        .collect()
}

/// Jobs of the CPU engine's thread pool per layer that read no weights: RoPE and attention
/// (norms and adds run on the calling thread). Each costs the profile's `cpu.dispatch_s`.
const CPU_WEIGHTLESS_JOBS: f64 = 2.0;

/// Jobs of the CPU engine's thread pool for a layer's routed experts, however many there are:
/// gate and up of every chosen expert, then their down projections (`engine/experts.rs`).
const CPU_EXPERT_JOBS: f64 = 2.0;

/// Attention's read of one layer's KV cache: on the GPU when the cache is in VRAM, on the CPU
/// in a plan for the CPU alone.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum KvRead {
    Gpu(f64),
    Cpu(f64),
}

impl KvRead {
    /// Seconds per layer with `context` tokens in the cache.
    pub fn of(
        model: &ModelDesc,
        profile: &HardwareProfile,
        context: u64,
        cpu_only: bool,
    ) -> KvRead {
        let per_layer = context * model.kv_bytes_per_token() / u64::from(model.n_layer.max(1));
        if cpu_only {
            KvRead::Cpu(per_layer as f64 / profile.cpu.memory_bandwidth)
        } else {
            // The attention's own dispatch is one of the layer's weightless ops.
            let a = profile.gpu_attention(model.query_width(), context, per_layer);
            KvRead::Gpu((a - profile.gpu.dispatch_s).max(0.0))
        }
    }
}

/// A placement being built, with its group sums kept up to date.
pub(super) struct State<'a> {
    pub units: &'a [Unit],
    pub tier: Vec<Tier>,
    pub in_ram: Vec<bool>,
    pub groups: Vec<Group>,
    /// Per tensor: summed probability of its units on the GPU and on the CPU, for dispatches.
    on_gpu: Vec<f64>,
    on_cpu: Vec<f64>,
    /// Per tensor: the tensor whose dispatch it shares on the GPU (itself, or for an up
    /// projection its gate, stacked with it) and that dispatch's count ([`gpu_dispatches`];
    /// an up projection on the GPU without its gate pays its own product's).
    gpu_key: Vec<usize>,
    gpu_ops: Vec<f64>,
    dispatch_gpu: f64,
    dispatch_cpu: f64,
    miss: f64,
}

impl<'a> State<'a> {
    /// `miss`: share of routed-expert transfers that prefetch does not start early.
    pub fn new(
        units: &'a [Unit],
        model: &ModelDesc,
        profile: &HardwareProfile,
        tier: Vec<Tier>,
        in_ram: Vec<bool>,
        kv: KvRead,
        miss: f64,
    ) -> State<'a> {
        let mut groups = vec![Group::default(); model.n_layer as usize + 1];
        let moe = model.experts.is_some();
        let used = model.experts.as_ref().map_or(1, |e| e.used);
        for g in &mut groups[..model.n_layer as usize] {
            // Attention over the KV cache, and the ops that read no weights.
            match kv {
                KvRead::Gpu(s) => {
                    let d = profile.gpu.dispatch_s;
                    g.gpu[0] = s + GPU_WEIGHTLESS_OPS[0] * d;
                    g.gpu[if moe { 2 } else { 1 }] +=
                        GPU_WEIGHTLESS_OPS[if moe { 2 } else { 1 }] * d;
                }
                KvRead::Cpu(s) => g.cpu[0] = s + CPU_WEIGHTLESS_JOBS * profile.cpu.dispatch_s,
            }
        }
        // The indexed path's cost per MoE layer: the dispatches of its routed expert matrices,
        // each over every chosen expert.
        let mut routed_tensors: Vec<std::collections::BTreeSet<usize>> =
            vec![Default::default(); groups.len()];
        for u in units.iter().filter(|u| u.routed) {
            groups[u.group].routed_units += 1;
            routed_tensors[u.group].extend(u.tensors.iter().copied());
        }
        for (g, t) in groups.iter_mut().zip(&routed_tensors) {
            // Experts in tensors of their own (older Mixtral files) are stacked on upload.
            let per_matrix = |t: &TensorDesc| match t.role {
                TensorRole::Expert { .. } => f64::from(model.expert_count().max(1)),
                _ => 1.0,
            };
            let ops: f64 = t
                .iter()
                .map(|&i| gpu_dispatches(&model.tensors[i], used) / per_matrix(&model.tensors[i]))
                .sum();
            g.indexed_dispatch = ops * profile.gpu.dispatch_s;
        }
        let mut s = State {
            units,
            tier,
            in_ram,
            groups,
            on_gpu: vec![0.0; model.tensors.len()],
            on_cpu: vec![0.0; model.tensors.len()],
            gpu_key: dispatch_keys(model),
            gpu_ops: model
                .tensors
                .iter()
                .map(|t| gpu_dispatches(t, used))
                .collect(),
            dispatch_gpu: profile.gpu.dispatch_s,
            dispatch_cpu: profile.cpu.dispatch_s,
            miss,
        };
        for i in 0..units.len() {
            s.apply(i, 1.0);
        }
        s
    }

    /// Adds (`sign` 1) or removes (-1) unit `i`'s contribution under its current tier.
    fn apply(&mut self, i: usize, sign: f64) {
        let u = &self.units[i];
        let p = u.prob;
        let ssd = if self.in_ram[i] { 0.0 } else { u.ssd };
        let ph = u.phase;
        let g = &mut self.groups[u.group];
        let on_gpu = self.tier[i] != Tier::Cpu;
        // One dispatch per tensor and device, when any of its units there is used.
        let (sums, cost, side) = if on_gpu {
            (&mut self.on_gpu, self.dispatch_gpu, &mut g.gpu)
        } else {
            (&mut self.on_cpu, self.dispatch_cpu, &mut g.cpu)
        };
        if u.routed && self.tier[i] != Tier::Vram {
            g.routed_off_vram += sign;
        }
        if u.routed && on_gpu {
            // With experts outside VRAM the GPU runs each routed expert by itself: its
            // products, the activation and the weighted add ([`Group::expert_dispatch`]).
            g.routed_dispatch += sign * p * (u.tensors.len() as f64 + GPU_OPS_PER_EXPERT) * cost;
        } else if u.routed {
            // The CPU engine runs all of a layer's chosen experts in two pool jobs (gates and
            // ups, then downs), paid when any expert it runs is chosen.
            let before = g.routed_cpu.min(1.0);
            g.routed_cpu = (g.routed_cpu + sign * p).max(0.0);
            side[ph] += (g.routed_cpu.min(1.0) - before) * CPU_EXPERT_JOBS * cost;
        } else if on_gpu || !u.norm {
            // Norms on the CPU run on the calling thread, not as pool jobs; on the GPU they
            // are fused into products (no dispatch of their own).
            for &ti in &u.tensors {
                let (key, ops) = if on_gpu {
                    let key = self.gpu_key[ti];
                    (key, self.gpu_ops[key])
                } else {
                    (ti, 1.0)
                };
                let before = sums[key].min(1.0);
                sums[key] = (sums[key] + sign * p).max(0.0);
                side[ph] += (sums[key].min(1.0) - before) * cost * ops;
            }
        }
        match self.tier[i] {
            Tier::Vram => g.gpu[ph] += sign * p * u.gpu,
            Tier::Stream => {
                g.gpu[ph] += sign * p * u.gpu;
                g.pcie += sign * p * u.copy;
                g.ssd += sign * p * ssd;
                if u.routed {
                    g.exposed += sign * self.miss * p * (u.copy + ssd);
                }
            }
            Tier::Cpu => {
                g.cpu[ph] += sign * p * u.cpu;
                g.ssd += sign * p * ssd;
                if u.routed {
                    g.exposed += sign * self.miss * p * ssd;
                }
            }
        }
    }

    /// Moves unit `i`, returning the change of its group's time in seconds.
    pub fn set(&mut self, i: usize, tier: Tier, in_ram: bool) -> f64 {
        let g = self.units[i].group;
        let before = self.groups[g].time().total_s;
        self.apply(i, -1.0);
        self.tier[i] = tier;
        self.in_ram[i] = in_ram;
        self.apply(i, 1.0);
        self.groups[g].time().total_s - before
    }

    /// The change moving unit `i` would make, without moving it.
    pub fn delta(&mut self, i: usize, tier: Tier, in_ram: bool) -> f64 {
        let (old_tier, old_ram) = (self.tier[i], self.in_ram[i]);
        let d = self.set(i, tier, in_ram);
        self.set(i, old_tier, old_ram);
        d
    }
}
