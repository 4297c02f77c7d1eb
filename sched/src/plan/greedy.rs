//! The planning algorithm.
//!
//! 1. Reserve VRAM for the KV cache, activations and the tensors pinned to VRAM, and refuse a
//!    budget below that. Plan twice where the budget allows: once with staging slots for
//!    `prefetch_depth` layers of streamed weights, once without (what VRAM does not hold runs
//!    on the CPU); keep the faster. The better of two plans that each improve with more VRAM
//!    also improves with more VRAM.
//! 2. Start every unpinned tensor and expert off VRAM: on the CPU where its CPU time is below
//!    its copy plus GPU time (Fiddler's rule), streamed otherwise; the RAM budget holds the
//!    most probably used of them, the rest are read from the SSD.
//! 3. Greedy by benefit density: repeatedly move into VRAM the unit whose move saves the most
//!    predicted step time per byte, re-evaluated lazily since savings change as layers change
//!    bounds; for MoE models, attention, norms, routers and shared experts go first. A greedy,
//!    not an optimal knapsack: a unit that does not fit is skipped and smaller ones are tried.
//! 4. Re-fill RAM with what VRAM freed, then per unit try the other of streaming and CPU where
//!    that shortens its layer (balancing PCIe against the CPU), and run step 3 once more.

use std::cmp::Ordering;
use std::collections::{BTreeMap, BinaryHeap};

use crate::model::{ModelDesc, TensorRole};
use crate::profile::HardwareProfile;
use crate::ByteSize;

use super::pins::{pinned, Tier};
use super::step::{self, Bottleneck, KvRead, State, Unit};
use super::{
    ExpertCaches, ExpertSplit, LayerPrediction, MemoryUse, Placement, Plan, PlanError, PlanOptions,
    Source, TensorPlacement,
};

/// Driver overhead, sub-allocation rounding and scratch the estimate below does not see.
const VRAM_SLACK: u64 = 128 << 20;

/// Activations: f32 logits, a few dozen f32 vectors of the model width. An estimate: the
/// daemon should replace it with its measured allocations once the engine runs plans.
fn activation_bytes(model: &ModelDesc) -> u64 {
    let vocab = model
        .tensors
        .iter()
        .filter(|t| matches!(t.role, TensorRole::Embedding | TensorRole::Output))
        .map(|t| t.shape.get(1).copied().unwrap_or(0))
        .max()
        .unwrap_or(0);
    4 * vocab + 4 * 64 * model.n_embd + VRAM_SLACK
}

/// The most bytes one layer reads per token: its dense tensors and its `used` experts.
fn largest_layer_read(model: &ModelDesc) -> u64 {
    let n_groups = model.n_layer as usize + 1;
    let (count, used) = model
        .experts
        .as_ref()
        .map_or((1, 1), |r| (u64::from(r.count), u64::from(r.used)));
    let mut read = vec![0u64; n_groups];
    for t in &model.tensors {
        let g = t.role.layer().map_or(n_groups - 1, |l| l as usize);
        read[g] += match t.role {
            TensorRole::Embedding => 0,
            TensorRole::Experts { .. } => t.bytes / count * used,
            // One of `count` per-expert tensors: `used` of them are read, spread evenly.
            TensorRole::Expert { .. } => t.bytes * used / count,
            _ => t.bytes,
        };
    }
    read.into_iter().max().unwrap_or(0)
}

/// Layers of weights in flight: enough that a read's latency hides behind the compute of the
/// layers before it, at least double buffering, at most four.
fn prefetch_depth(profile: &HardwareProfile, units: &[Unit], n_layer: u32) -> u32 {
    let latency = profile.ssd.request_s + profile.pcie.copy_s + profile.gpu.submit_s;
    let compute: f64 = units.iter().map(|u| u.prob * u.gpu).sum::<f64>() / f64::from(n_layer);
    if compute <= 0.0 {
        return 2;
    }
    (1.0 + (latency / compute).ceil()).clamp(2.0, 4.0) as u32
}

