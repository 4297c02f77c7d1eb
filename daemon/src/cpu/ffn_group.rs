//! Several gated FFNs (a MoE layer's chosen experts, a few tokens each) in one job of the
//! thread pool: the gate and up rows of every FFN, then the down rows, with no join between.
//!
//! [`matmul_group`](super::matmul_group) run twice (gate and up, then down) joins the pool in
//! between: every thread waits for the phase's slowest task, and the gate is applied to the
//! up rows and the result converted for down on the caller's thread alone. Here the pool
//! claims tasks in order from one counter, so every gate and up task is claimed before any
//! down task. The task that ends an FFN's last gate or up rows applies the gate, converts the
//! result for down and publishes it; a down task of that FFN waits until it is published
//! (the FFNs come in order, so the first down tasks find theirs ready). A thread whose gate
//! and up work ends early goes on to down rows instead of idling at a join.
//!
//! Only for products whose rows are dotted one by one with each token (fewer than
//! [`MIN_PANEL_TOKENS`] tokens): the results are the same bits as
//! [`matmul_act`](super::matmul_act) of each product in turn with the same conversions.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::OnceLock;

use crate::model::MatRef;

use super::act::Activation;
use super::group::{dot_rows, rows_for_bytes, task_bytes_of, OutPtr};
use super::kernels::{dot_kernel, DotFn, Isa};
use super::matvec::MIN_PANEL_TOKENS;
use super::pool::ThreadPool;

/// One gated FFN of a group: `out[b] = down · glu(gate · x_b, up · x_b)` for each token `b`
/// (token-major, `down.n_out` a token).
pub struct GatedFfn<'a> {
    pub gate: MatRef<'a>,
    pub up: MatRef<'a>,
    pub down: MatRef<'a>,
    /// The tokens converted for `gate`, and for `up` (the same slice where they share a format).
    pub gate_acts: &'a [Activation<'a>],
    pub up_acts: &'a [Activation<'a>],
    pub out: &'a mut [f32],
    /// What a traced pool labels the FFN's tasks with (an expert's index); label all or none.
    pub label: Option<u32>,
}

/// Whether [`gated_ffn_group`] takes FFNs of `n_tok` tokens.
pub fn dotted(n_tok: usize) -> bool {
    n_tok < MIN_PANEL_TOKENS
}

