//! What a profile's rows cost: the weight bytes each op group reads, the scheduler's predicted
//! time for it on the daemon's hardware profile, and the bandwidths the decode steps reached
//! against the profile's measured limits.
//!
//! Predictions are the scheduler's rooflines (`spillway_sched::profile::HardwareProfile`):
//! each weight matrix a group reads is one matrix-vector product (batched over the step's
//! tokens on the CPU; once per token on the GPU, which evaluates a prompt token by token), each
//! expert copied into VRAM one host-to-device copy, each expert read from the SSD one read. A
//! MoE layer's experts on the GPU and on the CPU run at the same time, so its prediction is the
//! router's plus the longer of the two sides. A GPU attention row adds decode attention at
//! each of its tokens' positions, from the profile's calibrated points
//! (`profile::attention_seconds`; nothing where the profile has none). Groups that read no
//! weights on the CPU (RoPE and the KV cache, attention over the cache) get no prediction.

use std::sync::Arc;

use spillway_proto::v1 as pb;
use spillway_sched::model::WeightType;
use spillway_sched::predict::{Roofline, Work};
use spillway_sched::profile::{attention_seconds, HardwareProfile};
use spillway_sched::refine::{ObservedProducts, Side};

use crate::gpu::expert_cache::LayerExpertStats;
use crate::model::{Ffn, Matrix, Model};

/// One weight matrix as the predictors see it (one expert's slice of a stacked one).
#[derive(Debug, Clone)]
struct Mat {
    ty: WeightType,
    n_in: u64,
    n_out: u64,
    bytes: u64,
}

impl Mat {
    fn of(m: &Matrix) -> Mat {
        Mat {
            ty: WeightType::new(m.ty.name()),
            n_in: m.n_in as u64,
            n_out: m.n_out as u64,
            bytes: m.bytes(),
        }
    }

    fn work(&self, batch: u64) -> Work {
        Work::matvec(self.n_in, self.n_out, self.bytes, batch)
    }

    /// One product on the GPU, its dispatch included, corrected by the calibrated shapes.
    fn gpu(&self, hw: &HardwareProfile) -> f64 {
        hw.gpu_product(&self.ty, self.n_in, self.n_out, self.bytes)
    }

    /// One product over `batch` tokens on the CPU's pool: shaped for one token, the roofline
    /// (which has the compute roof) for more.
    fn cpu(&self, hw: &HardwareProfile, batch: u64) -> f64 {
        if batch == 1 {
            hw.cpu_product(&self.ty, self.n_in, self.n_out, self.bytes)
        } else {
            hw.cpu_matvec(&self.ty).predict(self.work(batch))
        }
    }
}

/// What one routed expert (gate, up, down in `mats`) adds to a MoE layer, from the profile's
/// experts calibrated on one side (`calibrated`: [`HardwareProfile::cpu_expert`] or
/// [`HardwareProfile::gpu_expert`]); `None` without them.
fn expert_seconds(
    mats: &[Mat],
    calibrated: impl Fn(&WeightType, u64, u64, u64) -> Option<f64>,
) -> Option<f64> {
    let gate = mats.first()?;
    calibrated(&gate.ty, gate.n_in, gate.n_out, bytes(mats))
}

/// What one routed expert (gate, up, down in `mats`) adds to a MoE layer on `side`: as
/// calibrated ([`expert_seconds`]), else the sum of its products' marginal times.
fn one_expert(h: &HardwareProfile, side: Side, mats: &[Mat]) -> f64 {
    let calibrated = |t: &WeightType, k, n, b| match side {
        Side::Cpu => h.cpu_expert(t, k, n, b),
        Side::Gpu => h.gpu_expert(t, k, n, b),
    };
    expert_seconds(mats, calibrated).unwrap_or_else(|| {
        mats.iter()
            .map(|m| match side {
                Side::Cpu => h.cpu_product_marginal(&m.ty, m.n_in, m.n_out, m.bytes),
                Side::Gpu => h.gpu_product_marginal(&m.ty, m.n_in, m.n_out, m.bytes),
            })
            .sum()
    })
}

fn bytes(mats: &[Mat]) -> u64 {
    mats.iter().map(|m| m.bytes).sum()
}

