//! Online refinement: the daemon reports the measured time of the products of real decode
//! steps ([`ObservedProducts`]); shapes seen often enough become (or move) shape points of the
//! profile, which predictions and plans then use, and the stored profile takes them.

use std::collections::BTreeMap;

use crate::model::WeightType;
use crate::predict::ShapePoint;
use crate::profile::HardwareProfile;

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
