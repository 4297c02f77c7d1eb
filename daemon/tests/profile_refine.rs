//! Online refinement: a profiled request's decode steps refine the daemon's hardware profile
//! (each product row's time becomes shape points), the profile stored in the cache directory
//! is rewritten with them, and the next request's predictions follow what the machine did.

#[path = "common/daemon.rs"]
mod daemon;

use daemon::Daemon;
use spillway_proto::v1 as pb;
use spillway_sched::profile::HardwareProfile;
use spillway_sched::simulate::shipped_profile;

use pb::profile_request::Input;

async fn decode_rows(
    client: &mut pb::spillway_client::SpillwayClient<tonic::transport::Channel>,
) -> Vec<pb::ProfileRow> {
    let req = pb::ProfileRequest {
        input: Some(Input::TokenCount(4)),
        steps: 6,
        ..Default::default()
    };
    let mut stream = client.profile(req).await.unwrap().into_inner();
    let mut rows = Vec::new();
    while let Some(s) = stream.message().await.unwrap() {
        if s.phase == "decode" {
            rows.extend(s.rows);
        }
    }
    rows
}

/// Median of |ln(predicted / measured)| over the rows that are products only.
fn log_error(rows: &[pb::ProfileRow]) -> f64 {
    let mut e: Vec<f64> = rows
        .iter()
        .filter(|r| matches!(r.op.as_str(), "qkv" | "attn_output" | "router" | "experts"))
        .filter(|r| r.measured_ns > 0)
        .map(|r| {
            (r.predicted_ns.unwrap() as f64 / r.measured_ns as f64)
                .ln()
                .abs()
        })
        .collect();
    assert!(e.len() >= 8, "{rows:?}");
    e.sort_by(f64::total_cmp);
    e[e.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn profiled_steps_refine_the_stored_profile_and_the_predictions_follow() {
    // A profile far too fast for this machine's CPU, stored as if calibrated.
    let mut wrong = shipped_profile("h200").unwrap().unwrap();
    wrong.cpu.threads = 1;
    wrong.cpu.dispatch_s = 1e-7;
    wrong.cpu.memory_bandwidth = 1e14;
    for r in wrong.cpu.matvec.values_mut() {
        r.bandwidth = 1e14;
        r.fixed_s = 0.0;
    }
    wrong.cpu.matvec_per_thread.clear();
    let home = tempfile::tempdir().unwrap();
    let profiles = home.path().join("spillway/profiles");
    std::fs::create_dir_all(&profiles).unwrap();
    let stored = profiles.join("this-machine.toml");
    std::fs::write(&stored, wrong.to_toml()).unwrap();

    let test_model = daemon::test_model().to_str().unwrap().to_string();
    let d = Daemon::spawn(
        &["--model", &test_model],
        &[("XDG_CACHE_HOME", home.path())],
    );
    d.wait_serving().await;
    let mut client = d.client().await;
    let before = log_error(&decode_rows(&mut client).await);
    let after = log_error(&decode_rows(&mut client).await);
    eprintln!("log error before {before:.3}, after {after:.3}");
    assert!(before > 1.5, "the stored profile is far off: {before}");
    assert!(
        after < before / 3.0,
        "refined predictions follow the machine: {after} against {before}"
    );

    let log = d.log_text();
    assert!(log.contains("hardware profile refined"), "{log}");
    let refined = HardwareProfile::from_toml(&std::fs::read_to_string(&stored).unwrap()).unwrap();
    assert!(
        refined
            .source
            .ends_with("refined from timings of real steps"),
        "{}",
        refined.source
    );
    let points: usize = refined.cpu.matvec_points.values().map(Vec::len).sum();
    assert!(
        points >= 4,
        "the model's shapes: {:?}",
        refined.cpu.matvec_points
    );
    assert!(refined.gpu.matvec_points.is_empty(), "no GPU step ran");
    assert!(!profiles.join("this-machine.toml.partial").exists());
}
