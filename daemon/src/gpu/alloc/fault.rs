//! A fault-injection point: the device memory allocation that the driver refuses.
//!
//! `SPILLWAY_FAULT_DEVICE_OOM=N` (read once per process) makes the `N`th device memory block the
//! process allocates (1 is the first) fail as if the driver were out of device memory, once;
//! [`fail_block_after`] does the same from inside a process (tests). Checked once per new
//! block (64 MiB and up), so it costs nothing measurable.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

/// Blocks still to allocate before the injected failure; 0: none armed.
static COUNTDOWN: AtomicU64 = AtomicU64::new(0);
static FROM_ENV: Once = Once::new();

/// Arms the failure of the `n`th next block allocation (`n >= 1`); 0 disarms it.
pub fn fail_block_after(n: u64) {
    FROM_ENV.call_once(|| {});
    COUNTDOWN.store(n, Ordering::SeqCst);
}

/// Whether this block allocation is the one to fail (counting it).
pub(super) fn block_fails() -> bool {
    FROM_ENV.call_once(|| {
        if let Some(n) = std::env::var("SPILLWAY_FAULT_DEVICE_OOM")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
        {
            tracing::warn!("fault injection: device block allocation {n} will fail");
            COUNTDOWN.store(n, Ordering::SeqCst);
        }
    });
    COUNTDOWN
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| c.checked_sub(1))
        .is_ok_and(|before| before == 1)
}
