//! Per-layer profiling of the CPU forward pass: wall time, weight bytes and chosen experts of
//! every op group of every layer, for one step (a prompt or a decode step) at a time.
//!
//! The forward pass takes an optional [`StepProfile`]. Its timers are laps: each op group's
//! time runs from the end of the previous one, so the groups of a step cover the whole forward
//! pass without gaps (a group's time includes the norms and residual adds just before it). With
//! no profile nothing is timed and no bytes are counted: one untaken branch per op group.
//!
//! The GPU's decode step has its own timestamps (`gpu::forward::profile`).
//!
//! A profiled step also traces the thread pool ([`crate::cpu::ThreadPool::set_tracing`]): what
//! each of its threads ran, a span per job (per expert in a MoE layer's grouped products).
//!
//! Partial: `weight_bytes` counts weight matrices only (not the KV cache or activations); the
//! CPU engine reads its weights through the memory map, so it moves no bytes between tiers
//! that it could count. Predicted times are the server's (`server::profile::costs`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::cpu::{ThreadPool, WorkerSpan};

/// What part of the forward pass a record times.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpGroup {
    /// Embedding rows and RoPE angles of the step's tokens.
    Embedding,
    /// Attention norm and the Q, K, V projections (with biases).
    Qkv,
    /// QK-norm, RoPE and the KV-cache append.
    RopeCache,
    /// Scores, softmax and the weighted sum of values over the cache.
    Attention,
    /// The attention output projection and its residual add.
    AttnOutput,
    /// A dense layer's FFN norm, gate, up, SwiGLU, down and residual add.
    Ffn,
    /// A MoE layer's FFN norm, router and routing.
    Router,
    /// The routed experts and their weighted sum.
    Experts,
    /// Qwen2-MoE's gated shared expert.
    SharedExpert,
    /// The output norm and the output matrix (logits).
    OutputHead,
}

impl OpGroup {
    pub const ALL: [OpGroup; 10] = [
        OpGroup::Embedding,
        OpGroup::Qkv,
        OpGroup::RopeCache,
        OpGroup::Attention,
        OpGroup::AttnOutput,
        OpGroup::Ffn,
        OpGroup::Router,
        OpGroup::Experts,
        OpGroup::SharedExpert,
        OpGroup::OutputHead,
    ];

    /// The name reports and the protocol use.
    pub fn name(self) -> &'static str {
        match self {
            OpGroup::Embedding => "embedding",
            OpGroup::Qkv => "qkv",
            OpGroup::RopeCache => "rope_cache",
            OpGroup::Attention => "attention",
            OpGroup::AttnOutput => "attn_output",
            OpGroup::Ffn => "ffn",
            OpGroup::Router => "router",
            OpGroup::Experts => "experts",
            OpGroup::SharedExpert => "shared_expert",
            OpGroup::OutputHead => "output_head",
        }
    }
}

/// One op group of one layer in one step.
#[derive(Debug, Clone, PartialEq)]
pub struct OpRecord {
    /// `None` for the embedding and the output head.
    pub layer: Option<usize>,
    pub op: OpGroup,
    /// From the step's start.
    pub start: Duration,
    pub duration: Duration,
    /// Bytes of the weight matrices the group read (for experts: those of the chosen ones).
    pub weight_bytes: u64,
    /// MoE layers' routed experts: every expert some token of the step chose, ascending.
    pub experts: Vec<u32>,
}

/// The records of one step. Give it to an engine's `*_with` evaluation to fill it.
#[derive(Debug, Clone, Default)]
pub struct StepProfile {
    /// Tokens the step evaluated.
    pub tokens: usize,
    /// When the step began (the engine call).
    pub started: Option<Instant>,
    /// The engine call's wall time.
    pub duration: Duration,
    pub ops: Vec<OpRecord>,
    /// What each thread of the pool ran during the step (the caller's thread is 0).
    pub workers: Vec<WorkerSpan>,
    /// End of the last lap.
    mark: Option<Instant>,
}

impl StepProfile {
    /// Starts the step's clock and `pool`'s tracing; records of an earlier step are dropped.
    pub(super) fn begin(&mut self, tokens: usize, pool: &ThreadPool) {
        pool.set_tracing(true);
        let now = Instant::now();
        *self = StepProfile {
            tokens,
            started: Some(now),
            mark: Some(now),
            ..StepProfile::default()
        };
    }

    /// Restarts the lap clock (the forward pass begins; a prompt may take several).
    pub(super) fn mark(&mut self) {
        self.mark = Some(Instant::now());
    }

    /// Records the time since the last lap as `op` of `layer`.
    pub(super) fn lap(
        &mut self,
        layer: Option<usize>,
        op: OpGroup,
        weight_bytes: u64,
        experts: Vec<u32>,
    ) {
        let now = Instant::now();
        let started = self.started.unwrap_or(now);
        let mark = self.mark.unwrap_or(now);
        self.ops.push(OpRecord {
            layer,
            op,
            start: mark.saturating_duration_since(started),
            duration: now.saturating_duration_since(mark),
            weight_bytes,
            experts,
        });
        self.mark = Some(now);
    }

