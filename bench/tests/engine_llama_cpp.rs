//! Spillway's CPU engine against llama.cpp: for each fixture in daemon/tests/data/logits/
//! (recorded by scripts/fixtures/make_logit_fixtures.py from llama-cpp-python), regenerate the
//! same synthetic model in-process, evaluate the same tokens and compare, at every position,
//! the log-probabilities of llama.cpp's top-20 tokens and the argmax.
//!
//! The test lives in bench because the generator does (bench depends on daemon, not the
//! reverse). Pass criteria, per model: at least 95% of positions have all 20 log-probabilities
//! within 0.05 of llama.cpp's, and the argmax agrees at at least 90% of positions; for F32 and
//! F16 weights every log-probability must also be within 0.002.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use spillway_bench::synth::{SynthModel, WeightType};
use spillway_daemon::engine::ops::log_softmax;
use spillway_daemon::engine::{argmax, Engine, EngineOptions};
use spillway_daemon::gguf::writer::{GgufWriter, TensorSpec};
use spillway_daemon::gguf::{GgmlType, GgufFile, Value};
use spillway_daemon::model::Model;

const TOLERANCE: f32 = 0.05;
const MIN_CLOSE: f64 = 0.95;
const MIN_ARGMAX: f64 = 0.90;
/// Float weights involve no activation quantization, so there the engine must agree far more
/// closely (what remains is summation order); this catches graph mistakes such as a missing
/// renormalisation of expert weights, which move log-probabilities by ~0.03.
const FLOAT_MAX_ERR: f32 = 0.002;

#[derive(Deserialize)]
struct Fixture {
    preset: String,
    #[serde(rename = "type")]
    weights: String,
    seed: u64,
    llama_cpp_python: String,
    tokens: Vec<u32>,
    positions: Vec<Position>,
}

#[derive(Deserialize)]
struct Position {
    ids: Vec<u32>,
    logprobs: Vec<f32>,
}

/// How one model compares with its fixture.
#[derive(Debug)]
struct Comparison {
    close: f64,
    argmax: f64,
    max_err: f32,
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../daemon/tests/data/logits")
}

/// The generator has no Qwen2 presets; the fixture script derives them (`derive` there).
fn derived(preset: &str) -> Option<(&'static str, &'static str)> {
    match preset {
        "tiny-qwen2" => Some(("tiny-llama", "qwen2")),
        "tiny-qwen2moe" => Some(("tiny-qwen3moe", "qwen2moe")),
        _ => None,
    }
}

const SHARED_FF: u64 = 256;
const BIAS_SCALE: f32 = 1.5e-5;
const WEIGHT_SCALE: f32 = 1.0e-6;

/// The fixture script's `pattern`: a hash of the index, centred, times an f32 scale.
fn pattern(n: u64, salt: u64, scale: f32) -> Vec<u8> {
    (0..n)
        .flat_map(|i| {
            let h = (i.wrapping_mul(2_654_435_761).wrapping_add(salt * 40503) & 0xffff_ffff) >> 16;
            ((h as i64 - 32768) as f32 * scale).to_le_bytes()
        })
        .collect()
}

