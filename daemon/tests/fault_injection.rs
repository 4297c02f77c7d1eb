//! Faults injected into a real daemon (`SPILLWAY_FAULT_DEVICE_OOM`, `gpu::alloc::fault`): a
//! model load whose device memory allocation the driver refuses fails with RESOURCE_EXHAUSTED
//! (a later try may succeed, unlike a model over its VRAM budget), nothing of it stays loaded,
//! the same load then succeeds, and the next hundred requests on it succeed and agree.

#[path = "common/daemon.rs"]
mod daemon;

use std::path::Path;

use daemon::{load_model, stream_tokens, test_model, Daemon};
use spillway_proto::v1 as pb;
use tonic::Code;

type Client = pb::spillway_client::SpillwayClient<tonic::transport::Channel>;

async fn load(client: &mut Client, name: &str) -> Result<(), tonic::Status> {
    let req = pb::LoadModelRequest {
        path: test_model().display().to_string(),
        name: name.into(),
        device: "vulkan".into(),
        ..Default::default()
    };
    load_model(client, req).await
}

async fn greedy(client: &mut Client, model: &str) -> Vec<u32> {
    let req = pb::GenerateRequest {
        model: model.into(),
        input: Some(pb::generate_request::Input::Tokens(pb::TokenIds {
            ids: vec![1, 17, 300, 5],
        })),
        max_tokens: 4,
        ignore_eos: true,
        ..Default::default()
    };
    stream_tokens(client, req).await.0
}

#[tokio::test]
async fn a_load_the_driver_refuses_memory_for_fails_and_the_next_one_serves() {
    if spillway_daemon::gpu::device_or_skip().is_none() {
        return;
    }
    // The CPU serves the startup model, so the first device block is the Vulkan load's.
    let model = test_model().display().to_string();
    let d = Daemon::spawn(
        &["--model", &model, "--device", "cpu"],
        &[("SPILLWAY_FAULT_DEVICE_OOM", Path::new("1"))],
    );
    d.wait_serving().await;
    let mut client = d.client().await;

    let err = load(&mut client, "gpu").await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{}", err.message());
    assert!(
        err.message().contains("out of device memory"),
        "{}",
        err.message()
    );
    let listed = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(
        listed.models.iter().all(|m| m.name != "gpu"),
        "a failed load is not listed"
    );

    load(&mut client, "gpu").await.unwrap();
    let first = greedy(&mut client, "gpu").await;
    assert_eq!(first.len(), 4);
    for i in 1..100 {
        assert_eq!(greedy(&mut client, "gpu").await, first, "request {i}");
    }
    assert!(
        d.log_text().contains("fault injection"),
        "the daemon logs the armed fault"
    );
}