    /// Stops the step's clock.
    /// Stops the clock, and `pool`'s tracing, keeping what its threads ran.
    pub(super) fn finish(&mut self, pool: &ThreadPool) {
        if let Some(s) = self.started {
            self.duration = s.elapsed();
        }
        self.workers = pool.take_spans();
        pool.set_tracing(false);
    }

    /// The records' durations together.
    pub fn ops_duration(&self) -> Duration {
        self.ops.iter().map(|o| o.duration).sum()
    }

    pub fn weight_bytes(&self) -> u64 {
        self.ops.iter().map(|o| o.weight_bytes).sum()
    }
}

/// The forward pass's handle on an optional profile. `lap`'s arguments are closures so that
/// nothing is computed when profiling is off.
pub(super) struct Laps<'a>(pub Option<&'a mut StepProfile>);

impl Laps<'_> {
    #[inline]
    pub fn mark(&mut self) {
        if let Some(p) = self.0.as_deref_mut() {
            p.mark();
        }
    }

    #[inline]
    pub fn lap(&mut self, layer: Option<usize>, op: OpGroup, weight_bytes: impl FnOnce() -> u64) {
        if let Some(p) = self.0.as_deref_mut() {
            p.lap(layer, op, weight_bytes(), Vec::new());
        }
    }

    /// [`Laps::lap`] for routed experts: `chosen` gives every (token, rank)'s expert.
    #[inline]
    pub fn lap_experts(
        &mut self,
        layer: usize,
        chosen: &[usize],
        weight_bytes_per_expert: impl FnOnce() -> u64,
    ) {
        if let Some(p) = self.0.as_deref_mut() {
            let mut experts: Vec<u32> = chosen.iter().map(|&e| e as u32).collect();
            experts.sort_unstable();
            experts.dedup();
            let bytes = weight_bytes_per_expert() * experts.len() as u64;
            p.lap(Some(layer), OpGroup::Experts, bytes, experts);
        }
    }
}

/// One op group of one layer over several decode steps.
#[derive(Debug, Clone, PartialEq)]
pub struct OpSummary {
    pub layer: Option<usize>,
    pub op: OpGroup,
    pub mean: Duration,
    /// Of the mean decode step's time.
    pub share: f64,
    pub mean_weight_bytes: f64,
}

/// What a profile of a prompt and some decode steps amounts to.
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileSummary {
    pub prompt_tokens: usize,
    pub prefill_tokens_per_second: f64,
    pub decode_steps: usize,
    pub decode_tokens_per_second: f64,
    /// Mean time of a decode step.
    pub mean_step: Duration,
    /// Weight bytes over their op groups' time, in decode steps: the CPU's achieved memory
    /// bandwidth, bytes/s.
    pub cpu_bandwidth: f64,
    /// Per op group and layer, in forward order.
    pub ops: Vec<OpSummary>,
    /// Which op group takes the most of a decode step, in one line.
    pub bottleneck: String,
}

