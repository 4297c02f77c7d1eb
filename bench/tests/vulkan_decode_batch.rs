//! Decode steps of several sequences at once (`GpuModel::eval_batch`, continuous batching on the
//! GPU) against each sequence alone on a model of its own (`GpuModel::eval`, itself checked
//! against the CPU engine in `vulkan_forward.rs`): sequences at different positions, steps that
//! take some of them in another order, a sequence forgotten and started again beside the others
//! (its cache rows are its own), prompts into a selected sequence, dense and MoE models (routed
//! on the device, on the host, and with misses read over the bus), and the checks that refuse a
//! step before anything moves. On whatever Vulkan device the machine has (lavapipe in CI);
//! without one these tests skip, unless `SPILLWAY_REQUIRE_VULKAN` is set.

#[path = "../../daemon/tests/common/logits.rs"]
mod logits;
use logits::assert_logits_close;
#[path = "common/pcie_budget.rs"]
mod pcie_budget;
use pcie_budget::partial_pcie;

use std::sync::Arc;

use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions, StepBatching};
use spillway_daemon::gpu::placement::MoeMiss;
use spillway_daemon::gpu::Device;
use spillway_daemon::model::Model;

fn device() -> Option<Arc<Device>> {
    spillway_daemon::gpu::device_or_skip()
}

/// The batched step multiplies in the prompts' tiled products (their sums in another order, the
/// activations in f16 where the device has cooperative matrices); a token at the wrong position
/// or reading another sequence's rows moves the logits by their whole range.
const TOLERANCE: f32 = 0.01;

fn synth_model(preset: &str, weights: &str) -> Arc<Model> {
    synth_model_in(tempfile::tempdir().unwrap().path(), preset, weights)
}

/// [`synth_model`] written into `dir`, which a model that reads its file again (a RAM tier)
/// keeps while it runs.
fn synth_model_in(dir: &std::path::Path, preset: &str, weights: &str) -> Arc<Model> {
    let path = dir.join("m.gguf");
    SynthModel::from_name(preset, weights.parse::<WeightType>().unwrap(), 5)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    Arc::new(Model::open(&path).unwrap())
}

fn token(seq: usize, i: usize, n_vocab: usize) -> u32 {
    ((seq as u64 * 7919 + i as u64 * 2_654_435_761 + 17) % n_vocab as u64) as u32
}

/// Options of the models compared: f32 dots in the one-token steps, as the chunks' products
/// take (integer dots quantize a step's inputs, a difference checked in `vulkan_forward.rs`);
/// steps of several sequences batched wherever the model can (not by measured cost). Three runs
/// of the attention's 128 positions: a step launches only those up to its tokens' positions.
fn options(sequences: usize) -> GpuModelOptions {
    GpuModelOptions {
        context: 300,
        int_dot: false,
        sequences,
        step_batching: StepBatching::Always,
        ..GpuModelOptions::default()
    }
}

/// Three sequences on `gpu`, each beside a model of its own: prompts of different lengths,
/// steps of all three and of two (in another order), one forgotten and started again.
fn check_against_alone(dev: &Arc<Device>, model: &Arc<Model>, gpu: &mut GpuModel, what: &str) {
    let n_vocab = gpu.config().n_vocab;
    let mut alone: Vec<GpuModel> = (0..3)
        .map(|_| GpuModel::new(dev, model, &options(1)).unwrap())
        .collect();
    assert_eq!(gpu.sequences(), 3, "{what}");
    // Prompts of 5, 140 and 1 tokens, each into its selected sequence: steps whose tokens take
    // one run of positions and two.
    for (seq, n) in [(0, 5), (1, 140), (2, 1)] {
        let prompt: Vec<u32> = (0..n).map(|i| token(seq, i, n_vocab)).collect();
        gpu.select(seq);
        let got = gpu.eval_prompt(&prompt, false).unwrap();
        let want = alone[seq].eval_prompt(&prompt, false).unwrap();
        assert_logits_close(&got, &want, TOLERANCE, &format!("{what}: prompt {seq}"));
    }
    let mut next = [5, 140, 1];
    let steps: [&[usize]; 5] = [&[0, 1, 2], &[2, 0], &[1, 2, 0], &[0, 1, 2], &[1]];
    for (step, seqs) in steps.iter().enumerate() {
        if step == 3 {
            // Sequence 1 forgotten and started again while the others go on.
            gpu.select(1);
            gpu.reset();
            alone[1].reset();
            next[1] = 0;
        }
        let inputs: Vec<(usize, u32)> = seqs
            .iter()
            .map(|&s| (s, token(s, next[s] + 100, n_vocab)))
            .collect();
        let got = gpu.eval_batch(&inputs).unwrap();
        assert_eq!(got.len(), inputs.len() * n_vocab, "{what}");
        for (i, &(s, t)) in inputs.iter().enumerate() {
            let want = alone[s].eval(t).unwrap();
            let g = &got[i * n_vocab..(i + 1) * n_vocab];
            assert_logits_close(
                g,
                &want,
                TOLERANCE,
                &format!("{what}: step {step}, seq {s}"),
            );
            next[s] += 1;
            assert_eq!(gpu.position_of(s), alone[s].position(), "{what}: seq {s}");
        }
    }
    // A decode step of the selected sequence alone, after the batches: its cache holds them.
    gpu.select(2);
    let t = token(2, 999, n_vocab);
    let got = gpu.eval(t).unwrap();
    let want = alone[2].eval(t).unwrap();
    assert_logits_close(&got, &want, TOLERANCE, &format!("{what}: a step after"));
}

