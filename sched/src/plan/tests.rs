use super::*;
use crate::model::presets::{find, Quant};
use crate::model::{ModelDesc, TensorRole, WeightType};
use crate::predict::ShapePoint;
use crate::profile::{AttentionPoint, HardwareProfile};
use crate::simulate::shipped_profile;

fn profile(name: &str) -> HardwareProfile {
    shipped_profile(name).unwrap().unwrap()
}

fn model(name: &str) -> ModelDesc {
    find(name).unwrap().describe(&Quant::Q4KM)
}

fn gib(x: f64) -> ByteSize {
    ByteSize((x * f64::from(1u32 << 30)) as u64)
}

fn opts(vram: ByteSize, ram: ByteSize) -> PlanOptions {
    PlanOptions::new(vram, ram)
}

fn minimum(m: &ModelDesc, p: &HardwareProfile) -> ByteSize {
    minimum_vram(m, p, &opts(ByteSize(0), p.ram.memory)).unwrap()
}

#[test]
fn minimum_vram_is_the_boundary_of_refusal() {
    let p = profile("laptop-8gb");
    for name in ["llama-3-8b", "qwen3-30b-a3b"] {
        let m = model(name);
        let mut o = opts(ByteSize(0), gib(28.0));
        o.pins = vec![r"blk\.0\.=gpu".parse().unwrap()];
        let need = minimum_vram(&m, &p, &o).unwrap();
        // The KV cache alone for 4096 tokens, then the pinned layer, are in it.
        assert!(need.0 > 4096 * m.kv_bytes_per_token());
        o.vram_budget = need;
        plan(&m, &p, &o).unwrap();
        o.vram_budget = ByteSize(need.0 - 1);
        assert!(matches!(
            plan(&m, &p, &o),
            Err(PlanError::VramTooSmall { .. })
        ));
        // Without the pin less is needed.
        assert!(minimum(&m, &p) < need);
    }
}

#[test]
fn more_vram_never_predicts_fewer_tokens_per_second() {
    let p = profile("desktop-24gb");
    for name in [
        "small-qwen3moe",
        "llama-3-8b",
        "qwen3-30b-a3b",
        "mixtral-8x7b",
    ] {
        let m = model(name);
        let lo = minimum(&m, &p).0;
        let hi = p.gpu.memory.0;
        let steps = 40;
        let mut last = 0.0;
        for i in 0..=steps {
            let vram = ByteSize(lo + (hi - lo) / steps * i);
            let got = plan(&m, &p, &opts(vram, gib(64.0))).unwrap().tokens_per_s;
            assert!(
                got >= last * (1.0 - 1e-9),
                "{name}: {vram} gives {got} tokens/s, less than {last} with less VRAM"
            );
            last = got;
        }
        // And the range matters: the largest budget beats the smallest.
        let first = plan(&m, &p, &opts(ByteSize(lo), gib(64.0))).unwrap();
        assert!(last > first.tokens_per_s, "{name}");
    }
}

#[test]
fn more_vram_never_predicts_fewer_tokens_per_second_when_the_ssd_serves_experts() {
    // Qwen3-235B on the laptop: most experts come from the SSD whatever the VRAM.
    let p = profile("laptop-8gb");
    let m = model("qwen3-235b-a22b");
    let lo = minimum(&m, &p).0;
    let mut last = 0.0;
    for i in 0..=16u64 {
        let vram = ByteSize(lo + (p.gpu.memory.0 - lo) / 16 * i);
        let got = plan(&m, &p, &opts(vram, gib(28.0))).unwrap();
        assert!(
            got.tokens_per_s >= last * (1.0 - 1e-9),
            "{vram}: {}",
            got.tokens_per_s
        );
        assert!(got.notes.iter().any(|n| n.contains("read from the SSD")));
        last = got.tokens_per_s;
    }
}

#[test]
fn more_ram_never_predicts_fewer_tokens_per_second() {
    // Qwen3-235B does not fit in the desktop's VRAM and RAM: RAM decides what the SSD serves.
    let p = profile("desktop-24gb");
    let m = model("qwen3-235b-a22b");
    let mut last = 0.0;
    for ram in [8.0, 16.0, 32.0, 64.0, 96.0, 111.0] {
        let got = plan(&m, &p, &opts(gib(24.0), gib(ram))).unwrap();
        assert!(got.tokens_per_s >= last, "{ram} GiB: {}", got.tokens_per_s);
        last = got.tokens_per_s;
    }
}

