//! The weights of a model as typed views into the memory-mapped GGUF file: matrices are never
//! copied or dequantized whole; only the small 1-D tensors (norms, biases, RoPE factors) are
//! expanded to `f32` at load.

use std::path::Path;
use std::sync::Arc;

use crate::gguf::{GgmlType, GgufFile, TensorInfo};
use crate::quant::dequantize_row;

use super::config::{Arch, Config};
use super::{ModelError, SUPPORTED_TYPES};

/// A weight matrix (or a stack of expert matrices) in the file: `n_mat` matrices of `n_out`
/// rows of `n_in` contiguous elements (ggml dims `[n_in, n_out, n_mat]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Matrix {
    /// Index into the file's tensor list.
    tensor: usize,
    pub ty: GgmlType,
    pub n_in: usize,
    pub n_out: usize,
    pub n_mat: usize,
}

impl Matrix {
    /// Bytes of one matrix of the stack (one expert's) in the file's encoding.
    pub fn bytes(&self) -> u64 {
        (row_bytes(self.ty, self.n_in) * self.n_out) as u64
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> u64 {
        row_bytes(self.ty, self.n_in) as u64
    }
}

/// A borrowed matrix: `n_out` rows of `row_bytes` bytes each.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a> {
    pub ty: GgmlType,
    pub n_in: usize,
    pub n_out: usize,
    pub data: &'a [u8],
}

impl<'a> MatRef<'a> {
    pub fn row_bytes(&self) -> usize {
        row_bytes(self.ty, self.n_in)
    }

    /// Row `i` in the file's encoding.
    pub fn row(&self, i: usize) -> &'a [u8] {
        let rb = self.row_bytes();
        &self.data[i * rb..(i + 1) * rb]
    }

    /// Rows `range` as a matrix of their own.
    ///
    /// # Panics
    /// If `range` ends past the last row.
    pub fn rows(&self, range: std::ops::Range<usize>) -> MatRef<'a> {
        let rb = self.row_bytes();
        MatRef {
            n_out: range.len(),
            data: &self.data[range.start * rb..range.end * rb],
            ..*self
        }
    }
}

fn row_bytes(ty: GgmlType, n: usize) -> usize {
    // Checked at load: every matrix row is whole blocks.
    (n / ty.block_size() as usize) * ty.block_bytes() as usize
}

/// The attention weights of one layer.
#[derive(Debug, Clone)]
pub struct Attention {
    pub norm: Vec<f32>,
    pub wq: Matrix,
    pub wk: Matrix,
    pub wv: Matrix,
    pub wo: Matrix,
    /// Qwen2's projection biases.
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// Qwen3's per-head RMSNorm weights of Q and K (`head_dim` each).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
}

/// Qwen2-MoE's always-on expert, scaled by a sigmoid gate.
#[derive(Debug, Clone)]
pub struct SharedExpert {
    /// `[n_embd, 1]`: the gate's logit.
    pub gate_inp: Matrix,
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
}

/// Routed experts: stacks of `n_expert` matrices.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// `[n_embd, n_expert]`.
    pub router: Matrix,
    pub gate: Matrix,
    pub up: Matrix,
    pub down: Matrix,
    pub shared: Option<SharedExpert>,
}

#[derive(Debug, Clone)]
pub enum Ffn {
    Dense {
        gate: Matrix,
        up: Matrix,
        down: Matrix,
    },
    Moe(MoeWeights),
}

#[derive(Debug, Clone)]
pub struct Layer {
    pub attn: Attention,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
}

/// A loaded model: the mapped file, its configuration and views of every weight.
#[derive(Debug)]
pub struct Model {
    /// Shared with the models [`Model::layers_from`] makes.
    file: Arc<GgufFile>,
    pub config: Config,
    pub token_embd: Matrix,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// `output.weight`, or `token_embd.weight` when the output is tied to the embedding.
    pub output: Matrix,
    /// Per-frequency divisors of RoPE (`rope_freqs.weight`, Llama 3.1's scaling).
    pub rope_freqs: Option<Vec<f32>>,
}

impl Model {
    pub fn open(path: impl AsRef<Path>) -> Result<Model, ModelError> {
        Model::from_file(GgufFile::open(path)?)
    }