#[derive(Debug, Clone, Default)]
struct LayerMats {
    qkv: Vec<Mat>,
    wo: Vec<Mat>,
    /// A dense layer's gate, up and down.
    ffn: Vec<Mat>,
    router: Vec<Mat>,
    /// One routed expert's gate, up and down.
    expert: Vec<Mat>,
    /// The shared expert's gate input, gate, up and down.
    shared: Vec<Mat>,
}

/// Which side of a MoE layer an expert ran on, and how it got there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExpertSplit {
    /// Experts the GPU ran from VRAM (resident, or copied in this step).
    pub gpu: u64,
    /// Experts copied into VRAM in this step.
    pub fetched: u64,
    /// Experts the CPU ran.
    pub cpu: u64,
}

impl ExpertSplit {
    pub fn of(s: &LayerExpertStats) -> ExpertSplit {
        ExpertSplit {
            gpu: s.hits + s.fetched,
            fetched: s.fetched,
            cpu: s.cpu,
        }
    }
}

/// A model's matrices per op group, and the hardware profile predictions come from.
pub struct Costs {
    hardware: Option<Arc<HardwareProfile>>,
    embd_row: u64,
    output: Vec<Mat>,
    layers: Vec<LayerMats>,
    /// Routed experts per token.
    k: u64,
}

impl Costs {
    pub fn new(model: &Model, hardware: Option<Arc<HardwareProfile>>) -> Costs {
        let layers = model
            .layers
            .iter()
            .map(|l| {
                let a = &l.attn;
                let mut m = LayerMats {
                    qkv: vec![Mat::of(&a.wq), Mat::of(&a.wk), Mat::of(&a.wv)],
                    wo: vec![Mat::of(&a.wo)],
                    ..LayerMats::default()
                };
                match &l.ffn {
                    Ffn::Dense { gate, up, down } => {
                        m.ffn = vec![Mat::of(gate), Mat::of(up), Mat::of(down)];
                    }
                    Ffn::Moe(moe) => {
                        m.router = vec![Mat::of(&moe.router)];
                        m.expert = vec![Mat::of(&moe.gate), Mat::of(&moe.up), Mat::of(&moe.down)];
                        if let Some(s) = &moe.shared {
                            m.shared = vec![
                                Mat::of(&s.gate_inp),
                                Mat::of(&s.gate),
                                Mat::of(&s.up),
                                Mat::of(&s.down),
                            ];
                        }
                    }
                }
                m
            })
            .collect();
        Costs {
            hardware,
            embd_row: model.token_embd.row_bytes(),
            output: vec![Mat::of(&model.output)],
            layers,
            k: model.config.moe.map_or(0, |m| m.n_expert_used as u64),
        }
    }

    /// Bytes of one routed expert of `layer` (0 for a dense layer).
    pub fn expert_bytes(&self, layer: usize) -> u64 {
        self.layers.get(layer).map_or(0, |l| bytes(&l.expert))
    }

    /// The source and key of the hardware profile, for the totals; empty without one.
    pub fn hardware_name(&self) -> String {
        self.hardware.as_ref().map_or_else(String::new, |h| {
            format!("{} ({}, {})", h.source, h.key.device, h.key.cpu)
        })
    }

    /// Predicted time of CPU rows: every row of a CPU step. The engine has filled in the
    /// weight bytes; each group's matrices are one product over the step's tokens.
    pub fn annotate_cpu(&self, step: &mut pb::ProfileStep) {
        let Some(hw) = self.hardware.as_deref() else {
            return;
        };
        let tokens = u64::from(step.tokens.max(1));
        for r in &mut step.rows {
            let layer = r.layer.and_then(|l| self.layers.get(l as usize));
            let cpu =
                |mats: &[Mat], batch: u64| -> f64 { mats.iter().map(|m| m.cpu(hw, batch)).sum() };
            let seconds = match (r.op.as_str(), layer) {
                ("embedding", _) => Some(
                    Roofline::memory_bound(hw.cpu.memory_bandwidth, 0.0)
                        .predict(Work::transfer(self.embd_row * tokens)),
                ),
                ("output_head", _) => Some(cpu(&self.output, tokens)),
                ("qkv", Some(l)) => Some(cpu(&l.qkv, tokens)),
                ("attn_output", Some(l)) => Some(cpu(&l.wo, tokens)),
                ("ffn", Some(l)) => Some(cpu(&l.ffn, tokens)),
                ("router", Some(l)) => Some(cpu(&l.router, tokens)),
                ("shared_expert", Some(l)) => Some(cpu(&l.shared, tokens)),
                ("experts", Some(l)) if !r.experts.is_empty() => {
                    // Each chosen expert multiplies the tokens routed to it: on average the
                    // step's k routings per token spread over the experts chosen.
                    let n = r.experts.len() as u64;
                    let batch = (tokens * self.k).div_ceil(n).max(1);
                    // One token: the layer's two jobs and its experts as calibrated.
                    let calibrated = (batch == 1)
                        .then(|| expert_seconds(&l.expert, |t, k, n, b| hw.cpu_expert(t, k, n, b)))
                        .flatten()
                        .map(|one| 2.0 * hw.cpu.dispatch_s + n as f64 * one);
                    Some(calibrated.unwrap_or_else(|| n as f64 * cpu(&l.expert, batch)))
                }
                _ => None,
            };
            r.predicted_ns = seconds.map(ns);
        }
    }

