//! Cold reads: decode reads each weight matrix once per token with the rest of the model in
//! between, so no matrix is in a cache when its turn comes. A calibration case that timed the
//! same buffer over and over would measure the cache instead (this machine's last-level cache
//! is 480 MiB, larger than most cases), so each case rotates through copies of its data whose
//! total passes the cache: every timed run reads a copy the previous runs have not touched.

use std::path::Path;

/// The floor on what a rotation covers: larger than the last-level caches of today's GPUs
/// (50–96 MiB of L2 on NVIDIA's, 256 MiB of Infinity Cache on AMD's largest).
pub const MIN_COLD_BYTES: u64 = 512 << 20;

/// The ceiling, so calibration stays within the memory of small machines.
pub const MAX_COLD_BYTES: u64 = 2 << 30;

/// `SPILLWAY_CALIBRATE_COLD_BYTES`, when set: the bytes every rotation covers instead, for
/// measuring what the rotation itself changes.
pub fn override_bytes() -> Option<u64> {
    std::env::var("SPILLWAY_CALIBRATE_COLD_BYTES")
        .ok()?
        .parse()
        .ok()
}

/// Bytes a rotation covers on this host: twice its largest CPU cache, within
/// [`MIN_COLD_BYTES`]..=[`MAX_COLD_BYTES`].
pub fn host_cold_bytes() -> u64 {
    if let Some(b) = override_bytes() {
        return b;
    }
    (2 * largest_cpu_cache(Path::new("/sys/devices/system/cpu/cpu0/cache")))
        .clamp(MIN_COLD_BYTES, MAX_COLD_BYTES)
}

/// The largest cache `dir` (a sysfs `cpuN/cache` folder) lists, 0 when it lists none.
fn largest_cpu_cache(dir: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("size")).ok())
        .filter_map(|s| parse_cache_size(s.trim()))
        .max()
        .unwrap_or(0)
}

/// Sysfs writes cache sizes as `48K`, `2048K` or `480M`.
fn parse_cache_size(s: &str) -> Option<u64> {
    let (digits, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => s.split_at(i),
        None => (s, ""),
    };
    let n: u64 = digits.parse().ok()?;
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(scale)
}

/// Copies of a `bytes`-byte case a rotation over `cold` bytes needs: at least 2, so that
/// consecutive runs never read the same copy.
pub fn copies(bytes: u64, cold: u64) -> usize {
    cold.div_ceil(bytes.max(1)).max(2) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sysfs_cache_sizes_parse() {
        assert_eq!(parse_cache_size("48K"), Some(48 << 10));
        assert_eq!(parse_cache_size("480M"), Some(480 << 20));
        assert_eq!(parse_cache_size("1G"), Some(1 << 30));
        assert_eq!(parse_cache_size("4096"), Some(4096));
        assert_eq!(parse_cache_size("12Q"), None);
        assert_eq!(parse_cache_size(""), None);
    }

    #[test]
    fn the_largest_listed_cache_wins() {
        let dir = tempfile::tempdir().unwrap();
        for (i, size) in ["48K", "2048K", "105M"].iter().enumerate() {
            let d = dir.path().join(format!("index{i}"));
            std::fs::create_dir(&d).unwrap();
            std::fs::write(d.join("size"), format!("{size}\n")).unwrap();
        }
        assert_eq!(largest_cpu_cache(dir.path()), 105 << 20);
        assert_eq!(largest_cpu_cache(&dir.path().join("missing")), 0);
        assert!((MIN_COLD_BYTES..=MAX_COLD_BYTES).contains(&host_cold_bytes()));
    }

    #[test]
    fn a_rotation_has_at_least_two_copies() {
        assert_eq!(copies(64 << 20, 512 << 20), 8);
        assert_eq!(copies(1 << 30, 512 << 20), 2);
        assert_eq!(copies(3, 10), 4);
    }
}
