//! Several independent matrix products in one job of the thread pool. A MoE layer multiplies
//! a handful of small matrices per token (gate, up and down of each chosen expert); run one
//! after another, each pays a wake-up and a join of the whole pool for a few hundred rows. Run
//! as one job, the pool's threads claim row chunks of every product from one counter, so a
//! layer costs one join per phase (gate and up together, then down), whatever the number of
//! experts, and no thread idles while another finishes a matrix.
//!
//! Each product's arithmetic is [`matmul_act`](super::matmul_act)'s: the same dot products (or
//! the same batched AVX2 kernels for four tokens or more), so results are bit-identical to
//! computing the products one by one.

use crate::model::MatRef;

use super::act::Activation;
#[cfg(target_arch = "x86_64")]
use super::gemm_avx2;
#[cfg(target_arch = "x86_64")]
use super::gemm_avx512;
use super::kernels::{dot_kernel, DotFn, Isa};
use super::matvec::rows_per_task;
#[cfg(target_arch = "x86_64")]
use super::matvec::MIN_PANEL_TOKENS;
use super::pool::ThreadPool;

/// One product of a group: `out[b * n_out + i] = row_i(m) · acts[b]` (token-major).
pub struct Product<'a> {
    pub m: MatRef<'a>,
    pub acts: &'a [Activation<'a>],
    pub out: &'a mut [f32],
    /// What a traced pool labels the product's tasks with (an expert's index). Label all the
    /// products of a group or none: an unlabelled one is traced under the label before it.
    pub label: Option<u32>,
}

