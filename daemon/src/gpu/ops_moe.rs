//! The operations of a MoE layer on the device: the expert-indexed products (the k experts of
//! a token in one dispatch, their ids read on the device), the routing (softmax and top-k, with
//! the router's product before it in the same dispatch), and the routed weighted sum.

use spillway_shaders::{
    MatVecIdParams, MoeRouteParams, MoeRouterParams, MoeSortParams, Op, ScaleAddRoutedParams,
    ShaderId, WeightType,
};

use super::buffer::Buffer;
use super::error::{GpuError, Result};
use super::ops::{grid, GpuMatrix};
use super::record::{Binding, Recorder};

/// Most experts [`Recorder::moe_route`] routes among (its workgroup size).
pub const MOE_ROUTE_MAX_EXPERTS: usize = 256;

/// Floats of one routing in [`Recorder::moe_route`]'s buffer: `k` expert ids (uint bits), `k`
/// weights, the shared expert's gate.
pub fn route_floats(k: usize) -> usize {
    2 * k + 1
}

/// Floats of [`Recorder::moe_route`]'s buffer when some experts have no VRAM slot
/// ([`MoeRouteArgs::slots`]): [`route_floats`], then `k` entries listing the experts without one.
pub fn route_split_floats(k: usize) -> usize {
    route_floats(k) + k
}

/// Floats of one routing in [`Recorder::moe_route`]'s log: the router logits, then the
/// routing.
pub fn route_log_floats(n_expert: usize, k: usize) -> usize {
    n_expert + route_floats(k)
}

/// Where [`Recorder::moe_sort`] lays out a prompt chunk's routing in the route buffer (words,
/// as `moe_sort.comp` describes), and the word of expert 0's count in the counts buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLayout {
    pub weights_at: u32,
    pub runs_at: u32,
    /// 0 where every expert is resident; else the runs in the stacks in system RAM.
    pub host_runs_at: u32,
    pub list_at: u32,
    pub counts_at: u32,
}

impl ChunkLayout {
    /// The layout of a chunk of `n_tok` tokens routed to `k` of `n_expert` experts: the entries'
    /// tokens from word 0, their weights, a run per expert (and with `host`, a second table of
    /// runs in the stacks in system RAM), the gathered sum's list.
    pub fn new(n_tok: usize, k: usize, n_expert: usize, counts_at: usize, host: bool) -> Self {
        let weights_at = n_tok * k;
        let runs_at = 2 * weights_at;
        let host_runs_at = if host { runs_at + 3 * n_expert } else { 0 };
        let list_at = runs_at + 3 * n_expert * (1 + usize::from(host));
        ChunkLayout {
            weights_at: weights_at as u32,
            runs_at: runs_at as u32,
            host_runs_at: host_runs_at as u32,
            list_at: list_at as u32,
            counts_at: counts_at as u32,
        }
    }

    /// Route buffer words the layout takes for `n_tok` tokens routed to `k` experts.
    pub fn words(&self, n_tok: usize, k: usize) -> usize {
        self.list_at as usize + 2 * n_tok + 1 + n_tok * k
    }
}

/// One MoE layer's routing on the device.
#[derive(Clone, Copy)]
pub struct MoeRouteArgs<'b> {
    pub n_expert: u32,
    /// Experts chosen per token.
    pub k: u32,
    /// Divide the k weights by their sum (Mixtral, Qwen3-MoE).
    pub norm_weights: bool,
    /// Float offset of this routing in the log.
    pub log_offset: u32,
    /// Where some experts have no VRAM slot: the slot map (a `u32` per expert, `u32::MAX` for
    /// none) and the index of this layer's expert 0 in it. The routing's ids are then slots
    /// (`u32::MAX` for an expert without one), and entries [`route_floats`]`(k)..` list the
    /// experts without one (`u32::MAX` for those with one), as [`route_split_floats`] counts.
    pub slots: Option<(&'b Buffer, u32)>,
}

