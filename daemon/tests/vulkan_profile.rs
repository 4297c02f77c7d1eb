//! Per-layer GPU timestamps of a decode step (`GpuModel::set_profiling`): every op group of
//! every layer is timed, in order, one after the other, and the groups add up to the step,
//! which fits inside the host's call; MoE layers carry their expert counters; profiling
//! changes no logits. The tests run on whatever Vulkan device the
//! machine has (lavapipe in CI) and skip without one, unless `SPILLWAY_REQUIRE_VULKAN` is set.

#[path = "common/f16_model.rs"]
mod f16_model;
use f16_model::f16_model;

use std::time::{Duration, Instant};

use spillway_daemon::gpu::forward::{GpuModel, GpuModelOptions, GpuStepProfile};
use spillway_daemon::gpu::placement::MoeMiss;
use spillway_daemon::model::{Ffn, Model};

const TOKENS: [u32; 4] = [1, 17, 300, 5];

fn options(budget: Option<u64>) -> GpuModelOptions {
    GpuModelOptions {
        vram_budget: budget,
        context: 32,
        moe_miss: MoeMiss::Cpu,
        threads: 2,
        ..GpuModelOptions::default()
    }
}

/// The ops a step's rows must list, in order.
fn expected_ops(model: &Model) -> Vec<(Option<usize>, &'static str)> {
    let mut ops = vec![(None, "embedding")];
    for (il, l) in model.layers.iter().enumerate() {
        ops.push((Some(il), "attention"));
        let ffn = match l.ffn {
            Ffn::Dense { .. } => "ffn",
            Ffn::Moe(_) => "experts",
        };
        ops.push((Some(il), ffn));
    }
    ops.push((None, "output_head"));
    ops
}

/// Every group is timed, in step order, each from where the one before it ended; the groups
/// add up to the step within 10% (exactly, as the step is split at group boundaries), and the
/// step took no longer than `wall`, the host's call that waited for it.
fn check_step(what: &str, model: &Model, p: &GpuStepProfile, wall: Duration) {
    check_rows(what, expected_ops(model), p, wall);
}

fn check_rows(
    what: &str,
    expected: Vec<(Option<usize>, &'static str)>,
    p: &GpuStepProfile,
    wall: Duration,
) {
    let ops: Vec<_> = p.rows.iter().map(|r| (r.layer, r.op)).collect();
    assert_eq!(ops, expected, "{what}: rows");
    let step = p.step_gpu_ns.expect("the device has timestamps");
    assert!(step > 0, "{what}: step time");
    assert!(
        step <= wall.as_nanos() as u64,
        "{what}: the GPU's step ({step} ns) outlasted the call that waited for it ({wall:?})"
    );
    let mut next_start = 0;
    let mut sum = 0;
    for r in &p.rows {
        let (ns, start) = (r.gpu_ns.unwrap(), r.start_ns.unwrap());
        assert_eq!(
            start, next_start,
            "{what}: {r:?} starts apart from the row before"
        );
        assert!(
            start + ns <= step,
            "{what}: {r:?} ends after the step ({step})"
        );
        next_start = start + ns;
        sum += ns;
    }
    let diff = sum.abs_diff(step) as f64;
    assert!(
        diff <= 0.1 * step as f64,
        "{what}: groups sum to {sum} ns, the step took {step} ns"
    );
}

/// `f`'s result and how long it took.
fn timed<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed())
}

#[test]
fn a_dense_step_times_every_layer_and_adds_up() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), "tiny-llama");
    let mut on = GpuModel::new(&dev, &model, &options(None)).unwrap();
    let mut off = GpuModel::new(&dev, &model, &options(None)).unwrap();
    on.set_profiling(true).unwrap();
    for (i, &t) in TOKENS.iter().enumerate() {
        let (a, wall) = timed(|| on.eval(t).unwrap());
        assert_eq!(
            a,
            off.eval(t).unwrap(),
            "step {i}: profiling changed the logits"
        );
        check_step(
            &format!("step {i}"),
            &model,
            on.last_profile().unwrap(),
            wall,
        );
        assert!(on
            .last_profile()
            .unwrap()
            .rows
            .iter()
            .all(|r| r.experts.is_none()));
        assert!(off.last_profile().is_none(), "step {i}: profiling off");
    }
    // A profiled step is the served one: replayed, from a recording of its own.
    assert_eq!(
        on.replayed_steps(),
        TOKENS.len() as u64,
        "profiled steps replayed"
    );
    on.set_profiling(false).unwrap();
    assert!(on.last_profile().is_none());
    assert_eq!(on.eval(9).unwrap(), off.eval(9).unwrap());
    assert!(on.last_profile().is_none(), "profiling turned off");
    // Turned on again, steps write to the new queries.
    on.set_profiling(true).unwrap();
    let (a, wall) = timed(|| on.eval(23).unwrap());
    assert_eq!(
        a,
        off.eval(23).unwrap(),
        "profiling on again changed the logits"
    );
    check_step(
        "profiling on again",
        &model,
        on.last_profile().unwrap(),
        wall,
    );
    assert_eq!(on.replayed_steps(), TOKENS.len() as u64 + 2);
}