    /// Weight bytes, bytes moved and predicted time of a GPU step's rows. `position` is the
    /// step's first token's; `splits` gives each MoE layer's experts by side (`None` for dense
    /// layers); `ssd_bytes` the bytes the RAM tier read per layer. A host row `cpu_experts`
    /// gets the CPU's share of every layer.
    pub fn annotate_gpu(
        &self,
        step: &mut pb::ProfileStep,
        position: u64,
        splits: &[Option<ExpertSplit>],
        ssd_bytes: &[Option<u64>],
    ) {
        let hw = self.hardware.as_deref();
        let tokens = u64::from(step.tokens.max(1));
        let gpu = |mats: &[Mat]| -> Option<f64> {
            let hw = hw?;
            Some(mats.iter().map(|m| tokens as f64 * m.gpu(hw)).sum())
        };
        let mut cpu_bytes = 0u64;
        let mut cpu_seconds = 0.0;
        for r in step.rows.iter_mut().filter(|r| r.device == "gpu") {
            let il = r.layer.map(|l| l as usize);
            let layer = il.and_then(|l| self.layers.get(l));
            r.ram_to_vram_bytes = Some(0);
            let (weights, seconds) = match (r.op.as_str(), layer) {
                ("embedding", _) => (
                    self.embd_row * tokens,
                    hw.map(|h| {
                        h.gpu_stream()
                            .predict(Work::transfer(self.embd_row * tokens))
                    }),
                ),
                ("output_head", _) => (bytes(&self.output) * tokens, gpu(&self.output)),
                ("attention", Some(l)) => {
                    let mats: Vec<Mat> = l.qkv.iter().chain(&l.wo).cloned().collect();
                    // Each token's attention over the cache, where calibrated.
                    let width = l.qkv.first().map_or(0, |q| q.n_out);
                    let attend = hw
                        .and_then(|h| {
                            (position..position + tokens)
                                .map(|p| attention_seconds(&h.gpu.attention, width, p))
                                .sum::<Option<f64>>()
                        })
                        .unwrap_or(0.0);
                    (bytes(&mats) * tokens, gpu(&mats).map(|s| s + attend))
                }
                ("ffn", Some(l)) => (bytes(&l.ffn) * tokens, gpu(&l.ffn)),
                ("experts", Some(l)) => {
                    let il = il.expect("a layer row");
                    let split = splits.get(il).copied().flatten().unwrap_or_default();
                    let expert = bytes(&l.expert);
                    let fixed: Vec<Mat> = l.router.iter().chain(&l.shared).cloned().collect();
                    let fetched = split.fetched * expert;
                    r.ram_to_vram_bytes = Some(fetched);
                    r.ssd_to_ram_bytes = ssd_bytes.get(il).copied().flatten();
                    cpu_bytes += split.cpu * expert;
                    let cpu_side = hw.map(|h| {
                        let run = one_expert(h, Side::Cpu, &l.expert) * split.cpu as f64;
                        let read = r.ssd_to_ram_bytes.filter(|&b| b > 0).map_or(0.0, |b| {
                            h.ssd_read(h.best_tile()).predict(Work::transfer(b))
                        });
                        run + read
                    });
                    if let Some(c) = cpu_side {
                        cpu_seconds += c;
                    }
                    let gpu_side = hw.map(|h| {
                        let run = one_expert(h, Side::Gpu, &l.expert) * split.gpu as f64;
                        let copy = if fetched > 0 {
                            h.host_to_device().predict(Work::transfer(fetched))
                        } else {
                            0.0
                        };
                        run + copy
                    });
                    let seconds = gpu(&fixed)
                        .zip(gpu_side.zip(cpu_side))
                        .map(|(f, (g, c))| f + g.max(c));
                    (bytes(&fixed) * tokens + split.gpu * expert, seconds)
                }
                _ => (0, None),
            };
            r.weight_bytes = weights;
            r.predicted_ns = seconds.map(ns);
        }
        if let Some(r) = step.rows.iter_mut().find(|r| r.op == "cpu_experts") {
            r.weight_bytes = cpu_bytes;
            r.predicted_ns = hw.map(|_| ns(cpu_seconds));
        }
    }

