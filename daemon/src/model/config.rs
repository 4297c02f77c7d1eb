//! Hyper-parameters of a model, read once from GGUF metadata and checked against each other.

use crate::gguf::{GgufError, Metadata};

use super::ModelError;

/// The architectures the engine runs (`general.architecture`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 1–3, Mistral, and Mixtral (routed experts, no shared expert).
    Llama,
    /// Qwen2 dense: biases on the Q, K and V projections.
    Qwen2,
    /// Qwen2-MoE: routed experts without renormalised weights, plus a sigmoid-gated shared expert.
    Qwen2Moe,
    /// Qwen3 dense: per-head RMSNorm of Q and K before RoPE.
    Qwen3,
    /// Qwen3-MoE: Qwen3 attention with routed experts (weights renormalised).
    Qwen3Moe,
}

/// How RoPE pairs the dimensions of a head (ggml's `rope_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(2i, 2i + 1)`: ggml mode 0, llama.cpp's `LLAMA_ROPE_TYPE_NORM`.
    Normal,
    /// Halves `(i, i + n_rot / 2)`: ggml mode 2, `LLAMA_ROPE_TYPE_NEOX`.
    Neox,
}

impl Arch {
    pub fn from_name(name: &str) -> Option<Arch> {
        Some(match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen2moe" => Arch::Qwen2Moe,
            "qwen3" => Arch::Qwen3,
            "qwen3moe" => Arch::Qwen3Moe,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen2Moe => "qwen2moe",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
        }
    }

    /// As llama.cpp's `llama_model_rope_type`: the Qwen family rotates halves.
    pub fn rope_layout(self) -> RopeLayout {
        match self {
            Arch::Llama => RopeLayout::Normal,
            Arch::Qwen2 | Arch::Qwen2Moe | Arch::Qwen3 | Arch::Qwen3Moe => RopeLayout::Neox,
        }
    }

    pub fn has_qk_norm(self) -> bool {
        matches!(self, Arch::Qwen3 | Arch::Qwen3Moe)
    }

    /// Whether the top-k router weights are divided by their sum (llama.cpp's `norm_w`
    /// argument of `build_moe_ffn`: true for Mixtral and Qwen3-MoE, false for Qwen2-MoE).
    pub fn normalizes_expert_weights(self) -> bool {
        !matches!(self, Arch::Qwen2Moe)
    }
}

/// Routed-expert hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_expert_used: usize,
    /// Hidden width of one routed expert.
    pub n_ff_expert: usize,
    /// Normalise the selected experts' weights to sum to one.
    pub norm_weights: bool,
}

/// Everything the forward pass needs to know about the shapes of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Width of one query/key head (`attention.key_length`).
    pub head_dim: usize,
    /// Width of one value head (`attention.value_length`, must equal `head_dim` for now).
    pub head_dim_v: usize,
    /// Dense FFN width; 0 for MoE models without dense layers.
    pub n_ff: usize,
    /// Dimensions RoPE rotates, from the start of each head.
    pub n_rot: usize,
    pub rope_layout: RopeLayout,
    pub rope_freq_base: f32,
    pub rope_freq_scale: f32,
    pub rms_eps: f32,
    pub context_length: usize,
    pub moe: Option<MoeConfig>,
}

impl Config {
    /// Reads the hyper-parameters of `arch` from `md`; `n_vocab` comes from the embedding
    /// tensor, which is authoritative (the vocab metadata may be absent).
    pub fn from_metadata(md: &Metadata, n_vocab: usize) -> Result<Config, ModelError> {
        let arch_name = md.get_str("general.architecture")?;
        let arch = Arch::from_name(arch_name)
            .ok_or_else(|| ModelError::UnsupportedArchitecture(arch_name.to_owned()))?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let usize_of = |k: &str| -> Result<usize, GgufError> { Ok(md.get_u32(&key(k))? as usize) };
        let opt_usize = |k: &str| -> Result<Option<usize>, GgufError> {
            Ok(md.opt_u32(&key(k))?.map(|v| v as usize))
        };

        let n_embd = usize_of("embedding_length")?;
        let n_layer = usize_of("block_count")?;
        let n_head = usize_of("attention.head_count")?;
        let n_head_kv = opt_usize("attention.head_count_kv")?.unwrap_or(n_head);
        if n_head == 0 || n_head_kv == 0 || !n_head.is_multiple_of(n_head_kv) {
            return Err(ModelError::Inconsistent(format!(
                "{n_head} query heads cannot be grouped over {n_head_kv} key/value heads"
            )));
        }
        let head_dim = opt_usize("attention.key_length")?.unwrap_or(n_embd / n_head);
        let head_dim_v = opt_usize("attention.value_length")?.unwrap_or(head_dim);
        if head_dim_v != head_dim {
            return Err(ModelError::Inconsistent(format!(
                "value heads of {head_dim_v} differ from key heads of {head_dim}"
            )));
        }
        let n_rot = opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
        if n_rot > head_dim || !n_rot.is_multiple_of(2) {
            return Err(ModelError::Inconsistent(format!(
                "RoPE over {n_rot} dimensions of {head_dim}-wide heads"
            )));
        }
        let rope_freq_base = md.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0);
        let rope_freq_scale = match md.opt_f32(&key("rope.scale_linear"))? {
            Some(s) if s != 0.0 => 1.0 / s,
            _ => 1.0,
        };
        let rms_eps = md.get_f32(&key("attention.layer_norm_rms_epsilon"))?;
        let context_length = opt_usize("context_length")?.unwrap_or(4096);
        let n_ff = opt_usize("feed_forward_length")?.unwrap_or(0);

        let n_expert = opt_usize("expert_count")?.unwrap_or(0);
        let moe = if n_expert > 0 {
            let n_expert_used = usize_of("expert_used_count")?;
            if n_expert_used == 0 || n_expert_used > n_expert {
                return Err(ModelError::Inconsistent(format!(
                    "{n_expert_used} experts used of {n_expert}"
                )));
            }
            // Mixtral files carry no expert width: its experts are as wide as the dense FFN.
            let n_ff_expert = opt_usize("expert_feed_forward_length")?.unwrap_or(n_ff);
            // llama.cpp fixes this per architecture for these models (ignoring any
            // `expert_weights_norm` key), and so do we.
            let norm_weights = arch.normalizes_expert_weights();
            Some(MoeConfig {
                n_expert,
                n_expert_used,
                n_ff_expert,
                norm_weights,
            })
        } else {
            None
        };
        if matches!(arch, Arch::Qwen2Moe | Arch::Qwen3Moe) && moe.is_none() {
            return Err(ModelError::Inconsistent(format!(
                "{arch_name} without {arch_name}.expert_count"
            )));
        }
        Ok(Config {
            arch,
            n_vocab,
            n_embd,
            n_layer,
            n_head,
            n_head_kv,
            head_dim,
            head_dim_v,
            n_ff,
            n_rot,
            rope_layout: arch.rope_layout(),
            rope_freq_base,
            rope_freq_scale,
            rms_eps,
            context_length,
            moe,
        })
    }

    /// Width of all query heads together.
    pub fn q_width(&self) -> usize {
        self.n_head * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_width(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// Query heads sharing one key/value head.
    pub fn gqa_group(&self) -> usize {
        self.n_head / self.n_head_kv
    }
}
