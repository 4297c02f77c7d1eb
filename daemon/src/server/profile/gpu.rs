//! The `Profile` RPC for a model on a Vulkan device: the prompt and then greedy decode steps,
//! each step timed per layer and op group by GPU timestamps (`gpu::forward::profile`).
//!
//! The GPU evaluates a prompt token by token: step 0 ("prefill") is the sum of its tokens'
//! steps (each row's time summed over the tokens, its start the first token's, its experts the
//! union). Rows are `device: "gpu"` on the track "gpu-compute" (MoE rows of a model with
//! experts on the CPU: `"both"`, their weight bytes still the GPU's), with `cache_hits` and
//! `cache_misses` for MoE layers from the expert counters (misses were computed on the CPU or
//! fetched). A chained step (some experts on the CPU) adds two host rows on the track
//! "engine", without a layer: "cpu_experts" and "host_wait", the host's totals for the step,
//! both placed at the step's start (the host does not time them per layer).
//!
//! Weight bytes, bytes moved and predicted times come from [`super::costs`]: a GPU row's
//! weight bytes are what the GPU read (a MoE row's: the router, the shared expert and the
//! experts run from VRAM), the host row "cpu_experts" carries the experts the CPU ran; MoE
//! rows carry the bytes copied into VRAM and, under a RAM budget, the bytes the RAM tier read
//! from the SSD for their CPU experts.
//!
//! Partial: without timestamps (`timestampValidBits` 0) the rows carry no GPU time; the host
//! rows are per-step totals, not per layer.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use spillway_proto::v1 as pb;
use spillway_sched::refine::ObservedProducts;

use super::costs::{Costs, ExpertSplit};
use super::ProfileJob;
use crate::engine::argmax;
use crate::gpu::forward::GpuStepProfile;
use crate::gpu::GpuError;
use crate::server::gpu::GpuSequence;
use crate::server::worker::Interrupt;

/// Where GPU rows run, and the host's.
const GPU_TRACK: &str = "gpu-compute";
const ENGINE_TRACK: &str = "engine";

/// One profiled step (or a prompt's steps summed).
#[derive(Debug, Clone)]
pub struct GpuStep {
    /// The (first) token's position.
    pub position: usize,
    pub tokens: usize,
    pub started: Instant,
    pub duration: Duration,
    pub profile: GpuStepProfile,
    /// Per layer: the experts some token chose, ascending.
    pub experts: Vec<BTreeSet<u32>>,
}

