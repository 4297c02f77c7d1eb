//! The last rows of the CPU's layers' products on the GPU, read from system RAM over the bus,
//! while the CPU's threads compute the first rows (a dense model over the VRAM budget with
//! [`GpuModelOptions::bus_rows`](super::GpuModelOptions::bus_rows)).
//!
//! A dense model's first layers run on the CPU when VRAM holds only the rest
//! ([`crate::gpu::cpu_layers`]); a decode step is then bound by the CPU reading those layers'
//! weights, while the GPU waits and the bus idles. Here every such layer's matrices are also
//! copied into system RAM that the GPU can read, and each product of a decode step is shared:
//! the CPU computes its first rows from the memory map, the GPU the rest over the bus, at the
//! same time ([`crate::engine::row_help`]).
//!
//! The GPU's share of a group's rows (Q/K/V, the output projection, gate and up, down: each
//! group has its own, the same in every layer) is balanced as the groups run: when the
//! device had finished by the time the CPU's rows were done, the GPU takes one step more of
//! the next such group's rows, else one step less. Both sides' times grow with their share,
//! so the share settles where they finish together, which is where the slower of the two is
//! fastest, whatever bounds each (the bus, the CPU's dot products, the memory both read, the
//! fixed cost of a submission). [`GpuModelOptions::split_cpu_share`](super::GpuModelOptions::split_cpu_share)
//! fixes the CPU's share of every group instead.
//!
//! Each (layer, group, share) has a recording of the GPU's rows, made the first time and
//! replayed after: at most `STEPS + 1` shares a group, and in practice the few around where it
//! settles.

use std::collections::HashMap;
use std::sync::Arc;

use crate::engine::row_help::{LayerProducts, RowHelper};
use crate::gpu::error::{GpuError, Result};
use crate::gpu::matrix::GpuMatrix;
use crate::gpu::record::Kernels;
use crate::gpu::replay::Replay;
use crate::gpu::{Buffer, Device};
use crate::model::{Ffn, Model};

/// The GPU's rows of a product are a multiple of this (whole workgroups of the kernels).
const ROW_STEP: usize = 32;

/// A group's share moves by 1/`STEPS` of its rows.
const STEPS: u32 = 64;

/// One layer's matrices in system RAM.
struct LayerRows {
    qkv: [GpuMatrix; 3],
    output: GpuMatrix,
    gate_up: [GpuMatrix; 2],
    down: GpuMatrix,
}

impl LayerRows {
    fn products(&self, products: LayerProducts) -> &[GpuMatrix] {
        match products {
            LayerProducts::Qkv => &self.qkv,
            LayerProducts::Output => std::slice::from_ref(&self.output),
            LayerProducts::GateUp => &self.gate_up,
            LayerProducts::Down => std::slice::from_ref(&self.down),
        }
    }
}

/// The GPU's part of the CPU's layers ([`RowHelper`]).
pub(super) struct BusRows {
    kernels: Arc<Kernels>,
    layers: Vec<LayerRows>,
    /// The input of a group (host-written) and its products' rows (device-written), in system
    /// RAM.
    x: Buffer,
    y: [Buffer; 3],
    /// Per group (by [`LayerProducts::index`]): the GPU's share of its rows, in 1/[`STEPS`].
    gpu_steps: [u32; 4],
    /// The shares are given, not balanced.
    fixed: bool,
    /// Recordings by (the GPU's share in 1/[`STEPS`], layer, group).
    replays: HashMap<(u32, usize, LayerProducts), Replay>,
    /// The first failure of the GPU's part; the CPU computed the rows it had.
    error: Option<GpuError>,
}

