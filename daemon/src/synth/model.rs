//! The tensor table and the architecture metadata of a preset, named and shaped as llama.cpp's
//! converter writes them (gguf-py's `MODEL_TENSORS` and `Keys`).

use crate::gguf::writer::TensorSpec;
use crate::gguf::{GgmlType, Value};

use super::mix::{choose, MixContext, Role, WeightType};
use super::presets::{llama3_rope_factors, Arch, Preset};
use super::weights::{Init, WEIGHT_STD};

/// One tensor to write: its declaration and how to fill it.
#[derive(Debug, Clone)]
pub struct TensorPlan {
    pub spec: TensorSpec,
    pub init: Init,
}

/// All tensors of `preset` in `weights`, in execution order (embedding, layers, output), and
/// notes on any type fallbacks.
pub fn tensors(preset: &Preset, weights: WeightType) -> (Vec<TensorPlan>, Vec<String>) {
    let p = preset;
    let (embd, vocab) = (u64::from(p.n_embd), u64::from(p.n_vocab));
    let q_width = u64::from(p.n_head * p.head_dim);
    let kv_width = u64::from(p.n_head_kv * p.head_dim);
    let ctx = MixContext {
        n_layer: p.n_layer,
        n_expert: p.experts.map_or(0, |e| e.count),
        tied_embeddings: p.tied_embeddings,
    };
    let mut out = Vec::new();
    let mut notes = Vec::new();
    let mut add = |name: String, role: Role, layer: u32, dims: &[u64], init: Init| {
        let (ty, note) = choose(weights, role, layer, &ctx, dims[0]);
        if let Some(note) = note {
            notes.push(format!("{name}: {note}"));
        }
        out.push(TensorPlan {
            spec: TensorSpec::new(name, ty, dims),
            init,
        });
    };
    let random = || Init::Random { std: WEIGHT_STD };

    // convert_hf_to_gguf.py emits the generated RoPE factors before the model's own tensors.
    if let Some(rope) = &p.rope_scaling {
        let factors = llama3_rope_factors(rope, p.head_dim, p.rope_base);
        let n = factors.len() as u64;
        add(
            "rope_freqs.weight".into(),
            Role::Vector,
            0,
            &[n],
            Init::Values(factors),
        );
    }
    add(
        "token_embd.weight".into(),
        Role::TokenEmbd,
        0,
        &[embd, vocab],
        random(),
    );
    for l in 0..p.n_layer {
        let blk = |t: &str| format!("blk.{l}.{t}.weight");
        add(blk("attn_norm"), Role::Vector, l, &[embd], Init::NearOne);
        add(blk("attn_q"), Role::AttnQ, l, &[embd, q_width], random());
        add(blk("attn_k"), Role::AttnK, l, &[embd, kv_width], random());
        add(blk("attn_v"), Role::AttnV, l, &[embd, kv_width], random());
        add(
            blk("attn_output"),
            Role::AttnOutput,
            l,
            &[q_width, embd],
            random(),
        );
        if p.arch == Arch::Qwen2Moe {
            let bias = |t: &str| format!("blk.{l}.{t}.bias");
            add(bias("attn_q"), Role::Vector, l, &[q_width], random());
            add(bias("attn_k"), Role::Vector, l, &[kv_width], random());
            add(bias("attn_v"), Role::Vector, l, &[kv_width], random());
        }
        if matches!(p.arch, Arch::Qwen3 | Arch::Qwen3Moe) {
            let hd = u64::from(p.head_dim);
            add(blk("attn_q_norm"), Role::Vector, l, &[hd], Init::NearOne);
            add(blk("attn_k_norm"), Role::Vector, l, &[hd], Init::NearOne);
        }
        add(blk("ffn_norm"), Role::Vector, l, &[embd], Init::NearOne);
        match p.experts {
            Some(e) => {
                let (n, ff) = (u64::from(e.count), u64::from(e.n_ff));
                add(blk("ffn_gate_inp"), Role::Router, l, &[embd, n], random());
                add(
                    blk("ffn_gate_exps"),
                    Role::FfnGate,
                    l,
                    &[embd, ff, n],
                    random(),
                );
                add(blk("ffn_up_exps"), Role::FfnUp, l, &[embd, ff, n], random());
                add(
                    blk("ffn_down_exps"),
                    Role::FfnDown,
                    l,
                    &[ff, embd, n],
                    random(),
                );
                if let Some(sff) = e.shared_n_ff.map(u64::from) {
                    add(
                        blk("ffn_gate_inp_shexp"),
                        Role::Router,
                        l,
                        &[embd],
                        random(),
                    );
                    add(
                        blk("ffn_gate_shexp"),
                        Role::FfnGate,
                        l,
                        &[embd, sff],
                        random(),
                    );
                    add(blk("ffn_up_shexp"), Role::FfnUp, l, &[embd, sff], random());
                    add(
                        blk("ffn_down_shexp"),
                        Role::FfnDown,
                        l,
                        &[sff, embd],
                        random(),
                    );
                }
            }
            None => {
                let ff = u64::from(p.n_ff);
                add(blk("ffn_gate"), Role::FfnGate, l, &[embd, ff], random());
                add(blk("ffn_up"), Role::FfnUp, l, &[embd, ff], random());
                add(blk("ffn_down"), Role::FfnDown, l, &[ff, embd], random());
            }
        }
    }
    add(
        "output_norm.weight".into(),
        Role::Vector,
        0,
        &[embd],
        Init::NearOne,
    );
    if !p.tied_embeddings {
        add(
            "output.weight".into(),
            Role::Output,
            0,
            &[embd, vocab],
            random(),
        );
    }
    (out, notes)
}

