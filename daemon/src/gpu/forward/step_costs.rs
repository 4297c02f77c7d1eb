//! Whether a decode step of several sequences runs as one batched step or as one step per
//! sequence, chosen by what each has measured on this model.
//!
//! A batched step reads the weights once for every sequence in it; on a dense model that
//! multiplies the tokens a second (2.45× at 8 sequences on the H200). A MoE model's batched
//! step pays for routing and sorting a chunk, for dispatches over every expert of a layer and,
//! under a VRAM budget, for each sequence's misses: there it has cost more than the single
//! steps it replaces (0.49× at 8 sequences, misses over PCIe). Rather than a rule per model
//! shape, each way's wall time is measured as the steps run (per number of sequences, and per
//! sequence for single steps), and a step takes the way measured cheaper. A measurement below
//! the estimate replaces it and one above moves it a fifth of the way: a step slowed by
//! something else on the machine (noise is only ever added time) does not decide for long. The
//! way not taken is tried again after 4 steps, then 8, 16 ... up to every 128, since costs move
//! with the context length and with which experts are resident.

/// Weight of a measurement above the estimate.
const ALPHA: f64 = 0.2;

/// The most steps of several sequences between two that take the way not preferred, to keep
/// its cost current: at the 8B shape's figures about 1% of a step's time when batching wins.
pub const PROBE_EVERY: u64 = 128;

/// Steps before the first such probe once both ways are measured; the gap doubles after each.
const FIRST_PROBE: u64 = 4;

/// How steps of several sequences run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StepBatching {
    /// The way measured cheaper (see the module's notes).
    #[default]
    Measured,
    /// Batched wherever the model can batch them: for tests and benchmarks of that path.
    Always,
}

impl std::str::FromStr for StepBatching {
    type Err = String;

    fn from_str(s: &str) -> Result<StepBatching, String> {
        match s {
            "measured" => Ok(StepBatching::Measured),
            "always" => Ok(StepBatching::Always),
            _ => Err(format!("{s:?} is not `measured` or `always`")),
        }
    }
}

/// Measured costs of the two ways, in seconds.
#[derive(Debug, Default)]
pub(super) struct StepCosts {
    /// One sequence's step of its own.
    single: Estimate,
    /// A batched step, by its number of sequences.
    batched: Vec<Estimate>,
    /// When a step of several sequences takes the way not preferred.
    probes: Probes,
}

/// When a choice between two measured ways takes the one not preferred, to keep its cost
/// current: after [`FIRST_PROBE`] choices once both are measured, then twice as many after
/// each, up to every [`PROBE_EVERY`].
#[derive(Clone, Debug, Default)]
pub(super) struct Probes {
    /// Choices made.
    decided: u64,
    /// The choice (in `decided`) that takes the way not preferred next, and the gap after it;
    /// 0 until both ways are measured.
    next_probe: u64,
    gap: u64,
}

impl Probes {
    /// Counts a choice.
    pub(super) fn count(&mut self) {
        self.decided += 1;
    }

    /// Whether the choice just counted, with both ways measured, takes the way not preferred.
    pub(super) fn probe(&mut self) -> bool {
        if self.next_probe == 0 {
            self.gap = FIRST_PROBE;
            self.next_probe = self.decided + self.gap;
        }
        if self.decided < self.next_probe {
            return false;
        }
        self.gap = (2 * self.gap).min(PROBE_EVERY);
        self.next_probe = self.decided + self.gap;
        true
    }
}

/// What one way is measured to cost.
#[derive(Clone, Copy, Debug, Default)]
pub(super) enum Estimate {
    /// Not run yet.
    #[default]
    Unseen,
    /// Run once: that first step records the step's commands (and compiles pipelines), so it
    /// is not counted.
    Warm,
    /// Seconds.
    Measured(f64),
}

impl Estimate {
    /// The estimate after a step of `secs`: lower ones replace it, higher ones move it by
    /// [`ALPHA`] of the difference.
    pub(super) fn record(self, secs: f64) -> Estimate {
        Estimate::Measured(match self {
            Estimate::Unseen => return Estimate::Warm,
            Estimate::Measured(o) if secs > o => o + ALPHA * (secs - o),
            _ => secs,
        })
    }

    pub(super) fn secs(self) -> Option<f64> {
        match self {
            Estimate::Measured(s) => Some(s),
            _ => None,
        }
    }
}

