//! The `Profile` RPC on the model's worker: the prompt and then greedy decode steps of one
//! sequence, each step timed per layer and op group by the engine (`engine::profile`) and sent
//! as it completes; the last message carries the totals.
//!
//! A profile runs alone on the worker: requests already decoding wait for it (it is a
//! diagnostic, and sharing the steps would blur its numbers).
//!
//! Models on a Vulkan device are profiled from GPU timestamps instead ([`gpu`]).
//!
//! Predicted times and bandwidth limits come from [`costs`] when the daemon has a hardware
//! profile. Each step carries its thread pool's spans as trace slices ("cpu-worker-N").
//!
//! Partial: on the CPU engine, bytes moved between tiers and expert-cache hits are unset: its
//! weights come from the memory map, whose page faults the OS serves uncounted.

pub mod costs;
pub mod gpu;

use std::sync::Arc;
use std::time::{Duration, Instant};

use spillway_proto::v1 as pb;
use tokio::sync::mpsc;
use tonic::Status;

use super::hardware::HardwareCell;
use crate::engine::profile::{ProfileSummary, StepProfile};

/// What a profile stream carries.
pub type ProfileItem = Result<pb::ProfileStep, Status>;

/// One validated profile request.
pub struct ProfileJob {
    pub prompt: Vec<u32>,
    pub steps: usize,
    pub deadline: Option<Instant>,
    pub tx: mpsc::Sender<ProfileItem>,
    /// What predicted times and bandwidth limits come from (`--hardware-profile`), refined by
    /// the job's decode steps.
    pub hardware: Arc<HardwareCell>,
}

/// Where the CPU engine's records run: the model's worker thread.
const ENGINE_TRACK: &str = "engine";

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Step `index` (0: the prompt) as a message; `origin` is when the profile began.
pub fn step_message(index: usize, p: &StepProfile, origin: Instant) -> pb::ProfileStep {
    pb::ProfileStep {
        step: index as u32,
        phase: if index == 0 { "prefill" } else { "decode" }.into(),
        tokens: p.tokens as u32,
        start_ns: p
            .started
            .map_or(0, |s| ns(s.saturating_duration_since(origin))),
        duration_ns: ns(p.duration),
        rows: p
            .ops
            .iter()
            .map(|o| pb::ProfileRow {
                layer: o.layer.map(|l| l as u32),
                op: o.op.name().into(),
                device: "cpu".into(),
                weight_bytes: o.weight_bytes,
                measured_ns: ns(o.duration),
                start_ns: ns(o.start),
                experts: o.experts.clone(),
                track: ENGINE_TRACK.into(),
                ..Default::default()
            })
            .collect(),
        totals: None,
        slices: worker_slices(p),
    }
}

/// The step's pool spans as trace slices on one track per thread, each named after the op
/// group it ran in (by its start) and labelled with its expert.
fn worker_slices(p: &StepProfile) -> Vec<pb::TraceSlice> {
    let Some(started) = p.started else {
        return Vec::new();
    };
    p.workers
        .iter()
        .map(|w| {
            let start = w.start.saturating_duration_since(started);
            let op = p
                .ops
                .iter()
                .find(|o| o.start <= start && start < o.start + o.duration);
            pb::TraceSlice {
                track: format!("cpu-worker-{}", w.thread),
                name: op.map_or("", |o| o.op.name()).into(),
                layer: op.and_then(|o| o.layer).map(|l| l as u32),
                expert: w.label,
                start_ns: ns(start),
                duration_ns: ns(w.end.saturating_duration_since(w.start)),
                bytes: 0,
            }
        })
        .collect()
}

/// The totals of a profile's prompt and decode steps.
pub fn totals_message(
    prefill: &StepProfile,
    decode: &[StepProfile],
    layers: usize,
) -> pb::ProfileTotals {
    let s = ProfileSummary::new(prefill, decode);
    pb::ProfileTotals {
        prompt_tokens: s.prompt_tokens as u32,
        decode_steps: s.decode_steps as u32,
        prefill_tokens_per_second: s.prefill_tokens_per_second,
        decode_tokens_per_second: s.decode_tokens_per_second,
        device_times: vec![pb::DeviceTime {
            device: "cpu".into(),
            ns: ns(s.mean_step),
        }],
        cpu_bandwidth_bytes_per_second: s.cpu_bandwidth,
        bottleneck: s.bottleneck,
        layers: layers as u32,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::profile::{OpGroup, OpRecord};

    #[test]
    fn a_step_message_keeps_every_record_in_order() {
        let origin = Instant::now();
        let mut p = StepProfile::default();
        (p.tokens, p.started, p.duration, p.ops) = (
            1,
            Some(origin + Duration::from_micros(5)),
            Duration::from_micros(30),
            vec![
                OpRecord {
                    layer: Some(1),
                    op: OpGroup::Experts,
                    start: Duration::from_micros(2),
                    duration: Duration::from_micros(20),
                    weight_bytes: 99,
                    experts: vec![2, 5],
                },
                OpRecord {
                    layer: None,
                    op: OpGroup::OutputHead,
                    start: Duration::from_micros(22),
                    duration: Duration::from_micros(3),
                    weight_bytes: 7,
                    experts: Vec::new(),
                },
            ],
        );
        let m = step_message(2, &p, origin);
        assert_eq!((m.step, m.phase.as_str(), m.tokens), (2, "decode", 1));
        assert_eq!((m.start_ns, m.duration_ns), (5_000, 30_000));
        let r = &m.rows[0];
        assert_eq!(
            (r.layer, r.op.as_str(), r.device.as_str()),
            (Some(1), "experts", "cpu")
        );
        assert_eq!(
            (r.start_ns, r.measured_ns, r.weight_bytes),
            (2_000, 20_000, 99)
        );
        assert_eq!(r.experts, [2, 5]);
        assert_eq!((r.predicted_ns, r.cache_hits), (None, None));
        assert_eq!(m.rows[1].layer, None);
        let t = totals_message(&StepProfile::default(), std::slice::from_ref(&p), 2);
        assert_eq!((t.decode_steps, t.layers), (1, 2));
        assert_eq!(t.device_times[0].ns, 30_000);
        assert!(t.bottleneck.contains("experts"), "{}", t.bottleneck);
    }
}