impl MoeRouteArgs<'_> {
    /// `(host_at, map_offset)` of the kernel's parameters, and the binding of the slot map
    /// (`unused` stands in without one).
    fn split<'a>(&'a self, unused: &'a Buffer) -> (u32, u32, &'a Buffer) {
        match self.slots {
            Some((map, offset)) => (route_floats(self.k as usize) as u32, offset, map),
            None => (0, 0, unused),
        }
    }
}

/// What an expert-indexed product ([`Recorder::matvec_id_fused`]) does besides `W_e · x`.
#[derive(Clone, Copy, Default)]
pub struct IdFused<'b> {
    /// Take RMSNorm(x) times these weights, with this eps, as the input (one input for every
    /// expert: `x_stride` 0).
    pub norm: Option<(&'b Buffer, f32)>,
    /// Each expert's up rows lie this many rows after its gate rows in the stack (the up stack
    /// after the gate stack), and the results are `silu(gate · x) * (up · x)`.
    pub glu_up_rows: Option<usize>,
    /// Add `Σ_z w_z (W_z · x_z)` to `y`, `w_z` the float at word `sum_weights_at + z` of the
    /// ids buffer (the routing's weights): a MoE layer's down products into the residual.
    pub sum_weights_at: Option<u32>,
    /// Row of `w` where expert 0 starts (the up stack of a gate-then-up matrix read alone).
    pub first_row: usize,
    /// The entries of several tokens in one dispatch (a decode step of several sequences).
    pub tokens: Option<IdTokens>,
}

/// The entries of several tokens in one expert-indexed product ([`IdFused::tokens`]): `count`
/// is the entries of one token, and token `t`'s ids (and weights) start `ids_stride` words
/// after token `t - 1`'s. Without `sum_weights_at`, entry `j` of token `t` reads token `t`'s
/// input, `x_stride` floats after token `t - 1`'s (the product's own `x_stride` must be 0),
/// and writes `y` at `(t * count + j) * y_stride`. With it, entry `j` of token `t` reads
/// `x` at `(t * count + j) * x_stride`, and token `t`'s sum goes to `y` at `t * y_stride`
/// (the product's own `y_stride` unused).
#[derive(Clone, Copy, Debug)]
pub struct IdTokens {
    pub n: u32,
    pub ids_stride: u32,
    pub x_stride: u32,
    pub y_stride: u32,
}

