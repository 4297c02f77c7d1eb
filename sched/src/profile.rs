//! What a machine can do, as measured: GPU memory bandwidth and matrix-vector rates per weight
//! type, host-to-device copies, CPU rates per thread and in aggregate, RAM, SSD reads per tile
//! size, and the fixed cost of a dispatch, a submit, a copy and a read request.
//!
//! Calibration ([`crate::calibrate`]) measures one at first start; it is stored as TOML under a
//! [`ProfileKey`] (device, driver, CPU) and refined online ([`crate::refine`]). Described
//! profiles of machines we do not have use the same format (`sched/profiles/*.toml`).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::WeightType;
use crate::predict::{shaped_marginal, Roofline, ShapePoint, Work};
use crate::ByteSize;

/// Which machine a stored profile belongs to: a profile measured under another GPU, driver or
/// CPU is not reused.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProfileKey {
    /// GPU name as the driver reports it.
    pub device: String,
    /// Driver name and version.
    pub driver: String,
    /// CPU model name.
    pub cpu: String,
}

impl ProfileKey {
    /// A file name for the stored profile: the key's fields, lower-cased, with every run of
    /// characters other than letters and digits made one `-`.
    pub fn file_name(&self) -> String {
        let mut out = String::new();
        for part in [&self.device, &self.driver, &self.cpu] {
            if !out.is_empty() {
                out.push_str("--");
            }
            let mut dash = false;
            for c in part.chars() {
                if c.is_ascii_alphanumeric() {
                    out.push(c.to_ascii_lowercase());
                    dash = false;
                } else if !dash {
                    out.push('-');
                    dash = true;
                }
            }
        }
        out.push_str(".toml");
        out
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuProfile {
    /// Device memory usable for the model, KV cache and buffers.
    pub memory: ByteSize,
    /// Device memory read bandwidth of a streaming kernel, bytes/s.
    pub bandwidth: f64,
    /// Cost of one more dispatch in a command buffer, seconds.
    pub dispatch_s: f64,
    /// Cost of one queue submit and wait, seconds.
    pub submit_s: f64,
    /// Matrix-vector kernels per weight type. A type not listed is predicted from `bandwidth`
    /// at [`UNMEASURED_EFFICIENCY`].
    #[serde(default)]
    pub matvec: BTreeMap<WeightType, Roofline>,
    /// The calibrated products behind `matvec` (seconds per product of a chain), which
    /// correct its roofline by shape ([`shaped_marginal`]). Empty in described profiles.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub matvec_points: BTreeMap<WeightType, Vec<ShapePoint>>,
    /// Routed experts as a decode step runs a MoE layer's with all of them in VRAM (every
    /// chosen expert in two expert-indexed dispatches): per expert of `k`-wide, `n`-row gate,
    /// up and down matrices (`bytes` the three), the seconds one more chosen expert adds past
    /// the layer's dispatches. Empty in described profiles, whose experts are predicted as
    /// products.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub expert_points: BTreeMap<WeightType, Vec<ShapePoint>>,
    /// Decode attention of one layer as a decode step runs it (RoPE, QK-norm and the KV-cache
    /// append in one dispatch), timed at a few query widths and positions by calibration.
    /// Empty in described profiles: the cache is then read at `bandwidth` after one dispatch.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention: Vec<AttentionPoint>,
}

/// One calibrated decode attention: a layer's for a token at `position` with a query of
/// `query_width` floats (heads times head size).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AttentionPoint {
    pub query_width: u64,
    pub position: u64,
    pub seconds: f64,
}

/// Seconds of decode attention at (`query_width`, `position`) from calibrated `points`. At
/// each calibrated width, piecewise linear in the position between its points, the first
/// point's time below them and, past the last, the last segment's slope (not falling): a
/// GPU's attention is not a bandwidth and a fixed cost, since up to a run's length of
/// positions (128) each head's workgroup walks them one after another, and past it the runs
/// spread over the device. Across widths, linear in the width between the two nearest
/// calibrated ones, at least half the lesser of their times. `None` without points.
pub fn attention_seconds(
    points: &[AttentionPoint],
    query_width: u64,
    position: u64,
) -> Option<f64> {
    let mut widths: Vec<u64> = points.iter().map(|p| p.query_width).collect();
    widths.sort_unstable();
    widths.dedup();
    let at_width = |w: u64| -> f64 {
        let mut ps: Vec<(f64, f64)> = points
            .iter()
            .filter(|p| p.query_width == w)
            .map(|p| (p.position as f64, p.seconds))
            .collect();
        ps.sort_by(|a, b| a.0.total_cmp(&b.0));
        let x = position as f64;
        if ps.len() == 1 || x <= ps[0].0 {
            return ps[0].1;
        }
        for s in ps.windows(2) {
            let ((x0, y0), (x1, y1)) = (s[0], s[1]);
            if x <= x1 {
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0).max(1.0);
            }
        }
        let ((x0, y0), (x1, y1)) = (ps[ps.len() - 2], ps[ps.len() - 1]);
        y1 + ((y1 - y0) / (x1 - x0).max(1.0)).max(0.0) * (x - x1)
    };
    match widths.len() {
        0 => None,
        1 => Some(at_width(widths[0])),
        n => {
            // The two calibrated widths nearest `query_width`, bracketing it where they can.
            let i = widths.partition_point(|&w| w < query_width).clamp(1, n - 1);
            let (w0, w1) = (widths[i - 1], widths[i]);
            let (t0, t1) = (at_width(w0), at_width(w1));
            let f = (query_width as f64 - w0 as f64) / (w1 - w0) as f64;
            Some((t0 + (t1 - t0) * f).max(0.5 * t0.min(t1)))
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PcieProfile {
    /// Host-to-device copy bandwidth from pinned memory, bytes/s.
    pub bandwidth: f64,
    /// Cost of one copy command, seconds.
    pub copy_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CpuProfile {
    /// Threads the CPU kernels use.
    pub threads: u32,
    /// Memory read bandwidth with all threads, bytes/s.
    pub memory_bandwidth: f64,
    /// Cost of waking the thread pool for one operation, seconds.
    pub dispatch_s: f64,
    /// Matrix-vector kernels per weight type on one thread.
    #[serde(default)]
    pub matvec_per_thread: BTreeMap<WeightType, Roofline>,
    /// Matrix-vector kernels per weight type on all `threads`, where measured; otherwise
    /// derived from the per-thread figure and `memory_bandwidth`.
    #[serde(default)]
    pub matvec: BTreeMap<WeightType, Roofline>,
    /// The calibrated products on all `threads` behind `matvec`, which correct its roofline
    /// by shape ([`shaped_marginal`]). Empty in described profiles.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub matvec_points: BTreeMap<WeightType, Vec<ShapePoint>>,
    /// Routed experts as the CPU engine runs a MoE layer's (all of them in two pool jobs):
    /// per expert of `k`-wide, `n`-row gate, up and down matrices (`bytes` the three), the
    /// seconds one more chosen expert adds. Empty in described profiles.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub expert_points: BTreeMap<WeightType, Vec<ShapePoint>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RamProfile {
    /// Host memory usable for weights, caches and staging.
    pub memory: ByteSize,
}

/// Read throughput at one request size.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SsdRead {
    pub tile: ByteSize,
    /// Bytes/s with reads of `tile` bytes kept in flight.
    pub bandwidth: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SsdProfile {
    /// Latency of one read request that the queue depth does not hide, seconds.
    pub request_s: f64,
    /// Throughput per tile size, any order.
    pub reads: Vec<SsdRead>,
}

/// Everything the predictors need about one machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HardwareProfile {
    pub key: ProfileKey,
    /// Where the figures come from (measured, or described from datasheets).
    #[serde(default)]
    pub source: String,
    pub gpu: GpuProfile,
    pub pcie: PcieProfile,
    pub cpu: CpuProfile,
    pub ram: RamProfile,
    pub ssd: SsdProfile,
}

/// Fraction of the measured memory bandwidth assumed for a weight type's matrix-vector kernel
/// that was never measured; dequantizing kernels rarely reach a pure read's bandwidth.
pub const UNMEASURED_EFFICIENCY: f64 = 0.7;

/// A tile reaches "full speed" at this fraction of the best SSD throughput measured.
const TILE_SPEED_FRACTION: f64 = 0.9;

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("profile TOML: {0}")]
    Toml(String),
    #[error("profile: {field} must be a positive number, got {value}")]
    NotPositive { field: String, value: f64 },
    #[error("profile: ssd.reads needs at least one tile size")]
    NoSsdReads,
}

impl HardwareProfile {
    pub fn from_toml(text: &str) -> Result<HardwareProfile, ProfileError> {
        let p: HardwareProfile =
            toml::from_str(text).map_err(|e| ProfileError::Toml(e.to_string()))?;
        p.validate()?;
        Ok(p)
    }

