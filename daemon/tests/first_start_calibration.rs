//! `spillwayd serve --device vulkan` with no stored profile calibrates this machine at its
//! first start, shows its progress, stores the profile under the machine's key, and the next
//! start reuses it without measuring. Runs on whatever Vulkan device the machine has (lavapipe
//! in CI) and skips without one, unless `SPILLWAY_REQUIRE_VULKAN` is set.

#[path = "common/daemon.rs"]
mod daemon;

use std::path::Path;

use daemon::Daemon;
use spillway_daemon::calibrate::first_start::profile_path;
use spillway_daemon::calibrate::{machine_facts, TYPES};
use spillway_sched::model::WeightType;
use spillway_sched::profile::HardwareProfile;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_start_calibrates_stores_and_the_next_start_reuses() {
    let Some(device) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let key = machine_facts(device.info()).key;
    drop(device);
    // Rotations over 32 MiB instead of past the caches: the same cases, a fraction of the
    // uploads on a software device (the figures are not what this test checks).
    let cold = Path::new("33554432");
    // The cache outlives both daemons (each deletes its own directory when dropped).
    let home = tempfile::tempdir().unwrap();
    let cache = home.path().join("cache");
    let first = Daemon::spawn(
        &["--device", "vulkan", "--calibrate", "auto"],
        &[
            ("SPILLWAY_CALIBRATE_COLD_BYTES", cold),
            ("XDG_CACHE_HOME", &cache),
        ],
    );
    first.wait_serving().await;
    let log = first.log_text();
    let path = profile_path(&cache.join("spillway"), &key);
    assert!(
        log.contains("calibrating this machine (first start): 1/"),
        "progress is shown:\n{log}"
    );
    assert!(
        log.contains("GPU kernels") && log.contains("SSD reads"),
        "{log}"
    );
    assert!(
        log.contains(&format!("hardware profile stored in {}", path.display())),
        "{log}"
    );
    let text = std::fs::read_to_string(&path).expect("the profile is stored under the key");
    let profile = HardwareProfile::from_toml(&text).unwrap();
    assert_eq!(profile.key, key);
    assert_eq!(profile.source, "measured by calibration");
    for t in TYPES {
        let points = &profile.gpu.matvec_points[&WeightType::new(t)];
        assert_eq!(points.len(), 3, "{t}: the plan's three shapes");
        assert!(points.iter().all(|p| p.seconds > 0.0), "{t}: {points:?}");
        assert_eq!(profile.cpu.matvec_points[&WeightType::new(t)].len(), 3);
        let experts = &profile.cpu.expert_points[&WeightType::new(t)];
        assert_eq!(experts.len(), 1, "{t}: one MoE layer's experts");
        assert!(experts.iter().all(|p| p.seconds > 0.0), "{t}: {experts:?}");
    }
    assert!(log.contains("CPU experts"), "{log}");
    assert!(
        log.contains("calibration stages: GPU memory bandwidth "),
        "each stage's time is logged:\n{log}"
    );
    // No scratch file is left behind.
    let left: Vec<_> = std::fs::read_dir(cache.join("spillway"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("calibrate-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
    drop(first);

    // The same machine again: the stored profile, nothing measured.
    let again = Daemon::spawn(
        &["--device", "vulkan", "--calibrate", "auto"],
        &[("XDG_CACHE_HOME", &cache)],
    );
    again.wait_serving().await;
    let log = again.log_text();
    assert!(!log.contains("calibrating"), "{log}");
    assert!(
        log.contains(&format!("hardware profile: {}", path.display())),
        "{log}"
    );
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        text,
        "not rewritten"
    );

    // `--calibrate never` on a fresh machine measures nothing.
    let never = Daemon::spawn(&["--device", "vulkan", "--calibrate", "never"], &[]);
    never.wait_serving().await;
    assert!(!never.log_text().contains("calibrating"));
    assert!(!never.dir.path().join("cache/spillway/profiles").exists());
}

/// SIGTERM while the first start calibrates ends the daemon at once with status 0, leaving
/// neither a profile nor the calibration's scratch file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_the_first_start_calibration_exits_cleanly() {
    if spillway_daemon::gpu::device_or_skip().is_none() {
        return;
    }
    let home = tempfile::tempdir().unwrap();
    let cache = home.path().join("cache");
    let mut daemon = Daemon::spawn(
        &["--device", "vulkan", "--calibrate", "auto"],
        &[("XDG_CACHE_HOME", &cache)],
    );
    let start = std::time::Instant::now();
    // Into the GPU kernels' stage, which takes seconds on any device.
    while !daemon.log_text().contains("GPU kernels") {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(60),
            "no calibration progress:\n{}",
            daemon.log_text()
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    daemon.terminate();
    let asked = std::time::Instant::now();
    let status = daemon.wait_exit();
    let log = daemon.log_text();
    assert!(status.success(), "{status}:\n{log}");
    assert!(
        asked.elapsed() < std::time::Duration::from_secs(10),
        "it exited {:?} after SIGTERM",
        asked.elapsed()
    );
    assert!(log.contains("SIGTERM before serving: exiting"), "{log}");
    let dir = cache.join("spillway");
    assert!(!dir.join("profiles").exists(), "no profile is stored");
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("calibrate-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