#[test]
fn pins_are_honoured() {
    let p = profile("laptop-8gb");
    let m = model("qwen3-30b-a3b");
    let mut o = opts(gib(8.0), gib(28.0));
    o.pins = vec![
        r"blk\.1\.ffn_up_exps=gpu".parse().unwrap(),
        r"blk\.[0-9]+\.ffn_.*_exps=cpu".parse().unwrap(),
        r"^output\.weight$=stream".parse().unwrap(),
        r"blk\.2\.attn_q\.=cpu".parse().unwrap(),
        r"nothing_has_this_name=gpu".parse().unwrap(),
    ];
    let plan = plan(&m, &p, &o).unwrap();
    for t in &plan.tensors {
        match (t.name.as_str(), &t.placement) {
            ("blk.1.ffn_up_exps.weight", Placement::Experts(e)) => {
                assert_eq!(e.vram.len(), 128);
                assert!(t.pinned.as_deref().unwrap().ends_with("=gpu"));
            }
            (n, Placement::Experts(e)) => {
                assert_eq!(e.cpu.len(), 128, "{n}");
                assert!(t.pinned.is_some());
            }
            ("output.weight", pl) => assert!(matches!(pl, Placement::Stream { .. })),
            ("blk.2.attn_q.weight", pl) => assert!(matches!(pl, Placement::Cpu { .. })),
            (_, _) => assert!(t.pinned.is_none(), "{}", t.name),
        }
    }
    assert!(plan
        .notes
        .iter()
        .any(|n| n.contains("nothing_has_this_name")));
    // With experts on the CPU, attention keeps VRAM and the CPU bounds the step.
    assert_eq!(
        plan.placement("blk.5.attn_q.weight"),
        Some(&Placement::Vram)
    );
    assert_eq!(plan.bottleneck, Bottleneck::Cpu);
}

#[test]
fn budget_below_minimum_is_refused_saying_what_fits() {
    let p = profile("laptop-8gb");
    let m = model("qwen3-30b-a3b");
    let need = minimum(&m, &p);
    // Just below the minimum: refused, and the message offers a shorter context.
    let below = ByteSize(need.0 - (64 << 20));
    let err = plan(&m, &p, &opts(below, gib(28.0))).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("is below the"), "{msg}");
    assert!(msg.contains("KV cache"), "{msg}");
    let PlanError::VramTooSmall { fits, .. } = &err else {
        panic!("{err:?}")
    };
    let tokens: u64 = fits
        .split("up to ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no context offered: {msg}"));
    // What it offers does run.
    let mut shorter = opts(below, gib(28.0));
    shorter.context = tokens;
    plan(&m, &p, &shorter).unwrap();
    shorter.context = tokens + 64;
    assert!(plan(&m, &p, &shorter).is_err());
    // At the minimum: accepted.
    plan(&m, &p, &opts(need, gib(28.0))).unwrap();

    // Pins that cannot fit: the message says the model runs without them.
    let mut pinned = opts(gib(8.0), gib(28.0));
    pinned.pins = vec![".*=gpu".parse().unwrap()];
    let msg = plan(&m, &p, &pinned).unwrap_err().to_string();
    assert!(msg.contains("tensors pinned to VRAM"), "{msg}");
    assert!(msg.contains("without the VRAM pins"), "{msg}");

    // Budgets beyond the machine, and RAM below the staging buffers.
    assert!(matches!(
        plan(&m, &p, &opts(gib(9.0), gib(28.0))),
        Err(PlanError::OverMachine { which: "VRAM", .. })
    ));
    // Little RAM still runs, from the SSD; streaming needs its staging buffers in RAM.
    plan(&m, &p, &opts(gib(8.0), ByteSize(1 << 20))).unwrap();
    let mut stream = opts(gib(8.0), ByteSize(1 << 20));
    stream.pins = vec!["^output.weight$=stream".parse().unwrap()];
    assert!(matches!(
        plan(&m, &p, &stream),
        Err(PlanError::RamTooSmall { .. })
    ));
}