fn check(preset: &str, weights: &str) {
    let Some(dev) = device() else { return };
    let model = synth_model(preset, weights);
    let mut gpu = GpuModel::new(&dev, &model, &options(3)).unwrap();
    check_against_alone(&dev, &model, &mut gpu, &format!("{preset} {weights}"));
    // The steps of several sequences went in one pass each, not a step per sequence.
    assert_eq!(gpu.batched_steps(), 4, "{preset} {weights}");
}

/// A batched step that is one submission (a dense model, MoE layers routed on the device) is
/// recorded once per count of sequences and replayed: the same logits, bit for bit, and the
/// same experts counted, as recording every step anew (`replay: false`).
fn check_replayed(preset: &str, weights: &str) {
    let Some(dev) = device() else { return };
    let model = synth_model(preset, weights);
    let mut replayed = GpuModel::new(&dev, &model, &options(3)).unwrap();
    let recorded = GpuModelOptions {
        replay: false,
        ..options(3)
    };
    let mut recorded = GpuModel::new(&dev, &model, &recorded).unwrap();
    let n_vocab = model.config.n_vocab;
    for gpu in [&mut replayed, &mut recorded] {
        for (seq, n) in [(0, 4), (1, 9), (2, 2)] {
            let prompt: Vec<u32> = (0..n).map(|i| token(seq, i, n_vocab)).collect();
            gpu.select(seq);
            gpu.eval_prompt(&prompt, false).unwrap();
        }
    }
    let steps: [&[usize]; 5] = [&[0, 1, 2], &[2, 0], &[1, 2, 0], &[0, 2], &[2, 1, 0]];
    for (i, seqs) in steps.iter().enumerate() {
        let inputs: Vec<(usize, u32)> = seqs
            .iter()
            .map(|&s| (s, token(s, 50 + i, n_vocab)))
            .collect();
        let got = replayed.eval_batch(&inputs).unwrap();
        let want = recorded.eval_batch(&inputs).unwrap();
        assert_eq!(got, want, "{preset} {weights}: step {i}");
    }
    assert_eq!(replayed.replayed_batches(), 5, "{preset} {weights}");
    assert_eq!(recorded.replayed_batches(), 0, "{preset} {weights}");
    assert_eq!(
        replayed.expert_stats().map(|e| e.layers),
        recorded.expert_stats().map(|e| e.layers),
        "{preset} {weights}"
    );
}

#[test]
fn replayed_batched_steps_equal_recorded_ones_tiny_llama() {
    check_replayed("tiny-llama", "Q4_0");
}

#[test]
fn replayed_batched_steps_equal_recorded_ones_tiny_qwen3moe() {
    check_replayed("tiny-qwen3moe", "Q8_0");
}

#[test]
fn batched_steps_match_each_sequence_alone_tiny_llama_q4_0() {
    check("tiny-llama", "Q4_0");
}

#[test]
fn batched_steps_match_each_sequence_alone_tiny_qwen3_q8_0() {
    check("tiny-qwen3", "Q8_0");
}

