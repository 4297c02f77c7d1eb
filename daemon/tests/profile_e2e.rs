//! The `Profile` RPC end to end: a real `spillwayd serve` on a Unix socket, driven by a tonic
//! client. Asserts what the stream carries, never how fast.

#[path = "common/daemon.rs"]
mod daemon;

use daemon::Daemon;
use spillway_proto::v1 as pb;
use tonic::Code;

use pb::profile_request::Input;

async fn profile(
    client: &mut pb::spillway_client::SpillwayClient<tonic::transport::Channel>,
    req: pb::ProfileRequest,
) -> Result<Vec<pb::ProfileStep>, tonic::Status> {
    let mut stream = client.profile(req).await?.into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await? {
        out.push(m);
    }
    Ok(out)
}

#[tokio::test]
async fn profile_streams_every_layer_of_every_step_then_the_totals() {
    let d = Daemon::with_test_model(&[]).await;
    let mut client = d.client().await;
    let steps = profile(
        &mut client,
        pb::ProfileRequest {
            input: Some(Input::Text("Once upon a time".into())),
            steps: 3,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(steps.len(), 4, "the prompt and 3 decode steps");
    let totals = steps[3].totals.clone().expect("totals on the last step");
    assert!(steps[..3].iter().all(|s| s.totals.is_none()));
    assert_eq!(totals.decode_steps, 3);
    assert!(totals.layers >= 1);
    assert!(totals.decode_tokens_per_second > 0.0);
    assert!(totals.cpu_bandwidth_bytes_per_second > 0.0);
    assert!(
        totals.bottleneck.starts_with("cpu "),
        "{}",
        totals.bottleneck
    );
    assert_eq!(totals.device_times[0].device, "cpu");

    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s.step, i as u32);
        assert_eq!(s.phase, if i == 0 { "prefill" } else { "decode" });
        assert_eq!(s.tokens, if i == 0 { totals.prompt_tokens } else { 1 });
        for layer in 0..totals.layers {
            let ops: Vec<&str> = s
                .rows
                .iter()
                .filter(|r| r.layer == Some(layer))
                .map(|r| r.op.as_str())
                .collect();
            // The test model is a Qwen3-MoE.
            assert_eq!(
                ops,
                [
                    "qkv",
                    "rope_cache",
                    "attention",
                    "attn_output",
                    "router",
                    "experts"
                ],
                "step {i} layer {layer}"
            );
            let experts = s
                .rows
                .iter()
                .find(|r| r.layer == Some(layer) && r.op == "experts")
                .unwrap();
            assert!(!experts.experts.is_empty() && experts.weight_bytes > 0);
        }
        for r in &s.rows {
            assert_eq!((r.device.as_str(), r.track.as_str()), ("cpu", "engine"));
            assert!(r.start_ns + r.measured_ns <= s.duration_ns, "{r:?}");
            assert_eq!(r.predicted_ns, None);
            assert_eq!((r.ssd_to_ram_bytes, r.ram_to_vram_bytes), (None, None));
        }
        if i > 0 {
            assert!(s.start_ns >= steps[i - 1].start_ns + steps[i - 1].duration_ns);
        }
    }

    // The model stays usable: a generation after the profile.
    let mut stream = client
        .generate(pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Tokens(pb::TokenIds {
                ids: vec![1, 2, 3],
            })),
            max_tokens: 2,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut n = 0;
    while stream.message().await.unwrap().is_some() {
        n += 1;
    }
    assert_eq!(n, 2);
}

/// With a hardware profile the rows that read weights carry the scheduler's prediction, the
/// others none, and the totals give the CPU's weight bandwidth against the profile's memory
/// bandwidth.
#[tokio::test]
async fn a_hardware_profile_gives_predictions_and_limits() {
    let d = Daemon::with_test_model(&["--hardware-profile", "h200"]).await;
    let mut client = d.client().await;
    let steps = profile(
        &mut client,
        pb::ProfileRequest {
            input: Some(Input::TokenCount(5)),
            steps: 2,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    for s in &steps {
        for r in &s.rows {
            let reads = !matches!(r.op.as_str(), "rope_cache" | "attention");
            assert_eq!(r.predicted_ns.is_some(), reads, "step {}: {r:?}", s.step);
            if reads {
                assert!(r.weight_bytes > 0 && r.predicted_ns.unwrap() > 0, "{r:?}");
            }
        }
    }
    let totals = steps[2].totals.clone().unwrap();
    assert!(
        totals.hardware_profile.contains("H200"),
        "{}",
        totals.hardware_profile
    );
    let links: Vec<_> = totals.bandwidths.iter().map(|b| b.link.as_str()).collect();
    assert_eq!(links, ["cpu"], "a CPU model reads weights from RAM only");
    let cpu = &totals.bandwidths[0];
    assert!(cpu.bytes > 0 && cpu.bytes_per_second > 0.0);
    assert!(cpu.limit_bytes_per_second.is_some_and(|l| l > 0.0));
}

#[tokio::test]
async fn bad_profile_requests_are_invalid_arguments() {
    let d = Daemon::with_test_model(&["--ctx", "64"]).await;
    let mut client = d.client().await;
    let cases = [
        (None, 1, "", "no input"),
        (Some(Input::TokenCount(0)), 1, "", "token_count is 0"),
        (Some(Input::TokenCount(64)), 1, "", "context holds 64"),
        (Some(Input::TokenCount(60)), 5, "", "at most 4 steps"),
        (Some(Input::TokenCount(4)), 100_000, "", "at most 1024"),
        (
            Some(Input::Tokens(pb::TokenIds { ids: vec![] })),
            1,
            "",
            "empty",
        ),
        (
            Some(Input::Tokens(pb::TokenIds {
                ids: vec![u32::MAX],
            })),
            1,
            "",
            "vocabulary",
        ),
        (Some(Input::TokenCount(4)), 1, "nope", "not loaded"),
    ];
    for (input, steps, model, says) in cases {
        let e = profile(
            &mut client,
            pb::ProfileRequest {
                model: model.into(),
                input,
                steps,
            },
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{says}: {e:?}");
        assert!(
            e.message().contains(says),
            "{:?} lacks {says:?}",
            e.message()
        );
    }
    // Token counts and default steps within the context are fine.
    let steps = profile(
        &mut client,
        pb::ProfileRequest {
            input: Some(Input::TokenCount(60)),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(
        steps.len(),
        5,
        "the default of 8 steps capped by the context"
    );
}
