//! End to end: a real `spillwayd serve` process on a Unix socket in a temporary directory,
//! driven by a tonic client. Tests assert behaviour, never timings: where a test needs a long
//! generation it asks for one that cannot finish before the test acts on it (thousands of
//! tokens; the test then cancels it).

#[path = "common/daemon.rs"]
mod daemon;

use std::sync::Arc;
use std::time::Duration;

use daemon::{test_model, Daemon, PATIENCE};
use spillway_daemon::engine::generate::{generate, GenerateRequest, Prompt};
use spillway_daemon::engine::{Engine, EngineOptions, SamplerConfig};
use spillway_daemon::model::Model;
use spillway_daemon::tokenizer::Tokenizer;
use spillway_proto::v1 as pb;
use tonic::Code;

fn text(t: &str) -> Option<pb::generate_request::Input> {
    Some(pb::generate_request::Input::Text(t.into()))
}

fn tokens(ids: &[u32]) -> Option<pb::generate_request::Input> {
    Some(pb::generate_request::Input::Tokens(pb::TokenIds {
        ids: ids.to_vec(),
    }))
}

/// The context of daemons that serve [`endless`] requests.
const LONG_CONTEXT: &str = "32768";

/// A request that runs until cancelled: tens of thousands of tokens, each attending to all
/// before it.
fn endless(prompt: &[u32]) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: tokens(prompt),
        max_tokens: 30_000,
        ignore_eos: true,
        ..Default::default()
    }
}

fn chat() -> Option<pb::generate_request::Input> {
    Some(pb::generate_request::Input::Chat(pb::ChatMessages {
        messages: vec![
            pb::ChatMessage {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            pb::ChatMessage {
                role: "user".into(),
                content: "Hello".into(),
            },
        ],
    }))
}

async fn collect(
    client: &mut pb::spillway_client::SpillwayClient<tonic::transport::Channel>,
    req: pb::GenerateRequest,
) -> Result<Vec<pb::GenerateResponse>, tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await? {
        out.push(m);
    }
    Ok(out)
}