#[test]
fn batched_steps_match_each_sequence_alone_tiny_qwen3moe_q4_0() {
    check("tiny-qwen3moe", "Q4_0");
}

/// Qwen2-MoE's shared expert: its MoE layers are routed on the host, a submission each.
#[test]
fn batched_steps_match_each_sequence_alone_tiny_qwen2moe_q8_0() {
    check("tiny-qwen2moe", "Q8_0");
}

/// Under a VRAM budget with misses read from system RAM, a batched step is still one pass: its
/// missing experts are read over the bus once for every sequence's tokens.
#[test]
fn batched_steps_over_the_vram_budget_read_misses_over_the_bus() {
    let Some(dev) = device() else { return };
    let model = synth_model("tiny-qwen3moe", "Q4_0");
    let pcie = GpuModelOptions {
        moe_miss: MoeMiss::Pcie,
        ..options(3)
    };
    let options = partial_pcie(&dev, &model, &pcie);
    let mut gpu = GpuModel::new(&dev, &model, &options).unwrap();
    if !gpu.placement().is_partial() {
        let budget = options.vram_budget.unwrap();
        eprintln!("the whole model fits {budget} bytes on this device");
        return;
    }
    assert_eq!(gpu.sequences(), 3);
    check_against_alone(&dev, &model, &mut gpu, "tiny-qwen3moe over the budget");
    assert_eq!(gpu.batched_steps(), 4);
    let t = gpu.expert_stats().unwrap().total();
    assert!(t.pcie > 0 && t.pcie == t.misses, "{t:?}");
}

