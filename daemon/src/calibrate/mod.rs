//! Calibration: the scheduler's micro-benchmarks ([`spillway_sched::calibrate::MicroBench`]) run
//! on this machine's Vulkan device, CPU kernels, memory and disk, so that plans and predictions
//! use measured figures instead of a described profile.
//!
//! - [`gpu::GpuBench`]: device-memory bandwidth (the `a += b` kernel), the project's own
//!   matrix-vector kernels per weight type, an empty submit, and staging-to-device copies.
//! - [`host::HostBench`]: the CPU engine's matrix-vector kernels on its thread pool, a parallel
//!   read of host memory, and tile reads from a file through the [`crate::stream`] reader with
//!   the page cache dropped for that file first.
//!
//! Each case is run once to warm up, then [`REPEATS`] times; the median is reported. Matrix
//! products and host-memory reads rotate through copies of their data larger than the caches
//! ([`cold`]), as decode reads its weights.
//!
//! The GPU's products are timed in chains recorded into one command buffer, as a decode step
//! records them, so the fitted fixed cost is a product's share of a chain, not a lone
//! dispatch's. Partial: the GPU has no batched (matrix-matrix) kernel yet, so no compute roof
//! is measured; weight types the GPU cannot read are left out of the plan.

mod cold;
pub mod first_start;
pub mod gpu;
pub mod host;

use std::time::Instant;

use spillway_sched::calibrate::{CalibrationPlan, MicroBench};
use spillway_sched::model::WeightType;

use crate::gguf::GgmlType;

/// Timed runs of each case after the warm-up.
pub const REPEATS: usize = 3;

