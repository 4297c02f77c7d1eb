//! The key/value cache of one sequence: per layer, `capacity` positions of `kv_width` keys and
//! values stored as f16, as llama.cpp's default cache type is (so attention sees the same
//! rounded keys and values as llama.cpp does).

use half::f16;

#[derive(Debug, Clone)]
pub struct KvCache {
    capacity: usize,
    kv_width: usize,
    /// Per layer: `capacity * kv_width` keys, position-major.
    keys: Vec<Vec<f16>>,
    values: Vec<Vec<f16>>,
}

impl KvCache {
    /// Bytes of a cache of `capacity` positions: f16 keys and values per layer.
    pub fn bytes(n_layer: usize, capacity: usize, kv_width: usize) -> u64 {
        2 * n_layer as u64 * capacity as u64 * kv_width as u64 * 2
    }

    pub fn new(n_layer: usize, capacity: usize, kv_width: usize) -> KvCache {
        let empty = || vec![vec![f16::ZERO; capacity * kv_width]; n_layer];
        KvCache {
            capacity,
            kv_width,
            keys: empty(),
            values: empty(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Stores the key and value of `layer` at `pos` (rounded to f16).
    ///
    /// # Panics
    /// If `pos >= capacity` or the widths differ.
    pub fn store(&mut self, layer: usize, pos: usize, k: &[f32], v: &[f32]) {
        let w = self.kv_width;
        let range = pos * w..(pos + 1) * w;
        for (d, &s) in self.keys[layer][range.clone()].iter_mut().zip(k) {
            *d = f16::from_f32(s);
        }
        for (d, &s) in self.values[layer][range].iter_mut().zip(v) {
            *d = f16::from_f32(s);
        }
    }

    /// Stores `keys.len() / kv_width` positions of `layer` from `pos` on, keys and values
    /// already f16 (computed elsewhere, as a GPU's prompt chunk computes them).
    ///
    /// # Panics
    /// If the positions pass the capacity or the lengths differ.
    pub fn store_f16(&mut self, layer: usize, pos: usize, keys: &[f16], values: &[f16]) {
        assert_eq!(keys.len(), values.len(), "keys and values");
        let range = pos * self.kv_width..pos * self.kv_width + keys.len();
        self.keys[layer][range.clone()].copy_from_slice(keys);
        self.values[layer][range].copy_from_slice(values);
    }

    /// The keys of `layer` for positions `0..n`, position-major.
    pub fn keys(&self, layer: usize, n: usize) -> &[f16] {
        &self.keys[layer][..n * self.kv_width]
    }

    pub fn values(&self, layer: usize, n: usize) -> &[f16] {
        &self.values[layer][..n * self.kv_width]
    }

    pub fn kv_width(&self) -> usize {
        self.kv_width
    }
}
