//! The placement planner: which tensor, and which expert, lives in VRAM, is streamed to the GPU
//! each step, or runs on the CPU, under VRAM and RAM budgets, for the most predicted decode
//! tokens/s.
//!
//! The algorithm is greedy by benefit density, not an optimal knapsack: see [`greedy`].

mod evaluate;
mod greedy;
pub mod pins;
mod render;
mod step;

use serde::{Deserialize, Serialize};

use crate::ByteSize;

pub use evaluate::{layer_accuracy, layer_times, with_resident_experts};
pub use greedy::{minimum_vram, plan};
pub use pins::{Pin, PinError, Tier};
pub use step::{Bottleneck, GroupTime};

/// What the user asks for.
#[derive(Debug, Clone)]
pub struct PlanOptions {
    pub vram_budget: ByteSize,
    pub ram_budget: ByteSize,
    pub pins: Vec<Pin>,
    /// Tokens of context the KV cache is sized for; decode is predicted at this position.
    pub context: u64,
    /// Share of routed experts the next-layer prefetch guesses right. mixtral-offloading
    /// reports 80–90% with a speculative next-layer router; the default takes 80%.
    pub prefetch_accuracy: f64,
    /// Plan for the CPU alone (`--device cpu`): no VRAM, every tensor on the CPU.
    pub cpu_only: bool,
}

impl PlanOptions {
    pub fn new(vram_budget: ByteSize, ram_budget: ByteSize) -> PlanOptions {
        PlanOptions {
            vram_budget,
            ram_budget,
            pins: Vec::new(),
            context: 4096,
            prefetch_accuracy: 0.8,
            cpu_only: false,
        }
    }
}

/// Where a tensor's bytes come from when it is not resident in VRAM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Ram,
    Ssd,
}

/// Which experts of a stack go where.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertSplit {
    pub vram: Vec<u32>,
    pub stream: Vec<u32>,
    pub cpu: Vec<u32>,
    /// Those of `stream` and `cpu` held in the RAM expert cache; the others are read from the
    /// SSD when used.
    pub in_ram: Vec<u32>,
}

/// The placement of one tensor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "tier", rename_all = "snake_case")]
pub enum Placement {
    Vram,
    Stream {
        from: Source,
    },
    Cpu {
        from: Source,
    },
    /// An expert stack whose experts are placed one by one.
    Experts(ExpertSplit),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorPlacement {
    pub name: String,
    pub role: String,
    pub weight_type: String,
    pub bytes: u64,
    /// Set when a user pin decided it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned: Option<String>,
    pub placement: Placement,
}

/// Memory a plan uses in one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemoryUse {
    /// Weights resident for the whole run (routed experts excluded).
    pub weights: ByteSize,
    /// Routed experts held (VRAM: resident experts; RAM: the RAM expert cache).
    pub expert_cache: ByteSize,
    /// KV cache (VRAM only).
    pub kv_cache: ByteSize,
    /// Activations, logits and allocation slack (VRAM only).
    pub activations: ByteSize,
    /// Staging slots for streamed tensors (VRAM) or pinned staging buffers (RAM).
    pub staging: ByteSize,
    pub total: ByteSize,
}

/// Routed-expert caches, for MoE models.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ExpertCaches {
    pub experts: u64,
    pub in_vram: u64,
    pub in_ram: u64,
    /// Expected share of used experts found in VRAM, from the activation probabilities.
    pub vram_hit_rate: f64,
    /// Expected share found in VRAM or RAM (the rest is read from the SSD).
    pub ram_hit_rate: f64,
}

/// Predicted time of one layer (`blk.N`, or `head`: embedding, output norm and head).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerPrediction {
    pub name: String,
    #[serde(flatten)]
    pub time: GroupTime,
}

/// A placement and what it is predicted to do.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub model: String,
    pub profile: String,
    pub vram_budget: ByteSize,
    pub ram_budget: ByteSize,
    pub context: u64,
    /// A plan for the CPU alone: nothing in VRAM, the KV cache in RAM.
    #[serde(default)]
    pub cpu_only: bool,
    /// Predicted decode speed at batch 1.
    pub tokens_per_s: f64,
    pub step_s: f64,
    pub bottleneck: Bottleneck,
    /// Seconds per step the layers spent bound by each resource, largest first.
    pub bound_time_s: Vec<(Bottleneck, f64)>,
    pub tile: ByteSize,
    pub prefetch_depth: u32,
    pub vram: MemoryUse,
    pub ram: MemoryUse,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertCaches>,
    pub tensors: Vec<TensorPlacement>,
    pub layers: Vec<LayerPrediction>,
    pub notes: Vec<String>,
}

impl Plan {
    pub fn placement(&self, tensor: &str) -> Option<&Placement> {
        self.tensors
            .iter()
            .find(|t| t.name == tensor)
            .map(|t| &t.placement)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a plan is plain data")
    }

    pub fn from_json(text: &str) -> Result<Plan, serde_json::Error> {
        serde_json::from_str(text)
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    #[error("{0}")]
    Model(#[from] crate::model::ModelError),
    #[error(
        "VRAM budget {budget} is below the {needed} this model needs at least ({breakdown}); {fits}"
    )]
    VramTooSmall {
        budget: ByteSize,
        needed: ByteSize,
        breakdown: String,
        fits: String,
    },
    #[error("RAM budget {budget} is below the {needed} of pinned staging buffers streaming needs; {fits}")]
    RamTooSmall {
        budget: ByteSize,
        needed: ByteSize,
        fits: String,
    },
    #[error("{which} budget {budget} is more than the {have} the profile says the machine has")]
    OverMachine {
        which: &'static str,
        budget: ByteSize,
        have: ByteSize,
    },
}

#[cfg(test)]
mod tests;
