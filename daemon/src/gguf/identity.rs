//! What identifies a file's contents while it is open: a replaced file has another inode, a
//! rewritten one another mtime, a truncated one another size. The memory-mapped reader and the
//! tile streamer both check it, so that a model file changed underneath a running model is
//! reported instead of feeding the engine mixed weights.

use std::fs::{File, Metadata};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FileIdentity {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
}

impl FileIdentity {
    pub(crate) fn of(m: &Metadata) -> FileIdentity {
        FileIdentity {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
        }
    }

    /// The size seen.
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    /// What changed since this identity was seen of `file`, open from `path`, if anything:
    /// two `stat` calls.
    pub(crate) fn changed(&self, file: &File, path: &Path) -> Option<String> {
        let now = match file.metadata() {
            Ok(m) => FileIdentity::of(&m),
            Err(e) => return Some(format!("fstat failed: {e}")),
        };
        if now.size != self.size {
            return Some(format!("size {} -> {}", self.size, now.size));
        }
        if now.mtime != self.mtime {
            return Some("modified".to_string());
        }
        match std::fs::metadata(path) {
            Ok(m) if (m.dev(), m.ino()) != (self.dev, self.ino) => {
                Some("replaced by another file".to_string())
            }
            Ok(_) => None,
            Err(e) => Some(format!("the path no longer opens: {e}")),
        }
    }
}
