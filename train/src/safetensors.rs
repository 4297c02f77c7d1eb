//! A reader for the safetensors files `train.py` writes: an 8-byte little-endian header length,
//! a JSON header naming each tensor's dtype, shape and byte range, then the data. Only `F32`
//! tensors are accepted; shapes are row-major (PyTorch's `[out, in]`).

use std::collections::HashMap;
use std::path::Path;

use anyhow::{bail, ensure, Context};

pub struct Tensor {
    pub shape: Vec<u64>,
    pub data: Vec<f32>,
}

/// Every tensor of the file, by name.
pub fn read(path: &Path) -> anyhow::Result<HashMap<String, Tensor>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    ensure!(
        bytes.len() >= 8,
        "{}: too short for a header",
        path.display()
    );
    let header_len = u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let data_start = 8usize
        .checked_add(header_len)
        .filter(|&e| e <= bytes.len())
        .context("header runs past the end of the file")?;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..data_start]).context("parsing the header")?;
    let data = &bytes[data_start..];
    let mut out = HashMap::new();
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info["dtype"].as_str().unwrap_or_default();
        if dtype != "F32" {
            bail!("{name}: dtype {dtype:?}, only F32 is read");
        }
        let shape: Vec<u64> = serde_json::from_value(info["shape"].clone())
            .with_context(|| format!("{name}: shape"))?;
        let range: [usize; 2] = serde_json::from_value(info["data_offsets"].clone())
            .with_context(|| format!("{name}: data_offsets"))?;
        let n: u64 = shape.iter().product();
        ensure!(
            range[0] <= range[1] && range[1] <= data.len() && (range[1] - range[0]) as u64 == n * 4,
            "{name}: byte range {range:?} does not hold {n} f32 values"
        );
        let values = data[range[0]..range[1]]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        out.insert(
            name,
            Tensor {
                shape,
                data: values,
            },
        );
    }
    Ok(out)
}
