//! The CPU engine's per-layer profile on synthetic models: its op groups follow one another
//! through the step, in each layer's order, and the weight bytes it reports are the sizes of the
//! matrices in the file.

use std::path::Path;
use std::sync::Arc;

use spillway_daemon::engine::profile::OpRecord;
use spillway_daemon::engine::{argmax, Engine, EngineOptions, OpGroup, StepProfile};
use spillway_daemon::model::Model;
use spillway_daemon::synth::{SynthModel, WeightType};

fn model(dir: &Path, preset: &str) -> Arc<Model> {
    let path = dir.join(format!("{preset}.gguf"));
    SynthModel::from_name(preset, WeightType::Q4KM, 3)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    Arc::new(Model::open(&path).unwrap())
}

fn engine(model: &Arc<Model>) -> Engine {
    Engine::new(
        model.clone(),
        &EngineOptions {
            threads: 2,
            context: 64,
        },
    )
}

/// A prompt of `prompt` tokens, then `steps` greedy decode steps, each profiled.
fn profile(engine: &mut Engine, prompt: usize, steps: usize) -> Vec<StepProfile> {
    let tokens: Vec<u32> = (0..prompt as u32).map(|i| (i * 37 + 5) % 200).collect();
    let mut out = Vec::new();
    let mut p = StepProfile::default();
    let mut next = argmax(
        engine
            .eval_batch_with(&tokens, false, Some(&mut p))
            .unwrap(),
    ) as u32;
    out.push(p);
    for _ in 0..steps {
        let mut p = StepProfile::default();
        next = argmax(
            engine
                .eval_batch_with(&[next], false, Some(&mut p))
                .unwrap(),
        ) as u32;
        out.push(p);
    }
    out
}

fn groups_of_layer(step: &StepProfile, layer: usize) -> Vec<OpGroup> {
    step.ops
        .iter()
        .filter(|o| o.layer == Some(layer))
        .map(|o| o.op)
        .collect()
}

#[test]
fn op_groups_follow_one_another_inside_the_step() {
    let dir = tempfile::tempdir().unwrap();
    for preset in ["tiny-qwen3moe", "tiny-qwen2moe", "tiny-llama"] {
        let m = model(dir.path(), preset);
        let mut e = engine(&m);
        let steps = profile(&mut e, 9, 4);
        for s in &steps {
            assert_eq!(s.ops.first().map(|o| o.op), Some(OpGroup::Embedding));
            assert_eq!(s.ops.last().map(|o| o.op), Some(OpGroup::OutputHead));
            for l in 0..m.config.n_layer {
                let want: &[OpGroup] = match (m.config.moe.is_some(), preset) {
                    (false, _) => &[
                        OpGroup::Qkv,
                        OpGroup::RopeCache,
                        OpGroup::Attention,
                        OpGroup::AttnOutput,
                        OpGroup::Ffn,
                    ],
                    (true, "tiny-qwen2moe") => &[
                        OpGroup::Qkv,
                        OpGroup::RopeCache,
                        OpGroup::Attention,
                        OpGroup::AttnOutput,
                        OpGroup::Router,
                        OpGroup::Experts,
                        OpGroup::SharedExpert,
                    ],
                    (true, _) => &[
                        OpGroup::Qkv,
                        OpGroup::RopeCache,
                        OpGroup::Attention,
                        OpGroup::AttnOutput,
                        OpGroup::Router,
                        OpGroup::Experts,
                    ],
                };
                assert_eq!(groups_of_layer(s, l), want, "{preset} layer {l}");
            }
            // Laps: each record starts where the previous one ended, inside the step.
            for w in s.ops.windows(2) {
                assert_eq!(w[1].start, w[0].start + w[0].duration, "{preset}");
            }
            let last = s.ops.last().unwrap();
            assert!(last.start + last.duration <= s.duration, "{preset}");
        }
        // The laps are contiguous (above), so they cover the step from its embedding to its
        // output head; what lies outside them (the step's own bookkeeping) is a matter of
        // timing, which a test does not judge: only that the laps fit inside the steps.
        let total: f64 = steps.iter().map(|s| s.duration.as_secs_f64()).sum();
        let ops: f64 = steps.iter().map(|s| s.ops_duration().as_secs_f64()).sum();
        assert!(
            ops <= total,
            "{preset}: op groups {ops:.6} s of the steps' {total:.6} s"
        );
    }
}

