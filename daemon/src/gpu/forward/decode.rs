//! A decode step of the selected sequence: replayed where it is one submission, else
//! recorded in parts around the MoE layers whose routing is decided on the host, with the
//! experts placed (resident, fetched, or computed on the CPU) layer by layer.

use super::*;
use crate::engine::row_help::RowHelper;

impl GpuModel {
    /// Evaluates `token` at the next position; the logits of the token after it.
    pub fn eval(&mut self, token: u32) -> Result<Vec<f32>> {
        self.eval_from(token, None)
    }

    /// [`GpuModel::eval`]; with the first layers on the CPU, `hidden` is their output for
    /// `token` when the caller ran them already (a prompt's tokens at once), else they run now.
    pub(super) fn eval_from(&mut self, token: u32, hidden: Option<&[f32]>) -> Result<Vec<f32>> {
        self.check_tokens(&[token])?;
        let started = Instant::now();
        self.count_for_faults(1);
        let row = match (self.front.as_mut(), hidden) {
            (Some(_), Some(x)) => {
                self.input_rows.buffer.write_f32(x);
                0
            }
            (Some(front), None) => {
                let t = Instant::now();
                let help = self
                    .bus_rows
                    .as_mut()
                    .map(|b| b as &mut (dyn RowHelper + 'static));
                let x = front.run(&[token], self.positions[self.seq], help)?;
                self.front_time = t.elapsed();
                if let Some(b) = self.bus_rows.as_mut() {
                    // The CPU computed whatever rows the GPU failed to: `x` is right, and the
                    // device's failure is this step's.
                    if let Some(e) = b.take_error() {
                        return Err(e);
                    }
                }
                self.input_rows.buffer.write_f32(&x);
                0
            }
            (None, _) => token,
        };
        let pos = self.pos() as u32;
        let grid = attention_grid(self.attention_args(), pos);
        let words = [row, pos, self.seq_row(self.seq)].into_iter().chain(grid);
        let step: Vec<u8> = words.flat_map(u32::to_le_bytes).collect();
        self.act.step.write(&step);
        let profiling = self.profiler.is_some();
        if profiling {
            self.profile_before();
        }
        let replaying = self.replays;
        if replaying {
            // Copies from system RAM go ahead of the step, in its submission.
            self.flush_staged_promotions()?;
        } else if !self.chained {
            self.flush_promotions()?;
        }
        self.write_slot_map();
        let (logits, host) = if replaying {
            (self.eval_replay()?, None)
        } else if self.chained {
            let logits = self.eval_chained()?;
            (logits, self.last_host_time)
        } else {
            let logits = self.eval_parts()?;
            (logits, self.last_host_time)
        };
        let host = match self.front {
            Some(_) => Some(HostTime {
                cpu_layers_ns: self.front_time.as_nanos() as u64,
                ..host.unwrap_or_default()
            }),
            None => host,
        };
        if profiling {
            self.profile_after(host)?;
        }
        self.positions[self.seq] += 1;
        self.promote_experts(started.elapsed())?;
        Ok(logits)
    }

    /// [`GpuModel::eval`] of a step that is one submission, from its recording (made now the
    /// first time). A profiled step replays its own recording, which writes the timestamps.
    pub(super) fn eval_replay(&mut self) -> Result<Vec<f32>> {
        let profiling = self.profiler.is_some();
        let recorded = match profiling {
            true => self.profiled_replay.is_some(),
            false => self.replay.is_some(),
        };
        if !recorded {
            let mut paused_at = None;
            let replay = self
                .kernels
                .record_replay(|rec| self.record_part(rec, &Resume::Start, &mut paused_at))?;
            debug_assert!(paused_at.is_none(), "a replayed step is one submission");
            match profiling {
                true => self.profiled_replay = Some(replay),
                false => self.replay = Some(replay),
            }
        }
        let copies = self.host_copies_recording()?;
        let replay = match profiling {
            true => self.profiled_replay.as_ref(),
            false => self.replay.as_ref(),
        };
        let replay = replay.expect("recorded above");
        replay.run_after(copies.as_ref())?;
        self.replayed_steps += 1;
        self.last_stats = replay.stats();
        self.last_routing = if self.routes_on_device {
            self.device_routings()
        } else {
            Vec::new()
        };
        self.last_host_time = None;
        Ok(self.act.logits.read_f32(self.config.n_vocab))
    }

    /// [`GpuModel::eval`] as one submission per part: from the start or a MoE layer's experts
    /// to the next MoE router on the host, or to the logits.
    pub(super) fn eval_parts(&mut self) -> Result<Vec<f32>> {
        let mut stats = RecordStats::default();
        let mut routings: Vec<LayerRouting> = Vec::new();
        let mut resume = Resume::Start;
        let mut time = HostTime::default();
        let (start, mut cpu_ran) = (Instant::now(), false);
        loop {
            let mut paused_at = None;
            let cpu_job = match &resume {
                Resume::Experts { layer, cpu, xn, .. } if !cpu.is_empty() => {
                    Some((*layer, cpu.as_slice(), xn.as_slice()))
                }
                _ => None,
            };
            let cpu = self.experts.as_ref().and_then(|e| e.cpu.as_ref());
            cpu_ran |= cpu_job.is_some();
            // The CPU's experts run between this part's submission and its completion.
            let (part_start, mut cpu_ns) = (Instant::now(), 0);
            let (part, cpu_sum) = self.kernels.record_overlapped(
                |rec| self.record_part(rec, &resume, &mut paused_at),
                || {
                    cpu_job.map(|(layer, experts, xn)| {
                        let cpu = cpu.expect("a partial placement has CPU experts");
                        let t = Instant::now();
                        let sum = cpu.weighted_sum(layer, xn, experts);
                        cpu_ns = t.elapsed().as_nanos() as u64;
                        sum
                    })
                },
            )?;
            time.cpu_experts_ns += cpu_ns;
            time.wait_ns += (part_start.elapsed().as_nanos() as u64).saturating_sub(cpu_ns);
            let cpu_sum = cpu_sum.transpose()?;
            stats.dispatches += part.dispatches;
            stats.barriers += part.barriers;
            stats.submits += part.submits;
            if let Some(sum) = cpu_sum {
                let Resume::Experts { layer, .. } = resume else {
                    unreachable!("CPU experts run after a routing")
                };
                let scratch = self.act.moe.as_mut().expect("MoE scratch");
                scratch.cpu_sum.write_f32(&sum);
                resume = Resume::CpuSum { layer };
                continue;
            }
            let Some(il) = paused_at else { break };
            let cfg = self
                .config
                .moe
                .as_ref()
                .expect("MoE layers have a MoE config");
            let routing = self.moe_layer(il).route(il, cfg, self.moe_scratch());
            resume = self.place_experts(&routing)?;
            routings.push(routing);
        }
        if self.routes_on_device {
            routings = self.device_routings();
        }
        self.last_stats = stats;
        self.last_routing = routings;
        time.step_ns = start.elapsed().as_nanos() as u64;
        self.last_host_time = cpu_ran.then_some(time);
        Ok(self.act.logits.read_f32(self.config.n_vocab))
    }

    /// Records one command buffer of a step: from `resume` to the next MoE router (setting
    /// `paused_at` to its layer) or to the logits.
    pub(super) fn record_part(
        &self,
        rec: &mut Recorder<'_>,
        resume: &Resume,
        paused_at: &mut Option<usize>,
    ) -> Result<()> {
        let c = &self.config;
        let (a, e) = (&self.act, c.n_embd as u32);
        let from = match resume {
            Resume::Start => {
                self.record_embedding(rec)?;
                0
            }
            Resume::Experts {
                layer,
                gpu,
                cpu,
                shared_gate,
                ..
            } => {
                rec.after_earlier_submissions();
                let moe = self.moe_layer(*layer);
                moe.record_experts(rec, gpu, *shared_gate, (&a.xn, &a.x), self.moe_scratch())?;
                if !cpu.is_empty() {
                    return Ok(());
                }
                layer + 1
            }
            Resume::CpuSum { layer } => {
                rec.after_earlier_submissions();
                rec.scale_add(&a.x, &self.moe_scratch().cpu_sum, 1.0, e)?;
                layer + 1
            }
        };
        self.record_from(rec, from, paused_at)
    }

    /// Records layers `from..` up to the next MoE router on the host (setting `paused_at` to
    /// its layer), or to the logits.
    pub(super) fn record_from(
        &self,
        rec: &mut Recorder<'_>,
        from: usize,
        paused_at: &mut Option<usize>,
    ) -> Result<()> {
        let c = &self.config;
        let (a, e, eps) = (&self.act, c.n_embd as u32, c.rms_eps);
        for (il, l) in self.layers.iter().enumerate().skip(from) {
            self.mark(rec, profile::attention(il));
            self.record_attention(rec, l)?;
            self.mark(rec, profile::ffn(il));
            let norm_fused = match &l.ffn {
                GpuFfn::Dense { gate_up, .. } => matches!(gate_up, GateUp::Stacked(_)),
                GpuFfn::Moe(_) => self.routes_on_device,
            };
            if !norm_fused {
                rec.rms_norm(&a.x, &l.ffn_norm, &a.xn, e, 1, eps)?;
            }
            match &l.ffn {
                GpuFfn::Dense {
                    gate_up: GateUp::Stacked(gate_up),
                    down,
                } => {
                    // RMSNorm, gate, up and SwiGLU in one dispatch.
                    let fused = Fused {
                        norm: Some((&l.ffn_norm, eps)),
                        glu: true,
                        ..Fused::default()
                    };
                    rec.matvec_fused(gate_up, &a.x, &a.gate, fused)?;
                    rec.matvec_add(down, &a.gate, &a.x)?;
                }
                GpuFfn::Dense {
                    gate_up: GateUp::Apart { gate, up },
                    down,
                } => {
                    rec.matvec(gate, &a.xn, &a.gate)?;
                    rec.matvec(up, &a.xn, &a.up)?;
                    rec.swiglu(&a.gate, &a.up, gate.n_out as u32)?;
                    rec.matvec_add(down, &a.gate, &a.x)?;
                }
                GpuFfn::Moe(moe) if self.routes_on_device => {
                    let cfg = c.moe.as_ref().expect("MoE layers have a MoE config");
                    let io = (&a.x, (&l.ffn_norm, eps), &a.xn);
                    moe.record_routed(rec, (il, cfg), io, self.moe_scratch())?;
                }
                GpuFfn::Moe(moe) => {
                    let s = self.moe_scratch();
                    if self.placement.is_partial() {
                        // The same norm again, into memory the CPU experts read.
                        rec.rms_norm(&a.x, &l.ffn_norm, &s.xn_host, e, 1, eps)?;
                    }
                    moe.record_router(rec, &a.xn, s)?;
                    *paused_at = Some(il);
                    return Ok(());
                }
            }
        }
        let group = profile::head(self.layers.len());
        self.mark(rec, group);
        let head = self.output.as_ref().unwrap_or(&self.input_rows);
        let normed = Fused {
            norm: Some((&self.output_norm, eps)),
            ..Fused::default()
        };
        rec.matvec_fused(head, &a.x, &a.logits, normed)?;
        self.mark_end(rec);
        Ok(())
    }

    /// The token's embedding row into `x`: the first thing a step records (after resetting
    /// the profile's queries when profiling).
    pub(super) fn record_embedding(&self, rec: &mut Recorder<'_>) -> Result<()> {
        self.mark_start(rec);
        rec.get_rows(&self.input_rows, self.step_word(0), &self.act.x)?;
        Ok(())
    }

    /// The routings the device logged in the last step, counted as hits of resident experts.
    pub(super) fn device_routings(&mut self) -> Vec<LayerRouting> {
        let cfg = self.config.moe.expect("MoE layers have a MoE config");
        let log = self.moe_scratch().read_log(&cfg, self.config.n_layer);
        let per_layer = crate::gpu::ops::route_log_floats(cfg.n_expert, cfg.n_expert_used);
        let routings: Vec<LayerRouting> = self
            .layers
            .iter()
            .enumerate()
            .filter_map(|(il, l)| match &l.ffn {
                GpuFfn::Moe(m) => Some(m.logged_routing(il, &cfg, &log[il * per_layer..])),
                GpuFfn::Dense { .. } => None,
            })
            .collect();
        let ex = self
            .experts
            .as_mut()
            .expect("MoE models track their experts");
        for r in &routings {
            let slots = ex.slots[r.layer].as_mut().expect("a MoE layer has slots");
            let token = slots.place(&r.experts, ex.miss, &mut ex.stats[r.layer]);
            debug_assert!(
                token.cpu.is_empty() && token.fetch.is_empty(),
                "all resident"
            );
        }
        routings
    }

    /// Writes the slots of every MoE layer to the device's slot map where the GPU reads misses
    /// from system RAM and they changed (at load, and after promotions): before a step, once
    /// the copies into the slots are done.
    pub(super) fn write_slot_map(&mut self) {
        let (Some(ex), Some(scratch)) = (self.experts.as_mut(), self.act.moe.as_mut()) else {
            return;
        };
        if !ex.map_stale || ex.host_bytes == 0 {
            return;
        }
        for (il, slots) in ex.slots.iter().enumerate() {
            if let Some(slots) = slots {
                scratch.write_slot_map(il, slots.slot_table());
            }
        }
        ex.map_stale = false;
    }

    /// Where `routing`'s experts run: slots, fetches (copied here, before the GPU part is
    /// recorded) and the CPU; counted per layer.
    pub(super) fn place_experts(&mut self, routing: &LayerRouting) -> Result<Resume> {
        let il = routing.layer;
        let GpuModel {
            experts,
            layers,
            model,
            act,
            config,
            ..
        } = self;
        let ex = experts.as_mut().expect("MoE models track their experts");
        let stats = &mut ex.stats[il];
        let slots = ex.slots[il].as_mut().expect("a MoE layer has slots");
        let token = slots.place(&routing.experts, ex.miss, stats);
        if !token.fetch.is_empty() {
            let (GpuFfn::Moe(moe), Ffn::Moe(weights)) = (&layers[il].ffn, &model.layers[il].ffn)
            else {
                unreachable!("layer {il} is MoE");
            };
            let up = ex.uploader.as_mut().expect("fetching keeps an uploader");
            for &(slot, expert) in &token.fetch {
                stats.bytes_uploaded += moe.fill_slot(model, weights, up, slot, expert)?;
            }
            up.flush()?;
        }
        let xn = if token.cpu.is_empty() {
            Vec::new()
        } else {
            let s = act.moe.as_ref().expect("MoE scratch");
            s.xn_host.read_f32(config.n_embd)
        };
        Ok(Resume::Experts {
            layer: il,
            gpu: token.gpu,
            cpu: token.cpu,
            shared_gate: routing.shared_gate,
            xn,
        })
    }

    /// Attention of layer `l` at the current position, its output added to `x`.
    pub(super) fn record_attention(&self, rec: &mut Recorder<'_>, l: &GpuLayer) -> Result<()> {
        let (c, a) = (&self.config, &self.act);
        let pos = self.step_word(1);
        let (qw, kvw) = (c.q_width() as u32, c.kv_width() as u32);
        let eps = c.rms_eps;
        let rope = |n_heads| self.rope_args(n_heads);
        let attn_args = self.attention_args();
        // The attention norm is done by each of the three products on its own.
        let normed = Fused {
            norm: Some((&l.attn_norm, eps)),
            ..Fused::default()
        };
        rec.matvec_fused(&l.wq, &a.x, &a.q, normed)?;
        rec.matvec_fused(&l.wk, &a.x, &a.k, normed)?;
        rec.matvec_fused(&l.wv, &a.x, &a.v, normed)?;
        for (x, b, n) in [(&a.q, &l.bq, qw), (&a.k, &l.bk, kvw), (&a.v, &l.bv, kvw)] {
            if let Some(b) = b {
                rec.add(x, b, n)?;
            }
        }
        let caches = (&l.k_cache, &l.v_cache);
        let scratch = (&a.scores, &a.attn_done);
        // The fused kernel takes a QK-norm of both Q and K or of neither (as every supported
        // architecture has it); anything else takes the separate RoPE dispatch.
        if self.rope_in_attention && l.q_norm.is_some() == l.k_norm.is_some() {
            let new = Unroped {
                q: &a.q,
                k: &a.k,
                v: &a.v,
                qk_norm: l.q_norm.as_ref().zip(l.k_norm.as_ref()),
            };
            let rope_q = (&self.rope, rope(c.n_head));
            let grid = Some(self.step_word(ATTENTION_GRID_WORD));
            rec.attention_rope(
                new,
                rope_q,
                caches,
                scratch,
                &a.attn,
                attn_args,
                (pos, grid),
            )?;
        } else {
            rec.rope(&a.q, l.q_norm.as_ref(), &self.rope, rope(c.n_head), pos)?;
            // K's RoPE goes straight into the cache, with V beside it.
            let (k_norm, k_rope) = (l.k_norm.as_ref(), rope(c.n_head_kv));
            rec.rope_store((&a.k, &a.v), k_norm, &self.rope, k_rope, pos, caches)?;
            rec.attention(&a.q, caches, scratch, &a.attn, attn_args, pos)?;
        }
        rec.matvec_add(&l.wo, &a.attn, &a.x)
    }
}
