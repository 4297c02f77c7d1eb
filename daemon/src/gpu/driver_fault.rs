//! The driver refusing the objects a recording makes, injected: `SPILLWAY_FAULT_DRIVER_OOM=
//! pool:N` (or `commands:N`; read once per process) makes the device of the `N`th token a GPU
//! model evaluates in this process refuse its next descriptor pool (or its next command
//! buffers) with `VK_ERROR_OUT_OF_DEVICE_MEMORY`, once, as a driver out of memory would.
//! Those objects are made as steps are recorded, not at load, and come from the driver, not
//! from our allocator (whose refusals `super::alloc::fault` injects). [`refuse_after`] arms it
//! from inside a process.

use super::token_fault::TokenFault;

/// What the driver refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverObject {
    /// A descriptor pool of a recording ([`super::record`]).
    DescriptorPool = 1,
    /// Command buffers from the device's pool.
    CommandBuffers = 2,
}

static REFUSAL: TokenFault = TokenFault::new("SPILLWAY_FAULT_DRIVER_OOM", &["pool", "commands"]);

/// Arms the refusal of `what` on the device of the `n`th next evaluated token (`n >= 1`); 0
/// disarms it.
pub fn refuse_after(n: u64, what: DriverObject) {
    REFUSAL.arm(n, what as u8);
}

/// Counts one token evaluation; what its device is to refuse, if this is the one.
pub(super) fn token_refuses() -> Option<DriverObject> {
    match REFUSAL.count()? {
        1 => Some(DriverObject::DescriptorPool),
        2 => Some(DriverObject::CommandBuffers),
        _ => None,
    }
}
