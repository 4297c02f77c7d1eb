//! The daemon's hardware profile, shared by its models and refined online: each profiled
//! decode step's products ([`Costs::observe`](super::profile::costs::Costs::observe)) become
//! shape points of the profile ([`ObservedProducts::refine`]), so that later predictions
//! (`spillway profile`, plans, planned layouts) use what this machine's real steps took. A
//! profile that came from the cache directory (stored or calibrated at first start) is written
//! back there; one named by `--hardware-profile` is refined in memory only.

use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::RwLock;
use spillway_sched::profile::HardwareProfile;
use spillway_sched::refine::ObservedProducts;

/// Timings of a shape needed before they move its point: one layer's products seen in a few
/// steps, not a single outlier.
const MIN_OBSERVATIONS: usize = 4;

#[derive(Debug)]
pub struct HardwareCell {
    current: RwLock<Option<Arc<HardwareProfile>>>,
    /// Where the refined profile is stored, when it came from there.
    store: Option<PathBuf>,
}

impl HardwareCell {
    pub fn new(profile: Option<Arc<HardwareProfile>>, store: Option<PathBuf>) -> Arc<HardwareCell> {
        Arc::new(HardwareCell {
            current: RwLock::new(profile),
            store,
        })
    }

    /// A daemon without a profile.
    pub fn none() -> Arc<HardwareCell> {
        HardwareCell::new(None, None)
    }

    /// The profile as refined so far.
    pub fn get(&self) -> Option<Arc<HardwareProfile>> {
        self.current.read().clone()
    }

    /// Folds `seen` into the profile; returns the shapes refined. The stored copy is replaced
    /// whole ([`store`](crate::calibrate::first_start::store)).
    pub fn refine(&self, seen: &ObservedProducts) -> usize {
        if seen.is_empty() {
            return 0;
        }
        let mut current = self.current.write();
        let Some(profile) = current.as_deref() else {
            return 0;
        };
        let mut refined = profile.clone();
        let shapes = seen.refine(&mut refined, MIN_OBSERVATIONS);
        if shapes == 0 {
            return 0;
        }
        if let Some(path) = &self.store {
            match crate::calibrate::first_start::store(path, &refined.to_toml()) {
                Ok(()) => {
                    tracing::info!(shapes, path = %path.display(), "hardware profile refined")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), "storing the refined hardware profile: {e}")
                }
            }
        } else {
            tracing::info!(shapes, "hardware profile refined (in memory)");
        }
        *current = Some(Arc::new(refined));
        shapes
    }
}
