//! Loading a [`GpuModel`]: the miss policy resolved, the placement planned within the VRAM
//! budget, the weights uploaded (the routed experts that fit into slots, and with misses read
//! over PCIe every routed expert into system RAM too), the scratch and the experts' bookkeeping
//! made; and what a model would need, before anything is uploaded.

use std::sync::Arc;

use spillway_shaders::WeightType;

use super::bus_rows::BusRows;
use super::gate_up::GateUp;
use super::*;
use crate::gpu::chain::Handoff;
use crate::gpu::placement::MissContext;

/// Whether the routed experts are copied into system RAM for the GPU to read misses from: a
/// partial placement with misses over PCIe, or shared between the bus and the CPU.
fn host_experts_planned(placement: &Placement, options: &GpuModelOptions) -> bool {
    placement.is_partial() && matches!(options.moe_miss, MoeMiss::Pcie | MoeMiss::Split)
}

/// Bytes of every routed expert of `model` in its file.
fn routed_expert_bytes(model: &Model) -> u64 {
    model
        .layers
        .iter()
        .map(|l| match &l.ffn {
            Ffn::Moe(m) => [&m.gate, &m.up, &m.down]
                .iter()
                .map(|w| model.stacked(w).data.len() as u64)
                .sum(),
            Ffn::Dense { .. } => 0,
        })
        .sum()
}

impl GpuModel {
    /// Device memory `model` would take with `options`, before any upload.
    /// With several sequences and misses on the CPU, room for a batched step's chunk
    /// ([`crate::gpu::footprint::moe_step_chunk_bytes`]).
    pub fn device_bytes(model: &Model, options: &GpuModelOptions) -> DeviceBytes {
        let capacity = Self::capacity_for(&model.config, options);
        let mut bytes = device_bytes(model, capacity).with_sequences(options.sequences.max(1));
        if options.sequences > 1 && options.moe_miss == MoeMiss::Cpu {
            bytes.activations += crate::gpu::footprint::moe_step_chunk_bytes(model, capacity);
        }
        bytes
    }

    fn stream_for(options: &GpuModelOptions) -> Option<usize> {
        options
            .stream_prompts
            .then_some(options.prompt_expert_slots)
    }

    fn capacity_for(c: &Config, options: &GpuModelOptions) -> usize {
        match options.context {
            0 => c.context_length.min(4096),
            n => n,
        }
    }

    /// The smallest VRAM budget that runs `model` with `options` on `device` (`None` for a
    /// dense model of one layer: it needs [`GpuModel::device_bytes`] whole).
    pub fn minimum_budget(
        device: &Arc<Device>,
        model: &Model,
        options: &GpuModelOptions,
    ) -> Option<MinimumBudget> {
        let needed = Self::device_bytes(model, options);
        let allocator = Allocator::new(device, None);
        let counts = allocator.budget_counts(MemoryUse::Staging);
        // A budget of 0 is under any model: the plan says what it would have needed. Misses
        // over PCIe need less (the embedding goes to system RAM too); fetched ones as many.
        let capacity = Self::capacity_for(&model.config, options);
        let (resolved, bus_fits) = Self::resolve_miss(device, model, options);
        let minimum = |miss| match plan(
            model,
            (&needed, capacity, Self::stream_for(options)),
            Some(0),
            (counts, allocator.mapped_reserve()),
            miss,
            &options.expert_layout,
        ) {
            Err(GpuError::BelowMinimumBudget { minimum, .. }) => Some(*minimum),
            _ => None,
        };
        let chosen = minimum(match resolved.moe_miss {
            m @ (MoeMiss::Pcie | MoeMiss::Split) => m,
            _ => MoeMiss::Cpu,
        });
        // Under a budget the CPU's placement does not fit, `auto` loads the bus's where the bus
        // may take the misses ([`GpuModel::new`]): its minimum is the one that holds there.
        let over = |m: &MinimumBudget| options.vram_budget.is_some_and(|b| m.total() > b);
        match chosen {
            Some(c) if resolved.moe_miss == MoeMiss::Cpu && bus_fits && over(&c) => {
                minimum(MoeMiss::Pcie).or(Some(c))
            }
            c => c,
        }
    }

