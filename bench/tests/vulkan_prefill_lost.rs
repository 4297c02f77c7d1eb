//! A device lost in the middle of a prompt's chunk: the injected loss (`gpu::lost`, counted per
//! token evaluated, a chunk's tokens each; process-wide, hence this test's own binary) fails
//! the prompt with `DeviceLost`, the position stays where the prompt began, and the model
//! refuses work until it is reloaded. On whatever Vulkan device the machine has (lavapipe in
//! CI); without one this test skips, unless `SPILLWAY_REQUIRE_VULKAN` is set.

use std::sync::Arc;

use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions};
use spillway_daemon::gpu::lost::{lose_device_after, LossPoint};
use spillway_daemon::gpu::{Device, GpuError, Instance};
use spillway_daemon::model::Model;

#[test]
fn a_device_lost_inside_a_chunk_fails_the_prompt() {
    if spillway_daemon::gpu::device_or_skip().is_none() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    SynthModel::from_name("tiny-llama", "Q8_0".parse::<WeightType>().unwrap(), 5)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    let model = Arc::new(Model::open(&path).unwrap());
    let options = GpuModelOptions {
        context: 128,
        ..GpuModelOptions::default()
    };
    for point in [LossPoint::Submit, LossPoint::Wait] {
        // A device of its own: a lost one stays lost.
        let dev = Device::open(Instance::new().unwrap(), None).unwrap();
        let mut gpu = GpuModel::new(&dev, &model, &options).unwrap();
        assert!(gpu.batches_prompts());
        gpu.eval_prompt(&[1, 2, 3], false).unwrap();
        // The 10th token from here is the 7th of this 20-token chunk.
        lose_device_after(10, point);
        gpu.eval_prompt(&[4, 5, 6], false).unwrap();
        let err = gpu.eval_prompt(&[7; 20], false).unwrap_err();
        assert!(matches!(err, GpuError::DeviceLost), "{point:?}: {err}");
        assert_eq!(gpu.position(), 6, "{point:?}");
        assert!(dev.is_lost(), "{point:?}");
        assert!(matches!(
            gpu.eval_prompt(&[8, 9], false),
            Err(GpuError::DeviceLost)
        ));
    }
}
