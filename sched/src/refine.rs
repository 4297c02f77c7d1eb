//! Online refinement: the daemon reports the measured time of each kernel and transfer of real
//! steps; the predictors refit from them, and the stored profile takes the refined figures.

use std::collections::BTreeMap;

use crate::model::WeightType;
use crate::predict::{OnlinePredictor, Roofline, ShapePoint, Work};
use crate::profile::HardwareProfile;
use crate::ByteSize;

/// Which predictor a timing belongs to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PredictorKey {
    GpuMatVec(WeightType),
    CpuMatVec(WeightType),
    HostToDevice,
    SsdRead,
}

/// Predictors seeded from a profile and refined by observations.
#[derive(Debug, Clone)]
pub struct Predictors {
    profile: HardwareProfile,
    tile: ByteSize,
    online: BTreeMap<PredictorKey, OnlinePredictor>,
}

impl Predictors {
    /// SSD predictions are for reads of `tile` bytes, the tile size the streamer uses.
    pub fn new(profile: HardwareProfile, tile: ByteSize) -> Predictors {
        Predictors {
            profile,
            tile,
            online: BTreeMap::new(),
        }
    }

    fn prior(&self, key: &PredictorKey) -> Roofline {
        match key {
            PredictorKey::GpuMatVec(t) => self.profile.gpu_matvec(t),
            PredictorKey::CpuMatVec(t) => self.profile.cpu_matvec(t),
            PredictorKey::HostToDevice => self.profile.host_to_device(),
            PredictorKey::SsdRead => self.profile.ssd_read(self.tile),
        }
    }

    pub fn roofline(&self, key: &PredictorKey) -> Roofline {
        self.online
            .get(key)
            .map_or_else(|| self.prior(key), |p| p.roofline())
    }

    pub fn predict(&self, key: &PredictorKey, w: Work) -> f64 {
        self.roofline(key).predict(w)
    }

    /// Records one measured operation.
    pub fn observe(&mut self, key: PredictorKey, w: Work, seconds: f64) {
        let prior = self.prior(&key);
        self.online
            .entry(key)
            .or_insert_with(|| OnlinePredictor::new(prior))
            .observe(w, seconds);
    }

    /// The profile with every predictor that has seen at least `min_observations` timings
    /// written back, ready to be stored again under its key.
    pub fn refined_profile(&self, min_observations: usize) -> HardwareProfile {
        let mut p = self.profile.clone();
        for (key, online) in &self.online {
            if online.observations() < min_observations {
                continue;
            }
            let r = online.roofline();
            match key {
                PredictorKey::GpuMatVec(t) => {
                    p.gpu.matvec.insert(t.clone(), r);
                }
                PredictorKey::CpuMatVec(t) => {
                    p.cpu.matvec.insert(t.clone(), r);
                }
                PredictorKey::HostToDevice => {
                    p.pcie.bandwidth = r.bandwidth;
                    p.pcie.copy_s = r.fixed_s;
                }
                PredictorKey::SsdRead => {
                    // Rescale the measured curve so that it passes through the observed
                    // throughput at the streamer's tile size.
                    let scale = r.bandwidth / p.ssd_bandwidth(self.tile);
                    for read in &mut p.ssd.reads {
                        read.bandwidth *= scale;
                    }
                    p.ssd.request_s = r.fixed_s;
                }
            }
        }
        p.source = format!(
            "{}; refined from timings of real steps",
            self.profile.source
        );
        p
    }
}

/// Where an observed product ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Side {
    Gpu,
    Cpu,
}

/// Products timed in real decode steps, by side, weight type and shape: the seconds of one
/// product as the step ran it (on the GPU its dispatch included, on the CPU the pool's
/// wake-up included), to become shape points of the profile ([`crate::predict::ShapePoint`]).
/// Where a step timed a group of products together, the daemon shares the group's time out
/// in proportion to what the profile predicted for each.
#[derive(Debug, Clone, Default)]
pub struct ObservedProducts {
    /// By (side, type, k, n): the bytes of the product and its timings.
    seen: BTreeMap<ProductKey, (u64, Vec<f64>)>,
}

type ProductKey = (Side, WeightType, u64, u64);