impl Recorder<'_> {
    /// `count` experts' products in one dispatch: expert `ids[rank + z]` of the stack `w`
    /// (experts of `rows` rows, one after another) times `x[z * x_stride..]` into
    /// `y[z * y_stride..]`, for `z` in `0..count`. The expert ids are read on the device (see
    /// [`Recorder::moe_route`]); the whole stack is bound, so it must fit one binding.
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_id(
        &mut self,
        w: &GpuMatrix,
        rows: usize,
        ids: (&Buffer, u32),
        count: u32,
        x: (&Buffer, u32),
        y: (&Buffer, u32),
    ) -> Result<()> {
        self.matvec_id_fused(w, rows, ids, count, x, y, IdFused::default())
    }

    /// [`Recorder::matvec_id`] with the ops `fused` names done in the same dispatch (see
    /// [`IdFused`]). With `glu_up`, `rows` are gate rows, the results are SwiGLU's, `rows` an
    /// expert; with `sum_weights_at`, `y` gets one sum of `rows` results (`y_stride` unused).
    #[allow(clippy::too_many_arguments)]
    pub fn matvec_id_fused(
        &mut self,
        w: &GpuMatrix,
        rows: usize,
        (ids, rank): (&Buffer, u32),
        count: u32,
        (x, x_stride): (&Buffer, u32),
        (y, y_stride): (&Buffer, u32),
        fused: IdFused<'_>,
    ) -> Result<()> {
        let refuse = |what: String| Err(GpuError::Unsupported(what));
        let stack_rows = w.n_out.saturating_sub(fused.first_row);
        if rows == 0 || stack_rows == 0 || !stack_rows.is_multiple_of(rows) {
            return refuse(format!(
                "experts of {rows} rows from row {} of a stack of {}",
                fused.first_row, w.n_out
            ));
        }
        if !x_stride.is_multiple_of(4) {
            return refuse(format!(
                "expert inputs {x_stride} floats apart (a multiple of 4 is read as vectors)"
            ));
        }
        if w.buffer.size() > self.max_range {
            return refuse(format!(
                "an expert stack of {} bytes in one binding of at most {}",
                w.buffer.size(),
                self.max_range
            ));
        }
        if let Some(up) = fused.glu_up_rows {
            if up == 0 || fused.first_row + up + rows > w.n_out || !up.is_multiple_of(rows) {
                return refuse(format!(
                    "up rows {up} rows after the gate rows in a stack of {}",
                    w.n_out
                ));
            }
        }
        if fused.sum_weights_at.is_some() && (fused.glu_up_rows.is_some() || fused.norm.is_some()) {
            return refuse("a sum over experts with SwiGLU or RMSNorm fused".into());
        }
        if fused.norm.is_some() && x_stride != 0 {
            return refuse("RMSNorm of expert inputs that differ".into());
        }
        let summed = fused.sum_weights_at.is_some();
        if let Some(t) = fused.tokens {
            if t.n == 0 || fused.norm.is_some() || (!summed && x_stride != 0) {
                return refuse(format!(
                    "{} tokens' entries with {} and entry inputs {x_stride} floats apart",
                    t.n,
                    if fused.norm.is_some() {
                        "RMSNorm"
                    } else {
                        "no norm"
                    }
                ));
            }
        }
        // One vector for every expert, or each expert's own; with several tokens, each token's
        // (the entries of a token share it) or each of their entries' (summed).
        let (n_vec, vec_stride) = match fused.tokens {
            Some(t) if summed => ((t.n * count) as usize, x_stride as usize),
            Some(t) => (t.n as usize, t.x_stride as usize),
            None if x_stride == 0 => (1, 0),
            None => (count as usize, x_stride as usize),
        };
        let norm = fused.norm.map(|(b, _)| b);
        // The product's size for `q8_min_weights`: every chosen expert's rows (gate and up).
        let glu_rows: u32 = if fused.glu_up_rows.is_some() { 2 } else { 1 };
        let n_tok = fused.tokens.map_or(1, |t| t.n as usize);
        let all_rows = rows * (count * glu_rows) as usize * n_tok;
        let inputs = self.product_inputs(
            (Op::MatVecId, w.wtype, all_rows),
            x,
            0,
            (w.n_in, n_vec, vec_stride),
            norm,
        )?;
        // Strides in the units the variant reads (16-byte units of quantized inputs).
        let id = inputs.id;
        let (x_stride, x_tok) = match fused.tokens {
            Some(_) if summed => (inputs.x_stride, inputs.x_stride * count),
            Some(_) => (0, inputs.x_stride),
            None => (inputs.x_stride, 0),
        };
        let results = n_tok * if summed { rows } else { rows * count as usize };
        // A sum over experts walks the blocks of all of them.
        let walked = w.n_in * if summed { count as usize } else { 1 };
        let shape = self.matvec_shape_for(
            (Op::MatVecId, w.wtype),
            (results, glu_rows),
            norm.is_some() && !inputs.quantized(),
            walked,
        );
        let n_rows = shape.rows.max(glu_rows) & !(glu_rows - 1);
        let spec = [
            shape.threads,
            n_rows,
            u32::from(summed),
            u32::from(fused.norm.is_some()),
            u32::from(glu_rows == 2),
            u32::from(summed),
        ];
        let (norm_w, eps) = fused.norm.unwrap_or((x, 0.0));
        let push = MatVecIdParams {
            n_in: w.n_in as u32,
            n_rows: rows as u32,
            w_offset: (fused.first_row as u64 * w.row_bytes) as u32,
            y_offset: 0,
            rank,
            x_stride,
            y_stride,
            up_offset: fused
                .glu_up_rows
                .map_or(0, |up| (up as u64 * w.row_bytes) as u32),
            n_ids: count,
            weights_at: fused.sum_weights_at.unwrap_or(0),
            per_tok: count.max(1),
            ids_tok: fused.tokens.map_or(0, |t| t.ids_stride),
            x_tok,
            y_tok: fused.tokens.map_or(0, |t| t.y_stride),
            eps,
        };
        let bindings = [
            Binding::read(&w.buffer),
            inputs.binding(Binding::read(x)),
            Binding::write(y),
            Binding::read(ids),
            Binding::read(norm_w),
        ];
        let mut groups = grid((rows as u32).div_ceil(n_rows / glu_rows));
        groups[2] = n_tok as u32 * if summed { 1 } else { count };
        self.dispatch_spec(id, &spec, &bindings, &push, groups)
    }

    /// A MoE layer's routing from its router logits, on the device: as
    /// [`route`](crate::engine::routing::route) (softmax, the top k, ties to the lower expert,
    /// the weights renormalised when `args.norm_weights`) into `route` (see [`route_floats`]),
    /// with the sigmoid of `shared_logit[0]` after the weights when given (Qwen2-MoE's shared
    /// expert). The logits and the routing also go to `log` at `args.log_offset` (see
    /// [`route_log_floats`]), host-visible, for reading once the recording has completed.
    pub fn moe_route(
        &mut self,
        logits: &Buffer,
        shared_logit: Option<&Buffer>,
        route: &Buffer,
        log: &Buffer,
        args: MoeRouteArgs<'_>,
    ) -> Result<()> {
        check_routing(route, log, args)?;
        let (host_at, map_offset, slot_map) = args.split(logits);
        let push = MoeRouteParams {
            n_expert: args.n_expert,
            k: args.k,
            norm: u32::from(args.norm_weights),
            has_shared: u32::from(shared_logit.is_some()),
            log_offset: args.log_offset,
            host_at,
            map_offset,
        };
        // Without a shared expert the binding is unused; the logits stand in for it.
        let bindings = [
            Binding::read(logits),
            Binding::read(shared_logit.unwrap_or(logits)),
            Binding::write(route),
            Binding::write(log),
            Binding::read(slot_map),
        ];
        let id = self.variant(Op::MoeRoute, None)?;
        self.dispatch(id, &bindings, &push, [1, 1, 1])
    }

    /// The router's product and the routing in one dispatch: `logits = router · (RMSNorm(x) *
    /// norm.0)` (`router` F32, a row per expert), then as [`Recorder::moe_route`] without a
    /// shared expert, done by the workgroup that finishes last, which `done` (one counter,
    /// [`zeroed_counters`]) tells.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_router(
        &mut self,
        router: &GpuMatrix,
        (x, norm): (&Buffer, (&Buffer, f32)),
        (logits, done): (&Buffer, &Buffer),
        route: &Buffer,
        log: &Buffer,
        args: MoeRouteArgs<'_>,
    ) -> Result<()> {
        let n = args.n_expert as usize;
        let n_in = router.n_in;
        if router.wtype != WeightType::F32
            || router.n_out != n
            || !n_in.is_multiple_of(4)
            || router.buffer.size() > self.max_range
            || x.size() < n_in as u64 * 4
            || norm.0.size() < n_in as u64 * 4
            || logits.size() < n as u64 * 4
        {
            return Err(GpuError::Unsupported(format!(
                "a router of {} {:?} rows of {n_in} for {n} experts in one dispatch",
                router.n_out, router.wtype
            )));
        }
        check_routing(route, log, args)?;
        let (host_at, map_offset, slot_map) = args.split(x);
        let push = MoeRouterParams {
            n_expert: args.n_expert,
            k: args.k,
            norm: u32::from(args.norm_weights),
            has_shared: 0,
            log_offset: args.log_offset,
            host_at,
            map_offset,
            n_in: n_in as u32,
            eps: norm.1,
        };
        let bindings = [
            Binding::write(logits),
            Binding::read(x), // the shared expert's logit: none, x stands in
            Binding::write(route),
            Binding::write(log),
            Binding::read(&router.buffer),
            Binding::read(x),
            Binding::read(norm.0),
            Binding::write(done),
            Binding::read(slot_map),
        ];
        let id = self.variant(Op::MoeRouter, None)?;
        self.dispatch(id, &bindings, &push, [args.n_expert, 1, 1])
    }

    /// `a += Σ route[first + r] * b[r * b_stride..][..n]` for `r` in `0..count`, one term after
    /// another: experts' outputs added with the weights [`Recorder::moe_route`] chose.
    pub fn scale_add_routed(
        &mut self,
        a: &Buffer,
        (b, b_stride): (&Buffer, u32),
        (route, first, count): (&Buffer, u32, u32),
        n: u32,
    ) -> Result<()> {
        let push = ScaleAddRoutedParams {
            n,
            first,
            count,
            b_stride,
        };
        let bindings = [Binding::write(a), Binding::read(b), Binding::read(route)];
        self.dispatch(
            ShaderId::ScaleAddRouted,
            &bindings,
            &push,
            [n.div_ceil(256), 1, 1],
        )
    }
}

