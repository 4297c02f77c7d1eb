//! The model served when none is configured: Spillway KJV MoE, a small Qwen3-MoE (8 experts, 2
//! active, 18 M parameters, Q8_0) trained on the King James Bible. It is embedded in the binary
//! and written once into the cache directory, so every installation serves the same file with no
//! download. `train/` holds the script, the settings and the loss curve that made it.

use std::path::{Path, PathBuf};

/// The embedded model file.
pub static MODEL_BYTES: &[u8] = include_bytes!("../../assets/kjv-moe-q8_0.gguf");
/// The file name under the cache directory; a retrained model gets a new name.
pub const FILE_NAME: &str = "default-kjv-moe-q8_0-1.gguf";
/// The name the default model is served under.
pub const MODEL_NAME: &str = "default";

/// `$XDG_CACHE_HOME/spillway`, or `~/.cache/spillway`; `None` without either variable.
pub fn cache_dir(xdg_cache_home: Option<PathBuf>, home: Option<PathBuf>) -> Option<PathBuf> {
    match (xdg_cache_home, home) {
        (Some(x), _) if x.is_absolute() => Some(x.join("spillway")),
        (_, Some(h)) if !h.as_os_str().is_empty() => Some(h.join(".cache").join("spillway")),
        _ => None,
    }
}

/// [`cache_dir`] from this process's `XDG_CACHE_HOME` and `HOME`.
pub fn env_cache_dir() -> Option<PathBuf> {
    cache_dir(
        std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from),
        std::env::var_os("HOME").map(PathBuf::from),
    )
}

#[derive(Debug, thiserror::Error)]
pub enum DefaultModelError {
    #[error("creating {}: {source}", dir.display())]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("writing the default model to {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("moving the default model into place: {0}")]
    Rename(std::io::Error),
}

/// The default model's path under `dir`, writing it first when it is not there yet (or has
/// another size than the embedded file). The file is written under a temporary name and linked
/// into place, so a crash never leaves half a model behind.
pub fn ensure(dir: &Path) -> Result<PathBuf, DefaultModelError> {
    let path = dir.join(FILE_NAME);
    if std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() == MODEL_BYTES.len() as u64) {
        return Ok(path);
    }
    std::fs::create_dir_all(dir).map_err(|source| DefaultModelError::Dir {
        dir: dir.to_path_buf(),
        source,
    })?;
    write_into(dir, path)
}

/// Writes the default model to `path` in `dir` under a temporary name, then puts it in place.
fn write_into(dir: &Path, path: PathBuf) -> Result<PathBuf, DefaultModelError> {
    let tmp = dir.join(format!("{FILE_NAME}.{}.tmp", std::process::id()));
    tracing::info!(path = %path.display(), "writing the default model (first start)");
    if let Err(source) = std::fs::write(&tmp, MODEL_BYTES) {
        let _ = std::fs::remove_file(&tmp);
        return Err(DefaultModelError::Write { path: tmp, source });
    }
    // Linked rather than renamed into place, so that a daemon starting beside another never
    // replaces the file the other has mapped (it would see its model file replaced and stop
    // serving it, `GgufFile::intact`); a file that is there but incomplete is replaced.
    let complete =
        |p: &Path| std::fs::metadata(p).is_ok_and(|m| m.len() == MODEL_BYTES.len() as u64);
    match std::fs::hard_link(&tmp, &path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && complete(&path) => {}
        Err(_) => {
            return std::fs::rename(&tmp, &path)
                .map(|()| path)
                .map_err(DefaultModelError::Rename)
        }
    }
    let _ = std::fs::remove_file(&tmp);
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_dir_follows_xdg_then_home() {
        let d = cache_dir(Some("/x".into()), Some("/home/u".into()));
        assert_eq!(d, Some(PathBuf::from("/x/spillway")));
        let d = cache_dir(Some("relative".into()), Some("/home/u".into()));
        assert_eq!(d, Some(PathBuf::from("/home/u/.cache/spillway")));
        assert_eq!(cache_dir(None, None), None);
    }

    #[test]
    fn the_default_model_is_written_once_and_byte_identical() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let pa = ensure(a.path()).unwrap();
        let pb = ensure(b.path()).unwrap();
        let bytes = std::fs::read(&pa).unwrap();
        assert_eq!(bytes, MODEL_BYTES);
        assert_eq!(bytes, std::fs::read(&pb).unwrap());
        let modified = std::fs::metadata(&pa).unwrap().modified().unwrap();
        assert_eq!(ensure(a.path()).unwrap(), pa);
        assert_eq!(
            std::fs::metadata(&pa).unwrap().modified().unwrap(),
            modified
        );
        crate::model::Model::open(&pa).expect("the default model loads");
    }

    #[test]
    fn a_second_writer_leaves_the_first_ones_file_in_place() {
        use std::os::unix::fs::MetadataExt;
        let a = tempfile::tempdir().unwrap();
        let path = ensure(a.path()).unwrap();
        let ino = std::fs::metadata(&path).unwrap().ino();
        // A daemon that found no file before this one linked its own (the race of two first
        // starts): the file another process has mapped stays.
        assert_eq!(write_into(a.path(), path.clone()).unwrap(), path);
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino);
        assert_eq!(std::fs::read(&path).unwrap(), MODEL_BYTES);
        // An incomplete file is replaced.
        std::fs::write(&path, b"GGUF").unwrap();
        write_into(a.path(), path.clone()).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), MODEL_BYTES);
        let left: Vec<_> = std::fs::read_dir(a.path()).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file is left");
    }
}
