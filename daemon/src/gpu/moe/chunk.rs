//! A MoE layer over a prompt chunk's tokens: the host's routing of a chunk by expert
//! ([`ChunkRouting`]), and the recordings of a chunk's experts: one expert at a time, in groups
//! of experts ([`RunGroup`]), or laid out on the device ([`Recorder::moe_sort`]), and its shared
//! expert.

use super::{GpuMoe, Stacks};
use crate::engine::routing::{route, shared_expert_gate, RoutedExpert};
use crate::gpu::buffer::Buffer;
use crate::gpu::error::Result;
use crate::gpu::moe_groups::RunGroup;
use crate::gpu::ops::{ChunkLayout, GpuMatrix, IdFused, StepWord};
use crate::gpu::ops_moe::IdTokens;
use crate::gpu::record::Recorder;
use crate::model::MoeConfig;

/// An expert's run in a prompt chunk's routing: the expert (or the slot holding it), its
/// first entry and its number of entries.
pub(in crate::gpu) type ExpertRun = (usize, usize, usize);

/// One MoE layer's routing for a prompt's chunk, grouped by expert: for each expert that some
/// tokens chose, the run of entries (token, weight) that are its, as the route buffer lays them
/// out (the tokens from word 0, the weights' bits from word [`ChunkRouting::weights_at`]).
pub(in crate::gpu) struct ChunkRouting {
    /// The route buffer's words.
    pub words: Vec<u32>,
    /// (expert, first entry, entries).
    pub runs: Vec<ExpertRun>,
    /// The first of the entries that give each token, in order, its shared expert's gate
    /// (Qwen2-MoE), after the routed experts' entries.
    pub shared_from: Option<usize>,
}

impl ChunkRouting {
    /// Routes each token's router logits (`n_expert` a token) with the CPU engine's routing;
    /// `shared`: each token's shared-expert gate logit, where the layer has a shared expert.
    pub(in crate::gpu) fn new(
        cfg: &MoeConfig,
        logits: &[f32],
        shared: Option<&[f32]>,
    ) -> ChunkRouting {
        let tokens: Vec<Vec<RoutedExpert>> = logits
            .chunks_exact(cfg.n_expert)
            .map(|l| route(cfg, l))
            .collect();
        let mut by_expert: Vec<Vec<(u32, f32)>> = vec![Vec::new(); cfg.n_expert];
        for (t, experts) in tokens.iter().enumerate() {
            for e in experts {
                by_expert[e.expert].push((t as u32, e.weight));
            }
        }
        let weights_at = Self::weights_at_for(tokens.len(), cfg.n_expert_used, shared.is_some());
        let entries = weights_at;
        let mut words = vec![0u32; weights_at + entries];
        let mut runs = Vec::new();
        let mut at = 0;
        for (expert, list) in by_expert.iter().enumerate() {
            if list.is_empty() {
                continue;
            }
            runs.push((expert, at, list.len()));
            for &(t, w) in list {
                words[at] = t;
                words[weights_at + at] = w.to_bits();
                at += 1;
            }
        }
        let shared_from = shared.map(|gates| {
            let from = at;
            for (t, &logit) in gates.iter().enumerate() {
                words[at] = t as u32;
                words[weights_at + at] = shared_expert_gate(logit).to_bits();
                at += 1;
            }
            from
        });
        debug_assert_eq!(at, entries);
        ChunkRouting {
            words,
            runs,
            shared_from,
        }
    }

    /// Word of entry 0's weight for a chunk of `n` tokens routed to `k` experts each, and to
    /// the shared expert too where there is one.
    pub(in crate::gpu) fn weights_at_for(n: usize, k: usize, shared: bool) -> usize {
        n * (k + usize::from(shared))
    }

    /// Word of entry 0's weight in [`ChunkRouting::words`].
    pub(in crate::gpu) fn weights_at(&self) -> usize {
        self.words.len() / 2
    }
}

