//! First-start calibration: the micro-benchmarks the daemon runs (behind [`MicroBench`]), the
//! shapes they run on ([`CalibrationPlan`]), and the fits that turn their timings into a
//! [`HardwareProfile`].
//!
//! The scheduler runs nothing itself: the daemon is to implement [`MicroBench`] over Vulkan, its
//! CPU kernels and io_uring (not written yet: until then plans use described profiles), and
//! [`calibrate`] drives it and reports progress.

use std::collections::BTreeMap;

use crate::model::WeightType;
use crate::predict::{Roofline, ShapePoint, Work};
use crate::profile::{
    AttentionPoint, CpuProfile, GpuProfile, HardwareProfile, PcieProfile, ProfileKey, RamProfile,
    SsdProfile, SsdRead,
};
use crate::ByteSize;

/// Timed operations on the real hardware. Each returns the measured seconds of one run (the
/// implementation warms up and takes the median of a few repeats).
pub trait MicroBench {
    type Error;

    /// Read `bytes` of device memory with a streaming kernel.
    fn gpu_read(&mut self, bytes: u64) -> Result<f64, Self::Error>;
    /// Seconds per product of a chain of `chain` products of a `k`×`n` matrix of type `t` with
    /// a vector on the GPU, recorded into one command buffer as a decode step records its
    /// products, each reading a copy of the matrix no recent product read.
    fn gpu_matvec(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        chain: u64,
    ) -> Result<f64, Self::Error>;
    /// One empty submit and wait.
    fn gpu_submit(&mut self) -> Result<f64, Self::Error>;
    /// Seconds per dispatch of a chain of small dependent dispatches in one command buffer:
    /// what each op of a decode step costs beyond its bytes.
    fn gpu_dispatch(&mut self) -> Result<f64, Self::Error>;
    /// Copy `bytes` from pinned host memory to the device.
    fn host_to_device(&mut self, bytes: u64) -> Result<f64, Self::Error>;
    /// One `k`×`n` matrix of type `t` times one vector on `threads` CPU threads.
    fn cpu_matvec(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        threads: u32,
    ) -> Result<f64, Self::Error>;
    /// One MoE layer's routed experts for one token on `threads` CPU threads, as the CPU
    /// engine runs them: `used` experts, each a `k`→`n` gate and up product and an `n`→`k`
    /// down product of type `t`.
    fn cpu_experts(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        used: u64,
        threads: u32,
    ) -> Result<f64, Self::Error>;
    /// What one more chosen expert adds to a MoE layer's routed experts for one token on the
    /// GPU, as a decode step runs them with every expert in VRAM: `used` experts, each a
    /// `k`→`n` gate and up and an `n`→`k` down of type `t`, in two expert-indexed dispatches
    /// (gate, up and SwiGLU; the down products and their weighted sum), a barrier after each;
    /// the layer's fixed costs left out (timed against fewer experts, say). `None` where the
    /// device cannot run experts this large that way (their stack past one binding).
    fn gpu_experts(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        used: u64,
    ) -> Result<Option<f64>, Self::Error>;
    /// One layer's decode attention on the GPU for one token at each of `positions`
    /// (ascending; RoPE, QK-norm and the KV-cache append in its dispatch, as a decode step runs
    /// it), with heads `heads`, a barrier after it: seconds per position.
    fn gpu_attention(
        &mut self,
        heads: AttentionHeads,
        positions: &[u64],
    ) -> Result<Vec<f64>, Self::Error>;
    /// One empty job run on `threads` CPU threads and waited for.
    fn cpu_dispatch(&mut self, threads: u32) -> Result<f64, Self::Error>;
    /// Read `bytes` of host memory on `threads` threads.
    fn cpu_read(&mut self, bytes: u64, threads: u32) -> Result<f64, Self::Error>;
    /// Read `count` tiles of `tile` bytes from the model file, uncached, kept in flight.
    fn ssd_read(&mut self, tile: u64, count: u64) -> Result<f64, Self::Error>;
}

/// The heads [`MicroBench::gpu_attention`] times: Llama-3-8B's (32 query heads, 8 KV heads of
/// 128), the commonest shape of today's 7–70B models, and Llama-3.2-1B's (heads of 64), so
/// that the time can follow the query's width (`profile::attention_seconds`).
pub const ATTENTION_HEADS: [AttentionHeads; 2] = [
    AttentionHeads {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
    },
    AttentionHeads {
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 64,
    },
];

