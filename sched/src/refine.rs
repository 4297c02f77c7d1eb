//! Online refinement: the daemon reports the measured time of each kernel and transfer of real
//! steps; the predictors refit from them, and the stored profile takes the refined figures.

use std::collections::BTreeMap;

use crate::model::WeightType;
use crate::predict::{OnlinePredictor, Roofline, Work};
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
}
