//! Which ggml type each tensor gets: one type for every weight matrix, or a Q4_K_M-like mix.
//!
//! Single types behave like `llama-quantize --pure`: every matrix (token embedding and output
//! included) takes the type; 1-D tensors (norms, RoPE factors) and the MoE router
//! (`ffn_gate_inp`, which llama.cpp never quantizes) stay F32.
//!
//! `Q4_K_M` follows llama.cpp's `llama_tensor_get_type` for that file type:
//! - Q6_K for `output.weight` (for `token_embd.weight` when the output is tied to it);
//! - Q6_K for `attn_v` and `ffn_down` (`ffn_down_exps` too) in the layers where `use_more_bits`
//!   holds: the first 1/8, the last 1/8, and every third layer in between;
//! - for 8-expert models (Mixtral): Q8_0 for `attn_v` and `attn_k`, Q5_K for `attn_output`;
//! - Q4_K for every other matrix.
//!
//! A k-quant needs rows of whole 256-element super-blocks. Where a row is shorter, llama.cpp
//! falls back (Q4_K→Q5_0, Q5_K→Q5_1, Q6_K→Q8_0); we use Q8_0 for all three, since Q5_0/Q5_1 have
//! no generator here, and report it. Rows not a multiple of 32 fall back to F16, as in llama.cpp.

use std::fmt;
use std::str::FromStr;

use crate::gguf::GgmlType;

use super::weights::GENERATED_TYPES;

/// The `--type` of a synthetic model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightType {
    Uniform(GgmlType),
    Q4KM,
}

impl WeightType {
    /// Every choice, for listings and tests.
    pub fn all() -> Vec<WeightType> {
        let mut v: Vec<WeightType> = GENERATED_TYPES
            .iter()
            .map(|&t| WeightType::Uniform(t))
            .collect();
        v.push(WeightType::Q4KM);
        v
    }

    /// `general.file_type` (llama.cpp's `llama_ftype`).
    pub fn file_type(self) -> u32 {
        match self {
            WeightType::Q4KM => 15,
            WeightType::Uniform(t) => match t {
                GgmlType::F32 => 0,
                GgmlType::F16 => 1,
                GgmlType::Q4_0 => 2,
                GgmlType::Q8_0 => 7,
                // Q4_K_S and Q5_K_S: the file types whose default type these are.
                GgmlType::Q4K => 14,
                GgmlType::Q5K => 16,
                GgmlType::Q6K => 18,
                GgmlType::BF16 => 32,
                // Not produced: `from_str` only accepts generated types.
                _ => 1024,
            },
        }
    }

    pub fn is_quantized(self) -> bool {
        !matches!(
            self,
            WeightType::Uniform(GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
        )
    }
}

impl fmt::Display for WeightType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WeightType::Uniform(t) => f.write_str(t.name()),
            WeightType::Q4KM => f.write_str("Q4_K_M"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error(
    "unknown weight type {0:?}; choose one of F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, Q4_K_M"
)]
pub struct UnknownWeightType(pub String);

impl FromStr for WeightType {
    type Err = UnknownWeightType;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.eq_ignore_ascii_case("Q4_K_M") {
            return Ok(WeightType::Q4KM);
        }
        match GgmlType::from_name(s) {
            Some(t) if GENERATED_TYPES.contains(&t) => Ok(WeightType::Uniform(t)),
            _ => Err(UnknownWeightType(s.to_string())),
        }
    }
}

/// What a tensor is, as far as the type choice cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    TokenEmbd,
    Output,
    /// Any 1-D weight: norms and RoPE factors.
    Vector,
    Router,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    FfnGate,
    FfnUp,
    FfnDown,
}

/// The model facts the mix depends on.
#[derive(Debug, Clone, Copy)]
pub struct MixContext {
    pub n_layer: u32,
    pub n_expert: u32,
    pub tied_embeddings: bool,
}

/// llama.cpp's `use_more_bits`.
pub fn use_more_bits(layer: u32, n_layer: u32) -> bool {
    layer < n_layer / 8 || layer >= 7 * n_layer / 8 || (layer - n_layer / 8) % 3 == 2
}

