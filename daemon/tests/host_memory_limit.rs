//! A daemon in a memory cgroup below what a load needs: the load is refused with
//! RESOURCE_EXHAUSTED and a message saying what it needs and what bounds it, and the daemon is
//! not OOM-killed (it serves, and a load that fits succeeds). Needs a memory cgroup this test
//! may create (cgroup v1 `memory`, or v2 with the memory controller); skips where there is none.

#[path = "common/daemon.rs"]
mod daemon;

use std::path::PathBuf;

use daemon::{load_model, stream_tokens, test_model, Daemon};
use spillway_proto::v1 as pb;
use tonic::Code;

/// A child memory cgroup of the mount's root, removed on drop.
struct TestCgroup {
    dir: PathBuf,
    procs_parent: PathBuf,
}

impl TestCgroup {
    /// One limited to `limit` bytes, if this machine lets us make it.
    fn new(limit: u64) -> Option<TestCgroup> {
        let name = format!("spillway-test-{}", std::process::id());
        let v1 = PathBuf::from("/sys/fs/cgroup/memory");
        let v2 = PathBuf::from("/sys/fs/cgroup");
        let candidates = [
            (v1.clone(), "memory.limit_in_bytes"),
            (v2.clone(), "memory.max"),
        ];
        for (root, limit_file) in candidates {
            if !root.join("cgroup.procs").exists() {
                continue;
            }
            let dir = root.join(&name);
            if std::fs::create_dir(&dir).is_err() {
                continue;
            }
            if std::fs::write(dir.join(limit_file), limit.to_string()).is_ok() {
                return Some(TestCgroup {
                    dir,
                    procs_parent: root,
                });
            }
            let _ = std::fs::remove_dir(&dir);
        }
        None
    }

    fn add(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).unwrap();
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // Processes still inside move back to the root, so the directory can go.
        if let Ok(text) = std::fs::read_to_string(self.dir.join("cgroup.procs")) {
            for pid in text.lines() {
                let _ = std::fs::write(self.procs_parent.join("cgroup.procs"), pid);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[tokio::test]
async fn a_load_over_the_memory_cgroup_is_refused_and_the_daemon_lives() {
    let Some(cgroup) = TestCgroup::new(256 << 20) else {
        eprintln!("no memory cgroup can be made here: nothing to test");
        return;
    };
    // The embedded default model on the CPU; the daemon joins the cgroup before it loads more.
    let mut d = Daemon::spawn(&[], &[]);
    cgroup.add(d.child.id());
    d.wait_serving().await;
    let mut client = d.client().await;

    // A million positions of KV cache for 4 sequences: about a GiB, four times the limit.
    let model = test_model().display().to_string();
    let big = pb::LoadModelRequest {
        path: model.clone(),
        name: "big".into(),
        context_length: 1 << 20,
        ..Default::default()
    };
    let err = load_model(&mut client, big).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{}", err.message());
    for part in ["host memory", "memory cgroup", "lower --ctx"] {
        assert!(err.message().contains(part), "{part}: {}", err.message());
    }

    // Alive and serving: the default model generates, and a load that fits succeeds.
    let (tokens, _) = stream_tokens(
        &mut client,
        pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Text("In the beginning".into())),
            max_tokens: 8,
            ignore_eos: true,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(tokens.len(), 8);
    let small = pb::LoadModelRequest {
        path: model,
        name: "small".into(),
        context_length: 256,
        ..Default::default()
    };
    load_model(&mut client, small).await.unwrap();
    d.terminate();
    assert!(d.wait_exit().success(), "{}", d.log_text());
}
