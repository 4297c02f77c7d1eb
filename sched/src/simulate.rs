//! The simulator: the same planner and predictors on a described machine, to predict tokens/s
//! and the plan for hardware we do not have.
//!
//! Machines are [`HardwareProfile`] TOML files; three ship with the crate (`sched/profiles/`).
//! Models are a [`ModelDesc`] (the daemon reads one from a GGUF header) or a [`ModelSpec`]:
//! a preset or hyper-parameters, and a weight type.

use serde::Deserialize;

use crate::model::presets::{self, ModelShape, Quant};
use crate::model::ModelDesc;
use crate::plan::{self, Pin, Plan, PlanError, PlanOptions};
use crate::profile::{HardwareProfile, ProfileError};
use crate::ByteSize;

/// The profiles shipped in `sched/profiles/`, by name.
pub const SHIPPED_PROFILES: &[(&str, &str)] = &[
    ("laptop-8gb", include_str!("../profiles/laptop-8gb.toml")),
    (
        "desktop-24gb",
        include_str!("../profiles/desktop-24gb.toml"),
    ),
    ("h200", include_str!("../profiles/h200.toml")),
    (
        "h200-calibrated",
        include_str!("../profiles/h200-calibrated.toml"),
    ),
];

/// A shipped profile by name (`laptop-8gb`, `desktop-24gb`, `h200`).
pub fn shipped_profile(name: &str) -> Option<Result<HardwareProfile, ProfileError>> {
    SHIPPED_PROFILES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, text)| HardwareProfile::from_toml(text))
}

/// A model to simulate, as TOML: `preset = "qwen3-30b-a3b"` or a `[shape]` table of
/// hyper-parameters, and `weights = "Q4_K_M"` (the default).
#[derive(Debug, Clone, Deserialize)]
pub struct ModelSpec {
    #[serde(default)]
    pub preset: Option<String>,
    #[serde(default)]
    pub shape: Option<ModelShape>,
    #[serde(default)]
    pub weights: Option<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    #[error("model TOML: {0}")]
    Toml(String),
    #[error("model: give exactly one of `preset` and `[shape]`")]
    PresetOrShape,
    #[error("no preset named {0:?}")]
    UnknownPreset(String),
    #[error("{0}")]
    Weights(String),
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error(transparent)]
    Plan(#[from] PlanError),
}

impl ModelSpec {
    pub fn from_toml(text: &str) -> Result<ModelSpec, SimulateError> {
        toml::from_str(text).map_err(|e| SimulateError::Toml(e.to_string()))
    }

    pub fn describe(&self) -> Result<ModelDesc, SimulateError> {
        let shape = match (&self.preset, &self.shape) {
            (Some(name), None) => {
                presets::find(name).ok_or_else(|| SimulateError::UnknownPreset(name.clone()))?
            }
            (None, Some(shape)) => shape.clone(),
            _ => return Err(SimulateError::PresetOrShape),
        };
        let quant: Quant = self
            .weights
            .as_deref()
            .unwrap_or("Q4_K_M")
            .parse()
            .map_err(SimulateError::Weights)?;
        Ok(shape.describe(&quant))
    }
}

