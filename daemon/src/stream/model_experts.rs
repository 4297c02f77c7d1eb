//! A RAM tier for one model's routed experts: an [`ExpertCache`] over the model's GGUF file,
//! bounded by a RAM budget, whose misses are read from the SSD by a [`TileReader`] (io_uring
//! with O_DIRECT, so they do not fill the page cache either).
//!
//! An expert is three tiles, its gate, up and down matrices (one slice of each stack tensor).
//! The reader's buffers are the cache's memory, allocated when it opens: as many as the budget
//! holds and no more than every expert takes, each as large as the largest tile at any
//! alignment, so the RAM held never passes the budget ([`ram_tier_bytes`]). The cache evicts
//! when its buffers run out.

use std::sync::Arc;

use super::buffer::{buffer_size_for_tile, ALIGN};
use super::cache::{ExpertCache, Extent};
use super::error::StreamError;
use super::fault::StorageFaults;
use super::policy::{ExpertKey, ReplacementPolicy};
use super::reader::{ReaderOptions, TileReader};
use crate::model::{Ffn, Model};

/// Tiles of one expert: gate, up, down.
const TILES_PER_EXPERT: usize = 3;

/// Where each MoE layer's experts lie in the file: per layer, per matrix, the first expert's
/// offset and one expert's length (`None` for dense layers).
type Layout = Vec<Option<[(u64, usize); TILES_PER_EXPERT]>>;

fn layout(model: &Model) -> Layout {
    model
        .layers
        .iter()
        .map(|l| match &l.ffn {
            Ffn::Moe(m) => Some([&m.gate, &m.up, &m.down].map(|w| model.expert_extent(w, 0))),
            Ffn::Dense { .. } => None,
        })
        .collect()
}

/// Bytes of the largest expert of `model` (gate, up and down together); 0 without experts.
pub fn expert_bytes(model: &Model) -> u64 {
    layout(model)
        .iter()
        .flatten()
        .map(|tiles| tiles.iter().map(|&(_, len)| len as u64).sum::<u64>())
        .max()
        .unwrap_or(0)
}

/// The size of each of the cache's buffers: the largest tile at any alignment.
fn buffer_bytes(layout: &Layout) -> u64 {
    let max_tile = layout
        .iter()
        .flatten()
        .flat_map(|tiles| tiles.iter().map(|&(_, len)| len))
        .max()
        .unwrap_or(1);
    buffer_size_for_tile(max_tile) as u64
}

/// Buffers of a cache under `budget`: as many as it holds, at most one for each tile of every
/// routed expert.
fn cache_buffers(model: &Model, layout: &Layout, budget: u64) -> usize {
    let n_expert = model.config.moe.map_or(0, |m| m.n_expert) as u64;
    let every_tile = layout.iter().flatten().count() as u64 * n_expert * TILES_PER_EXPERT as u64;
    (budget / buffer_bytes(layout)).min(every_tile) as usize
}

/// The RAM a cache of `model`'s routed experts under `budget` takes when it opens
/// ([`open_expert_cache`]): the host memory a load with that RAM budget must have room for.
pub fn ram_tier_bytes(model: &Model, budget: u64) -> u64 {
    let layout = layout(model);
    cache_buffers(model, &layout, budget) as u64 * buffer_bytes(&layout)
}

/// The smallest RAM budget a token's CPU experts need: the `k` experts of one layer are held
/// at once while they are computed, each in three buffers.
pub fn minimum_ram_budget(model: &Model) -> u64 {
    let k = model.config.moe.map_or(0, |m| m.n_expert_used) as u64;
    k * TILES_PER_EXPERT as u64 * buffer_bytes(&layout(model))
}

/// A cache of `model`'s routed experts in at most `budget` bytes of RAM, read from its file.
///
/// # Errors
/// [`StreamError::RamBelowMinimum`] when `budget` is under [`minimum_ram_budget`], or the
/// reader's errors opening the file.
pub fn open_expert_cache(
    model: &Model,
    budget: u64,
    policy: ReplacementPolicy,
) -> Result<ExpertCache, StreamError> {
    open_expert_cache_with(model, budget, policy, StorageFaults::from_env())
}

/// [`open_expert_cache`] whose reader injects `faults`.
pub(crate) fn open_expert_cache_with(
    model: &Model,
    budget: u64,
    policy: ReplacementPolicy,
    faults: StorageFaults,
) -> Result<ExpertCache, StreamError> {
    let layout = layout(model);
    let minimum = minimum_ram_budget(model);
    if budget < minimum {
        return Err(StreamError::RamBelowMinimum {
            budget,
            minimum,
            k: model.config.moe.map_or(0, |m| m.n_expert_used),
        });
    }
    let buffer = buffer_bytes(&layout);
    let buffers = cache_buffers(model, &layout, budget);
    let options = ReaderOptions {
        buffers,
        max_tile: buffer as usize - ALIGN,
        faults,
        ..ReaderOptions::default()
    };
    let path = model.file().path().ok_or(StreamError::NoFile)?;
    let reader = Arc::new(TileReader::open(path, &options)?);
    let locator = move |key: ExpertKey| -> Vec<Extent> {
        let tiles = layout[key.layer as usize].expect("experts of a MoE layer");
        tiles
            .iter()
            .map(|&(first, len)| Extent {
                offset: first + key.expert as u64 * len as u64,
                len,
            })
            .collect()
    };
    // Tile bytes of as many whole experts as the buffers hold.
    let capacity = (buffers / TILES_PER_EXPERT) as u64 * expert_bytes(model);
    Ok(ExpertCache::new(
        reader,
        Box::new(locator),
        capacity,
        policy,
    ))
}
