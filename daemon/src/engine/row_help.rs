//! Rows of a dense layer's products computed elsewhere while the CPU computes the rest.
//!
//! A model whose first layers run on the CPU (`gpu::cpu_layers`) leaves the GPU idle while
//! they run, and the bus to it unused. A [`RowHelper`] takes the last rows of each of those
//! layers' products (the GPU reading them from system RAM over the bus) while the CPU's
//! threads compute the first rows: two readers of the weights at once instead of one. Only
//! passes of one token use it (decode steps); the rows the CPU computes are its usual
//! arithmetic, the helper's are the GPU kernels'.

use crate::cpu::{activations, matmul_group, Product, ThreadPool};
use crate::model::MatRef;

/// A group of a dense layer's products that share their input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LayerProducts {
    /// Q, K and V, of the normed hidden state.
    Qkv,
    /// The attention's output projection.
    Output,
    /// The FFN's gate and up, of the normed hidden state.
    GateUp,
    /// The FFN's down projection.
    Down,
}

impl LayerProducts {
    /// Every group, in the order a layer runs them (and of [`LayerProducts::index`]).
    pub const ALL: [LayerProducts; 4] = [
        LayerProducts::Qkv,
        LayerProducts::Output,
        LayerProducts::GateUp,
        LayerProducts::Down,
    ];

    /// The group's place in [`LayerProducts::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Computes the last rows of a layer's products while the CPU computes the first ones.
pub trait RowHelper {
    /// Of a product of `n_out` rows in `products`, how many the CPU computes (the first ones)
    /// this time; the helper computes the rest.
    fn cpu_rows(&self, products: LayerProducts, n_out: usize) -> usize;

    /// Computes the helper's rows of `products` of layer `layer` for the input `x` (one
    /// token) while `cpu` runs on this thread, then writes them into `tails`: for each product
    /// of the group in order, the rows after the CPU's. False when the helper failed (its
    /// error kept for its owner): `tails` are then not written.
    fn run(
        &mut self,
        layer: usize,
        products: LayerProducts,
        x: &[f32],
        cpu: &mut dyn FnMut(),
        tails: &mut [&mut [f32]],
    ) -> bool;
}

/// The products of `mats` with the one token `x` into `outs`, the last rows of each computed
/// by `help` at the same time as the CPU computes the first ones (and by the CPU too, if the
/// helper fails). False, with nothing computed, without a helper or for more than one token.
pub(super) fn shared_rows(
    pool: &ThreadPool,
    help: Option<&mut (dyn RowHelper + 'static)>,
    at: (usize, LayerProducts),
    mats: &[MatRef<'_>],
    x: &[f32],
    outs: &mut [&mut [f32]],
) -> bool {
    let Some(help) = help else { return false };
    if mats.iter().any(|m| m.n_in != x.len()) {
        return false;
    }
    let cut: Vec<usize> = mats.iter().map(|m| help.cpu_rows(at.1, m.n_out)).collect();
    let (mut heads, mut tails): (Vec<&mut [f32]>, Vec<&mut [f32]>) = outs
        .iter_mut()
        .zip(&cut)
        .map(|(o, &c)| o.split_at_mut(c))
        .unzip();
    let mut cpu = || {
        let parts: Vec<MatRef<'_>> = mats.iter().zip(&cut).map(|(m, &c)| m.rows(0..c)).collect();
        products(pool, &parts, x, &mut heads);
    };
    if !help.run(at.0, at.1, x, &mut cpu, &mut tails) {
        let parts: Vec<MatRef<'_>> = mats
            .iter()
            .zip(&cut)
            .map(|(m, &c)| m.rows(c..m.n_out))
            .collect();
        products(pool, &parts, x, &mut tails);
    }
    true
}

/// Every product of `mats` with the token `x` into `outs`, in one job of the pool.
fn products(pool: &ThreadPool, mats: &[MatRef<'_>], x: &[f32], outs: &mut [&mut [f32]]) {
    let acts: Vec<_> = mats.iter().map(|m| activations(m.ty, x, m.n_in)).collect();
    let mut jobs: Vec<Product<'_>> = mats
        .iter()
        .zip(&acts)
        .zip(outs.iter_mut())
        .filter(|((m, _), _)| m.n_out > 0)
        .map(|((m, a), o)| Product {
            m: *m,
            acts: a,
            out: o,
            label: None,
        })
        .collect();
    if !jobs.is_empty() {
        matmul_group(pool, &mut jobs);
    }
}
