//! A synthetic model of a preset with F16 weights (seed 5), written into a test's directory and
//! opened: F16 keeps the CPU's rounding of activations within 0.1% of the logits, so the GPU and
//! CPU paths of the Vulkan tests can be compared tightly.

use std::path::Path;
use std::sync::Arc;

use spillway_daemon::model::Model;
use spillway_daemon::synth::SynthModel;

pub fn f16_model(dir: &Path, preset: &str) -> Arc<Model> {
    let path = dir.join(format!("{preset}.gguf"));
    SynthModel::from_name(preset, "F16".parse().unwrap(), 5)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    Arc::new(Model::open(&path).unwrap())
}
