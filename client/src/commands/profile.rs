//! `spillway profile`: a prompt and some decode steps with the daemon's per-layer timers on.
//! Prints one row per layer and op group, averaged over the decode steps, then the totals and
//! the bottleneck; `--json` prints the same for scripts; `--trace FILE` writes the steps as
//! Chrome trace events (ui.perfetto.dev opens them): step ⊃ layer ⊃ op group, one track per
//! thread or queue that ran them: "engine" (the model's worker thread) and, for a model on a
//! Vulkan device, "gpu-compute" (its op groups timed by GPU timestamps); then what each thread
//! of the CPU pool ran ("cpu-worker-N", a slice per op group or expert) and each expert the
//! tile reader read from the SSD ("io_uring", with more lanes where reads overlap). The GPU's
//! copies run on its compute queue, so there is no transfer-queue track.
//!
//! Predicted times and the bandwidth limits need the daemon to have a hardware profile
//! (`spillwayd serve --hardware-profile`, or `spillwayd calibrate`); bytes moved between
//! tiers and expert-cache hits and misses come from models on a Vulkan device.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use serde::Serialize;
use serde_json::{json, Value};
use spillway_proto::v1 as pb;
use tonic::Request;

use crate::connect::Client;
use crate::exit::{self, Failure};

#[derive(Debug, Clone, Args)]
pub struct ProfileArgs {
    /// Model name (`spillway models`); default: the daemon's default model.
    #[arg(long, default_value = "")]
    pub model: String,
    /// The prompt text (tokenized by the daemon).
    #[arg(long, conflicts_with = "tokens")]
    pub prompt: Option<String>,
    /// A prompt of this many tokens [default: 32 when no --prompt is given].
    #[arg(long)]
    pub tokens: Option<u32>,
    /// Decode steps after the prompt.
    #[arg(long, default_value_t = 8)]
    pub steps: u32,
    /// Print the table as one JSON object.
    #[arg(long)]
    pub json: bool,
    /// Write the steps as Chrome trace-event JSON to FILE (opens in ui.perfetto.dev).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
}

/// One layer's op group over the decode steps.
#[derive(Debug, Serialize)]
struct Row {
    layer: Option<u32>,
    op: String,
    device: String,
    /// Mean per decode step.
    weight_bytes: f64,
    mean_us: f64,
    /// Of the decode steps' time.
    share: f64,
    /// Per decode step (MoE layers' routed experts).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    experts: Vec<Vec<u32>>,
    /// Means per decode step; null while the daemon does not report them.
    predicted_us: Option<f64>,
    ssd_to_ram_bytes: Option<f64>,
    ram_to_vram_bytes: Option<f64>,
    cache_hits: Option<f64>,
    cache_misses: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    model: String,
    layers: u32,
    prompt_tokens: u32,
    decode_steps: u32,
    prefill_ms: f64,
    prefill_tokens_per_second: f64,
    decode_tokens_per_second: f64,
    mean_step_us: f64,
    /// Mean per decode step.
    device_us: BTreeMap<String, f64>,
    cpu_bandwidth_bytes_per_second: f64,
    /// Per link that carried bytes in the decode steps.
    bandwidths: Vec<Bandwidth>,
    /// Where predictions and limits come from; empty without a hardware profile.
    hardware_profile: String,
    bottleneck: String,
    rows: Vec<Row>,
}

#[derive(Debug, Serialize)]
struct Bandwidth {
    /// ssd, pcie, cpu or gpu.
    link: String,
    /// Mean per decode step.
    bytes: u64,
    bytes_per_second: f64,
    limit_bytes_per_second: Option<f64>,
}

