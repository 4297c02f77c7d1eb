//! Synthetic models as the daemon sees them: every tiny preset in every weight type opens with
//! the validating reader, matches its plan, and dequantizes to sane weights; the same seed gives
//! the same bytes; sparse files keep their shapes.

use std::path::Path;

use spillway_bench::synth::{presets, SynthModel, WeightType, PRESETS};
use spillway_daemon::gguf::{GgmlType, GgufFile};
use spillway_daemon::quant::dequantize_row;

fn write(model: &SynthModel, path: &Path, sparse: bool) -> GgufFile {
    let size = model.write(path, sparse, |_, _| {}).unwrap();
    assert_eq!(std::fs::metadata(path).unwrap().len(), size);
    GgufFile::open(path).unwrap_or_else(|e| panic!("{} {}: {e}", model.preset.name, model.weights))
}

fn tiny() -> impl Iterator<Item = &'static presets::Preset> {
    PRESETS.iter().filter(|p| p.is_tiny())
}

/// Mean and standard deviation of a tensor, when the daemon can dequantize its type.
fn stats(file: &GgufFile, name: &str) -> Option<(f64, f64)> {
    let t = file.tensor(name)?;
    let mut out = vec![0f32; t.n_elements as usize];
    dequantize_row(t.ggml_type, file.tensor_data(t), &mut out).ok()?;
    assert!(out.iter().all(|v| v.is_finite()), "{name}");
    let n = out.len() as f64;
    let mean = out.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = out
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    Some((mean, var.sqrt()))
}

#[test]
fn every_tiny_preset_in_every_type_opens_and_matches_its_plan() {
    let dir = tempfile::tempdir().unwrap();
    for preset in tiny() {
        for weights in WeightType::all() {
            let model = SynthModel::new(preset, weights, 1).unwrap();
            let path = dir.path().join(format!("{}-{weights}.gguf", preset.name));
            let file = write(&model, &path, false);
            let ctx = format!("{} {weights}", preset.name);

            assert_eq!(file.architecture(), Some(preset.arch.name()), "{ctx}");
            let md = file.metadata();
            assert_eq!(
                md.get_u32("general.file_type").unwrap(),
                weights.file_type(),
                "{ctx}"
            );
            let tokens = md.get_string_array("tokenizer.ggml.tokens").unwrap();
            let embd = file.tensor("token_embd.weight").unwrap();
            assert_eq!(tokens.len() as u64, embd.dims[1], "{ctx}");
            assert_eq!(embd.dims[0], u64::from(preset.n_embd), "{ctx}");
            assert_eq!(file.tensors().len(), model.tensors.len(), "{ctx}");
            for (t, plan) in file.tensors().iter().zip(&model.tensors) {
                assert_eq!(t.name, plan.spec.name, "{ctx}");
                assert_eq!(t.ggml_type, plan.spec.ggml_type, "{ctx}");
                assert_eq!(t.dims, plan.spec.dims, "{ctx}");
            }
            // Norms stay F32 whatever the type.
            let norm = file.tensor("output_norm.weight").unwrap();
            assert_eq!(norm.ggml_type, GgmlType::F32, "{ctx}");
            let (mean, _) = stats(&file, "output_norm.weight").unwrap();
            assert!((mean - 1.0).abs() < 0.01, "{ctx}: norm mean {mean}");
            // Weights dequantize (with the daemon's own kernels) to mean 0, std 0.02.
            if let Some((mean, std)) = stats(&file, "blk.0.attn_q.weight") {
                assert!(mean.abs() < 0.002, "{ctx}: mean {mean}");
                assert!((std / 0.02 - 1.0).abs() < 0.1, "{ctx}: std {std}");
            }
        }
    }
}

#[test]
fn same_seed_gives_the_same_file_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = |seed: u64, name: &str| {
        let model = SynthModel::from_name("tiny-mixtral", WeightType::Q4KM, seed).unwrap();
        let path = dir.path().join(name);
        model.write(&path, false, |_, _| {}).unwrap();
        std::fs::read(path).unwrap()
    };
    let a = bytes(7, "a.gguf");
    assert_eq!(a, bytes(7, "b.gguf"));
    assert_ne!(a, bytes(8, "c.gguf"));
}

#[test]
fn sparse_files_keep_shapes_and_leave_matrices_zero() {
    let dir = tempfile::tempdir().unwrap();
    let model = SynthModel::from_name("tiny-llama", WeightType::Q4KM, 3).unwrap();
    let dense = write(&model, &dir.path().join("dense.gguf"), false);
    let sparse = write(&model, &dir.path().join("sparse.gguf"), true);
    assert_eq!(dense.file_size(), sparse.file_size());
    for (d, s) in dense.tensors().iter().zip(sparse.tensors()) {
        assert_eq!(d, s);
        if s.dims.len() >= 2 {
            assert!(sparse.tensor_data(s).iter().all(|&b| b == 0), "{}", s.name);
        } else {
            assert_eq!(dense.tensor_data(d), sparse.tensor_data(s), "{}", s.name);
        }
    }
}

#[test]
fn real_size_llama_3_2_1b_sparse_opens_with_real_vocabulary() {
    let dir = tempfile::tempdir().unwrap();
    let model =
        SynthModel::from_name("llama-3.2-1b", WeightType::Uniform(GgmlType::Q4_0), 0).unwrap();
    let file = write(&model, &dir.path().join("l.gguf"), true);
    let md = file.metadata();
    assert_eq!(
        md.get_string_array("tokenizer.ggml.tokens").unwrap().len(),
        128_256
    );
    assert_eq!(md.get_u32("tokenizer.ggml.eos_token_id").unwrap(), 128_009);
    assert_eq!(file.tensor("rope_freqs.weight").unwrap().dims, [32]);
    assert!(file.tensor("output.weight").is_none());
}

/// Every real-size preset, sparse. Apparent sizes reach 130 GiB (a few MB on disk), so this
/// needs a file system with sparse files: `cargo test -p spillway-bench -- --ignored`.
#[test]
#[ignore]
fn every_real_size_preset_sparse_opens() {
    let dir = tempfile::tempdir().unwrap();
    for preset in PRESETS.iter().filter(|p| !p.is_tiny()) {
        let model = SynthModel::new(preset, WeightType::Q4KM, 0).unwrap();
        let path = dir.path().join(format!("{}.gguf", preset.name));
        let file = write(&model, &path, true);
        assert_eq!(file.tensors().len(), model.tensors.len());
        std::fs::remove_file(path).unwrap();
    }
}
