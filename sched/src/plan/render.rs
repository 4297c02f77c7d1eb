//! A plan as a text table (JSON is serde's: [`Plan::to_json`]).

use std::fmt::{self, Write};

use crate::ByteSize;

use super::{Placement, Plan, Source};

fn from(s: Source) -> &'static str {
    match s {
        Source::Ram => "RAM",
        Source::Ssd => "SSD",
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Vram => f.write_str("VRAM"),
            Placement::Stream { from: s } => write!(f, "stream from {}", from(*s)),
            Placement::Cpu { from: s } => write!(f, "CPU from {}", from(*s)),
            Placement::Experts(e) => {
                let mut parts = Vec::new();
                for (n, what) in [
                    (e.vram.len(), "VRAM"),
                    (e.stream.len(), "stream"),
                    (e.cpu.len(), "CPU"),
                ] {
                    if n > 0 {
                        parts.push(format!("{n} {what}"));
                    }
                }
                write!(f, "experts: {}", parts.join(", "))?;
                let off = e.stream.len() + e.cpu.len();
                if off > 0 {
                    write!(f, " ({} of {off} in RAM)", e.in_ram.len())?;
                }
                Ok(())
            }
        }
    }
}

impl Plan {
    /// The text report: prediction, memory, expert caches, each tensor, each layer.
    pub fn write_table(&self, out: &mut String) -> fmt::Result {
        writeln!(out, "{} on {}", self.model, self.profile)?;
        writeln!(
            out,
            "budgets: VRAM {}, RAM {}; context {} tokens",
            self.vram_budget, self.ram_budget, self.context
        )?;
        let bounds: Vec<String> = self
            .bound_time_s
            .iter()
            .map(|(b, t)| format!("{b} {:.2} ms", t * 1e3))
            .collect();
        writeln!(
            out,
            "predicted decode: {:.1} tokens/s ({:.2} ms/token); bottleneck: {} (layers bound by {})",
            self.tokens_per_s,
            self.step_s * 1e3,
            self.bottleneck,
            bounds.join(", ")
        )?;
        writeln!(
            out,
            "streaming: tiles of {}, prefetch depth {}",
            self.tile, self.prefetch_depth
        )?;
        writeln!(out)?;
        writeln!(
            out,
            "{:<6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
            "memory", "weights", "experts", "KV cache", "activations", "staging", "total"
        )?;
        for (name, m) in [("VRAM", &self.vram), ("RAM", &self.ram)] {
            let z = |b: ByteSize| {
                if b.0 == 0 {
                    "-".to_string()
                } else {
                    b.to_string()
                }
            };
            writeln!(
                out,
                "{:<6} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
                name,
                z(m.weights),
                z(m.expert_cache),
                z(m.kv_cache),
                z(m.activations),
                z(m.staging),
                z(m.total)
            )?;
        }
        if let Some(e) = &self.experts {
            writeln!(
                out,
                "experts: {} of {} in VRAM, {} more in RAM; expected hits: VRAM {:.1}%, VRAM or RAM {:.1}%",
                e.in_vram,
                e.experts,
                e.in_ram,
                e.vram_hit_rate * 100.0,
                e.ram_hit_rate * 100.0
            )?;
        }
        writeln!(out)?;
        let width = self
            .tensors
            .iter()
            .map(|t| t.name.len())
            .max()
            .unwrap_or(6)
            .max(6);
        writeln!(
            out,
            "{:<width$} {:<13} {:<7} {:>11}  placement",
            "tensor", "role", "type", "size"
        )?;
        for t in &self.tensors {
            write!(
                out,
                "{:<width$} {:<13} {:<7} {:>11}  {}",
                t.name,
                t.role,
                t.weight_type,
                ByteSize(t.bytes).to_string(),
                t.placement
            )?;
            if let Some(p) = &t.pinned {
                write!(out, "  [pinned: {p}]")?;
            }
            writeln!(out)?;
        }
        writeln!(out)?;
        writeln!(
            out,
            "{:<8} {:>9} {:>9} {:>9} {:>9} {:>9}  bound",
            "layer", "ms", "GPU ms", "CPU ms", "PCIe ms", "SSD ms"
        )?;
        for l in &self.layers {
            let t = &l.time;
            writeln!(
                out,
                "{:<8} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3}  {}",
                l.name,
                t.total_s * 1e3,
                t.gpu_s * 1e3,
                t.cpu_s * 1e3,
                t.pcie_s * 1e3,
                t.ssd_s * 1e3,
                t.bound
            )?;
        }
        if !self.notes.is_empty() {
            writeln!(out)?;
            for n in &self.notes {
                writeln!(out, "note: {n}")?;
            }
        }
        Ok(())
    }
}