impl BusRows {
    /// Copies the matrices of `model`'s first `n_layers` layers (all dense) into system RAM
    /// the GPU reads; `share`: the CPU's share, fixed, or `None` to balance each group's.
    pub(super) fn new(
        device: &Arc<Device>,
        kernels: &Arc<Kernels>,
        model: &Model,
        n_layers: usize,
        share: Option<f32>,
    ) -> Result<BusRows> {
        let host = |m: &crate::model::Matrix| {
            let r = model.mat(m);
            GpuMatrix::in_host_memory(device, r.ty, r.n_in, &[r.data])
        };
        let mut layers = Vec::with_capacity(n_layers);
        let (mut widest_in, mut widest_out) = (0, 0);
        for layer in &model.layers[..n_layers] {
            let Ffn::Dense { gate, up, down } = &layer.ffn else {
                return Err(GpuError::Unsupported(
                    "rows over the bus for a layer with routed experts".into(),
                ));
            };
            let a = &layer.attn;
            let rows = LayerRows {
                qkv: [host(&a.wq)?, host(&a.wk)?, host(&a.wv)?],
                output: host(&a.wo)?,
                gate_up: [host(gate)?, host(up)?],
                down: host(down)?,
            };
            for m in LayerProducts::ALL.iter().flat_map(|&p| rows.products(p)) {
                widest_in = widest_in.max(m.n_in);
                widest_out = widest_out.max(m.n_out);
            }
            layers.push(rows);
        }
        let out = || Buffer::new_host_memory(device, widest_out as u64 * 4);
        Ok(BusRows {
            kernels: kernels.clone(),
            layers,
            x: Buffer::new_host_memory(device, widest_in as u64 * 4)?,
            y: [out()?, out()?, out()?],
            gpu_steps: [share.map_or(STEPS / 2, |s| {
                ((1.0 - s.clamp(0.0, 1.0)) * STEPS as f32).round() as u32
            }); 4],
            fixed: share.is_some(),
            replays: HashMap::new(),
            error: None,
        })
    }

    /// The CPU's share of each group's rows now (Q/K/V, output, gate and up, down).
    pub(super) fn cpu_shares(&self) -> [(LayerProducts, f32); 4] {
        LayerProducts::ALL.map(|g| (g, 1.0 - self.gpu_steps[g.index()] as f32 / STEPS as f32))
    }

    /// The GPU's failure since the last call, if any.
    pub(super) fn take_error(&mut self) -> Option<GpuError> {
        self.error.take()
    }

    /// The GPU's rows of a product of `n_out` rows in `products`: the last ones, whole steps
    /// of [`ROW_STEP`].
    fn gpu_rows(&self, products: LayerProducts, n_out: usize) -> usize {
        let steps = n_out / ROW_STEP;
        let share = self.gpu_steps[products.index()] as usize;
        (steps * share + STEPS as usize / 2) / STEPS as usize * ROW_STEP
    }

    /// After a group ran on both sides: the next such group gives the GPU a step more of its
    /// rows if the GPU had finished first, else a step less.
    fn balance(&mut self, products: LayerProducts, gpu_first: bool) {
        if self.fixed {
            return;
        }
        let s = &mut self.gpu_steps[products.index()];
        *s = match gpu_first {
            true => (*s + 1).min(STEPS),
            false => s.saturating_sub(1),
        };
    }

    /// The recording of `products` of `layer` at this pass's share, made now if new.
    fn replay(&mut self, layer: usize, products: LayerProducts) -> Result<&Replay> {
        let key = (self.gpu_steps[products.index()], layer, products);
        if !self.replays.contains_key(&key) {
            let mats = self.layers[layer].products(products);
            let (x, y) = (&self.x, &self.y);
            let rows: Vec<usize> = mats
                .iter()
                .map(|m| self.gpu_rows(products, m.n_out))
                .collect();
            let replay = self.kernels.record_replay(|rec| {
                for ((m, &n), y) in mats.iter().zip(&rows).zip(y) {
                    if n > 0 {
                        rec.matvec_rows(m, m.n_out - n, n, x, y)?;
                    }
                }
                Ok(())
            })?;
            self.replays.insert(key, replay);
        }
        Ok(&self.replays[&key])
    }
}

impl RowHelper for BusRows {
    fn cpu_rows(&self, products: LayerProducts, n_out: usize) -> usize {
        n_out - self.gpu_rows(products, n_out)
    }

    fn run(
        &mut self,
        layer: usize,
        products: LayerProducts,
        x: &[f32],
        cpu: &mut dyn FnMut(),
        tails: &mut [&mut [f32]],
    ) -> bool {
        if tails.iter().all(|t| t.is_empty()) {
            cpu();
            // A GPU with no rows has finished first.
            self.balance(products, true);
            return true;
        }
        if self.error.is_some() {
            cpu();
            return false;
        }
        self.x.write_f32(x);
        let done = match self.replay(layer, products) {
            Ok(replay) => replay.run_with(cpu).1,
            Err(e) => {
                cpu();
                Err(e)
            }
        };
        match done {
            Ok(gpu_first) => self.balance(products, gpu_first),
            Err(e) => {
                self.error = Some(e);
                return false;
            }
        }
        for (t, y) in tails.iter_mut().zip(&self.y) {
            t.copy_from_slice(&y.read_f32(t.len()));
        }
        true
    }
}