#[test]
fn moe_attention_goes_to_vram_before_any_expert() {
    let p = profile("laptop-8gb");
    let m = model("qwen3-30b-a3b");
    let need = minimum(&m, &p);
    for extra_mib in [64u64, 256, 1024, 4096] {
        let plan = plan(
            &m,
            &p,
            &opts(ByteSize(need.0 + (extra_mib << 20)), gib(28.0)),
        )
        .unwrap();
        // Attention left out of VRAM only where it did not fit: experts then take just the
        // gap, less than any attention tensor left out.
        let attn_off = plan
            .tensors
            .iter()
            .filter(|t| t.role == "attn" && t.placement != Placement::Vram)
            .map(|t| t.bytes)
            .min();
        if let Some(smallest) = attn_off {
            assert!(
                plan.vram.expert_cache.0 < smallest,
                "{extra_mib} MiB: experts hold {} while a {} attention tensor is off VRAM",
                plan.vram.expert_cache,
                ByteSize(smallest)
            );
        }
    }
    // With room, every attention tensor is resident.
    let roomy = plan(&m, &p, &opts(ByteSize(need.0 + (1 << 30)), gib(28.0))).unwrap();
    assert!(roomy
        .tensors
        .iter()
        .filter(|t| t.role == "attn" || t.role == "router")
        .all(|t| t.placement == Placement::Vram));
}

#[test]
fn hot_experts_are_resident_first() {
    // Expert 0..8 of every layer are used far more often than the rest.
    let p = profile("laptop-8gb");
    let mut m = model("qwen3-30b-a3b");
    let r = m.experts.as_mut().unwrap();
    let (count, used) = (r.count as usize, f64::from(r.used));
    let hot = 0.6;
    let row: Vec<f64> = (0..count)
        .map(|e| {
            if e < 8 {
                hot
            } else {
                (used - 8.0 * hot) / (count - 8) as f64
            }
        })
        .collect();
    r.probabilities = Some(vec![row; m.n_layer as usize]);
    let uniform = plan(&model("qwen3-30b-a3b"), &p, &opts(gib(4.0), gib(28.0))).unwrap();
    let skewed = plan(&m, &p, &opts(gib(4.0), gib(28.0))).unwrap();
    let Some(Placement::Experts(e)) = skewed.placement("blk.7.ffn_down_exps.weight") else {
        panic!()
    };
    for hot in 0..8 {
        assert!(e.vram.contains(&hot), "{e:?}");
    }
    let caches = skewed.experts.unwrap();
    assert!(caches.vram_hit_rate > uniform.experts.unwrap().vram_hit_rate);
    assert!(skewed.tokens_per_s > uniform.tokens_per_s);
}

#[test]
fn dense_model_larger_than_vram_streams_or_uses_the_cpu() {
    let p = profile("desktop-24gb");
    let m = find("llama-3-8b")
        .unwrap()
        .describe(&Quant::Uniform(crate::model::WeightType::new("F16")));
    let small = plan(&m, &p, &opts(gib(6.0), gib(64.0))).unwrap();
    let big = plan(&m, &p, &opts(gib(24.0), gib(64.0))).unwrap();
    assert!(big.notes.iter().any(|n| n.contains("every weight fits")));
    assert_eq!(big.vram.staging, ByteSize(0));
    let off: usize = small
        .tensors
        .iter()
        .filter(|t| !matches!(t.placement, Placement::Vram))
        .count();
    assert!(off > 1, "{}", small.to_json());
    assert!(small.vram.total <= small.vram_budget);
    assert!(small.tokens_per_s < big.tokens_per_s);
    assert_ne!(small.bottleneck, Bottleneck::Ssd);
    // Every tensor of the model is placed exactly once, in file order.
    let names: Vec<&str> = m.tensors.iter().map(|t| t.name.as_str()).collect();
    let placed: Vec<&str> = small.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, placed);
}