    /// Uploads `model`'s weights to `device` and makes room for `options.context` positions.
    /// A MoE model larger than `options.vram_budget` (without one: than the device memory the
    /// driver reports free, where it reports it) keeps what is not a routed expert in VRAM and as
    /// many experts per layer as the rest of the budget holds; a dense one keeps as many of its
    /// last layers as the budget holds and runs the others on the CPU ([`super::placement`]).
    /// A model that cannot run within the budget is refused before anything is uploaded
    /// ([`GpuError::BelowMinimumBudget`]).
    pub fn new(
        device: &Arc<Device>,
        model: &Arc<Model>,
        options: &GpuModelOptions,
    ) -> Result<GpuModel> {
        let (mut resolved, bus_fits) = Self::resolve_miss(device, model, options);
        let mut tried = vec![resolved.moe_miss];
        loop {
            match Self::new_resolved(device, model, &resolved) {
                // `auto` chose a policy the device or the budget does not take: the next one
                // it may take, each tried once.
                Err(e) if options.moe_miss == MoeMiss::Auto => {
                    match resolved.moe_miss.auto_fallback(&e, bus_fits) {
                        Some(miss) if !tried.contains(&miss) => {
                            tracing::info!("misses {miss}, not {}: {e}", resolved.moe_miss);
                            tried.push(miss);
                            resolved.moe_miss = miss;
                        }
                        _ => return Err(e),
                    }
                }
                r => return r,
            }
        }
    }

    /// [`GpuModel::new`] with the miss policy resolved.
    fn new_resolved(
        device: &Arc<Device>,
        model: &Arc<Model>,
        options: &GpuModelOptions,
    ) -> Result<GpuModel> {
        let capacity = Self::capacity_for(&model.config, options);
        let allocator = Allocator::new(device, options.vram_budget);
        let counts = allocator.budget_counts(MemoryUse::Staging);
        // Without a budget the plan keeps to what the driver says is free for this process
        // (VK_EXT_memory_budget): a MoE model larger than that is placed in part, not refused by
        // an allocation halfway through its upload.
        let plan_budget = options.vram_budget.or_else(|| device.memory_budget());
        let plan_with = |options: &GpuModelOptions| {
            plan(
                model,
                (
                    &Self::device_bytes(model, options),
                    capacity,
                    Self::stream_for(options),
                ),
                plan_budget,
                (counts, allocator.mapped_reserve()),
                options.moe_miss,
                &options.expert_layout,
            )
        };
        let mut options = options.clone();
        let mut placement = match plan_with(&options) {
            Ok(p) if options.sequences <= 1 || p.batches_steps(options.moe_miss) => p,
            // The caches of more sequences than pay: a step that cannot take their tokens
            // together (layers on the CPU, misses on the CPU or fetched) takes them one by one,
            // and the VRAM is worth more as weights. Or they do not fit at all.
            _ => {
                options.sequences = 1;
                plan_with(&options)?
            }
        };
        let options = &options;
        let dense = model.config.moe.is_none();
        loop {
            match Self::load_split(&allocator, model, options, &placement, capacity) {
                // The alignment margin was short (fragmented blocks): fewer slots.
                Err(GpuError::OverBudget { .. })
                    if placement.is_partial() && placement.slots > 1 =>
                {
                    placement.slots -= (placement.slots / 8).max(1);
                }
                // ... or one layer more on the CPU.
                Err(GpuError::OverBudget { .. })
                    if dense && placement.cpu_layers + 1 < model.layers.len() =>
                {
                    placement.cpu_layers += 1;
                }
                r => return r,
            }
        }
    }