/// Refuses a routing the kernel cannot make ([`Recorder::moe_route`], [`Recorder::moe_router`]):
/// more experts than [`MOE_ROUTE_MAX_EXPERTS`], k outside `1..=n_expert`, or `route` and `log`
/// too small for it.
impl Recorder<'_> {
    /// [`Recorder::moe_route`] of each of `n_tok` tokens (`logits`: `n_expert` a token, in
    /// order): token t's `k` ids and `k` weights to floats `t * 2k..` of `sel`. No shared
    /// expert and no log. With `args.slots`, token t's block is `3k` floats from `t * 3k`: the
    /// slots of its experts (`u32::MAX` for those without one), its weights, then the experts
    /// without a slot (`u32::MAX` for those with one).
    pub fn moe_route_chunk(
        &mut self,
        logits: &Buffer,
        sel: &Buffer,
        n_tok: u32,
        args: MoeRouteArgs<'_>,
    ) -> Result<()> {
        check_top_k(args)?;
        let (n, k) = (args.n_expert as u64, args.k as u64);
        // Each token's block: k ids and k weights, then with a slot map the k experts without
        // a slot (the ids being slots then).
        let block = if args.slots.is_some() { 3 * k } else { 2 * k };
        if logits.size() < u64::from(n_tok) * n * 4 || sel.size() < u64::from(n_tok) * block * 4 {
            return Err(GpuError::Unsupported(format!(
                "routing {n_tok} tokens to {k} of {n} experts in buffers of {} and {} bytes",
                logits.size(),
                sel.size()
            )));
        }
        if n_tok == 0 {
            return Ok(());
        }
        let push = MoeRouteParams {
            n_expert: args.n_expert,
            k: args.k,
            norm: u32::from(args.norm_weights),
            host_at: if args.slots.is_some() { 2 * args.k } else { 0 },
            map_offset: args.slots.map_or(0, |(_, at)| at),
            ..MoeRouteParams::default()
        };
        // Bindings 1 and 3 (shared logit, log) are unused with CHUNK, 4 without a slot map.
        let bindings = [
            Binding::read(logits),
            Binding::read(logits),
            Binding::write(sel),
            Binding::write(sel),
            Binding::read(args.slots.map_or(logits, |(map, _)| map)),
        ];
        let id = self.variant(Op::MoeRouteChunk, None)?;
        self.dispatch(id, &bindings, &push, [n_tok, 1, 1])
    }

    /// Lays out `n_tok` tokens' routing (`sel`, from [`Recorder::moe_route_chunk`]) by expert
    /// in `route` at `layout`, for [`Recorder::matvec_batch_grouped`] (one run per expert; its
    /// slot from `slots`, the slot map and this layer's expert 0 in it, where
    /// `layout.host_runs_at` gives a second table for the experts without one, else slot =
    /// expert) and [`Recorder::gather_add`] (every token, its entries in rank order), and each
    /// expert's count to `counts`.
    pub fn moe_sort(
        &mut self,
        sel: &Buffer,
        (route, counts): (&Buffer, &Buffer),
        (n_tok, k, n_expert): (u32, u32, u32),
        (layout, slots): (ChunkLayout, Option<(&Buffer, u32)>),
    ) -> Result<()> {
        let words = layout.words(n_tok as usize, k as usize) as u64;
        let map_ok = match (layout.host_runs_at, slots) {
            (0, None) => true,
            (0, Some(_)) | (_, None) => false,
            (_, Some((map, at))) => map.size() >= (u64::from(at) + u64::from(n_expert)) * 4,
        };
        if !map_ok
            || n_expert as usize > MOE_ROUTE_MAX_EXPERTS
            || sel.size() < u64::from(n_tok * 2 * k) * 4
            || route.size() < words * 4
            || u64::from(layout.weights_at) < u64::from(n_tok * k)
            || counts.size() < u64::from(layout.counts_at + n_expert) * 4
        {
            return Err(GpuError::Unsupported(format!(
                "laying out {n_tok} tokens' {k} of {n_expert} experts at {layout:?} in buffers of \
                 {}, {} and {} bytes",
                sel.size(),
                route.size(),
                counts.size()
            )));
        }
        let push = MoeSortParams {
            n_tok,
            k,
            n_expert,
            weights_at: layout.weights_at,
            runs_at: layout.runs_at,
            list_at: layout.list_at,
            counts_at: layout.counts_at,
            host_runs_at: layout.host_runs_at,
            map_offset: slots.map_or(0, |(_, at)| at),
        };
        // Without a slot map `sel` stands in for its unused binding.
        let bindings = [
            Binding::read(sel),
            Binding::write(route),
            Binding::write(counts),
            Binding::read(slots.map_or(sel, |(map, _)| map)),
        ];
        let id = self.variant(Op::MoeSort, None)?;
        self.dispatch(id, &bindings, &push, [1, 1, 1])
    }
}

