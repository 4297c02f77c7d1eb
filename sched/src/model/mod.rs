//! What the planner knows of a model: its tensors (name, weight type, shape, bytes, role) and how
//! its experts are routed. The daemon fills a [`ModelDesc`] from a GGUF header; [`presets`]
//! build one from hyper-parameters for the simulator.

pub mod presets;

use std::fmt;

use serde::{Deserialize, Serialize};

/// A ggml weight type, by the name ggml prints (`Q4_K`, `F16`, `IQ4_XS`, ...).
///
/// A name rather than a closed enum: the planner only needs it as a key for predictors, and
/// the daemon may read types the scheduler has no special knowledge of.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WeightType(String);

impl WeightType {
    pub fn new(name: &str) -> WeightType {
        WeightType(name.trim().to_ascii_uppercase())
    }

    pub fn name(&self) -> &str {
        &self.0
    }

    /// Elements and bytes of one block, for the types presets use.
    pub fn block(&self) -> Option<(u64, u64)> {
        Some(match self.0.as_str() {
            "F32" => (1, 4),
            "F16" | "BF16" => (1, 2),
            "Q4_0" => (32, 18),
            "Q8_0" => (32, 34),
            "Q4_K" => (256, 144),
            "Q5_K" => (256, 176),
            "Q6_K" => (256, 210),
            _ => return None,
        })
    }

    /// Whether the GPU's products of this type take their inputs quantized to 8 bits for
    /// integer dot products, in a dispatch of its own before the first product that reads them
    /// where the product has at least [`GPU_SMALL_PRODUCT_WEIGHTS`] weights (smaller ones
    /// quantize in their own workgroups).
    pub fn gpu_quantizes_inputs(&self) -> bool {
        matches!(self.0.as_str(), "Q4_0" | "Q8_0")
    }

    /// Bytes of `n` elements, when the block layout is known and `n` is whole blocks.
    pub fn bytes_for(&self, n: u64) -> Option<u64> {
        let (elems, bytes) = self.block()?;
        n.is_multiple_of(elems).then(|| n / elems * bytes)
    }
}

impl fmt::Display for WeightType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a tensor does in a decode step, which decides how often it is read and where it may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TensorRole {
    /// `token_embd`: one row is read per token, never a matrix product.
    Embedding,
    /// The output head: one matrix-vector product per token over the vocabulary.
    Output,
    /// Any 1-D weight: norms, RoPE factors; `layer` is `None` outside the blocks.
    Norm { layer: Option<u32> },
    /// Q, K, V and output projections.
    Attention { layer: u32 },
    /// The MoE gate (`ffn_gate_inp`), including a shared expert's gate.
    Router { layer: u32 },
    /// A dense FFN matrix.
    Ffn { layer: u32 },
    /// A shared expert's matrix (Qwen2-MoE `*_shexp`): used by every token.
    SharedExpert { layer: u32 },
    /// All routed experts of one matrix in one tensor; the last dimension is the expert.
    Experts { layer: u32 },
    /// One routed expert's matrix in a tensor of its own (older Mixtral files).
    Expert { layer: u32, index: u32 },
}

impl TensorRole {
    pub fn layer(self) -> Option<u32> {
        match self {
            TensorRole::Embedding | TensorRole::Output => None,
            TensorRole::Norm { layer } => layer,
            TensorRole::Attention { layer }
            | TensorRole::Router { layer }
            | TensorRole::Ffn { layer }
            | TensorRole::SharedExpert { layer }
            | TensorRole::Experts { layer }
            | TensorRole::Expert { layer, .. } => Some(layer),
        }
    }

    /// Routed experts, which only some tokens read.
    pub fn is_routed(self) -> bool {
        matches!(self, TensorRole::Experts { .. } | TensorRole::Expert { .. })
    }

