//! Same model, seed and request: the same bytes, over 100 requests to one daemon and after the
//! daemon restarts, on the CPU and on Vulkan (lavapipe in CI) separately, one stream at a
//! time. Sampled with a temperature, top-k, top-p and a repetition penalty (greedy would hide
//! a sampler that is not seeded); what is compared is every streamed message: token ids, text
//! pieces and log-probabilities with their top alternatives, and the finish reason.
//!
//! Batching: on the CPU the tokens of a request are those of the request alone whatever else
//! is decoded in the same step (`engine_batch.rs` checks it); this file sends one request at a
//! time.

#[path = "common/daemon.rs"]
mod daemon;

use daemon::{test_model, Daemon};
use spillway_proto::v1 as pb;

const RUNS: usize = 100;
const RESTARTS: usize = 2;
const TOKENS: usize = 12;

/// Everything the stream of one request said that should not depend on the run (timings do).
async fn generate(
    client: &mut pb::spillway_client::SpillwayClient<tonic::transport::Channel>,
) -> String {
    let mut stream = client
        .generate(pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Tokens(pb::TokenIds {
                ids: vec![1, 17, 300, 5, 1000, 42],
            })),
            sampling: Some(pb::SamplingParams {
                temperature: 0.9,
                top_k: 40,
                top_p: 0.95,
                repetition_penalty: 1.1,
                seed: Some(1234),
                ..Default::default()
            }),
            max_tokens: TOKENS as u32,
            ignore_eos: true,
            logprobs: true,
            top_logprobs: 3,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut out = String::new();
    while let Some(m) = stream.message().await.unwrap() {
        let top: Vec<String> = m
            .top_logprobs
            .iter()
            .map(|t| format!("{}:{:08x}", t.token, t.logprob.to_bits()))
            .collect();
        out.push_str(&format!(
            "{} {:?} {:08x} [{}] {}\n",
            m.token,
            m.text,
            m.logprob.expect("asked for log-probabilities").to_bits(),
            top.join(","),
            m.finish_reason
        ));
    }
    out
}

/// `RUNS` requests to each of `RESTARTS` daemons started with `args`: all the same.
async fn same_bytes_every_time(args: &[&str]) -> String {
    let mut first: Option<String> = None;
    for restart in 0..RESTARTS {
        let mut d = Daemon::with_test_model(args).await;
        let mut client = d.client().await;
        for run in 0..RUNS {
            let got = generate(&mut client).await;
            match &first {
                None => first = Some(got),
                Some(want) => assert_eq!(&got, want, "daemon {restart}, request {run}"),
            }
        }
        d.terminate();
        assert!(d.wait_exit().success());
    }
    let out = first.unwrap();
    assert_eq!(out.lines().count(), TOKENS, "{out}");
    out
}

#[tokio::test]
async fn cpu_output_is_the_same_over_100_requests_and_a_restart() {
    let out = same_bytes_every_time(&["--device", "cpu"]).await;
    // Sampled, not greedy: more than one distinct token.
    let distinct: std::collections::HashSet<&str> =
        out.lines().map(|l| l.split(' ').next().unwrap()).collect();
    assert!(distinct.len() > 1, "{out}");
}

#[tokio::test]
async fn vulkan_output_is_the_same_over_100_requests_and_a_restart() {
    if spillway_daemon::gpu::device_or_skip().is_none() {
        return;
    }
    let _ = test_model();
    same_bytes_every_time(&["--device", "vulkan"]).await;
}
