//! Calibration on this machine's Vulkan device (lavapipe in CI) and CPU: the quick plan runs
//! every micro-benchmark and yields a valid hardware profile that the planner reads back.
//! Without a device the test skips, unless `SPILLWAY_REQUIRE_VULKAN` is set.

use spillway_daemon::calibrate::{
    gpu::GpuBench, host::HostBench, machine_facts, quick_plan, Bench,
};
use spillway_sched::calibrate::calibrate;
use spillway_sched::model::WeightType;
use spillway_sched::profile::HardwareProfile;

#[test]
fn the_quick_plan_measures_every_part_and_gives_a_valid_profile() {
    let Some(device) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let max_range = device.max_storage_buffer_range();
    let mut gpu = GpuBench::on(device);
    // Experts whose stack passes one binding (F16 4096 × 1536: 24 MiB each, gate and up) are
    // left out where the device cannot bind eight of them, not an error.
    let f16 = WeightType::new("F16");
    let stack_of_eight = 8 * 2 * 1536 * 4096 * 2;
    if max_range < stack_of_eight {
        assert_eq!(gpu.experts(&f16, 4096, 1536, 8).unwrap(), None);
    }
    let dir = tempfile::tempdir().unwrap();
    let plan = quick_plan();
    let facts = machine_facts(gpu.info());
    assert!(facts.cpu_threads >= 1 && facts.ram.0 > 0, "{facts:?}");
    let host = HostBench::new(None, dir.path(), plan.ssd_bytes).unwrap();
    let mut bench = Bench { gpu, host };
    let mut steps = Vec::new();
    let profile = calibrate(&facts, &mut bench, &plan, &mut |p| steps.push(p.done)).unwrap();
    assert_eq!(steps, (1..=plan.steps()).collect::<Vec<_>>());
    // Every weight type's experts ran as the CPU engine runs a MoE layer's, and as a GPU
    // decode step runs them.
    for t in &plan.weight_types {
        for (side, points) in [
            ("CPU", &profile.cpu.expert_points[t]),
            ("GPU", &profile.gpu.expert_points[t]),
        ] {
            assert_eq!(points.len(), plan.experts.len(), "{side} {t}");
            assert!(
                points.iter().all(|p| p.seconds > 0.0),
                "{side} {t}: {points:?}"
            );
        }
    }

    // Decode attention ran as a decode step runs it, at every position of the plan.
    let heads = spillway_sched::calibrate::ATTENTION_HEADS.len();
    assert_eq!(
        profile.gpu.attention.len(),
        heads * plan.attention_positions.len()
    );
    assert!(
        profile.gpu.attention.iter().all(|p| p.seconds > 0.0),
        "{:?}",
        profile.gpu.attention
    );
    for (what, v) in [
        ("GPU bandwidth", profile.gpu.bandwidth),
        ("host-to-device bandwidth", profile.pcie.bandwidth),
        ("CPU memory bandwidth", profile.cpu.memory_bandwidth),
    ] {
        assert!(v.is_finite() && v > 0.0, "{what}: {v}");
    }
    assert_eq!(profile.ssd.reads.len(), plan.ssd_tiles.len());
    for t in &plan.weight_types {
        assert!(
            profile.gpu.matvec.contains_key(t),
            "no GPU fit for {}",
            t.name()
        );
        assert!(
            profile.cpu.matvec.contains_key(t),
            "no CPU fit for {}",
            t.name()
        );
    }
    assert!(!profile.gpu.matvec.contains_key(&WeightType::new("Q6_K")));
    // The scratch file is gone once the bench is.
    drop(bench);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);

    let back = HardwareProfile::from_toml(&profile.to_toml()).unwrap();
    assert_eq!(back.key, profile.key);
    assert_eq!(back.ssd.reads.len(), profile.ssd.reads.len());
}
