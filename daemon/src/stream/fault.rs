//! Fault-injection points of the tile reader: reads that fail, stop short or come late.
//!
//! `SPILLWAY_FAULT_STORAGE` (read by [`StorageFaults::from_env`], which every reader's default
//! options call) takes a comma-separated list of:
//! - `eio:N`: the `N`th chunk read of each reader (1 is the first) fails with EIO, once;
//! - `short:N`: the `N`th chunk read returns no bytes, as a read at the end of a truncated
//!   file does, once;
//! - `slow:MS`: every chunk read completes `MS` milliseconds late.
//!
//! Both backends pass each chunk's result through [`Injector::apply`] before the scheduler
//! sees it, so an injected fault takes the same path as a real one.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Once;
use std::time::Duration;

/// The faults a reader injects; the default injects none.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StorageFaults {
    /// The chunk read (counted from 1) that fails with EIO.
    pub eio_at: Option<u64>,
    /// The chunk read (counted from 1) that returns no bytes.
    pub short_at: Option<u64>,
    /// Added to every chunk read.
    pub delay: Option<Duration>,
}

/// The environment variable [`StorageFaults::from_env`] reads.
pub const ENV: &str = "SPILLWAY_FAULT_STORAGE";

impl StorageFaults {
    /// Parses `eio:N`, `short:N` and `slow:MS`, comma-separated.
    pub fn parse(spec: &str) -> Result<StorageFaults, String> {
        let mut f = StorageFaults::default();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (what, n) = part
                .split_once(':')
                .ok_or_else(|| format!("{part:?} is not eio:N, short:N or slow:MS"))?;
            let n: u64 = n
                .parse()
                .map_err(|_| format!("{part:?}: {n:?} is not a whole number"))?;
            match what {
                "eio" | "short" if n == 0 => {
                    return Err(format!("{part:?}: reads are counted from 1"))
                }
                "eio" => f.eio_at = Some(n),
                "short" => f.short_at = Some(n),
                "slow" => f.delay = Some(Duration::from_millis(n)),
                _ => return Err(format!("{part:?} is not eio:N, short:N or slow:MS")),
            }
        }
        Ok(f)
    }

    /// The faults `SPILLWAY_FAULT_STORAGE` asks for; none when it is unset. A value that does
    /// not parse injects nothing; either is logged once per process.
    pub fn from_env() -> StorageFaults {
        static LOGGED: Once = Once::new();
        let Ok(spec) = std::env::var(ENV) else {
            return StorageFaults::default();
        };
        match StorageFaults::parse(&spec) {
            Ok(f) => {
                LOGGED.call_once(|| tracing::warn!("fault injection: {ENV}={spec}: {f:?}"));
                f
            }
            Err(e) => {
                LOGGED.call_once(|| tracing::warn!("{ENV}={spec}: {e}; nothing injected"));
                StorageFaults::default()
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        *self == StorageFaults::default()
    }
}

/// One reader's faults and its count of chunk reads.
pub(crate) struct Injector {
    faults: StorageFaults,
    reads: AtomicU64,
}

impl Injector {
    pub(crate) fn new(faults: StorageFaults) -> Injector {
        Injector {
            faults,
            reads: AtomicU64::new(0),
        }
    }

    /// A chunk read's result as the faults make it (counting the read); may sleep, so it is
    /// called with no lock held.
    pub(crate) fn apply(&self, result: io::Result<usize>) -> io::Result<usize> {
        if self.faults.is_empty() {
            return result;
        }
        if let Some(d) = self.faults.delay {
            std::thread::sleep(d);
        }
        let n = self.reads.fetch_add(1, Ordering::Relaxed) + 1;
        if self.faults.eio_at == Some(n) {
            tracing::warn!("fault injection: chunk read {n} fails with EIO");
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        if self.faults.short_at == Some(n) {
            tracing::warn!("fault injection: chunk read {n} returns no bytes");
            return Ok(0);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_bad_ones_say_why() {
        let f = StorageFaults::parse("eio:3, slow:20,short:7").unwrap();
        assert_eq!(f.eio_at, Some(3));
        assert_eq!(f.short_at, Some(7));
        assert_eq!(f.delay, Some(Duration::from_millis(20)));
        assert!(StorageFaults::parse("").unwrap().is_empty());
        for bad in ["eio", "eio:x", "eio:0", "hang:3", "slow:-1"] {
            assert!(StorageFaults::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn each_fault_fires_at_its_read_once() {
        let i = Injector::new(StorageFaults::parse("eio:2,short:3").unwrap());
        let results: Vec<_> = (0..5).map(|_| i.apply(Ok(4096))).collect();
        assert_eq!(results[0].as_ref().unwrap(), &4096);
        assert_eq!(
            results[1].as_ref().unwrap_err().raw_os_error(),
            Some(libc::EIO)
        );
        assert_eq!(results[2].as_ref().unwrap(), &0);
        assert!(results[3..].iter().all(|r| r.as_ref().unwrap() == &4096));
    }
}
