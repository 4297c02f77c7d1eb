//! A helper that computes the last rows of a dense layer's products
//! (`engine::row_help::RowHelper`, which the GPU's bus rows implement) changes who computes
//! them, not the hidden states: with a helper that computes its rows as the CPU would, or one
//! that fails (its rows then computed by the CPU), the first layers' output is bit for bit the
//! engine's alone. The helper is asked for every group of products of every layer in passes of
//! one token, and never in longer passes.

use std::sync::Arc;

use spillway_daemon::cpu::{matmul, ThreadPool};
use spillway_daemon::engine::forward::hidden_after;
use spillway_daemon::engine::row_help::{LayerProducts, RowHelper};
use spillway_daemon::engine::KvCache;
use spillway_daemon::gguf::GgmlType;
use spillway_daemon::model::{Ffn, Model};
use spillway_daemon::synth::{SynthModel, WeightType};

fn model(preset: &str, ty: GgmlType, dir: &std::path::Path) -> Arc<Model> {
    let path = dir.join(format!("{preset}-{ty}.gguf"));
    SynthModel::from_name(preset, WeightType::Uniform(ty), 3)
        .unwrap()
        .write(&path, false, |_, _| {})
        .unwrap();
    Arc::new(Model::open(&path).unwrap())
}

/// Computes its rows (the last `1 - share` of each product, 8 rows at a time) on this thread
/// with the CPU's kernels, or fails every time; counts what it was asked.
struct CpuHelper {
    model: Arc<Model>,
    pool: ThreadPool,
    share: f32,
    fails: bool,
    calls: Vec<(usize, LayerProducts)>,
}

impl RowHelper for CpuHelper {
    fn cpu_rows(&self, _: LayerProducts, n_out: usize) -> usize {
        (((n_out as f32 * self.share) as usize) / 8 * 8).min(n_out)
    }

    fn run(
        &mut self,
        layer: usize,
        products: LayerProducts,
        x: &[f32],
        cpu: &mut dyn FnMut(),
        tails: &mut [&mut [f32]],
    ) -> bool {
        self.calls.push((layer, products));
        cpu();
        if self.fails {
            return false;
        }
        let l = &self.model.layers[layer];
        let Ffn::Dense { gate, up, down } = &l.ffn else {
            panic!("a dense layer")
        };
        let mats = match products {
            LayerProducts::Qkv => vec![&l.attn.wq, &l.attn.wk, &l.attn.wv],
            LayerProducts::Output => vec![&l.attn.wo],
            LayerProducts::GateUp => vec![gate, up],
            LayerProducts::Down => vec![down],
        };
        assert_eq!(mats.len(), tails.len());
        for (m, t) in mats.into_iter().zip(tails.iter_mut()) {
            let m = self.model.mat(m);
            let first = m.n_out - t.len();
            assert_eq!(first, self.cpu_rows(products, m.n_out));
            matmul(&self.pool, m.rows(first..m.n_out), x, t);
        }
        true
    }
}

fn check(preset: &str, ty: GgmlType) {
    let dir = tempfile::tempdir().unwrap();
    let model = model(preset, ty, dir.path());
    let c = &model.config;
    let n_layers = c.n_layer - 1;
    let pool = ThreadPool::new(2);
    let cache = || KvCache::new(n_layers, 16, c.kv_width());
    let prompt = [5u32, 90, 7];
    let tokens = [17u32, 300, 2];

    // The engine alone: a prompt of three tokens, then three tokens one at a time.
    let mut kv = cache();
    let mut want = vec![hidden_after(&model, &pool, &mut kv, &prompt, 0, n_layers, None).unwrap()];
    for (i, &t) in tokens.iter().enumerate() {
        let at = prompt.len() + i;
        want.push(hidden_after(&model, &pool, &mut kv, &[t], at, n_layers, None).unwrap());
    }

    for (share, fails) in [(0.5, false), (0.0, false), (1.0, false), (0.3, true)] {
        let what = format!("{preset} {ty}, the CPU's share {share}, failing {fails}");
        let mut help = CpuHelper {
            model: model.clone(),
            pool: ThreadPool::new(1),
            share,
            fails,
            calls: Vec::new(),
        };
        let mut kv = cache();
        let mut got = vec![hidden_after(
            &model,
            &pool,
            &mut kv,
            &prompt,
            0,
            n_layers,
            Some(&mut help),
        )
        .unwrap()];
        assert!(help.calls.is_empty(), "{what}: a prompt of three tokens");
        for (i, &t) in tokens.iter().enumerate() {
            let at = prompt.len() + i;
            got.push(
                hidden_after(&model, &pool, &mut kv, &[t], at, n_layers, Some(&mut help)).unwrap(),
            );
        }
        assert_eq!(got, want, "{what}");
        let expected: Vec<(usize, LayerProducts)> = (0..tokens.len())
            .flat_map(|_| (0..n_layers).flat_map(|l| LayerProducts::ALL.map(|g| (l, g))))
            .collect();
        assert_eq!(help.calls, expected, "{what}");
    }
}

#[test]
fn rows_computed_by_a_helper_leave_llama_layers_as_the_engine_computes_them() {
    check("tiny-llama", GgmlType::Q4_0);
    check("tiny-llama", GgmlType::F16);
}

#[test]
fn rows_computed_by_a_helper_leave_qwen3_layers_as_the_engine_computes_them() {
    check("tiny-qwen3", GgmlType::Q8_0);
}