#[test]
fn whole_stack_experts_and_split_experts_plan_alike() {
    // Older Mixtral files store each expert's matrix on its own (`blk.N.ffn_up.E.weight`).
    let p = profile("laptop-8gb");
    let stacked = model("mixtral-8x7b");
    let mut split = stacked.clone();
    split.tensors = Vec::new();
    for t in &stacked.tensors {
        if let TensorRole::Experts { layer } = t.role {
            let base = t.name.trim_end_matches("_exps.weight");
            for e in 0..8 {
                let name = format!("{base}.{e}.weight");
                let mut one = crate::model::TensorDesc::new(
                    &name,
                    t.weight_type.clone(),
                    &t.shape[..2],
                    t.bytes / 8,
                );
                assert_eq!(one.role, TensorRole::Expert { layer, index: e });
                one.role = TensorRole::Expert { layer, index: e };
                split.tensors.push(one);
            }
        } else {
            split.tensors.push(t.clone());
        }
    }
    let a = plan(&stacked, &p, &opts(gib(8.0), gib(28.0))).unwrap();
    let b = plan(&split, &p, &opts(gib(8.0), gib(28.0))).unwrap();
    assert_eq!(a.experts.unwrap().experts, b.experts.unwrap().experts);
    // Stacks pay one dispatch per matrix, split files one per expert matrix: never faster.
    let ratio = a.tokens_per_s / b.tokens_per_s;
    assert!((1.0..1.3).contains(&ratio), "{ratio}");
}

#[test]
fn json_round_trip_and_table() {
    let p = profile("desktop-24gb");
    let mut o = opts(gib(12.0), gib(64.0));
    o.pins = vec![r"blk\.0\.ffn_.*_exps=cpu".parse().unwrap()];
    let plan = plan(&model("qwen3-30b-a3b"), &p, &o).unwrap();
    let json = plan.to_json();
    assert_eq!(Plan::from_json(&json).unwrap(), plan);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(["GPU", "CPU", "PCIe", "SSD"].contains(&v["bottleneck"].as_str().unwrap()));
    assert_eq!(v["tensors"][0]["name"], "token_embd.weight");

    let mut table = String::new();
    plan.write_table(&mut table).unwrap();
    assert!(
        table.contains(&format!("{:.1} tokens/s", plan.tokens_per_s)),
        "{table}"
    );
    assert!(table.contains(&format!("bottleneck: {}", plan.bottleneck)));
    assert!(table.contains("blk.0.ffn_up_exps.weight"));
    assert!(table.contains("[pinned: blk\\.0\\.ffn_.*_exps=cpu]"));
    assert_eq!(
        table.lines().filter(|l| l.starts_with("blk.")).count(),
        plan.tensors.len() - 3 + 48,
        "one line per tensor and per layer"
    );
}

#[test]
fn per_layer_predictions_meet_the_accuracy_bar_on_synthetic_measurements() {
    // Ground truth: the laptop profile. What the planner believes: the same machine as a
    // calibration with a few percent of error per figure would measure it. "Measured" layer
    // times: the truth's, with 8% measurement noise. No real hardware is involved here.
    use crate::predict::tests::Rng;
    let truth = profile("laptop-8gb");
    let mut rng = Rng::new(21);
    let mut believed = truth.clone();
    believed.gpu.bandwidth *= rng.noise(0.05);
    believed.pcie.bandwidth *= rng.noise(0.05);
    believed.cpu.memory_bandwidth *= rng.noise(0.05);
    for r in believed.cpu.matvec_per_thread.values_mut() {
        r.bandwidth *= rng.noise(0.05);
    }
    for r in &mut believed.ssd.reads {
        r.bandwidth *= rng.noise(0.05);
    }
    for name in ["qwen3-30b-a3b", "llama-3-8b", "mixtral-8x7b"] {
        let m = model(name);
        let o = opts(gib(6.0), gib(20.0));
        let planned = plan(&m, &believed, &o).unwrap();
        let real = layer_times(&planned, &m, &truth, &o).unwrap();
        let measured: std::collections::BTreeMap<String, f64> = real
            .iter()
            .map(|l| (l.name.clone(), l.time.total_s * rng.noise(0.08)))
            .collect();
        let report = layer_accuracy(&planned, &measured).unwrap();
        assert_eq!(report.count, m.n_layer as usize + 1);
        assert!(report.within(0.15), "{name}: {report:?}");

        // A profile off by 2x in every bandwidth misses the bar: the check can fail.
        let mut wrong = believed.clone();
        wrong.gpu.bandwidth *= 2.0;
        wrong.pcie.bandwidth *= 2.0;
        wrong.cpu.memory_bandwidth *= 2.0;
        for r in wrong.cpu.matvec_per_thread.values_mut() {
            r.bandwidth *= 2.0;
        }
        for r in &mut wrong.ssd.reads {
            r.bandwidth *= 2.0;
        }
        let bad = layer_times(&planned, &m, &wrong, &o).unwrap();
        let mut as_planned = planned.clone();
        as_planned.layers = bad;
        assert!(
            !layer_accuracy(&as_planned, &measured).unwrap().within(0.15),
            "{name}"
        );
    }
    // A plan of another model is refused.
    let other = plan(&model("llama-3-8b"), &truth, &opts(gib(6.0), gib(20.0))).unwrap();
    assert!(layer_times(
        &other,
        &model("qwen3-30b-a3b"),
        &truth,
        &opts(gib(6.0), gib(20.0))
    )
    .is_none());
}

