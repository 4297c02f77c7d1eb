//! Achieved bandwidth of the Vulkan matrix-vector kernels: GB/s over the bytes of the weights,
//! from GPU timestamps around one recording of many products. Each product reads another copy
//! of the matrix (at least 512 MiB of copies in all, ten times the L2 of an H100/H200), so the weights come from VRAM, not L2.
//!
//! With `tokens=T` (T > 1), each product is the batched kernel over T tokens (prompts): GB/s
//! counts the weights once per product, and the last column gives TFLOPS (2 · n_in · n_out · T
//! per product). It uses cooperative matrices where the device has them; `nocoop` measures the
//! f32 kernel instead, `staged` dequantizes each matrix to f16 first and multiplies that
//! (`Recorder::matvec_batch_rows_staged`, the dequantization included in the time), and `tile=DEPTH[xROWS[xTOKENS]],...` the inputs per step of its tile (32, 64 or 128), its rows and its tokens (64 or 128), each tile in turn.
//!
//! With `wg=THREADSxROWS,...`, each one-token product is measured with each of these workgroup
//! shapes of `matvec.comp` in turn (the matrices uploaded once), instead of the tuned shape.
//!
//! With `serial`, every product writes the same output, so each waits for the one before (a
//! barrier between them, as in a decode step) instead of overlapping with it: the time a product
//! takes in a chain of dependent ones. `fused=norm` takes an RMSNorm of the input in the product,
//! `fused=glu` reads a SwiGLU stack of 2 × N_OUT rows (gate and up) and writes N_OUT results,
//! `fused=add` adds into the output (`gpu::ops::Fused`). `types=Q4_0,Q8_0` limits the weight
//! types. `intdot` runs Q4_0 and Q8_0 products in integer dot products where the device has them
//! (inputs quantized to 8 bits in the kernel, as decode does by default).
//!
//! `cargo run --release -p spillway-bench --example vulkan_matvec [-- [tokens=T] [wg=64x4,...] [serial] [intdot] [fused=norm|glu|add] [types=...] N_IN N_OUT ...]`

use std::sync::Arc;

use spillway_daemon::gguf::GgmlType;
use spillway_daemon::gpu::ops::{Fused, GpuMatrix, MatVecShape};
use spillway_daemon::gpu::{
    Allocator, Buffer, Device, Instance, Kernels, MatMulTile, MemoryUse, Uploader,
};
use spillway_shaders::Op;

/// Bytes of `ty` rows whose scales are small and finite (the values do not matter here).
fn rows(ty: GgmlType, n_in: usize, n_out: usize) -> Vec<u8> {
    let rb = ty.row_bytes(n_in as u64).unwrap() as usize;
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut out: Vec<u8> = (0..rb * n_out)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 32) as u8
        })
        .collect();
    let bb = ty.block_bytes() as usize;
    let at = match ty {
        GgmlType::Q6K => 208,
        _ => 0,
    };
    let d = half::f16::from_f32(0.01).to_le_bytes();
    for b in out.chunks_exact_mut(bb) {
        b[at..at + 2].copy_from_slice(&d);
    }
    out
}

/// How the products are recorded (`serial`, `fused=`).
#[derive(Clone, Copy)]
struct Mode {
    serial: bool,
    norm: bool,
    glu: bool,
    add: bool,
    /// The batched products without cooperative matrices.
    nocoop: bool,
    /// The batched products dequantized to f16 first (`matvec_batch_rows_staged`).
    staged: bool,
    /// Q4_0 and Q8_0 products in integer dot products (`intdot`).
    int_dot: bool,
}

fn main() {
    let mut tokens = 1;
    let mut mode = Mode {
        serial: false,
        norm: false,
        glu: false,
        add: false,
        nocoop: false,
        staged: false,
        int_dot: false,
    };
    let mut tiles: Vec<Option<MatMulTile>> = vec![None];
    let mut types = vec![
        GgmlType::Q4_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
        GgmlType::Q8_0,
        GgmlType::F16,
    ];
    let mut wg: Vec<Option<MatVecShape>> = vec![None];
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter(|a| {
            if let Some(t) = a.strip_prefix("tokens=") {
                tokens = t.parse().unwrap();
                false
            } else if let Some(list) = a.strip_prefix("wg=") {
                wg = list
                    .split(',')
                    .map(|s| {
                        let (t, r) = s.split_once('x').expect("wg=THREADSxROWS,...");
                        Some(MatVecShape {
                            threads: t.parse().unwrap(),
                            rows: r.parse().unwrap(),
                        })
                    })
                    .collect();
                false
            } else if let Some(list) = a.strip_prefix("tile=") {
                tiles = list
                    .split(',')
                    .map(|t| {
                        let mut it = t.split('x').map(|n| n.parse::<u32>().unwrap());
                        let depth = it.next().unwrap();
                        let rows = it.next().unwrap_or(64);
                        let tokens = it.next().unwrap_or(64);
                        Some(MatMulTile {
                            depth,
                            rows,
                            tokens,
                        })
                    })
                    .collect();
                false
            } else if a == "staged" {
                mode.staged = true;
                false
            } else if a == "intdot" {
                mode.int_dot = true;
                false
            } else if a == "nocoop" {
                mode.nocoop = true;
                false
            } else if a == "serial" {
                mode.serial = true;
                false
            } else if let Some(f) = a.strip_prefix("fused=") {
                match f {
                    "norm" => mode.norm = true,
                    "glu" => mode.glu = true,
                    "add" => mode.add = true,
                    other => panic!("fused={other}: norm, glu or add"),
                }
                false
            } else if let Some(list) = a.strip_prefix("types=") {
                types = list
                    .split(',')
                    .map(|t| {
                        *types
                            .iter()
                            .find(|ty| ty.name().eq_ignore_ascii_case(t))
                            .unwrap_or_else(|| panic!("types={t}: Q4_0, Q4_K, Q6_K, Q8_0 or F16"))
                    })
                    .collect();
                false
            } else {
                true
            }
        })
        .map(|a| a.parse().unwrap())
        .collect();
    let shapes: Vec<(usize, usize)> = if args.is_empty() {
        vec![(4096, 4096), (4096, 14336), (14336, 4096)]
    } else {
        args.chunks_exact(2).map(|c| (c[0], c[1])).collect()
    };
    let device = Device::open(Instance::new().unwrap(), None).unwrap();
    println!("device: {}", device.info().name);
    println!(
        "| weights | n_in × n_out | tokens | workgroup | matrix MiB | copies | GPU µs / product | GB/s | TFLOPS |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for (n_in, n_out) in shapes {
        for &ty in &types {
            for &tile in &tiles {
                measure(&device, ty, (n_in, n_out), (tokens, mode, tile), &wg);
            }
        }
    }
}