/// The top `k` of `n_expert` experts can be routed on the device.
fn check_top_k(args: MoeRouteArgs<'_>) -> Result<()> {
    let (n, k) = (args.n_expert as usize, args.k as usize);
    if n > MOE_ROUTE_MAX_EXPERTS || k == 0 || k > n {
        return Err(GpuError::Unsupported(format!(
            "routing the top {k} of {n} experts on the device (at most {MOE_ROUTE_MAX_EXPERTS})"
        )));
    }
    Ok(())
}

fn check_routing(route: &Buffer, log: &Buffer, args: MoeRouteArgs<'_>) -> Result<()> {
    check_top_k(args)?;
    let (n, k) = (args.n_expert as usize, args.k as usize);
    let log_end = (args.log_offset as usize + route_log_floats(n, k)) as u64 * 4;
    let route_end = match args.slots {
        Some((map, offset)) if map.size() < (offset as u64 + n as u64) * 4 => {
            return Err(GpuError::Unsupported(format!(
                "a slot map of {} bytes for {n} experts from entry {offset}",
                map.size()
            )));
        }
        Some(_) => route_split_floats(k),
        None => route_floats(k),
    };
    if route.size() < route_end as u64 * 4 || log.size() < log_end {
        return Err(GpuError::Unsupported(format!(
            "routing buffers of {} and {} bytes for {k} of {n} experts",
            route.size(),
            log.size()
        )));
    }
    Ok(())
}