/// A MoE model with every expert in VRAM (routed on the device) and at the minimum budget
/// (experts on the CPU, as a chained step and as separate submissions): every MoE layer's row
/// counts the step's routed experts, and a step with CPU experts reports the host's time.
/// A dense model over its budget: the GPU's rows are its layers (numbered as the model's) after
/// the hidden state from the CPU, and the host's time has the CPU's layers.
#[test]
fn a_split_step_times_the_gpu_layers_and_the_cpu_layers() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), "tiny-llama");
    let minimum = GpuModel::minimum_budget(&dev, &model, &options(None))
        .unwrap()
        .total();
    let mut on = GpuModel::new(&dev, &model, &options(Some(minimum))).unwrap();
    let mut off = GpuModel::new(&dev, &model, &options(Some(minimum))).unwrap();
    let last = model.config.n_layer - 1;
    assert_eq!(on.cpu_layers(), last);
    on.set_profiling(true).unwrap();
    for (i, &t) in TOKENS.iter().enumerate() {
        let (a, wall) = timed(|| on.eval(t).unwrap());
        assert_eq!(
            a,
            off.eval(t).unwrap(),
            "step {i}: profiling changed the logits"
        );
        let p = on.last_profile().unwrap();
        let expected = vec![
            (None, "hidden_state_in"),
            (Some(last), "attention"),
            (Some(last), "ffn"),
            (None, "output_head"),
        ];
        check_rows(&format!("step {i}"), expected, p, wall);
        let cpu = p.host.expect("the CPU's layers' time").cpu_layers_ns;
        assert!(
            cpu > 0 && cpu < wall.as_nanos() as u64,
            "step {i}: {cpu} ns"
        );
    }
    // While profiling, a prompt runs in chunks as it does unprofiled (its CPU layers over the
    // whole prompt at once): the same logits, one profile for the chunk, with the CPU's time.
    on.reset();
    off.reset();
    let n_vocab = model.config.n_vocab;
    let (got, wall) = timed(|| on.eval_prompt(&TOKENS, true).unwrap());
    assert_eq!(got.len(), TOKENS.len() * n_vocab);
    let want = off.eval_prompt(&TOKENS, true).unwrap();
    assert_eq!(got, want, "profiling changed a prompt's logits");
    let p = on.last_profile().expect("the prompt's chunk was profiled");
    let expected = vec![
        (None, "hidden_state_in"),
        (Some(last), "attention"),
        (Some(last), "ffn"),
        (None, "output_head"),
    ];
    check_rows("prompt", expected, p, wall);
    let host = p.host.expect("a chunk's host time");
    assert!(host.cpu_layers_ns > 0 && host.wait_ns <= host.step_ns);
}

/// A prompt profiled in one chunk, dense and MoE (whose chunk pauses at each MoE layer's
/// router for the host's routing): every group in order, adding up to the chunk, the MoE rows
/// counting k experts for each of the chunk's tokens, and the logits of the unprofiled chunk.
#[test]
fn a_profiled_prompt_chunk_times_every_layer_and_changes_no_logits() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let prompt: Vec<u32> = (0..24).map(|i| (i * 37 + 3) % 200).collect();
    for name in ["tiny-llama", "tiny-qwen3moe"] {
        let model = f16_model(tmp.path(), name);
        let mut on = GpuModel::new(&dev, &model, &options(None)).unwrap();
        let mut off = GpuModel::new(&dev, &model, &options(None)).unwrap();
        assert!(on.batches_prompts(), "{name}");
        on.set_profiling(true).unwrap();
        let (got, wall) = timed(|| on.eval_prompt(&prompt, false).unwrap());
        assert_eq!(
            got,
            off.eval_prompt(&prompt, false).unwrap(),
            "{name}: logits"
        );
        let p = on.last_profile().expect("the chunk was profiled");
        check_step(&format!("{name} prompt"), &model, p, wall);
        let host = p.host.expect("a chunk's host time");
        assert!(host.wait_ns > 0 && host.wait_ns <= host.step_ns, "{name}");
        // The GPU's time in the submissions fits in the host's time waiting for them.
        let busy = p.submissions_gpu_ns.expect("timestamps");
        assert!(
            busy > 0 && busy <= host.wait_ns,
            "{name}: {busy} of {host:?}"
        );
        if let Some(cfg) = model.config.moe {
            for r in p.rows.iter().filter(|r| r.op == "experts") {
                let e = r.experts.expect("a MoE row's counters");
                let routed = (prompt.len() * cfg.n_expert_used) as u64;
                assert_eq!(e.hits + e.misses, routed, "{name} layer {:?}", r.layer);
            }
        }
    }
}