/// Computes every FFN of `ffns` in one job of `pool`; `glu(gate, up)` applies the gate to the
/// up rows in place in `gate` (SwiGLU: `gate = silu(gate) * up`).
///
/// # Panics
/// If an FFN has [`MIN_PANEL_TOKENS`] tokens or more, or different counts of gate and up
/// tokens, or an output of the wrong size; or as the products do for activations that do not
/// fit their matrices. A panic in a task or in `glu` is raised again here, as the pool does.
pub fn gated_ffn_group(
    pool: &ThreadPool,
    ffns: &mut [GatedFfn<'_>],
    glu: &(dyn Fn(&mut [f32], &[f32]) + Sync),
) {
    let isa = Isa::detect();
    let n_threads = pool.n_threads();
    let labels: Vec<Option<u32>> = ffns.iter().map(|f| f.label).collect();
    let plans: Vec<FfnPlan<'_>> = {
        let tokens = |f: &GatedFfn<'_>| f.gate_acts.len();
        let gate_up_weights: usize = ffns
            .iter()
            .filter(|f| tokens(f) > 0)
            .map(|f| f.gate.n_out * f.gate.row_bytes() + f.up.n_out * f.up.row_bytes())
            .sum();
        let down_weights: usize = ffns
            .iter()
            .filter(|f| tokens(f) > 0)
            .map(|f| f.down.n_out * f.down.row_bytes())
            .sum();
        let gate_up_bytes = task_bytes_of(gate_up_weights, n_threads);
        let down_bytes = task_bytes_of(down_weights, n_threads);
        ffns.iter_mut()
            .map(|f| FfnPlan::new(f, isa, gate_up_bytes, down_bytes))
            .collect()
    };

    // Tasks: every FFN's gate rows then its up rows, FFN by FFN; then every FFN's down rows.
    let mut first_task = Vec::with_capacity(3 * plans.len() + 1);
    first_task.push(0usize);
    for p in &plans {
        for stage in [&p.gate, &p.up] {
            first_task.push(first_task.last().unwrap() + stage.n_tasks(p.n_tok));
        }
    }
    let n_first = *first_task.last().unwrap();
    for p in &plans {
        first_task.push(first_task.last().unwrap() + p.down.n_tasks(p.n_tok));
    }
    let n_tasks = *first_task.last().unwrap();
    let n = plans.len();
    let parts: Vec<(usize, u32)> = (0..3 * n)
        .filter_map(|s| {
            let ffn = if s < 2 * n { s / 2 } else { s - 2 * n };
            labels[ffn].map(|l| (first_task[s], l))
        })
        .collect();

    let state = State {
        left: plans
            .iter()
            .map(|p| AtomicUsize::new(p.gate.n_tasks(p.n_tok) + p.up.n_tasks(p.n_tok)))
            .collect(),
        ready: (0..n).map(|_| OnceLock::new()).collect(),
        failed: AtomicBool::new(false),
    };
    pool.run_labeled(n_tasks, &parts, &|t| {
        let s = first_task.partition_point(|&f| f <= t) - 1;
        if t < n_first {
            let (k, plan) = (s / 2, &plans[s / 2]);
            let (stage, acts) = match s % 2 {
                0 => (&plan.gate, plan.gate_acts),
                _ => (&plan.up, plan.up_acts),
            };
            let mut finish = Finish {
                plan,
                ready: &state.ready[k],
                left: &state.left[k],
                failed: &state.failed,
                glu,
                done: false,
            };
            let start = (t - first_task[s]) * stage.rows_per;
            // SAFETY: each task writes rows `start..` of its own stage alone, into the plan's
            // scratch, which outlives the job.
            unsafe { stage.rows(start, acts) };
            finish.done = true;
        } else {
            let k = s - 2 * n;
            let Some(acts) = wait_ready(&state.ready[k]) else {
                return; // The gate and up rows failed; the pool raises that panic.
            };
            let start = (t - first_task[s]) * plans[k].down.rows_per;
            // SAFETY: as above, into the FFN's `out`.
            unsafe { plans[k].down.rows(start, acts) };
        }
    });
}

/// What the tasks of one job share.
struct State<'a> {
    /// Gate and up tasks of each FFN not yet ended.
    left: Vec<AtomicUsize>,
    /// Each FFN's gated rows converted for down, once its gate and up rows are done (`None`
    /// where one of their tasks panicked).
    ready: Vec<OnceLock<Option<Vec<Activation<'a>>>>>,
    failed: AtomicBool,
}

/// Ends a gate or up task, even one that panics: the last of an FFN's gate and up tasks to
/// end applies the gate and publishes down's activations, so that its down tasks never wait
/// for ever.
struct Finish<'s, 'a, 'g> {
    plan: &'s FfnPlan<'a>,
    ready: &'s OnceLock<Option<Vec<Activation<'a>>>>,
    left: &'s AtomicUsize,
    failed: &'s AtomicBool,
    glu: &'g (dyn Fn(&mut [f32], &[f32]) + Sync),
    /// Set once the task's rows are written: a guard dropped without it is a task that
    /// panicked.
    done: bool,
}