/// Under a VRAM budget with misses on the CPU, a batched step is still one pass on the GPU: at
/// each MoE layer the CPU runs the missing experts, each once over every sequence's tokens that
/// chose it, and the GPU adds their sums after the resident ones.
#[test]
fn batched_steps_over_the_vram_budget_run_misses_on_the_cpu() {
    let Some(dev) = device() else { return };
    // Kept on disk: the RAM tier reads the experts from the file.
    let dir = tempfile::tempdir().unwrap();
    let model = synth_model_in(dir.path(), "tiny-qwen3moe", "Q4_0");
    // One slot for a prompt's missing experts: the budget then holds a chunk's memory even
    // where the tiny model's experts take less.
    let cpu = GpuModelOptions {
        moe_miss: MoeMiss::Cpu,
        prompt_expert_slots: 1,
        ..options(3)
    };
    // The smallest budget, in steps of half a slot a layer from the minimum, at which the
    // model keeps three sequences and batches their steps (a chunk's memory) with some experts
    // outside VRAM.
    let minimum = GpuModel::minimum_budget(&dev, &model, &cpu).unwrap();
    let step = (minimum.one_slot_per_layer / 2).max(1);
    let batches = |o: &GpuModelOptions| {
        let mut probe = GpuModel::new(&dev, &model, o).ok()?;
        if !probe.placement().is_partial() {
            return Some(false);
        }
        probe.eval_batch(&[(0, 1), (1, 2), (2, 3)]).ok()?;
        (probe.sequences() == 3 && probe.batched_steps() == 1).then_some(true)
    };
    let found = (0..512)
        .map(|i| GpuModelOptions {
            vram_budget: Some(minimum.total() + i * step),
            ..cpu.clone()
        })
        .find_map(|o| batches(&o).map(|partial| (o, partial)))
        .expect("a budget at which three sequences' steps batch");
    assert!(found.1, "steps batch only with every expert in VRAM");
    // The experts read through the memory map, then through the smallest RAM tier, which pins
    // a token's experts at a time; each step a chain of command buffers (the default: its parts
    // recorded once for each count of tokens and kept), and through the mmap also a chain
    // recorded for every step and a submission per MoE layer.
    let min_ram = spillway_daemon::stream::minimum_ram_budget(&model);
    let ways = [
        (None, true, true),
        (Some(min_ram), true, true),
        (None, true, false),
        (None, false, true),
    ];
    for (ram_budget, chain, replay) in ways {
        let o = GpuModelOptions {
            ram_budget,
            chain,
            replay,
            ..found.0.clone()
        };
        let what = format!(
            "tiny-qwen3moe, misses on the CPU, RAM {ram_budget:?}, chain {chain}, kept {replay}"
        );
        let mut gpu = GpuModel::new(&dev, &model, &o).unwrap();
        let before = gpu.expert_stats().unwrap().total();
        check_against_alone(&dev, &model, &mut gpu, &what);
        assert_eq!(gpu.batched_steps(), 4, "{what}");
        let chained = if chain { 4 } else { 0 };
        assert_eq!(gpu.chained_batches(), chained, "{what}");
        let t = gpu.expert_stats().unwrap().total();
        // Prompts stream their misses through slots; decode steps run them on the CPU.
        assert!(t.cpu > before.cpu, "{what}: {t:?}");
        assert_eq!(t.cpu + t.fetched, t.misses, "{what}: {t:?}");
    }

    // Prompts at that budget, in chunks with their misses on the CPU (streamed through slots
    // where the placement has them, twice for each size, then on the CPU twice, then whichever
    // measured cheaper): the logits the unconstrained model's.
    let mut gpu = GpuModel::new(&dev, &model, &found.0).unwrap();
    assert!(gpu.placement().is_partial());
    let mut alone = GpuModel::new(&dev, &model, &options(1)).unwrap();
    let n_vocab = model.config.n_vocab;
    for i in 0..5 {
        let prompt: Vec<u32> = (0..12).map(|j| token(i, j, n_vocab)).collect();
        gpu.reset();
        alone.reset();
        let got = gpu.eval_prompt(&prompt, true).unwrap();
        let want = alone.eval_prompt(&prompt, true).unwrap();
        assert_logits_close(
            &got,
            &want,
            TOLERANCE,
            &format!("prompt {i} over the budget"),
        );
    }
    assert!(gpu.cpu_prompt_chunks() >= 2, "{}", gpu.cpu_prompt_chunks());
    // (As a batched step's chain, where steps are chains.)
    assert_eq!(gpu.chained_prompt_chunks(), gpu.cpu_prompt_chunks());
    let t = gpu.expert_stats().unwrap().total();
    assert!(t.cpu > 0, "{t:?}");

    // Steps that carry prompts' parts beside other sequences' next tokens (`eval_mixed`, as
    // the daemon takes a newly admitted request's prompt into the running ones' steps), as a
    // chain and not: each entry's last logits are what its sequence's tokens give alone.
    for chain in [true, false] {
        let o = GpuModelOptions {
            chain,
            ..found.0.clone()
        };
        let mut gpu = GpuModel::new(&dev, &model, &o).unwrap();
        assert_eq!(gpu.mixed_step_tokens(), 8, "chain {chain}");
        let seq_tokens = |s: usize| -> Vec<u32> { (0..9).map(|j| token(s, j, n_vocab)).collect() };
        let all: Vec<Vec<u32>> = (0..3).map(seq_tokens).collect();
        // (sequence, first token, end) of each entry of each step.
        let steps: [&[(usize, usize, usize)]; 3] = [
            &[(0, 0, 5), (1, 0, 3)],
            &[(0, 5, 6), (1, 3, 6), (2, 0, 2)],
            &[(2, 2, 9), (0, 6, 7)],
        ];
        for (i, step) in steps.iter().enumerate() {
            let inputs: Vec<(usize, &[u32])> =
                step.iter().map(|&(s, a, b)| (s, &all[s][a..b])).collect();
            let got = gpu.eval_mixed(&inputs).unwrap();
            for (j, &(s, _, end)) in step.iter().enumerate() {
                alone.reset();
                let want = alone.eval_prompt(&all[s][..end], false).unwrap();
                let got = &got[j * n_vocab..(j + 1) * n_vocab];
                let what = format!("chain {chain}, step {i}, sequence {s}");
                assert_logits_close(got, &want, TOLERANCE, &what);
                assert_eq!(gpu.position_of(s), end, "{what}");
            }
        }
        assert_eq!(gpu.batched_steps(), 3, "chain {chain}");
        assert_eq!(gpu.chained_batches(), if chain { 3 } else { 0 });
    }
}

