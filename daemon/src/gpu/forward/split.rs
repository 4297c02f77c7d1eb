//! How a chained step shares a MoE layer's missing experts between the CPU and the bus
//! ([`MoeMiss::Split`](crate::gpu::placement::MoeMiss::Split)).
//!
//! At each MoE layer the host gives the CPU a share of the experts that have no VRAM slot
//! (computed from the memory map) and the device the rest (read from system RAM over the bus
//! by the dispatches that run the resident ones); both run at once. The share is found by
//! measuring whole steps: tokens alternate between the share plus [`DELTA`] and minus it, and
//! after [`TOKENS_PER_ARM`] tokens of each the share moves by `DELTA` toward the faster side.
//! It thus climbs to the share that makes steps fastest on this machine and model, whatever
//! bounds the two sides (the bus, the CPU's dot products, the memory both read), measured
//! rather than assumed.
//!
//! (A first version moved the share after every layer by whether the device's part had
//! completed when the CPU's sum was ready. On an H100 it drove the CPU's share to about 0.08,
//! where a fixed 0.6 ran 19% faster: `bench/RESULTS.md`.)

/// Half the gap between the two shares a round compares, and the step a round moves.
pub(super) const DELTA: f32 = 0.05;

/// Tokens timed at each of the two shares before the share moves.
pub(super) const TOKENS_PER_ARM: u32 = 6;

/// The CPU's share before anything is measured.
const FIRST_SHARE: f32 = 0.5;

#[derive(Debug, Clone, Copy)]
pub(super) struct SplitShare {
    share: f32,
    /// A share given by the caller stays as given, and is not probed.
    fixed: bool,
    /// Nanoseconds and tokens timed at `share + DELTA` (0) and `share - DELTA` (1) this round.
    arms: [(u64, u32); 2],
    /// Tokens timed this round.
    turn: u32,
}

impl SplitShare {
    /// `fixed`: a share to keep (clamped to `0..=1`); `None`: measured.
    pub(super) fn new(fixed: Option<f32>) -> SplitShare {
        SplitShare {
            share: fixed.map_or(FIRST_SHARE, |s| s.clamp(0.0, 1.0)),
            fixed: fixed.is_some(),
            arms: [(0, 0); 2],
            turn: 0,
        }
    }

    /// The share the search stands at (between probes).
    pub(super) fn share(&self) -> f32 {
        self.share
    }

    /// The share this token uses: the share itself when fixed, else one of the two probes.
    fn current(&self) -> f32 {
        if self.fixed {
            return self.share;
        }
        let side = if self.turn.is_multiple_of(2) {
            DELTA
        } else {
            -DELTA
        };
        (self.share + side).clamp(0.0, 1.0)
    }

    /// How many of a layer's `misses` the CPU takes in this token's step.
    pub(super) fn cpu_count(&self, misses: usize) -> usize {
        ((self.current() * misses as f32).round() as usize).min(misses)
    }

    /// After a step that shared misses: its time, counted for the probe it used.
    pub(super) fn observe_step(&mut self, step_ns: u64) {
        if self.fixed {
            return;
        }
        let arm = &mut self.arms[(self.turn % 2) as usize];
        arm.0 += step_ns;
        arm.1 += 1;
        self.turn += 1;
        if self.turn < 2 * TOKENS_PER_ARM {
            return;
        }
        let mean = |(ns, n): (u64, u32)| ns as f64 / f64::from(n.max(1));
        let up = mean(self.arms[0]) < mean(self.arms[1]);
        let step = if up { DELTA } else { -DELTA };
        self.share = (self.share + step).clamp(0.0, 1.0);
        self.arms = [(0, 0); 2];
        self.turn = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step's time when the CPU takes `share` of the misses: the slower side, the CPU
    /// taking `cpu` and the bus `bus` for all of them, plus a fixed part and some noise.
    fn step_ns(share: f32, (cpu, bus): (f64, f64), noise: f64) -> u64 {
        let s = f64::from(share);
        (1e6 + (s * cpu).max((1.0 - s) * bus) + noise) as u64
    }

    #[test]
    fn the_share_climbs_to_the_fastest_steps() {
        // (CPU ns, bus ns for every miss, the share that balances them)
        for (cpu, bus) in [(6e6, 9e6), (9e6, 3e6), (4e6, 4e6)] {
            let best = (bus / (cpu + bus)) as f32;
            let mut s = SplitShare::new(None);
            let mut x = 12345u64;
            let mut late = Vec::new();
            for i in 0..1200 {
                // Noise of ±5% of the fixed part, from a small LCG.
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let noise = ((x >> 33) as f64 / (1u64 << 31) as f64 - 0.5) * 1e5;
                s.observe_step(step_ns(s.current(), (cpu, bus), noise));
                if i >= 600 {
                    late.push(s.share());
                }
            }
            let mean = late.iter().sum::<f32>() / late.len() as f32;
            assert!(
                (mean - best).abs() < 0.1,
                "{cpu}/{bus}: {mean} against {best}"
            );
        }
    }

    #[test]
    fn a_given_share_stays_and_counts_whole_experts() {
        let mut s = SplitShare::new(Some(0.5));
        for t in 0..100 {
            s.observe_step(1000 + t);
        }
        assert_eq!(s.share(), 0.5);
        assert_eq!(s.cpu_count(6), 3);
        assert_eq!(s.cpu_count(0), 0);
        assert_eq!(SplitShare::new(Some(7.0)).cpu_count(5), 5);
        assert_eq!(SplitShare::new(Some(-1.0)).cpu_count(5), 0);
    }

    #[test]
    fn probes_alternate_around_the_share() {
        let mut s = SplitShare::new(None);
        assert_eq!(s.cpu_count(20), 11);
        s.observe_step(1);
        assert_eq!(s.cpu_count(20), 9);
    }
}