    /// Short name for tables.
    pub fn label(self) -> &'static str {
        match self {
            TensorRole::Embedding => "embedding",
            TensorRole::Output => "output",
            TensorRole::Norm { .. } => "norm",
            TensorRole::Attention { .. } => "attn",
            TensorRole::Router { .. } => "router",
            TensorRole::Ffn { .. } => "ffn",
            TensorRole::SharedExpert { .. } => "shared expert",
            TensorRole::Experts { .. } | TensorRole::Expert { .. } => "experts",
        }
    }

    /// The role of a tensor from its llama.cpp name and number of dimensions.
    pub fn from_name(name: &str, n_dims: usize) -> TensorRole {
        let base = name.strip_suffix(".weight").unwrap_or(name);
        let Some(rest) = base.strip_prefix("blk.") else {
            return match base {
                "token_embd" => TensorRole::Embedding,
                "output" => TensorRole::Output,
                _ => TensorRole::Norm { layer: None },
            };
        };
        let (layer, what) = rest.split_once('.').unwrap_or((rest, ""));
        let Ok(layer) = layer.parse::<u32>() else {
            return TensorRole::Norm { layer: None };
        };
        if n_dims <= 1 {
            return TensorRole::Norm { layer: Some(layer) };
        }
        if what.starts_with("ffn_gate_inp") {
            return TensorRole::Router { layer };
        }
        if what.starts_with("attn") {
            return TensorRole::Attention { layer };
        }
        if what.ends_with("_exps") {
            return TensorRole::Experts { layer };
        }
        if what.ends_with("_shexp") {
            return TensorRole::SharedExpert { layer };
        }
        // `ffn_up.3` in files that store each Mixtral expert on its own.
        if let Some((_, idx)) = what.rsplit_once('.') {
            if let Ok(index) = idx.parse::<u32>() {
                return TensorRole::Expert { layer, index };
            }
        }
        TensorRole::Ffn { layer }
    }
}

/// GPU products (a decode step's matrix-vector products in integer dot products) of fewer
/// weights than this quantize their inputs in their own workgroups instead of reading them
/// quantized by a dispatch before them (`GpuModelOptions::q8_min_weights` in the daemon, whose
/// default this is): for those, the dispatch and its dependency cost more than each workgroup
/// quantizing the inputs it reads.
pub const GPU_SMALL_PRODUCT_WEIGHTS: usize = 20_000_000;

/// One weight tensor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorDesc {
    pub name: String,
    pub weight_type: WeightType,
    /// Dimensions in ggml order: `shape[0]` is the row length (the input width of a matrix).
    pub shape: Vec<u64>,
    pub bytes: u64,
    pub role: TensorRole,
}

impl TensorDesc {
    /// Builds a tensor whose role follows from its name.
    pub fn new(name: &str, weight_type: WeightType, shape: &[u64], bytes: u64) -> TensorDesc {
        TensorDesc {
            role: TensorRole::from_name(name, shape.len()),
            name: name.to_string(),
            weight_type,
            shape: shape.to_vec(),
            bytes,
        }
    }

    /// Input and output width of one matrix (one expert's, for an expert stack).
    pub fn matrix(&self) -> (u64, u64) {
        let k = self.shape.first().copied().unwrap_or(1);
        let n = self.shape.get(1).copied().unwrap_or(1);
        (k, n)
    }
}

/// Routed experts of a MoE model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertRouting {
    pub count: u32,
    /// Experts each token uses in each layer (top-k).
    pub used: u32,
    /// Probability that a token uses each expert, per layer (`[layer][expert]`), each layer
    /// summing to `used`. `None`: uniform, `used / count`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probabilities: Option<Vec<Vec<f64>>>,
}

/// A model as the planner sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelDesc {
    pub name: String,
    pub n_layer: u32,
    pub n_embd: u64,
    /// KV heads and head size, which size the KV cache.
    pub n_head_kv: u64,
    pub head_dim: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertRouting>,
    pub tensors: Vec<TensorDesc>,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    #[error("tensor {name} is in layer {layer}, but the model has {n_layer} layers")]
    LayerOutOfRange {
        name: String,
        layer: u32,
        n_layer: u32,
    },
    #[error("tensor {name} holds routed experts, but the model declares no expert count")]
    ExpertsWithoutRouting { name: String },
    #[error("tensor {name}: last dimension {got} is not the expert count {count}")]
    ExpertCountMismatch { name: String, got: u64, count: u32 },
    #[error("expert probabilities: {0}")]
    Probabilities(String),
    #[error("experts used per token ({used}) must be between 1 and the expert count ({count})")]
    UsedOutOfRange { used: u32, count: u32 },
}

