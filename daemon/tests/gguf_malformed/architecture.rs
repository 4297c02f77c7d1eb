//! Malformed files of known architectures: metadata that contradicts the tensors, and missing
//! tensors. Each case starts from a tiny consistent model and breaks one thing.

use spillway_daemon::gguf::{GgufError, GgufFile};

use super::gguf_bytes::{llama_spec, model, qwen2moe_spec, qwen3moe_spec, Bytes, Kv};
use super::open;

#[test]
fn accepts_minimal_llama_file() {
    let f = open(&model(&llama_spec()).to_bytes()).unwrap();
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.metadata().get_u32("llama.block_count").unwrap(), 2);
    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.dims, [8, 10]);
    assert_eq!(f.tensor_data(embd).len(), 320);
    assert_eq!(f.data_offset() % f.alignment(), 0);
}

#[test]
fn accepts_llama_with_tied_output_embedding() {
    let mut g = model(&llama_spec());
    g.remove_tensor("output.weight");
    assert!(open(&g.to_bytes()).is_ok());
}

#[test]
fn accepts_minimal_qwen3moe_and_qwen2moe_files() {
    assert!(open(&model(&qwen3moe_spec()).to_bytes()).is_ok());
    assert!(open(&model(&qwen2moe_spec()).to_bytes()).is_ok());
}

#[test]
fn unknown_architecture_skips_consistency_checks() {
    let bytes = Bytes::new()
        .header(3, 0, 1)
        .kv_str("general.architecture", "mamba")
        .to_vec();
    assert_eq!(open(&bytes).unwrap().architecture(), Some("mamba"));
}

#[test]
fn rejects_vocab_size_differing_from_embedding_rows() {
    let mut g = model(&llama_spec());
    g.tensor_mut("token_embd.weight").dims = vec![8, 12];
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::ShapeMismatch { tensor, axis: 1, found: 12, expected: 10, key })
            if tensor == "token_embd.weight" && key == "tokenizer.ggml.tokens"
    ));
}

#[test]
fn rejects_vocab_size_differing_from_output_rows() {
    let mut g = model(&llama_spec());
    g.tensor_mut("output.weight").dims = vec![8, 9];
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::ShapeMismatch { tensor, axis: 1, found: 9, .. }) if tensor == "output.weight"
    ));
}

#[test]
fn rejects_embedding_length_differing_from_token_embd() {
    let mut g = model(&llama_spec());
    g.set("llama.embedding_length", Kv::U32(16));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::ShapeMismatch { tensor, axis: 0, found: 8, expected: 16, key })
            if tensor == "token_embd.weight" && key == "llama.embedding_length"
    ));
}

#[test]
fn rejects_bos_token_id_past_vocab() {
    let mut g = model(&llama_spec());
    g.set("tokenizer.ggml.bos_token_id", Kv::U32(10));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::TokenIdOutOfRange { key, id: 10, vocab_size: 10 })
            if key == "tokenizer.ggml.bos_token_id"
    ));
}

#[test]
fn rejects_any_special_token_id_past_vocab() {
    let mut g = model(&llama_spec());
    g.set("tokenizer.ggml.eot_token_id", Kv::U64(1 << 40));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::TokenIdOutOfRange { key, .. }) if key == "tokenizer.ggml.eot_token_id"
    ));
}

#[test]
fn rejects_scores_length_differing_from_tokens() {
    let mut g = model(&llama_spec());
    g.set("tokenizer.ggml.scores", Kv::F32s(vec![0.0; 9]));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::ArrayLengthMismatch { key, len: 9, expected: 10, .. })
            if key == "tokenizer.ggml.scores"
    ));
}

#[test]
fn rejects_token_type_length_differing_from_tokens() {
    let mut g = model(&llama_spec());
    g.set("tokenizer.ggml.token_type", Kv::I32s(vec![1; 11]));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::ArrayLengthMismatch { key, len: 11, .. }) if key == "tokenizer.ggml.token_type"
    ));
}