    pub fn from_file(file: GgufFile) -> Result<Model, ModelError> {
        let embd_info = file
            .tensor("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        let n_vocab = embd_info.dim(1) as usize;
        let config = Config::from_metadata(file.metadata(), n_vocab)?;
        let l = Loader {
            file: &file,
            c: &config,
        };
        let (e, v) = (config.n_embd as u64, n_vocab as u64);
        let token_embd = l.matrix("token_embd.weight", &[e, v])?;
        let output = match file.tensor("output.weight") {
            Some(_) => l.matrix("output.weight", &[e, v])?,
            None => token_embd,
        };
        let output_norm = l.vector("output_norm.weight", e)?;
        let rope_freqs = l.opt_vector("rope_freqs.weight", config.n_rot as u64 / 2)?;
        let layers = (0..config.n_layer)
            .map(|i| l.layer(i))
            .collect::<Result<_, _>>()?;
        Ok(Model {
            file: Arc::new(file),
            config,
            token_embd,
            layers,
            output_norm,
            output,
            rope_freqs,
        })
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// The model from layer `first` on: its layers `first..`, the same embedding, output and
    /// file (mapped once). Runs the rest of a forward pass whose first layers ran elsewhere
    /// (the GPU's share of a dense model split between the CPU and the GPU).
    ///
    /// # Panics
    /// If `first` is past the last layer.
    pub fn layers_from(&self, first: usize) -> Model {
        assert!(
            first < self.layers.len(),
            "layer {first} of {}",
            self.layers.len()
        );
        let mut config = self.config.clone();
        config.n_layer -= first;
        Model {
            file: self.file.clone(),
            config,
            token_embd: self.token_embd,
            layers: self.layers[first..].to_vec(),
            output_norm: self.output_norm.clone(),
            output: self.output,
            rope_freqs: self.rope_freqs.clone(),
        }
    }

    /// Matrix `m` (expert 0 of a stack) as rows of bytes.
    pub fn mat(&self, m: &Matrix) -> MatRef<'_> {
        self.expert(m, 0)
    }

    /// Expert `e` of a stack of matrices.
    ///
    /// # Panics
    /// If `e >= m.n_mat`.
    pub fn expert(&self, m: &Matrix, e: usize) -> MatRef<'_> {
        assert!(e < m.n_mat, "expert {e} of {}", m.n_mat);
        let info = &self.file.tensors()[m.tensor];
        let size = row_bytes(m.ty, m.n_in) * m.n_out;
        MatRef {
            ty: m.ty,
            n_in: m.n_in,
            n_out: m.n_out,
            data: &self.file.tensor_data(info)[e * size..(e + 1) * size],
        }
    }

    /// Where expert `e` of a stack lies in the file: its absolute offset and length.
    ///
    /// # Panics
    /// If `e >= m.n_mat`.
    pub fn expert_extent(&self, m: &Matrix, e: usize) -> (u64, usize) {
        assert!(e < m.n_mat, "expert {e} of {}", m.n_mat);
        let info = &self.file.tensors()[m.tensor];
        let size = row_bytes(m.ty, m.n_in) * m.n_out;
        let offset = self.file.data_offset() + info.offset + (e * size) as u64;
        (offset, size)
    }

    /// Every matrix of a stack as one matrix of `n_mat × n_out` rows (expert `e`'s rows are
    /// `e * n_out..(e + 1) * n_out`), as the file stores them.
    pub fn stacked(&self, m: &Matrix) -> MatRef<'_> {
        let info = &self.file.tensors()[m.tensor];
        let size = row_bytes(m.ty, m.n_in) * m.n_out * m.n_mat;
        MatRef {
            ty: m.ty,
            n_in: m.n_in,
            n_out: m.n_out * m.n_mat,
            data: &self.file.tensor_data(info)[..size],
        }
    }

    /// Row `token` of the embedding, dequantized into `out` (ggml's `get_rows`).
    pub fn embed(&self, token: u32, out: &mut [f32]) -> Result<(), ModelError> {
        let m = self.mat(&self.token_embd);
        let t = token as usize;
        if t >= m.n_out {
            return Err(ModelError::Inconsistent(format!(
                "token {token} is outside the vocabulary of {}",
                m.n_out
            )));
        }
        match m.ty {
            // The quant module has no Q5_K yet; the CPU kernels carry their own.
            GgmlType::Q5K => crate::cpu::dot::dequantize_q5_k(m.row(t), out),
            ty => dequantize_row(ty, m.row(t), out)?,
        }
        Ok(())
    }
}

/// Looks tensors up and checks their shapes and types.
struct Loader<'f> {
    file: &'f GgufFile,
    c: &'f Config,
}

