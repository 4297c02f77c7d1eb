//! Calibration at the daemon's first start on a Vulkan device: the stored profile of this
//! machine (keyed by GPU, driver and CPU, [`ProfileKey::file_name`]) when there is one, else a
//! short calibration ([`first_start_plan`]) whose profile is stored for the next start.
//! `spillwayd calibrate` runs the full plan and overwrites it.

use std::path::{Path, PathBuf};
use std::time::Instant;

use spillway_sched::calibrate::{calibrate, CalibrationPlan, Progress};
use spillway_sched::model::WeightType;
use spillway_sched::profile::{HardwareProfile, ProfileKey};

use super::gpu::GpuBench;
use super::host::HostBench;
use super::{machine_facts, Bench, CalibrateError, TYPES};

/// Where this machine's profile is kept under the cache directory.
pub fn profile_path(cache: &Path, key: &ProfileKey) -> PathBuf {
    cache.join("profiles").join(key.file_name())
}

/// The plan of a first start: every weight type the GPU reads, at three shapes (an expert's,
/// a projection's, a feed-forward matrix's, of three widths: a shape's local fit needs
/// products of more than one width) in one chain length, one MoE layer's experts (a
/// Qwen3-30B-A3B layer's) on the CPU and the GPU, decode attention at four positions, three
/// copy sizes and three tile sizes of 16 MiB each. Fewer shapes than [`super::full_plan`], so
/// its shaped corrections are coarser; `spillwayd calibrate --first-start` runs it and says
/// what each stage took.
pub fn first_start_plan() -> CalibrationPlan {
    CalibrationPlan {
        weight_types: TYPES.into_iter().map(WeightType::new).collect(),
        matrices: vec![(2048, 512), (4096, 4096), (14336, 4096)],
        chains: vec![32],
        experts: vec![(2048, 768, 8)],
        attention_positions: vec![16, 128, 1024, 4096],
        copy_sizes: vec![1 << 20, 8 << 20, 64 << 20],
        ssd_tiles: vec![256 << 10, 1 << 20, 4 << 20],
        ssd_bytes: 16 << 20,
    }
}

/// What [`stored_or_calibrate`] did.
#[derive(Debug)]
pub enum Outcome {
    /// The profile stored for this machine.
    Stored(PathBuf),
    /// Calibrated now, in the seconds given, and stored.
    Calibrated { path: PathBuf, seconds: f64 },
}

/// This machine's profile: read from `cache` when stored, else measured on Vulkan device
/// `index` with [`first_start_plan`] (reporting progress) and stored there.
pub fn stored_or_calibrate(
    index: Option<usize>,
    cache: &Path,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<(HardwareProfile, Outcome), FirstStartError> {
    let gpu = GpuBench::open(index)?;
    let facts = machine_facts(gpu.info());
    let path = profile_path(cache, &facts.key);
    if let Ok(text) = std::fs::read_to_string(&path) {
        let profile = HardwareProfile::from_toml(&text).map_err(|e| FirstStartError::Stored {
            path: path.clone(),
            message: e.to_string(),
        })?;
        return Ok((profile, Outcome::Stored(path)));
    }
    let start = Instant::now();
    let plan = first_start_plan();
    let host = HostBench::new(None, cache, plan.ssd_bytes)?;
    let mut bench = Bench { gpu, host };
    let profile = calibrate(&facts, &mut bench, &plan, progress)?;
    let seconds = start.elapsed().as_secs_f64();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let text = format!(
        "# Calibrated at the daemon's first start ({seconds:.1} s, the short plan); \
         `spillwayd calibrate` measures more shapes.\n{}",
        profile.to_toml()
    );
    store(&path, &text)?;
    Ok((profile, Outcome::Calibrated { path, seconds }))
}

/// Writes a profile's `text` to `path` whole under another name, then renames it: a daemon
/// killed mid-write leaves no half profile for the next start to trip on.
pub fn store(path: &Path, text: &str) -> std::io::Result<()> {
    let partial = path.with_extension("toml.partial");
    std::fs::write(&partial, text)?;
    std::fs::rename(&partial, path)
}

#[derive(Debug, thiserror::Error)]
pub enum FirstStartError {
    #[error(transparent)]
    Calibrate(#[from] CalibrateError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the stored hardware profile {path} is unreadable ({message}): delete it to calibrate again")]
    Stored { path: PathBuf, message: String },
}

impl From<crate::gpu::GpuError> for FirstStartError {
    fn from(e: crate::gpu::GpuError) -> Self {
        FirstStartError::Calibrate(e.into())
    }
}