/// Plans `model` on `profile`; budgets default to the whole of the profile's VRAM and RAM.
pub fn simulate(
    model: &ModelDesc,
    profile: &HardwareProfile,
    vram_budget: Option<ByteSize>,
    ram_budget: Option<ByteSize>,
    pins: Vec<Pin>,
) -> Result<Plan, PlanError> {
    let mut opts = PlanOptions::new(
        vram_budget.unwrap_or(profile.gpu.memory),
        ram_budget.unwrap_or(profile.ram.memory),
    );
    opts.pins = pins;
    plan::plan(model, profile, &opts)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Bottleneck, Placement};

    fn profile(name: &str) -> HardwareProfile {
        shipped_profile(name).unwrap().unwrap()
    }

    fn model(name: &str) -> ModelDesc {
        presets::find(name).unwrap().describe(&Quant::Q4KM)
    }

    #[test]
    fn shipped_profiles_parse_and_plan_the_big_presets() {
        for &(name, _) in SHIPPED_PROFILES {
            let p = profile(name);
            for m in ["qwen3-30b-a3b", "mixtral-8x7b", "qwen3-235b-a22b"] {
                let plan = simulate(&model(m), &p, None, None, Vec::new())
                    .unwrap_or_else(|e| panic!("{m} on {name}: {e}"));
                assert!(
                    plan.tokens_per_s.is_finite() && plan.tokens_per_s > 0.0,
                    "{m} on {name}"
                );
                assert!(plan.vram.total <= plan.vram_budget, "{m} on {name}");
                assert!(plan.ram.total <= plan.ram_budget, "{m} on {name}");
                assert_eq!(plan.layers.len(), model(m).n_layer as usize + 1);
            }
        }
    }

    #[test]
    fn big_presets_land_where_the_arithmetic_says() {
        // Qwen3-235B-A22B at Q4_K_M is about 133 GiB: more than the desktop's 24 GiB of VRAM
        // plus 111 GiB of RAM, so the desktop's CPU and memory bound it; on the H200
        // (139 GiB) the model fits and the GPU bounds the step. Some experts stay on the CPU,
        // which runs them alongside the GPU's (each expert on the GPU costs four dispatches,
        // the CPU's run as two jobs a layer): under a tenth.
        let big = model("qwen3-235b-a22b");
        let h200 = simulate(&big, &profile("h200"), None, None, Vec::new()).unwrap();
        assert_eq!(h200.bottleneck, Bottleneck::Gpu);
        let e = h200.experts.unwrap();
        assert!(e.in_vram as f64 > 0.9 * e.experts as f64, "{e:?}");
        let desktop = simulate(&big, &profile("desktop-24gb"), None, None, Vec::new()).unwrap();
        assert_ne!(desktop.bottleneck, Bottleneck::Gpu);
        assert!(desktop.tokens_per_s < h200.tokens_per_s / 5.0);
        // Decode reads ~22B active parameters at ~4.8 bits: ~13 GB a token, which ~4.5 TB/s
        // at 70% reads ~240 times a second; the GPU engine's dispatches (five per routed
        // expert: 94 layers of 8) bound it well below that.
        assert!(
            h200.tokens_per_s > 20.0 && h200.tokens_per_s < 240.0,
            "{}",
            h200.tokens_per_s
        );

        // Qwen3-30B-A3B on the 8 GB laptop: experts off VRAM, attention in VRAM.
        let laptop = simulate(
            &model("qwen3-30b-a3b"),
            &profile("laptop-8gb"),
            None,
            None,
            Vec::new(),
        )
        .unwrap();
        assert_eq!(
            laptop.placement("blk.10.attn_q.weight"),
            Some(&Placement::Vram)
        );
        let e = laptop.experts.unwrap();
        assert!(e.in_vram < e.experts && e.in_vram > 0, "{e:?}");
    }

    #[test]
    fn model_specs_from_toml() {
        let m = ModelSpec::from_toml("preset = \"mixtral-8x7b\"\nweights = \"Q8_0\"")
            .unwrap()
            .describe()
            .unwrap();
        assert!(m.tensors.iter().all(|t| t.shape.len() == 1
            || t.weight_type.name() == "Q8_0"
            || t.name.contains("gate_inp")));
        let shape = toml::to_string(&presets::find("llama-3-8b").unwrap()).unwrap();
        let spec = ModelSpec::from_toml(&format!("[shape]\n{shape}")).unwrap();
        assert_eq!(spec.describe().unwrap(), model("llama-3-8b"));
        assert!(matches!(
            ModelSpec::from_toml("preset = \"gpt-5\"")
                .unwrap()
                .describe(),
            Err(SimulateError::UnknownPreset(_))
        ));
        assert!(matches!(
            ModelSpec::from_toml("").unwrap().describe(),
            Err(SimulateError::PresetOrShape)
        ));
    }
}
