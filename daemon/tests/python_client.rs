//! A client we did not write: Python's grpcio with code generated from our .proto by protoc and
//! grpc's Python plugin (Debian's python3-grpcio, protobuf-compiler, protobuf-compiler-grpc;
//! `scripts/setup.sh` installs them). A missing tool fails the test rather than skipping it.

#[path = "common/daemon.rs"]
mod daemon;

use std::path::Path;
use std::process::Command;

use daemon::{stream_tokens, Daemon};
use spillway_proto::v1 as pb;

/// Debian's interpreter: the grpcio and protobuf modules are installed for it.
const PYTHON: &str = "/usr/bin/python3";
const GRPC_PYTHON_PLUGIN: &str = "/usr/bin/grpc_python_plugin";

fn require(tool: &str) {
    assert!(
        Path::new(tool).exists() || which(tool),
        "{tool} is missing: run scripts/setup.sh (it installs python3-grpcio, protobuf-compiler \
         and protobuf-compiler-grpc)"
    );
}

fn which(tool: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {tool}")])
        .output()
        .is_ok_and(|o| o.status.success())
}

#[tokio::test]
async fn a_python_grpcio_client_generated_from_the_proto_streams_tokens() {
    for tool in [PYTHON, GRPC_PYTHON_PLUGIN, "protoc"] {
        require(tool);
    }
    let out = tempfile::tempdir().unwrap();
    let proto_root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/proto");
    let gen = Command::new("protoc")
        .arg(format!("-I{}", proto_root.display()))
        .arg(format!("--python_out={}", out.path().display()))
        .arg(format!("--grpc_python_out={}", out.path().display()))
        .arg(format!(
            "--plugin=protoc-gen-grpc_python={GRPC_PYTHON_PLUGIN}"
        ))
        .arg(proto_root.join("spillway/v1/spillway.proto"))
        .output()
        .unwrap();
    assert!(
        gen.status.success(),
        "protoc: {}",
        String::from_utf8_lossy(&gen.stderr)
    );

    let d = Daemon::with_test_model(&[]).await;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/grpc_client.py");
    let run = tokio::process::Command::new(PYTHON)
        .arg(&script)
        .arg(&d.socket)
        .arg(out.path())
        .output()
        .await
        .unwrap();
    assert!(
        run.status.success(),
        "the Python client failed:\n{}\n{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let seen: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(seen["models"], serde_json::json!(["tiny-qwen3moe-q8_0"]));
    assert_eq!(seen["empty_request"], "INVALID_ARGUMENT");

    // The same request through our own client gives the same tokens.
    let mut client = d.client().await;
    let req = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Tokens(pb::TokenIds {
            ids: vec![1, 2, 3],
        })),
        max_tokens: 5,
        ignore_eos: true,
        ..Default::default()
    };
    let (tokens, _) = stream_tokens(&mut client, req).await;
    assert_eq!(seen["tokens"], serde_json::json!(tokens));
}
