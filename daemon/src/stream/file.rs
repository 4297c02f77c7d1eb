//! The model file as the streamer sees it: one descriptor (O_DIRECT when the filesystem takes
//! it) and the identity seen at open, so a file truncated, rewritten or replaced underneath a
//! running model is noticed instead of feeding the GPU mixed weights.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::buffer::{AlignedRegion, HostRegion, ALIGN};
use super::error::StreamError;
use crate::gguf::identity::FileIdentity;

pub(crate) struct ModelFile {
    path: PathBuf,
    file: File,
    direct: bool,
    /// Why O_DIRECT is not used, when it is not.
    direct_refused: Option<String>,
    seen: FileIdentity,
    /// Bytes of the tiles delivered from this file (the requested lengths, not the aligned
    /// spans an O_DIRECT read covers), and how many tiles.
    delivered: AtomicU64,
    tiles: AtomicU64,
}

impl ModelFile {
    /// Opens `path` for reading, with O_DIRECT unless the filesystem refuses it (at open, or
    /// at a first aligned read, which is where some filesystems say no).
    pub(crate) fn open(path: &Path) -> Result<ModelFile, StreamError> {
        let open_err = |source| StreamError::Open {
            path: path.to_path_buf(),
            source,
        };
        let (file, direct_refused) = match open_direct(path) {
            Ok(file) => (file, None),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                let file = File::open(path).map_err(open_err)?;
                (
                    file,
                    Some(format!("O_DIRECT refused by the filesystem: {e}")),
                )
            }
            Err(e) => return Err(open_err(e)),
        };
        let seen = FileIdentity::of(&file.metadata().map_err(open_err)?);
        Ok(ModelFile {
            path: path.to_path_buf(),
            file,
            direct: direct_refused.is_none(),
            direct_refused,
            seen,
            delivered: AtomicU64::new(0),
            tiles: AtomicU64::new(0),
        })
    }

    /// Counts a tile delivered from the file.
    pub(crate) fn count_tile(&self, len: usize) {
        self.delivered.fetch_add(len as u64, Ordering::Relaxed);
        self.tiles.fetch_add(1, Ordering::Relaxed);
    }

    /// Bytes and tiles delivered so far.
    pub(crate) fn delivered(&self) -> (u64, u64) {
        (
            self.delivered.load(Ordering::Relaxed),
            self.tiles.load(Ordering::Relaxed),
        )
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    pub(crate) fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Whether reads bypass the page cache (offsets, lengths and memory must then be aligned).
    pub(crate) fn is_direct(&self) -> bool {
        self.direct
    }

    pub(crate) fn direct_refused(&self) -> Option<&str> {
        self.direct_refused.as_deref()
    }

    /// The size seen at open.
    pub(crate) fn len(&self) -> u64 {
        self.seen.size()
    }

    /// What changed since open, if anything: two `stat` calls, cheap next to a tile read.
    pub(crate) fn changed(&self) -> Option<String> {
        self.seen.changed(&self.file, &self.path)
    }
}

fn open_direct(path: &Path) -> io::Result<File> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    // Some filesystems accept the flag at open and refuse the reads.
    let probe = AlignedRegion::new(ALIGN);
    // SAFETY: the region is ours alone and valid for ALIGN bytes.
    let buf = unsafe { std::slice::from_raw_parts_mut(probe.as_ptr(), ALIGN) };
    file.read_at(buf, 0)?;
    Ok(file)
}
