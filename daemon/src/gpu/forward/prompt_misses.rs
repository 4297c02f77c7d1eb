//! Where a prompt chunk's routed experts that miss VRAM run, for a MoE model under its VRAM
//! budget that has both ways: streamed through VRAM slots ([`super::stream_experts`]: each
//! missing expert copied over PCIe once for the chunk and run on the GPU over its tokens) or
//! on the CPU, as its batched decode steps run them (each missing expert read from RAM once
//! and run over its tokens while the GPU runs the resident ones).
//!
//! Which is faster depends on the chunk: a chunk of a few tokens chooses most of a layer's
//! experts but gives each one or two tokens, so streaming copies nearly every missing expert
//! for little arithmetic and the CPU, which reads them faster than the bus carries them on a
//! machine like the H200's, wins; a chunk of hundreds gives each expert many tokens, which the
//! GPU multiplies far faster. Rather than a rule, each way's time per token is measured per
//! chunk size (by powers of two) as prompts run, as [`super::step_costs`] measures decode
//! steps: streamed first (twice: the first run is not counted), then on the CPU, then the way
//! measured cheaper, the other probed after 4 chunks of that size, then 8 ... up to every 128.

use super::step_costs::{Estimate, Probes};

/// The two ways' costs for each chunk size.
#[derive(Debug, Default)]
pub(super) struct PromptMisses {
    sizes: Vec<TwoWays>,
}

/// Seconds per token of a chunk of one size class, each way.
#[derive(Debug, Default, Clone)]
struct TwoWays {
    stream: Estimate,
    cpu: Estimate,
    probes: Probes,
}

impl PromptMisses {
    /// Whether a prompt chunk of `n` tokens runs its misses on the CPU.
    pub(super) fn on_cpu(&mut self, n: usize) -> bool {
        let w = self.size(n);
        w.probes.count();
        let (Some(stream), Some(cpu)) = (w.stream.secs(), w.cpu.secs()) else {
            // Streamed first (the way prompts ran before), then on the CPU.
            return w.stream.secs().is_some();
        };
        let cpu_cheaper = cpu < stream;
        cpu_cheaper != w.probes.probe()
    }

    /// A chunk of `n` tokens took `secs` with its misses on the CPU (`on_cpu`) or streamed.
    pub(super) fn record(&mut self, n: usize, on_cpu: bool, secs: f64) {
        let per_token = secs / n.max(1) as f64;
        let w = self.size(n);
        match on_cpu {
            true => w.cpu = w.cpu.record(per_token),
            false => w.stream = w.stream.record(per_token),
        }
    }

    /// The size class of chunks of `n` tokens: `n` rounded up to a power of two.
    fn size(&mut self, n: usize) -> &mut TwoWays {
        let class = n.max(1).next_power_of_two().trailing_zeros() as usize;
        if self.sizes.len() <= class {
            self.sizes.resize(class + 1, TwoWays::default());
        }
        &mut self.sizes[class]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::forward::step_costs::PROBE_EVERY;

    /// Runs `chunks` chunks of `n` tokens at the given seconds a token each way; how many ran
    /// on the CPU.
    fn run(p: &mut PromptMisses, n: usize, chunks: u64, stream: f64, cpu: f64) -> u64 {
        let mut count = 0;
        for _ in 0..chunks {
            let on_cpu = p.on_cpu(n);
            count += u64::from(on_cpu);
            let secs = n as f64 * if on_cpu { cpu } else { stream };
            p.record(n, on_cpu, secs);
        }
        count
    }

    #[test]
    fn each_way_is_measured_then_the_cheaper_runs_per_size() {
        let mut p = PromptMisses::default();
        // Streamed twice, on the CPU twice, then the cheaper (the CPU) with probes.
        let first: Vec<bool> = (0..4)
            .map(|_| {
                let c = p.on_cpu(32);
                p.record(32, c, 32.0 * if c { 0.004 } else { 0.030 });
                c
            })
            .collect();
        assert_eq!(first, [false, false, true, true]);
        let cpu = run(&mut p, 32, 4 * PROBE_EVERY, 0.030, 0.004);
        // Probes after 4 chunks, then 8, 16 ... 128: 8 in these 512.
        assert_eq!(cpu, 4 * PROBE_EVERY - 8, "all but the probes");
        // Chunks of 512 are measured apart, and there streaming wins.
        let cpu = run(&mut p, 512, 4 * PROBE_EVERY, 0.0005, 0.003);
        assert!(cpu <= 2 + 7, "measuring, then only probes: {cpu}");
        // 20 and 32 tokens share a size class; 33 does not.
        assert!(p.on_cpu(20));
        assert!(!p.on_cpu(33), "33 is not measured yet: streamed first");
    }
}