#[test]
fn rejects_expert_count_differing_from_exps_shape() {
    let mut g = model(&qwen3moe_spec());
    g.tensor_mut("blk.1.ffn_up_exps.weight").dims = vec![8, 16, 3];
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::ShapeMismatch { tensor, axis: 2, found: 3, expected: 4, key })
            if tensor == "blk.1.ffn_up_exps.weight" && key == "qwen3moe.expert_count"
    ));
}

#[test]
fn rejects_expert_used_count_above_expert_count() {
    let mut g = model(&qwen3moe_spec());
    g.set("qwen3moe.expert_used_count", Kv::U32(5));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::InvalidMetadataValue { key, value: 5, .. })
            if key == "qwen3moe.expert_used_count"
    ));
}

#[test]
fn rejects_moe_architecture_without_expert_count() {
    let mut g = model(&qwen3moe_spec());
    g.remove_kv("qwen3moe.expert_count");
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::MissingKey { key }) if key == "qwen3moe.expert_count"
    ));
}

#[test]
fn rejects_missing_attn_q_in_block_1() {
    let mut g = model(&llama_spec());
    g.remove_tensor("blk.1.attn_q.weight");
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::MissingTensor { arch, tensor })
            if arch == "llama" && tensor == "blk.1.attn_q.weight"
    ));
}

#[test]
fn rejects_missing_token_embd() {
    let mut g = model(&llama_spec());
    g.remove_tensor("token_embd.weight");
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::MissingTensor { tensor, .. }) if tensor == "token_embd.weight"
    ));
}

#[test]
fn rejects_missing_shared_expert_in_qwen2moe() {
    let mut g = model(&qwen2moe_spec());
    g.remove_tensor("blk.0.ffn_down_shexp.weight");
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::MissingTensor { tensor, .. }) if tensor == "blk.0.ffn_down_shexp.weight"
    ));
}

#[test]
fn rejects_block_count_larger_than_tensors_present() {
    let mut g = model(&llama_spec());
    g.set("llama.block_count", Kv::U32(3));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::MissingTensor { tensor, .. }) if tensor == "blk.2.attn_norm.weight"
    ));
}

#[test]
fn rejects_huge_block_count_quickly() {
    let mut g = model(&llama_spec());
    g.set("llama.block_count", Kv::U64(u64::MAX));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::MissingTensor { .. })
    ));
}

#[test]
fn rejects_tensor_beyond_block_count() {
    let mut g = model(&llama_spec());
    g.set("llama.block_count", Kv::U32(1));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::TensorBeyondBlockCount { tensor, block_count: 1 }) if tensor == "blk.1.attn_norm.weight"
    ));
}

#[test]
fn rejects_head_count_kv_contradicting_attn_k() {
    let mut g = model(&llama_spec());
    g.set("llama.attention.head_count_kv", Kv::U32(2));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::ShapeMismatch { tensor, axis: 1, found: 4, expected: 8, key })
            if tensor == "blk.0.attn_k.weight" && key == "llama.attention.head_count_kv"
    ));
}

#[test]
fn rejects_head_count_kv_not_dividing_head_count() {
    let mut g = model(&llama_spec());
    g.set("llama.attention.head_count", Kv::U32(4))
        .set("llama.attention.head_count_kv", Kv::U32(3));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::InvalidMetadataValue { key, value: 3, .. })
            if key == "llama.attention.head_count_kv"
    ));
}

#[test]
fn rejects_block_count_of_wrong_type() {
    let mut g = model(&llama_spec());
    g.set("llama.block_count", Kv::Str("2".into()));
    assert!(matches!(
        open(&g.to_bytes()),
        Err(GgufError::WrongType { key, found: "string", .. }) if key == "llama.block_count"
    ));
}

#[test]
fn structure_only_open_skips_architecture_checks() {
    let mut g = model(&llama_spec());
    g.remove_tensor("blk.1.attn_q.weight");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("model.gguf");
    std::fs::write(&path, g.to_bytes()).unwrap();
    let f = GgufFile::open_structure_only(&path).unwrap();
    assert!(f.tensor("blk.1.attn_q.weight").is_none());
}
