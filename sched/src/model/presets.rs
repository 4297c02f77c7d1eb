//! Model descriptions from hyper-parameters, for the simulator: the shapes of the models Spillway
//! targets (the same figures as the benchmark generator's presets, from each model's
//! `config.json`) and llama.cpp's Q4_K_M type mix.

use serde::{Deserialize, Serialize};

use super::{ExpertRouting, ModelDesc, TensorDesc, WeightType};

/// Routed experts of a [`ModelShape`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpertShape {
    pub count: u32,
    pub used: u32,
    /// Hidden size of one expert.
    pub n_ff: u64,
}

/// The hyper-parameters that fix a model's tensor table (TOML or a preset).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelShape {
    pub name: String,
    pub n_vocab: u64,
    pub n_embd: u64,
    pub n_layer: u32,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub head_dim: u64,
    /// Dense FFN hidden size; unused when the model has experts.
    pub n_ff: u64,
    /// Per-head RMS norms of Q and K (Qwen3).
    #[serde(default)]
    pub qk_norm: bool,
    /// No output head: it reuses the token embedding.
    #[serde(default)]
    pub tied_embeddings: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertShape>,
}

/// The weight types of a described model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Quant {
    /// Every matrix in one type; 1-D tensors and routers in F32 (`llama-quantize --pure`).
    Uniform(WeightType),
    /// llama.cpp's Q4_K_M mix.
    Q4KM,
}

impl std::str::FromStr for Quant {
    type Err = String;

