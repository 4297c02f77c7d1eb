//! `spillwayd calibrate [--device vulkan[:N]] [--file MODEL.gguf] [--quick | --first-start]
//! [--out FILE]`:
//! measures this machine (GPU kernels and memory, host-to-device copies, CPU kernels and memory,
//! disk reads) and writes the hardware profile that `spillwayd plan --profile FILE` uses.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context};
use clap::Args;
use spillway_daemon::calibrate::{
    first_start, full_plan, machine_facts, quick_plan, Bench, StageClock,
};
use spillway_daemon::calibrate::{gpu::GpuBench, host::HostBench};
use spillway_daemon::server::default_model::env_cache_dir;
use spillway_sched::calibrate::calibrate;

use super::run::RunDevice;

#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// The GPU to measure: `vulkan` (the preferred device) or `vulkan:N`.
    #[arg(long, default_value = "vulkan")]
    pub device: RunDevice,
    /// Read the disk from this file (a model on the disk models load from); default: a scratch
    /// file in the cache directory.
    #[arg(long)]
    pub file: Option<PathBuf>,
    /// A few seconds of small cases instead of the full plan (coarse figures).
    #[arg(long, conflicts_with = "first_start")]
    pub quick: bool,
    /// The plan the daemon runs at its first start (fewer shapes than the full plan).
    #[arg(long)]
    pub first_start: bool,
    /// Where the profile goes; default: `$XDG_CACHE_HOME/spillway/profiles/<machine>.toml`.
    /// `-` prints it.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: &CalibrateArgs) -> anyhow::Result<()> {
    let RunDevice::Vulkan(index) = args.device else {
        bail!(
            "--device {}: calibration measures a Vulkan device (vulkan or vulkan:N)",
            args.device
        );
    };
    let cache = env_cache_dir()
        .context("no cache directory: set XDG_CACHE_HOME or HOME, or give --out and --file")?;
    let plan = if args.quick {
        quick_plan()
    } else if args.first_start {
        first_start::first_start_plan()
    } else {
        full_plan()
    };
    let gpu = GpuBench::open(index).context("opening the Vulkan device")?;
    let facts = machine_facts(gpu.info());
    let host = HostBench::new(args.file.as_deref(), &cache, plan.ssd_bytes)?;
    let mut bench = Bench { gpu, host };
    eprintln!(
        "calibrating {} / {} with {} threads",
        facts.key.device, facts.key.cpu, facts.cpu_threads
    );
    let mut stderr = std::io::stderr();
    let mut clock = StageClock::start();
    let profile = calibrate(&facts, &mut bench, &plan, &mut |p| {
        clock.report(p.what);
        let _ = write!(stderr, "\r{:>3}/{} {:<24}", p.done, p.total, p.what);
    })?;
    eprintln!();
    let seconds: f64 = clock.stages().iter().map(|s| s.1).sum();
    eprintln!("calibrated in {seconds:.1} s: {}", clock.summary());
    let text = profile.to_toml();
    match args.out.as_deref() {
        Some(p) if p.as_os_str() == "-" => print!("{text}"),
        out => {
            let path = out.map_or_else(
                || first_start::profile_path(&cache, &facts.key),
                PathBuf::from,
            );
            if let Some(dir) = path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            // Whole or not at all: a daemon starting meanwhile reads the old profile or this.
            first_start::store(&path, &text)
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!(
                "GPU {:.1} GB/s, host-to-device {:.1} GB/s, CPU memory {:.1} GB/s, disk {:.2} GB/s",
                profile.gpu.bandwidth / 1e9,
                profile.pcie.bandwidth / 1e9,
                profile.cpu.memory_bandwidth / 1e9,
                profile
                    .ssd
                    .reads
                    .iter()
                    .map(|r| r.bandwidth)
                    .fold(0.0, f64::max)
                    / 1e9,
            );
            eprintln!(
                "profile written to {} (use: spillwayd plan --profile FILE)",
                path.display()
            );
        }
    }
    Ok(())
}