impl Loader<'_> {
    fn info(&self, name: &str) -> Result<&TensorInfo, ModelError> {
        self.file
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_owned()))
    }

    fn check_shape(t: &TensorInfo, expected: &[u64]) -> Result<(), ModelError> {
        // ggml drops trailing dimensions of size 1, so compare with those trimmed.
        let trim = |d: &[u64]| {
            let mut v = d.to_vec();
            while v.len() > 1 && v.last() == Some(&1) {
                v.pop();
            }
            v
        };
        if trim(&t.dims) != trim(expected) {
            return Err(ModelError::Shape {
                tensor: t.name.clone(),
                expected: expected.to_vec(),
                found: t.dims.clone(),
            });
        }
        Ok(())
    }

    /// A 2-D `[n_in, n_out]` or 3-D `[n_in, n_out, n_mat]` weight.
    fn matrix(&self, name: &str, dims: &[u64]) -> Result<Matrix, ModelError> {
        let t = self.info(name)?;
        Self::check_shape(t, dims)?;
        if !SUPPORTED_TYPES.contains(&t.ggml_type) {
            return Err(ModelError::UnsupportedType {
                tensor: name.to_owned(),
                ty: t.ggml_type,
            });
        }
        let tensor = self
            .file
            .tensors()
            .iter()
            .position(|x| x.name == name)
            .expect("found by name above");
        Ok(Matrix {
            tensor,
            ty: t.ggml_type,
            n_in: dims[0] as usize,
            n_out: dims[1] as usize,
            n_mat: dims.get(2).copied().unwrap_or(1) as usize,
        })
    }

    fn vector(&self, name: &str, n: u64) -> Result<Vec<f32>, ModelError> {
        let t = self.info(name)?;
        Self::check_shape(t, &[n])?;
        let mut out = vec![0.0; n as usize];
        dequantize_row(t.ggml_type, self.file.tensor_data(t), &mut out)?;
        Ok(out)
    }

    fn opt_vector(&self, name: &str, n: u64) -> Result<Option<Vec<f32>>, ModelError> {
        match self.file.tensor(name) {
            Some(_) => self.vector(name, n).map(Some),
            None => Ok(None),
        }
    }

    fn layer(&self, i: usize) -> Result<Layer, ModelError> {
        let c = self.c;
        let n = |t: &str| format!("blk.{i}.{t}");
        let e = c.n_embd as u64;
        let (qw, kvw, hd) = (c.q_width() as u64, c.kv_width() as u64, c.head_dim as u64);
        let qwen3 = c.arch.has_qk_norm();
        let attn = Attention {
            norm: self.vector(&n("attn_norm.weight"), e)?,
            wq: self.matrix(&n("attn_q.weight"), &[e, qw])?,
            wk: self.matrix(&n("attn_k.weight"), &[e, kvw])?,
            wv: self.matrix(&n("attn_v.weight"), &[e, kvw])?,
            wo: self.matrix(&n("attn_output.weight"), &[qw, e])?,
            bq: self.opt_vector(&n("attn_q.bias"), qw)?,
            bk: self.opt_vector(&n("attn_k.bias"), kvw)?,
            bv: self.opt_vector(&n("attn_v.bias"), kvw)?,
            q_norm: if qwen3 {
                Some(self.vector(&n("attn_q_norm.weight"), hd)?)
            } else {
                None
            },
            k_norm: if qwen3 {
                Some(self.vector(&n("attn_k_norm.weight"), hd)?)
            } else {
                None
            },
        };
        let ffn = match c.moe {
            Some(moe) => {
                let (x, ff) = (moe.n_expert as u64, moe.n_ff_expert as u64);
                let shared = if c.arch == Arch::Qwen2Moe {
                    let sff = self
                        .file
                        .tensor(&n("ffn_up_shexp.weight"))
                        .map(|t| t.dim(1))
                        .ok_or_else(|| ModelError::MissingTensor(n("ffn_up_shexp.weight")))?;
                    Some(SharedExpert {
                        gate_inp: self.matrix(&n("ffn_gate_inp_shexp.weight"), &[e, 1])?,
                        gate: self.matrix(&n("ffn_gate_shexp.weight"), &[e, sff])?,
                        up: self.matrix(&n("ffn_up_shexp.weight"), &[e, sff])?,
                        down: self.matrix(&n("ffn_down_shexp.weight"), &[sff, e])?,
                    })
                } else {
                    None
                };
                Ffn::Moe(MoeWeights {
                    router: self.matrix(&n("ffn_gate_inp.weight"), &[e, x])?,
                    gate: self.matrix(&n("ffn_gate_exps.weight"), &[e, ff, x])?,
                    up: self.matrix(&n("ffn_up_exps.weight"), &[e, ff, x])?,
                    down: self.matrix(&n("ffn_down_exps.weight"), &[ff, e, x])?,
                    shared,
                })
            }
            None => {
                let ff = c.n_ff as u64;
                Ffn::Dense {
                    gate: self.matrix(&n("ffn_gate.weight"), &[e, ff])?,
                    up: self.matrix(&n("ffn_up.weight"), &[e, ff])?,
                    down: self.matrix(&n("ffn_down.weight"), &[ff, e])?,
                }
            }
        };
        Ok(Layer {
            attn,
            ffn_norm: self.vector(&n("ffn_norm.weight"), e)?,
            ffn,
        })
    }
}