    pub fn to_toml(&self) -> String {
        toml::to_string(self).expect("a profile is plain data")
    }

    /// Every rate positive and finite, every fixed cost non-negative.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let positive = |field: &str, value: f64| {
            if value.is_finite() && value > 0.0 {
                Ok(())
            } else {
                Err(ProfileError::NotPositive {
                    field: field.to_string(),
                    value,
                })
            }
        };
        let non_negative = |field: &str, value: f64| {
            if value.is_finite() && value >= 0.0 {
                Ok(())
            } else {
                Err(ProfileError::NotPositive {
                    field: field.to_string(),
                    value,
                })
            }
        };
        let roofline = |field: String, r: &Roofline| {
            positive(&format!("{field}.bandwidth"), r.bandwidth)?;
            non_negative(&format!("{field}.fixed_s"), r.fixed_s)?;
            match r.flop_rate {
                Some(f) => positive(&format!("{field}.flop_rate"), f),
                None => Ok(()),
            }
        };
        positive("gpu.memory", self.gpu.memory.0 as f64)?;
        positive("gpu.bandwidth", self.gpu.bandwidth)?;
        non_negative("gpu.dispatch_s", self.gpu.dispatch_s)?;
        non_negative("gpu.submit_s", self.gpu.submit_s)?;
        positive("pcie.bandwidth", self.pcie.bandwidth)?;
        non_negative("pcie.copy_s", self.pcie.copy_s)?;
        positive("cpu.threads", f64::from(self.cpu.threads))?;
        positive("cpu.memory_bandwidth", self.cpu.memory_bandwidth)?;
        non_negative("cpu.dispatch_s", self.cpu.dispatch_s)?;
        positive("ram.memory", self.ram.memory.0 as f64)?;
        non_negative("ssd.request_s", self.ssd.request_s)?;
        for (t, r) in &self.gpu.matvec {
            roofline(format!("gpu.matvec.{t}"), r)?;
        }
        for (t, r) in &self.cpu.matvec_per_thread {
            roofline(format!("cpu.matvec_per_thread.{t}"), r)?;
        }
        for (t, r) in &self.cpu.matvec {
            roofline(format!("cpu.matvec.{t}"), r)?;
        }
        if self.ssd.reads.is_empty() {
            return Err(ProfileError::NoSsdReads);
        }
        for r in &self.ssd.reads {
            positive("ssd.reads.tile", r.tile.0 as f64)?;
            positive("ssd.reads.bandwidth", r.bandwidth)?;
        }
        Ok(())
    }

    /// A matrix-vector product of weights of type `t` on the GPU.
    pub fn gpu_matvec(&self, t: &WeightType) -> Roofline {
        self.gpu
            .matvec
            .get(t)
            .copied()
            .unwrap_or(Roofline::memory_bound(
                self.gpu.bandwidth * UNMEASURED_EFFICIENCY,
                self.gpu.dispatch_s,
            ))
    }

    /// An element-wise or reduction kernel over device memory (norms, attention over the KV
    /// cache): the plain read bandwidth.
    pub fn gpu_stream(&self) -> Roofline {
        Roofline::memory_bound(self.gpu.bandwidth, self.gpu.dispatch_s)
    }

    /// Seconds of a layer's decode attention on the GPU, its dispatch included, for a query
    /// `query_width` floats wide at `position`, over `kv_bytes` of cache: calibrated
    /// ([`attention_seconds`]), or the cache read at the stream's bandwidth after one dispatch.
    pub fn gpu_attention(&self, query_width: u64, position: u64, kv_bytes: u64) -> f64 {
        attention_seconds(&self.gpu.attention, query_width, position)
            .unwrap_or_else(|| self.gpu_stream().predict(Work::transfer(kv_bytes)))
    }

    /// A matrix-vector product of weights of type `t` on all CPU threads: measured, or `threads`
    /// times the single-thread rate capped by the memory bandwidth.
    pub fn cpu_matvec(&self, t: &WeightType) -> Roofline {
        if let Some(r) = self.cpu.matvec.get(t) {
            return *r;
        }
        let n = f64::from(self.cpu.threads);
        match self.cpu.matvec_per_thread.get(t) {
            Some(one) => Roofline {
                fixed_s: self.cpu.dispatch_s,
                bandwidth: (one.bandwidth * n).min(self.cpu.memory_bandwidth),
                flop_rate: one.flop_rate.map(|f| f * n),
            },
            None => Roofline::memory_bound(
                self.cpu.memory_bandwidth * UNMEASURED_EFFICIENCY,
                self.cpu.dispatch_s,
            ),
        }
    }

    /// Seconds of one `k`×`n` product of `bytes` of type `t` on the GPU as a decode step
    /// chains it, its dispatch included.
    pub fn gpu_product(&self, t: &WeightType, k: u64, n: u64, bytes: u64) -> f64 {
        match self.gpu_shaped(t, k, n, bytes) {
            Some(s) => self.gpu.dispatch_s + s,
            None => self.gpu_matvec(t).predict(Work::matvec(k, n, bytes, 1)),
        }
    }

    /// What a product adds to a GPU step beyond its dispatch (`gpu.dispatch_s`, which the step
    /// model counts per op): from the calibrated shapes where the profile has them
    /// ([`shaped_marginal`]), else the roofline's marginal.
    pub fn gpu_product_marginal(&self, t: &WeightType, k: u64, n: u64, bytes: u64) -> f64 {
        self.gpu_shaped(t, k, n, bytes)
            .unwrap_or_else(|| self.gpu_matvec(t).marginal(Work::matvec(k, n, bytes, 1)))
    }

    fn gpu_shaped(&self, t: &WeightType, k: u64, n: u64, bytes: u64) -> Option<f64> {
        let points = self.gpu.matvec_points.get(t)?;
        shaped_marginal(self.gpu.dispatch_s, points, bytes, k, n)
    }

    /// Seconds of one `k`×`n` product of type `t` on all CPU threads, the pool's wake-up
    /// included.
    pub fn cpu_product(&self, t: &WeightType, k: u64, n: u64, bytes: u64) -> f64 {
        match self.cpu_shaped(t, k, n, bytes) {
            Some(s) => self.cpu.dispatch_s + s,
            None => self.cpu_matvec(t).predict(Work::matvec(k, n, bytes, 1)),
        }
    }

    /// What a product adds to the CPU's part of a step beyond the pool's wake-up
    /// (`cpu.dispatch_s`): from the calibrated shapes where the profile has them, else the
    /// roofline's marginal.
    pub fn cpu_product_marginal(&self, t: &WeightType, k: u64, n: u64, bytes: u64) -> f64 {
        self.cpu_shaped(t, k, n, bytes)
            .unwrap_or_else(|| self.cpu_matvec(t).marginal(Work::matvec(k, n, bytes, 1)))
    }

    /// Seconds one more chosen routed expert adds to a CPU MoE layer: `k` wide, `n` rows,
    /// `bytes` its gate, up and down together, of type `t` (a mixed expert: its gate's). From
    /// the calibrated experts; `None` without them.
    pub fn cpu_expert(&self, t: &WeightType, k: u64, n: u64, bytes: u64) -> Option<f64> {
        let points = self.cpu.expert_points.get(t)?;
        shaped_marginal(0.0, points, bytes, k, n)
    }

    /// Seconds one more chosen routed expert adds to a GPU MoE layer: `k` wide, `n` rows,
    /// `bytes` its gate, up and down together, of type `t`. From the calibrated experts;
    /// `None` without them.
    pub fn gpu_expert(&self, t: &WeightType, k: u64, n: u64, bytes: u64) -> Option<f64> {
        let points = self.gpu.expert_points.get(t)?;
        shaped_marginal(0.0, points, bytes, k, n)
    }

    fn cpu_shaped(&self, t: &WeightType, k: u64, n: u64, bytes: u64) -> Option<f64> {
        let points = self.cpu.matvec_points.get(t)?;
        shaped_marginal(self.cpu.dispatch_s, points, bytes, k, n)
    }

    /// A host-to-device copy.
    pub fn host_to_device(&self) -> Roofline {
        Roofline::memory_bound(self.pcie.bandwidth, self.pcie.copy_s)
    }

    /// SSD throughput at a tile size: interpolated in log(tile) between measured sizes, the
    /// nearest measured value outside them.
    pub fn ssd_bandwidth(&self, tile: ByteSize) -> f64 {
        let mut pts: Vec<SsdRead> = self.ssd.reads.clone();
        pts.sort_by_key(|r| r.tile);
        let x = (tile.0.max(1) as f64).ln();
        let first = pts[0];
        let last = pts[pts.len() - 1];
        if tile <= first.tile {
            return first.bandwidth;
        }
        if tile >= last.tile {
            return last.bandwidth;
        }
        let i = pts
            .iter()
            .position(|r| r.tile >= tile)
            .expect("inside the range");
        let (a, b) = (pts[i - 1], pts[i]);
        let (xa, xb) = ((a.tile.0 as f64).ln(), (b.tile.0 as f64).ln());
        a.bandwidth + (b.bandwidth - a.bandwidth) * (x - xa) / (xb - xa)
    }

    /// Reads from the SSD in tiles of `tile` bytes.
    pub fn ssd_read(&self, tile: ByteSize) -> Roofline {
        Roofline::memory_bound(self.ssd_bandwidth(tile), self.ssd.request_s)
    }

    /// The smallest measured tile size whose throughput is within 10% of the best: larger
    /// tiles only cost staging memory and waste reads of experts that end mid-tile.
    pub fn best_tile(&self) -> ByteSize {
        let best = self
            .ssd
            .reads
            .iter()
            .map(|r| r.bandwidth)
            .fold(0.0, f64::max);
        self.ssd
            .reads
            .iter()
            .filter(|r| r.bandwidth >= TILE_SPEED_FRACTION * best)
            .map(|r| r.tile)
            .min()
            .expect("validated: at least one read")
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small made-up machine for unit tests.
    pub(crate) fn test_profile() -> HardwareProfile {
        HardwareProfile::from_toml(
            r#"
            source = "made up for tests"
            [key]
            device = "Test GPU 8GB"
            driver = "testdrv 1.0"
            cpu = "Test CPU"
            [gpu]
            memory = "8GiB"
            bandwidth = 300e9
            dispatch_s = 5e-6
            submit_s = 20e-6
            [gpu.matvec.Q4_K]
            fixed_s = 5e-6
            bandwidth = 240e9
            flop_rate = 20e12
            [pcie]
            bandwidth = 12e9
            copy_s = 10e-6
            [cpu]
            threads = 8
            memory_bandwidth = 60e9
            dispatch_s = 20e-6
            [cpu.matvec_per_thread.Q4_K]
            fixed_s = 0.0
            bandwidth = 10e9
            flop_rate = 60e9
            [ram]
            memory = "32GiB"
            [ssd]
            request_s = 80e-6
            reads = [
                { tile = "64KiB", bandwidth = 1.0e9 },
                { tile = "1MiB", bandwidth = 5.0e9 },
                { tile = "4MiB", bandwidth = 6.5e9 },
                { tile = "16MiB", bandwidth = 6.8e9 },
            ]
            "#,
        )
        .unwrap()
    }

    #[test]
    fn attention_follows_its_calibrated_positions_and_widths() {
        let pt = |query_width, position, us: f64| AttentionPoint {
            query_width,
            position,
            seconds: us * 1e-6,
        };
        let points = [
            pt(2048, 16, 5.0),
            pt(2048, 128, 15.0),
            pt(2048, 1024, 17.0),
            pt(4096, 16, 10.0),
            pt(4096, 128, 30.0),
            pt(4096, 1024, 34.0),
        ];
        let us = |w, p| attention_seconds(&points, w, p).unwrap() * 1e6;
        let near = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(
            near(us(2048, 1), 5.0),
            "below the first position: the first's"
        );
        assert!(near(us(2048, 72), 10.0), "between positions: linear");
        assert!(
            near(us(2048, 1920), 19.0),
            "past the last: the last segment's slope"
        );
        assert!(near(us(3072, 128), 22.5), "between widths: linear");
        assert!(near(us(8192, 128), 60.0), "past the widest: the trend");
        assert!(near(us(1024, 16), 2.5), "never under half the least");
        assert_eq!(attention_seconds(&[], 4096, 64), None);
    }

    #[test]
    fn toml_round_trip_keeps_every_figure() {
        let p = test_profile();
        let again = HardwareProfile::from_toml(&p.to_toml()).unwrap();
        assert_eq!(again, p);
        assert_eq!(p.gpu.memory, ByteSize(8 << 30));
    }

    #[test]
    fn derived_rates() {
        let p = test_profile();
        let q4k = WeightType::new("q4_k");
        // CPU: 8 threads x 10 GB/s capped by 60 GB/s of memory.
        let cpu = p.cpu_matvec(&q4k);
        assert_eq!(cpu.bandwidth, 60e9);
        assert_eq!(cpu.flop_rate, Some(480e9));
        // An unmeasured type falls back to a fraction of the read bandwidth.
        let f16 = p.gpu_matvec(&WeightType::new("F16"));
        assert_eq!(f16.bandwidth, 300e9 * UNMEASURED_EFFICIENCY);
        assert_eq!(p.gpu_matvec(&q4k).bandwidth, 240e9);
        // SSD: 4 MiB is the smallest tile within 10% of the best; 2 MiB interpolates.
        assert_eq!(p.best_tile(), ByteSize(4 << 20));
        let mid = p.ssd_bandwidth(ByteSize(2 << 20));
        assert!((mid - 5.75e9).abs() < 1e6, "{mid}");
        assert_eq!(p.ssd_bandwidth(ByteSize(1)), 1.0e9);
    }

    #[test]
    fn validation_names_the_bad_field() {
        let mut p = test_profile();
        p.pcie.bandwidth = 0.0;
        let e = p.validate().unwrap_err().to_string();
        assert!(e.contains("pcie.bandwidth"), "{e}");
        let text = test_profile()
            .to_toml()
            .replace("threads = 8", "threads = \"many\"");
        assert!(matches!(
            HardwareProfile::from_toml(&text),
            Err(ProfileError::Toml(_))
        ));
    }

    #[test]
    fn key_file_names_are_stable_and_distinct() {
        let k = test_profile().key;
        assert_eq!(k.file_name(), "test-gpu-8gb--testdrv-1-0--test-cpu.toml");
        let other = ProfileKey {
            driver: "testdrv 1.1".into(),
            ..k.clone()
        };
        assert_ne!(other.file_name(), k.file_name());
    }
}