    fn from_str(s: &str) -> Result<Quant, String> {
        if s.eq_ignore_ascii_case("Q4_K_M") {
            return Ok(Quant::Q4KM);
        }
        let t = WeightType::new(s);
        match t.block() {
            Some(_) => Ok(Quant::Uniform(t)),
            None => Err(format!(
                "unknown weight type {s:?}: choose Q4_K_M, F32, F16, BF16, Q4_0, Q8_0, Q4_K, Q5_K or Q6_K"
            )),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Embd,
    Output,
    AttnQ,
    AttnK,
    AttnV,
    AttnOut,
    Gate,
    Up,
    Down,
}

impl Quant {
    /// llama.cpp's `llama_tensor_get_type` for this mix, before the short-row fallback.
    fn preferred(&self, kind: Kind, layer: u32, shape: &ModelShape) -> WeightType {
        let Quant::Q4KM = self else {
            let Quant::Uniform(t) = self else {
                unreachable!()
            };
            return t.clone();
        };
        let n = shape.n_layer;
        let more_bits = layer < n / 8 || layer >= 7 * n / 8 || (layer - n / 8) % 3 == 2;
        let eight_experts = shape.experts.is_some_and(|e| e.count == 8);
        let name = match kind {
            Kind::Output => "Q6_K",
            Kind::Embd if shape.tied_embeddings => "Q6_K",
            Kind::AttnV | Kind::AttnK if eight_experts => "Q8_0",
            Kind::AttnOut if eight_experts => "Q5_K",
            Kind::AttnV | Kind::Down if more_bits => "Q6_K",
            _ => "Q4_K",
        };
        WeightType::new(name)
    }
}

impl ModelShape {
    /// The tensor table llama.cpp's converter writes for this shape, typed by `quant`.
    pub fn describe(&self, quant: &Quant) -> ModelDesc {
        let s = self;
        let mut tensors = Vec::new();
        let f32t = WeightType::new("F32");
        let vector = |tensors: &mut Vec<TensorDesc>, name: String, n: u64| {
            tensors.push(TensorDesc::new(&name, f32t.clone(), &[n], 4 * n));
        };
        let matrix = |tensors: &mut Vec<TensorDesc>,
                      name: String,
                      kind: Option<Kind>,
                      l: u32,
                      dims: &[u64]| {
            let want = match kind {
                Some(k) => quant.preferred(k, l, s),
                None => WeightType::new("F32"),
            };
            // llama.cpp's fallback for rows that are not whole blocks.
            let ty = match want.block() {
                Some((b, _)) if !dims[0].is_multiple_of(b) => {
                    WeightType::new(if dims[0].is_multiple_of(32) {
                        "Q8_0"
                    } else {
                        "F16"
                    })
                }
                _ => want,
            };
            let n: u64 = dims.iter().product();
            let bytes = ty.bytes_for(n).expect("presets use whole blocks");
            tensors.push(TensorDesc::new(&name, ty, dims, bytes));
        };
        let (embd, vocab) = (s.n_embd, s.n_vocab);
        let q = s.n_head * s.head_dim;
        let kv = s.n_head_kv * s.head_dim;
        matrix(
            &mut tensors,
            "token_embd.weight".into(),
            Some(Kind::Embd),
            0,
            &[embd, vocab],
        );
        for l in 0..s.n_layer {
            let blk = |t: &str| format!("blk.{l}.{t}.weight");
            vector(&mut tensors, blk("attn_norm"), embd);
            matrix(
                &mut tensors,
                blk("attn_q"),
                Some(Kind::AttnQ),
                l,
                &[embd, q],
            );
            matrix(
                &mut tensors,
                blk("attn_k"),
                Some(Kind::AttnK),
                l,
                &[embd, kv],
            );
            matrix(
                &mut tensors,
                blk("attn_v"),
                Some(Kind::AttnV),
                l,
                &[embd, kv],
            );
            matrix(
                &mut tensors,
                blk("attn_output"),
                Some(Kind::AttnOut),
                l,
                &[q, embd],
            );
            if s.qk_norm {
                vector(&mut tensors, blk("attn_q_norm"), s.head_dim);
                vector(&mut tensors, blk("attn_k_norm"), s.head_dim);
            }
            vector(&mut tensors, blk("ffn_norm"), embd);
            match s.experts {
                Some(e) => {
                    let (n, ff) = (u64::from(e.count), e.n_ff);
                    matrix(&mut tensors, blk("ffn_gate_inp"), None, l, &[embd, n]);
                    let (g, u, d) = (Some(Kind::Gate), Some(Kind::Up), Some(Kind::Down));
                    matrix(&mut tensors, blk("ffn_gate_exps"), g, l, &[embd, ff, n]);
                    matrix(&mut tensors, blk("ffn_up_exps"), u, l, &[embd, ff, n]);
                    matrix(&mut tensors, blk("ffn_down_exps"), d, l, &[ff, embd, n]);
                }
                None => {
                    let ff = s.n_ff;
                    matrix(
                        &mut tensors,
                        blk("ffn_gate"),
                        Some(Kind::Gate),
                        l,
                        &[embd, ff],
                    );
                    matrix(&mut tensors, blk("ffn_up"), Some(Kind::Up), l, &[embd, ff]);
                    matrix(
                        &mut tensors,
                        blk("ffn_down"),
                        Some(Kind::Down),
                        l,
                        &[ff, embd],
                    );
                }
            }
        }
        vector(&mut tensors, "output_norm.weight".into(), embd);
        if !s.tied_embeddings {
            matrix(
                &mut tensors,
                "output.weight".into(),
                Some(Kind::Output),
                0,
                &[embd, vocab],
            );
        }
        ModelDesc {
            name: s.name.clone(),
            n_layer: s.n_layer,
            n_embd: embd,
            n_head_kv: s.n_head_kv,
            head_dim: s.head_dim,
            experts: s.experts.map(|e| ExpertRouting {
                count: e.count,
                used: e.used,
                probabilities: None,
            }),
            tensors,
        }
    }
}

fn shape(
    name: &str,
    (n_vocab, n_embd, n_layer): (u64, u64, u32),
    (n_head, n_head_kv, head_dim): (u64, u64, u64),
    n_ff: u64,
    experts: Option<(u32, u32, u64)>,
    (qk_norm, tied_embeddings): (bool, bool),
) -> ModelShape {
    ModelShape {
        name: name.into(),
        n_vocab,
        n_embd,
        n_layer,
        n_head,
        n_head_kv,
        head_dim,
        n_ff,
        qk_norm,
        tied_embeddings,
        experts: experts.map(|(count, used, n_ff)| ExpertShape { count, used, n_ff }),
    }
}

/// Every preset, smallest first.
pub fn all() -> Vec<ModelShape> {
    let (llama, qwen3, qwen3_tied) = ((false, false), (true, false), (true, true));
    vec![
        shape(
            "tiny-qwen3moe",
            (2048, 256, 2),
            (4, 2, 128),
            512,
            Some((16, 4, 256)),
            qwen3_tied,
        ),
        shape(
            "llama-3.2-1b",
            (128_256, 2048, 16),
            (32, 8, 64),
            8192,
            None,
            (false, true),
        ),
        shape(
            "small-qwen3moe",
            (151_936, 1024, 12),
            (16, 4, 128),
            3072,
            Some((32, 8, 512)),
            qwen3_tied,
        ),
        shape(
            "llama-3-8b",
            (128_256, 4096, 32),
            (32, 8, 128),
            14336,
            None,
            llama,
        ),
        shape(
            "qwen3-30b-a3b",
            (151_936, 2048, 48),
            (32, 4, 128),
            6144,
            Some((128, 8, 768)),
            qwen3,
        ),
        shape(
            "mixtral-8x7b",
            (32000, 4096, 32),
            (32, 8, 128),
            14336,
            Some((8, 2, 14336)),
            llama,
        ),
        shape(
            "mixtral-8x22b",
            (32768, 6144, 56),
            (48, 8, 128),
            16384,
            Some((8, 2, 16384)),
            llama,
        ),
        shape(
            "qwen3-235b-a22b",
            (151_936, 4096, 94),
            (64, 4, 128),
            12288,
            Some((128, 8, 1536)),
            qwen3,
        ),
    ]
}

pub fn find(name: &str) -> Option<ModelShape> {
    all()
        .into_iter()
        .find(|s| s.name.eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_their_published_sizes() {
        // Parameter counts in billions (published), checked through F16 bytes.
        let f16 = Quant::Uniform(WeightType::new("F16"));
        for (name, params) in [
            ("llama-3.2-1b", 1.236),
            ("llama-3-8b", 8.030),
            ("qwen3-30b-a3b", 30.53),
            ("mixtral-8x7b", 46.70),
            ("mixtral-8x22b", 140.6),
            ("qwen3-235b-a22b", 235.1),
        ] {
            let m = find(name).unwrap().describe(&f16);
            assert_eq!(m.validate(), Ok(()));
            let got = m.total_bytes() as f64 / 2e9;
            assert!((got / params - 1.0).abs() < 0.01, "{name}: {got}");
        }
        // Q4_K_M as llama.cpp writes it: Qwen's published Qwen3-30B-A3B-Q4_K_M.gguf is about
        // 18.6 GB (1e9 bytes).
        let f = find("qwen3-30b-a3b").unwrap().describe(&Quant::Q4KM);
        let gb = f.total_bytes() as f64 / 1e9;
        assert!((gb / 18.6 - 1.0).abs() < 0.02, "{gb}");
    }

    #[test]
    fn short_rows_fall_back_like_llama_cpp() {
        let m = find("tiny-qwen3moe").unwrap().describe(&Quant::Q4KM);
        let t = |n: &str| m.tensors.iter().find(|t| t.name == n).unwrap();
        // Expert rows of 256 take Q4_K; the router stays F32.
        assert_eq!(t("blk.0.ffn_up_exps.weight").weight_type.name(), "Q4_K");
        assert_eq!(t("blk.0.ffn_gate_inp.weight").weight_type.name(), "F32");
        assert_eq!(t("token_embd.weight").weight_type.name(), "Q6_K");
        assert!("Q3_XL".parse::<Quant>().is_err());
        assert_eq!("q4_k_m".parse::<Quant>(), Ok(Quant::Q4KM));
    }
}
