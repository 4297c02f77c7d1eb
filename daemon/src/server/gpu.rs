//! A model served on a Vulkan device: its worker drives one [`GpuModel`] through the same
//! [`SequenceModel`] calls `spillwayd run --device vulkan` makes, so requests get the CPU
//! worker's queue, sampling, stop strings, streaming, cancellation and deadlines. The model's KV
//! cache holds `--max-batch` sequences ([`GpuModelOptions::sequences`]) where a decode step can
//! take their tokens together, so that many requests run at once and each decode step reads the
//! weights once for all of them ([`GpuModel::eval_batch`]); otherwise (a dense model with layers
//! on the CPU, MoE misses computed on the CPU or fetched) it holds one and requests run one at
//! a time. Prompts go in chunks where the model batches them, with cancellation and deadlines
//! checked between chunks. When the device is lost, the worker has [`GpuSequence::recover`] open
//! it again and reload the model there.

use std::sync::Arc;

use parking_lot::Mutex;

use super::device::{load_gpu_model, open_vulkan};
use super::worker::Sequences;
use crate::engine::generate::{GenerateError, SequenceModel};
use crate::engine::RamExperts;
use crate::gpu::alloc::Allocator;
use crate::gpu::expert_cache::ExpertStats;
use crate::gpu::footprint::{split_bytes, DeviceBytes};
use crate::gpu::forward::{GpuModel, GpuModelOptions, PREFILL_CHUNK};
use crate::gpu::GpuError;
use crate::model::Model;

/// What `Status` reads of a model on a Vulkan device while its worker runs.
pub struct GpuStatus {
    /// `vulkan:N (NAME)`.
    pub device: String,
    /// Weight bytes in VRAM, and those in RAM: routed experts (computed on the CPU, fetched or
    /// read over PCIe when routed; with PCIe, all of them), or a dense model's first layers
    /// (run on the CPU).
    pub vram_weights: u64,
    pub ram_weights: u64,
    /// Device memory the model holds (its allocator's blocks); replaced when the model is
    /// reloaded after a device loss.
    pub allocator: Mutex<Arc<Allocator>>,
    /// Where a MoE model's routed experts ran since loading, updated after every evaluation
    /// (`None` for dense models).
    pub experts: Mutex<Option<ExpertStats>>,
    /// The RAM tier of the experts computed on the CPU, under a RAM budget (those without a
    /// VRAM slot then live in the file); replaced on a reload.
    pub ram_tier: Mutex<Option<Arc<RamExperts>>>,
}

impl GpuStatus {
    /// Device-memory bytes held now.
    pub fn vram_bytes(&self) -> u64 {
        self.allocator.lock().budget().held()
    }

    /// The VRAM budget the model was loaded under, if any.
    pub fn vram_budget(&self) -> Option<u64> {
        self.allocator.lock().budget().limit()
    }
}

/// The worker's view of a [`GpuModel`]: its sequences.
pub struct GpuSequence {
    model: Arc<Model>,
    /// `None` between dropping the model of a lost device and loading it on a new one.
    gpu: Option<GpuModel>,
    /// The device index asked for and the options of the load, to load again after a loss.
    reload: (Option<usize>, GpuModelOptions),
    /// Positions a sequence holds, and sequences (the same after a reload).
    capacity: usize,
    sequences: usize,
    status: Arc<GpuStatus>,
}

impl GpuSequence {
    /// `footprint`: what the model takes on the device with every expert in VRAM.
    pub fn new(
        model: Arc<Model>,
        gpu: GpuModel,
        reload: (Option<usize>, GpuModelOptions),
        device: String,
        footprint: DeviceBytes,
    ) -> (GpuSequence, Arc<GpuStatus>) {
        let placement = gpu.placement();
        let left_in_ram = match placement.n_expert {
            // A dense model's first layers on the CPU (and the embedding they read).
            0 if gpu.cpu_layers() > 0 => {
                let gpu_part = split_bytes(&model, gpu.capacity(), gpu.cpu_layers());
                footprint.weights.saturating_sub(gpu_part.weights)
            }
            0 => 0,
            n => {
                let layers = placement.moe_layers.len().max(1) as u64;
                let left: usize = placement
                    .per_layer()
                    .iter()
                    .map(|&s| n.saturating_sub(s))
                    .sum();
                footprint.experts / (n as u64 * layers) * left as u64
            }
        };
        let status = Arc::new(GpuStatus {
            device,
            vram_weights: footprint
                .weights
                .saturating_sub(left_in_ram + gpu.host_embedding_bytes()),
            // With misses read over PCIe every routed expert is in RAM, the resident ones too.
            ram_weights: left_in_ram.max(gpu.host_expert_bytes()),
            allocator: Mutex::new(gpu.allocator().clone()),
            experts: Mutex::new(gpu.expert_stats()),
            ram_tier: Mutex::new(gpu.ram_experts()),
        });
        (
            GpuSequence {
                model,
                capacity: SequenceModel::capacity(&gpu),
                sequences: gpu.sequences(),
                gpu: Some(gpu),
                reload,
                status: status.clone(),
            },
            status,
        )
    }