    /// Completes a profile's totals from its decode steps (`decode`: each step's rows, as
    /// sent): each link's bandwidth, where the predictions come from, and the busiest link on
    /// the bottleneck line.
    /// The products a decode step timed, for refining the hardware profile's shape points
    /// ([`ObservedProducts`]). Only rows that are products and nothing else count: on the CPU
    /// the projections, the dense FFN, the router, the shared expert, the chosen experts and
    /// the head; on the GPU the dense FFN and the head (its attention and MoE rows hold
    /// kernels that read no weights). A row of several products is shared out in proportion
    /// to each one's prediction. Prompt steps, which run many tokens a product, do not count.
    pub fn observe(&self, step: &pb::ProfileStep, out: &mut ObservedProducts) {
        let Some(hw) = self.hardware.as_deref() else {
            return;
        };
        if step.tokens != 1 {
            return;
        }
        for r in &step.rows {
            let layer = r.layer.and_then(|l| self.layers.get(l as usize));
            let (side, mats): (Side, Vec<&Mat>) = match (r.device.as_str(), r.op.as_str(), layer) {
                ("cpu", "output_head", _) => (Side::Cpu, self.output.iter().collect()),
                ("cpu", "qkv", Some(l)) => (Side::Cpu, l.qkv.iter().collect()),
                ("cpu", "attn_output", Some(l)) => (Side::Cpu, l.wo.iter().collect()),
                ("cpu", "ffn", Some(l)) => (Side::Cpu, l.ffn.iter().collect()),
                ("cpu", "router", Some(l)) => (Side::Cpu, l.router.iter().collect()),
                ("cpu", "shared_expert", Some(l)) => (Side::Cpu, l.shared.iter().collect()),
                ("cpu", "experts", Some(l)) => (
                    Side::Cpu,
                    r.experts.iter().flat_map(|_| l.expert.iter()).collect(),
                ),
                ("gpu", "ffn", Some(l)) => (Side::Gpu, l.ffn.iter().collect()),
                ("gpu", "output_head", _) => (Side::Gpu, self.output.iter().collect()),
                _ => continue,
            };
            let predicted: Vec<f64> = mats
                .iter()
                .map(|m| match side {
                    Side::Gpu => m.gpu(hw),
                    Side::Cpu => m.cpu(hw, 1),
                })
                .collect();
            let sum: f64 = predicted.iter().sum();
            if mats.is_empty() || r.measured_ns == 0 || sum.is_nan() || sum <= 0.0 {
                continue;
            }
            let scale = r.measured_ns as f64 * 1e-9 / sum;
            for (m, p) in mats.iter().zip(&predicted) {
                out.observe(side, &m.ty, m.n_in, m.n_out, m.bytes, p * scale);
            }
        }
    }

    pub fn complete_totals(&self, totals: &mut pb::ProfileTotals, decode: &[Vec<pb::ProfileRow>]) {
        totals.bandwidths = self.bandwidths(decode);
        totals.hardware_profile = self.hardware_name();
        if let Some(link) = busiest_link(&totals.bandwidths) {
            totals.bottleneck = format!("{}; busiest link: {link}", totals.bottleneck);
        }
    }

