//! Per-model counters for `Status`: requests waiting and running, tokens generated, and the
//! generation rate over the last few seconds.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How far back the recent rate looks.
const WINDOW: Duration = Duration::from_secs(5);

#[derive(Default)]
pub struct ModelStats {
    /// Accepted requests not yet finished: waiting ones and the running one.
    pub in_queue: AtomicUsize,
    pub generated: AtomicU64,
    /// Decode steps that took the tokens of several requests together.
    pub shared_steps: AtomicU64,
    /// Steps that carried part of a prompt (`Sequences::mixed_step_tokens`).
    pub prompt_steps: AtomicU64,
    /// Set while the worker reopens a lost GPU device and reloads the model: new requests are
    /// refused with UNAVAILABLE, and health reports NOT_SERVING.
    pub recovering: AtomicBool,
    /// Called when `recovering` changes (the daemon updates its health).
    on_recovery: std::sync::OnceLock<Box<dyn Fn() + Send + Sync>>,
    recent: Mutex<VecDeque<Instant>>,
}

impl std::fmt::Debug for ModelStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelStats")
            .field("in_queue", &self.in_queue)
            .field("generated", &self.generated)
            .field("recovering", &self.recovering)
            .finish_non_exhaustive()
    }
}

impl ModelStats {
    /// Sets what runs when the model starts or ends recovering from a lost device (once).
    pub fn on_recovery(&self, hook: Box<dyn Fn() + Send + Sync>) {
        let _ = self.on_recovery.set(hook);
    }

    /// Marks the model recovering (or not) and runs the hook.
    pub fn set_recovering(&self, on: bool) {
        self.recovering.store(on, Ordering::SeqCst);
        if let Some(hook) = self.on_recovery.get() {
            hook();
        }
    }

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