impl StepCosts {
    /// Whether a step of `n` sequences runs batched.
    pub(super) fn batch(&mut self, n: usize, how: StepBatching) -> bool {
        if how == StepBatching::Always {
            return true;
        }
        self.probes.count();
        let (Some(b), Some(s)) = (self.batched_cost(n), self.single.secs()) else {
            // What is not measured yet is measured first, batched before single.
            return self.batched_cost(n).is_none();
        };
        let batched_cheaper = b < n as f64 * s;
        batched_cheaper != self.probes.probe()
    }

    /// A batched step of `n` sequences took `secs`.
    pub(super) fn record_batched(&mut self, n: usize, secs: f64) {
        if self.batched.len() <= n {
            self.batched.resize(n + 1, Estimate::Unseen);
        }
        self.batched[n] = self.batched[n].record(secs);
    }

    /// `n` sequences took single steps, one after another, in `secs` together.
    pub(super) fn record_single(&mut self, n: usize, secs: f64) {
        if n > 0 {
            self.single = self.single.record(secs / n as f64);
        }
    }

    fn batched_cost(&self, n: usize) -> Option<f64> {
        self.batched.get(n).and_then(|e| e.secs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `steps` steps of `n` sequences with the given costs; how many ran batched.
    fn run(c: &mut StepCosts, n: usize, steps: u64, batched: f64, single: f64) -> u64 {
        let mut count = 0;
        for _ in 0..steps {
            if c.batch(n, StepBatching::Measured) {
                count += 1;
                c.record_batched(n, batched);
            } else {
                c.record_single(n, n as f64 * single);
            }
        }
        count
    }

    #[test]
    fn each_way_is_measured_first_then_the_cheaper_one_runs_and_the_other_is_probed() {
        // A dense model's figures: a batch of 8 in 10.7 ms against 3.3 ms a sequence.
        let mut c = StepCosts::default();
        // Batched twice (the first is the recording's and not counted), then single twice.
        let first: Vec<bool> = (0..4)
            .map(|_| {
                let b = c.batch(8, StepBatching::Measured);
                if b {
                    c.record_batched(8, 0.0107);
                } else {
                    c.record_single(8, 8.0 * 0.0033);
                }
                b
            })
            .collect();
        assert_eq!(first, [true, true, false, false]);
        // The first probe comes after 4 steps, then 8, 16 ... 128: 7 in the next 512 steps.
        assert_eq!(run(&mut c, 8, 5, 0.0107, 0.0033), 4);
        let batched = run(&mut c, 8, 4 * PROBE_EVERY, 0.0107, 0.0033);
        assert_eq!(batched, 4 * PROBE_EVERY - 7, "all but the probes");

        // A MoE model under its budget: a batch of 8 in 66 ms against 4.1 ms a sequence.
        let mut c = StepCosts::default();
        let batched = run(&mut c, 8, 4 * PROBE_EVERY, 0.066, 0.0041);
        assert!(batched <= 2 + 9, "measuring, then only probes: {batched}");
    }

    #[test]
    fn a_step_slowed_by_something_else_does_not_decide_for_long() {
        let mut c = StepCosts::default();
        // Batched steps that cost 8 ms, but the one measured first took 40 (the machine was
        // busy): single steps (4 ms a sequence, 16 for 4) win until the first probe.
        c.batch(4, StepBatching::Measured);
        c.record_batched(4, 0.008);
        c.batch(4, StepBatching::Measured);
        c.record_batched(4, 0.040);
        assert_eq!(run(&mut c, 4, 2, 0.008, 0.004), 0, "single steps measured");
        assert_eq!(run(&mut c, 4, 5, 0.008, 0.004), 1, "the probe after four");
        assert!(
            run(&mut c, 4, 100, 0.008, 0.004) >= 96,
            "batched from then on"
        );
    }

    #[test]
    fn costs_that_change_change_the_choice_within_a_few_probes() {
        let mut c = StepCosts::default();
        run(&mut c, 4, PROBE_EVERY, 0.020, 0.004);
        // Batched steps become cheap (the hot experts came into VRAM): the next probe sees it.
        run(&mut c, 4, 2 * PROBE_EVERY, 0.008, 0.004);
        assert!(run(&mut c, 4, PROBE_EVERY, 0.008, 0.004) >= PROBE_EVERY - 1);
        // And dear again: measured at every step, the estimate follows within a few.
        run(&mut c, 4, 20, 0.030, 0.004);
        assert!(run(&mut c, 4, 64, 0.030, 0.004) <= 1);
    }

    #[test]
    fn sizes_are_measured_apart_and_always_means_always() {
        let mut c = StepCosts::default();
        run(&mut c, 2, 10, 0.05, 0.004);
        assert!(
            c.batch(3, StepBatching::Measured),
            "3 sequences are not measured yet"
        );
        assert!(c.batch(2, StepBatching::Always));
    }
}
