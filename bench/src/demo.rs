//! The README's first command: a synthetic MoE model written, read back through the validating
//! reader, described, its weights dequantized on the Vulkan device and on the CPU and compared,
//! and text generated from it by the CPU engine. The weights are random, so the text is too; a
//! trained default model replaces it.

use std::path::Path;
use std::sync::Arc;

use spillway_daemon::engine::{Engine, EngineOptions, Sampler, SamplerConfig};
use spillway_daemon::gguf::inspect::{human_bytes, Summary};
use spillway_daemon::gguf::{GgmlType, GgufFile};
use spillway_daemon::gpu::{Buffer, ComputePipeline, Device, Instance};
use spillway_daemon::model::Model;
use spillway_daemon::quant::dequantize_row;
use spillway_daemon::tokenizer::{Detokenizer, Tokenizer};
use spillway_shaders::{DequantParams, Feature, Op, PushConstants, ShaderId, WeightType as Wt};

use crate::synth::{SynthError, SynthModel, WeightType};

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Synth(#[from] SynthError),
    #[error(transparent)]
    Gguf(#[from] spillway_daemon::gguf::GgufError),
    #[error(transparent)]
    Gpu(#[from] spillway_daemon::gpu::GpuError),
    #[error(transparent)]
    Quant(#[from] spillway_daemon::quant::QuantError),
    #[error(transparent)]
    Model(#[from] spillway_daemon::model::ModelError),
    #[error(transparent)]
    Engine(#[from] spillway_daemon::engine::EngineError),
    #[error(transparent)]
    Tokenizer(#[from] spillway_daemon::tokenizer::TokenizerError),
    #[error("{tensor}: {differ} of {total} values differ between {device} and the CPU")]
    Mismatch {
        tensor: String,
        device: String,
        differ: usize,
        total: usize,
    },
}

/// What the GPU part of the demo found.
pub struct GpuCheck {
    pub device: String,
    pub tensors: usize,
    pub values: u64,
}

/// Writes `preset` as Q8_0 to `path`, opens it, and prints its summary to stdout.
pub fn write_and_describe(preset: &str, path: &Path) -> Result<GgufFile, DemoError> {
    let model = SynthModel::from_name(preset, WeightType::Uniform(GgmlType::Q8_0), 0)?;
    model.write(path, false, |_, _| {})?;
    let file = GgufFile::open(path)?;
    let mut text = String::new();
    Summary::new(&path.display().to_string(), &file)
        .write_text(&mut text)
        .expect("formatting into a String cannot fail");
    print!("{text}");
    println!(
        "read back and validated: {} tensors, {} of weights",
        file.tensors().len(),
        human_bytes(file.file_size())
    );
    Ok(file)
}

/// Dequantizes every Q8_0 tensor of `file` on the preferred Vulkan device and on the CPU, and
/// checks that they agree bit for bit.
pub fn dequantize_on_gpu(file: &GgufFile) -> Result<GpuCheck, DemoError> {
    let device: Arc<Device> = Device::open(Instance::new()?, None)?;
    let shader = ShaderId::find(Op::Dequant, Some(Wt::Q8_0), Feature::Base)
        .expect("the variant table has Q8_0 dequantization");
    let params_size = std::mem::size_of::<DequantParams>() as u32;
    let pipeline = ComputePipeline::new(&device, shader, 2, params_size, &[])?;
    let (mut tensors, mut values) = (0, 0u64);
    for t in file
        .tensors()
        .iter()
        .filter(|t| t.ggml_type == GgmlType::Q8_0)
    {
        if t.n_bytes > device.max_storage_buffer_range()
            || t.n_elements * 4 > device.max_storage_buffer_range()
        {
            continue; // binding by ranges arrives with the Vulkan backend proper
        }
        let bytes = file.tensor_data(t);
        let n = t.n_elements as usize;
        let mut src = Buffer::new_host_visible(&device, bytes.len().next_multiple_of(4) as u64)?;
        src.write(bytes);
        let dst = Buffer::new_host_visible(&device, (n * 4) as u64)?;
        let n_blocks = (n / 32) as u32;
        let params = DequantParams {
            n_blocks,
            src_offset: 0,
            dst_offset: 0,
        };
        pipeline.dispatch(
            &[&src, &dst],
            &params.bytes(),
            [n_blocks.div_ceil(64), 1, 1],
        )?;
        let mut cpu = vec![0f32; n];
        dequantize_row(t.ggml_type, bytes, &mut cpu)?;
        let gpu = dst.read_f32(n);
        let differ = gpu
            .iter()
            .zip(&cpu)
            .filter(|(g, c)| g.to_bits() != c.to_bits())
            .count();
        if differ > 0 {
            return Err(DemoError::Mismatch {
                tensor: t.name.clone(),
                device: device.info().name.clone(),
                differ,
                total: n,
            });
        }
        tensors += 1;
        values += t.n_elements;
    }
    Ok(GpuCheck {
        device: device.info().name.clone(),
        tensors,
        values,
    })
}

/// Greedy generation of `n` tokens after `prompt` on the CPU engine, streamed to stdout.
pub fn generate_text(path: &Path, prompt: &str, n: usize) -> Result<String, DemoError> {
    use std::io::Write;
    let model = Arc::new(Model::open(path)?);
    let tokenizer = Tokenizer::from_metadata(model.file().metadata())?;
    let mut engine = Engine::new(model, &EngineOptions::default());
    let mut sampler = Sampler::new(SamplerConfig::default());
    let mut history = tokenizer.encode(prompt, true);
    let mut logits = engine.eval_batch(&history, false)?.to_vec();
    let mut detok = Detokenizer::new(&tokenizer, false);
    let mut text = String::new();
    for _ in 0..n {
        let next = sampler.sample(&logits, &history);
        if tokenizer.is_eog(next) {
            break;
        }
        history.push(next);
        let piece = detok.push(next);
        print!("{piece}");
        let _ = std::io::stdout().flush();
        text.push_str(&piece);
        logits = engine.eval(next)?.to_vec();
    }
    let rest = detok.finish();
    print!("{rest}");
    text.push_str(&rest);
    Ok(text)
}