impl ObservedProducts {
    /// One product of a `k`-wide, `n`-tall matrix of `bytes` took `seconds`.
    pub fn observe(
        &mut self,
        side: Side,
        t: &WeightType,
        k: u64,
        n: u64,
        bytes: u64,
        seconds: f64,
    ) {
        if !(seconds.is_finite() && seconds > 0.0) || bytes == 0 {
            return;
        }
        let entry = self
            .seen
            .entry((side, t.clone(), k, n))
            .or_insert_with(|| (bytes, Vec::new()));
        entry.1.push(seconds);
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// Writes the median of every shape seen at least `min_observations` times into
    /// `profile`'s shape points: a shape already there (calibrated, or refined before) moves
    /// halfway to it, a new one is added. Returns the shapes written.
    pub fn refine(&self, profile: &mut HardwareProfile, min_observations: usize) -> usize {
        let mut written = 0;
        for ((side, t, k, n), (bytes, times)) in &self.seen {
            if times.len() < min_observations.max(1) {
                continue;
            }
            let mut sorted = times.clone();
            sorted.sort_by(f64::total_cmp);
            let median = sorted[sorted.len() / 2];
            let points = match side {
                Side::Gpu => &mut profile.gpu.matvec_points,
                Side::Cpu => &mut profile.cpu.matvec_points,
            };
            let points = points.entry(t.clone()).or_default();
            match points.iter_mut().find(|p| p.k == *k && p.n == *n) {
                // Halfway in log space: one noisy request cannot undo calibration.
                Some(p) => p.seconds = (p.seconds * median).sqrt(),
                None => points.push(ShapePoint {
                    k: *k,
                    n: *n,
                    bytes: *bytes,
                    seconds: median,
                }),
            }
            written += 1;
        }
        if written > 0 && !profile.source.contains("refined") {
            profile.source = format!("{}; refined from timings of real steps", profile.source);
        }
        written
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::predict::tests::Rng;
    use crate::profile::tests::test_profile;

    #[test]
    fn observed_timings_refine_the_stored_profile() {
        let profile = test_profile();
        let tile = profile.best_tile();
        let mut pred = Predictors::new(profile.clone(), tile);
        let q4k = WeightType::new("Q4_K");
        // The real GPU kernel is 20% slower than calibration said; PCIe is as measured.
        let real = Roofline {
            bandwidth: 200e9,
            ..profile.gpu_matvec(&q4k)
        };
        let mut rng = Rng::new(9);
        for i in 0..64u64 {
            let n = 1024 * (1 + i % 8);
            let w = Work::matvec(4096, n, 4096 * n * 9 / 16, 1);
            pred.observe(
                PredictorKey::GpuMatVec(q4k.clone()),
                w,
                real.predict(w) * rng.noise(0.05),
            );
            let c = Work::transfer(n << 10);
            let t = profile.host_to_device().predict(c) * rng.noise(0.05);
            pred.observe(PredictorKey::HostToDevice, c, t);
        }
        let w = Work::matvec(4096, 4096, 4096 * 4096 * 9 / 16, 1);
        let key = PredictorKey::GpuMatVec(q4k.clone());
        assert!((pred.predict(&key, w) / real.predict(w) - 1.0).abs() < 0.05);

        let refined = pred.refined_profile(32);
        let g = refined.gpu_matvec(&q4k);
        assert!((g.bandwidth / 200e9 - 1.0).abs() < 0.05, "{g:?}");
        assert!((refined.pcie.bandwidth / profile.pcie.bandwidth - 1.0).abs() < 0.05);
        // Nothing observed: unchanged.
        assert_eq!(refined.ssd, profile.ssd);
        assert_eq!(refined.cpu, profile.cpu);
        // Too few observations to trust: the profile keeps its figures.
        assert_eq!(pred.refined_profile(1000).gpu, profile.gpu);
    }

    #[test]
    fn observed_products_become_shape_points_and_move_the_predictions() {
        let mut profile = test_profile();
        let q4k = WeightType::new("Q4_K");
        let (k, n) = (2048u64, 8192u64);
        let bytes = q4k.bytes_for(k * n).unwrap();
        let before = profile.gpu_product(&q4k, k, n, bytes);
        // The real kernel takes twice the roofline's time at this shape.
        let real = 2.0 * before;
        let mut seen = ObservedProducts::default();
        let mut rng = Rng::new(4);
        for _ in 0..9 {
            seen.observe(Side::Gpu, &q4k, k, n, bytes, real * rng.noise(0.03));
        }
        seen.observe(Side::Cpu, &q4k, k, n, bytes, 1e-3);
        assert_eq!(
            seen.refine(&mut profile, 3),
            1,
            "the CPU's one timing is too few"
        );
        let after = profile.gpu_product(&q4k, k, n, bytes);
        assert!((after / real - 1.0).abs() < 0.05, "{after} against {real}");
        assert!(profile
            .source
            .ends_with("refined from timings of real steps"));
        assert!(profile.cpu.matvec_points.is_empty());
        // Seen again at half the time: halfway (in log space) to it, not all the way.
        let mut again = ObservedProducts::default();
        for _ in 0..3 {
            again.observe(Side::Gpu, &q4k, k, n, bytes, before);
        }
        again.refine(&mut profile, 3);
        let twice = profile.gpu_product(&q4k, k, n, bytes);
        assert!(twice < after && twice > before, "{before} {twice} {after}");
        assert_eq!(profile.gpu.matvec_points[&q4k].len(), 1);
        HardwareProfile::from_toml(&profile.to_toml()).unwrap();
    }
}
