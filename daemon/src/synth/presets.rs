//! Model shapes: tiny ones for tests and the real hyper-parameters of the models Spillway targets
//! (from each model's Hugging Face `config.json`, as llama.cpp's converter writes them to GGUF).

/// Architecture name as `general.architecture` spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 1–3; Mixtral when the preset has experts.
    Llama,
    /// Qwen3 dense: per-head RMS norm of Q and K, head size independent of the width.
    Qwen3,
    /// Qwen3 MoE: routed experts only (no shared expert).
    Qwen3Moe,
    /// Qwen2 MoE (Qwen1.5-MoE): Q/K/V biases, routed experts plus a sigmoid-gated shared expert.
    Qwen2Moe,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Qwen2Moe => "qwen2moe",
        }
    }
}

/// The tokenizer family, which fixes `tokenizer.ggml.model`/`pre` and the special tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerKind {
    /// SentencePiece BPE with byte fallback (Llama 2, Mistral, Mixtral): `"llama"`.
    SentencePiece,
    /// GPT-2 byte-level BPE with Llama 3's pre-tokenizer: `"gpt2"` / `"llama-bpe"`.
    Llama3,
    /// GPT-2 byte-level BPE with Qwen2's pre-tokenizer: `"gpt2"` / `"qwen2"`.
    Qwen2,
}

/// Where special tokens go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialLayout {
    /// A handful of specials after the BPE pieces (tiny presets).
    Compact,
    /// Llama 3.0's 256 specials at 128000..128256.
    Llama30,
    /// Llama 3.1/3.2's 256 specials (eom, python_tag, finetune pad) at 128000..128256.
    Llama31,
    /// Qwen2/Qwen3's 26 added tokens at 151643.. then `[PADn]` up to the embedding rows.
    Qwen,
}

/// Routed experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Experts {
    pub count: u32,
    pub used: u32,
    /// Hidden size of one expert (`expert_feed_forward_length`); Mixtral's equals `n_ff`.
    pub n_ff: u32,
    /// Hidden size of the shared expert (`expert_shared_feed_forward_length`, Qwen2-MoE).
    pub shared_n_ff: Option<u32>,
}

/// Llama 3.1's "llama3" RoPE scaling, which the converter bakes into `rope_freqs.weight`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Llama3Rope {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_context: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    /// `general.name`.
    pub model_name: &'static str,
    pub summary: &'static str,
    pub arch: Arch,
    pub tokenizer: TokenizerKind,
    pub specials: SpecialLayout,
    /// Rows of the token embedding = tokens in the vocabulary.
    pub n_vocab: u32,
    pub n_embd: u32,
    pub n_layer: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub head_dim: u32,
    /// Dense FFN hidden size (`feed_forward_length`).
    pub n_ff: u32,
    pub context: u32,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub experts: Option<Experts>,
    /// No `output.weight`: the output projection reuses `token_embd.weight`.
    pub tied_embeddings: bool,
    pub rope_scaling: Option<Llama3Rope>,
}

impl Preset {
    pub fn is_tiny(&self) -> bool {
        self.name.starts_with("tiny-")
    }
}

const LLAMA: Preset = Preset {
    name: "",
    model_name: "",
    summary: "",
    arch: Arch::Llama,
    tokenizer: TokenizerKind::Llama3,
    specials: SpecialLayout::Compact,
    n_vocab: 2048,
    n_embd: 256,
    n_layer: 4,
    n_head: 4,
    n_head_kv: 2,
    head_dim: 64,
    n_ff: 512,
    context: 2048,
    rope_base: 500_000.0,
    rms_eps: 1e-5,
    experts: None,
    tied_embeddings: false,
    rope_scaling: None,
};

const QWEN3: Preset = Preset {
    arch: Arch::Qwen3,
    tokenizer: TokenizerKind::Qwen2,
    context: 40960,
    rope_base: 1_000_000.0,
    rms_eps: 1e-6,
    ..LLAMA
};