fn measure(
    device: &Arc<Device>,
    ty: GgmlType,
    (n_in, n_out): (usize, usize),
    (tokens, mode, tile): (usize, Mode, Option<MatMulTile>),
    shapes: &[Option<MatVecShape>],
) {
    let alloc = Allocator::new(device, None);
    let kernels = Kernels::with_int_dot(device, (true, !mode.nocoop), mode.int_dot);
    if let Err(e) = kernels.set_matmul_tile(tile) {
        println!(
            "| {} | {n_in} × {n_out} | {tokens} | refused: {e} | | | | | |",
            ty.name()
        );
        return;
    }
    // A GLU stack holds the gate and the up matrix.
    let data = rows(ty, n_in, if mode.glu { 2 * n_out } else { n_out });
    let n_rows = data.len() / ty.row_bytes(n_in as u64).unwrap() as usize;
    let copies = (512usize << 20).div_ceil(data.len()).clamp(2, 256);
    let mut up = Uploader::new(&alloc, 64 << 20).unwrap();
    let mats: Vec<GpuMatrix> = (0..copies)
        .map(|_| GpuMatrix::upload(&alloc, &mut up, ty, n_in, n_rows, &data).unwrap())
        .collect();
    up.flush().unwrap();
    let t = tokens as u64;
    let x = Buffer::new_in(&alloc, t * n_in as u64 * 4, MemoryUse::DeviceLocal).unwrap();
    let norm_w = Buffer::new_in(&alloc, n_in as u64 * 4, MemoryUse::DeviceLocal).unwrap();
    let outputs = if mode.serial { 1 } else { copies };
    let ys: Vec<Buffer> = (0..outputs)
        .map(|_| Buffer::new_in(&alloc, t * n_out as u64 * 4, MemoryUse::DeviceLocal).unwrap())
        .collect();
    let scratch_bytes = if mode.staged { n_rows * n_in * 2 } else { 4 };
    let scratch = Buffer::new_in(&alloc, scratch_bytes as u64, MemoryUse::DeviceLocal).unwrap();
    let fused = Fused {
        accumulate: mode.add,
        norm: mode.norm.then_some((&norm_w, 1e-5)),
        glu: mode.glu,
        ..Fused::default()
    };
    let run = || {
        kernels
            .record_timed(|r| {
                for (m, y) in mats.iter().zip(ys.iter().cycle()) {
                    if tokens > 1 {
                        if mode.staged {
                            r.matvec_batch_rows_staged(m, 0, n_out, &x, y, tokens, &scratch)?;
                        } else {
                            r.matvec_batch(m, &x, y, tokens)?;
                        }
                    } else {
                        r.matvec_fused(m, &x, y, fused)?;
                    }
                }
                Ok(())
            })
            .unwrap()
    };
    for &shape in shapes {
        kernels.set_matvec_shape(shape).unwrap();
        run(); // pipelines, caches, clocks
        let best = (0..5)
            .filter_map(|_| run().gpu_ns)
            .min()
            .expect("the queue has timestamps");
        let per = best as f64 / copies as f64;
        let gbs = data.len() as f64 / per;
        let wtype = spillway_daemon::gpu::ops::weight_type(ty).unwrap();
        let used = match shape {
            Some(shape) => shape,
            None => kernels.matvec_shape_for(
                (Op::MatVec, wtype),
                (n_out, if mode.glu { 2 } else { 1 }),
                mode.norm,
                n_in,
            ),
        };
        let label = match (tokens, shape) {
            (1, None) => format!(
                "{}x{} (tuned){}{}{}{}",
                used.threads,
                used.rows,
                if mode.serial { " serial" } else { "" },
                if mode.norm { " norm" } else { "" },
                if mode.glu { " glu" } else { "" },
                if mode.add { " add" } else { "" }
            ),
            (1, Some(_)) => format!("{}x{}", used.threads, used.rows),
            _ if kernels.uses_coopmat() => {
                let t = kernels.matmul_tile();
                let how = if mode.staged { "staged f16" } else { "coopmat" };
                format!(
                    "batch, {how}, {} rows × {} tokens, {} deep",
                    t.rows, t.tokens, t.depth
                )
            }
            _ => "batch".into(),
        };
        let tflops = 2.0 * (n_in * n_out * tokens) as f64 / per / 1e3;
        println!(
            "| {} | {n_in} × {n_out} | {tokens} | {label} | {:.1} | {copies} | {:.1} | {:.0} | {:.1} |",
            ty.name(),
            data.len() as f64 / (1 << 20) as f64,
            per / 1e3,
            gbs,
            tflops
        );
    }
}