#[tokio::test]
async fn generate_streams_the_same_tokens_as_the_engine_and_ends_with_timings() {
    let d = Daemon::with_test_model(&[]).await;
    let mut client = d.client().await;
    let prompt = "Once upon a time";
    let msgs = collect(
        &mut client,
        pb::GenerateRequest {
            input: text(prompt),
            max_tokens: 12,
            ignore_eos: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(msgs.len(), 12, "one message per token");
    let last = msgs.last().unwrap();
    assert_eq!(last.finish_reason(), pb::FinishReason::MaxTokens);
    let t = last.timings.unwrap();
    assert_eq!(t.generated_tokens, 12);
    assert!(t.time_to_first_token_ms > 0.0);
    assert!(msgs[..11]
        .iter()
        .all(|m| m.timings.is_none() && m.finish_reason() == pb::FinishReason::Unspecified));

    // The same request on the library's engine, in this process.
    let model = Model::open(test_model()).unwrap();
    let tok = Tokenizer::from_metadata(model.file().metadata()).unwrap();
    let mut engine = Engine::new(Arc::new(model), &EngineOptions::default());
    let want = generate(
        &mut engine,
        Some(&tok),
        &GenerateRequest {
            prompt: Prompt::Text(prompt.into()),
            max_tokens: 12,
            sampling: SamplerConfig::default(),
            stop: Vec::new(),
            prompt_logprobs: 0,
            ignore_eos: true,
        },
        |_| {},
    )
    .unwrap();
    let got: Vec<u32> = msgs.iter().map(|m| m.token).collect();
    assert_eq!(got, want.tokens);
    assert_eq!(t.prompt_tokens as usize, want.prompt_tokens.len());
    let streamed: String = msgs.iter().map(|m| m.text.as_str()).collect();
    assert_eq!(Some(streamed), want.text);
}

#[tokio::test]
async fn token_input_reports_logprobs_and_the_greedy_token_is_the_most_likely() {
    let d = Daemon::with_test_model(&[]).await;
    let mut client = d.client().await;
    let msgs = collect(
        &mut client,
        pb::GenerateRequest {
            input: tokens(&[1, 2, 3]),
            max_tokens: 4,
            logprobs: true,
            top_logprobs: 3,
            prompt_logprobs: 2,
            ignore_eos: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(msgs.len(), 4);
    assert_eq!(
        msgs[0].prompt_logprobs.len(),
        3,
        "one entry per prompt position"
    );
    assert!(msgs[1..].iter().all(|m| m.prompt_logprobs.is_empty()));
    for m in &msgs {
        assert_eq!(m.top_logprobs.len(), 3);
        assert_eq!(
            m.top_logprobs[0].token, m.token,
            "greedy picks the most likely"
        );
        assert_eq!(m.logprob, Some(m.top_logprobs[0].logprob));
        assert!(m
            .top_logprobs
            .windows(2)
            .all(|w| w[0].logprob >= w[1].logprob));
    }
}

#[tokio::test]
async fn chat_input_is_rendered_and_stop_strings_end_the_stream() {
    let d = Daemon::with_test_model(&[]).await;
    let mut client = d.client().await;
    let msgs = collect(
        &mut client,
        pb::GenerateRequest {
            input: chat(),
            max_tokens: 6,
            ignore_eos: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let t = msgs.last().unwrap().timings.unwrap();
    // The rendered conversation, tokenized by the daemon, is the prompt.
    let rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n\
                    <|im_start|>assistant\n";
    let ids = client
        .tokenize(pb::TokenizeRequest {
            text: rendered.into(),
            add_special: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .tokens;
    assert_eq!(t.prompt_tokens as usize, ids.len());

    // Stop at the second character of what the model says anyway.
    let full: String = msgs.iter().map(|m| m.text.as_str()).collect();
    let Some((at, _)) = full.char_indices().nth(1) else {
        panic!("the model generated text: {full:?}")
    };
    let stop = full[at..].chars().next().unwrap().to_string();
    let req = pb::GenerateRequest {
        input: chat(),
        max_tokens: 6,
        ignore_eos: true,
        stop: vec![stop.clone()],
        ..Default::default()
    };
    let stopped = collect(&mut client, req).await.unwrap();
    let text: String = stopped.iter().map(|m| m.text.as_str()).collect();
    assert_eq!(
        stopped.last().unwrap().finish_reason(),
        pb::FinishReason::StopString
    );
    assert!(
        !text.contains(&stop),
        "{text:?} must not include the stop string {stop:?}"
    );
    assert!(full.starts_with(&text));
}

#[tokio::test]
async fn models_load_list_generate_status_and_unload() {
    let d = Daemon::with_test_model(&[]).await;
    let mut client = d.client().await;
    let mut progress = client
        .load_model(pb::LoadModelRequest {
            path: test_model().display().to_string(),
            name: "second".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut stages = Vec::new();
    while let Some(p) = progress.message().await.unwrap() {
        stages.push(p);
    }
    let last = stages.last().unwrap();
    assert!(last.ready && last.bytes_done == last.bytes_total && last.bytes_total > 0);
    assert!(stages.iter().any(|p| p.stage == "reading weights"));

    let list = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    let names: Vec<&str> = list.models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["tiny-qwen3moe-q8_0", "second"]);
    assert!(list.models[0].is_default && !list.models[1].is_default);
    assert_eq!(list.models[1].architecture, "qwen3moe");

    let again = client
        .load_model(pb::LoadModelRequest {
            path: test_model().display().to_string(),
            name: "second".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(again.code(), Code::AlreadyExists);

    let msgs = collect(
        &mut client,
        pb::GenerateRequest {
            model: "second".into(),
            input: tokens(&[1, 2]),
            max_tokens: 3,
            ignore_eos: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(msgs.len(), 3);

    let status = client
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    let second = status.models.iter().find(|m| m.name == "second").unwrap();
    assert_eq!(second.device, "cpu");
    assert_eq!(second.tiers.len(), 1);
    assert_eq!(second.tiers[0].tier, "ram");
    assert!(second.tiers[0].bytes > 0 && second.kv_cache_bytes > 0);
    assert_eq!(second.generated_tokens, 3);
    assert_eq!(second.queue_depth, 0);

    client
        .unload_model(pb::UnloadModelRequest {
            name: "second".into(),
        })
        .await
        .unwrap();
    let gone = collect(
        &mut client,
        pb::GenerateRequest {
            model: "second".into(),
            input: tokens(&[1, 2]),
            ..Default::default()
        },
    )
    .await
    .unwrap_err();
    assert_eq!(gone.code(), Code::InvalidArgument);
    assert!(
        gone.message().contains("tiny-qwen3moe-q8_0"),
        "{}",
        gone.message()
    );
    let missing = client
        .unload_model(pb::UnloadModelRequest {
            name: "second".into(),
        })
        .await
        .unwrap_err();
    assert_eq!(missing.code(), Code::NotFound);
}

/// A MoE model on the CPU under a RAM budget: its routed experts are read from the file into
/// a cache of that size as tokens need them; it serves the memory-mapped model's tokens, and
/// Status shows the experts on the SSD with the cache's counters. A budget under one token's
/// experts is refused with what it needs.
#[tokio::test]
async fn a_cpu_model_under_a_ram_budget_serves_the_mapped_models_tokens() {
    let d = Daemon::with_test_model(&[]).await;
    let mut client = d.client().await;
    let model = Model::open(test_model()).unwrap();
    let least = spillway_daemon::stream::minimum_ram_budget(&model);
    let load = |name: &str, ram_bytes: u64| pb::LoadModelRequest {
        path: test_model().display().to_string(),
        name: name.into(),
        device: "cpu".into(),
        budgets: Some(pb::Budgets {
            vram_bytes: 0,
            ram_bytes,
        }),
        ..Default::default()
    };
    let err = daemon::load_model(&mut client, load("low", least - 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{}", err.message());
    assert!(err.message().contains("RAM budget"), "{}", err.message());
    daemon::load_model(&mut client, load("ram", least))
        .await
        .unwrap();

    let request = |model: &str, prompt: &[u32]| pb::GenerateRequest {
        model: model.into(),
        input: tokens(prompt),
        max_tokens: 6,
        ignore_eos: true,
        ..Default::default()
    };
    // Two at once share decode steps through the cache, which holds one token's experts.
    let prompts: [&[u32]; 2] = [&[1, 2, 3], &[40, 41, 42, 43, 44, 45, 46, 47, 48]];
    let want = futures_join(&d, &prompts.map(|p| request("", p))).await;
    let got = futures_join(&d, &prompts.map(|p| request("ram", p))).await;
    assert_eq!(got, want);

    let status = client
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    let ram = status.models.iter().find(|m| m.name == "ram").unwrap();
    let mapped = status.models.iter().find(|m| m.name != "ram").unwrap();
    let tiers: Vec<&str> = ram.tiers.iter().map(|t| t.tier.as_str()).collect();
    assert_eq!(tiers, ["ram", "ssd"]);
    assert_eq!(
        ram.tiers.iter().map(|t| t.bytes).sum::<u64>(),
        mapped.tiers[0].bytes
    );
    let tier = ram.ram_tier.expect("the RAM tier's counters");
    assert!(tier.buffer_bytes <= least, "{tier:?}");
    assert!(tier.misses > 0 && tier.bytes_read > 0, "{tier:?}");
    assert!(mapped.ram_tier.is_none());
}

/// `serve --ram-budget B --predict-experts true`: the default model on the CPU reads its
/// experts through a RAM tier that predicts the next layer's choices, and Status counts the
/// predictions it checked.
#[tokio::test]
async fn serve_predicts_experts_under_a_daemon_wide_ram_budget_when_asked() {
    let model = Model::open(test_model()).unwrap();
    let least = spillway_daemon::stream::minimum_ram_budget(&model);
    let budget = format!("{}", 2 * least);
    let d = Daemon::with_test_model(&["--ram-budget", &budget, "--predict-experts", "true"]).await;
    let mut client = d.client().await;
    let request = pb::GenerateRequest {
        input: tokens(&[1, 2, 3]),
        max_tokens: 8,
        ignore_eos: true,
        ..Default::default()
    };
    let got = futures_join(&d, &[request]).await;
    assert_eq!(got[0].len(), 8, "{got:?}");
    let status = client
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    let tier = status.models[0].ram_tier.expect("the RAM tier's counters");
    assert!(
        tier.predicted_right + tier.predicted_wrong > 0,
        "no prediction was checked: {tier:?}"
    );
}

/// Polls Status until the default model's queue is empty (the daemon noticed the cancel).
async fn wait_idle(client: &mut pb::spillway_client::SpillwayClient<tonic::transport::Channel>) {
    let start = std::time::Instant::now();
    loop {
        let s = client
            .status(pb::StatusRequest {})
            .await
            .unwrap()
            .into_inner();
        if s.models[0].queue_depth == 0 {
            return;
        }
        assert!(
            start.elapsed() < PATIENCE,
            "the cancelled request never stopped"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_cancelled_stream_stops_and_the_next_request_works() {
    let d = Daemon::with_test_model(&["--ctx", LONG_CONTEXT]).await;
    let mut client = d.client().await;
    let mut stream = client
        .generate(endless(&[1, 2, 3]))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..2 {
        assert!(stream.message().await.unwrap().is_some());
    }
    drop(stream);
    wait_idle(&mut client).await;
    let before = client
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner()
        .models[0]
        .generated_tokens;
    // Far fewer than the tens of thousands asked for: the work stopped.
    assert!(before < 30_000, "{before} tokens generated");

    let msgs = collect(
        &mut client,
        pb::GenerateRequest {
            input: tokens(&[4, 5]),
            max_tokens: 3,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(!msgs.is_empty() && msgs.last().unwrap().timings.is_some());
}

#[tokio::test]
async fn a_request_beyond_the_queue_is_refused_at_once() {
    let d = Daemon::with_test_model(&[
        "--queue-depth",
        "1",
        "--max-batch",
        "1",
        "--ctx",
        LONG_CONTEXT,
    ])
    .await;
    let mut client = d.client().await;
    // One running (it has produced a token), one waiting.
    let mut running = client
        .generate(endless(&[1, 2]))
        .await
        .unwrap()
        .into_inner();
    assert!(running.message().await.unwrap().is_some());
    let waiting = client
        .generate(endless(&[3, 4]))
        .await
        .unwrap()
        .into_inner();
    let refused = client.generate(endless(&[5, 6])).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Code::ResourceExhausted,
        "{}",
        refused.message()
    );
    assert!(refused.message().contains("--queue-depth"));
    let status = client
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.models[0].queue_depth, 2);
    assert_eq!(status.models[0].queue_capacity, 1);
    drop((running, waiting));
    wait_idle(&mut client).await;
}

/// With no queue, a request is taken while a sequence is free for it, also while others run
/// (before, only while none ran), and refused once every sequence runs one.
#[tokio::test]
async fn without_a_queue_a_request_runs_beside_others_while_a_sequence_is_free() {
    let d = Daemon::with_test_model(&[
        "--queue-depth",
        "0",
        "--max-batch",
        "2",
        "--ctx",
        LONG_CONTEXT,
    ])
    .await;
    let mut client = d.client().await;
    let mut first = client
        .generate(endless(&[1, 2]))
        .await
        .unwrap()
        .into_inner();
    assert!(first.message().await.unwrap().is_some());
    let mut second = client
        .generate(endless(&[3, 4]))
        .await
        .expect("a free sequence takes it")
        .into_inner();
    assert!(second.message().await.unwrap().is_some());
    let refused = client.generate(endless(&[5, 6])).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Code::ResourceExhausted,
        "{}",
        refused.message()
    );
    let status = client
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.models[0].queue_depth, 2);
    drop((first, second));
    wait_idle(&mut client).await;
}

#[tokio::test]
async fn a_request_predicted_to_wait_past_the_limit_is_refused_and_others_are_queued() {
    let d = Daemon::with_test_model(&[
        "--queue-depth",
        "4",
        "--max-batch",
        "1",
        "--max-queue-wait-ms",
        "1000",
        "--ctx",
        LONG_CONTEXT,
    ])
    .await;
    let mut client = d.client().await;
    // The one sequence runs a request of 30,000 tokens; once a few steps are measured, a
    // request behind it would wait far longer than a second.
    let mut running = client
        .generate(endless(&[1, 2]))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..4 {
        assert!(running.message().await.unwrap().is_some());
    }
    let refused = client.generate(endless(&[3, 4])).await.unwrap_err();
    assert_eq!(
        refused.code(),
        Code::ResourceExhausted,
        "{}",
        refused.message()
    );
    assert!(
        refused.message().contains("--max-queue-wait"),
        "{}",
        refused.message()
    );
    let status = client
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        status.models[0].queue_depth, 1,
        "the refused one never queued"
    );
    drop(running);
    wait_idle(&mut client).await;

    // Short requests predict short waits: three sent together all run, one after another.
    let short = |first: u32| pb::GenerateRequest {
        input: tokens(&[first, first + 1]),
        max_tokens: 4,
        ignore_eos: true,
        ..Default::default()
    };
    let (mut a, mut b, mut c) = (client.clone(), client.clone(), client.clone());
    let (ra, rb, rc) = tokio::join!(
        collect(&mut a, short(1)),
        collect(&mut b, short(3)),
        collect(&mut c, short(5)),
    );
    for r in [ra, rb, rc] {
        assert_eq!(r.unwrap().len(), 4);
    }
}

#[tokio::test]
async fn concurrent_requests_share_decode_steps_and_get_their_results_alone() {
    let d = Daemon::with_test_model(&["--max-batch", "3"]).await;
    let mut client = d.client().await;
    let req = |ids: &[u32], n| pb::GenerateRequest {
        input: tokens(ids),
        max_tokens: n,
        ignore_eos: true,
        ..Default::default()
    };
    let reqs = [req(&[1, 2, 3], 8), req(&[9, 8], 5), req(&[4], 11)];
    let mut alone = Vec::new();
    for r in &reqs {
        let msgs = collect(&mut client, r.clone()).await.unwrap();
        alone.push(msgs.iter().map(|m| m.token).collect::<Vec<_>>());
    }
    let together = futures_join(&d, &reqs).await;
    assert_eq!(together, alone);
}

/// Runs the requests at the same time, each on its own connection.
async fn futures_join(d: &Daemon, reqs: &[pb::GenerateRequest]) -> Vec<Vec<u32>> {
    let mut tasks = Vec::new();
    for r in reqs {
        let mut client = d.client().await;
        let r = r.clone();
        tasks.push(tokio::spawn(async move {
            let msgs = collect(&mut client, r).await.unwrap();
            msgs.iter().map(|m| m.token).collect::<Vec<_>>()
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test]
async fn bad_arguments_are_refused_before_any_compute() {
    let d = Daemon::with_test_model(&["--ctx", "64"]).await;
    let mut client = d.client().await;
    let ok = || pb::GenerateRequest {
        input: tokens(&[1, 2]),
        max_tokens: 2,
        ..Default::default()
    };
    let cases: Vec<(pb::GenerateRequest, &str)> = vec![
        (
            pb::GenerateRequest {
                model: "nope".into(),
                ..ok()
            },
            "not loaded",
        ),
        (
            pb::GenerateRequest {
                input: None,
                ..ok()
            },
            "no input",
        ),
        (
            pb::GenerateRequest {
                input: tokens(&[]),
                ..ok()
            },
            "empty",
        ),
        (
            pb::GenerateRequest {
                input: text(""),
                ..ok()
            },
            "empty",
        ),
        (
            pb::GenerateRequest {
                input: tokens(&[u32::MAX]),
                ..ok()
            },
            "vocabulary",
        ),
        (
            pb::GenerateRequest {
                max_tokens: 63,
                ..ok()
            },
            "at most 62",
        ),
        (
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams {
                    temperature: -0.5,
                    ..Default::default()
                }),
                ..ok()
            },
            "temperature",
        ),
        (
            pb::GenerateRequest {
                sampling: Some(pb::SamplingParams {
                    top_p: 1.5,
                    ..Default::default()
                }),
                ..ok()
            },
            "top_p",
        ),
        (
            pb::GenerateRequest {
                input: text(&"a".repeat(2 << 20)),
                ..ok()
            },
            "bytes",
        ),
        (
            pb::GenerateRequest {
                stop: vec![String::new()],
                ..ok()
            },
            "stop string",
        ),
    ];
    for (req, says) in cases {
        let e = collect(&mut client, req).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
        assert!(
            e.message().contains(says),
            "{:?} lacks {says:?}",
            e.message()
        );
    }
    let status = client
        .status(pb::StatusRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(status.models[0].generated_tokens, 0, "nothing was computed");
}

#[tokio::test]
async fn a_deadline_ends_the_stream_with_deadline_exceeded() {
    let d = Daemon::with_test_model(&["--ctx", LONG_CONTEXT]).await;
    let mut client = d.client().await;
    let mut req = tonic::Request::new(endless(&[1, 2]));
    req.set_timeout(Duration::from_millis(300));
    let result = async {
        let mut stream = client.generate(req).await?.into_inner();
        while stream.message().await?.is_some() {}
        Ok::<_, tonic::Status>(())
    }
    .await;
    assert_eq!(result.unwrap_err().code(), Code::DeadlineExceeded);
    wait_idle(&mut client).await;
}

#[tokio::test]
async fn sigterm_while_streaming_exits_zero() {
    let mut d = Daemon::with_test_model(&["--grace-period", "0.5", "--ctx", LONG_CONTEXT]).await;
    let mut client = d.client().await;
    let mut stream = client
        .generate(endless(&[1, 2, 3]))
        .await
        .unwrap()
        .into_inner();
    assert!(stream.message().await.unwrap().is_some());
    d.terminate();
    // The stream ends: cut off after the grace period with UNAVAILABLE (or the connection).
    let end = loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => break None,
            Err(e) => break Some(e.code()),
        }
    };
    assert_ne!(end, None, "an endless stream cannot have finished normally");
    let status = d.wait_exit();
    assert_eq!(status.code(), Some(0), "log:\n{}", d.log_text());
    assert!(!d.socket.exists(), "the socket file is removed");
}

#[tokio::test]
async fn without_a_model_the_default_model_is_written_and_served() {
    let d = Daemon::start(&[]).await;
    let mut client = d.client().await;
    let list = client
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.models.len(), 1);
    assert_eq!(list.models[0].name, "default");
    assert!(list.models[0]
        .path
        .starts_with(d.dir.path().join("cache/spillway").to_str().unwrap()));
    let msgs = collect(
        &mut client,
        pb::GenerateRequest {
            input: text("Hello"),
            max_tokens: 2,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(msgs.last().unwrap().timings.is_some());
}

#[tokio::test]
async fn tcp_with_a_token_needs_the_bearer_token() {
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "t0k3n\n").unwrap();
    let model = test_model().to_str().unwrap().to_string();
    let d = Daemon::spawn(
        &[
            "--model",
            &model,
            "--listen",
            "127.0.0.1:0",
            "--token-file",
            token_file.to_str().unwrap(),
        ],
        &[],
    );
    // The daemon prints the address it bound.
    let start = std::time::Instant::now();
    let url = loop {
        let log = d.log_text();
        if let Some(line) = log.lines().find(|l| l.contains("listening on http://")) {
            break line.rsplit("listening on ").next().unwrap().to_string();
        }
        assert!(start.elapsed() < PATIENCE, "no address printed:\n{log}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let channel = loop {
        if let Ok(c) = tonic::transport::Endpoint::from_shared(url.clone())
            .unwrap()
            .connect()
            .await
        {
            break c;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let mut plain = pb::spillway_client::SpillwayClient::new(channel.clone());
    let e = plain
        .list_models(pb::ListModelsRequest {})
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    let mut wrong = tonic::Request::new(pb::ListModelsRequest {});
    wrong
        .metadata_mut()
        .insert("authorization", "Bearer nope".parse().unwrap());
    assert_eq!(
        plain.list_models(wrong).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    let mut right = tonic::Request::new(pb::ListModelsRequest {});
    right
        .metadata_mut()
        .insert("authorization", "Bearer t0k3n".parse().unwrap());
    plain.list_models(right).await.unwrap();
}

#[test]
fn a_public_address_without_a_token_is_refused_at_start() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_spillwayd"))
        .args(["serve", "--listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--token-file"), "{err}");
}
