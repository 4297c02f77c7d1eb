//! Per-layer GPU timestamps of a decode step ([`GpuModel::set_profiling`]).
//!
//! With profiling on, the step writes a timestamp (stage `ALL_COMMANDS`: once everything
//! recorded before it has completed) where each op group begins, and one after the last: the
//! groups are the embedding, each layer's attention (norm, Q/K/V, RoPE, KV store, attention,
//! output projection and residual) and its FFN (a dense layer's, or a MoE layer's norm,
//! router, experts and shared expert), and the output head. A group ends where the next one
//! begins, so every nanosecond of the step belongs to exactly one group: time the device spends
//! between two groups' commands (barriers, or on a CPU device a thread the OS preempted) is
//! the earlier group's, not lost between them. The queries live in one pool, created when
//! profiling is turned on and sized for the step (one per group and one for the end); the
//! first command buffer of each step resets it. With profiling off no timestamp is written and
//! no pool exists.
//!
//! A MoE layer routed on the host spans command buffers (the router's, the experts', the CPU
//! sum's): its FFN time runs from its first command buffer to the next group's, so it includes
//! the host's routing, the CPU's experts and the waits between them. The host's side of a
//! chained step is [`GpuStepProfile::host`].
//!
//! A prompt chunk ([`super::prefill`]) is profiled the same way, its rows over all of its
//! tokens: a MoE layer's `experts` row spans the read-back of its router logits, the host's
//! routing and the experts' command buffer. Its [`HostTime`] has the chunk's wall time and the
//! host's time inside its submissions (`wait_ns`); the rest is the host's routing (and, under a
//! VRAM budget, the missing experts' turns through their slots).
//!
//! Where the compute queue has no timestamps (`timestampValidBits` 0) the rows are still
//! listed, with no GPU times.

use std::sync::Arc;

use ash::vk;

use super::{GpuFfn, GpuModel, HostTime};
use crate::cpu::WorkerSpan;
use crate::gpu::device::Device;
use crate::gpu::error::{map_vk, Result};
use crate::gpu::expert_cache::LayerExpertStats;
use crate::gpu::record::Recorder;
use crate::stream::ExpertRead;

/// One op group of one step on the GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuProfileRow {
    /// `None` for the embedding and the output head.
    pub layer: Option<usize>,
    /// `embedding`, `attention`, `ffn` (dense), `experts` (MoE) or `output_head`.
    pub op: &'static str,
    /// GPU time from the group's timestamp to the next group's; `None` without timestamps.
    pub gpu_ns: Option<u64>,
    /// From the step's first timestamp (the embedding's).
    pub start_ns: Option<u64>,
    /// MoE layers: this step's change in [`crate::gpu::expert_cache::ExpertStats`].
    pub experts: Option<LayerExpertStats>,
    /// MoE layers under a RAM budget: bytes of the layer's CPU experts the RAM tier read from
    /// the SSD in this step. `None` elsewhere (experts read through the memory map, whose page
    /// faults are the OS's and not counted).
    pub ssd_bytes: Option<u64>,
}

/// What one step did, per op group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuStepProfile {
    /// In step order: embedding, then per layer attention and FFN, then the output head.
    pub rows: Vec<GpuProfileRow>,
    /// GPU time between the step's first and last timestamps, the sum of the rows' times;
    /// `None` without timestamps.
    pub step_gpu_ns: Option<u64>,
    /// The host's side of a step with experts on the CPU, or of a prompt chunk; else `None`.
    pub host: Option<HostTime>,
    /// A prompt chunk's: the GPU time of each of its submissions, summed (the chunk without
    /// the host's turns between them); `None` for decode steps and without timestamps.
    pub submissions_gpu_ns: Option<u64>,
    /// What the CPU experts' pool threads ran in the step, with the layer of each span.
    pub workers: Vec<(usize, WorkerSpan)>,
    /// The experts the RAM tier read from the SSD in the step.
    pub reads: Vec<ExpertRead>,
}

/// Group indices: 0 the embedding, `1 + 2l` layer `l`'s attention, `2 + 2l` its FFN,
/// `1 + 2n` the output head.
pub(super) const EMBEDDING: usize = 0;

pub(super) fn attention(layer: usize) -> usize {
    1 + 2 * layer
}

pub(super) fn ffn(layer: usize) -> usize {
    2 + 2 * layer
}

pub(super) fn head(n_layer: usize) -> usize {
    1 + 2 * n_layer
}