    /// The decode steps' bandwidths per link, against the hardware profile's limits: each
    /// link's bytes over the measured time of the rows that carried them.
    pub fn bandwidths(&self, decode: &[Vec<pb::ProfileRow>]) -> Vec<pb::Bandwidth> {
        let hw = self.hardware.as_deref();
        let n = decode.len().max(1) as u64;
        let rows = || decode.iter().flatten();
        let link = |name: &str, carried: &dyn Fn(&pb::ProfileRow) -> u64, limit: Option<f64>| {
            let (bytes, time) = rows()
                .map(|r| (carried(r), r.measured_ns))
                .filter(|&(b, _)| b > 0)
                .fold((0u64, 0u64), |(b, t), (rb, rt)| (b + rb, t + rt));
            (bytes > 0).then(|| pb::Bandwidth {
                link: name.into(),
                bytes: bytes / n,
                bytes_per_second: if time == 0 {
                    0.0
                } else {
                    bytes as f64 / (time as f64 * 1e-9)
                },
                limit_bytes_per_second: limit,
            })
        };
        let ssd_limit = hw.map(|h| h.ssd_bandwidth(h.best_tile()));
        [
            link("ssd", &|r| r.ssd_to_ram_bytes.unwrap_or(0), ssd_limit),
            link(
                "pcie",
                &|r| r.ram_to_vram_bytes.unwrap_or(0),
                hw.map(|h| h.pcie.bandwidth),
            ),
            link(
                "cpu",
                &|r| if r.device == "cpu" { r.weight_bytes } else { 0 },
                hw.map(|h| h.cpu.memory_bandwidth),
            ),
            link(
                "gpu",
                &|r| match r.device.as_str() {
                    "gpu" | "both" => r.weight_bytes,
                    _ => 0,
                },
                hw.map(|h| h.gpu.bandwidth),
            ),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// The link closest to its limit, as a clause for the bottleneck line: "ssd at 53% of its
/// 2.08 GB/s"; `None` without limits.
pub fn busiest_link(bandwidths: &[pb::Bandwidth]) -> Option<String> {
    bandwidths
        .iter()
        .filter_map(|b| {
            let limit = b.limit_bytes_per_second.filter(|&l| l > 0.0)?;
            Some((b, b.bytes_per_second / limit, limit))
        })
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(b, share, limit)| {
            format!(
                "{} at {:.0}% of its {:.2} GB/s",
                b.link,
                100.0 * share,
                limit / 1e9
            )
        })
}

fn ns(seconds: f64) -> u64 {
    (seconds * 1e9).round() as u64
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::synth::SynthModel;

    /// A one-file tiny qwen3moe model (F16) in a temporary directory.
    pub(crate) fn tiny_moe() -> (tempfile::TempDir, Model) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        SynthModel::from_name("tiny-qwen3moe", "F16".parse().unwrap(), 1)
            .unwrap()
            .write(&path, false, |_, _| {})
            .unwrap();
        let model = Model::open(&path).unwrap();
        (dir, model)
    }

    /// The file's bytes of the named tensors of layer `il` (`blk.{il}.{name}.weight`).
    fn file_bytes(model: &Model, il: usize, names: &[&str]) -> u64 {
        names
            .iter()
            .map(|n| {
                model
                    .file()
                    .tensor(&format!("blk.{il}.{n}.weight"))
                    .unwrap_or_else(|| panic!("tensor {n}"))
                    .n_bytes
            })
            .sum()
    }

    fn row(layer: Option<u32>, op: &str, device: &str, ns: u64) -> pb::ProfileRow {
        pb::ProfileRow {
            layer,
            op: op.into(),
            device: device.into(),
            measured_ns: ns,
            ..Default::default()
        }
    }

    fn gpu_step(tokens: u32) -> pb::ProfileStep {
        pb::ProfileStep {
            tokens,
            rows: vec![
                row(None, "embedding", "gpu", 10),
                row(Some(0), "attention", "gpu", 100),
                row(Some(0), "experts", "gpu", 1_000),
                row(None, "output_head", "gpu", 50),
                row(None, "cpu_experts", "cpu", 400),
                row(None, "host_wait", "cpu", 600),
            ],
            ..Default::default()
        }
    }

    fn h200() -> Arc<HardwareProfile> {
        Arc::new(
            spillway_sched::simulate::shipped_profile("h200")
                .unwrap()
                .unwrap(),
        )
    }

    /// A GPU attention row adds each token's calibrated attention at its position to its
    /// products; without calibrated points it predicts the products alone.
    #[test]
    fn gpu_attention_rows_add_calibrated_attention_at_their_positions() {
        use spillway_sched::profile::AttentionPoint;
        let (_dir, model) = tiny_moe();
        let width = model.layers[0].attn.wq.n_out as u64;
        let plain = h200();
        let mut hw = (*plain).clone();
        hw.gpu.attention = [(16, 10e-6), (1024, 30e-6)]
            .into_iter()
            .map(|(position, seconds)| AttentionPoint {
                query_width: width,
                position,
                seconds,
            })
            .collect();
        let n_layer = model.layers.len();
        let attention_ns = |hw: &Arc<HardwareProfile>, position: u64, tokens: u32| {
            let mut step = gpu_step(tokens);
            let costs = Costs::new(&model, Some(hw.clone()));
            costs.annotate_gpu(
                &mut step,
                position,
                &vec![None; n_layer],
                &vec![None; n_layer],
            );
            step.rows[1].predicted_ns.unwrap() as f64 * 1e-9
        };
        let hw = Arc::new(hw);
        let products = attention_ns(&plain, 520, 1);
        assert_eq!(
            products,
            attention_ns(&plain, 16, 1),
            "no points: products only"
        );
        // Halfway between the points: 20 µs.
        let at = attention_ns(&hw, 520, 1) - products;
        assert!((at - 20e-6).abs() < 1e-8, "{at}");
        // Two tokens: positions 16 and 17.
        let two = attention_ns(&hw, 16, 2) - 2.0 * products;
        let want = 10e-6 + (10e-6 + 20e-6 / 1008.0);
        assert!((two - want).abs() < 1e-8, "{two} against {want}");
    }

    /// A GPU row's weight bytes are the file's bytes of the matrices the group read on the
    /// GPU, per token; a MoE row's are the router and the experts run from VRAM; the CPU's
    /// experts go to the host row; copies into VRAM and SSD reads land on the MoE row.
    #[test]
    fn gpu_rows_read_the_files_matrices() {
        let (_dir, model) = tiny_moe();
        let n_expert = model.config.moe.unwrap().n_expert as u64;
        let costs = Costs::new(&model, None);
        let expert = file_bytes(
            &model,
            0,
            &["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"],
        ) / n_expert;
        assert_eq!(costs.expert_bytes(0), expert);
        let split = ExpertSplit {
            gpu: 3,
            fetched: 1,
            cpu: 2,
        };
        let n_layer = model.layers.len();
        let mut splits = vec![None; n_layer];
        splits[0] = Some(split);
        let mut ssd = vec![None; n_layer];
        ssd[0] = Some(12_345);
        for tokens in [1, 3] {
            let mut step = gpu_step(tokens);
            costs.annotate_gpu(&mut step, 0, &splits, &ssd);
            let t = u64::from(tokens);
            let r = &step.rows;
            let attn = file_bytes(&model, 0, &["attn_q", "attn_k", "attn_v", "attn_output"]);
            assert_eq!(r[1].weight_bytes, attn * t, "{tokens} tokens: attention");
            let router = file_bytes(&model, 0, &["ffn_gate_inp"]);
            assert_eq!(r[2].weight_bytes, router * t + 3 * expert, "experts");
            assert_eq!(
                (r[2].ram_to_vram_bytes, r[2].ssd_to_ram_bytes),
                (Some(expert), Some(12_345))
            );
            let embd = model.file().tensor("token_embd.weight").unwrap();
            assert_eq!(r[0].weight_bytes, embd.n_bytes / embd.dims[1] * t);
            assert_eq!(r[4].weight_bytes, 2 * expert, "the CPU's experts");
            assert_eq!((r[5].weight_bytes, r[5].predicted_ns), (0, None));
            assert!(r.iter().all(|r| r.predicted_ns.is_none()), "no profile");
            assert_eq!(r[1].ram_to_vram_bytes, Some(0));
            assert_eq!(r[4].ram_to_vram_bytes, None, "a host row");
        }
    }

    /// With a hardware profile every row that reads weights gets the roofline's prediction;
    /// a MoE row waits for the slower of its GPU and CPU sides.
    #[test]
    fn predictions_follow_the_hardware_profile() {
        let (_dir, model) = tiny_moe();
        let hw = h200();
        let costs = Costs::new(&model, Some(hw.clone()));
        let n_layer = model.layers.len();
        let predict = |split: ExpertSplit| {
            let mut splits = vec![None; n_layer];
            splits[0] = Some(split);
            let mut step = gpu_step(1);
            costs.annotate_gpu(&mut step, 0, &splits, &vec![None; n_layer]);
            step
        };
        let gpu_only = predict(ExpertSplit {
            gpu: 2,
            fetched: 0,
            cpu: 0,
        });
        let r = &gpu_only.rows;
        let wq = &model.layers[0].attn.wq;
        let one = hw
            .gpu_matvec(&WeightType::new(wq.ty.name()))
            .predict(Work::matvec(wq.n_in as u64, wq.n_out as u64, wq.bytes(), 1));
        assert!(
            r[1].predicted_ns.unwrap() >= ns(one),
            "attention reads wq and more"
        );
        assert!(r.iter().take(5).all(|r| r.predicted_ns.is_some()), "{r:?}");
        assert_eq!(r[5].predicted_ns, None, "waiting is not predicted");
        let both = predict(ExpertSplit {
            gpu: 1,
            fetched: 0,
            cpu: 1,
        });
        let on_cpu = predict(ExpertSplit {
            gpu: 0,
            fetched: 0,
            cpu: 2,
        });
        // The CPU is slower than the GPU: moving an expert to it lengthens the layer.
        let e = |s: &pb::ProfileStep| s.rows[2].predicted_ns.unwrap();
        assert!(e(&gpu_only) < e(&both) && e(&both) < e(&on_cpu));
        assert!(on_cpu.rows[4].predicted_ns > both.rows[4].predicted_ns);
        assert!(costs.hardware_name().contains(&hw.key.device));

        let mut cpu = pb::ProfileStep {
            tokens: 4,
            rows: vec![
                row(Some(0), "qkv", "cpu", 1),
                row(Some(0), "rope_cache", "cpu", 1),
                row(Some(0), "experts", "cpu", 1),
            ],
            ..Default::default()
        };
        cpu.rows[2].experts = vec![1, 5];
        costs.annotate_cpu(&mut cpu);
        let a = &model.layers[0].attn;
        let qkv: f64 = [&a.wq, &a.wk, &a.wv]
            .iter()
            .map(|m| {
                hw.cpu_matvec(&WeightType::new(m.ty.name()))
                    .predict(Work::matvec(m.n_in as u64, m.n_out as u64, m.bytes(), 4))
            })
            .sum();
        assert_eq!(cpu.rows[0].predicted_ns, Some(ns(qkv)));
        assert_eq!(cpu.rows[1].predicted_ns, None, "no weights");
        assert!(cpu.rows[2].predicted_ns.unwrap() > 0);
    }

    /// Each link's bytes over the time of the rows that carried them, with the profile's limit.
    #[test]
    fn bandwidths_divide_the_bytes_by_the_rows_that_carried_them() {
        let (_dir, model) = tiny_moe();
        let hw = h200();
        let costs = Costs::new(&model, Some(hw.clone()));
        let mut a = gpu_step(1);
        a.rows[2].ssd_to_ram_bytes = Some(3_000);
        a.rows[2].ram_to_vram_bytes = Some(1_000);
        a.rows[1].weight_bytes = 2_000;
        a.rows[4].weight_bytes = 800;
        let mut b = a.clone();
        b.rows[2].ssd_to_ram_bytes = Some(0);
        let bw = costs.bandwidths(&[a.rows, b.rows]);
        let links: Vec<_> = bw.iter().map(|b| b.link.as_str()).collect();
        assert_eq!(links, ["ssd", "pcie", "cpu", "gpu"]);
        // ssd: 3,000 bytes in one 1,000 ns row; a mean of 1,500 a step.
        assert_eq!(bw[0].bytes, 1_500);
        assert!((bw[0].bytes_per_second / 3e9 - 1.0).abs() < 1e-12);
        assert!((bw[1].bytes_per_second / 1e9 - 1.0).abs() < 1e-12);
        assert!((bw[2].bytes_per_second / 2e9 - 1.0).abs() < 1e-12);
        assert_eq!(bw[3].limit_bytes_per_second, Some(hw.gpu.bandwidth));
        assert!(Costs::new(&model, None)
            .bandwidths(&[gpu_step(1).rows])
            .is_empty());
        // The link closest to its limit names the bottleneck's link.
        let share = |b: &pb::Bandwidth| b.bytes_per_second / b.limit_bytes_per_second.unwrap();
        let top = bw
            .iter()
            .max_by(|a, b| share(a).total_cmp(&share(b)))
            .unwrap();
        assert_eq!(
            busiest_link(&bw).unwrap(),
            format!(
                "{} at {:.0}% of its {:.2} GB/s",
                top.link,
                100.0 * share(top),
                top.limit_bytes_per_second.unwrap() / 1e9
            )
        );
        assert_eq!(busiest_link(&[]), None);
    }
}