pub async fn run(client: &mut Client, args: &ProfileArgs) -> Result<(), Failure> {
    use pb::profile_request::Input;
    let input = match (&args.prompt, args.tokens) {
        (Some(text), _) => Input::Text(text.clone()),
        (None, n) => Input::TokenCount(n.unwrap_or(32)),
    };
    let req = pb::ProfileRequest {
        model: args.model.clone(),
        input: Some(input),
        steps: args.steps,
    };
    let mut stream = client.profile(Request::new(req)).await?.into_inner();
    let mut steps = Vec::new();
    while let Some(msg) = stream.message().await? {
        steps.push(msg);
    }
    let Some(totals) = steps.last().and_then(|s| s.totals.clone()) else {
        return Err(Failure::new(
            exit::FAILED,
            "the stream ended before the totals",
        ));
    };
    let model = if args.model.is_empty() {
        "the default model".to_string()
    } else {
        args.model.clone()
    };
    let report = report(model, &steps, totals);
    if let Some(path) = &args.trace {
        let text = serde_json::to_string(&trace(&report.model, &steps))
            .map_err(|e| Failure::new(exit::FAILED, e.to_string()))?;
        std::fs::write(path, text)
            .map_err(|e| Failure::new(exit::FAILED, format!("writing {}: {e}", path.display())))?;
    }
    let mut out = std::io::stdout().lock();
    // A closed pipe (`| head`) ends the output, not the program with an error.
    let _ = if args.json {
        let json = serde_json::to_string(&report)
            .map_err(|e| Failure::new(exit::FAILED, e.to_string()))?;
        writeln!(out, "{json}")
    } else {
        out.write_all(table(&report).as_bytes())
    };
    if let Some(path) = &args.trace {
        eprintln!(
            "spillway: trace written to {} (open it in ui.perfetto.dev)",
            path.display()
        );
    }
    Ok(())
}

fn report(model: String, steps: &[pb::ProfileStep], totals: pb::ProfileTotals) -> Report {
    let decode: Vec<&pb::ProfileStep> = steps.iter().filter(|s| s.step > 0).collect();
    let n = decode.len().max(1) as f64;
    let decode_ns: f64 = decode.iter().map(|s| s.duration_ns as f64).sum();
    let mut order: Vec<(Option<u32>, String, String)> = Vec::new();
    let mut rows: BTreeMap<(Option<u32>, String, String), Row> = BTreeMap::new();
    for r in decode.iter().flat_map(|s| &s.rows) {
        let key = (r.layer, r.op.clone(), r.device.clone());
        let row = rows.entry(key.clone()).or_insert_with(|| {
            order.push(key);
            Row {
                layer: r.layer,
                op: r.op.clone(),
                device: r.device.clone(),
                weight_bytes: 0.0,
                mean_us: 0.0,
                share: 0.0,
                experts: Vec::new(),
                predicted_us: None,
                ssd_to_ram_bytes: None,
                ram_to_vram_bytes: None,
                cache_hits: None,
                cache_misses: None,
            }
        });
        row.weight_bytes += r.weight_bytes as f64 / n;
        row.mean_us += r.measured_ns as f64 / 1e3 / n;
        if decode_ns > 0.0 {
            row.share += r.measured_ns as f64 / decode_ns;
        }
        if !r.experts.is_empty() {
            row.experts.push(r.experts.clone());
        }
        // Means per decode step of what the daemon reports; absent while it reports none.
        let mean = |acc: &mut Option<f64>, v: Option<f64>| {
            if let Some(v) = v {
                *acc = Some(acc.unwrap_or(0.0) + v / n);
            }
        };
        mean(
            &mut row.predicted_us,
            r.predicted_ns.map(|v| v as f64 / 1e3),
        );
        mean(
            &mut row.ssd_to_ram_bytes,
            r.ssd_to_ram_bytes.map(|v| v as f64),
        );
        mean(
            &mut row.ram_to_vram_bytes,
            r.ram_to_vram_bytes.map(|v| v as f64),
        );
        mean(&mut row.cache_hits, r.cache_hits.map(f64::from));
        mean(&mut row.cache_misses, r.cache_misses.map(f64::from));
    }
    let prefill = steps.iter().find(|s| s.step == 0);
    Report {
        model,
        layers: totals.layers,
        prompt_tokens: totals.prompt_tokens,
        decode_steps: totals.decode_steps,
        prefill_ms: prefill.map_or(0.0, |p| p.duration_ns as f64 / 1e6),
        prefill_tokens_per_second: totals.prefill_tokens_per_second,
        decode_tokens_per_second: totals.decode_tokens_per_second,
        mean_step_us: decode_ns / n / 1e3,
        device_us: totals
            .device_times
            .iter()
            .map(|d| (d.device.clone(), d.ns as f64 / 1e3))
            .collect(),
        cpu_bandwidth_bytes_per_second: totals.cpu_bandwidth_bytes_per_second,
        bandwidths: totals
            .bandwidths
            .iter()
            .map(|b| Bandwidth {
                link: b.link.clone(),
                bytes: b.bytes,
                bytes_per_second: b.bytes_per_second,
                limit_bytes_per_second: b.limit_bytes_per_second,
            })
            .collect(),
        hardware_profile: totals.hardware_profile,
        bottleneck: totals.bottleneck,
        rows: order
            .into_iter()
            .map(|k| rows.remove(&k).expect("a row per key"))
            .collect(),
    }
}

