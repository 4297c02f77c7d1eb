//! Device loss: the state a lost device keeps, and its fault-injection point.
//!
//! A real device loss (`VK_ERROR_DEVICE_LOST`) leaves the device unusable: every later
//! submission fails too, and the only way on is a new device. [`Device`](super::Device) keeps
//! that state, so an injected loss behaves like a real one.
//!
//! `SPILLWAY_FAULT_DEVICE_LOST=submit:N` (or `wait:N`; read once per process) loses the device
//! of the `N`th token a GPU model evaluates in this process (1 is the first): its next queue
//! submission is refused (or its next wait for completed work reports the loss after the work
//! did complete, so nothing in flight is freed early). Once, like the allocation fault;
//! [`lose_device_after`] arms it from inside a process.

use std::sync::atomic::{AtomicBool, Ordering};

use super::token_fault::{Armed, TokenFault};

/// Where an injected loss shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossPoint {
    Submit = 1,
    Wait = 2,
}

static LOSS: TokenFault = TokenFault::new("SPILLWAY_FAULT_DEVICE_LOST", &["submit", "wait"]);

/// Arms the loss of the device of the `n`th next evaluated token (`n >= 1`); 0 disarms it.
pub fn lose_device_after(n: u64, point: LossPoint) {
    LOSS.arm(n, point as u8);
}

/// Counts one token evaluation; where its device is to be lost, if this is the one.
pub(super) fn token_loses_device() -> Option<LossPoint> {
    match LOSS.count()? {
        1 => Some(LossPoint::Submit),
        2 => Some(LossPoint::Wait),
        _ => None,
    }
}

/// A device's loss state: lost for good, or an injected loss waiting for its point.
#[derive(Debug, Default)]
pub(super) struct LossState {
    lost: AtomicBool,
    armed: Armed,
}

impl LossState {
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    pub fn arm(&self, point: LossPoint) {
        self.armed.arm(point as u8);
    }

    /// At `point`: whether the device is (now) lost, an armed loss for this point taking
    /// effect.
    pub fn lost_at(&self, point: LossPoint) -> bool {
        if self.armed.take(point as u8) {
            tracing::warn!("fault injection: the device is lost at {point:?}");
            self.lost.store(true, Ordering::SeqCst);
        }
        self.is_lost()
    }

    /// Records a real loss the driver reported.
    pub fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
    }
}
