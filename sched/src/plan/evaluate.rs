//! Re-predicting a given placement: per-layer times of a plan on another profile (a refined
//! one, or the machine the plan was not made for), to compare with measured layer times.

use std::collections::{BTreeMap, HashSet};

use crate::model::ModelDesc;
use crate::predict::AccuracyReport;
use crate::profile::HardwareProfile;

use super::pins::Tier;
use super::step::{self, KvRead, State};
use super::{Bottleneck, ExpertSplit, LayerPrediction, Placement, Plan, PlanOptions, Source};

/// Per-layer predicted times of `plan`'s placement of `model` on `profile`, in the order of
/// [`Plan::layers`]. `None` when the plan does not describe this model.
pub fn layer_times(
    plan: &Plan,
    model: &ModelDesc,
    profile: &HardwareProfile,
    opts: &PlanOptions,
) -> Option<Vec<LayerPrediction>> {
    if plan.tensors.len() != model.tensors.len()
        || plan
            .tensors
            .iter()
            .zip(&model.tensors)
            .any(|(p, t)| p.name != t.name)
    {
        return None;
    }
    // Bundle experts as the planner did: by pin.
    let mut pin_ids: BTreeMap<&str, usize> = BTreeMap::new();
    let pin_of: Vec<Option<usize>> = plan
        .tensors
        .iter()
        .map(|t| {
            t.pinned.as_deref().map(|p| {
                let n = pin_ids.len();
                *pin_ids.entry(p).or_insert(n)
            })
        })
        .collect();
    let units = step::units(model, profile, plan.tile, &pin_of);
    let sets: Vec<Option<[HashSet<u32>; 4]>> = plan
        .tensors
        .iter()
        .map(|t| match &t.placement {
            Placement::Experts(e) => {
                Some([&e.vram, &e.stream, &e.cpu, &e.in_ram].map(|v| v.iter().copied().collect()))
            }
            _ => None,
        })
        .collect();
    let (mut tier, mut in_ram) = (Vec::new(), Vec::new());
    for u in &units {
        let t = u.tensors[0];
        let (ti, ram) = match (&plan.tensors[t].placement, &sets[t], u.expert) {
            (Placement::Vram, _, _) => (Tier::Vram, false),
            (Placement::Stream { from }, _, _) => (Tier::Stream, *from == Source::Ram),
            (Placement::Cpu { from }, _, _) => (Tier::Cpu, *from == Source::Ram),
            (Placement::Experts(_), Some(s), Some(e)) => {
                let tier = if s[0].contains(&e) {
                    Tier::Vram
                } else if s[1].contains(&e) {
                    Tier::Stream
                } else {
                    Tier::Cpu
                };
                (tier, s[3].contains(&e))
            }
            _ => return None,
        };
        tier.push(ti);
        in_ram.push(ram);
    }
    let kv = KvRead::of(model, profile, opts.context, plan.cpu_only);
    let miss = 1.0 - opts.prefetch_accuracy.clamp(0.0, 1.0);
    let state = State::new(&units, model, profile, tier, in_ram, kv, miss);
    Some(
        state
            .groups
            .iter()
            .zip(&plan.layers)
            .map(|(g, l)| LayerPrediction {
                name: l.name.clone(),
                time: g.time(),
            })
            .collect(),
    )
}

/// Scores a plan's per-layer predictions against measured layer times (seconds, by layer
/// name as in [`Plan::layers`]); layers without a measurement are left out.
pub fn layer_accuracy(plan: &Plan, measured: &BTreeMap<String, f64>) -> Option<AccuracyReport> {
    AccuracyReport::from_pairs(
        plan.layers
            .iter()
            .filter_map(|l| measured.get(&l.name).map(|&m| (l.time.total_s, m))),
    )
}

/// `plan` with the placement the daemon's GPU runs today instead of the planner's: every tensor
/// but the routed experts in VRAM, and in each MoE layer experts `0..resident` in VRAM and the
/// others on the CPU from RAM, re-predicted on `profile`. For scoring the predictors against
/// that placement's measured layers; the memory figures stay the planner's. `None` when the
/// plan does not describe this model.
pub fn with_resident_experts(
    plan: &Plan,
    model: &ModelDesc,
    profile: &HardwareProfile,
    opts: &PlanOptions,
    resident: u32,
) -> Option<Plan> {
    let mut out = plan.clone();
    for t in &mut out.tensors {
        t.placement = match &t.placement {
            Placement::Experts(_) => {
                let n = model.expert_count();
                let cpu: Vec<u32> = (resident.min(n)..n).collect();
                Placement::Experts(ExpertSplit {
                    vram: (0..resident.min(n)).collect(),
                    stream: Vec::new(),
                    in_ram: cpu.clone(),
                    cpu,
                })
            }
            _ => Placement::Vram,
        };
        t.pinned = None;
    }
    out.layers = layer_times(&out, model, profile, opts)?;
    let (step_s, bound) = super::greedy::step_totals(&out.layers, profile, out.cpu_only);
    out.step_s = step_s;
    out.tokens_per_s = 1.0 / step_s;
    out.bottleneck = bound.first().map_or(Bottleneck::Gpu, |b| b.0);
    out.bound_time_s = bound;
    out.notes.push(format!(
        "placement fixed, not planned: {resident} routed experts per layer in VRAM, the others on the CPU"
    ));
    Some(out)
}