    /// Drops the model of the lost device (freeing what it held), opens the device again and
    /// loads the model there with the options of the first load.
    pub fn reload(&mut self) -> Result<(), String> {
        self.gpu = None;
        let (index, options) = &self.reload;
        let device = open_vulkan(*index).map_err(|e| e.to_string())?;
        let gpu = load_gpu_model(&device, &self.model, options).map_err(|(_, message)| message)?;
        // The worker hands out the sequences the first load held (a plan without a VRAM budget
        // follows the memory the driver reports free, which may have shrunk since).
        if gpu.sequences() < self.sequences {
            return Err(format!(
                "the model reloads with room for {} sequences, fewer than the {} it serves",
                gpu.sequences(),
                self.sequences
            ));
        }
        *self.status.allocator.lock() = gpu.allocator().clone();
        *self.status.ram_tier.lock() = gpu.ram_experts();
        self.gpu = Some(gpu);
        Ok(())
    }

    fn loaded(&mut self) -> Result<&mut GpuModel, GpuError> {
        self.gpu.as_mut().ok_or(GpuError::DeviceLost)
    }

    /// The model's weights, for profiles (`super::profile::gpu`).
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The model on the device, for profiles (`super::profile::gpu`); `DeviceLost` while
    /// it is being reloaded.
    pub fn gpu_mut(&mut self) -> Result<&mut GpuModel, GpuError> {
        self.loaded()
    }

    /// Makes `seq` the sequence that [`GpuSequence::eval_one`] and the model's own calls act
    /// on (while the model is loaded).
    pub fn select(&mut self, seq: usize) {
        if let Some(gpu) = &mut self.gpu {
            gpu.select(seq);
        }
    }

    /// One token at the next position, the expert counters in the status updated.
    pub fn eval_one(&mut self, token: u32) -> Result<Vec<f32>, GpuError> {
        let gpu = self.loaded()?;
        let out = gpu.eval(token);
        if let Some(stats) = gpu.expert_stats() {
            *self.status.experts.lock() = Some(stats);
        }
        out
    }

    fn eval(
        &mut self,
        seq: usize,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, GenerateError> {
        let gpu = self.loaded()?;
        gpu.select(seq);
        let out = gpu.eval_tokens(tokens, all_logits);
        if let Some(stats) = gpu.expert_stats() {
            *self.status.experts.lock() = Some(stats);
        }
        out
    }
}

impl Sequences for GpuSequence {
    fn model(&self) -> &Model {
        &self.model
    }

    fn sequences(&self) -> usize {
        self.sequences
    }

    fn capacity(&self) -> usize {
        self.capacity
    }

    fn position(&self, seq: usize) -> usize {
        self.gpu.as_ref().map_or(0, |g| g.position_of(seq))
    }

    fn reset(&mut self, seq: usize) {
        if let Some(gpu) = &mut self.gpu {
            gpu.select(seq);
            SequenceModel::reset(gpu);
        }
    }

    /// A dense model's prompt goes in chunks ([`GpuModel::eval_prompt`]); a MoE model's token
    /// by token, so chunks would cost nothing there.
    fn prompt_chunk(&self) -> usize {
        match &self.gpu {
            Some(gpu) if gpu.batches_prompts() => PREFILL_CHUNK,
            _ => 1,
        }
    }

    fn eval_sequence(
        &mut self,
        seq: usize,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>, GenerateError> {
        self.eval(seq, tokens, all_logits)
    }

    /// One token of each listed sequence, in one pass where the model batches steps.
    fn step(&mut self, inputs: &[(usize, u32)]) -> Result<Vec<f32>, GenerateError> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let gpu = self.loaded()?;
        let out = gpu.eval_batch(inputs);
        if let Some(stats) = gpu.expert_stats() {
            *self.status.experts.lock() = Some(stats);
        }
        Ok(out?)
    }

    fn mixed_step_tokens(&self) -> usize {
        self.gpu.as_ref().map_or(0, GpuModel::mixed_step_tokens)
    }

    /// The prompts' parts and the other sequences' tokens in one pass where the model
    /// batches them ([`GpuModel::eval_mixed`]).
    fn step_mixed(&mut self, inputs: &[(usize, &[u32])]) -> Result<Vec<f32>, GenerateError> {
        let gpu = self.loaded()?;
        let out = gpu.eval_mixed(inputs);
        if let Some(stats) = gpu.expert_stats() {
            *self.status.experts.lock() = Some(stats);
        }
        Ok(out?)
    }

    fn gpu_profiler(&mut self) -> Option<&mut GpuSequence> {
        Some(self)
    }

    fn recover(&mut self) -> Result<(), String> {
        self.reload()
    }
}