/// Holds the most probably used non-VRAM units in RAM, up to `capacity` bytes.
fn fill_ram(units: &[Unit], tier: &[Tier], capacity: u64) -> Vec<bool> {
    let mut order: Vec<usize> = (0..units.len())
        .filter(|&i| tier[i] != Tier::Vram)
        .collect();
    order.sort_by(|&a, &b| {
        units[b]
            .prob
            .total_cmp(&units[a].prob)
            .then(units[a].group.cmp(&units[b].group))
    });
    let mut in_ram = vec![false; units.len()];
    let mut left = capacity;
    for i in order {
        if units[i].bytes <= left {
            left -= units[i].bytes;
            in_ram[i] = true;
        }
    }
    in_ram
}

#[derive(PartialEq)]
struct Candidate(f64, usize);

impl Eq for Candidate {}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> Ordering {
        // Highest density first; lower index first on ties, for deterministic plans.
        self.0
            .total_cmp(&other.0)
            .then_with(|| other.1.cmp(&self.1))
    }
}

/// Step 3: moves units into VRAM by saving per byte while `left` bytes remain.
fn promote(state: &mut State<'_>, candidates: &[usize], left: &mut u64) {
    let units = state.units;
    let density =
        |s: &mut State<'_>, i: usize| -s.delta(i, Tier::Vram, false) / units[i].bytes.max(1) as f64;
    let mut heap: BinaryHeap<Candidate> = candidates
        .iter()
        .map(|&i| Candidate(density(state, i), i))
        .collect();
    let mut requeued = vec![0u8; units.len()];
    while let Some(Candidate(_, i)) = heap.pop() {
        if units[i].bytes > *left || state.tier[i] == Tier::Vram {
            continue;
        }
        let fresh = density(state, i);
        if fresh <= 0.0 {
            continue;
        }
        // Lazy greedy: a stale entry whose saving shrank goes back in at its true place.
        if let Some(top) = heap.peek() {
            if fresh < top.0 && requeued[i] < 4 {
                requeued[i] += 1;
                heap.push(Candidate(fresh, i));
                continue;
            }
        }
        state.set(i, Tier::Vram, false);
        *left -= units[i].bytes;
    }
}