/// Attention heads of a layer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AttentionHeads {
    pub n_heads: u64,
    pub n_kv_heads: u64,
    pub head_dim: u64,
}

impl AttentionHeads {
    /// Bytes of one position's K and V in an f16 cache.
    pub fn kv_bytes_per_position(&self) -> u64 {
        2 * self.n_kv_heads * self.head_dim * 2
    }

    /// Floats of a token's query.
    pub fn query_width(&self) -> u64 {
        self.n_heads * self.head_dim
    }
}

/// What the machine says about itself without measuring.
#[derive(Debug, Clone, PartialEq)]
pub struct MachineFacts {
    pub key: ProfileKey,
    pub vram: ByteSize,
    pub ram: ByteSize,
    pub cpu_threads: u32,
}

/// The shapes and sizes calibration measures. The default is sized for about ten seconds on a
/// machine with at least 1 GB/s of SSD and 10 GB/s of host memory: matrices and copies move at
/// most 64 MiB a case, the SSD 64 MiB a tile size, the bandwidth reads 256 MiB. (The daemon's
/// implementation reads each case from copies larger than the caches, which makes a software
/// Vulkan device take minutes.)
#[derive(Debug, Clone, PartialEq)]
pub struct CalibrationPlan {
    pub weight_types: Vec<WeightType>,
    /// (k, n) of the matrices.
    pub matrices: Vec<(u64, u64)>,
    /// Lengths of the GPU's chains of products (see [`MicroBench::gpu_matvec`]).
    pub chains: Vec<u64>,
    /// (width, expert rows, experts used) of the MoE layers, on the CPU
    /// ([`MicroBench::cpu_experts`]) and on the GPU ([`MicroBench::gpu_experts`]).
    pub experts: Vec<(u64, u64, u64)>,
    /// Positions of the GPU's decode attention ([`MicroBench::gpu_attention`]).
    pub attention_positions: Vec<u64>,
    pub copy_sizes: Vec<u64>,
    pub ssd_tiles: Vec<u64>,
    /// Bytes read per tile size.
    pub ssd_bytes: u64,
}

impl Default for CalibrationPlan {
    fn default() -> CalibrationPlan {
        CalibrationPlan {
            weight_types: ["F16", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
                .into_iter()
                .map(WeightType::new)
                .collect(),
            // Expert-sized and projection-sized matrices beside large ones, so that the fits see
            // what a small product costs beyond its bytes, and an output head's many rows.
            matrices: vec![
                (2048, 512),
                (512, 2048),
                (2048, 2048),
                (2048, 8192),
                (4096, 4096),
                (4096, 14336),
                (14336, 4096),
                (2048, 65536),
            ],
            chains: vec![16, 64],
            // A small MoE's, Qwen3-30B-A3B's and Qwen3-235B-A22B's experts.
            experts: vec![(1024, 512, 8), (2048, 768, 8), (4096, 1536, 8)],
            attention_positions: vec![16, 48, 128, 512, 2048, 8192],
            copy_sizes: vec![64 << 10, 1 << 20, 8 << 20, 64 << 20],
            ssd_tiles: vec![256 << 10, 1 << 20, 4 << 20, 16 << 20],
            ssd_bytes: 64 << 20,
        }
    }
}

impl CalibrationPlan {
    /// Number of measurements, for progress.
    pub fn steps(&self) -> usize {
        let gpu = self.weight_types.len()
            * (self.matrices.len() * self.chains.len() + self.experts.len())
            + ATTENTION_HEADS.len() * self.attention_positions.len();
        let cpu = self.weight_types.len() * (self.matrices.len() * 2 + self.experts.len());
        4 + 3 + 1 + gpu + self.copy_sizes.len() + cpu + 1 + 2 + self.ssd_tiles.len()
    }
}

/// Where calibration is, for the progress line.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress<'a> {
    pub done: usize,
    pub total: usize,
    pub what: &'a str,
}