/// Every preset, tiny ones first.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "tiny-llama",
        model_name: "Tiny Llama 3 (synthetic)",
        summary: "Llama 3 layout, 4 layers, GQA, untied output",
        ..LLAMA
    },
    Preset {
        name: "tiny-mixtral",
        model_name: "Tiny Mixtral (synthetic)",
        summary: "Mixtral layout, 8 experts top-2, SentencePiece vocab",
        tokenizer: TokenizerKind::SentencePiece,
        n_layer: 2,
        n_ff: 256,
        context: 4096,
        rope_base: 1_000_000.0,
        experts: Some(Experts {
            count: 8,
            used: 2,
            n_ff: 256,
            shared_n_ff: None,
        }),
        ..LLAMA
    },
    Preset {
        name: "tiny-qwen3",
        model_name: "Tiny Qwen3 (synthetic)",
        summary: "Qwen3 layout, QK-norm, head_dim*heads != width, tied embeddings",
        n_layer: 2,
        head_dim: 128,
        tied_embeddings: true,
        ..QWEN3
    },
    Preset {
        name: "tiny-qwen3moe",
        model_name: "Tiny Qwen3 MoE (synthetic)",
        summary: "Qwen3-MoE layout, 16 experts top-4, expert rows of 128 (k-quant fallback)",
        arch: Arch::Qwen3Moe,
        n_layer: 2,
        experts: Some(Experts {
            count: 16,
            used: 4,
            n_ff: 128,
            shared_n_ff: None,
        }),
        ..QWEN3
    },
    Preset {
        name: "tiny-qwen2moe",
        model_name: "Tiny Qwen2 MoE (synthetic)",
        summary: "Qwen2-MoE layout, Q/K/V biases, 16 experts top-4 and a gated shared expert",
        arch: Arch::Qwen2Moe,
        n_layer: 2,
        experts: Some(Experts {
            count: 16,
            used: 4,
            n_ff: 128,
            shared_n_ff: Some(256),
        }),
        ..QWEN3
    },
    Preset {
        name: "llama-3.2-1b",
        model_name: "Llama 3.2 1B Instruct (synthetic)",
        summary: "Llama 3.2 1B: tied embeddings, llama3 RoPE scaling",
        specials: SpecialLayout::Llama31,
        n_vocab: 128_256,
        n_embd: 2048,
        n_layer: 16,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 64,
        n_ff: 8192,
        context: 131_072,
        tied_embeddings: true,
        rope_scaling: Some(Llama3Rope {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_context: 8192,
        }),
        ..LLAMA
    },
    Preset {
        name: "llama-3-8b",
        model_name: "Meta Llama 3 8B Instruct (synthetic)",
        summary: "Llama 3 8B",
        specials: SpecialLayout::Llama30,
        n_vocab: 128_256,
        n_embd: 4096,
        n_layer: 32,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 128,
        n_ff: 14336,
        context: 8192,
        ..LLAMA
    },
    Preset {
        name: "qwen3-0.6b",
        model_name: "Qwen3 0.6B (synthetic)",
        summary: "Qwen3 0.6B dense: tied embeddings",
        specials: SpecialLayout::Qwen,
        n_vocab: 151_936,
        n_embd: 1024,
        n_layer: 28,
        n_head: 16,
        n_head_kv: 8,
        head_dim: 128,
        n_ff: 3072,
        tied_embeddings: true,
        ..QWEN3
    },
    Preset {
        name: "qwen3-30b-a3b",
        model_name: "Qwen3 30B A3B (synthetic)",
        summary: "Qwen3-30B-A3B: 128 experts top-8",
        arch: Arch::Qwen3Moe,
        specials: SpecialLayout::Qwen,
        n_vocab: 151_936,
        n_embd: 2048,
        n_layer: 48,
        n_head: 32,
        n_head_kv: 4,
        head_dim: 128,
        n_ff: 6144,
        experts: Some(Experts {
            count: 128,
            used: 8,
            n_ff: 768,
            shared_n_ff: None,
        }),
        ..QWEN3
    },
    Preset {
        name: "small-qwen3moe",
        model_name: "Small Qwen3 MoE (synthetic)",
        summary: "Synthetic only, no published model: Qwen3-MoE layout at benchmark size, \
                  12 layers, width 1024, 32 experts top-8 of 512 rows; 0.82 B total, \
                  0.37 B active per token (0.21 B without the tied output head)",
        arch: Arch::Qwen3Moe,
        specials: SpecialLayout::Qwen,
        n_vocab: 151_936,
        n_embd: 1024,
        n_layer: 12,
        n_head: 16,
        n_head_kv: 4,
        head_dim: 128,
        n_ff: 3072,
        experts: Some(Experts {
            count: 32,
            used: 8,
            n_ff: 512,
            shared_n_ff: None,
        }),
        tied_embeddings: true,
        ..QWEN3
    },
    Preset {
        name: "mixtral-8x7b",
        model_name: "Mixtral 8x7B Instruct v0.1 (synthetic)",
        summary: "Mixtral 8x7B: 8 experts top-2, SentencePiece vocab",
        tokenizer: TokenizerKind::SentencePiece,
        n_vocab: 32000,
        n_embd: 4096,
        n_layer: 32,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 128,
        n_ff: 14336,
        context: 32768,
        rope_base: 1_000_000.0,
        experts: Some(Experts {
            count: 8,
            used: 2,
            n_ff: 14336,
            shared_n_ff: None,
        }),
        ..LLAMA
    },
    Preset {
        name: "qwen3-235b-a22b",
        model_name: "Qwen3 235B A22B (synthetic)",
        summary: "Qwen3-235B-A22B: 94 layers, 128 experts top-8",
        arch: Arch::Qwen3Moe,
        specials: SpecialLayout::Qwen,
        n_vocab: 151_936,
        n_embd: 4096,
        n_layer: 94,
        n_head: 64,
        n_head_kv: 4,
        head_dim: 128,
        n_ff: 12288,
        experts: Some(Experts {
            count: 128,
            used: 8,
            n_ff: 1536,
            shared_n_ff: None,
        }),
        ..QWEN3
    },
];