/// The type llama.cpp's rule would pick, before any row-length fallback.
fn preferred(weights: WeightType, role: Role, layer: u32, ctx: &MixContext) -> GgmlType {
    if matches!(role, Role::Vector | Role::Router) {
        return GgmlType::F32;
    }
    let WeightType::Uniform(t) = weights else {
        let eight_experts = ctx.n_expert == 8;
        return match role {
            Role::Output => GgmlType::Q6K,
            Role::TokenEmbd if ctx.tied_embeddings => GgmlType::Q6K,
            Role::AttnV if eight_experts => GgmlType::Q8_0,
            Role::AttnK if eight_experts => GgmlType::Q8_0,
            Role::AttnOutput if eight_experts => GgmlType::Q5K,
            Role::AttnV | Role::FfnDown if use_more_bits(layer, ctx.n_layer) => GgmlType::Q6K,
            _ => GgmlType::Q4K,
        };
    };
    t
}

/// The type of a tensor whose rows have `ne0` elements, and a note when it had to fall back.
pub fn choose(
    weights: WeightType,
    role: Role,
    layer: u32,
    ctx: &MixContext,
    ne0: u64,
) -> (GgmlType, Option<String>) {
    let want = preferred(weights, role, layer, ctx);
    if ne0.is_multiple_of(want.block_size()) {
        return (want, None);
    }
    let fallback = if ne0.is_multiple_of(32) {
        GgmlType::Q8_0
    } else {
        GgmlType::F16
    };
    let note = format!("rows of {ne0} are not whole {want} blocks: {fallback} instead");
    (fallback, Some(note))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_layers_match_llama_cpp() {
        let layers: Vec<u32> = (0..32).filter(|&i| use_more_bits(i, 32)).collect();
        assert_eq!(
            layers,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
    }

    #[test]
    fn q4_k_m_mix() {
        let ctx = MixContext {
            n_layer: 32,
            n_expert: 0,
            tied_embeddings: false,
        };
        let q = |role, layer| choose(WeightType::Q4KM, role, layer, &ctx, 4096).0;
        assert_eq!(q(Role::Output, 0), GgmlType::Q6K);
        assert_eq!(q(Role::TokenEmbd, 0), GgmlType::Q4K);
        assert_eq!(q(Role::AttnV, 0), GgmlType::Q6K);
        assert_eq!(q(Role::AttnV, 4), GgmlType::Q4K);
        assert_eq!(q(Role::FfnDown, 6), GgmlType::Q6K);
        assert_eq!(q(Role::FfnUp, 6), GgmlType::Q4K);
        assert_eq!(q(Role::Router, 6), GgmlType::F32);
        let mixtral = MixContext { n_expert: 8, ..ctx };
        assert_eq!(
            choose(WeightType::Q4KM, Role::AttnOutput, 5, &mixtral, 4096).0,
            GgmlType::Q5K
        );
        assert_eq!(
            choose(WeightType::Q4KM, Role::AttnK, 5, &mixtral, 4096).0,
            GgmlType::Q8_0
        );
    }

    #[test]
    fn short_rows_fall_back() {
        let ctx = MixContext {
            n_layer: 2,
            n_expert: 16,
            tied_embeddings: true,
        };
        let (t, note) = choose(WeightType::Q4KM, Role::FfnDown, 0, &ctx, 128);
        assert_eq!(t, GgmlType::Q8_0);
        assert!(note.is_some());
        let f16 = choose(
            WeightType::Uniform(GgmlType::Q4_0),
            Role::AttnQ,
            0,
            &ctx,
            48,
        );
        assert_eq!(f16.0, GgmlType::F16);
        assert_eq!(
            choose(WeightType::Q4KM, Role::TokenEmbd, 0, &ctx, 256).0,
            GgmlType::Q6K
        );
    }

    #[test]
    fn names_parse() {
        assert_eq!("q4_k_m".parse::<WeightType>().unwrap(), WeightType::Q4KM);
        assert_eq!(
            "Q8_0".parse::<WeightType>().unwrap(),
            WeightType::Uniform(GgmlType::Q8_0)
        );
        assert!("IQ2_XS".parse::<WeightType>().is_err());
        for w in WeightType::all() {
            assert_eq!(w.to_string().parse::<WeightType>().unwrap(), w);
            assert_ne!(w.file_type(), 1024);
        }
    }
}