/// Mirror of the fixture script's `derive`: renames the architecture's keys, drops QK-norm,
/// adds Q/K/V biases and (qwen2moe) a shared expert with its gate.
fn derive(src: &Path, dst: &Path, arch: &str) {
    let f = GgufFile::open(src).unwrap();
    let md = f.metadata();
    let old = md.get_str("general.architecture").unwrap().to_owned();
    let mut metadata: Vec<(String, Value)> = md
        .iter()
        .map(|(k, v)| match k.strip_prefix(&format!("{old}.")) {
            _ if k == "general.architecture" => (k.to_owned(), Value::String(arch.into())),
            Some(rest) => (format!("{arch}.{rest}"), v.clone()),
            None => (k.to_owned(), v.clone()),
        })
        .collect();
    let get = |k: &str| u64::from(md.get_u32(&format!("{old}.{k}")).unwrap());
    let (n_embd, n_layer, hd) = (
        get("embedding_length"),
        get("block_count"),
        get("attention.key_length"),
    );
    let (n_head, n_head_kv) = (get("attention.head_count"), get("attention.head_count_kv"));
    if arch == "qwen2moe" {
        metadata.push((
            format!("{arch}.expert_shared_feed_forward_length"),
            Value::U32(SHARED_FF as u32),
        ));
    }
    let mut specs = Vec::new();
    let mut data: Vec<Vec<u8>> = Vec::new();
    for t in f.tensors() {
        if t.name.ends_with("attn_q_norm.weight") || t.name.ends_with("attn_k_norm.weight") {
            continue;
        }
        specs.push(TensorSpec::new(t.name.clone(), t.ggml_type, &t.dims));
        data.push(f.tensor_data(t).to_vec());
    }
    for l in 0..n_layer {
        let mut extra = vec![
            ("attn_q.bias", vec![n_head * hd], BIAS_SCALE),
            ("attn_k.bias", vec![n_head_kv * hd], BIAS_SCALE),
            ("attn_v.bias", vec![n_head_kv * hd], BIAS_SCALE),
        ];
        if arch == "qwen2moe" {
            extra.extend([
                ("ffn_gate_inp_shexp.weight", vec![n_embd], WEIGHT_SCALE),
                (
                    "ffn_gate_shexp.weight",
                    vec![n_embd, SHARED_FF],
                    WEIGHT_SCALE,
                ),
                ("ffn_up_shexp.weight", vec![n_embd, SHARED_FF], WEIGHT_SCALE),
                (
                    "ffn_down_shexp.weight",
                    vec![SHARED_FF, n_embd],
                    WEIGHT_SCALE,
                ),
            ]);
        }
        for (k, (name, dims, scale)) in extra.into_iter().enumerate() {
            let n = dims.iter().product();
            specs.push(TensorSpec::new(
                format!("blk.{l}.{name}"),
                GgmlType::F32,
                &dims,
            ));
            data.push(pattern(n, 16 * l + k as u64 + 1, scale));
        }
    }
    let mut w = GgufWriter::create(dst, &metadata, &specs).unwrap();
    for (spec, bytes) in specs.iter().zip(&data) {
        w.begin_tensor(&spec.name).unwrap();
        w.write_chunk(bytes).unwrap();
    }
    w.finish().unwrap();
}

fn compare(fx: &Fixture, dir: &Path) -> Comparison {
    let weights: WeightType = fx.weights.parse().expect("fixture weight type");
    let (base, arch) = match derived(&fx.preset) {
        Some((base, arch)) => (base, Some(arch)),
        None => (fx.preset.as_str(), None),
    };
    let synth = SynthModel::from_name(base, weights, fx.seed).expect("preset");
    let path = dir.join(format!("{}-{}.gguf", fx.preset, fx.weights));
    let src = dir.join("source.gguf");
    synth
        .write(if arch.is_some() { &src } else { &path }, false, |_, _| {})
        .expect("writing the model");
    if let Some(arch) = arch {
        derive(&src, &path, arch);
    }
    let model = Arc::new(Model::open(&path).expect("loading the model"));
    let mut engine = Engine::new(
        model,
        &EngineOptions {
            threads: 2,
            context: 64,
        },
    );
    let (mut close, mut agree, mut max_err) = (0usize, 0usize, 0.0f32);
    // One batch, as llama.cpp evaluated the fixture.
    let all = engine.eval_batch(&fx.tokens, true).expect("eval").to_vec();
    let n_vocab = all.len() / fx.tokens.len();
    for (logits, pos) in all.chunks_exact(n_vocab).zip(&fx.positions) {
        let lp = log_softmax(logits);
        let err = pos
            .ids
            .iter()
            .zip(&pos.logprobs)
            .map(|(&id, &want)| (lp[id as usize] - want).abs())
            .fold(0.0f32, f32::max);
        max_err = max_err.max(err);
        close += usize::from(err <= TOLERANCE);
        agree += usize::from(argmax(logits) as u32 == pos.ids[0]);
    }
    let n = fx.positions.len() as f64;
    // Token by token (decoding) must give the very same logits as the batch.
    engine.reset();
    for (&tok, batch) in fx.tokens.iter().zip(all.chunks_exact(n_vocab)) {
        let one = engine.eval(tok).expect("eval");
        assert!(
            one == batch,
            "{} {}: batch and token-by-token logits differ",
            fx.preset,
            fx.weights
        );
    }
    std::fs::remove_file(&path).ok();
    Comparison {
        close: close as f64 / n,
        argmax: agree as f64 / n,
        max_err,
    }
}