    /// `options` with [`MoeMiss::Auto`] resolved ([`MoeMiss::resolve`]) for `model` on `device`,
    /// and whether `auto` could read misses over the bus ([`MissContext::bus_fits`]).
    fn resolve_miss(
        device: &Arc<Device>,
        model: &Model,
        options: &GpuModelOptions,
    ) -> (GpuModelOptions, bool) {
        // A policy given is itself: no need to read the RAM left or the device's memory types.
        if options.moe_miss != MoeMiss::Auto {
            return (options.clone(), false);
        }
        let allocator = Allocator::new(device, None);
        // Staging that does not count against a VRAM budget is system RAM across a bus; the
        // experts it holds need the routing on the device.
        let routable = model
            .config
            .moe
            .is_some_and(|c| c.n_expert <= crate::gpu::ops::MOE_ROUTE_MAX_EXPERTS);
        let bus = !allocator.budget_counts(MemoryUse::Staging) && routable && !options.host_routing;
        let experts = routed_expert_bytes(model);
        // The share of the experts the budget holds beside what the model keeps in VRAM.
        let coverage = options
            .vram_budget
            .or_else(|| device.memory_budget())
            .map(|budget| {
                let needed = Self::device_bytes(model, options);
                let rest = needed.total().saturating_sub(needed.experts);
                budget.saturating_sub(rest) as f64 / needed.experts.max(1) as f64
            });
        let at = MissContext {
            bus,
            experts,
            ram_budget: options.ram_budget,
            headroom: crate::host_memory::headroom().map(|h| h.bytes),
            coverage,
            sequences: options.sequences,
        };
        let options = GpuModelOptions {
            moe_miss: options.moe_miss.resolve(&at),
            ..options.clone()
        };
        (options, at.bus_fits())
    }

    /// [`GpuModel::load`] of the layers `placement` puts on the GPU, with the others on the CPU.
    fn load_split(
        allocator: &Arc<Allocator>,
        model: &Arc<Model>,
        options: &GpuModelOptions,
        placement: &Placement,
        capacity: usize,
    ) -> Result<GpuModel> {
        let n_cpu = placement.cpu_layers;
        if n_cpu == 0 {
            return Self::load(allocator, model, options, placement, capacity);
        }
        let tail = Arc::new(model.layers_from(n_cpu));
        let mut gpu = Self::load(allocator, &tail, options, placement, capacity)?;
        if placement.stream_slot {
            let staging = placement.staging_bytes;
            gpu.stream = Some(stream::StreamSlot::new(
                model, allocator, staging, capacity,
            )?);
        }
        gpu.front = Some(CpuLayers::new(
            model.clone(),
            n_cpu,
            options.threads,
            capacity,
        ));
        if options.bus_rows {
            let device = allocator.device();
            let share = options.split_cpu_share;
            gpu.bus_rows = Some(BusRows::new(device, &gpu.kernels, model, n_cpu, share)?);
        }
        Ok(gpu)
    }