#[test]
fn a_cpu_only_plan_holds_nothing_in_vram() {
    let p = profile("desktop-24gb");
    let m = model("qwen3-30b-a3b");
    let mut o = opts(ByteSize(0), gib(64.0));
    o.cpu_only = true;
    let plan = plan(&m, &p, &o).unwrap();
    assert!(plan.cpu_only);
    assert_eq!(plan.vram.total, ByteSize(0));
    assert_eq!(plan.ram.kv_cache.0, o.context * m.kv_bytes_per_token());
    for t in &plan.tensors {
        match &t.placement {
            Placement::Cpu { .. } => {}
            Placement::Experts(e) => assert!(e.vram.is_empty() && e.stream.is_empty()),
            other => panic!("{}: {other:?}", t.name),
        }
    }
    for l in &plan.layers {
        assert_eq!(l.time.gpu_s, 0.0, "{}", l.name);
        assert_eq!(l.time.bound, Bottleneck::Cpu, "{}", l.name);
    }
    // Without a GPU the step is slower than with the desktop's 24 GiB of VRAM.
    let gpu = plan_gpu(&m, &p);
    assert!(plan.tokens_per_s < gpu);
}

fn plan_gpu(m: &ModelDesc, p: &HardwareProfile) -> f64 {
    plan(m, p, &opts(p.gpu.memory, gib(64.0)))
        .unwrap()
        .tokens_per_s
}

#[test]
fn a_tied_embedding_is_read_whole_by_the_head() {
    // small-qwen3moe ties its output to the embedding: the head reads the whole matrix a
    // token, not one row.
    let p = profile("laptop-8gb");
    let m = model("small-qwen3moe");
    assert!(!m.tensors.iter().any(|t| t.role == TensorRole::Output));
    let embd = m
        .tensors
        .iter()
        .find(|t| t.role == TensorRole::Embedding)
        .unwrap();
    let mut o = opts(ByteSize(0), gib(16.0));
    o.cpu_only = true;
    let head = plan(&m, &p, &o)
        .unwrap()
        .layers
        .last()
        .unwrap()
        .time
        .total_s;
    let read = embd.bytes as f64 / p.cpu_matvec(&embd.weight_type).bandwidth;
    assert!(
        head >= read,
        "head {head} s, reading the embedding {read} s"
    );
}

#[test]
fn more_resident_experts_predict_a_faster_step() {
    let p = profile("h200");
    let m = model("qwen3-30b-a3b");
    let o = opts(gib(16.0), gib(64.0));
    let planned = plan(&m, &p, &o).unwrap();
    let mut last = 0.0;
    for resident in [1, 16, 64, 128] {
        let fixed = with_resident_experts(&planned, &m, &p, &o, resident).unwrap();
        let e = fixed
            .tensors
            .iter()
            .find_map(|t| match &t.placement {
                Placement::Experts(e) => Some(e),
                _ => None,
            })
            .unwrap();
        assert_eq!(e.vram.len(), resident as usize);
        assert_eq!(e.cpu.len(), 128 - resident as usize);
        assert!(
            fixed.tokens_per_s > last,
            "{resident}: {}",
            fixed.tokens_per_s
        );
        last = fixed.tokens_per_s;
    }
}

