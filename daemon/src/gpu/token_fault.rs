//! Faults injected at a chosen token: an environment variable `POINT:N` (read once per process)
//! arms a fault on the device of the `N`th token a GPU model evaluates in this process (1 is
//! the first), to take effect once at the device's next `POINT`. Device loss
//! (`SPILLWAY_FAULT_DEVICE_LOST`, [`super::lost`]) and the driver refusing the objects a
//! recording makes (`SPILLWAY_FAULT_DRIVER_OOM`, [`super::driver_fault`]) are both armed so.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Once;

/// A process-wide countdown of evaluated tokens to one armed fault.
pub(super) struct TokenFault {
    /// The environment variable that arms it.
    var: &'static str,
    /// The points a fault may take effect at, by name; a point's code is its index + 1.
    points: &'static [&'static str],
    /// Tokens still to go; 0: none armed.
    countdown: AtomicU64,
    point: AtomicU8,
    from_env: Once,
}

impl TokenFault {
    pub const fn new(var: &'static str, points: &'static [&'static str]) -> TokenFault {
        TokenFault {
            var,
            points,
            countdown: AtomicU64::new(0),
            point: AtomicU8::new(0),
            from_env: Once::new(),
        }
    }

    /// Arms the fault at `point` (a code, 1 and up) on the `n`th next token; 0 disarms it.
    /// The environment is not read after this.
    pub fn arm(&self, n: u64, point: u8) {
        self.from_env.call_once(|| {});
        self.point.store(point, Ordering::SeqCst);
        self.countdown.store(n, Ordering::SeqCst);
    }

    /// Counts one evaluated token; the point code of the fault when it is the chosen one.
    pub fn count(&self) -> Option<u8> {
        self.from_env.call_once(|| self.read_env());
        let fires = self
            .countdown
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |c| c.checked_sub(1))
            .is_ok_and(|before| before == 1);
        fires.then(|| self.point.load(Ordering::SeqCst))
    }

    fn read_env(&self) {
        let Ok(v) = std::env::var(self.var) else {
            return;
        };
        let parsed = v.split_once(':').and_then(|(point, n)| {
            let code = self.points.iter().position(|&p| p == point)? + 1;
            Some((code as u8, n.parse::<u64>().ok()?))
        });
        match parsed {
            Some((code, n)) => {
                tracing::warn!(
                    "fault injection ({}): token {n} arms {}",
                    self.var,
                    self.points[code as usize - 1]
                );
                self.point.store(code, Ordering::SeqCst);
                self.countdown.store(n, Ordering::SeqCst);
            }
            None => tracing::warn!(
                "{}={v} is not POINT:N with POINT one of {:?}; nothing injected",
                self.var,
                self.points
            ),
        }
    }
}

/// A fault armed on one device: takes effect once, at its point.
#[derive(Debug, Default)]
pub(super) struct Armed(AtomicU8);

impl Armed {
    pub fn arm(&self, point: u8) {
        self.0.store(point, Ordering::SeqCst);
    }

    /// Whether a fault armed for `point` takes effect now (disarming it).
    pub fn take(&self, point: u8) -> bool {
        point != 0
            && self
                .0
                .compare_exchange(point, 0, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_armed_token_fires_once_with_its_point() {
        static F: TokenFault = TokenFault::new("SPILLWAY_TEST_NO_SUCH_FAULT", &["a", "b"]);
        F.arm(3, 2);
        assert_eq!(
            [F.count(), F.count(), F.count(), F.count()],
            [None, None, Some(2), None]
        );
        F.arm(0, 1);
        assert_eq!(F.count(), None);
    }

    #[test]
    fn an_armed_point_is_taken_once_and_only_there() {
        let a = Armed::default();
        assert!(!a.take(1));
        a.arm(2);
        assert!(!a.take(1));
        assert!(a.take(2));
        assert!(!a.take(2));
    }
}
