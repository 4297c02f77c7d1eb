//! Per-model counters for `Status`: requests waiting and running, tokens generated, and the
//! generation rate over the last few seconds.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How far back the recent rate looks.
const WINDOW: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
pub struct ModelStats {
    /// Accepted requests not yet finished: waiting ones and the running one.
    pub in_queue: AtomicUsize,
    pub generated: AtomicU64,
    recent: Mutex<VecDeque<Instant>>,
}

impl ModelStats {
    /// Records one generated token.
    pub fn token(&self, at: Instant) {
        self.generated.fetch_add(1, Ordering::Relaxed);
        let mut recent = self.recent.lock();
        recent.push_back(at);
        while recent
            .front()
            .is_some_and(|&t| at.duration_since(t) > WINDOW)
        {
            recent.pop_front();
        }
    }

    /// Tokens per second over the last [`WINDOW`] before `now`.
    pub fn recent_tokens_per_second(&self, now: Instant) -> f64 {
        let recent = self.recent.lock();
        let n = recent
            .iter()
            .filter(|&&t| now.saturating_duration_since(t) <= WINDOW)
            .count();
        n as f64 / WINDOW.as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_counts_only_the_recent_window() {
        let s = ModelStats::default();
        let t0 = Instant::now();
        for i in 0..10 {
            s.token(t0 + Duration::from_millis(i * 100));
        }
        let now = t0 + Duration::from_secs(1);
        assert_eq!(s.recent_tokens_per_second(now), 10.0 / WINDOW.as_secs_f64());
        assert_eq!(s.recent_tokens_per_second(now + WINDOW * 2), 0.0);
        assert_eq!(s.generated.load(Ordering::Relaxed), 10);
    }
}