#[test]
fn a_layer_with_every_expert_in_vram_pays_the_expert_indexed_dispatches() {
    // With every expert resident the GPU routes the layer itself and runs the chosen experts
    // in two expert-indexed dispatches (gate and up stacked, then down); with one expert
    // outside VRAM it runs them one by one (their products, the activation and the weighted
    // add each).
    let p = profile("h200");
    let m = model("qwen3-30b-a3b");
    let o = opts(gib(16.0), gib(64.0));
    let planned = plan(&m, &p, &o).unwrap();
    let gpu_s = |resident: u32| {
        let fixed = with_resident_experts(&planned, &m, &p, &o, resident).unwrap();
        fixed.layers[0].time.gpu_s
    };
    let (all, one_out) = (gpu_s(128), gpu_s(127));
    let k = m.experts.as_ref().unwrap().used as f64;
    let d = p.gpu.dispatch_s;
    // One by one: k experts × (3 products + 2 ops) of dispatches, in expectation over the
    // experts on the GPU (127 of 128); all at once: 2 (Q4_K and Q6_K experts: no inputs
    // quantized for integer dots).
    let per_expert = k * 127.0 / 128.0 * 5.0 * d;
    let indexed = 2.0 * d;
    let diff = one_out - all;
    // The expert moved off VRAM also takes its reads from the GPU: a small share.
    assert!(
        (diff - (per_expert - indexed)).abs() < 0.1 * (per_expert - indexed),
        "{all} s with every expert resident, {one_out} s with one out; dispatch {d}"
    );
}

#[test]
fn calibrated_gpu_experts_set_what_a_resident_expert_costs() {
    // Calibrated GPU experts stand for the products' costs of a routed expert: a MoE layer
    // with every expert in VRAM pays k of them, and twice the calibrated cost twice that.
    let m = find("qwen3-30b-a3b")
        .unwrap()
        .describe(&Quant::Uniform(WeightType::new("Q4_0")));
    let o = opts(gib(16.0), gib(64.0));
    let t = m.tensors.iter().find(|t| t.role.is_routed()).unwrap();
    let r = m.experts.as_ref().unwrap();
    let (a, b) = t.matrix();
    let rows = if a == m.n_embd { b } else { a };
    let gpu_s = |per_expert: Option<f64>| {
        let mut p = profile("h200");
        if let Some(s) = per_expert {
            let point = ShapePoint {
                k: m.n_embd,
                n: rows,
                bytes: 3 * t.bytes / u64::from(r.count),
                seconds: s,
            };
            p.gpu
                .expert_points
                .insert(t.weight_type.clone(), vec![point]);
        }
        let planned = plan(&m, &p, &o).unwrap();
        let fixed = with_resident_experts(&planned, &m, &p, &o, r.count).unwrap();
        fixed.layers[0].time.gpu_s
    };
    let (one, two) = (gpu_s(Some(10e-6)), gpu_s(Some(20e-6)));
    let k = f64::from(r.used);
    assert!(
        ((two - one) - k * 10e-6).abs() < 1e-9,
        "{one} s at 10 µs an expert, {two} s at 20 µs"
    );
    assert_ne!(
        gpu_s(None),
        one,
        "the products' costs stand without calibrated experts"
    );
}

#[test]
fn calibrated_gpu_attention_sets_a_layers_attention() {
    // A layer on the GPU pays the calibrated attention's time at the plan's context, in place
    // of one dispatch and the cache read at the stream's rate.
    let m = model("llama-3-8b");
    assert_eq!(m.query_width(), 4096);
    let o = opts(gib(16.0), gib(64.0));
    let layer_gpu = |points: Vec<AttentionPoint>| {
        let mut p = profile("h200");
        p.gpu.attention = points;
        plan(&m, &p, &o).unwrap().layers[0].time.gpu_s
    };
    // The same time at every position, at the model's width and twice it.
    let flat = |us: f64| {
        [4096, 8192]
            .into_iter()
            .flat_map(|query_width| {
                [1, 100_000].map(|position| AttentionPoint {
                    query_width,
                    position,
                    seconds: us * 1e-6 * query_width as f64 / 4096.0,
                })
            })
            .collect::<Vec<_>>()
    };
    let (a, b) = (layer_gpu(flat(10.0)), layer_gpu(flat(30.0)));
    assert!(((b - a) - 20e-6).abs() < 1e-9, "{a} s, then {b} s");
    assert!(
        layer_gpu(Vec::new()) < a,
        "a dispatch and a stream read cost less here"
    );
}