/// Distinct experts over the steps, shortened to fit a column.
fn experts_cell(per_step: &[Vec<u32>]) -> String {
    let mut all: Vec<u32> = per_step.iter().flatten().copied().collect();
    all.sort_unstable();
    all.dedup();
    let mut s = all.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    if s.len() > 24 {
        let cut = s[..21].rfind(',').unwrap_or(21);
        s.truncate(cut);
        s.push_str(",…");
    }
    s
}

fn table(r: &Report) -> String {
    let mut t = format!(
        "{}: {} layers, {} prompt tokens, {} decode steps; per decode step, means over the steps\n",
        r.model, r.layers, r.prompt_tokens, r.decode_steps
    );
    t.push_str(&format!(
        "{:>5}  {:<13} {:<6} {:>10} {:>10} {:>6}  {:>10}  {:>9}  {:>9}  {:>9}  {}\n",
        "layer",
        "op",
        "device",
        "weight MB",
        "mean µs",
        "share",
        "predicted",
        "SSD MB",
        "PCIe MB",
        "hit/miss",
        "experts"
    ));
    for row in &r.rows {
        let layer = row.layer.map_or("-".to_string(), |l| l.to_string());
        let predicted = row
            .predicted_us
            .map_or("-".to_string(), |p| format!("{p:.1}"));
        let hits = match (row.cache_hits, row.cache_misses) {
            (Some(h), Some(m)) => format!("{h:.1}/{m:.1}"),
            _ => "-".to_string(),
        };
        let mb = |b: Option<f64>| b.map_or("-".to_string(), |b| format!("{:.3}", b / 1e6));
        let (ssd, pcie) = (mb(row.ssd_to_ram_bytes), mb(row.ram_to_vram_bytes));
        t.push_str(&format!(
            "{layer:>5}  {:<13} {:<6} {:>10.3} {:>10.1} {:>5.1}%  {predicted:>10}  {ssd:>9}  {pcie:>9}  {hits:>9}  {}\n",
            row.op,
            row.device,
            row.weight_bytes / 1e6,
            row.mean_us,
            100.0 * row.share,
            experts_cell(&row.experts)
        ));
    }
    let devices = r
        .device_us
        .iter()
        .map(|(d, us)| format!("{d} {:.2} ms", us / 1e3))
        .collect::<Vec<_>>()
        .join(", ");
    t.push_str(&format!(
        "prefill: {} tokens in {:.2} ms, {:.1} tok/s\n",
        r.prompt_tokens, r.prefill_ms, r.prefill_tokens_per_second
    ));
    t.push_str(&format!(
        "decode: {:.1} tok/s, {:.2} ms per step ({devices})",
        r.decode_tokens_per_second,
        r.mean_step_us / 1e3,
    ));
    // Only the CPU engine counts the weight bytes its op groups read.
    if r.cpu_bandwidth_bytes_per_second > 0.0 {
        t.push_str(&format!(
            "; CPU weight bandwidth {:.2} GB/s",
            r.cpu_bandwidth_bytes_per_second / 1e9
        ));
    }
    t.push('\n');
    if !r.bandwidths.is_empty() {
        let links = r
            .bandwidths
            .iter()
            .map(|b| {
                let mut s = format!(
                    "{} {:.2} GB/s ({:.2} MB a step)",
                    b.link,
                    b.bytes_per_second / 1e9,
                    b.bytes as f64 / 1e6
                );
                if let Some(limit) = b.limit_bytes_per_second.filter(|&l| l > 0.0) {
                    s.push_str(&format!(
                        " of {:.2}, {:.0}%",
                        limit / 1e9,
                        100.0 * b.bytes_per_second / limit
                    ));
                }
                s
            })
            .collect::<Vec<_>>()
            .join("; ");
        t.push_str(&format!("bandwidth: {links}\n"));
    }
    if r.hardware_profile.is_empty() {
        t.push_str(
            "predicted: not available (start the daemon with --hardware-profile, or run `spillwayd calibrate` first)\n",
        );
    } else {
        t.push_str(&format!("predicted from: {}\n", r.hardware_profile));
    }
    t.push_str(&format!("bottleneck: {}\n", r.bottleneck));
    t
}