    fn load(
        allocator: &Arc<Allocator>,
        model: &Arc<Model>,
        options: &GpuModelOptions,
        placement: &Placement,
        capacity: usize,
    ) -> Result<GpuModel> {
        let c = model.config.clone();
        let device = allocator.device();
        let kernels = Kernels::with_int_dot(device, (true, options.coopmat), options.int_dot);
        kernels.set_matmul_tile(options.matmul_tile)?;
        kernels.set_matvec_cols(options.matvec_cols);
        kernels.set_q8_min_weights(options.q8_min_weights);
        let mut up = Uploader::new(allocator, placement.staging_bytes)?;
        let al = allocator;
        // Misses read by the GPU from system RAM: every routed expert is copied there too.
        let host_experts = host_experts_planned(placement, options);
        if host_experts {
            let bytes = routed_expert_bytes(model);
            if let Some(budget) = options.ram_budget.filter(|&b| b < bytes) {
                return Err(GpuError::Unsupported(format!(
                    "misses read over PCIe keep every routed expert in system RAM ({:.2} GiB), \
                     more than the RAM budget of {:.2} GiB: raise it, or use --moe-miss cpu",
                    bytes as f64 / (1u64 << 30) as f64,
                    budget as f64 / (1u64 << 30) as f64,
                )));
            }
        }
        let mut host_bytes = 0;
        let mut embedding_bytes = 0;
        // With the first layers on the CPU the step starts from their hidden state.
        let hidden_in = placement.cpu_layers > 0;
        let input_rows = if hidden_in {
            GpuMatrix {
                buffer: Buffer::new_in(al, c.n_embd as u64 * 4, MemoryUse::DeviceMapped)?,
                wtype: WeightType::F32,
                n_in: c.n_embd,
                n_out: 1,
                row_bytes: c.n_embd as u64 * 4,
            }
        } else if host_experts && model.output != model.token_embd {
            // With the experts, the embedding lives in system RAM (the plan counted it so).
            let e = model.mat(&model.token_embd);
            embedding_bytes = e.data.len() as u64;
            host_bytes += embedding_bytes;
            GpuMatrix::in_host_memory(device, e.ty, e.n_in, &[e.data])?
        } else {
            matrix(model, al, &mut up, &model.token_embd)?
        };
        let output = if model.output == model.token_embd && !hidden_in {
            None
        } else {
            Some(matrix(model, al, &mut up, &model.output)?)
        };
        let output_norm = upload_f32(al, &mut up, &model.output_norm)?;
        // The first layers on the CPU hold one sequence's cache: so does the rest.
        let sequences = match placement.cpu_layers {
            0 => options.sequences.max(1),
            _ => 1,
        };
        let kv_bytes = (sequences * capacity * c.kv_width() * 2) as u64;
        let max_range = allocator.device().max_storage_buffer_range();
        if kv_bytes > max_range {
            return Err(GpuError::Unsupported(format!(
                "a KV cache of {sequences} sequences of {capacity} positions takes {:.1} MiB a \
                 layer, more than the device binds at once ({:.1} MiB): fewer sequences or a \
                 shorter context",
                kv_bytes as f64 / (1u64 << 20) as f64,
                max_range as f64 / (1u64 << 20) as f64,
            )));
        }
        let mut layers = Vec::with_capacity(c.n_layer);
        for (il, layer) in model.layers.iter().enumerate() {
            let ffn = match &layer.ffn {
                Ffn::Dense {
                    gate,
                    up: w_up,
                    down,
                } => GpuFfn::Dense {
                    gate_up: GateUp::upload(model, al, &mut up, gate, w_up)?,
                    down: matrix(model, al, &mut up, down)?,
                },
                Ffn::Moe(moe) => {
                    let mut m = GpuMoe::upload(model, al, &mut up, moe, placement.slots_of(il))?;
                    if host_experts {
                        host_bytes += m.attach_host_experts(model, device, moe)?;
                    }
                    GpuFfn::Moe(m)
                }
            };
            layers.push(GpuLayer::upload(model, al, &mut up, layer, ffn, kv_bytes)?);
            // Bounds the staging memory the pending copies pin to one layer's worth.
            up.flush()?;
        }
        let table = rope_table(
            capacity,
            c.n_rot,
            c.rope_freq_base,
            c.rope_freq_scale,
            model.rope_freqs.as_deref(),
        );
        let rope = upload_f32(al, &mut up, &table)?;
        up.flush()?;
        let f32s = |n: usize| Buffer::new_in(al, n as u64 * 4, MemoryUse::DeviceLocal);
        let mut dense_ff = 0;
        let mut shared_ff = 0;
        for l in &layers {
            match &l.ffn {
                GpuFfn::Dense { gate_up, .. } => dense_ff = dense_ff.max(gate_up.n_ff()),
                GpuFfn::Moe(m) => shared_ff = shared_ff.max(m.shared_ff()),
            }
        }
        let moe = match &c.moe {
            Some(cfg) => Some(MoeScratch::new(
                al,
                cfg,
                (c.n_layer, c.n_embd, shared_ff),
                host_experts,
            )?),
            None => None,
        };
        let act = Activations {
            x: f32s(c.n_embd)?,
            xn: f32s(c.n_embd)?,
            q: f32s(c.q_width())?,
            k: f32s(c.kv_width())?,
            v: f32s(c.kv_width())?,
            attn: f32s(c.q_width())?,
            gate: f32s(dense_ff)?,
            up: f32s(dense_ff)?,
            scores: f32s(attention_scratch_floats(c.n_head, c.head_dim, capacity))?,
            attn_done: attention_counters(al, c.n_head, 1)?,
            step: Buffer::new_in(al, 24, MemoryUse::DeviceMapped)?,
            logits: Buffer::new_in(al, c.n_vocab as u64 * 4, MemoryUse::Staging)?,
            moe,
        };
        if options.ram_budget.is_some() && options.moe_miss == MoeMiss::Fetch {
            return Err(GpuError::Unsupported(
                "a RAM budget applies to experts computed on the CPU (misses go to the CPU), \
                 not to fetched ones"
                    .into(),
            ));
        }
        // The CPU's experts, from the memory map or, under a RAM budget, a cache of them (with
        // misses read over PCIe the CPU computes none: its threads stage promotions).
        let mut ram = match (placement.is_partial(), options.ram_budget) {
            (false, _) => None,
            (true, None) => Some(None),
            (true, Some(_)) if host_experts => Some(None),
            (true, Some(budget)) => Some(Some(open_expert_cache(
                model,
                budget,
                options.expert_policy,
            )?)),
        };
        let experts = c.moe.map(|cfg| {
            let ram = ram.take();
            let threads = match options.threads {
                0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
                n => n,
            };
            Experts {
                slots: model
                    .layers
                    .iter()
                    .enumerate()
                    .map(|(il, l)| {
                        matches!(l.ffn, Ffn::Moe(_)).then(|| {
                            LayerSlots::new(
                                il,
                                cfg.n_expert,
                                placement.slots_of(il),
                                options.expert_policy,
                            )
                        })
                    })
                    .collect(),
                stats: vec![LayerExpertStats::default(); c.n_layer],
                miss: options.moe_miss,
                cpu: ram.map(|ram| CpuExperts::new(model.clone(), threads, ram)),
                uploader: None,
                promoter: None,
                host_bytes,
                embedding_bytes,
                map_stale: host_experts,
            }
        });
        // Split misses are shared out by the host, layer by layer.
        let split = placement.is_partial() && options.moe_miss == MoeMiss::Split;
        let routes_on_device = match &c.moe {
            Some(cfg) => {
                !options.host_routing
                    && !split
                    && (!placement.is_partial() || host_experts)
                    && layers.iter().all(|l| match &l.ffn {
                        GpuFfn::Moe(m) => m.routes_on_device(cfg, max_range),
                        GpuFfn::Dense { .. } => true,
                    })
            }
            None => false,
        };
        if host_experts && !split && !routes_on_device {
            return Err(GpuError::Unsupported(format!(
                "misses read over PCIe need the routing on the device (at most {} experts, \
                 each layer's stacks within one binding, no --host-routing): use --moe-miss cpu",
                crate::gpu::ops::MOE_ROUTE_MAX_EXPERTS
            )));
        }
        let chained = options.chain
            && c.moe.is_some()
            && placement.is_partial()
            && matches!(options.moe_miss, MoeMiss::Cpu | MoeMiss::Split)
            && (allocator.device().chains() || options.handoff == Handoff::Events)
            && layers.iter().all(|l| match &l.ffn {
                GpuFfn::Moe(m) => m.stacks_fit(max_range),
                GpuFfn::Dense { .. } => true,
            });
        if split && !chained {
            return Err(GpuError::Unsupported(
                "misses split between the CPU and the bus need a chained step (each layer's \
                 stacks within one binding, chains on): use --moe-miss cpu or pcie"
                    .into(),
            ));
        }
        let mut experts = experts;
        match experts.as_mut() {
            Some(e) if placement.is_partial() && options.moe_miss == MoeMiss::Fetch => {
                e.uploader = Some(up);
            }
            Some(e) if placement.is_partial() && options.promote_experts => {
                // A chained step copies promotions through staging at its start; the device's
                // copies from system RAM go ahead of a replayed step only.
                let from_host = host_experts && !chained;
                e.promoter = Some(promote::Promoter::new(model, al, up, from_host)?);
            }
            _ => drop(up),
        }
        let replays = options.replay && !chained && (routes_on_device || c.moe.is_none());
        let expert_stream = match (&c.moe, placement.stream_slot) {
            (Some(_), true) => Some(stream_experts::ExpertStream::new(
                model,
                al,
                placement.prompt_expert_slots,
            )?),
            _ => None,
        };
        // Last, so that it takes what the weights leave of the budget (a few hundred KiB).
        if options.int_dot && options.q8_inputs && kernels.uses_int_dot() {
            kernels.set_q8_scratch(q8_scratch(allocator, &c)?);
        }
        Ok(GpuModel {
            model: model.clone(),
            kernels,
            allocator: allocator.clone(),
            config: c,
            input_rows,
            output,
            front: None,
            front_time: std::time::Duration::ZERO,
            bus_rows: None,
            stream: None,
            streamed_chunks: 0,
            expert_stream,
            output_norm,
            layers,
            rope,
            act,
            capacity,
            positions: vec![0; sequences],
            seq: 0,
            batched_steps: 0,
            replayed_batches: 0,
            replayed_steps: 0,
            chained_batches: 0,
            last_stats: RecordStats::default(),
            last_routing: Vec::new(),
            placement: placement.clone(),
            experts,
            routes_on_device,
            chained,
            handoff: options.handoff,
            split: split.then(|| split::SplitShare::new(options.split_cpu_share)),
            last_host_time: None,
            profiler: None,
            replays,
            replay: None,
            profiled_replay: None,
            last_profile: None,
            chain_replays: options.replay && chained,
            chain_replay: None,
            batch: None,
            batch_refused: None,
            step_batching: options.step_batching,
            prompt_steps: options.prompt_steps,
            moe_by_entry: options.moe_by_entry,
            step_costs: Default::default(),
            prompt_misses: Default::default(),
            cpu_prompt_chunks: 0,
            chained_prompt_chunks: 0,
            rope_in_attention: options.rope_in_attention,
            flash_attention: options.flash_attention,
        })
    }
}