pub fn find(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name.eq_ignore_ascii_case(name))
}

/// Llama 3.1's per-frequency RoPE divisors, as `convert_hf_to_gguf.py` computes them for
/// `rope_freqs.weight` (one per pair of rotated dimensions).
pub fn llama3_rope_factors(rope: &Llama3Rope, head_dim: u32, base: f32) -> Vec<f32> {
    let low_wavelen = rope.original_context as f64 / f64::from(rope.low_freq_factor);
    let high_wavelen = rope.original_context as f64 / f64::from(rope.high_freq_factor);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / f64::from(base).powf(f64::from(2 * i) / f64::from(head_dim));
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let factor = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                f64::from(rope.factor)
            } else {
                let smooth = (rope.original_context as f64 / wavelen
                    - f64::from(rope.low_freq_factor))
                    / f64::from(rope.high_freq_factor - rope.low_freq_factor);
                1.0 / ((1.0 - smooth) / f64::from(rope.factor) + smooth)
            };
            factor as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_heads_divide() {
        for (i, p) in PRESETS.iter().enumerate() {
            assert!(PRESETS[..i].iter().all(|q| q.name != p.name));
            assert_eq!(p.n_head % p.n_head_kv, 0, "{}", p.name);
            if p.arch == Arch::Llama {
                assert_eq!(p.n_head * p.head_dim, p.n_embd, "{}", p.name);
            }
            assert_eq!(find(p.name), Some(p));
        }
    }

    #[test]
    fn llama3_rope_factors_span_one_to_factor() {
        let p = find("llama-3.2-1b").unwrap();
        let f = llama3_rope_factors(p.rope_scaling.as_ref().unwrap(), p.head_dim, p.rope_base);
        assert_eq!(f.len(), 32);
        assert_eq!(f[0], 1.0);
        assert_eq!(*f.last().unwrap(), 32.0);
        assert!(f.windows(2).all(|w| w[0] <= w[1]));
    }
}