/// Chrome trace events: per track, each step, its layers and their op groups as nested
/// complete ("X") events, in microseconds from the profile's start.
fn trace(model: &str, steps: &[pb::ProfileStep]) -> Value {
    const PID: u32 = 1;
    let us = |ns: u64| ns as f64 / 1e3;
    // Each track's name and the device of its rows.
    let mut tracks: Vec<(String, String)> = Vec::new();
    let mut events = vec![json!({
        "name": "process_name", "ph": "M", "pid": PID,
        "args": {"name": format!("spillwayd: {model}")},
    })];
    let mut body = Vec::new();
    // Per slice track, the end of the last slice on each of its lanes: slices that overlap
    // (reads in flight together) go on lanes of their own, so every track's events nest.
    let mut lanes: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for s in steps {
        // Each track gets the step's event, then its layers and op groups.
        let mut on_track: BTreeMap<usize, Vec<&pb::ProfileRow>> = BTreeMap::new();
        for r in &s.rows {
            let tid = match tracks.iter().position(|t| t.0 == r.track) {
                Some(i) => i,
                None => {
                    tracks.push((r.track.clone(), r.device.clone()));
                    tracks.len() - 1
                }
            } + 1;
            on_track.entry(tid).or_default().push(r);
        }
        for (tid, rows) in on_track {
            body.push(json!({
                "name": if s.step == 0 {
                    format!("prefill ({} tokens)", s.tokens)
                } else {
                    format!("decode {}", s.step)
                },
                "cat": "step", "ph": "X", "pid": PID, "tid": tid,
                "ts": us(s.start_ns), "dur": us(s.duration_ns),
            }));
            let mut i = 0;
            while i < rows.len() {
                // Consecutive rows of one layer make its event.
                let layer = rows[i].layer;
                let j = i + rows[i..]
                    .iter()
                    .take_while(|r| r.layer == layer && layer.is_some())
                    .count()
                    .max(1);
                if let Some(l) = layer {
                    let start = rows[i].start_ns;
                    let end = rows[j - 1].start_ns + rows[j - 1].measured_ns;
                    body.push(json!({
                        "name": format!("layer {l}"), "cat": "layer", "ph": "X",
                        "pid": PID, "tid": tid,
                        "ts": us(s.start_ns + start), "dur": us(end - start),
                    }));
                }
                for r in &rows[i..j] {
                    let mut args = json!({
                        "device": r.device, "weight_bytes": r.weight_bytes,
                    });
                    if !r.experts.is_empty() {
                        args["experts"] = json!(r.experts);
                    }
                    body.push(json!({
                        "name": r.op, "cat": "op", "ph": "X", "pid": PID, "tid": tid,
                        "ts": us(s.start_ns + r.start_ns), "dur": us(r.measured_ns),
                        "args": args,
                    }));
                }
                i = j;
            }
        }
        let mut slices: Vec<&pb::TraceSlice> = s.slices.iter().collect();
        slices.sort_by_key(|sl| sl.start_ns);
        for sl in slices {
            let (start, end) = (
                s.start_ns + sl.start_ns,
                s.start_ns + sl.start_ns + sl.duration_ns,
            );
            let ends = lanes.entry(sl.track.clone()).or_default();
            let lane = match ends.iter().position(|&e| e <= start) {
                Some(k) => k,
                None => {
                    ends.push(0);
                    ends.len() - 1
                }
            };
            ends[lane] = end;
            let name = if lane == 0 {
                sl.track.clone()
            } else {
                format!("{} #{lane}", sl.track)
            };
            let device = if sl.track == "io_uring" { "ssd" } else { "cpu" };
            let tid = match tracks.iter().position(|t| t.0 == name) {
                Some(i) => i,
                None => {
                    tracks.push((name, device.into()));
                    tracks.len() - 1
                }
            } + 1;
            let mut label = sl.name.clone();
            if let Some(l) = sl.layer {
                label = format!("layer {l} {label}");
            }
            if let Some(e) = sl.expert {
                label.push_str(&format!(" expert {e}"));
            }
            let mut args = json!({});
            if sl.bytes > 0 {
                args["bytes"] = json!(sl.bytes);
            }
            body.push(json!({
                "name": label, "cat": "slice", "ph": "X", "pid": PID, "tid": tid,
                "ts": us(start), "dur": us(sl.duration_ns), "args": args,
            }));
        }
    }
    for (i, (t, device)) in tracks.iter().enumerate() {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": PID, "tid": i + 1,
            "args": {"name": format!("{t} ({device})")},
        }));
    }
    events.extend(body);
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(layer: Option<u32>, op: &str, start: u64, dur: u64) -> pb::ProfileRow {
        pb::ProfileRow {
            layer,
            op: op.into(),
            device: "cpu".into(),
            weight_bytes: 100,
            measured_ns: dur,
            start_ns: start,
            track: "engine".into(),
            ..Default::default()
        }
    }

    fn steps() -> Vec<pb::ProfileStep> {
        let rows = vec![
            row(None, "embedding", 0, 10),
            row(Some(0), "qkv", 10, 30),
            row(Some(0), "experts", 40, 50),
            row(None, "output_head", 90, 10),
        ];
        (0..3)
            .map(|i| pb::ProfileStep {
                step: i,
                phase: if i == 0 { "prefill" } else { "decode" }.into(),
                tokens: 1,
                start_ns: 1000 * u64::from(i),
                duration_ns: 100,
                rows: rows.clone(),
                totals: None,
                slices: Vec::new(),
            })
            .collect()
    }

    #[test]
    fn rows_average_the_decode_steps_only() {
        let r = report("m".into(), &steps(), pb::ProfileTotals::default());
        assert_eq!(r.rows.len(), 4);
        assert_eq!(
            (r.rows[2].layer, r.rows[2].op.as_str()),
            (Some(0), "experts")
        );
        assert!((r.rows[2].mean_us - 0.05).abs() < 1e-9);
        assert!((r.rows[2].share - 0.5).abs() < 1e-9);
        assert!((r.mean_step_us - 0.1).abs() < 1e-9);
        assert!(table(&r).contains("not available"));
    }

    /// Bytes moved per tier and predictions are means per decode step; the totals give each
    /// link against its limit and name the hardware profile.
    #[test]
    fn moved_bytes_and_bandwidths_are_shown() {
        let mut steps = steps();
        for s in &mut steps {
            s.rows[2].ssd_to_ram_bytes = Some(2_000_000 * u64::from(s.step));
            s.rows[2].predicted_ns = Some(40);
        }
        let totals = pb::ProfileTotals {
            bandwidths: vec![pb::Bandwidth {
                link: "ssd".into(),
                bytes: 3_000_000,
                bytes_per_second: 1.5e9,
                limit_bytes_per_second: Some(2e9),
            }],
            hardware_profile: "measured (GPU, CPU)".into(),
            ..Default::default()
        };
        let r = report("m".into(), &steps, totals);
        // Decode steps 1 and 2 moved 2 and 4 MB.
        assert_eq!(r.rows[2].ssd_to_ram_bytes, Some(3e6));
        assert_eq!(r.rows[2].predicted_us, Some(0.04));
        let t = table(&r);
        assert!(
            t.contains("ssd 1.50 GB/s (3.00 MB a step) of 2.00, 75%"),
            "{t}"
        );
        assert!(t.contains("predicted from: measured (GPU, CPU)"), "{t}");
        assert!(t.contains("3.000"), "{t}");
    }

    /// Worker and read slices get tracks of their own; reads in flight together go on lanes
    /// of their own track so that events on a track never overlap.
    #[test]
    fn slices_get_tracks_and_overlapping_reads_lanes() {
        let mut steps = steps();
        let slice = |track: &str, start, dur, expert| pb::TraceSlice {
            track: track.into(),
            name: "read".into(),
            layer: Some(0),
            expert: Some(expert),
            start_ns: start,
            duration_ns: dur,
            bytes: 4096,
        };
        steps[1].slices = vec![
            slice("io_uring", 0, 50, 1),
            slice("io_uring", 10, 30, 2),
            slice("io_uring", 60, 10, 3),
            slice("cpu-worker-1", 40, 20, 1),
        ];
        let t = trace("m", &steps);
        let events = t["traceEvents"].as_array().unwrap();
        let tid_of = |name: &str| {
            events
                .iter()
                .find(|e| e["name"] == "thread_name" && e["args"]["name"] == name)
                .unwrap_or_else(|| panic!("no track {name}"))["tid"]
                .as_u64()
                .unwrap()
        };
        let (ring, lane, worker) = (
            tid_of("io_uring (ssd)"),
            tid_of("io_uring #1 (ssd)"),
            tid_of("cpu-worker-1 (cpu)"),
        );
        let on = |tid: u64| -> Vec<String> {
            events
                .iter()
                .filter(|e| e["cat"] == "slice" && e["tid"] == tid)
                .map(|e| e["name"].as_str().unwrap().to_string())
                .collect()
        };
        assert_eq!(on(ring), ["layer 0 read expert 1", "layer 0 read expert 3"]);
        assert_eq!(on(lane), ["layer 0 read expert 2"]);
        assert_eq!(on(worker).len(), 1);
        let read = events.iter().find(|e| e["cat"] == "slice").unwrap();
        assert_eq!(
            (read["ts"].as_f64(), read["args"]["bytes"].as_u64()),
            (Some(1.0), Some(4096))
        );
    }

    #[test]
    fn trace_layers_wrap_their_op_groups() {
        let t = trace("m", &steps());
        let events = t["traceEvents"].as_array().unwrap();
        let layers: Vec<&Value> = events.iter().filter(|e| e["cat"] == "layer").collect();
        assert_eq!(layers.len(), 3);
        assert_eq!(layers[1]["ts"], 1.01);
        assert_eq!(layers[1]["dur"], 0.08);
        assert_eq!(events.iter().filter(|e| e["cat"] == "op").count(), 12);
    }

    /// A model on a Vulkan device: its GPU rows get their own track, named for the device,
    /// and the table lists them with their expert-cache counts.
    #[test]
    fn gpu_rows_have_their_own_track() {
        let mut steps = steps();
        for s in &mut steps {
            for r in &mut s.rows {
                (r.device, r.track) = ("gpu".into(), "gpu-compute".into());
            }
            s.rows[2].cache_hits = Some(3);
            s.rows[2].cache_misses = Some(1);
            s.rows.push(pb::ProfileRow {
                op: "cpu_experts".into(),
                device: "cpu".into(),
                measured_ns: 20,
                track: "engine".into(),
                ..Default::default()
            });
        }
        let t = trace("m", &steps);
        let events = t["traceEvents"].as_array().unwrap();
        let names: Vec<&str> = events
            .iter()
            .filter(|e| e["name"] == "thread_name")
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["gpu-compute (gpu)", "engine (cpu)"]);
        let tid_of = |op: &str| {
            let e = events.iter().find(|e| e["name"] == op).unwrap();
            e["tid"].as_u64().unwrap()
        };
        assert_eq!((tid_of("experts"), tid_of("cpu_experts")), (1, 2));

        let r = report("m".into(), &steps, pb::ProfileTotals::default());
        let table = table(&r);
        let experts = table.lines().find(|l| l.contains("3.0/1.0")).unwrap();
        assert!(
            experts.contains("experts") && experts.contains("gpu"),
            "{table}"
        );
        assert!(!table.contains("bandwidth"), "{table}");
    }
}