/// Bytes of a tensor in the file, divided by `parts` (the experts of a stack).
fn file_bytes(m: &Model, name: &str, parts: u64) -> u64 {
    let t = m.file().tensor(name).unwrap_or_else(|| panic!("{name}"));
    assert_eq!(t.n_bytes % parts, 0);
    t.n_bytes / parts
}

fn record(step: &StepProfile, layer: Option<usize>, op: OpGroup) -> &OpRecord {
    step.ops
        .iter()
        .find(|o| o.layer == layer && o.op == op)
        .unwrap_or_else(|| panic!("{layer:?} {op:?}"))
}

#[test]
fn reported_weight_bytes_are_the_sizes_of_the_matrices_in_the_file() {
    let dir = tempfile::tempdir().unwrap();
    for preset in ["tiny-qwen2moe", "tiny-llama"] {
        let m = model(dir.path(), preset);
        let mut e = engine(&m);
        let steps = profile(&mut e, 5, 2);
        let vocab = m.config.n_vocab as u64;
        let head = if m.file().tensor("output.weight").is_some() {
            file_bytes(&m, "output.weight", 1)
        } else {
            file_bytes(&m, "token_embd.weight", 1)
        };
        for s in &steps {
            let emb = file_bytes(&m, "token_embd.weight", vocab) * s.tokens as u64;
            assert_eq!(record(s, None, OpGroup::Embedding).weight_bytes, emb);
            assert_eq!(record(s, None, OpGroup::OutputHead).weight_bytes, head);
            for l in 0..m.config.n_layer {
                let b = |t: &str| file_bytes(&m, &format!("blk.{l}.{t}.weight"), 1);
                let qkv = b("attn_q") + b("attn_k") + b("attn_v");
                assert_eq!(record(s, Some(l), OpGroup::Qkv).weight_bytes, qkv);
                assert_eq!(
                    record(s, Some(l), OpGroup::AttnOutput).weight_bytes,
                    b("attn_output")
                );
                assert_eq!(record(s, Some(l), OpGroup::Attention).weight_bytes, 0);
                let Some(moe) = m.config.moe else {
                    let ffn = b("ffn_gate") + b("ffn_up") + b("ffn_down");
                    assert_eq!(record(s, Some(l), OpGroup::Ffn).weight_bytes, ffn);
                    continue;
                };
                assert_eq!(
                    record(s, Some(l), OpGroup::Router).weight_bytes,
                    b("ffn_gate_inp")
                );
                let x = moe.n_expert as u64;
                let per_expert: u64 = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
                    .iter()
                    .map(|t| file_bytes(&m, &format!("blk.{l}.{t}.weight"), x))
                    .sum();
                let ex = record(s, Some(l), OpGroup::Experts);
                // A step of n tokens runs between k and n·k distinct experts.
                let k = moe.n_expert_used;
                assert!(
                    ex.experts.len() >= k && ex.experts.len() <= (s.tokens * k).min(moe.n_expert),
                    "{:?}",
                    ex.experts
                );
                assert!(ex.experts.windows(2).all(|w| w[0] < w[1]));
                assert!(ex.experts.iter().all(|&x| (x as usize) < moe.n_expert));
                assert_eq!(ex.weight_bytes, per_expert * ex.experts.len() as u64);
                let shared = b("ffn_gate_inp_shexp")
                    + b("ffn_gate_shexp")
                    + b("ffn_up_shexp")
                    + b("ffn_down_shexp");
                assert_eq!(
                    record(s, Some(l), OpGroup::SharedExpert).weight_bytes,
                    shared
                );
            }
        }
    }
}

#[test]
fn profiling_does_not_change_the_logits() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path(), "tiny-qwen3moe");
    let (mut a, mut b) = (engine(&m), engine(&m));
    let tokens = [3, 1, 4, 1, 5];
    let plain = a.eval_batch(&tokens, true).unwrap().to_vec();
    let mut p = StepProfile::default();
    let profiled = b.eval_batch_with(&tokens, true, Some(&mut p)).unwrap();
    assert_eq!(plain, profiled);
}
