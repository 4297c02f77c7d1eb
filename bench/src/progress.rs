//! A progress line for long writes, on stderr.
//!
//! On a terminal it redraws one line; otherwise (a log file, CI) it prints a line every few
//! seconds, and only for large jobs, so that small runs stay quiet.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

use spillway_daemon::gguf::inspect::human_bytes;

/// Jobs at least this large report progress even when stderr is not a terminal.
const LARGE: u64 = 1 << 30;

pub struct Progress {
    label: String,
    start: Instant,
    last: Option<Instant>,
    terminal: bool,
    enabled: bool,
}

impl Progress {
    pub fn new(label: impl Into<String>, total: u64) -> Self {
        let terminal = std::io::stderr().is_terminal();
        Progress {
            label: label.into(),
            start: Instant::now(),
            last: None,
            terminal,
            enabled: terminal || total >= LARGE,
        }
    }

    pub fn update(&mut self, done: u64, total: u64) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        let every = if self.terminal {
            Duration::from_millis(200)
        } else {
            Duration::from_secs(10)
        };
        if done < total && self.last.is_some_and(|t| now - t < every) {
            return;
        }
        self.last = Some(now);
        let secs = (now - self.start).as_secs_f64().max(1e-3);
        let rate = done as f64 / secs;
        let eta = if rate > 0.0 {
            (total - done) as f64 / rate
        } else {
            0.0
        };
        let frac = if total == 0 {
            1.0
        } else {
            done as f64 / total as f64
        };
        let width = 30;
        let filled = (frac * width as f64) as usize;
        let line = format!(
            "{} [{}{}] {:5.1}% {} / {}  {}/s  ETA {:.0}s",
            self.label,
            "#".repeat(filled),
            " ".repeat(width - filled),
            frac * 100.0,
            human_bytes(done),
            human_bytes(total),
            human_bytes(rate as u64),
            eta
        );
        let mut err = std::io::stderr().lock();
        // Progress output is best-effort: a closed stderr must not fail the write.
        let _ = if self.terminal {
            write!(err, "\r{line}\x1b[K")
        } else {
            writeln!(err, "{line}")
        };
        let _ = err.flush();
    }

    /// Ends the redrawn line.
    pub fn finish(&mut self) {
        if self.enabled && self.terminal && self.last.is_some() {
            eprintln!();
        }
    }
}