/// The scratch where products' inputs are quantized once ([`Kernels::set_q8_scratch`]): room
/// for the widest input of any product, times as many vectors as a batched step's several
/// columns, each expert's rows of them in a MoE layer. `None`, with a warning, where the VRAM
/// budget leaves no room: the products then quantize in place.
fn q8_scratch(allocator: &Arc<Allocator>, c: &crate::model::Config) -> Result<Option<Arc<Buffer>>> {
    let (experts_ff, k) = c
        .moe
        .as_ref()
        .map_or((0, 1), |m| (m.n_ff_expert, m.n_expert_used));
    // Wider inputs (a shared expert's, if any is) quantize in the product.
    let widest = [c.n_embd, c.n_ff, experts_ff * k, c.n_head * c.head_dim]
        .into_iter()
        .max()
        .unwrap_or(0);
    let vectors = crate::gpu::ops_batch::MAX_MATVEC_COLS as usize * k.max(1);
    let bytes = crate::gpu::ops_q8::q8_bytes(widest, vectors);
    match Buffer::new_in(allocator, bytes, MemoryUse::DeviceLocal) {
        Ok(b) => Ok(Some(Arc::new(b))),
        Err(e) if e.is_out_of_memory() => {
            tracing::warn!("no room for {bytes} bytes of quantized inputs: {e}");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}