/// The query pool of a profiled step: query `g` where group `g` begins, and one more after the
/// output head.
pub(super) struct StepQueries {
    /// `None` where the queue has no timestamps.
    pool: Option<vk::QueryPool>,
    count: u32,
    device: Arc<Device>,
    /// Expert counters before the step, for the deltas.
    pub(super) before: Vec<LayerExpertStats>,
    /// The RAM tier's bytes read per layer before the step.
    ram_before: Vec<u64>,
}

impl StepQueries {
    pub(super) fn new(device: &Arc<Device>, n_layer: usize) -> Result<StepQueries> {
        let count = (head(n_layer) + 2) as u32;
        let pool = if device.timestamp_valid_bits == 0 {
            None
        } else {
            let info = vk::QueryPoolCreateInfo::default()
                .query_type(vk::QueryType::TIMESTAMP)
                .query_count(count);
            // SAFETY: a valid create info; the pool is destroyed in `Drop`.
            Some(unsafe { device.raw.create_query_pool(&info, None) }.map_err(map_vk)?)
        };
        Ok(StepQueries {
            pool,
            count,
            device: device.clone(),
            before: Vec::new(),
            ram_before: Vec::new(),
        })
    }

    /// Resets the pool: the first thing the step records.
    pub(super) fn start(&self, rec: &mut Recorder<'_>) {
        if let Some(pool) = self.pool {
            rec.reset_queries(pool, self.count);
        }
    }

    /// Marks the step's end, after the output head: the last thing it records.
    pub(super) fn end(&self, rec: &mut Recorder<'_>) {
        if let Some(pool) = self.pool {
            rec.write_timestamp(pool, self.count - 1);
        }
    }

    /// Marks where group `group` begins (and the one before it ends).
    pub(super) fn mark(&self, rec: &mut Recorder<'_>, group: usize) {
        if let Some(pool) = self.pool {
            rec.write_timestamp(pool, group as u32);
        }
    }

    /// Nanoseconds from the step's start to each query, once the step has completed; `None`
    /// without timestamps or where a query was not written.
    fn read(&self) -> Result<Option<Vec<u64>>> {
        let Some(pool) = self.pool else {
            return Ok(None);
        };
        let mut results = vec![[0u64; 2]; self.count as usize];
        // SAFETY: the step that wrote the queries has completed; each element holds a value
        // and its availability (64-bit).
        unsafe {
            self.device.raw.get_query_pool_results(
                pool,
                0,
                &mut results,
                vk::QueryResultFlags::TYPE_64 | vk::QueryResultFlags::WITH_AVAILABILITY,
            )
        }
        .map_err(map_vk)?;
        if results.iter().any(|r| r[1] == 0) {
            return Ok(None);
        }
        let bits = self.device.timestamp_valid_bits;
        let mask = if bits >= 64 {
            u64::MAX
        } else {
            (1u64 << bits) - 1
        };
        let period = f64::from(self.device.limits.timestamp_period);
        let origin = results[0][0] & mask;
        Ok(Some(
            results
                .iter()
                .map(|r| ((r[0] & mask).wrapping_sub(origin) & mask) as f64 * period)
                .map(|ns| ns as u64)
                .collect(),
        ))
    }
}

impl Drop for StepQueries {
    fn drop(&mut self) {
        if let Some(pool) = self.pool {
            // SAFETY: the steps that used the pool have completed (each waits for its end).
            unsafe { self.device.raw.destroy_query_pool(pool, None) };
        }
    }
}

impl GpuModel {
    /// Turns per-layer GPU timestamps on or off for the next steps (see [`self`]). Off, steps
    /// write no timestamps and [`GpuModel::last_profile`] is `None`.
    pub fn set_profiling(&mut self, on: bool) -> Result<()> {
        self.last_profile = None;
        // Its timestamps go to the queries dropped or kept below: record it again with them.
        self.profiled_replay = None;
        if let Some(cpu) = self.experts.as_ref().and_then(|e| e.cpu.as_ref()) {
            cpu.set_tracing(on);
        }
        self.profiler = match (on, self.profiler.take()) {
            (false, _) => None,
            (true, Some(p)) => Some(p),
            (true, None) => Some(StepQueries::new(
                self.allocator.device(),
                self.config.n_layer,
            )?),
        };
        Ok(())
    }

    /// The per-group profile of the last step, when profiling was on for it.
    pub fn last_profile(&self) -> Option<&GpuStepProfile> {
        self.last_profile.as_ref()
    }

