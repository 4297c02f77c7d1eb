//! Fault-injection points: the device memory allocation that the driver refuses.
//!
//! `SPILLWAY_FAULT_DEVICE_OOM=N` (read once per process) makes the `N`th device memory block the
//! process allocates (1 is the first) fail as if the driver were out of device memory, once;
//! [`fail_block_after`] does the same from inside a process (tests). Checked once per new
//! block (64 MiB and up), so it costs nothing measurable. [`fail_allocation_after`] counts
//! every allocation instead, from a block already held or a new one, so that a test can make
//! the allocation of its choice fail (the same error a refused block gives).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;

/// Blocks still to allocate before the injected failure; 0: none armed.
static COUNTDOWN: AtomicU64 = AtomicU64::new(0);
/// Allocations still to make before the injected failure; 0: none armed.
static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
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
    fires(&COUNTDOWN)
}

/// Arms the failure of the `n`th next allocation of device memory (`n >= 1`), whichever
/// allocator makes it; 0 disarms it. Process-wide: for a test binary of one test.
pub fn fail_allocation_after(n: u64) {
    ALLOCATIONS.store(n, Ordering::SeqCst);
}

/// Whether this allocation is the one to fail (counting it).
pub(super) fn allocation_fails() -> bool {
    fires(&ALLOCATIONS)
}

/// Counts one event down on `countdown`; whether it was the armed one.
fn fires(countdown: &AtomicU64) -> bool {
    countdown
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| c.checked_sub(1))
        .is_ok_and(|before| before == 1)
}