/// Runs `plan` on `bench` and fits a profile. Weight types whose block layout the scheduler
/// does not know are skipped (they fall back to the bandwidth-derived rate).
pub fn calibrate<B: MicroBench>(
    facts: &MachineFacts,
    bench: &mut B,
    plan: &CalibrationPlan,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<HardwareProfile, B::Error> {
    let total = plan.steps();
    let mut done = 0;
    let mut tick = |what: &str| {
        done += 1;
        progress(Progress { done, total, what });
    };

    let mut reads = Vec::new();
    for bytes in [4u64 << 20, 16 << 20, 64 << 20, 256 << 20] {
        reads.push((Work::transfer(bytes), bench.gpu_read(bytes)?, 1.0));
        tick("GPU memory bandwidth");
    }
    let gpu_read = guess(&reads).fit(&reads);
    let mut submits = Vec::new();
    for _ in 0..3 {
        submits.push(bench.gpu_submit()?);
        tick("GPU submit");
    }
    let submit_s = median(&mut submits);
    let dispatch_s = bench.gpu_dispatch()?;
    tick("GPU dispatch");

    let mut gpu_matvec = BTreeMap::new();
    let mut gpu_points = BTreeMap::new();
    // The longest chain is the steady state of a decode step's products: its timings are the
    // points that correct the fit by shape.
    let longest = plan.chains.iter().copied().max().unwrap_or(1);
    for t in &plan.weight_types {
        let (mut obs, mut points) = (Vec::new(), Vec::new());
        for &(k, n) in &plan.matrices {
            for &chain in &plan.chains {
                let Some(bytes) = t.bytes_for(k * n) else {
                    tick("GPU kernels");
                    continue;
                };
                let seconds = bench.gpu_matvec(t, k, n, chain)?;
                obs.push((Work::matvec(k, n, bytes, 1), seconds, 1.0));
                if chain == longest {
                    points.push(ShapePoint {
                        k,
                        n,
                        bytes,
                        seconds,
                    });
                }
                tick("GPU kernels");
            }
        }
        if obs.len() >= 3 {
            // Products one vector at a time are bound by memory: no compute roof is fitted.
            gpu_matvec.insert(t.clone(), guess(&obs).fit(&obs));
            gpu_points.insert(t.clone(), points);
        }
    }

    // What one more chosen expert costs, past the layer's dispatches.
    let gpu_expert_points = expert_points(plan, &mut tick, "GPU experts", |t, k, n, used| {
        bench.gpu_experts(t, k, n, used)
    })?;

    // Decode attention at each reference shape and position, as measured: its time does not
    // follow a fixed cost and a bandwidth (`profile::attention_seconds`).
    let mut gpu_attention = Vec::new();
    let mut positions = plan.attention_positions.clone();
    positions.sort_unstable();
    positions.dedup();
    for heads in ATTENTION_HEADS {
        let seconds = bench.gpu_attention(heads, &positions)?;
        for (&position, seconds) in positions.iter().zip(seconds) {
            gpu_attention.push(AttentionPoint {
                query_width: heads.query_width(),
                position,
                seconds,
            });
        }
        for _ in &plan.attention_positions {
            tick("GPU attention");
        }
    }

    let mut copies = Vec::new();
    for &bytes in &plan.copy_sizes {
        copies.push((Work::transfer(bytes), bench.host_to_device(bytes)?, 1.0));
        tick("host-to-device copies");
    }
    let copy = guess(&copies).fit(&copies);

    let threads = facts.cpu_threads.max(1);
    let (mut one_thread, mut all_threads) = (BTreeMap::new(), BTreeMap::new());
    let mut cpu_points = BTreeMap::new();
    for t in &plan.weight_types {
        let (mut one, mut all) = (Vec::new(), Vec::new());
        for &(k, n) in &plan.matrices {
            let Some(bytes) = t.bytes_for(k * n) else {
                tick("CPU kernels");
                tick("CPU kernels");
                continue;
            };
            let w = Work::matvec(k, n, bytes, 1);
            one.push((w, bench.cpu_matvec(t, k, n, 1)?, 1.0));
            tick("CPU kernels");
            all.push((w, bench.cpu_matvec(t, k, n, threads)?, 1.0));
            tick("CPU kernels");
        }
        if one.len() >= 3 {
            one_thread.insert(t.clone(), guess(&one).fit(&one));
            all_threads.insert(t.clone(), guess(&all).fit(&all));
            let points = all
                .iter()
                .zip(
                    plan.matrices
                        .iter()
                        .filter(|(k, n)| t.bytes_for(k * n).is_some()),
                )
                .map(|(&(w, seconds, _), &(k, n))| ShapePoint {
                    k,
                    n,
                    bytes: w.bytes as u64,
                    seconds,
                })
                .collect();
            cpu_points.insert(t.clone(), points);
        }
    }
    let cpu_dispatch_s = bench.cpu_dispatch(threads)?;
    tick("CPU dispatch");
    // Per expert, past the layer's two jobs: what one more chosen expert costs.
    let expert_points = expert_points(plan, &mut tick, "CPU experts", |t, k, n, used| {
        let seconds = bench.cpu_experts(t, k, n, used, threads)?;
        Ok(Some((seconds - 2.0 * cpu_dispatch_s) / used.max(1) as f64))
    })?;
    let mem_bytes = 256u64 << 20;
    let t1 = bench.cpu_read(mem_bytes, threads)?;
    tick("CPU memory bandwidth");
    let t2 = bench.cpu_read(mem_bytes, threads)?;
    tick("CPU memory bandwidth");
    let memory_bandwidth = mem_bytes as f64 / t1.min(t2);

    let mut ssd = Vec::new();
    for &tile in &plan.ssd_tiles {
        let count = (plan.ssd_bytes / tile).max(1);
        let secs = bench.ssd_read(tile, count)?;
        ssd.push((tile, count, secs));
        tick("SSD reads");
    }
    let reads: Vec<SsdRead> = ssd
        .iter()
        .map(|&(tile, count, secs)| SsdRead {
            tile: ByteSize(tile),
            bandwidth: (tile * count) as f64 / secs,
        })
        .collect();
    // What the largest tiles' throughput leaves unexplained at the smallest tile is per-request
    // latency the queue did not hide.
    let best = reads.iter().map(|r| r.bandwidth).fold(0.0, f64::max);
    let request_s = ssd
        .iter()
        .min_by_key(|s| s.0)
        .map_or(0.0, |&(tile, count, secs)| {
            ((secs - (tile * count) as f64 / best) / count as f64).max(0.0)
        });

    Ok(HardwareProfile {
        key: facts.key.clone(),
        source: "measured by calibration".into(),
        gpu: GpuProfile {
            memory: facts.vram,
            bandwidth: gpu_read.bandwidth,
            dispatch_s,
            submit_s,
            matvec: gpu_matvec,
            matvec_points: gpu_points,
            expert_points: gpu_expert_points,
            attention: gpu_attention,
        },
        pcie: PcieProfile {
            bandwidth: copy.bandwidth,
            copy_s: copy.fixed_s,
        },
        cpu: CpuProfile {
            threads,
            memory_bandwidth,
            dispatch_s: cpu_dispatch_s,
            matvec_per_thread: one_thread,
            matvec: all_threads,
            matvec_points: cpu_points,
            expert_points,
        },
        ram: RamProfile { memory: facts.ram },
        ssd: SsdProfile { request_s, reads },
    })
}

/// Per weight type, the plan's MoE layers' experts as `per_expert` times them: the seconds
/// one more chosen expert adds (`None`, or none past the layer's fixed costs: no point). A
/// type without points is left out.
fn expert_points<E>(
    plan: &CalibrationPlan,
    tick: &mut dyn FnMut(&str),
    what: &str,
    mut per_expert: impl FnMut(&WeightType, u64, u64, u64) -> Result<Option<f64>, E>,
) -> Result<BTreeMap<WeightType, Vec<ShapePoint>>, E> {
    let mut out = BTreeMap::new();
    for t in &plan.weight_types {
        let mut points = Vec::new();
        for &(k, n, used) in &plan.experts {
            let Some(bytes) = t.bytes_for(k * n) else {
                tick(what);
                continue;
            };
            let seconds = per_expert(t, k, n, used)?;
            tick(what);
            if let Some(seconds) = seconds.filter(|&s| s > 0.0) {
                // Gate, up and down.
                points.push(ShapePoint {
                    k,
                    n,
                    bytes: 3 * bytes,
                    seconds,
                });
            }
        }
        if !points.is_empty() {
            out.insert(t.clone(), points);
        }
    }
    Ok(out)
}

/// A starting point for a fit: the bandwidth of the largest observation, no fixed cost.
fn guess(obs: &[(Work, f64, f64)]) -> Roofline {
    let (w, t, _) = obs
        .iter()
        .max_by(|a, b| a.0.bytes.total_cmp(&b.0.bytes))
        .copied()
        .unwrap_or((Work::transfer(1), 1.0, 1.0));
    Roofline::memory_bound((w.bytes / t).max(1.0), 0.0)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::predict::tests::Rng;
    use crate::profile::tests::test_profile;

    /// A machine that answers from a known profile, with 5% noise.
    struct Simulated {
        truth: HardwareProfile,
        rng: Rng,
    }

    impl Simulated {
        fn noisy(&mut self, t: f64) -> Result<f64, ()> {
            Ok(t * self.rng.noise(0.05))
        }
    }

    impl MicroBench for Simulated {
        type Error = ();
        fn gpu_read(&mut self, bytes: u64) -> Result<f64, ()> {
            let t = self.truth.gpu_stream().predict(Work::transfer(bytes));
            self.noisy(t)
        }
        fn gpu_matvec(&mut self, t: &WeightType, k: u64, n: u64, _chain: u64) -> Result<f64, ()> {
            let w = Work::matvec(k, n, t.bytes_for(k * n).unwrap(), 1);
            let s = self.truth.gpu_matvec(t).predict(w);
            self.noisy(s)
        }
        fn gpu_submit(&mut self) -> Result<f64, ()> {
            let s = self.truth.gpu.submit_s;
            self.noisy(s)
        }
        fn gpu_dispatch(&mut self) -> Result<f64, ()> {
            let s = self.truth.gpu.dispatch_s;
            self.noisy(s)
        }
        fn cpu_dispatch(&mut self, _threads: u32) -> Result<f64, ()> {
            let s = self.truth.cpu.dispatch_s;
            self.noisy(s)
        }
        fn host_to_device(&mut self, bytes: u64) -> Result<f64, ()> {
            let s = self.truth.host_to_device().predict(Work::transfer(bytes));
            self.noisy(s)
        }
        fn cpu_matvec(&mut self, t: &WeightType, k: u64, n: u64, th: u32) -> Result<f64, ()> {
            let w = Work::matvec(k, n, t.bytes_for(k * n).unwrap(), 1);
            let r = if th == 1 {
                self.truth.cpu.matvec_per_thread.get(t).copied().unwrap()
            } else {
                self.truth.cpu_matvec(t)
            };
            self.noisy(r.predict(w))
        }
        fn cpu_experts(
            &mut self,
            t: &WeightType,
            k: u64,
            n: u64,
            used: u64,
            _threads: u32,
        ) -> Result<f64, ()> {
            let w = Work::matvec(k, n, t.bytes_for(k * n).unwrap(), 1);
            let one = self.truth.cpu_matvec(t).marginal(w);
            let s = 2.0 * self.truth.cpu.dispatch_s + used as f64 * 3.0 * one;
            self.noisy(s)
        }
        fn gpu_experts(
            &mut self,
            t: &WeightType,
            k: u64,
            n: u64,
            _used: u64,
        ) -> Result<Option<f64>, ()> {
            let w = Work::matvec(k, n, t.bytes_for(k * n).unwrap(), 1);
            // Expert-indexed products stream at half a product's rate here.
            let one = 2.0 * self.truth.gpu_matvec(t).marginal(w);
            self.noisy(3.0 * one).map(Some)
        }
        fn gpu_attention(
            &mut self,
            heads: AttentionHeads,
            positions: &[u64],
        ) -> Result<Vec<f64>, ()> {
            positions
                .iter()
                .map(|&position| {
                    let bytes = (position + 1) * heads.kv_bytes_per_position();
                    let s = self
                        .truth
                        .gpu_attention(heads.query_width(), position, bytes);
                    self.noisy(s)
                })
                .collect()
        }
        fn cpu_read(&mut self, bytes: u64, _threads: u32) -> Result<f64, ()> {
            let s = bytes as f64 / self.truth.cpu.memory_bandwidth;
            self.noisy(s)
        }
        fn ssd_read(&mut self, tile: u64, count: u64) -> Result<f64, ()> {
            let bw = self.truth.ssd_bandwidth(ByteSize(tile));
            self.noisy((tile * count) as f64 / bw)
        }
    }

    #[test]
    fn calibration_recovers_the_machine_it_measures() {
        let mut truth = test_profile();
        // An attention dispatch slower than a dispatch, reading its cache at half the stream's.
        // Attention that grows with the position up to a run's length, then slowly.
        for query_width in [1024, 8192] {
            for (position, us) in [(1, 6.0), (128, 20.0), (8192, 60.0)] {
                let seconds = us * 1e-6 * query_width as f64 / 4096.0;
                truth.gpu.attention.push(AttentionPoint {
                    query_width,
                    position,
                    seconds,
                });
            }
        }
        let facts = MachineFacts {
            key: truth.key.clone(),
            vram: truth.gpu.memory,
            ram: truth.ram.memory,
            cpu_threads: truth.cpu.threads,
        };
        let plan = CalibrationPlan {
            weight_types: vec![WeightType::new("Q4_K")],
            ..CalibrationPlan::default()
        };
        let mut bench = Simulated {
            truth: truth.clone(),
            rng: Rng::new(5),
        };
        let mut seen = Vec::new();
        let p = calibrate(&facts, &mut bench, &plan, &mut |pr| {
            seen.push((pr.done, pr.total))
        })
        .unwrap();
        p.validate().unwrap();
        // Progress counts every step up to the announced total.
        assert_eq!(seen.len(), plan.steps());
        assert_eq!(seen.last(), Some(&(plan.steps(), plan.steps())));

        let close = |got: f64, want: f64, tol: f64| (got / want - 1.0).abs() < tol;
        assert!(
            close(p.gpu.bandwidth, truth.gpu.bandwidth, 0.1),
            "{}",
            p.gpu.bandwidth
        );
        assert!(close(p.pcie.bandwidth, truth.pcie.bandwidth, 0.1));
        assert!(close(
            p.cpu.memory_bandwidth,
            truth.cpu.memory_bandwidth,
            0.12
        ));
        let q4k = WeightType::new("Q4_K");
        let g = p.gpu_matvec(&q4k);
        assert!(close(g.bandwidth, 240e9, 0.1), "{g:?}");
        // One vector at a time never reaches the compute roof: none is fitted.
        assert_eq!(g.flop_rate, None, "{g:?}");
        assert!(close(p.gpu.dispatch_s, truth.gpu.dispatch_s, 0.1));
        assert!(close(p.cpu.dispatch_s, truth.cpu.dispatch_s, 0.1));
        let c = p.cpu_matvec(&q4k);
        assert!(close(c.bandwidth, 60e9, 0.1), "{c:?}");
        // Decode attention: the dispatch's fixed cost is recovered.
        assert_eq!(p.gpu.attention.len(), 2 * plan.attention_positions.len());
        for (width, position) in [(2048, 32), (4096, 64), (4096, 300), (8192, 4000)] {
            let (got, want) = (
                p.gpu_attention(width, position, 0),
                truth.gpu_attention(width, position, 0),
            );
            assert!(
                close(got, want, 0.1),
                "{width}, {position}: {got} against {want}"
            );
        }
        // A GPU expert is what the bench's products cost it, past the layer's dispatches.
        let (k, n) = (2048, 768);
        let bytes = 3 * q4k.bytes_for(k * n).unwrap();
        let want = 2.0
            * 3.0
            * truth
                .gpu_matvec(&q4k)
                .marginal(Work::matvec(k, n, bytes / 3, 1));
        let got = p
            .gpu_expert(&q4k, k, n, bytes)
            .expect("GPU experts calibrated");
        assert!(close(got, want, 0.15), "{got} against {want}");
        // The tile chosen is one the true disk reads near its best (5% of noise can move the
        // choice between tiles that close).
        let true_bw = |tile| truth.ssd_bandwidth(tile);
        assert!(true_bw(p.best_tile()) >= 0.9 * true_bw(truth.best_tile()));
    }
}