    /// Marks where group `group` begins when profiling.
    pub(super) fn mark(&self, rec: &mut Recorder<'_>, group: usize) {
        if let Some(p) = &self.profiler {
            p.mark(rec, group);
        }
    }

    /// When profiling, resets the queries and marks where the embedding begins: the first
    /// thing a step or a prompt chunk records.
    pub(super) fn mark_start(&self, rec: &mut Recorder<'_>) {
        if let Some(p) = &self.profiler {
            p.start(rec);
        }
        self.mark(rec, EMBEDDING);
    }

    /// When profiling, marks the end of the output head: the last thing a step or a prompt
    /// chunk records.
    pub(super) fn mark_end(&self, rec: &mut Recorder<'_>) {
        if let Some(p) = &self.profiler {
            p.end(rec);
        }
    }

    /// Before a profiled step: the expert counters, for the deltas.
    pub(super) fn profile_before(&mut self) {
        let stats = self.experts.as_ref().map(|e| e.stats.clone());
        let ram = self.ram_bytes_read();
        if let Some(p) = self.profiler.as_mut() {
            p.before = stats.unwrap_or_default();
            p.ram_before = ram.unwrap_or_default();
        }
    }

    /// The RAM tier's bytes read from the SSD per layer; `None` without a RAM budget.
    fn ram_bytes_read(&self) -> Option<Vec<u64>> {
        let (stats, _) = self.ram_tier()?;
        Some(stats.iter().map(|s| s.bytes_read).collect())
    }

    /// After a profiled step: its rows from the queries and the expert counters.
    pub(super) fn profile_after(&mut self, host: Option<HostTime>) -> Result<()> {
        let Some(p) = &self.profiler else {
            return Ok(());
        };
        let times = p.read()?;
        let ram = self.ram_bytes_read();
        let ssd_bytes = |il: usize| {
            let now = ram.as_ref()?;
            let before = p.ram_before.get(il).copied().unwrap_or(0);
            Some(now.get(il).copied().unwrap_or(0) - before)
        };
        let at = |q: usize| times.as_ref().map(|t| t[q]);
        let span = |g: usize| {
            let (a, b) = (at(g), at(g + 1));
            (a.zip(b).map(|(a, b)| b.saturating_sub(a)), a)
        };
        let row = |layer, op, g, experts| {
            let (gpu_ns, start_ns) = span(g);
            GpuProfileRow {
                layer,
                op,
                gpu_ns,
                start_ns,
                experts,
                ssd_bytes: None,
            }
        };
        // With the first layers on the CPU the step starts from their hidden state, and its
        // layers are the model's from there (the CPU's are not in this profile).
        let (first, input) = match self.cpu_layers() {
            0 => (0, "embedding"),
            n => (n, "hidden_state_in"),
        };
        let mut rows = vec![row(None, input, EMBEDDING, None)];
        for (il, l) in self.layers.iter().enumerate() {
            rows.push(row(Some(first + il), "attention", attention(il), None));
            rows.push(match &l.ffn {
                GpuFfn::Dense { .. } => row(Some(first + il), "ffn", ffn(il), None),
                GpuFfn::Moe(_) => {
                    let now = self.experts.as_ref().map(|e| e.stats[il]);
                    let delta = now.map(|n| delta(&n, p.before.get(il)));
                    GpuProfileRow {
                        ssd_bytes: ssd_bytes(il),
                        ..row(Some(il), "experts", ffn(il), delta)
                    }
                }
            });
        }
        rows.push(row(None, "output_head", head(self.layers.len()), None));
        let (workers, reads) = self
            .experts
            .as_ref()
            .and_then(|e| e.cpu.as_ref())
            .map(|c| c.take_trace())
            .unwrap_or_default();
        self.last_profile = Some(GpuStepProfile {
            rows,
            step_gpu_ns: at(p.count as usize - 1),
            host,
            submissions_gpu_ns: None,
            workers,
            reads,
        });
        Ok(())
    }
}

fn delta(now: &LayerExpertStats, before: Option<&LayerExpertStats>) -> LayerExpertStats {
    let b = before.copied().unwrap_or_default();
    LayerExpertStats {
        hits: now.hits - b.hits,
        misses: now.misses - b.misses,
        cpu: now.cpu - b.cpu,
        fetched: now.fetched - b.fetched,
        pcie: now.pcie - b.pcie,
        evictions: now.evictions - b.evictions,
        promoted: now.promoted - b.promoted,
        bytes_uploaded: now.bytes_uploaded - b.bytes_uploaded,
    }
}
