//! Host memory a load may still take: the headroom under the daemon's memory cgroup limit (v2
//! `memory.max` minus `memory.current`, or v1 `memory.limit_in_bytes` minus
//! `memory.usage_in_bytes`), and the machine's `MemAvailable`, whichever is smaller. A load
//! whose own allocations (KV cache, buffers; the weights are mapped from the file, which the
//! kernel can drop and read again) exceed it is refused with a message instead of letting the
//! kernel's OOM killer end the daemon and every model in it.

use std::path::Path;

/// Room left for anonymous allocations, and what bounds it.
#[derive(Debug, Clone, PartialEq)]
pub struct Headroom {
    pub bytes: u64,
    /// `cgroup /path (limit L)` or `MemAvailable`.
    pub bound: String,
}

/// This process's headroom, from `/proc` and `/sys/fs/cgroup`; `None` when neither says.
pub fn headroom() -> Option<Headroom> {
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|text| cgroup_headroom(&text, Path::new("/sys/fs/cgroup")));
    let machine = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_available(&text))
        .map(|bytes| Headroom {
            bytes,
            bound: "the machine's available memory".into(),
        });
    match (cgroup, machine) {
        (Some(c), Some(m)) => Some(if c.bytes <= m.bytes { c } else { m }),
        (c, m) => c.or(m),
    }
}

/// The headroom under the memory cgroup that `proc_cgroup` (the text of `/proc/self/cgroup`)
/// names, with cgroup file systems mounted under `root`: v2 (`0::/path`) at `root/path`, v1
/// (`N:memory:/path` or `N:...,memory,...:/path`) at `root/memory/path`. `None` without a limit
/// or when the files are not there (a container may show a path it does not mount).
pub fn cgroup_headroom(proc_cgroup: &str, root: &Path) -> Option<Headroom> {
    for line in proc_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        let (dir, limit_file, usage_file) = if controllers.is_empty() {
            (root.join(rel), "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            (
                root.join("memory").join(rel),
                "memory.limit_in_bytes",
                "memory.usage_in_bytes",
            )
        } else {
            continue;
        };
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
        let Some(limit) = read(limit_file).and_then(|t| parse_limit(&t)) else {
            continue;
        };
        let usage = read(usage_file)
            .and_then(|t| t.trim().parse::<u64>().ok())
            .unwrap_or(0);
        return Some(Headroom {
            bytes: limit.saturating_sub(usage),
            bound: format!("the memory cgroup {path} (limit {})", mib(limit)),
        });
    }
    None
}

/// A limit file's value; `None` for no limit (`max`, or v1's page-rounded `i64::MAX`).
fn parse_limit(text: &str) -> Option<u64> {
    let v = text.trim().parse::<u64>().ok()?;
    (v < 1 << 62).then_some(v)
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// `N MiB`.
pub fn mib(bytes: u64) -> String {
    format!("{:.0} MiB", bytes as f64 / f64::from(1 << 20))
}

/// Hands what the heap keeps of freed memory back to the system (glibc's `malloc_trim`), once a
/// model is dropped. Each model's threads allocate from arenas of their own, which otherwise keep
/// the pages of what the model freed: the resident set would grow with every load and unload
/// (about 25 MiB a cycle of the embedded model on lavapipe, whose compiled pipelines live in
/// the heap). A no-op on other C libraries.
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` only walks the allocator's own free lists; any thread may call it.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, rel: &str, text: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    #[test]
    fn the_cgroup_limit_less_its_usage_is_the_headroom_in_v1_and_v2() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        write(root, "a/b/memory.max", "1073741824\n");
        write(root, "a/b/memory.current", "73741824\n");
        let v2 = cgroup_headroom("0::/a/b\n", root).unwrap();
        assert_eq!(v2.bytes, 1_000_000_000);
        assert!(
            v2.bound.contains("/a/b") && v2.bound.contains("1024 MiB"),
            "{v2:?}"
        );

        write(root, "memory/c/memory.limit_in_bytes", "209715200\n");
        write(root, "memory/c/memory.usage_in_bytes", "9715200\n");
        let v1 = "12:pids:/\n4:memory:/c\n1:cpu,cpuacct:/\n";
        assert_eq!(cgroup_headroom(v1, root).unwrap().bytes, 200_000_000);
        let joint = "4:cpu,memory:/c\n";
        assert_eq!(cgroup_headroom(joint, root).unwrap().bytes, 200_000_000);
    }

    #[test]
    fn no_limit_or_no_files_is_no_cgroup_headroom() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        write(root, "u/memory.max", "max\n");
        assert_eq!(cgroup_headroom("0::/u\n", root), None);
        write(
            root,
            "memory/v/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        assert_eq!(cgroup_headroom("4:memory:/v\n", root), None);
        assert_eq!(cgroup_headroom("4:memory:/not-mounted\n", root), None);
    }

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24683568 kB\nMemAvailable:   24116576 kB\n";
        assert_eq!(mem_available(text), Some(24_116_576 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }
}