#[test]
fn cpu_engine_matches_llama_cpp_logprobs_on_every_fixture() {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(fixture_dir())
        .expect("fixture directory")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    paths.sort();
    assert!(paths.len() >= 20, "expected the committed fixtures");
    let tmp = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for p in &paths {
        let fx: Fixture = serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        let c = compare(&fx, tmp.path());
        println!(
            "{:<14} {:<7} close {:>5.1}%  argmax {:>5.1}%  max |Δlogprob| {:.5}  (llama-cpp-python {})",
            fx.preset,
            fx.weights,
            100.0 * c.close,
            100.0 * c.argmax,
            c.max_err,
            fx.llama_cpp_python
        );
        let float = matches!(fx.weights.as_str(), "F32" | "F16");
        if c.close < MIN_CLOSE || c.argmax < MIN_ARGMAX || (float && c.max_err > FLOAT_MAX_ERR) {
            failures.push(format!("{} {}: {c:?}", fx.preset, fx.weights));
        }
    }
    assert!(failures.is_empty(), "mismatches: {failures:#?}");
}

fn load_fixture(name: &str) -> Fixture {
    let text = std::fs::read_to_string(fixture_dir().join(name)).expect("fixture");
    serde_json::from_str(&text).unwrap()
}

#[test]
fn generation_reports_prompt_logprobs_like_llama_cpp_and_greedy_is_deterministic() {
    use spillway_daemon::engine::generate::{generate, GenerateRequest, Prompt};
    use spillway_daemon::engine::SamplerConfig;

    let fx = load_fixture("tiny-qwen3-Q8_0.json");
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    let weights: WeightType = fx.weights.parse().unwrap();
    SynthModel::from_name(&fx.preset, weights, fx.seed)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    let options = EngineOptions {
        threads: 2,
        ..EngineOptions::default()
    };
    let mut engine = Engine::new(Arc::new(Model::open(&path).unwrap()), &options);
    let request = GenerateRequest {
        prompt: Prompt::Tokens(fx.tokens.clone()),
        max_tokens: 8,
        sampling: SamplerConfig::default(),
        stop: Vec::new(),
        prompt_logprobs: 5,
        ignore_eos: true,
    };
    let report = generate(&mut engine, None, &request, |_| {}).unwrap();
    assert_eq!(report.prompt_tokens, fx.tokens);
    assert_eq!(report.tokens.len(), 8);
    assert_eq!(report.prompt_logprobs.len(), fx.tokens.len());
    for (ours, theirs) in report.prompt_logprobs.iter().zip(&fx.positions) {
        assert_eq!(ours.len(), 5);
        for (o, (&id, &lp)) in ours.iter().zip(theirs.ids.iter().zip(&theirs.logprobs)) {
            // The top-5 sets agree unless two tokens are within the tolerance of each other.
            assert!((o.logprob - lp).abs() <= TOLERANCE, "{o:?} vs {id} {lp}");
        }
    }
    // Greedy: the first generated token is the argmax after the prompt.
    assert_eq!(
        report.tokens[0],
        report.prompt_logprobs.last().unwrap()[0].token
    );
    // The engine is reset between requests: the same request gives the same tokens.
    let again = generate(&mut engine, None, &request, |_| {}).unwrap();
    assert_eq!(again.tokens, report.tokens);
    let json: serde_json::Value = serde_json::to_value(&report).unwrap();
    for key in [
        "prompt_tokens",
        "tokens",
        "finish_reason",
        "prompt_logprobs",
        "timings",
    ] {
        assert!(json.get(key).is_some(), "{key} missing from {json}");
    }
    assert!(json["prompt_logprobs"][0][0]["logprob"].is_number());

    // Seeded sampling repeats.
    let sampled = GenerateRequest {
        sampling: SamplerConfig {
            temperature: 0.9,
            top_p: 0.95,
            seed: 11,
            ..SamplerConfig::default()
        },
        prompt_logprobs: 0,
        ..request
    };
    let a = generate(&mut engine, None, &sampled, |_| {})
        .unwrap()
        .tokens;
    assert_eq!(
        a,
        generate(&mut engine, None, &sampled, |_| {})
            .unwrap()
            .tokens
    );
}

