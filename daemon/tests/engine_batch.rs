//! Continuous batching changes speed, not results: sequences decoded together in one forward
//! pass per step, joining and leaving at different times, get exactly the logits each gets
//! alone on an `Engine`.

use std::sync::Arc;

use spillway_daemon::engine::{argmax, BatchEngine, Engine, EngineOptions};
use spillway_daemon::gguf::GgmlType;
use spillway_daemon::model::Model;
use spillway_daemon::synth::{SynthModel, WeightType};

const STEPS: usize = 6;

fn model(preset: &str, dir: &std::path::Path) -> Arc<Model> {
    let path = dir.join(format!("{preset}.gguf"));
    SynthModel::from_name(preset, WeightType::Uniform(GgmlType::Q8_0), 3)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    Arc::new(Model::open(&path).unwrap())
}

/// Greedy decoding of `prompt` alone: the logits after the prompt and after each token.
fn alone(model: &Arc<Model>, prompt: &[u32]) -> Vec<Vec<f32>> {
    let mut engine = Engine::new(model.clone(), &options());
    let mut logits = engine.eval_batch(prompt, false).unwrap().to_vec();
    let mut out = vec![logits.clone()];
    for _ in 0..STEPS {
        let next = argmax(&logits) as u32;
        logits = engine.eval(next).unwrap().to_vec();
        out.push(logits.clone());
    }
    out
}

fn options() -> EngineOptions {
    EngineOptions {
        threads: 2,
        context: 64,
    }
}

fn check(preset: &str) {
    let dir = tempfile::tempdir().unwrap();
    let model = model(preset, dir.path());
    let n_vocab = model.config.n_vocab;
    let prompts: [&[u32]; 3] = [&[1, 2, 3], &[7, 8, 9, 10, 11], &[42]];
    let want: Vec<Vec<Vec<f32>>> = prompts.iter().map(|p| alone(&model, p)).collect();

    let mut batch = BatchEngine::new(model.clone(), &options(), 3);
    let mut got: Vec<Vec<Vec<f32>>> = vec![Vec::new(); 3];
    // Sequence 2 joins two steps late, as a request arriving mid-generation would.
    let join = [0, 0, 2];
    let mut step = 0;
    while got.iter().any(|g| g.len() < STEPS + 1) {
        for (seq, p) in prompts.iter().enumerate() {
            if join[seq] == step {
                got[seq].push(batch.eval_sequence(seq, p, false).unwrap());
            }
        }
        let inputs: Vec<(usize, u32)> = (0..3)
            .filter(|&s| !got[s].is_empty() && got[s].len() < STEPS + 1)
            .map(|s| (s, argmax(got[s].last().unwrap()) as u32))
            .collect();
        let logits = batch.step(&inputs).unwrap();
        assert_eq!(logits.len(), inputs.len() * n_vocab);
        for (&(seq, _), l) in inputs.iter().zip(logits.chunks_exact(n_vocab)) {
            got[seq].push(l.to_vec());
        }
        step += 1;
    }
    for seq in 0..3 {
        assert_eq!(got[seq].len(), want[seq].len());
        for (i, (g, w)) in got[seq].iter().zip(&want[seq]).enumerate() {
            assert!(
                g == w,
                "{preset}: sequence {seq}, step {i}: batched logits differ"
            );
        }
        assert_eq!(batch.position(seq), prompts[seq].len() + STEPS);
    }
}

#[test]
fn batched_moe_sequences_equal_sequences_run_alone() {
    check("tiny-qwen3moe");
}

#[test]
fn batched_shared_expert_moe_sequences_equal_sequences_run_alone() {
    check("tiny-qwen2moe");
}

#[test]
fn batched_dense_sequences_equal_sequences_run_alone() {
    check("tiny-llama");
}