/// With steps batched by measured cost (the default), a model measures both ways before it
/// chooses: its first two steps of several sequences batched (the first one records the step
/// and is not counted), its next two a sequence at a time; every step gives each sequence the
/// logits it gets alone, whichever way it ran.
#[test]
fn measured_steps_try_both_ways_and_give_the_same_logits() {
    let Some(dev) = device() else { return };
    let model = synth_model("tiny-llama", "Q8_0");
    let measured = GpuModelOptions {
        step_batching: StepBatching::Measured,
        ..options(3)
    };
    let mut gpu = GpuModel::new(&dev, &model, &measured).unwrap();
    let n_vocab = model.config.n_vocab;
    let mut alone: Vec<GpuModel> = (0..3)
        .map(|_| GpuModel::new(&dev, &model, &options(1)).unwrap())
        .collect();
    let mut batched = Vec::new();
    for step in 0..8 {
        let inputs: Vec<(usize, u32)> = (0..3).map(|s| (s, token(s, step, n_vocab))).collect();
        let got = gpu.eval_batch(&inputs).unwrap();
        for (i, &(s, t)) in inputs.iter().enumerate() {
            let want = alone[s].eval(t).unwrap();
            let g = &got[i * n_vocab..(i + 1) * n_vocab];
            assert_logits_close(g, &want, TOLERANCE, &format!("step {step}, seq {s}"));
        }
        batched.push(gpu.batched_steps());
    }
    assert_eq!(
        batched[..4],
        [1, 2, 2, 2],
        "batched twice, then single twice"
    );
    assert_eq!(
        (0..3).map(|s| gpu.position_of(s)).collect::<Vec<_>>(),
        [8, 8, 8]
    );
}

#[test]
fn a_bad_step_is_refused_and_nothing_moves() {
    let Some(dev) = device() else { return };
    let model = synth_model("tiny-llama", "Q8_0");
    let mut gpu = GpuModel::new(&dev, &model, &options(2)).unwrap();
    let n_vocab = gpu.config().n_vocab as u32;
    gpu.eval_batch(&[(0, 1), (1, 2)]).unwrap();
    for bad in [
        vec![(0, 1), (0, 2)],       // a sequence twice
        vec![(0, 1), (2, 2)],       // no sequence 2
        vec![(1, n_vocab), (0, 1)], // outside the vocabulary
    ] {
        assert!(gpu.eval_batch(&bad).is_err(), "{bad:?}");
        assert_eq!((gpu.position_of(0), gpu.position_of(1)), (1, 1), "{bad:?}");
    }
    // A step of several tokens a sequence (`eval_mixed`) is checked the same way, and for
    // entries without tokens.
    let bad_mixed: [&[(usize, &[u32])]; 4] = [
        &[(0, &[1, 2]), (0, &[3])],
        &[(0, &[1]), (1, &[])],
        &[(1, &[1, n_vocab])],
        &[(2, &[1, 2])],
    ];
    for bad in bad_mixed {
        assert!(gpu.eval_mixed(bad).is_err(), "{bad:?}");
        assert_eq!((gpu.position_of(0), gpu.position_of(1)), (1, 1), "{bad:?}");
    }
    // A full sequence refuses the step; the other's context is its own.
    gpu.select(1);
    let fill: Vec<u32> = (0..299).map(|i| i % n_vocab).collect();
    gpu.eval_prompt(&fill, false).unwrap();
    assert!(gpu.eval_batch(&[(0, 3), (1, 4)]).is_err());
    assert!(gpu.eval_mixed(&[(0, &[3, 4]), (1, &[4])]).is_err());
    assert_eq!((gpu.position_of(0), gpu.position_of(1)), (1, 300));
    gpu.eval_batch(&[(0, 3)]).unwrap();
    assert_eq!(gpu.position_of(0), 2);
}

/// A dense model over its VRAM budget runs its first layers on the CPU, whose cache holds one
/// sequence: the model holds one, and says so.
#[test]
fn more_sequences_than_a_step_can_take_together_are_not_kept() {
    let Some(dev) = device() else { return };
    let model = synth_model("tiny-llama", "Q8_0");
    let minimum = GpuModel::minimum_budget(&dev, &model, &options(1))
        .expect("a dense model of several layers has a minimum budget")
        .total();
    let options = GpuModelOptions {
        vram_budget: Some(minimum),
        ..options(4)
    };
    let gpu = GpuModel::new(&dev, &model, &options).unwrap();
    assert!(gpu.cpu_layers() > 0);
    assert_eq!(gpu.sequences(), 1);
}
