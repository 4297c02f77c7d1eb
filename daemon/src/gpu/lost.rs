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

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Once;

/// Where an injected loss shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossPoint {
    Submit = 1,
    Wait = 2,
}

impl LossPoint {
    fn from_u8(v: u8) -> Option<LossPoint> {
        match v {
            1 => Some(LossPoint::Submit),
            2 => Some(LossPoint::Wait),
            _ => None,
        }
    }
}

/// Token evaluations still to go before the injected loss; 0: none armed.
static COUNTDOWN: AtomicU64 = AtomicU64::new(0);
static POINT: AtomicU8 = AtomicU8::new(0);
static FROM_ENV: Once = Once::new();

/// Arms the loss of the device of the `n`th next evaluated token (`n >= 1`); 0 disarms it.
pub fn lose_device_after(n: u64, point: LossPoint) {
    FROM_ENV.call_once(|| {});
    POINT.store(point as u8, Ordering::SeqCst);
    COUNTDOWN.store(n, Ordering::SeqCst);
}

/// Counts one token evaluation; where its device is to be lost, if this is the one.
pub(super) fn token_loses_device() -> Option<LossPoint> {
    FROM_ENV.call_once(|| {
        let Ok(v) = std::env::var("SPILLWAY_FAULT_DEVICE_LOST") else {
            return;
        };
        let parsed = v.split_once(':').and_then(|(point, n)| {
            let point = match point {
                "submit" => LossPoint::Submit,
                "wait" => LossPoint::Wait,
                _ => return None,
            };
            Some((point, n.parse::<u64>().ok()?))
        });
        match parsed {
            Some((point, n)) => {
                tracing::warn!(
                    "fault injection: the device of token {n} will be lost at {point:?}"
                );
                POINT.store(point as u8, Ordering::SeqCst);
                COUNTDOWN.store(n, Ordering::SeqCst);
            }
            None => tracing::warn!(
                "SPILLWAY_FAULT_DEVICE_LOST={v} is not submit:N or wait:N; nothing injected"
            ),
        }
    });
    let fires = COUNTDOWN
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| c.checked_sub(1))
        .is_ok_and(|before| before == 1);
    fires
        .then(|| LossPoint::from_u8(POINT.load(Ordering::SeqCst)))
        .flatten()
}

/// A device's loss state: lost for good, or an injected loss waiting for its point.
#[derive(Debug, Default)]
pub(super) struct LossState {
    lost: std::sync::atomic::AtomicBool,
    armed: AtomicU8,
}

impl LossState {
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    pub fn arm(&self, point: LossPoint) {
        self.armed.store(point as u8, Ordering::SeqCst);
    }

    /// At `point`: whether the device is (now) lost, an armed loss for this point taking
    /// effect.
    pub fn lost_at(&self, point: LossPoint) -> bool {
        if self
            .armed
            .compare_exchange(point as u8, 0, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
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
