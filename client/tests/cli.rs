//! The `spillway` binary against a real `spillwayd` (the one built next to it, as the client
//! finds it) on Unix sockets in temporary directories. The daemons serve the default model,
//! written once into a cache directory the tests share.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const PATIENCE: Duration = Duration::from_secs(120);

fn spillway() -> &'static str {
    env!("CARGO_BIN_EXE_spillway")
}

/// `spillwayd` next to `spillway`: `cargo test --workspace` builds both.
fn spillwayd() -> PathBuf {
    let p = Path::new(spillway()).with_file_name("spillwayd");
    assert!(
        p.is_file(),
        "{} is missing: build it with `cargo build -p spillway-daemon` (cargo test --workspace does)",
        p.display()
    );
    p
}

/// One cache directory for all tests: the default model is written once.
fn cache_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().unwrap()).path()
}

struct Daemon {
    child: Child,
    _dir: tempfile::TempDir,
    socket: PathBuf,
    log: PathBuf,
}

impl Daemon {
    fn start(args: &[&str]) -> Daemon {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("s.sock");
        let log = dir.path().join("daemon.log");
        let child = Command::new(spillwayd())
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(["--threads", "1", "--log-level", "debug"])
            .args(args)
            .env_remove("RUST_LOG")
            .env("XDG_CACHE_HOME", cache_dir())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let d = Daemon {
            child,
            _dir: dir,
            socket,
            log,
        };
        d.wait_ready();
        d
    }