#[test]
fn moe_steps_count_their_experts_per_layer() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), "tiny-qwen3moe");
    let k = model.config.moe.unwrap().n_expert_used as u64;
    let minimum = GpuModel::minimum_budget(&dev, &model, &options(None))
        .unwrap()
        .total();
    for (budget, chain) in [(None, true), (Some(minimum), true), (Some(minimum), false)] {
        let what = format!("budget {budget:?}, chain {chain}");
        let o = GpuModelOptions {
            chain,
            ..options(budget)
        };
        let mut off = GpuModel::new(&dev, &model, &o).unwrap();
        let mut gpu = GpuModel::new(&dev, &model, &o).unwrap();
        gpu.set_profiling(true).unwrap();
        let mut cpu = 0;
        for (i, &t) in TOKENS.iter().enumerate() {
            let (logits, wall) = timed(|| gpu.eval(t).unwrap());
            assert_eq!(logits, off.eval(t).unwrap(), "{what}, step {i}: logits");
            let p = gpu.last_profile().unwrap();
            check_step(&format!("{what}, step {i}"), &model, p, wall);
            for r in p.rows.iter().filter(|r| r.op == "experts") {
                let e = r.experts.expect("a MoE layer's counters");
                assert_eq!(e.hits + e.misses, k, "{what}, step {i}: {r:?}");
                cpu += e.cpu;
            }
            // The host's side is timed whenever experts ran on the CPU.
            let cpu_step: u64 = p.rows.iter().filter_map(|r| r.experts).map(|e| e.cpu).sum();
            assert_eq!(
                p.host.is_some(),
                cpu_step > 0,
                "{what}, step {i}: host time"
            );
            if let Some(h) = p.host {
                assert!(
                    h.cpu_experts_ns > 0 && h.cpu_experts_ns <= h.step_ns,
                    "{what}: {h:?}"
                );
            }
        }
        let total = gpu.expert_stats().unwrap().total();
        assert_eq!(cpu, total.cpu, "{what}: the deltas add up to the counters");
        if budget.is_some() {
            assert!(cpu > 0, "{what}: some experts ran on the CPU");
        }
    }
}

/// Under a RAM budget the CPU's experts come from the SSD through the tile reader: each MoE
/// row's `ssd_bytes` is what its layer read, and a step's rows add up to what the reader
/// delivered in that step; without a RAM budget no row claims SSD bytes.
#[test]
fn ssd_bytes_per_layer_add_up_to_what_the_reader_delivered() {
    let Some(dev) = spillway_daemon::gpu::device_or_skip() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let model = f16_model(tmp.path(), "tiny-qwen3moe");
    let minimum = GpuModel::minimum_budget(&dev, &model, &options(None))
        .unwrap()
        .total();
    let ram = spillway_daemon::stream::minimum_ram_budget(&model);
    for chain in [true, false] {
        let o = GpuModelOptions {
            chain,
            ram_budget: Some(ram),
            ..options(Some(minimum))
        };
        let mut gpu = GpuModel::new(&dev, &model, &o).unwrap();
        gpu.set_profiling(true).unwrap();
        let mut read = 0;
        for (i, &t) in TOKENS.iter().cycle().take(8).enumerate() {
            let before = gpu.ram_delivered().expect("a RAM tier").0;
            gpu.eval(t).unwrap();
            let delivered = gpu.ram_delivered().unwrap().0 - before;
            let p = gpu.last_profile().unwrap();
            let rows: u64 = p.rows.iter().filter_map(|r| r.ssd_bytes).sum();
            assert_eq!(rows, delivered, "chain {chain}, step {i}");
            // The trace has each expert read, and the CPU's experts of each layer that had
            // some, on the pool's threads.
            let reads: u64 = p.reads.iter().map(|r| r.bytes).sum();
            assert_eq!(reads, delivered, "chain {chain}, step {i}: traced reads");
            assert!(p.reads.iter().all(|r| r.issued <= r.done));
            for r in p.rows.iter().filter(|r| r.op == "experts") {
                let layer = r.layer.unwrap();
                let ran = p
                    .workers
                    .iter()
                    .any(|(l, w)| *l == layer && w.label.is_some());
                assert_eq!(
                    ran,
                    r.experts.unwrap().cpu > 0,
                    "chain {chain}, step {i}: {r:?}"
                );
            }
            for r in &p.rows {
                assert_eq!(r.ssd_bytes.is_some(), r.op == "experts", "{r:?}");
            }
            read += delivered;
        }
        assert!(
            read > 0,
            "chain {chain}: the RAM tier read experts from the SSD"
        );
    }
    let mut plain = GpuModel::new(&dev, &model, &options(Some(minimum))).unwrap();
    plain.set_profiling(true).unwrap();
    plain.eval(1).unwrap();
    assert!(plain.ram_delivered().is_none());
    let p = plain.last_profile().unwrap();
    assert!(p.rows.iter().all(|r| r.ssd_bytes.is_none()));
}