impl GpuMoe {
    /// Part 2 of a MoE layer for a prompt's chunk whose routing the host decided and wrote to
    /// `route` ([`ChunkRouting::words`], the entries' weights from word `weights_at`): for each
    /// `(slot, first entry, entries)` of `runs`, those entries' tokens' rows of `xn` gathered
    /// into `xg`, slot `slot`'s gate, up, SwiGLU and down over them in `(eg, eu, ed)`, and its
    /// outputs added to those tokens' rows of `x` with their weights.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::gpu) fn record_chunk_experts(
        &self,
        rec: &mut Recorder<'_>,
        runs: &[ExpertRun],
        (route, weights_at): (&Buffer, usize),
        xn: &GpuMatrix,
        (xg, eg, eu, ed): (&Buffer, &Buffer, &Buffer, &Buffer),
        x: &Buffer,
    ) -> Result<()> {
        let (ff, n_embd) = (self.n_ff, self.n_embd);
        let (up, up_first) = self.up_rows();
        for &(slot, first, count) in runs {
            assert!(slot < self.n_slots, "slot {slot} of {}", self.n_slots);
            let ids = StepWord {
                buffer: route,
                index: first as u32,
            };
            rec.get_rows_n(xn, ids, count as u32, xg)?;
            rec.matvec_batch_rows(&self.gate, slot * ff, ff, xg, eg, count)?;
            rec.matvec_batch_rows(up, up_first + slot * ff, ff, xg, eu, count)?;
            rec.swiglu(eg, eu, (count * ff) as u32)?;
            rec.matvec_batch_rows(&self.down, slot * n_embd, n_embd, eg, ed, count)?;
            let run = (first as u32, count as u32, weights_at as u32);
            rec.scatter_add(x, ed, route, run, n_embd as u32)?;
        }
        Ok(())
    }

    /// The k experts of each of `n` tokens by their entries, as a decode step runs one
    /// token's ([`GpuMoe::record_routed`]): token `t`'s block of `route` starts at word
    /// `t * block` and holds its k slots (every expert resident: the experts themselves) and k
    /// weights, then, with experts in system RAM, the k experts without a slot
    /// (`moe_route.comp` with CHUNK); its input is row `t` of `xn`. The gate, up and SwiGLU of
    /// all `n * k` entries in one dispatch per stack (two and a SwiGLU where the up stack is
    /// apart) into `eg` (and `eu`; `hg` and `hu` for the stacks in system RAM), then each
    /// token's down products summed with its weights into its row of `x`. Unlike the chunk's
    /// paths nothing is laid out by expert and no dispatch covers experts no token chose: for
    /// the few tokens of a decode step of several sequences. `host_list` says the blocks hold
    /// the experts without a slot (routed on the device); a block the host wrote (the CPU ran
    /// those) is `2k` words and lists none.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::gpu) fn record_tokens(
        &self,
        rec: &mut Recorder<'_>,
        (route, block, host_list): (&Buffer, usize, bool),
        (n, k): (usize, usize),
        xn: &Buffer,
        (eg, eu, hg, hu): (&Buffer, &Buffer, &Buffer, &Buffer),
        x: &Buffer,
    ) -> Result<()> {
        let n_embd = self.n_embd as u32;
        let k32 = k as u32;
        let tokens = |x_stride, y_stride| IdTokens {
            n: n as u32,
            ids_stride: block as u32,
            x_stride,
            y_stride,
        };
        let each_token = IdFused {
            tokens: Some(tokens(n_embd, 0)),
            ..IdFused::default()
        };
        let summed = IdFused {
            sum_weights_at: Some(k32),
            tokens: Some(tokens(0, n_embd)),
            ..IdFused::default()
        };
        let outs = [(eg, eu), (hg, hu)];
        let ids = (route, host_list.then_some(2 * k32));
        self.record_stacks(rec, ids, k32, xn, outs, (each_token, summed), x)
    }

    /// Whether [`GpuMoe::record_chunk_groups`] can run this layer: each stack in one binding.
    pub(in crate::gpu) fn groups_fit(&self, rec: &Recorder<'_>) -> bool {
        let (up, up_first) = self.up_rows();
        rec.in_one_binding(&self.gate, 0)
            && rec.in_one_binding(up, up_first)
            && rec.in_one_binding(&self.down, 0)
    }

    /// [`GpuMoe::record_chunk_experts`] by [`RunGroup`]s: per group, its entries' rows of `xn`
    /// gathered into `xg`, the gate, up and down products of all its experts in one dispatch
    /// each, and their outputs added to their tokens' rows of `x` in one more.
    pub(in crate::gpu) fn record_chunk_groups(
        &self,
        rec: &mut Recorder<'_>,
        groups: &[RunGroup],
        (route, weights_at): (&Buffer, usize),
        xn: &GpuMatrix,
        bufs: (&Buffer, &Buffer, &Buffer, &Buffer),
        x: &Buffer,
    ) -> Result<()> {
        for g in groups {
            let tables = [(self.slot_stacks(), g.runs_at)];
            self.record_group(rec, g, &tables, (route, weights_at), xn, bufs, x)?;
        }
        Ok(())
    }

    /// A chunk's experts routed on the device and laid out by [`Recorder::moe_sort`] at
    /// `layout` in `route` (`n` tokens, `k` entries each): one group of every entry, its
    /// products over the VRAM slots' runs and, where some experts are in system RAM only,
    /// over theirs, and each token's experts added to `x` in rank order.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::gpu) fn record_chunk_sorted(
        &self,
        rec: &mut Recorder<'_>,
        (route, layout): (&Buffer, ChunkLayout),
        (n, k): (usize, usize),
        xn: &GpuMatrix,
        bufs: (&Buffer, &Buffer, &Buffer, &Buffer),
        x: &Buffer,
    ) -> Result<()> {
        let mut tables = vec![(self.slot_stacks(), layout.runs_at as usize)];
        if let Some(host) = self.host_stacks().filter(|_| layout.host_runs_at != 0) {
            tables.push((host, layout.host_runs_at as usize));
        }
        let group = RunGroup {
            first: 0,
            span: n * k,
            runs_at: layout.runs_at as usize,
            // A run per expert of the layer: every one has a slot or a copy in system RAM.
            n_runs: self.host_stacks().map_or(self.n_slots, |h| h.n),
            // An expert's rows are known on the device only: a token tile per token tile of
            // the chunk, those past an expert's rows idle.
            max_count: n,
            list_at: layout.list_at as usize,
            n_tokens: n,
        };
        let route = (route, layout.weights_at as usize);
        self.record_group(rec, &group, &tables, route, xn, bufs, x)
    }

    /// One group of a chunk's entries (`g`): its rows of `xn` gathered into `xg`, for each of
    /// `tables` (expert stacks and the word of their runs, `g.n_runs` of them) the gate and up
    /// products into `(eg, eu)`, SwiGLU over every row, the down products into `ed`, and the
    /// outputs added to their tokens' rows of `x` with the weights from word `weights_at`.
    #[allow(clippy::too_many_arguments)]
    fn record_group(
        &self,
        rec: &mut Recorder<'_>,
        g: &RunGroup,
        tables: &[(Stacks<'_>, usize)],
        (route, weights_at): (&Buffer, usize),
        xn: &GpuMatrix,
        (xg, eg, eu, ed): (&Buffer, &Buffer, &Buffer, &Buffer),
        x: &Buffer,
    ) -> Result<()> {
        let (ff, n_embd) = (self.n_ff, self.n_embd);
        let ids = StepWord {
            buffer: route,
            index: g.first as u32,
        };
        rec.get_rows_n(xn, ids, g.span as u32, xg)?;
        let sizes = (g.span, g.max_count);
        for (st, runs_at) in tables {
            let runs = (route, *runs_at as u32, g.n_runs as u32);
            let (up, up_first) = st.up_rows(ff);
            rec.matvec_batch_grouped(st.gate, (0, ff), xg, eg, runs, sizes)?;
            rec.matvec_batch_grouped(up, (up_first, ff), xg, eu, runs, sizes)?;
        }
        rec.swiglu(eg, eu, (g.span * ff) as u32)?;
        for (st, runs_at) in tables {
            let runs = (route, *runs_at as u32, g.n_runs as u32);
            rec.matvec_batch_grouped(st.down, (0, n_embd), eg, ed, runs, sizes)?;
        }
        let list = (
            g.first as u32,
            weights_at as u32,
            g.list_at as u32,
            g.n_tokens as u32,
        );
        rec.gather_add(x, ed, route, list, n_embd as u32)
    }

    /// A prompt chunk's shared expert (Qwen2-MoE; nothing without one) over all `n` rows of
    /// `xn`: gate, up and SwiGLU in `(sg, su)`, down in `out`, added to `x` with each token's
    /// gate from entries `from..from + n` of `route` (weights from word `weights_at`).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::gpu) fn record_chunk_shared(
        &self,
        rec: &mut Recorder<'_>,
        n: usize,
        (route, weights_at, from): (&Buffer, usize, usize),
        xn: &GpuMatrix,
        (sg, su, out): (&Buffer, &Buffer, &Buffer),
        x: &Buffer,
    ) -> Result<()> {
        let Some(sh) = &self.shared else {
            return Ok(());
        };
        rec.matvec_batch(&sh.gate, &xn.buffer, sg, n)?;
        rec.matvec_batch(&sh.up, &xn.buffer, su, n)?;
        rec.swiglu(sg, su, (n * sh.gate.n_out) as u32)?;
        rec.matvec_batch(&sh.down, sg, out, n)?;
        let run = (from as u32, n as u32, weights_at as u32);
        rec.scatter_add(x, out, route, run, self.n_embd as u32)
    }
}