/// Computes every product of `products` in one job of `pool`.
///
/// # Panics
/// If a product's `out` is not `acts.len()` rows of `m.n_out`, or an activation's format or
/// width does not fit its matrix.
pub fn matmul_group(pool: &ThreadPool, products: &mut [Product<'_>]) {
    let isa = Isa::detect();
    let labels: Vec<Option<u32>> = products.iter().map(|p| p.label).collect();
    let task_bytes = task_bytes(products, pool.n_threads());
    let plans: Vec<Plan<'_>> = products
        .iter_mut()
        .map(|p| Plan::new(p, isa, pool.n_threads(), task_bytes))
        .collect();
    // Task `t` belongs to the product whose range of task indices holds it.
    let mut first_task = Vec::with_capacity(plans.len() + 1);
    first_task.push(0usize);
    for p in &plans {
        first_task.push(first_task.last().unwrap() + p.n_tasks());
    }
    let n_tasks = *first_task.last().unwrap();
    let parts: Vec<(usize, u32)> = labels
        .iter()
        .zip(&first_task)
        .filter_map(|(l, &first)| l.map(|l| (first, l)))
        .collect();
    pool.run_labeled(n_tasks, &parts, &|t| {
        let k = first_task.partition_point(|&f| f <= t) - 1;
        let plan = &plans[k];
        let start = (t - first_task[k]) * plan.rows_per;
        let end = (start + plan.rows_per).min(plan.m.n_out);
        // SAFETY: each task writes rows `start..end` of its own product alone, and every
        // product's `out` outlives `run`.
        unsafe { plan.rows(start, end) };
    });
}

/// Tasks per thread a group's weights are cut into, where its products are one token's.
const TASKS_PER_THREAD: usize = 4;

/// Bounds on the weights a one-token task reads.
const MIN_TASK_BYTES: usize = 32 << 10;
const MAX_TASK_BYTES: usize = 256 << 10;

/// Bytes of weights each task of a group reads where a product's rows are dotted one by one
/// with each token (fewer than [`MIN_PANEL_TOKENS`] of them): the group's weights over
/// [`TASKS_PER_THREAD`] tasks a thread, within [`MIN_TASK_BYTES`]..[`MAX_TASK_BYTES`].
///
/// Such a product is bound by its reads of the weights, and a task is a new stream of them:
/// cut by rows alone, a Qwen3-30B-A3B expert's products (768 rows of 1152 bytes in Q4_0, or
/// 2048 of 432) left 14 KB tasks on 16 threads. On the development machine's 2 threads, tasks
/// that small read six such experts a layer from DRAM at 12.8 GB/s, against 17.8 at the
/// 110 KB that 2 threads give them (`spillway-kernels --expert-layers 48`).
fn task_bytes(products: &[Product<'_>], n_threads: usize) -> usize {
    let weights: usize = products
        .iter()
        .filter(|p| !p.acts.is_empty())
        .map(|p| p.m.n_out * p.m.row_bytes())
        .sum();
    task_bytes_of(weights, n_threads)
}

/// [`task_bytes`] for `weights` bytes of one-token products in all.
pub(super) fn task_bytes_of(weights: usize, n_threads: usize) -> usize {
    (weights / (TASKS_PER_THREAD * n_threads.max(1))).clamp(MIN_TASK_BYTES, MAX_TASK_BYTES)
}

/// Rows of `m` in a task that reads `task_bytes` of its weights (one at least).
pub(super) fn rows_for_bytes(m: &MatRef<'_>, task_bytes: usize) -> usize {
    task_bytes.div_ceil(m.row_bytes().max(1)).max(1)
}

/// Rows `start..end` of `m`, each dotted by `dot` with every token of `acts`, into `out`
/// (token-major, `m.n_out` floats a token).
///
/// # Safety
/// `out` holds `acts.len() * m.n_out` floats, and no other thread touches these rows of it
/// meanwhile.
pub(super) unsafe fn dot_rows(
    m: MatRef<'_>,
    dot: DotFn,
    acts: &[Activation<'_>],
    out: *mut f32,
    (start, end): (usize, usize),
) {
    for i in start..end {
        let row = m.row(i);
        for (b, act) in acts.iter().enumerate() {
            // SAFETY: `b * n_out + i` is inside `out`, and the caller owns row `i`.
            unsafe { *out.add(b * m.n_out + i) = dot(row, act) };
        }
    }
}

/// A product ready to be cut into tasks.
struct Plan<'a> {
    m: MatRef<'a>,
    acts: &'a [Activation<'a>],
    out: OutPtr,
    rows_per: usize,
    dot: super::kernels::DotFn,
    #[cfg(target_arch = "x86_64")]
    batch: Option<gemm_avx2::Batch<'a>>,
    #[cfg(target_arch = "x86_64")]
    batch512: Option<gemm_avx512::Batch<'a>>,
}

/// A product's output, written by several tasks at disjoint rows.
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: tasks write disjoint elements, and every `out` outlives the pool's `run`.
unsafe impl Sync for OutPtr {}

impl<'a> Plan<'a> {
    /// `task_bytes`: the weights a task reads where the rows are dotted one by one
    /// ([`task_bytes`]); batched products keep the usual cut by rows.
    fn new(p: &'a mut Product<'_>, isa: Isa, n_threads: usize, task_bytes: usize) -> Plan<'a> {
        let n_tok = p.acts.len();
        assert_eq!(
            p.out.len(),
            n_tok * p.m.n_out,
            "grouped product output size"
        );
        // The activations' format and width are asserted by the kernels on first use.
        #[cfg(target_arch = "x86_64")]
        let batch512 = (isa == Isa::Avx2
            && gemm_avx512::supports(p.m.ty)
            && n_tok >= MIN_PANEL_TOKENS
            && gemm_avx512::available())
        // SAFETY: `available` found the features.
        .then(|| unsafe { gemm_avx512::Batch::new(p.m.ty, p.acts) });
        #[cfg(target_arch = "x86_64")]
        let batch = (batch512.is_none()
            && isa == Isa::Avx2
            && gemm_avx2::supports(p.m.ty)
            && n_tok >= MIN_PANEL_TOKENS)
            // SAFETY: `Isa::detect` found AVX2, FMA and F16C.
            .then(|| unsafe { gemm_avx2::Batch::new(p.m.ty, p.acts) });
        #[cfg(target_arch = "x86_64")]
        let batched = batch.is_some() || batch512.is_some();
        #[cfg(not(target_arch = "x86_64"))]
        let batched = false;
        let rows_per = match batched {
            true => rows_per_task(p.m.n_out, n_threads),
            false => rows_for_bytes(&p.m, task_bytes),
        };
        Plan {
            m: p.m,
            acts: p.acts,
            out: OutPtr(p.out.as_mut_ptr()),
            rows_per,
            dot: dot_kernel(p.m.ty, isa),
            #[cfg(target_arch = "x86_64")]
            batch,
            #[cfg(target_arch = "x86_64")]
            batch512,
        }
    }

    fn n_tasks(&self) -> usize {
        if self.acts.is_empty() {
            0
        } else {
            self.m.n_out.div_ceil(self.rows_per)
        }
    }

    /// Rows `start..end` of the product for every token.
    ///
    /// # Safety
    /// No other thread writes these rows of `out` meanwhile.
    unsafe fn rows(&self, start: usize, end: usize) {
        #[cfg(target_arch = "x86_64")]
        if let Some(batch) = &self.batch512 {
            // SAFETY: the batch exists only where `available` found the features; the caller
            // owns the rows.
            unsafe { gemm_avx512::products(batch, self.m, start, end, self.out.0, self.m.n_out) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if let Some(batch) = &self.batch {
            let mut panel = gemm_avx2::Panel::default();
            for first in (start..end).step_by(gemm_avx2::PANEL_ROWS) {
                let n_rows = gemm_avx2::PANEL_ROWS.min(end - first);
                let mut rows: [&[u8]; gemm_avx2::PANEL_ROWS] = Default::default();
                for (k, row) in rows[..n_rows].iter_mut().enumerate() {
                    *row = self.m.row(first + k);
                }
                // SAFETY: the batch exists only where `Isa::detect` found AVX2, FMA and F16C;
                // the panel is unpacked for this batch just before; the caller owns the rows.
                unsafe {
                    panel.unpack(batch, &rows[..n_rows]);
                    panel.products(batch, self.out.0, self.m.n_out, first);
                }
            }
            return;
        }
        // SAFETY: `out`'s size was checked, and the caller owns the rows.
        unsafe { dot_rows(self.m, self.dot, self.acts, self.out.0, (start, end)) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::matvec::{
        activations, matmul_act,
        tests::{noise, rows_of},
    };
    use crate::gguf::GgmlType;

    #[test]
    fn a_group_equals_its_products_one_by_one() {
        // Shapes of different heights and token counts on both sides of the batched-kernel
        // threshold, and an empty product, in one group; at 4096 inputs the one-token products
        // are cut into several tasks of whole rows.
        let pool = ThreadPool::new(3);
        for (n_in, (ty, d_at)) in [256, 4096].into_iter().flat_map(|n| {
            [
                (GgmlType::Q4_0, &[][..]),
                (GgmlType::Q8_0, &[][..]),
                (GgmlType::F16, &[][..]),
                (GgmlType::Q4K, &[0, 2][..]),
                (GgmlType::Q6K, &[208][..]),
            ]
            .map(|t| (n, t))
        }) {
            let shapes = [(37usize, 1usize), (64, 3), (19, 6), (8, 0), (130, 4)];
            let weights: Vec<Vec<u8>> = shapes
                .iter()
                .map(|&(n_out, _)| rows_of(ty, n_in, n_out, d_at))
                .collect();
            let mats: Vec<MatRef<'_>> = shapes
                .iter()
                .zip(&weights)
                .map(|(&(n_out, _), data)| MatRef {
                    ty,
                    n_in,
                    n_out,
                    data,
                })
                .collect();
            let xs: Vec<Vec<f32>> = shapes
                .iter()
                .enumerate()
                .map(|(s, &(_, n_tok))| noise(n_in * n_tok, 20 + s as u64))
                .collect();
            let acts: Vec<Vec<Activation<'_>>> =
                xs.iter().map(|x| activations(ty, x, n_in)).collect();
            let mut outs: Vec<Vec<f32>> = shapes
                .iter()
                .map(|&(n_out, n_tok)| vec![f32::NAN; n_out * n_tok])
                .collect();
            let mut products: Vec<Product<'_>> = outs
                .iter_mut()
                .zip(&mats)
                .zip(&acts)
                .map(|((out, &m), acts)| Product {
                    m,
                    acts,
                    out,
                    label: None,
                })
                .collect();
            if n_in == 4096 {
                let rows = task_bytes(&products, pool.n_threads()).div_ceil(mats[0].row_bytes());
                assert!(rows < 37, "{ty}: one task of {rows} rows");
            }
            matmul_group(&pool, &mut products);
            drop(products);
            for (s, ((m, acts), out)) in mats.iter().zip(&acts).zip(&outs).enumerate() {
                let mut want = vec![0.0f32; out.len()];
                if !acts.is_empty() {
                    matmul_act(&pool, *m, acts, &mut want);
                }
                assert_eq!(out, &want, "{ty} product {s}, {n_in} inputs");
            }
        }
    }
}