impl Drop for Finish<'_, '_, '_> {
    fn drop(&mut self) {
        if !self.done {
            self.failed.store(true, Ordering::Relaxed);
        }
        // AcqRel: the last task sees every other task's rows.
        if self.left.fetch_sub(1, Ordering::AcqRel) != 1 {
            return;
        }
        if self.failed.load(Ordering::Relaxed) {
            let _ = self.ready.set(None);
            return;
        }
        let plan = self.plan;
        let len = plan.n_tok * plan.ff;
        // SAFETY: every gate and up task of this FFN has ended (`left` reached 0, acquired
        // above), so nothing else reads or writes its scratch until down's tasks, which read
        // it only after `ready` is set below.
        let acts = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: as above; `g` is the only reference to the gate's rows until it ends.
            let (g, u) = unsafe {
                (
                    std::slice::from_raw_parts_mut(plan.gate.out.0, len),
                    std::slice::from_raw_parts(plan.up.out.0, len),
                )
            };
            for (g, u) in g.chunks_exact_mut(plan.ff).zip(u.chunks_exact(plan.ff)) {
                (self.glu)(g, u);
            }
            // SAFETY: the gated rows are not written again while the job runs, and the
            // scratch outlives it (and so every activation that borrows it).
            let g = unsafe { std::slice::from_raw_parts(plan.gate.out.0, len) };
            g.chunks_exact(plan.ff)
                .map(|g| Activation::new(plan.down.m.ty, g))
                .collect::<Vec<_>>()
        }));
        match acts {
            Ok(acts) => {
                let _ = self.ready.set(Some(acts));
            }
            Err(p) => {
                let _ = self.ready.set(None);
                if !std::thread::panicking() {
                    std::panic::resume_unwind(p);
                }
            }
        }
    }
}

/// Waits for an FFN's down activations: spins a little, then yields to the threads still
/// computing its gate and up rows (which may share a core with this one).
fn wait_ready<'r, 'a>(
    ready: &'r OnceLock<Option<Vec<Activation<'a>>>>,
) -> Option<&'r [Activation<'a>]> {
    let mut spins = 0u32;
    loop {
        if let Some(r) = ready.get() {
            return r.as_deref();
        }
        if spins < 256 {
            spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// One FFN cut into tasks, with its gate and up outputs in a scratch it owns.
struct FfnPlan<'a> {
    gate: Stage<'a>,
    up: Stage<'a>,
    down: Stage<'a>,
    gate_acts: &'a [Activation<'a>],
    up_acts: &'a [Activation<'a>],
    n_tok: usize,
    ff: usize,
    /// Gate's and up's outputs, `n_tok * ff` each (written through `gate.out`, `up.out`).
    _scratch: Vec<f32>,
}

impl<'a> FfnPlan<'a> {
    fn new(
        f: &'a mut GatedFfn<'_>,
        isa: Isa,
        gate_up_bytes: usize,
        down_bytes: usize,
    ) -> FfnPlan<'a> {
        let n_tok = f.gate_acts.len();
        assert!(dotted(n_tok), "{n_tok} tokens for a gated FFN group");
        assert_eq!(f.up_acts.len(), n_tok, "gate and up tokens");
        assert_eq!(f.gate.n_out, f.up.n_out, "gate and up rows");
        assert_eq!(f.down.n_in, f.gate.n_out, "down's inputs");
        assert_eq!(f.out.len(), n_tok * f.down.n_out, "gated FFN output size");
        let ff = f.gate.n_out;
        let mut scratch = vec![0.0f32; 2 * n_tok * ff];
        let (g, u) = scratch.split_at_mut(n_tok * ff);
        FfnPlan {
            gate: Stage::new(f.gate, OutPtr(g.as_mut_ptr()), isa, gate_up_bytes),
            up: Stage::new(f.up, OutPtr(u.as_mut_ptr()), isa, gate_up_bytes),
            down: Stage::new(f.down, OutPtr(f.out.as_mut_ptr()), isa, down_bytes),
            gate_acts: f.gate_acts,
            up_acts: f.up_acts,
            n_tok,
            ff,
            _scratch: scratch,
        }
    }
}

/// One product of an FFN: its matrix, output and cut.
struct Stage<'a> {
    m: MatRef<'a>,
    out: OutPtr,
    rows_per: usize,
    dot: DotFn,
}