/// `general.*` and `{arch}.*` metadata, in the order llama.cpp's converter writes them.
pub fn arch_metadata(preset: &Preset, weights: WeightType, seed: u64) -> Vec<(String, Value)> {
    let p = preset;
    let arch = p.arch.name();
    let mut m: Vec<(String, Value)> = Vec::new();
    let mut general = |k: &str, v: Value| m.push((format!("general.{k}"), v));
    general("architecture", Value::String(arch.into()));
    general("type", Value::String("model".into()));
    general("name", Value::String(p.model_name.into()));
    general(
        "description",
        Value::String(format!(
            "Synthetic random weights, not a trained model: spillway-bench synth \
             --preset {} --type {weights} --seed {seed}",
            p.name
        )),
    );
    general("alignment", Value::U32(32));
    let mut put = |k: &str, v: Value| m.push((format!("{arch}.{k}"), v));
    put("vocab_size", Value::U32(p.n_vocab));
    put("context_length", Value::U32(p.context));
    put("embedding_length", Value::U32(p.n_embd));
    put("block_count", Value::U32(p.n_layer));
    put("feed_forward_length", Value::U32(p.n_ff));
    put("attention.head_count", Value::U32(p.n_head));
    put("attention.head_count_kv", Value::U32(p.n_head_kv));
    put("rope.freq_base", Value::F32(p.rope_base));
    put("attention.layer_norm_rms_epsilon", Value::F32(p.rms_eps));
    put("attention.key_length", Value::U32(p.head_dim));
    put("attention.value_length", Value::U32(p.head_dim));
    if p.arch == Arch::Llama {
        put("rope.dimension_count", Value::U32(p.head_dim));
    }
    if let Some(e) = p.experts {
        put("expert_count", Value::U32(e.count));
        put("expert_used_count", Value::U32(e.used));
        if matches!(p.arch, Arch::Qwen3Moe | Arch::Qwen2Moe) {
            put("expert_feed_forward_length", Value::U32(e.n_ff));
        }
        if let Some(sff) = e.shared_n_ff {
            put("expert_shared_feed_forward_length", Value::U32(sff));
        }
    }
    m.push(("general.file_type".into(), Value::U32(weights.file_type())));
    m
}

/// Parameters and data bytes of a tensor list.
pub fn totals(tensors: &[TensorPlan]) -> (u64, u64) {
    tensors.iter().fold((0, 0), |(params, bytes), t| {
        let n = t.spec.n_elements().unwrap_or(0);
        let b = t.spec.n_bytes().unwrap_or(0);
        (params + n, bytes + b)
    })
}

/// Types used and how many tensors have each, most common first (for reports).
pub fn type_counts(tensors: &[TensorPlan]) -> Vec<(GgmlType, usize)> {
    let mut counts: Vec<(GgmlType, usize)> = Vec::new();
    for t in tensors {
        match counts.iter_mut().find(|(ty, _)| *ty == t.spec.ggml_type) {
            Some((_, n)) => *n += 1,
            None => counts.push((t.spec.ggml_type, 1)),
        }
    }
    counts.sort_by_key(|c| std::cmp::Reverse(c.1));
    counts
}

#[cfg(test)]
mod tests {
    use super::super::presets::find;
    use super::*;

    fn params(name: &str) -> f64 {
        let (t, _) = tensors(find(name).unwrap(), WeightType::Uniform(GgmlType::F16));
        totals(&t).0 as f64 / 1e9
    }

    #[test]
    fn real_presets_have_their_published_parameter_counts() {
        // Published sizes (billions), embeddings counted once when tied.
        for (name, want) in [
            ("llama-3.2-1b", 1.236),
            ("llama-3-8b", 8.030),
            ("qwen3-0.6b", 0.596),
            ("qwen3-30b-a3b", 30.53),
            ("mixtral-8x7b", 46.70),
            ("qwen3-235b-a22b", 235.1),
        ] {
            let got = params(name);
            assert!((got / want - 1.0).abs() < 0.01, "{name}: {got} vs {want}");
        }
    }

    #[test]
    fn small_qwen3moe_is_a_benchmark_sized_moe() {
        // Synthetic only (no published model): its size is what its summary says.
        let got = params("small-qwen3moe");
        assert!((got / 0.8229 - 1.0).abs() < 0.01, "small-qwen3moe: {got}");
    }

    #[test]
    fn mixtral_q4_k_m_has_llama_cpp_types() {
        let (t, notes) = tensors(find("mixtral-8x7b").unwrap(), WeightType::Q4KM);
        let ty = |n: &str| t.iter().find(|t| t.spec.name == n).unwrap().spec.ggml_type;
        assert_eq!(ty("output.weight"), GgmlType::Q6K);
        assert_eq!(ty("blk.0.attn_v.weight"), GgmlType::Q8_0);
        assert_eq!(ty("blk.0.attn_output.weight"), GgmlType::Q5K);
        assert_eq!(ty("blk.0.ffn_down_exps.weight"), GgmlType::Q6K);
        assert_eq!(ty("blk.4.ffn_down_exps.weight"), GgmlType::Q4K);
        assert_eq!(ty("blk.4.ffn_gate_inp.weight"), GgmlType::F32);
        assert!(notes.is_empty());
    }
}