    fn addr(&self) -> &str {
        self.socket.to_str().unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The daemon logs "ready" once its models are loaded and health is SERVING.
    fn wait_ready(&self) {
        let start = Instant::now();
        while !self.log().contains(": ready") {
            assert!(start.elapsed() < PATIENCE, "never ready:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn run(&self, args: &[&str]) -> Output {
        self.run_with_input(args, "")
    }

    fn run_with_input(&self, args: &[&str], input: &str) -> Output {
        let mut child = Command::new(spillway())
            .arg("--addr")
            .arg(self.addr())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn generate_streams_text_and_json_reports_tokens_and_finish() {
    let d = Daemon::start(&[]);
    // Greedy, so that the JSON and the text runs generate the same tokens.
    let args = [
        "generate",
        "--prompt-tokens",
        "1,2,3",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
    ];
    let mut json_args = args.to_vec();
    json_args.extend(["--json", "--top-logprobs", "2", "--ignore-eos"]);
    let out = d.run(&json_args);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 5);
    assert_eq!(v["finish_reason"], "max_tokens");
    assert_eq!(v["top_logprobs"].as_array().unwrap().len(), 5);
    assert_eq!(v["timings"]["generated_tokens"], 5);

    let mut text_args = args.to_vec();
    text_args.push("--ignore-eos");
    let out = d.run(&text_args);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out), format!("{}\n", v["text"].as_str().unwrap()));
    assert!(
        stderr(&out).contains("5 generated (max_tokens)"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn chat_keeps_the_history_across_turns() {
    let d = Daemon::start(&[]);
    let out = d.run_with_input(
        &["chat", "--max-tokens", "3", "--system", "Be brief."],
        "Hello\nAnd then?\n",
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).lines().count(), 2, "one reply per turn");
    // The daemon logs each request's prompt length: the second turn carries the first.
    let prompts: Vec<usize> = d
        .log()
        .lines()
        .filter_map(|l| l.split("prompt_tokens=").nth(1))
        .map(|rest| {
            rest.split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse()
                .unwrap()
        })
        .collect();
    assert_eq!(prompts.len(), 2, "{}", d.log());
    assert!(prompts[1] > prompts[0] + 3, "{prompts:?}");
}

/// `spillway load --device vulkan` and `spillway ps` on a model on the GPU; skipped on a machine
/// without a Vulkan device unless `SPILLWAY_REQUIRE_VULKAN` is set.
#[test]
fn ps_shows_a_model_on_the_gpu_with_its_vram() {
    let d = Daemon::start(&[]);
    let model = cache_dir().join("spillway/default-kjv-moe-q8_0-1.gguf");
    let out = d.run(&[
        "load",
        model.to_str().unwrap(),
        "--name",
        "ongpu",
        "--device",
        "vulkan",
    ]);
    if !out.status.success() && stderr(&out).contains("Vulkan is not usable") {
        let required = std::env::var("SPILLWAY_REQUIRE_VULKAN").is_ok_and(|v| v != "0");
        assert!(!required, "no Vulkan device: {}", stderr(&out));
        eprintln!("skipping: {}", stderr(&out));
        return;
    }
    assert!(out.status.success(), "{}", stderr(&out));
    let ps = stdout(&d.run(&["ps"]));
    let mut lines = ps.lines().skip_while(|l| !l.starts_with("ongpu"));
    let line = lines.next().unwrap_or_default();
    assert!(line.contains("vulkan:") && line.contains("VRAM"), "{ps}");
    let detail = lines.next().unwrap_or_default();
    assert!(
        detail.contains("VRAM") && detail.contains("held") && detail.contains("experts 8 of 8"),
        "{ps}"
    );

    // A budget under what the model needs is refused with the daemon's reason; a size that is
    // not one is a usage error before anything is sent.
    let path = model.to_str().unwrap();
    let small = [
        "load",
        path,
        "--name",
        "tiny",
        "--device",
        "vulkan",
        "--vram-budget",
        "1MiB",
    ];
    let out = d.run(&small);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(stderr(&out).contains("needs at least"), "{}", stderr(&out));
    let out = d.run(&["load", path, "--vram-budget", "lots"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
}

#[test]
fn models_load_ps_and_unload() {
    let d = Daemon::start(&[]);
    // The daemon writes its embedded default model here (`default_model::FILE_NAME`).
    let model = cache_dir().join("spillway/default-kjv-moe-q8_0-1.gguf");
    let out = d.run(&["load", model.to_str().unwrap(), "--name", "again"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("loaded"), "{}", stderr(&out));

    let out = d.run(&["models"]);
    let listing = stdout(&out);
    assert!(
        listing.contains("default (default)") && listing.contains("again"),
        "{listing}"
    );

    let out = d.run(&["ps"]);
    let ps = stdout(&out);
    let line = ps.lines().find(|l| l.starts_with("again")).unwrap();
    assert!(line.contains("cpu") && line.contains("RAM"), "{ps}");

    let out = d.run(&["unload", "again"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stdout(&d.run(&["models"])).contains("again"));
    let out = d.run(&["unload", "again"]);
    assert_eq!(out.status.code(), Some(4), "an unknown model is refused");
    assert!(stderr(&out).contains("not loaded"), "{}", stderr(&out));
}

#[test]
fn load_plan_prints_the_plan_and_loads_nothing() {
    let d = Daemon::start(&["--hardware-profile", "laptop-8gb"]);
    let model = cache_dir().join("spillway/default-kjv-moe-q8_0-1.gguf");
    let path = model.to_str().unwrap();
    let load = ["load", path, "--name", "planned", "--device", "vulkan"];
    let planned = |extra: &[&str]| d.run(&[&load[..], extra].concat());
    let out = planned(&["--vram-budget", "256MiB", "--plan"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    assert!(
        table.contains("budgets: VRAM 256.00 MiB") && table.contains("bottleneck: "),
        "{table}"
    );
    assert!(
        stderr(&out).contains("nothing was loaded"),
        "{}",
        stderr(&out)
    );

    let out = planned(&["--vram-budget", "256MiB", "--plan", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(v["vram_budget"].as_u64(), Some(256 << 20), "{v}");
    assert!(v["vram"]["total"].as_u64().unwrap() <= 256 << 20, "{v}");
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0, "{v}");
    assert!(!stdout(&d.run(&["models"])).contains("planned"));

    // Refusals are the daemon's, with its exit code; --json needs --plan.
    let out = planned(&["--pin", "exps=tpu", "--plan"]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    let out = planned(&["--json"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    let help = stdout(
        &Command::new(spillway())
            .args(["load", "--help"])
            .output()
            .unwrap(),
    );
    assert!(help.contains("--plan"), "{help}");

    let bare = Daemon::start(&[]);
    let out = bare.run(&["load", path, "--plan"]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("spillwayd calibrate"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn exit_codes_tell_failures_apart() {
    let d = Daemon::start(&["--ctx", "32"]);
    let out = d.run(&["generate", "hi", "--max-tokens", "1000"]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    assert!(stderr(&out).contains("max_tokens"), "{}", stderr(&out));

    let dir = tempfile::tempdir().unwrap();
    let nowhere = dir.path().join("none.sock");
    let out = Command::new(spillway())
        .args(["--addr", nowhere.to_str().unwrap(), "models"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains("spillwayd serve"), "{}", stderr(&out));

    let out = Command::new(spillway())
        .args(["frobnicate"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let help = Command::new(spillway()).arg("--help").output().unwrap();
    assert!(stdout(&help).contains("Exit codes"));
}

#[test]
fn without_a_daemon_the_client_starts_one_on_the_default_socket() {
    let runtime = tempfile::tempdir().unwrap();
    let out = Command::new(spillway())
        .arg("models")
        .env("XDG_RUNTIME_DIR", runtime.path())
        .env("XDG_CACHE_HOME", cache_dir())
        .env_remove("SPILLWAY_ADDR")
        .output()
        .unwrap();
    let err = stderr(&out);
    // Look for the socket before stopping the daemon: on SIGTERM it removes it.
    let socket_existed = runtime.path().join("spillway.sock").exists();
    // Stop the daemon it started, whatever happened.
    let pid = err
        .split("(pid ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .and_then(|p| p.parse::<i32>().ok());
    if let Some(pid) = pid {
        let _ = Command::new("kill").arg(pid.to_string()).status();
    }
    assert!(out.status.success(), "{err}");
    assert!(err.contains("started") && pid.is_some(), "{err}");
    assert!(stdout(&out).contains("default"), "{}", stdout(&out));
    assert!(socket_existed);
}

#[test]
fn profile_json_has_rows_for_every_layer_and_the_trace_nests() {
    let d = Daemon::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    let out = d.run(&[
        "profile",
        "--steps",
        "2",
        "--tokens",
        "5",
        "--json",
        "--trace",
        trace.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(
        (v["decode_steps"].as_u64(), v["prompt_tokens"].as_u64()),
        (Some(2), Some(5))
    );
    let layers = v["layers"].as_u64().unwrap();
    assert!(layers >= 1);
    let rows = v["rows"].as_array().unwrap();
    for l in 0..layers {
        let ops: Vec<&str> = rows
            .iter()
            .filter(|r| r["layer"].as_u64() == Some(l))
            .map(|r| r["op"].as_str().unwrap())
            .collect();
        assert!(
            ops.contains(&"qkv") && ops.contains(&"attention") && ops.contains(&"experts"),
            "layer {l}: {ops:?}"
        );
    }
    let experts = rows.iter().find(|r| r["op"] == "experts").unwrap();
    assert_eq!(
        experts["experts"].as_array().unwrap().len(),
        2,
        "one list per step"
    );
    assert!(rows.iter().all(|r| r["predicted_us"].is_null()));
    let share: f64 = rows.iter().map(|r| r["share"].as_f64().unwrap()).sum();
    assert!(share > 0.0 && share <= 1.0 + 1e-9, "{share}");
    assert!(v["bottleneck"].as_str().unwrap().starts_with("cpu "));

    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let events: Vec<&serde_json::Value> = t["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "X")
        .collect();
    let span = |e: &serde_json::Value| {
        let ts = e["ts"].as_f64().unwrap();
        (ts, ts + e["dur"].as_f64().unwrap())
    };
    // Microseconds from integer nanoseconds: a rounding's slack, no more.
    let eps = 1e-6;
    let within = |(s, e): (f64, f64), (ps, pe): (f64, f64)| s >= ps - eps && e <= pe + eps;
    // Perfetto's rule for complete events on one track: any two are disjoint or one holds
    // the other.
    for a in &events {
        for b in &events {
            if a["tid"] == b["tid"] {
                let (sa, sb) = (span(a), span(b));
                let disjoint = sa.1 <= sb.0 + eps || sb.1 <= sa.0 + eps;
                assert!(
                    disjoint || within(sa, sb) || within(sb, sa),
                    "{a} overlaps {b}"
                );
            }
        }
    }
    // And every layer lies in a step, every op group in a layer of its number or a step.
    let of = |cat: &'static str| events.iter().filter(move |e| e["cat"] == cat);
    let steps = of("step").count();
    let layer_events = of("layer").count();
    for l in of("layer") {
        assert!(of("step").any(|s| within(span(l), span(s))), "{l}");
    }
    for op in of("op") {
        assert!(
            of("layer")
                .chain(of("step"))
                .any(|p| within(span(op), span(p))),
            "{op}"
        );
    }
    assert_eq!(steps, 3, "the prompt and two decode steps");
    assert_eq!(layer_events as u64, 3 * layers);
    // The pool's threads have tracks of their own, their slices named for the op group (and
    // the expert) they ran, inside the step's time.
    let names: Vec<&str> = t["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "thread_name")
        .map(|e| e["args"]["name"].as_str().unwrap())
        .collect();
    assert!(names.contains(&"cpu-worker-0 (cpu)"), "{names:?}");
    let slices: Vec<_> = of("slice").collect();
    assert!(
        slices.iter().any(|s| {
            let n = s["name"].as_str().unwrap();
            n.starts_with("layer ") && n.contains(" experts expert ")
        }),
        "{slices:?}"
    );
    for sl in &slices {
        assert!(of("step").any(|s| within(span(sl), span(s))), "{sl}");
    }

    let out = d.run(&["profile", "--tokens", "0"]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr(&out));
    let out = d.run(&["profile", "--tokens", "3", "--steps", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("bottleneck:"), "{}", stdout(&out));
}

#[test]
fn completions_are_printed_for_bash() {
    let out = Command::new(spillway())
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(stdout(&out).contains("_spillway"));
}