impl ProfileSummary {
    /// Summarises a prompt's step and the decode steps after it.
    pub fn new(prefill: &StepProfile, decode: &[StepProfile]) -> ProfileSummary {
        let per_s = |n: usize, d: Duration| {
            if d.is_zero() {
                0.0
            } else {
                n as f64 / d.as_secs_f64()
            }
        };
        let decode_time: Duration = decode.iter().map(|s| s.duration).sum();
        let decode_tokens: usize = decode.iter().map(|s| s.tokens).sum();
        let n = decode.len().max(1) as u32;
        let mean_step = decode_time / n;

        // Forward order: the order of the first step's records.
        let mut order: Vec<(Option<usize>, OpGroup)> = Vec::new();
        let mut sums: BTreeMap<(Option<usize>, OpGroup), (Duration, u64)> = BTreeMap::new();
        for op in decode.iter().flat_map(|s| &s.ops) {
            let key = (op.layer, op.op);
            let e = sums.entry(key).or_insert_with(|| {
                order.push(key);
                (Duration::ZERO, 0)
            });
            e.0 += op.duration;
            e.1 += op.weight_bytes;
        }
        let ops: Vec<OpSummary> = order
            .iter()
            .map(|&(layer, op)| {
                let (time, bytes) = sums[&(layer, op)];
                OpSummary {
                    layer,
                    op,
                    mean: time / n,
                    share: ratio(time.as_secs_f64(), decode_time.as_secs_f64()),
                    mean_weight_bytes: bytes as f64 / f64::from(n),
                }
            })
            .collect();
        let (op_time, op_bytes) = sums
            .values()
            .fold((Duration::ZERO, 0u64), |(t, b), &(dt, db)| (t + dt, b + db));
        ProfileSummary {
            prompt_tokens: prefill.tokens,
            prefill_tokens_per_second: per_s(prefill.tokens, prefill.duration),
            decode_steps: decode.len(),
            decode_tokens_per_second: per_s(decode_tokens, decode_time),
            mean_step,
            cpu_bandwidth: ratio(op_bytes as f64, op_time.as_secs_f64()),
            bottleneck: bottleneck(&sums, decode_time),
            ops,
        }
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Names the op group (over all layers) that takes the most decode time, and whether it is
/// bound by reading weights.
fn bottleneck(
    sums: &BTreeMap<(Option<usize>, OpGroup), (Duration, u64)>,
    total: Duration,
) -> String {
    let mut by_op: BTreeMap<OpGroup, (Duration, u64)> = BTreeMap::new();
    for (&(_, op), &(t, b)) in sums {
        let e = by_op.entry(op).or_default();
        e.0 += t;
        e.1 += b;
    }
    let Some((op, (time, bytes))) = by_op.into_iter().max_by_key(|(_, (t, _))| *t) else {
        return "no decode step was profiled".into();
    };
    let share = 100.0 * ratio(time.as_secs_f64(), total.as_secs_f64());
    if bytes > 0 {
        let gbps = ratio(bytes as f64, time.as_secs_f64()) / 1e9;
        format!(
            "cpu {}: {share:.0}% of a decode step, reading its weights at {gbps:.2} GB/s",
            op.name()
        )
    } else {
        format!(
            "cpu {}: {share:.0}% of a decode step (no weights: activations and the KV cache)",
            op.name()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(layer: Option<usize>, op: OpGroup, us: u64, bytes: u64) -> OpRecord {
        OpRecord {
            layer,
            op,
            start: Duration::ZERO,
            duration: Duration::from_micros(us),
            weight_bytes: bytes,
            experts: Vec::new(),
        }
    }

    fn step(us: u64, ops: Vec<OpRecord>) -> StepProfile {
        StepProfile {
            tokens: 1,
            duration: Duration::from_micros(us),
            ops,
            ..StepProfile::default()
        }
    }

    #[test]
    fn a_summary_averages_steps_and_names_the_largest_op_group() {
        let ops = |e: u64| {
            vec![
                record(Some(0), OpGroup::Qkv, 10, 1000),
                record(Some(0), OpGroup::Experts, e, 4000),
                record(None, OpGroup::OutputHead, 10, 1000),
            ]
        };
        let decode = [step(100, ops(80)), step(60, ops(40))];
        let prefill = StepProfile {
            tokens: 4,
            duration: Duration::from_millis(2),
            ..StepProfile::default()
        };
        let s = ProfileSummary::new(&prefill, &decode);
        assert_eq!(s.decode_steps, 2);
        assert_eq!(s.mean_step, Duration::from_micros(80));
        assert!((s.decode_tokens_per_second - 2.0 / 160e-6).abs() < 1e-6);
        assert!((s.prefill_tokens_per_second - 2000.0).abs() < 1e-9);
        let keys: Vec<_> = s.ops.iter().map(|o| (o.layer, o.op)).collect();
        assert_eq!(
            keys,
            [
                (Some(0), OpGroup::Qkv),
                (Some(0), OpGroup::Experts),
                (None, OpGroup::OutputHead)
            ]
        );
        assert_eq!(s.ops[1].mean, Duration::from_micros(60));
        assert!((s.ops[1].share - 120.0 / 160.0).abs() < 1e-9);
        // 12 000 bytes in 160 µs of op time.
        assert!((s.cpu_bandwidth - 12_000.0 / 160e-6).abs() < 1e-3);
        assert!(
            s.bottleneck.starts_with("cpu experts: 75%"),
            "{}",
            s.bottleneck
        );
    }

    #[test]
    fn laps_are_contiguous_and_expert_lists_distinct() {
        let pool = ThreadPool::new(1);
        let mut p = StepProfile::default();
        p.begin(2, &pool);
        let mut laps = Laps(Some(&mut p));
        laps.mark();
        laps.lap(None, OpGroup::Embedding, || 7);
        laps.lap_experts(0, &[3, 1, 3, 2], || 10);
        p.finish(&pool);
        assert_eq!(p.ops.len(), 2);
        assert_eq!(p.ops[1].start, p.ops[0].start + p.ops[0].duration);
        assert_eq!(p.ops[1].experts, [1, 2, 3]);
        assert_eq!(p.ops[1].weight_bytes, 30);
        assert!(p.ops_duration() <= p.duration);
    }

    #[test]
    fn without_a_profile_nothing_is_computed() {
        let mut laps = Laps(None);
        laps.lap(None, OpGroup::Embedding, || {
            unreachable!("bytes computed while off")
        });
        laps.lap_experts(0, &[1], || unreachable!("bytes computed while off"));
    }
}
