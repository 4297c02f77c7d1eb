//! A model file changed on disk while loaded: truncated (a mapped page past the new end would
//! raise SIGBUS and kill the process), rewritten in place or replaced. The reader notices each
//! (`GgufFile::intact`), reads past a new end give zeros instead of a crash, and a daemon fails
//! the requests on such a model with FAILED_PRECONDITION, keeps serving, and serves the model
//! again once it is loaded again.

#[path = "common/daemon.rs"]
mod daemon;

use std::fs::OpenOptions;
use std::io::{Seek, SeekFrom, Write};
use std::path::PathBuf;

use daemon::{load_model, stream_tokens, test_model, Daemon};
use spillway_daemon::gguf::reader::GgufFile;
use spillway_proto::v1 as pb;
use tonic::Code;

type Client = pb::spillway_client::SpillwayClient<tonic::transport::Channel>;

/// A copy of the test model in a directory of its own.
fn copy() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("changing.gguf");
    std::fs::copy(test_model(), &path).unwrap();
    (dir, path)
}

/// The bytes of the last tensor, read through the map.
fn last_tensor_sum(f: &GgufFile) -> (usize, u64) {
    let t = f.tensors().last().unwrap().clone();
    let bytes = f.tensor_data(&t);
    (bytes.len(), bytes.iter().map(|&b| u64::from(b)).sum())
}

#[test]
fn a_file_truncated_while_mapped_reads_zeros_and_is_reported() {
    let (_dir, path) = copy();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.intact(), Ok(()));
    let (len, sum) = last_tensor_sum(&f);
    assert!(len > 0 && sum > 0, "the tensor has bytes");
    // Cut the file at its data section: every tensor's pages now lie past the end.
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(f.data_offset())
        .unwrap();
    // Without the guard this read raises SIGBUS and ends the test binary.
    let (len_after, sum_after) = last_tensor_sum(&f);
    assert_eq!(
        (len_after, sum_after),
        (len, 0),
        "pages past the end read as zeros"
    );
    let err = f.intact().unwrap_err();
    assert!(
        err.contains("changed on disk") && err.contains("past its new end"),
        "{err}"
    );
    assert!(err.contains(&path.display().to_string()), "{err}");
}

#[test]
fn a_file_rewritten_in_place_or_replaced_is_reported() {
    let (_dir, path) = copy();
    let f = GgufFile::open(&path).unwrap();
    let mut w = OpenOptions::new().write(true).open(&path).unwrap();
    w.seek(SeekFrom::Start(f.data_offset())).unwrap();
    w.write_all(&[0x55; 64]).unwrap();
    drop(w);
    let err = f.intact().unwrap_err();
    assert!(err.contains("modified"), "{err}");

    let (_dir2, path2) = copy();
    let g = GgufFile::open(&path2).unwrap();
    let other = path2.with_extension("new");
    std::fs::copy(test_model(), &other).unwrap();
    std::fs::rename(&other, &path2).unwrap();
    let err = g.intact().unwrap_err();
    assert!(err.contains("replaced"), "{err}");
}

fn request(model: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        model: model.into(),
        input: Some(pb::generate_request::Input::Tokens(pb::TokenIds {
            ids: vec![1, 17, 300, 5],
        })),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

/// The request's error status (it must fail).
async fn failure(client: &mut Client, req: pb::GenerateRequest) -> tonic::Status {
    let mut stream = match client.generate(req).await {
        Ok(s) => s.into_inner(),
        Err(status) => return status,
    };
    loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the request succeeded"),
            Err(status) => return status,
        }
    }
}

#[tokio::test]
async fn a_daemon_fails_requests_on_a_truncated_model_and_serves_it_once_loaded_again() {
    let (_dir, path) = copy();
    let model = path.to_str().unwrap();
    let d = Daemon::start(&["--model", model]).await;
    let mut client = d.client().await;
    let (want, _) = stream_tokens(&mut client, request("changing", 6)).await;
    assert_eq!(want.len(), 6);

    let cut = GgufFile::open(&path).unwrap().data_offset();
    OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();
    for _ in 0..3 {
        let status = failure(&mut client, request("changing", 6)).await;
        assert_eq!(
            status.code(),
            Code::FailedPrecondition,
            "{}",
            status.message()
        );
        assert!(
            status.message().contains("load it again"),
            "{}",
            status.message()
        );
    }
    // The daemon is alive and answers.
    let listed = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(listed.models.iter().any(|m| m.name == "changing"));

    // The file back, the model loaded again: the same tokens as before.
    std::fs::copy(test_model(), &path).unwrap();
    client
        .unload_model(pb::UnloadModelRequest {
            name: "changing".into(),
        })
        .await
        .unwrap();
    let req = pb::LoadModelRequest {
        path: model.into(),
        name: "changing".into(),
        ..Default::default()
    };
    load_model(&mut client, req).await.unwrap();
    let (again, _) = stream_tokens(&mut client, request("changing", 6)).await;
    assert_eq!(again, want);
}