/// Dispatches of layer 0 on the GPU, every weight in VRAM: the change of its GPU time per
/// second of dispatch cost.
fn gpu_dispatches_of_layer0(m: &ModelDesc) -> f64 {
    let layer0_gpu = |dispatch_s: f64| {
        // A profile from datasheets: products without calibrated shapes, whose marginal
        // cost does not move with the dispatch's.
        let mut p = profile("desktop-24gb");
        p.gpu.dispatch_s = dispatch_s;
        let o = opts(gib(20.0), gib(64.0));
        let planned = plan(m, &p, &o).unwrap();
        let fixed = match &m.experts {
            Some(r) => with_resident_experts(&planned, m, &p, &o, r.count).unwrap(),
            None => planned,
        };
        fixed.layers[0].time.gpu_s
    };
    (layer0_gpu(2e-6) - layer0_gpu(1e-6)) / 1e-6
}

#[test]
fn a_gpu_layer_pays_the_dispatches_a_decode_step_records() {
    // What `gpu/forward/decode.rs` records for a layer (`vulkan_decode` counts 133 dispatches
    // a token for the 16 layers of llama-3.2-1b in Q4_0, 98 for the 12 of small-qwen3moe in
    // Q4_K_M, embedding and head included): norms fused into products, gate and up stacked,
    // attention one dispatch, and inputs quantized once before the products that take
    // integer dots and are not small (`GPU_SMALL_PRODUCT_WEIGHTS`).
    let dense = find("llama-3.2-1b")
        .unwrap()
        .describe(&Quant::Uniform(WeightType::new("Q4_0")));
    // Q, K, V, O, attention; gate and up, down; the stacked gate and up's inputs (Q, K, V, O
    // and down, 2048 × 2048 to 2048 × 8192, quantize theirs in place).
    let n = gpu_dispatches_of_layer0(&dense);
    assert!((n - 8.0).abs() < 1e-6, "{n} dispatches");
    let moe = model("small-qwen3moe");
    // Q, K, V, O, attention; router and routing; gate and up of every chosen expert, down.
    let n = gpu_dispatches_of_layer0(&moe);
    assert!((n - 8.0).abs() < 1e-6, "{n} dispatches");
    // In Q4_0 (`vulkan_decode` counts 435 a token for the 48 layers of the Qwen3-30B-A3B
    // shape): the same, and the inputs of the chosen experts' gate and up quantized first
    // (8 experts × 2 × 768 × 2048 weights); their down products (8 × 2048 × 768) and the
    // attention's are small and quantize in place.
    let moe = find("qwen3-30b-a3b")
        .unwrap()
        .describe(&Quant::Uniform(WeightType::new("Q4_0")));
    let n = gpu_dispatches_of_layer0(&moe);
    assert!((n - 9.0).abs() < 1e-6, "{n} dispatches");
}

#[test]
fn a_cpu_moe_layer_pays_two_pool_jobs_for_all_its_experts() {
    // The CPU engine runs every chosen expert of a layer in two jobs (gates and ups, then
    // downs), besides one job per other matrix and two that read no weights; norms run on
    // the calling thread.
    let m = model("qwen3-30b-a3b");
    let mut o = opts(ByteSize(0), gib(64.0));
    o.cpu_only = true;
    let layer0_cpu = |dispatch_s: f64| {
        let mut p = profile("desktop-24gb");
        p.cpu.dispatch_s = dispatch_s;
        plan(&m, &p, &o).unwrap().layers[0].time.cpu_s
    };
    let jobs = (layer0_cpu(2e-3) - layer0_cpu(1e-3)) / 1e-3;
    let other_matrices = m
        .tensors
        .iter()
        .filter(|t| {
            matches!(
                t.role,
                TensorRole::Attention { layer: 0 } | TensorRole::Router { layer: 0 }
            )
        })
        .count() as f64;
    assert_eq!(other_matrices, 5.0, "q, k, v, output and the router");
    assert!(
        (jobs - (2.0 + other_matrices + 2.0)).abs() < 1e-6,
        "{jobs} jobs in layer 0"
    );
}