impl<'a> Stage<'a> {
    fn new(m: MatRef<'a>, out: OutPtr, isa: Isa, task_bytes: usize) -> Stage<'a> {
        Stage {
            m,
            out,
            rows_per: rows_for_bytes(&m, task_bytes),
            dot: dot_kernel(m.ty, isa),
        }
    }

    fn n_tasks(&self, n_tok: usize) -> usize {
        if n_tok == 0 {
            0
        } else {
            self.m.n_out.div_ceil(self.rows_per)
        }
    }

    /// The task of rows from `start` for every token of `acts`.
    ///
    /// # Safety
    /// No other thread touches these rows of `out` meanwhile, and `out` holds `acts.len()`
    /// tokens of `m.n_out` rows.
    unsafe fn rows(&self, start: usize, acts: &[Activation<'_>]) {
        let end = (start + self.rows_per).min(self.m.n_out);
        // SAFETY: as the caller promises.
        unsafe { dot_rows(self.m, self.dot, acts, self.out.0, (start, end)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matvec::{
        activations, matmul_act,
        tests::{noise, rows_of},
    };
    use crate::engine::ops::swiglu_inplace as swiglu;
    use crate::gguf::GgmlType;
    use crate::quant::quantize_row;

    /// `n_out` rows of `n_in` noise from `seed`, quantized to `ty` (not a K-quant).
    fn quantized(ty: GgmlType, n_in: usize, n_out: usize, seed: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; ty.row_bytes((n_in * n_out) as u64).unwrap() as usize];
        quantize_row(ty, &noise(n_in * n_out, seed), &mut bytes).unwrap();
        bytes
    }

    /// Weights of `n` FFNs of `ty`, `e` wide and `ff` deep: (gate, up, down) each, every
    /// matrix its own noise (the K-quants: random blocks, the same for each FFN).
    fn weights(ty: GgmlType, n: usize, e: usize, ff: usize) -> Vec<[Vec<u8>; 3]> {
        let one = |n_in: usize, n_out: usize, seed: u64| match ty {
            GgmlType::Q4K => rows_of(ty, n_in, n_out, &[0, 2]),
            _ => quantized(ty, n_in, n_out, seed),
        };
        (0..n as u64)
            .map(|i| {
                [
                    one(e, ff, 3 * i),
                    one(e, ff, 3 * i + 1),
                    one(ff, e, 3 * i + 2),
                ]
            })
            .collect()
    }

    fn mat(ty: GgmlType, n_in: usize, n_out: usize, data: &[u8]) -> MatRef<'_> {
        MatRef {
            ty,
            n_in,
            n_out,
            data,
        }
    }

    #[test]
    fn a_group_equals_each_ffns_products_in_turn() {
        // Several FFNs with 1–3 tokens (and one with none), cut into several tasks each, on
        // pools of one thread and of several.
        for threads in [1, 3] {
            let pool = ThreadPool::new(threads);
            for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::F16] {
                let (e, ff) = (256, 1536);
                let tokens = [1usize, 3, 0, 2, 1];
                let w = weights(ty, tokens.len(), e, ff);
                let xs: Vec<Vec<f32>> = tokens
                    .iter()
                    .enumerate()
                    .map(|(i, &n)| noise(n * e, 40 + i as u64))
                    .collect();
                let acts: Vec<Vec<Activation<'_>>> =
                    xs.iter().map(|x| activations(ty, x, e)).collect();
                let mut outs: Vec<Vec<f32>> =
                    tokens.iter().map(|&n| vec![f32::NAN; n * e]).collect();
                let mut ffns: Vec<GatedFfn<'_>> = w
                    .iter()
                    .zip(&acts)
                    .zip(outs.iter_mut())
                    .enumerate()
                    .map(|(i, ((w, acts), out))| GatedFfn {
                        gate: mat(ty, e, ff, &w[0]),
                        up: mat(ty, e, ff, &w[1]),
                        down: mat(ty, ff, e, &w[2]),
                        gate_acts: acts,
                        up_acts: acts,
                        out,
                        label: Some(i as u32),
                    })
                    .collect();
                gated_ffn_group(&pool, &mut ffns, &swiglu);
                drop(ffns);
                for (i, (w, acts)) in w.iter().zip(&acts).enumerate() {
                    let n = acts.len();
                    let (mut g, mut u) = (vec![0.0; n * ff], vec![0.0; n * ff]);
                    let mut want = vec![0.0; n * e];
                    if n > 0 {
                        matmul_act(&pool, mat(ty, e, ff, &w[0]), acts, &mut g);
                        matmul_act(&pool, mat(ty, e, ff, &w[1]), acts, &mut u);
                        for (g, u) in g.chunks_exact_mut(ff).zip(u.chunks_exact(ff)) {
                            swiglu(g, u);
                        }
                        let down_acts = activations(ty, &g, ff);
                        matmul_act(&pool, mat(ty, ff, e, &w[2]), &down_acts, &mut want);
                    }
                    assert_eq!(outs[i], want, "{ty}, {threads} threads, FFN {i}");
                }
            }
        }
    }

    #[test]
    fn each_product_takes_inputs_converted_for_its_own_matrix() {
        // Gate in Q4_0 (Q8_0 inputs), up in F16 (rounded inputs of their own), down in Q4_K
        // (Q8_K inputs): converting up's or down's inputs for the gate's type would fail.
        let pool = ThreadPool::new(3);
        let (e, ff) = (256, 1536);
        let (tg, tu, td) = (GgmlType::Q4_0, GgmlType::F16, GgmlType::Q4K);
        let (wg, wu) = (quantized(tg, e, ff, 1), quantized(tu, e, ff, 2));
        let wd = rows_of(td, ff, e, &[0, 2]);
        let x = noise(2 * e, 9);
        let (gate_acts, up_acts) = (activations(tg, &x, e), activations(tu, &x, e));
        let mut out = vec![f32::NAN; 2 * e];
        let mut ffns = [GatedFfn {
            gate: mat(tg, e, ff, &wg),
            up: mat(tu, e, ff, &wu),
            down: mat(td, ff, e, &wd),
            gate_acts: &gate_acts,
            up_acts: &up_acts,
            out: &mut out,
            label: None,
        }];
        gated_ffn_group(&pool, &mut ffns, &swiglu);
        let (mut g, mut u, mut want) = (vec![0.0; 2 * ff], vec![0.0; 2 * ff], vec![0.0; 2 * e]);
        matmul_act(&pool, mat(tg, e, ff, &wg), &gate_acts, &mut g);
        matmul_act(&pool, mat(tu, e, ff, &wu), &up_acts, &mut u);
        for (g, u) in g.chunks_exact_mut(ff).zip(u.chunks_exact(ff)) {
            swiglu(g, u);
        }
        let down_acts = activations(td, &g, ff);
        matmul_act(&pool, mat(td, ff, e, &wd), &down_acts, &mut want);
        assert_eq!(out, want);
    }

    #[test]
    fn a_panic_in_the_gate_or_a_product_is_raised_again_and_the_pool_survives() {
        let pool = ThreadPool::new(3);
        let ty = GgmlType::Q8_0;
        let (e, ff) = (256, 2048);
        let w = weights(ty, 3, e, ff);
        let x = noise(e, 5);
        let acts = activations(ty, &x, e);
        // Inputs in a format the Q8_0 kernel refuses: the up tasks of that FFN panic while
        // the down tasks of every FFN wait for their inputs.
        let wrong = activations(GgmlType::F16, &x, e);
        let mut outs = vec![vec![0.0f32; e]; 3];
        let run = |glu: &(dyn Fn(&mut [f32], &[f32]) + Sync),
                   bad_up: Option<usize>,
                   outs: &mut [Vec<f32>]| {
            let mut ffns: Vec<GatedFfn<'_>> = w
                .iter()
                .zip(outs.iter_mut())
                .enumerate()
                .map(|(i, (w, out))| GatedFfn {
                    gate: mat(ty, e, ff, &w[0]),
                    up: mat(ty, e, ff, &w[1]),
                    down: mat(ty, ff, e, &w[2]),
                    gate_acts: &acts,
                    up_acts: if bad_up == Some(i) { &wrong } else { &acts },
                    out,
                    label: None,
                })
                .collect();
            gated_ffn_group(&pool, &mut ffns, glu);
        };
        let raised = |f: &dyn Fn()| std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        assert!(
            raised(&|| run(&|_, _| panic!("glu"), None, &mut outs.clone())).is_err(),
            "the glu's panic is raised"
        );
        for bad in 0..3 {
            assert!(
                raised(&|| run(&swiglu, Some(bad), &mut outs.clone())).is_err(),
                "FFN {bad}'s up product's panic is raised"
            );
        }
        // The same pool still runs a whole group afterwards.
        run(&swiglu, None, &mut outs);
        assert!(outs.iter().all(|o| o.iter().all(|v| v.is_finite())));
    }
}
