//! Synthetic GGUF models: random weights with the exact tensor names, shapes, metadata keys,
//! weight types and tokenizer layout of llama.cpp-converted Llama 3, Mixtral, Qwen3, Qwen3-MoE
//! and Qwen2-MoE files, streamed to disk so that a 120 GB model never sits in memory.
//!
//! The same preset, type and seed give the same file byte for byte. With `sparse`, tensors of
//! two or more dimensions are left as holes (they read as zeros and take no disk space), so the
//! header and shapes of a model larger than the disk can still be checked; 1-D tensors (norms,
//! RoPE factors) are written, since zero RoPE factors would make RoPE divide by zero.

pub mod mix;
pub mod model;
pub mod presets;
pub mod rng;
pub mod vocab;
pub mod weights;

use std::path::Path;

use crate::gguf::writer::{GgufWriter, TensorSpec, WriteError};
use crate::gguf::Value;

pub use mix::WeightType;
pub use model::TensorPlan;
pub use presets::{Preset, PRESETS};

use rng::Xoshiro256;

/// Bytes generated per write: large enough to amortise calls, small enough for any machine.
const CHUNK_BYTES: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown preset {0:?}; `spillway-bench presets` lists them")]
    UnknownPreset(String),
    #[error(transparent)]
    WeightType(#[from] mix::UnknownWeightType),
    #[error(transparent)]
    Vocab(#[from] vocab::VocabError),
    #[error(transparent)]
    Unsupported(#[from] weights::UnsupportedType),
    #[error(transparent)]
    Write(#[from] WriteError),
}

/// A model ready to be written: metadata and tensor plans.
#[derive(Debug, Clone)]
pub struct SynthModel {
    pub preset: &'static Preset,
    pub weights: WeightType,
    pub seed: u64,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorPlan>,
    /// Type fallbacks (rows too short for the requested block size).
    pub notes: Vec<String>,
}

impl SynthModel {
    /// Builds metadata (vocabulary included) and the tensor table of a preset.
    pub fn new(
        preset: &'static Preset,
        weights: WeightType,
        seed: u64,
    ) -> Result<Self, SynthError> {
        let (tensors, notes) = model::tensors(preset, weights);
        let mut metadata = model::arch_metadata(preset, weights, seed);
        let vocab = vocab::build(preset, seed)?;
        metadata.extend(vocab.metadata());
        if weights.is_quantized() {
            // llama-quantize stamps the block-format generation last.
            metadata.push(("general.quantization_version".into(), Value::U32(2)));
        }
        Ok(SynthModel {
            preset,
            weights,
            seed,
            metadata,
            tensors,
            notes,
        })
    }

    /// Looks a preset up by name and builds it.
    pub fn from_name(name: &str, weights: WeightType, seed: u64) -> Result<Self, SynthError> {
        let preset =
            presets::find(name).ok_or_else(|| SynthError::UnknownPreset(name.to_string()))?;
        Self::new(preset, weights, seed)
    }

    pub fn specs(&self) -> Vec<TensorSpec> {
        self.tensors.iter().map(|t| t.spec.clone()).collect()
    }

    /// Parameters and bytes of tensor data (without padding).
    pub fn totals(&self) -> (u64, u64) {
        model::totals(&self.tensors)
    }

    /// Whether `sparse` mode writes this tensor (1-D) or leaves it as a hole.
    fn written_when_sparse(t: &TensorPlan) -> bool {
        t.spec.dims.len() < 2
    }

    /// Tensor bytes a write generates (fewer with `sparse`).
    pub fn bytes_to_write(&self, sparse: bool) -> u64 {
        self.tensors
            .iter()
            .filter(|t| !sparse || Self::written_when_sparse(t))
            .map(|t| t.spec.n_bytes().unwrap_or(0))
            .sum()
    }

    /// Writes the file. `progress(done, total)` is called after every chunk with the tensor bytes
    /// written so far and the total to be written. Returns the file size.
    pub fn write(
        &self,
        path: impl AsRef<Path>,
        sparse: bool,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<u64, SynthError> {
        let mut w = GgufWriter::create(path, &self.metadata, &self.specs())?;
        let file_size = w.layout().file_size();
        let total = self.bytes_to_write(sparse);
        let mut done = 0u64;
        let mut buf = vec![0u8; CHUNK_BYTES];
        for t in &self.tensors {
            let spec = &t.spec;
            if sparse && !Self::written_when_sparse(t) {
                w.skip_tensor(&spec.name)?;
                continue;
            }
            w.begin_tensor(&spec.name)?;
            let mut rng = Xoshiro256::for_stream(self.seed, &spec.name);
            let ty = spec.ggml_type;
            let (block_elems, block_bytes) = (ty.block_size(), ty.block_bytes());
            let per_chunk = (CHUNK_BYTES as u64 / block_bytes).max(1);
            let mut blocks_left = spec.n_elements().unwrap_or(0) / block_elems;
            let mut element = 0u64;
            while blocks_left > 0 {
                let n = blocks_left.min(per_chunk);
                let bytes = &mut buf[..(n * block_bytes) as usize];
                weights::fill(ty, &t.init, element, &mut rng, bytes)?;
                w.write_chunk(bytes)?;
                blocks_left -= n;
                element += n * block_elems;
                done += bytes.len() as u64;
                progress(done, total);
            }
        }
        w.finish()?;
        Ok(file_size)
    }
}
