//! Hyper-parameters from metadata; the full models are checked against llama.cpp in
//! `bench/tests/engine_llama_cpp.rs`.

use crate::gguf::{Metadata, Value};

use super::{Arch, Config, ModelError, RopeLayout};

fn metadata(arch: &str, extra: &[(&str, Value)]) -> Metadata {
    let mut md = Metadata::new();
    md.insert("general.architecture", Value::String(arch.into()))
        .unwrap();
    let mut put = |k: &str, v: Value| md.insert(format!("{arch}.{k}"), v).unwrap();
    put("embedding_length", Value::U32(256));
    put("block_count", Value::U32(2));
    put("attention.head_count", Value::U32(8));
    put("attention.layer_norm_rms_epsilon", Value::F32(1e-6));
    for (k, v) in extra {
        put(k, v.clone());
    }
    md
}

#[test]
fn defaults_follow_llama_cpp() {
    let c = Config::from_metadata(&metadata("llama", &[]), 1000).unwrap();
    assert_eq!((c.n_head_kv, c.head_dim, c.n_rot), (8, 32, 32));
    assert_eq!(c.rope_layout, RopeLayout::Normal);
    assert_eq!(c.rope_freq_base, 10_000.0);
    assert!(c.moe.is_none());
    let q = Config::from_metadata(
        &metadata("qwen3", &[("attention.key_length", Value::U32(128))]),
        10,
    )
    .unwrap();
    assert_eq!(
        (q.head_dim, q.q_width(), q.rope_layout),
        (128, 1024, RopeLayout::Neox)
    );
}

#[test]
fn expert_weights_are_renormalised_except_for_qwen2moe() {
    let moe = [
        ("expert_count", Value::U32(8)),
        ("expert_used_count", Value::U32(2)),
        ("expert_feed_forward_length", Value::U32(64)),
    ];
    for (arch, norm) in [("llama", true), ("qwen3moe", true), ("qwen2moe", false)] {
        let c = Config::from_metadata(&metadata(arch, &moe), 10).unwrap();
        let m = c.moe.unwrap();
        assert_eq!((m.n_expert, m.n_expert_used, m.n_ff_expert), (8, 2, 64));
        assert_eq!(m.norm_weights, norm, "{arch}");
    }
    assert!(matches!(
        Config::from_metadata(&metadata("qwen3moe", &[]), 10),
        Err(ModelError::Inconsistent(_))
    ));
    assert_eq!(Arch::from_name("qwen2moe"), Some(Arch::Qwen2Moe));
}

#[test]
fn impossible_shapes_are_refused() {
    let bad_gqa = metadata("llama", &[("attention.head_count_kv", Value::U32(3))]);
    assert!(matches!(
        Config::from_metadata(&bad_gqa, 10),
        Err(ModelError::Inconsistent(_))
    ));
    let mut md = metadata("gpt2", &[]);
    md.insert("x", Value::U32(0)).unwrap();
    assert!(matches!(
        Config::from_metadata(&md, 10),
        Err(ModelError::UnsupportedArchitecture(a)) if a == "gpt2"
    ));
}