/// Runs `f` once to warm up, then [`REPEATS`] times, and returns the median seconds.
pub fn median_seconds<E>(mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    f()?;
    let mut times = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        let t = Instant::now();
        f()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// The ggml type a scheduler weight type names.
pub fn ggml_type(t: &WeightType) -> Result<GgmlType, CalibrateError> {
    GgmlType::from_name(t.name())
        .ok_or_else(|| CalibrateError::Unsupported(format!("weight type {}", t.name())))
}

/// Weight types both the GPU kernels and the CPU kernels read.
pub const TYPES: [&str; 5] = ["F16", "Q8_0", "Q4_0", "Q4_K", "Q6_K"];

/// The scheduler's default plan, restricted to the types the GPU reads.
pub fn full_plan() -> CalibrationPlan {
    CalibrationPlan {
        weight_types: TYPES.into_iter().map(WeightType::new).collect(),
        ..CalibrationPlan::default()
    }
}

/// A plan of a few seconds on a software Vulkan device: small matrices, short chains, and
/// 16 MiB read per tile size. Its figures are coarse; it is for checking the machinery.
pub fn quick_plan() -> CalibrationPlan {
    CalibrationPlan {
        weight_types: ["Q8_0", "Q4_K"].into_iter().map(WeightType::new).collect(),
        matrices: vec![(256, 256), (512, 1024), (1024, 1024)],
        chains: vec![4, 16],
        experts: vec![(512, 256, 4)],
        attention_positions: vec![16, 64, 256],
        copy_sizes: vec![64 << 10, 1 << 20, 4 << 20],
        ssd_tiles: vec![256 << 10, 1 << 20, 4 << 20],
        ssd_bytes: 16 << 20,
    }
}

/// Why a measurement could not run.
#[derive(Debug, thiserror::Error)]
pub enum CalibrateError {
    #[error(transparent)]
    Gpu(#[from] crate::gpu::GpuError),
    #[error(transparent)]
    Stream(#[from] crate::stream::StreamError),
    #[error("{0}")]
    Unsupported(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// The GPU and the host together, as the scheduler's calibration drives them.
pub struct Bench {
    pub gpu: gpu::GpuBench,
    pub host: host::HostBench,
}

impl MicroBench for Bench {
    type Error = CalibrateError;

    fn gpu_read(&mut self, bytes: u64) -> Result<f64, CalibrateError> {
        self.gpu.read(bytes)
    }
    fn gpu_matvec(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        chain: u64,
    ) -> Result<f64, CalibrateError> {
        self.gpu.matvec(t, k, n, chain)
    }
    fn gpu_submit(&mut self) -> Result<f64, CalibrateError> {
        self.gpu.submit()
    }
    fn gpu_dispatch(&mut self) -> Result<f64, CalibrateError> {
        self.gpu.dispatch()
    }
    fn cpu_experts(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        used: u64,
        threads: u32,
    ) -> Result<f64, CalibrateError> {
        self.host.experts(t, k, n, used, threads)
    }
    fn gpu_experts(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        used: u64,
    ) -> Result<Option<f64>, CalibrateError> {
        self.gpu.experts(t, k, n, used)
    }
    fn gpu_attention(
        &mut self,
        heads: spillway_sched::calibrate::AttentionHeads,
        positions: &[u64],
    ) -> Result<Vec<f64>, CalibrateError> {
        self.gpu.attention(heads, positions)
    }
    fn cpu_dispatch(&mut self, threads: u32) -> Result<f64, CalibrateError> {
        self.host.dispatch(threads)
    }
    fn host_to_device(&mut self, bytes: u64) -> Result<f64, CalibrateError> {
        self.gpu.host_to_device(bytes)
    }
    fn cpu_matvec(
        &mut self,
        t: &WeightType,
        k: u64,
        n: u64,
        threads: u32,
    ) -> Result<f64, CalibrateError> {
        self.host.matvec(t, k, n, threads)
    }
    fn cpu_read(&mut self, bytes: u64, threads: u32) -> Result<f64, CalibrateError> {
        self.host.read(bytes, threads)
    }
    fn ssd_read(&mut self, tile: u64, count: u64) -> Result<f64, CalibrateError> {
        self.host.ssd_read(tile, count)
    }
}

/// Random blocks of `ty` for an `n_out × n_in` matrix (weights of a plausible scale).
pub fn random_matrix(ty: GgmlType, n_in: u64, n_out: u64) -> Result<Vec<u8>, CalibrateError> {
    let bytes = ty
        .row_bytes(n_in)
        .and_then(|r| r.checked_mul(n_out))
        .ok_or_else(|| CalibrateError::Unsupported(format!("{n_out}×{n_in} {ty}")))?;
    let mut data = vec![0u8; bytes as usize];
    // Rows made on every thread, each run of rows from its own stream: the largest cases
    // (58 M weights of F16) took the host most of a second on one.
    let row = (bytes / n_out.max(1)) as usize;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let per_thread = (n_out as usize).div_ceil(threads).max(1) * row;
    let seed = n_in ^ (n_out << 20);
    std::thread::scope(|s| {
        let runs = data.chunks_mut(per_thread.max(1)).enumerate();
        let made: Vec<_> = runs
            .map(|(i, rows)| {
                s.spawn(move || {
                    let mut rng =
                        crate::synth::rng::Xoshiro256::seed_from(seed ^ ((i as u64) << 48));
                    crate::synth::weights::fill_blocks(ty, 0.02, &mut rng, rows)
                })
            })
            .collect();
        made.into_iter()
            .try_for_each(|h| h.join().expect("a filling thread panicked"))
            .map_err(|e| CalibrateError::Unsupported(e.to_string()))
    })?;
    Ok(data)
}

/// What this machine says about itself: the GPU's name, driver and device-local memory, the
/// CPU's model name, total RAM and the threads available.
pub fn machine_facts(gpu: &crate::gpu::DeviceInfo) -> spillway_sched::calibrate::MachineFacts {
    use spillway_sched::profile::ProfileKey;
    use spillway_sched::ByteSize;

    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split_once(':'))
        .map_or_else(
            || std::env::consts::ARCH.to_string(),
            |(_, v)| v.trim().to_string(),
        );
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let ram_kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0);
    spillway_sched::calibrate::MachineFacts {
        key: ProfileKey {
            device: gpu.name.clone(),
            driver: gpu.driver.clone(),
            cpu,
        },
        vram: ByteSize(gpu.device_local_bytes),
        ram: ByteSize(ram_kib * 1024),
        cpu_threads: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
    }
}

/// Seconds spent in each stage of a calibration, from its progress reports: a stage runs from
/// the report that names it first until the next stage's first report.
#[derive(Debug, Default)]
pub struct StageClock {
    last: Option<Instant>,
    stages: Vec<(String, f64)>,
}

impl StageClock {
    /// Starts the clock: the first stage's time counts from here.
    pub fn start() -> StageClock {
        StageClock {
            last: Some(Instant::now()),
            stages: Vec::new(),
        }
    }

    /// Counts the time since the last report toward `what`, the stage just finished a step.
    pub fn report(&mut self, what: &str) {
        let now = Instant::now();
        let spent = self.last.map_or(0.0, |t| (now - t).as_secs_f64());
        self.last = Some(now);
        match self.stages.last_mut() {
            Some((name, s)) if name == what => *s += spent,
            _ => self.stages.push((what.to_string(), spent)),
        }
    }

    /// Each stage with its seconds, in the order they ran.
    pub fn stages(&self) -> &[(String, f64)] {
        &self.stages
    }

    /// One line: `stage 1.2 s, stage 0.3 s, ...`.
    pub fn summary(&self) -> String {
        self.stages
            .iter()
            .map(|(name, s)| format!("{name} {s:.1} s"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::StageClock;

    #[test]
    fn a_stage_gathers_its_consecutive_reports() {
        let mut c = StageClock::start();
        for what in ["a", "a", "b", "a"] {
            std::thread::sleep(std::time::Duration::from_millis(2));
            c.report(what);
        }
        let names: Vec<&str> = c.stages().iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["a", "b", "a"]);
        assert!(c.stages()[0].1 >= 0.004 && c.stages()[1].1 >= 0.002);
        assert!(c.summary().starts_with("a "));
    }
}
