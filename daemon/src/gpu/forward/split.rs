//! How a chained step shares a MoE layer's missing experts between the CPU and the bus
//! ([`MoeMiss::Split`](crate::gpu::placement::MoeMiss::Split)).
//!
//! At each MoE layer the host gives the CPU a share of the experts that have no VRAM slot
//! (computed from the memory map) and the device the rest (read from system RAM over the bus
//! by the dispatches that run the resident ones); both run at once. Once the CPU's sum is
//! written the host looks, without waiting, whether the device's part has completed: if it
//! has, the CPU was the slower side and its share falls by [`STEP`]; if not, it rises. The
//! share thus settles where the two sides finish together, on whatever machine and model,
//! measured rather than assumed.

/// The change of the CPU's share after each layer.
pub(super) const STEP: f32 = 0.02;

/// The CPU's share before anything is measured.
const FIRST_SHARE: f32 = 0.25;

#[derive(Debug, Clone, Copy)]
pub(super) struct SplitShare {
    share: f32,
    /// A share given by the caller stays as given.
    fixed: bool,
}

impl SplitShare {
    /// `fixed`: a share to keep (clamped to `0..=1`); `None`: measured.
    pub(super) fn new(fixed: Option<f32>) -> SplitShare {
        SplitShare {
            share: fixed.map_or(FIRST_SHARE, |s| s.clamp(0.0, 1.0)),
            fixed: fixed.is_some(),
        }
    }

    pub(super) fn share(&self) -> f32 {
        self.share
    }

    /// How many of a layer's `misses` the CPU takes.
    pub(super) fn cpu_count(&self, misses: usize) -> usize {
        ((self.share * misses as f32).round() as usize).min(misses)
    }

    /// After a layer with misses: `device_first` says the device's part had completed when
    /// the CPU's sum was ready.
    pub(super) fn observe(&mut self, device_first: bool) {
        if self.fixed {
            return;
        }
        let step = if device_first { -STEP } else { STEP };
        self.share = (self.share + step).clamp(0.0, 1.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A layer of `misses` experts: the CPU takes `c` of them at `cpu` time each, the device
    /// the rest at `bus` each; whether the device finished first.
    fn device_first(s: &SplitShare, misses: usize, (cpu, bus): (f32, f32)) -> bool {
        let c = s.cpu_count(misses);
        (misses - c) as f32 * bus <= c as f32 * cpu
    }

    #[test]
    fn the_share_settles_where_both_sides_finish_together() {
        // The bus twice as fast as the CPU: the CPU should take about a third.
        for (cpu, bus, want) in [(2.0, 1.0, 1.0 / 3.0), (1.0, 1.0, 0.5), (1.0, 3.0, 0.75)] {
            let mut s = SplitShare::new(None);
            let mut shares = Vec::new();
            for _ in 0..400 {
                let first = device_first(&s, 48, (cpu, bus));
                s.observe(first);
                shares.push(s.share());
            }
            let late = &shares[200..];
            let mean = late.iter().sum::<f32>() / late.len() as f32;
            assert!(
                (mean - want).abs() < 0.05,
                "{cpu}/{bus}: {mean} against {want}"
            );
        }
    }

    #[test]
    fn a_given_share_stays_and_counts_whole_experts() {
        let mut s = SplitShare::new(Some(0.5));
        for _ in 0..10 {
            s.observe(true);
        }
        assert_eq!(s.share(), 0.5);
        assert_eq!(s.cpu_count(6), 3);
        assert_eq!(s.cpu_count(0), 0);
        assert_eq!(SplitShare::new(Some(7.0)).cpu_count(5), 5);
        assert_eq!(SplitShare::new(Some(-1.0)).cpu_count(5), 0);
    }
}
