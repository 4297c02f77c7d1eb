//! The model served when none is configured: a tiny synthetic Qwen3-MoE (random weights, a real
//! BPE vocabulary, Q8_0), written once into the cache directory. The same preset, type and seed
//! always give the same file, so every installation has the same default model.

use std::path::{Path, PathBuf};

use crate::synth::{SynthError, SynthModel, WeightType};

pub const PRESET: &str = "tiny-qwen3moe";
pub const SEED: u64 = 0;
/// The file name under the cache directory; it names the preset, type and seed.
pub const FILE_NAME: &str = "default-tiny-qwen3moe-q8_0-seed0.gguf";
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

#[derive(Debug, thiserror::Error)]
pub enum DefaultModelError {
    #[error("creating {}: {source}", dir.display())]
    Dir {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("writing the default model: {0}")]
    Synth(#[from] SynthError),
    #[error("moving the default model into place: {0}")]
    Rename(std::io::Error),
}

/// The default model's path under `dir`, writing it first when it is not there yet. The file is
/// written under a temporary name and renamed, so a crash never leaves half a model behind.
pub fn ensure(dir: &Path) -> Result<PathBuf, DefaultModelError> {
    let path = dir.join(FILE_NAME);
    if path.is_file() {
        return Ok(path);
    }
    std::fs::create_dir_all(dir).map_err(|source| DefaultModelError::Dir {
        dir: dir.to_path_buf(),
        source,
    })?;
    let tmp = dir.join(format!("{FILE_NAME}.{}.tmp", std::process::id()));
    let model = SynthModel::from_name(
        PRESET,
        WeightType::Uniform(crate::gguf::GgmlType::Q8_0),
        SEED,
    )?;
    tracing::info!(path = %path.display(), "writing the default model (first start)");
    let written = model.write(&tmp, false, |_, _| {});
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e.into());
    }
    std::fs::rename(&tmp, &path).map_err(DefaultModelError::Rename)?;
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
        assert_eq!(bytes, std::fs::read(&pb).unwrap());
        let modified = std::fs::metadata(&pa).unwrap().modified().unwrap();
        assert_eq!(ensure(a.path()).unwrap(), pa);
        assert_eq!(
            std::fs::metadata(&pa).unwrap().modified().unwrap(),
            modified
        );
        crate::model::Model::open(&pa).expect("the default model loads");
    }
}