/// Step 4: per unit, the other of streaming and CPU where that shortens its layer.
fn balance(state: &mut State<'_>, movable: &[usize], may_stream: bool) {
    if !may_stream {
        return;
    }
    for _ in 0..2 {
        let mut moved = false;
        for &i in movable {
            let other = match state.tier[i] {
                Tier::Stream => Tier::Cpu,
                Tier::Cpu => Tier::Stream,
                Tier::Vram => continue,
            };
            let ram = state.in_ram[i];
            if state.delta(i, other, ram) < -1e-12 {
                state.set(i, other, ram);
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
}

/// Plans `model` on `profile` under `opts`.
pub fn plan(
    model: &ModelDesc,
    profile: &HardwareProfile,
    opts: &PlanOptions,
) -> Result<Plan, PlanError> {
    model.validate()?;
    for (which, budget, have) in [
        ("VRAM", opts.vram_budget, profile.gpu.memory),
        ("RAM", opts.ram_budget, profile.ram.memory),
    ] {
        if budget > have {
            return Err(PlanError::OverMachine {
                which,
                budget,
                have,
            });
        }
    }
    let tile = profile.best_tile();
    let mut notes = Vec::new();
    let pins: Vec<Option<(usize, Tier)>> = model
        .tensors
        .iter()
        .map(|t| pinned(&opts.pins, &t.name))
        .collect();
    for (i, p) in opts.pins.iter().enumerate() {
        if !pins.iter().flatten().any(|&(j, _)| j == i) {
            notes.push(format!("pin `{p}` matches no tensor"));
        }
    }
    let pin_of: Vec<Option<usize>> = pins.iter().map(|p| p.map(|(i, _)| i)).collect();
    let units = step::units(model, profile, tile, &pin_of);
    let pin = |u: &Unit| pins[u.tensors[0]].map(|(_, t)| t);
    if opts.cpu_only {
        return Ok(plan_cpu_only(
            model, profile, opts, &units, &pins, tile, notes,
        ));
    }

    let kv = opts.context * model.kv_bytes_per_token();
    let activations = activation_bytes(model);
    let depth = prefetch_depth(profile, &units, model.n_layer);
    let pinned_vram: u64 = units
        .iter()
        .filter(|u| pin(u) == Some(Tier::Vram))
        .map(|u| u.bytes)
        .sum();
    let pinned_stream = units.iter().any(|u| pin(u) == Some(Tier::Stream));
    let base = kv + activations + pinned_vram;
    let all_fit = !units
        .iter()
        .any(|u| matches!(pin(u), Some(Tier::Stream | Tier::Cpu)))
        && kv + activations + model.total_bytes() <= opts.vram_budget.0;
    // Two ways to run what VRAM does not hold: with staging slots, streamed or on the CPU;
    // without, on the CPU only. Each is planned where the budget allows, the faster kept.
    let staging = u64::from(depth) * largest_layer_read(model);
    let mut ways = Vec::new();
    if !pinned_stream {
        ways.push(0);
    }
    if !all_fit {
        ways.push(staging);
    }
    let feasible: Vec<u64> = ways
        .iter()
        .copied()
        .filter(|&st| base + st <= opts.vram_budget.0 && st <= opts.ram_budget.0)
        .collect();
    if feasible.is_empty() {
        let least = ways.iter().copied().min().unwrap_or(0);
        if base + least > opts.vram_budget.0 {
            return Err(vram_refusal(
                model,
                opts,
                kv,
                activations,
                least,
                pinned_vram,
            ));
        }
        return Err(PlanError::RamTooSmall {
            budget: opts.ram_budget,
            needed: ByteSize(least),
            fits: format!(
                "with {} of RAM, only plans without streamed tensors run: drop the stream pins",
                opts.ram_budget
            ),
        });
    }

    let kv_read = KvRead::of(model, profile, opts.context, false);
    let miss = 1.0 - opts.prefetch_accuracy.clamp(0.0, 1.0);
    let free: Vec<usize> = (0..units.len())
        .filter(|&i| pin(&units[i]).is_none() && !units[i].embedding)
        .collect();
    let pinned_tiers: Vec<Option<Tier>> = units.iter().map(pin).collect();
    let mut best: Option<(State<'_>, u64)> = None;
    for staging in feasible {
        let state = place(
            &Setting {
                model,
                profile,
                units: &units,
                pinned: &pinned_tiers,
                free: &free,
                kv_read,
                miss,
                may_stream: staging > 0,
                ram_capacity: opts.ram_budget.0 - staging,
            },
            opts.vram_budget.0 - base - staging,
        );
        let faster = best
            .as_ref()
            .is_none_or(|(b, _)| step_s(&state) < step_s(b));
        if faster {
            best = Some((state, staging));
        }
    }
    let (state, staging) = best.expect("at least one feasible way");

    Ok(assemble(
        model,
        profile,
        opts,
        &units,
        &state,
        &pins,
        Assembly {
            kv,
            activations,
            staging,
            ram_staging: staging,
            tile,
            depth,
            notes,
            all_fit,
        },
    ))
}

/// A step's seconds (its layers and, with a GPU, one submit) and the seconds its layers spent
/// bound by each resource, largest first.
pub(super) fn step_totals(
    layers: &[LayerPrediction],
    profile: &HardwareProfile,
    cpu_only: bool,
) -> (f64, Vec<(Bottleneck, f64)>) {
    let submit_s = if cpu_only { 0.0 } else { profile.gpu.submit_s };
    let step_s = layers.iter().map(|l| l.time.total_s).sum::<f64>() + submit_s;
    let mut bound: Vec<(Bottleneck, f64)> = Vec::new();
    for l in layers {
        match bound.iter_mut().find(|(b, _)| *b == l.time.bound) {
            Some((_, t)) => *t += l.time.total_s,
            None => bound.push((l.time.bound, l.time.total_s)),
        }
    }
    bound.sort_by(|x, y| y.1.total_cmp(&x.1));
    (step_s, bound)
}

/// The plan of a machine without a GPU: every tensor on the CPU, from RAM while the budget
/// lasts and from the SSD after; the KV cache in RAM. Pins cannot move anything (there is
/// nowhere else to go), so they are noted, not applied.
fn plan_cpu_only(
    model: &ModelDesc,
    profile: &HardwareProfile,
    opts: &PlanOptions,
    units: &[Unit],
    pins: &[Option<(usize, Tier)>],
    tile: ByteSize,
    mut notes: Vec<String>,
) -> Plan {
    if !opts.pins.is_empty() {
        notes.push(
            "a plan for the CPU alone places every tensor on the CPU: pins are ignored".into(),
        );
    }
    let tier = vec![Tier::Cpu; units.len()];
    let in_ram = fill_ram(units, &tier, opts.ram_budget.0);
    let kv = KvRead::of(model, profile, opts.context, true);
    let state = State::new(units, model, profile, tier, in_ram, kv, 0.0);
    let no_pins = vec![None; pins.len()];
    let mut plan = assemble(
        model,
        profile,
        opts,
        units,
        &state,
        &no_pins,
        Assembly {
            kv: 0,
            activations: 0,
            staging: 0,
            ram_staging: 0,
            tile,
            depth: 0,
            notes,
            all_fit: false,
        },
    );
    let kv_bytes = opts.context * model.kv_bytes_per_token();
    plan.ram.kv_cache = ByteSize(kv_bytes);
    plan.ram.total = ByteSize(plan.ram.total.0 + kv_bytes);
    plan
}

/// What one run of steps 2 to 4 works with.
struct Setting<'a> {
    model: &'a ModelDesc,
    profile: &'a HardwareProfile,
    units: &'a [Unit],
    pinned: &'a [Option<Tier>],
    /// Units the planner may move: not pinned, not the embedding.
    free: &'a [usize],
    kv_read: KvRead,
    miss: f64,
    /// Staging slots exist, so units may stream.
    may_stream: bool,
    ram_capacity: u64,
}

fn step_s(state: &State<'_>) -> f64 {
    state.groups.iter().map(|g| g.time().total_s).sum()
}

/// Steps 2 to 4 with `left` bytes of VRAM for weights beyond the pinned ones.
fn place<'a>(s: &Setting<'a>, mut left: u64) -> State<'a> {
    let units = s.units;
    // Step 2.
    let tier: Vec<Tier> = units
        .iter()
        .zip(s.pinned)
        .map(|(u, p)| match p {
            Some(t) => *t,
            None if u.embedding || !s.may_stream => Tier::Cpu,
            None if u.cpu < u.copy + u.gpu => Tier::Cpu,
            None => Tier::Stream,
        })
        .collect();
    let in_ram = fill_ram(units, &tier, s.ram_capacity);
    let new_state = |tier: Vec<Tier>, in_ram: Vec<bool>| {
        State::new(units, s.model, s.profile, tier, in_ram, s.kv_read, s.miss)
    };
    let mut state = new_state(tier, in_ram);

    // Step 3.
    let (core, rest): (Vec<usize>, Vec<usize>) = s.free.iter().partition(|&&i| units[i].core);
    promote(&mut state, &core, &mut left);
    promote(&mut state, &rest, &mut left);

    // Step 4, twice: what moved changes what RAM and the balance should hold.
    for _ in 0..2 {
        let in_ram = fill_ram(units, &state.tier, s.ram_capacity);
        state = new_state(state.tier.clone(), in_ram);
        balance(&mut state, s.free, s.may_stream);
        promote(&mut state, s.free, &mut left);
    }
    state
}

/// The smallest VRAM budget [`plan`] accepts for `model` with `opts`' pins and context (the
/// KV cache, activations and tensors pinned to VRAM, plus staging when pins stream tensors);
/// `opts.vram_budget` is ignored.
pub fn minimum_vram(
    model: &ModelDesc,
    profile: &HardwareProfile,
    opts: &PlanOptions,
) -> Result<ByteSize, PlanError> {
    let mut o = opts.clone();
    o.vram_budget = ByteSize(0);
    match plan(model, profile, &o) {
        Err(PlanError::VramTooSmall { needed, .. }) => Ok(needed),
        Err(e) => Err(e),
        Ok(_) => Ok(ByteSize(0)),
    }
}

fn vram_refusal(
    model: &ModelDesc,
    opts: &PlanOptions,
    kv: u64,
    activations: u64,
    staging: u64,
    pinned_vram: u64,
) -> PlanError {
    let budget = opts.vram_budget.0;
    let needed = kv + activations + staging + pinned_vram;
    let mut breakdown = format!(
        "KV cache {} for {} tokens, activations {}",
        ByteSize(kv),
        opts.context,
        ByteSize(activations)
    );
    if staging > 0 {
        breakdown.push_str(&format!(
            ", staging for streamed layers {}",
            ByteSize(staging)
        ));
    }
    if pinned_vram > 0 {
        breakdown.push_str(&format!(
            ", tensors pinned to VRAM {}",
            ByteSize(pinned_vram)
        ));
    }
    let mut fits = Vec::new();
    let per_token = model.kv_bytes_per_token().max(1);
    let other = activations + staging + pinned_vram;
    if budget > other {
        let tokens = (budget - other) / per_token;
        if tokens >= 256 {
            fits.push(format!(
                "a context of up to {tokens} tokens fits in {}",
                ByteSize(budget)
            ));
        }
    }
    if pinned_vram > 0 && budget >= needed - pinned_vram {
        fits.push(format!(
            "without the VRAM pins the model runs in {}",
            ByteSize(budget)
        ));
    }
    if fits.is_empty() {
        fits.push(format!(
            "nothing of this model fits in {}: give at least {}",
            ByteSize(budget),
            ByteSize(needed)
        ));
    }
    PlanError::VramTooSmall {
        budget: opts.vram_budget,
        needed: ByteSize(needed),
        breakdown,
        fits: fits.join("; or "),
    }
}

struct Assembly {
    kv: u64,
    activations: u64,
    staging: u64,
    ram_staging: u64,
    tile: ByteSize,
    depth: u32,
    notes: Vec<String>,
    all_fit: bool,
}

fn assemble(
    model: &ModelDesc,
    profile: &HardwareProfile,
    opts: &PlanOptions,
    units: &[Unit],
    state: &State<'_>,
    pins: &[Option<(usize, Tier)>],
    a: Assembly,
) -> Plan {
    let mut notes = a.notes;
    let source = |i: usize| {
        if state.in_ram[i] {
            Source::Ram
        } else {
            Source::Ssd
        }
    };
    let mut by_tensor: Vec<Vec<usize>> = vec![Vec::new(); model.tensors.len()];
    for (i, u) in units.iter().enumerate() {
        for &t in &u.tensors {
            by_tensor[t].push(i);
        }
    }
    let tensors = model
        .tensors
        .iter()
        .zip(&by_tensor)
        .enumerate()
        .map(|(ti, (t, us))| {
            let placement = if let TensorRole::Experts { .. } = t.role {
                let mut split = ExpertSplit::default();
                for &i in us {
                    let e = units[i].expert.unwrap_or(0);
                    match state.tier[i] {
                        Tier::Vram => split.vram.push(e),
                        Tier::Stream => split.stream.push(e),
                        Tier::Cpu => split.cpu.push(e),
                    }
                    if state.tier[i] != Tier::Vram && state.in_ram[i] {
                        split.in_ram.push(e);
                    }
                }
                Placement::Experts(split)
            } else {
                let i = us[0];
                match state.tier[i] {
                    Tier::Vram => Placement::Vram,
                    Tier::Stream => Placement::Stream { from: source(i) },
                    Tier::Cpu => Placement::Cpu { from: source(i) },
                }
            };
            TensorPlacement {
                name: t.name.clone(),
                role: t.role.label().to_string(),
                weight_type: t.weight_type.to_string(),
                bytes: t.bytes,
                pinned: pins[ti].map(|(p, _)| opts.pins[p].to_string()),
                placement,
            }
        })
        .collect();

    let sum = |f: &dyn Fn(usize) -> bool| -> u64 {
        (0..units.len())
            .filter(|&i| f(i))
            .map(|i| units[i].bytes)
            .sum()
    };
    let vram_w = sum(&|i| state.tier[i] == Tier::Vram && !units[i].routed);
    let vram_e = sum(&|i| state.tier[i] == Tier::Vram && units[i].routed);
    let ram_w = sum(&|i| state.tier[i] != Tier::Vram && state.in_ram[i] && !units[i].routed);
    let ram_e = sum(&|i| state.tier[i] != Tier::Vram && state.in_ram[i] && units[i].routed);
    let vram = MemoryUse {
        weights: ByteSize(vram_w),
        expert_cache: ByteSize(vram_e),
        kv_cache: ByteSize(a.kv),
        activations: ByteSize(a.activations),
        staging: ByteSize(a.staging),
        total: ByteSize(vram_w + vram_e + a.kv + a.activations + a.staging),
    };
    let ram = MemoryUse {
        weights: ByteSize(ram_w),
        expert_cache: ByteSize(ram_e),
        staging: ByteSize(a.ram_staging),
        total: ByteSize(ram_w + ram_e + a.ram_staging),
        ..MemoryUse::default()
    };

    let experts = model.experts.as_ref().map(|_| {
        // An expert is (layer, index); in VRAM when all its matrices are.
        let mut per: BTreeMap<(usize, u32), (bool, bool)> = BTreeMap::new();
        let (mut used, mut hit_vram, mut hit_ram) = (0.0, 0.0, 0.0);
        for (i, u) in units.iter().enumerate().filter(|(_, u)| u.routed) {
            let index = u.expert.unwrap_or(0);
            let e = per.entry((u.group, index)).or_insert((true, true));
            let v = state.tier[i] == Tier::Vram;
            e.0 &= v;
            e.1 &= v || state.in_ram[i];
            let w = u.prob * u.bytes as f64;
            used += w;
            if v {
                hit_vram += w;
            }
            if v || state.in_ram[i] {
                hit_ram += w;
            }
        }
        ExpertCaches {
            experts: per.len() as u64,
            in_vram: per.values().filter(|e| e.0).count() as u64,
            in_ram: per.values().filter(|e| !e.0 && e.1).count() as u64,
            vram_hit_rate: if used > 0.0 { hit_vram / used } else { 0.0 },
            ram_hit_rate: if used > 0.0 { hit_ram / used } else { 0.0 },
        }
    });

    let layers: Vec<LayerPrediction> = state
        .groups
        .iter()
        .enumerate()
        .map(|(g, grp)| LayerPrediction {
            name: if g < model.n_layer as usize {
                format!("blk.{g}")
            } else {
                "head".to_string()
            },
            time: grp.time(),
        })
        .collect();
    let (step_s, bound) = step_totals(&layers, profile, opts.cpu_only);

    if a.all_fit {
        notes.push("every weight fits in VRAM: no staging is reserved and nothing streams".into());
    }
    let from_ssd = (0..units.len())
        .filter(|&i| state.tier[i] != Tier::Vram && !state.in_ram[i])
        .count();
    if from_ssd > 0 {
        notes.push(format!(
            "{from_ssd} tensors or experts do not fit in the RAM budget and are read from the SSD when used"
        ));
    }
    notes.push("decode at batch 1; prefill is not modelled".into());

    Plan {
        model: model.name.clone(),
        profile: profile.key.device.clone(),
        vram_budget: opts.vram_budget,
        ram_budget: opts.ram_budget,
        context: opts.context,
        cpu_only: opts.cpu_only,
        tokens_per_s: 1.0 / step_s,
        step_s,
        bottleneck: bound.first().map_or(Bottleneck::Gpu, |b| b.0),
        bound_time_s: bound,
        tile: a.tile,
        prefetch_depth: a.depth,
        vram,
        ram,
        experts,
        tensors,
        layers,
        notes,
    }
}