impl GpuStep {
    /// Adds `other`'s times, counters and experts to this one's (a prompt's next token).
    pub fn add(&mut self, other: &GpuStep) {
        self.tokens += other.tokens;
        self.duration += other.duration;
        let (p, q) = (&mut self.profile, &other.profile);
        for (r, s) in p.rows.iter_mut().zip(&q.rows) {
            r.gpu_ns = r.gpu_ns.zip(s.gpu_ns).map(|(a, b)| a + b);
            if let (Some(a), Some(b)) = (r.experts.as_mut(), s.experts) {
                a.add(&b);
            }
            r.ssd_bytes = r.ssd_bytes.zip(s.ssd_bytes).map(|(a, b)| a + b);
        }
        p.step_gpu_ns = p.step_gpu_ns.zip(q.step_gpu_ns).map(|(a, b)| a + b);
        p.workers.extend_from_slice(&q.workers);
        p.reads.extend_from_slice(&q.reads);
        // A token without experts on the CPU has no host time.
        match (p.host.as_mut(), q.host) {
            (Some(a), Some(b)) => {
                a.step_ns += b.step_ns;
                a.wait_ns += b.wait_ns;
                a.cpu_experts_ns += b.cpu_experts_ns;
                a.cpu_layers_ns += b.cpu_layers_ns;
                a.submit_ns += b.submit_ns;
            }
            (None, b) => p.host = b,
            (Some(_), None) => {}
        }
        for (a, b) in self.experts.iter_mut().zip(&other.experts) {
            a.extend(b);
        }
    }
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Step `index` (0: the prompt) as a message, its costs from `costs`; `origin` is when the
/// profile began.
pub fn gpu_step_message(
    index: usize,
    s: &GpuStep,
    origin: Instant,
    costs: &Costs,
    partial: bool,
) -> pb::ProfileStep {
    let mut rows: Vec<pb::ProfileRow> = s
        .profile
        .rows
        .iter()
        .map(|r| pb::ProfileRow {
            layer: r.layer.map(|l| l as u32),
            op: r.op.into(),
            device: "gpu".into(),
            measured_ns: r.gpu_ns.unwrap_or(0),
            start_ns: r.start_ns.unwrap_or(0),
            experts: r
                .layer
                .and_then(|l| s.experts.get(l))
                .map_or_else(Vec::new, |e| e.iter().copied().collect()),
            cache_hits: r.experts.map(|e| e.hits as u32),
            cache_misses: r.experts.map(|e| e.misses as u32),
            track: GPU_TRACK.into(),
            ..Default::default()
        })
        .collect();
    if let Some(h) = s.profile.host {
        let cpu_layers = (h.cpu_layers_ns > 0).then_some(("cpu_layers", h.cpu_layers_ns));
        let host_rows = [("cpu_experts", h.cpu_experts_ns), ("host_wait", h.wait_ns)];
        for (op, t) in host_rows.into_iter().chain(cpu_layers) {
            rows.push(pb::ProfileRow {
                op: op.into(),
                device: "cpu".into(),
                measured_ns: t,
                track: ENGINE_TRACK.into(),
                ..Default::default()
            });
        }
    }
    let mut msg = pb::ProfileStep {
        step: index as u32,
        phase: if index == 0 { "prefill" } else { "decode" }.into(),
        tokens: s.tokens as u32,
        start_ns: ns(s.started.saturating_duration_since(origin)),
        duration_ns: ns(s.duration),
        rows,
        totals: None,
        slices: slices(s),
    };
    let n_layer = s.experts.len();
    let (mut splits, mut ssd) = (vec![None; n_layer], vec![None; n_layer]);
    for r in &s.profile.rows {
        if let (Some(l), Some(e)) = (r.layer, r.experts) {
            splits[l] = Some(ExpertSplit::of(&e));
            ssd[l] = r.ssd_bytes;
        }
    }
    costs.annotate_gpu(&mut msg, s.position as u64, &splits, &ssd);
    if partial {
        // Some of these layers' experts run on the CPU.
        for r in msg.rows.iter_mut().filter(|r| r.op == "experts") {
            r.device = "both".into();
        }
    }
    msg
}

/// The step's CPU expert threads and SSD reads as trace slices, from the step's start: one
/// track per thread ("cpu-worker-N", 0 the model's own thread), each span an expert of a
/// layer; and the tile reader's ring ("io_uring"), each read an expert of a layer.
fn slices(s: &GpuStep) -> Vec<pb::TraceSlice> {
    let from = |t: Instant| ns(t.saturating_duration_since(s.started));
    let workers = s.profile.workers.iter().map(|(layer, w)| pb::TraceSlice {
        track: format!("cpu-worker-{}", w.thread),
        name: "cpu_experts".into(),
        layer: Some(*layer as u32),
        expert: w.label,
        start_ns: from(w.start),
        duration_ns: ns(w.end.saturating_duration_since(w.start)),
        bytes: 0,
    });
    let reads = s.profile.reads.iter().map(|r| pb::TraceSlice {
        track: "io_uring".into(),
        name: "read".into(),
        layer: Some(r.key.layer),
        expert: Some(r.key.expert),
        start_ns: from(r.issued),
        duration_ns: ns(r.done.saturating_duration_since(r.issued)),
        bytes: r.bytes,
    });
    workers.chain(reads).collect()
}

/// The totals of a GPU profile: device times are means per decode step ("gpu": between the
/// step's first and last timestamps; "cpu": the host's experts, for chained steps).
pub fn gpu_totals_message(
    prefill: &GpuStep,
    decode: &[GpuStep],
    layers: usize,
) -> pb::ProfileTotals {
    let per_s = |n: usize, d: Duration| {
        if d.is_zero() {
            0.0
        } else {
            n as f64 / d.as_secs_f64()
        }
    };
    let n = decode.len().max(1) as u64;
    let gpu: u64 = decode.iter().filter_map(|s| s.profile.step_gpu_ns).sum();
    let mut device_times = vec![pb::DeviceTime {
        device: "gpu".into(),
        ns: gpu / n,
    }];
    let host: Vec<_> = decode.iter().filter_map(|s| s.profile.host).collect();
    if !host.is_empty() {
        device_times.push(pb::DeviceTime {
            device: "cpu".into(),
            ns: host
                .iter()
                .map(|h| h.cpu_experts_ns + h.cpu_layers_ns)
                .sum::<u64>()
                / n,
        });
    }
    let decode_time: Duration = decode.iter().map(|s| s.duration).sum();
    pb::ProfileTotals {
        prompt_tokens: prefill.tokens as u32,
        decode_steps: decode.len() as u32,
        prefill_tokens_per_second: per_s(prefill.tokens, prefill.duration),
        decode_tokens_per_second: per_s(decode.len(), decode_time),
        device_times,
        cpu_bandwidth_bytes_per_second: 0.0,
        bottleneck: bottleneck(decode, gpu),
        layers: layers as u32,
        ..Default::default()
    }
}

/// What bounds the decode steps: the host's CPU experts when they take most of a step's time
/// (the GPU's experts rows then mostly wait for them), else the op (over all layers) that
/// takes the most GPU time.
fn bottleneck(decode: &[GpuStep], total: u64) -> String {
    let wall: u64 = decode.iter().map(|s| ns(s.duration)).sum();
    let cpu: u64 = decode
        .iter()
        .filter_map(|s| s.profile.host)
        .map(|h| h.cpu_experts_ns)
        .sum();
    let layers: u64 = decode
        .iter()
        .filter_map(|s| s.profile.host)
        .map(|h| h.cpu_layers_ns)
        .sum();
    if wall > 0 && 2 * layers > wall {
        return format!(
            "cpu layers: {:.0}% of a decode step on the host (the model's first layers, over the \
             VRAM budget)",
            100.0 * layers as f64 / wall as f64
        );
    }
    if wall > 0 && 2 * cpu > wall {
        return format!(
            "cpu experts: {:.0}% of a decode step on the host (the GPU's experts rows wait for them)",
            100.0 * cpu as f64 / wall as f64
        );
    }
    let mut by_op: Vec<(&str, u64)> = Vec::new();
    for r in decode.iter().flat_map(|s| &s.profile.rows) {
        match by_op.iter_mut().find(|(op, _)| *op == r.op) {
            Some(e) => e.1 += r.gpu_ns.unwrap_or(0),
            None => by_op.push((r.op, r.gpu_ns.unwrap_or(0))),
        }
    }
    match by_op.into_iter().max_by_key(|&(_, t)| t) {
        Some((op, t)) if total > 0 => {
            format!(
                "gpu {op}: {:.0}% of GPU time",
                100.0 * t as f64 / total as f64
            )
        }
        _ => "no GPU times (no decode step, or the device has no timestamps)".into(),
    }
}

/// Runs `job` on the GPU model: the prompt, then greedy decode steps, each sent as it
/// completes; the last carries the totals. Profiling is off again afterwards.
pub(crate) fn run(
    seq: &mut GpuSequence,
    job: &ProfileJob,
    check: &dyn Fn() -> Result<(), Interrupt>,
) -> Result<(), Interrupt> {
    let send = |msg: pb::ProfileStep| job.tx.blocking_send(Ok(msg)).map_err(|_| Interrupt::Gone);
    let costs = Costs::new(seq.model(), job.hardware.get());
    let mut seen = ObservedProducts::default();
    let gpu = seq.gpu_mut().map_err(fail)?;
    let partial = gpu.expert_stats().is_some_and(|e| e.slots < e.n_expert);
    let layers = gpu.config().n_layer;
    gpu.reset();
    gpu.set_profiling(true).map_err(fail)?;
    let result = (|| {
        let origin = Instant::now();
        let mut prefill: Option<GpuStep> = None;
        let mut next = 0;
        for &t in &job.prompt {
            check()?;
            let (logits, s) = step(seq, t)?;
            next = argmax(&logits) as u32;
            match prefill.as_mut() {
                Some(p) => p.add(&s),
                None => prefill = Some(s),
            }
        }
        let prefill = prefill.ok_or_else(|| fail_msg("the prompt is empty"))?;
        send(gpu_step_message(0, &prefill, origin, &costs, partial))?;
        let mut decode = Vec::with_capacity(job.steps);
        let mut sent = Vec::with_capacity(job.steps);
        for i in 1..=job.steps {
            check()?;
            let (logits, s) = step(seq, next)?;
            next = argmax(&logits) as u32;
            let mut msg = gpu_step_message(i, &s, origin, &costs, partial);
            costs.observe(&msg, &mut seen);
            decode.push(s);
            // Their rows, for the totals (not the trace slices, which can be many).
            sent.push(msg.rows.clone());
            if i == job.steps {
                let mut totals = gpu_totals_message(&prefill, &decode, layers);
                costs.complete_totals(&mut totals, &sent);
                msg.totals = Some(totals);
            }
            send(msg)?;
        }
        Ok(())
    })();
    if let Ok(gpu) = seq.gpu_mut() {
        let _ = gpu.set_profiling(false);
        gpu.reset();
    }
    if result.is_ok() {
        job.hardware.refine(&seen);
    }
    result
}

fn step(seq: &mut GpuSequence, token: u32) -> Result<(Vec<f32>, GpuStep), Interrupt> {
    let position = seq.gpu_mut().map_err(fail)?.position();
    let started = Instant::now();
    let logits = seq.eval_one(token).map_err(fail)?;
    let duration = started.elapsed();
    let gpu = seq.gpu_mut().map_err(fail)?;
    let profile = gpu
        .last_profile()
        .cloned()
        .ok_or_else(|| fail_msg("the step was not profiled"))?;
    let mut experts = vec![BTreeSet::new(); gpu.config().n_layer];
    for r in gpu.last_routing() {
        experts[r.layer].extend(r.experts.iter().map(|e| e.expert as u32));
    }
    let s = GpuStep {
        position,
        tokens: 1,
        started,
        duration,
        profile,
        experts,
    };
    Ok((logits, s))
}

fn fail(e: GpuError) -> Interrupt {
    if matches!(e, GpuError::DeviceLost) {
        // The worker reloads the model before its next request.
        return Interrupt::Fail(tonic::Status::unavailable(format!(
            "{e}: the model is being reloaded; retry shortly"
        )));
    }
    fail_msg(&e.to_string())
}

fn fail_msg(m: &str) -> Interrupt {
    Interrupt::Fail(tonic::Status::internal(m.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::expert_cache::LayerExpertStats;
    use crate::gpu::forward::{GpuProfileRow, HostTime};

    fn step(origin: Instant, gpu_ns: u64, hits: u64, expert: u32) -> GpuStep {
        let row = |layer, op, start| GpuProfileRow {
            layer,
            op,
            gpu_ns: Some(gpu_ns),
            start_ns: Some(start),
            experts: (op == "experts").then_some(LayerExpertStats {
                hits,
                misses: 1,
                cpu: 1,
                ..Default::default()
            }),
            ssd_bytes: None,
        };
        GpuStep {
            position: 0,
            tokens: 1,
            started: origin + Duration::from_micros(3),
            duration: Duration::from_micros(10),
            profile: GpuStepProfile {
                rows: vec![
                    row(None, "embedding", 0),
                    row(Some(0), "attention", 10),
                    row(Some(0), "experts", 20),
                    row(None, "output_head", 30),
                ],
                step_gpu_ns: Some(4 * gpu_ns),
                host: Some(HostTime {
                    step_ns: 9,
                    wait_ns: 5,
                    cpu_experts_ns: 4,
                    cpu_layers_ns: 0,
                    submit_ns: 0,
                }),
                submissions_gpu_ns: None,
                workers: Vec::new(),
                reads: Vec::new(),
            },
            experts: vec![BTreeSet::from([expert])],
        }
    }

    /// A prompt's tokens add up into step 0: times, counters and experts; starts are the first
    /// token's.
    #[test]
    fn a_prompt_sums_its_tokens_rows() {
        let origin = Instant::now();
        let mut p = step(origin, 100, 2, 7);
        // The first token ran no expert on the CPU: the host time is the second's.
        let host = p.profile.host.take();
        p.add(&step(origin, 50, 3, 1));
        assert_eq!(p.profile.host, host);
        p.profile.host = host.map(|h| HostTime {
            step_ns: 2 * h.step_ns,
            wait_ns: 2 * h.wait_ns,
            cpu_experts_ns: 2 * h.cpu_experts_ns,
            cpu_layers_ns: 0,
            submit_ns: 0,
        });
        let (_dir, model) = super::super::costs::tests::tiny_moe();
        let m = gpu_step_message(0, &p, origin, &Costs::new(&model, None), false);
        assert_eq!(
            (m.phase.as_str(), m.tokens, m.start_ns),
            ("prefill", 2, 3_000)
        );
        assert_eq!(m.duration_ns, 20_000);
        let gpu: Vec<_> = m.rows.iter().filter(|r| r.device == "gpu").collect();
        assert_eq!(gpu.len(), 4);
        assert!(gpu
            .iter()
            .all(|r| r.track == "gpu-compute" && r.measured_ns == 150));
        let e = gpu[2];
        assert_eq!(
            (e.layer, e.op.as_str(), e.start_ns),
            (Some(0), "experts", 20)
        );
        assert_eq!((e.cache_hits, e.cache_misses), (Some(5), Some(2)));
        assert_eq!(e.experts, [1, 7]);
        assert_eq!(gpu[1].cache_hits, None);
        let host: Vec<_> = m
            .rows
            .iter()
            .filter(|r| r.track == "engine")
            .map(|r| (r.op.as_str(), r.device.as_str(), r.measured_ns))
            .collect();
        assert_eq!(host, [("cpu_experts", "cpu", 8), ("host_wait", "cpu", 10)]);

        let mut decode = [step(origin, 100, 2, 7), step(origin, 300, 2, 7)];
        decode[0].profile.rows[2].gpu_ns = Some(500);
        let t = gpu_totals_message(&p, &decode, 1);
        assert_eq!((t.prompt_tokens, t.decode_steps, t.layers), (2, 2, 1));
        assert_eq!(t.device_times[0].device, "gpu");
        assert_eq!(t.device_times[0].ns, 800);
        assert_eq!(
            (t.device_times[1].device.as_str(), t.device_times[1].ns),
            ("cpu", 4)
        );
        assert!(
            t.bottleneck.starts_with("gpu experts: 50% of GPU time"),
            "{}",
            t.bottleneck
        );
    }
}