#[test]
fn text_prompts_stream_text_and_stop_strings_end_generation() {
    use spillway_daemon::engine::generate::{
        generate, FinishReason, GenerateError, GenerateRequest, Prompt,
    };
    use spillway_daemon::engine::SamplerConfig;
    use spillway_daemon::tokenizer::Tokenizer;

    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("m.gguf");
    SynthModel::from_name("tiny-llama", "Q8_0".parse().unwrap(), 3)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    let model = Arc::new(Model::open(&path).unwrap());
    let tokenizer = Tokenizer::from_metadata(model.file().metadata()).unwrap();
    let options = EngineOptions {
        threads: 2,
        context: 64,
    };
    let mut engine = Engine::new(model, &options);
    let request = GenerateRequest {
        prompt: Prompt::Text("The keeper opened the gate".into()),
        max_tokens: 24,
        sampling: SamplerConfig::default(),
        stop: Vec::new(),
        prompt_logprobs: 0,
        ignore_eos: true,
    };
    let mut streamed = String::new();
    let free = generate(&mut engine, Some(&tokenizer), &request, |t| {
        streamed.push_str(t)
    })
    .unwrap();
    assert_eq!(
        free.prompt_tokens,
        tokenizer.encode("The keeper opened the gate", true)
    );
    let text = free.text.clone().unwrap();
    assert_eq!(streamed, text, "streamed pieces add up to the text");
    assert_eq!(free.finish_reason, FinishReason::MaxTokens);

    // Stop at a string taken from the middle of the free-running text.
    let mid = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[mid..].chars().take(3).collect();
    let cut = text.find(&stop).unwrap();
    let stopped_req = GenerateRequest {
        stop: vec![stop.clone()],
        ..request.clone()
    };
    let mut streamed = String::new();
    let stopped = generate(&mut engine, Some(&tokenizer), &stopped_req, |t| {
        streamed.push_str(t)
    })
    .unwrap();
    assert_eq!(stopped.finish_reason, FinishReason::StopString);
    assert_eq!(stopped.text.as_deref(), Some(&text[..cut]));
    assert_eq!(streamed, text[..cut]);
    assert!(stopped.tokens.len() < free.tokens.len());

    // Bad requests fail before any compute.
    let empty = GenerateRequest {
        prompt: Prompt::Tokens(Vec::new()),
        ..request.clone()
    };
    assert!(matches!(
        generate(&mut engine, Some(&tokenizer), &empty, |_| {}),
        Err(GenerateError::EmptyPrompt)
    ));
    let long = GenerateRequest {
        prompt: Prompt::Tokens(vec![1; 64]),
        ..request.clone()
    };
    assert!(matches!(
        generate(&mut engine, Some(&tokenizer), &long, |_| {}),
        Err(GenerateError::PromptTooLong {
            tokens: 64,
            capacity: 64
        })
    ));
    let text_without_tokenizer = generate(&mut engine, None, &request, |_| {});
    assert!(matches!(
        text_without_tokenizer,
        Err(GenerateError::NoTokenizer)
    ));
    let empty_stop = GenerateRequest {
        stop: vec![String::new()],
        ..request
    };
    assert!(matches!(
        generate(&mut engine, Some(&tokenizer), &empty_stop, |_| {}),
        Err(GenerateError::EmptyStop)
    ));
}