impl ModelDesc {
    /// Checks what the planner relies on: layers in range, expert stacks of the declared count,
    /// probabilities per layer that sum to the experts used.
    pub fn validate(&self) -> Result<(), ModelError> {
        if let Some(r) = &self.experts {
            if r.used == 0 || r.used > r.count {
                return Err(ModelError::UsedOutOfRange {
                    used: r.used,
                    count: r.count,
                });
            }
            if let Some(p) = &r.probabilities {
                if p.len() != self.n_layer as usize {
                    return Err(ModelError::Probabilities(format!(
                        "{} layers given, the model has {}",
                        p.len(),
                        self.n_layer
                    )));
                }
                for (l, row) in p.iter().enumerate() {
                    let sum: f64 = row.iter().sum();
                    let bad = row.len() != r.count as usize
                        || row.iter().any(|&x| !(0.0..=1.0).contains(&x))
                        || (sum - f64::from(r.used)).abs() > 1e-3 * f64::from(r.used);
                    if bad {
                        return Err(ModelError::Probabilities(format!(
                            "layer {l}: need {} values in [0, 1] summing to {}",
                            r.count, r.used
                        )));
                    }
                }
            }
        }
        for t in &self.tensors {
            if let Some(layer) = t.role.layer() {
                if layer >= self.n_layer {
                    return Err(ModelError::LayerOutOfRange {
                        name: t.name.clone(),
                        layer,
                        n_layer: self.n_layer,
                    });
                }
            }
            if t.role.is_routed() {
                let Some(r) = &self.experts else {
                    return Err(ModelError::ExpertsWithoutRouting {
                        name: t.name.clone(),
                    });
                };
                if let TensorRole::Experts { .. } = t.role {
                    let got = t.shape.last().copied().unwrap_or(0);
                    if got != u64::from(r.count) {
                        return Err(ModelError::ExpertCountMismatch {
                            name: t.name.clone(),
                            got,
                            count: r.count,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Probability that one token reads expert `index` of `layer` (1 for a dense model).
    pub fn expert_probability(&self, layer: u32, index: u32) -> f64 {
        match &self.experts {
            None => 1.0,
            Some(r) => match &r.probabilities {
                Some(p) => p[layer as usize][index as usize],
                None => f64::from(r.used) / f64::from(r.count),
            },
        }
    }

    /// Number of routed experts, 0 for a dense model.
    pub fn expert_count(&self) -> u32 {
        self.experts.as_ref().map_or(0, |r| r.count)
    }

    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.bytes).sum()
    }

    /// KV-cache bytes per token of context, keys and values in f16.
    /// Floats of a token's query: the rows of the first layer's Q projection, else the width.
    pub fn query_width(&self) -> u64 {
        self.tensors
            .iter()
            .find(|t| t.name.starts_with("blk.0.attn_q."))
            .map_or(self.n_embd, |t| t.matrix().1)
    }

    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.n_layer) * self.n_head_kv * self.head_dim * 2
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_follow_llama_cpp_names() {
        let r = TensorRole::from_name;
        assert_eq!(r("token_embd.weight", 2), TensorRole::Embedding);
        assert_eq!(r("output.weight", 2), TensorRole::Output);
        assert_eq!(r("output_norm.weight", 1), TensorRole::Norm { layer: None });
        assert_eq!(
            r("blk.3.attn_norm.weight", 1),
            TensorRole::Norm { layer: Some(3) }
        );
        assert_eq!(
            r("blk.3.attn_q.weight", 2),
            TensorRole::Attention { layer: 3 }
        );
        assert_eq!(
            r("blk.3.ffn_gate_inp.weight", 2),
            TensorRole::Router { layer: 3 }
        );
        assert_eq!(
            r("blk.3.ffn_up_exps.weight", 3),
            TensorRole::Experts { layer: 3 }
        );
        assert_eq!(
            r("blk.3.ffn_up_shexp.weight", 2),
            TensorRole::SharedExpert { layer: 3 }
        );
        assert_eq!(
            r("blk.3.ffn_up.5.weight", 2),
            TensorRole::Expert { layer: 3, index: 5 }
        );
        assert_eq!(r("blk.3.ffn_down.weight", 2), TensorRole::Ffn { layer: 3 });
    }

    #[test]
    fn validate_rejects_bad_probabilities_and_counts() {
        let mut m = presets::find("tiny-qwen3moe")
            .unwrap()
            .describe(&presets::Quant::Q4KM);
        assert_eq!(m.validate(), Ok(()));
        let r = m.experts.as_mut().unwrap();
        r.probabilities = Some(vec![vec![0.25; 16]; 2]);
        assert_eq!(m.validate(), Ok(()));
        m.experts.as_mut().unwrap().probabilities = Some(vec![vec![0.5; 16]; 2]);
        assert!(matches!(m.validate(), Err(ModelError::Probabilities(_))));
        m.experts.as_mut().unwrap().probabilities = None;
        m.experts.as_mut().unwrap().count = 8;
        assert!(matches!(
            m.validate(),
            Err(ModelError::ExpertCountMismatch { .. })
        ));
    }
}
