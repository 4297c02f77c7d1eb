//! The batched matrix product for prompts (`Recorder::matvec_batch`) against the one-token
//! product (`Recorder::matvec`, itself checked against the CPU in `vulkan_ops.rs`), for every
//! weight type, token counts around the kernel's tile of 64, a row range of a stack, a
//! matrix split over several bindings, every tile of the cooperative-matrix kernel, and several
//! experts' products in one dispatch (`matvec_batch_grouped`) with their sums into the tokens
//! (`gather_add`). On whatever Vulkan device the machine has (lavapipe in
//! CI); without one these tests skip, unless `SPILLWAY_REQUIRE_VULKAN` is set.

use std::sync::Arc;

use spillway_daemon::calibrate::random_matrix;
use spillway_daemon::gguf::GgmlType;
use spillway_daemon::gpu::ops::GpuMatrix;
use spillway_daemon::gpu::ops_q8::q8_bytes;
use spillway_daemon::gpu::{Allocator, Buffer, Device, Kernels, MatMulTile, MemoryUse, Uploader};

/// Every weight type the kernels read.
const TYPES: [GgmlType; 6] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4K,
    GgmlType::Q6K,
];

fn device() -> Option<Arc<Device>> {
    spillway_daemon::gpu::device_or_skip()
}

fn inputs(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| (((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 2001) as f32 / 1000.0 - 1.0)
        .collect()
}

struct Setup {
    allocator: Arc<Allocator>,
    kernels: Arc<Kernels>,
    w: GpuMatrix,
}

fn setup(dev: &Arc<Device>, ty: GgmlType, n_in: usize, n_out: usize) -> Setup {
    let allocator = Allocator::new(dev, None);
    let mut up = Uploader::new(&allocator, 1 << 20).unwrap();
    let data = random_matrix(ty, n_in as u64, n_out as u64).unwrap();
    let w = GpuMatrix::upload(&allocator, &mut up, ty, n_in, n_out, &data).unwrap();
    up.flush().unwrap();
    Setup {
        kernels: Kernels::new(dev),
        allocator,
        w,
    }
}

/// Kernels with integer dots or not, and with `q8` (inputs, vectors) a scratch where the
/// integer-dot products' inputs are quantized before them (`Kernels::set_q8_scratch`).
fn kernels(s: &Setup, int_dot: bool, q8: Option<(usize, usize)>) -> Arc<Kernels> {
    let k = Kernels::with_int_dot(s.allocator.device(), (true, true), int_dot);
    if let Some((n_in, n_vec)) = q8 {
        let bytes = q8_bytes(n_in, n_vec);
        let b = Buffer::new_in(&s.allocator, bytes, MemoryUse::DeviceLocal).unwrap();
        k.set_q8_scratch(Some(Arc::new(b)));
    }
    k
}

/// f32 dots, integer dots quantizing in the product, integer dots over inputs quantized first.
const DOTS: [(bool, bool); 3] = [(false, false), (true, false), (true, true)];

fn host(s: &Setup, values: &[f32]) -> Buffer {
    let mut b =
        Buffer::new_in(&s.allocator, (values.len() * 4) as u64, MemoryUse::Staging).unwrap();
    b.write_f32(values);
    b
}

/// Each token's product alone, through the one-token kernel.
fn one_by_one(s: &Setup, xs: &[f32], n_tok: usize) -> Vec<f32> {
    let (n_in, n_out) = (s.w.n_in, s.w.n_out);
    let mut out = Vec::with_capacity(n_tok * n_out);
    for t in 0..n_tok {
        let x = host(s, &xs[t * n_in..(t + 1) * n_in]);
        let y = host(s, &vec![0.0; n_out]);
        s.kernels.record(|r| r.matvec(&s.w, &x, &y)).unwrap();
        out.extend(y.read_f32(n_out));
    }
    out
}

/// Equal up to float reassociation: within 1e-5 of the largest result. With cooperative
/// matrices (on devices that have them) the weights and inputs are rounded to f16 first, which
/// moves each result by about 2^-11 of the sum of its terms' magnitudes: within 1e-2.
fn assert_close(s: &Setup, got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let tolerance = if s.kernels.uses_coopmat() { 1e-2 } else { 1e-5 };
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tolerance * scale,
            "{what}: [{i}] {g} vs {w}"
        );
    }
}

fn check(ty: GgmlType) {
    let Some(dev) = device() else { return };
    let (n_in, n_out) = (512, 67);
    let s = setup(&dev, ty, n_in, n_out);
    for n_tok in [1, 7, 64, 65, 130] {
        let xs = inputs(n_tok * n_in, n_tok as u32);
        let want = one_by_one(&s, &xs, n_tok);
        let x = host(&s, &xs);
        let y = host(&s, &vec![f32::NAN; n_tok * n_out]);
        s.kernels
            .record(|r| r.matvec_batch(&s.w, &x, &y, n_tok))
            .unwrap();
        assert_close(
            &s,
            &y.read_f32(n_tok * n_out),
            &want,
            &format!("{ty} × {n_tok} tokens"),
        );
    }
}

#[test]
fn every_tile_of_the_cooperative_matrix_product_gives_the_same_products() {
    // Rows and tokens past the last whole tile, depths that do and do not divide the row, each
    // tile the device's shared memory holds. Where the device has no cooperative matrices the
    // tile is not used and this checks the f32 kernel.
    let Some(dev) = device() else { return };
    for ty in [GgmlType::Q4_0, GgmlType::Q4K] {
        let (n_in, n_out, n_tok) = (768, 200, 70);
        let s = setup(&dev, ty, n_in, n_out);
        let xs = inputs(n_tok * n_in, 5);
        let want = one_by_one(&s, &xs, n_tok);
        let x = host(&s, &xs);
        let before = inputs(n_tok * n_out, 3);
        let want_added: Vec<f32> = before.iter().zip(&want).map(|(b, p)| b + p).collect();
        for tokens in [64, 128] {
            for rows in [64, 128] {
                for depth in [32, 64, 128] {
                    let tile = MatMulTile {
                        depth,
                        rows,
                        tokens,
                    };
                    if tile.check_on(&dev).is_err() {
                        // Over the device's shared memory: refused, never run.
                        assert!(s.kernels.set_matmul_tile(Some(tile)).is_err(), "{tile:?}");
                        continue;
                    }
                    s.kernels.set_matmul_tile(Some(tile)).unwrap();
                    let y = host(&s, &vec![f32::NAN; n_tok * n_out]);
                    s.kernels
                        .record(|r| r.matvec_batch(&s.w, &x, &y, n_tok))
                        .unwrap();
                    let got = y.read_f32(n_tok * n_out);
                    assert_close(&s, &got, &want, &format!("{ty} {tile:?}"));
                    // Added to what Y held: whole blocks and the blocks at the edge.
                    let y = host(&s, &before);
                    s.kernels
                        .record(|r| r.matvec_batch_add(&s.w, &x, &y, n_tok))
                        .unwrap();
                    let got = y.read_f32(n_tok * n_out);
                    assert_close(&s, &got, &want_added, &format!("{ty} {tile:?}, added"));
                }
            }
        }
        if s.kernels.uses_coopmat() {
            MatMulTile::TUNED.check_on(&dev).unwrap();
        }
        for bad in [
            (64, 32, 64),
            (48, 64, 64),
            (64, 256, 64),
            (64, 64, 32),
            (64, 64, 96),
        ] {
            let tile = MatMulTile {
                depth: bad.0,
                rows: bad.1,
                tokens: bad.2,
            };
            assert!(s.kernels.set_matmul_tile(Some(tile)).is_err(), "{tile:?}");
        }
    }
}

#[test]
fn batched_f32_products_equal_one_token_products() {
    check(GgmlType::F32);
}

#[test]
fn batched_f16_products_equal_one_token_products() {
    check(GgmlType::F16);
}

#[test]
fn batched_q8_0_products_equal_one_token_products() {
    check(GgmlType::Q8_0);
}

#[test]
fn batched_q4_0_products_equal_one_token_products() {
    check(GgmlType::Q4_0);
}

#[test]
fn batched_q4_k_products_equal_one_token_products() {
    check(GgmlType::Q4K);
}

#[test]
fn batched_q6_k_products_equal_one_token_products() {
    check(GgmlType::Q6K);
}

#[test]
fn a_row_range_and_a_split_binding_give_the_same_rows() {
    // 11 tokens: the tiled kernel.
    check_row_range_and_split(11, assert_close);
}

/// Rows 40..72 of a Q8_0 matrix only (as one expert of a stack), then the whole matrix split
/// over several bindings, for `n_tok` tokens, each compared with the one-token products by
/// `compare`; and buffers too small for the tokens refused.
fn check_row_range_and_split(n_tok: usize, compare: impl Fn(&Setup, &[f32], &[f32], &str)) {
    let Some(dev) = device() else { return };
    let (n_in, n_out) = (256, 96);
    let s = setup(&dev, GgmlType::Q8_0, n_in, n_out);
    let xs = inputs(n_tok * n_in, 5);
    let whole = one_by_one(&s, &xs, n_tok);
    let x = host(&s, &xs);

    let (first, n) = (40, 32);
    let y = host(&s, &vec![f32::NAN; n_tok * n]);
    s.kernels
        .record(|r| r.matvec_batch_rows(&s.w, first, n, &x, &y, n_tok))
        .unwrap();
    let want: Vec<f32> = (0..n_tok)
        .flat_map(|t| whole[t * n_out + first..t * n_out + first + n].to_vec())
        .collect();
    compare(&s, &y.read_f32(n_tok * n), &want, "rows 40..72");

    // A binding limit of a third of the matrix (still above the input's size) splits it into
    // several dispatches.
    let limit = 12_000;
    assert!(limit < 96 * s.w.row_bytes / 2 && limit > x.size());
    let y = host(&s, &vec![f32::NAN; n_tok * n_out]);
    s.kernels
        .record_with_max_range(limit, |r| r.matvec_batch(&s.w, &x, &y, n_tok))
        .unwrap();
    compare(&s, &y.read_f32(n_tok * n_out), &whole, "split binding");

    // Buffers too small for the tokens are refused, not overrun.
    let small = host(&s, &vec![0.0; n_out]);
    assert!(s
        .kernels
        .record(|r| r.matvec_batch(&s.w, &x, &small, n_tok))
        .is_err());

    // With the several-column kernel off, the same tokens take the tiled kernel: the same
    // products up to the order of their sums.
    s.kernels.set_matvec_cols(0);
    let y = host(&s, &vec![f32::NAN; n_tok * n_out]);
    s.kernels
        .record(|r| r.matvec_batch(&s.w, &x, &y, n_tok))
        .unwrap();
    assert_close(&s, &y.read_f32(n_tok * n_out), &whole, "tiled");
}

#[test]
fn an_added_product_is_added_to_what_the_output_held() {
    let Some(dev) = device() else { return };
    let (n_in, n_out, n_tok) = (256, 70, 66);
    let s = setup(&dev, GgmlType::Q4_0, n_in, n_out);
    let xs = inputs(n_tok * n_in, 9);
    let product = one_by_one(&s, &xs, n_tok);
    let before = inputs(n_tok * n_out, 3);
    let x = host(&s, &xs);
    let y = host(&s, &before);
    s.kernels
        .record(|r| r.matvec_batch_add(&s.w, &x, &y, n_tok))
        .unwrap();
    let want: Vec<f32> = before.iter().zip(&product).map(|(b, p)| b + p).collect();
    assert_close(&s, &y.read_f32(n_tok * n_out), &want, "y + W·x");
}

#[test]
fn a_repeated_addend_is_added_to_every_token() {
    let Some(dev) = device() else { return };
    let s = setup(&dev, GgmlType::Q8_0, 32, 1);
    let (width, n_tok) = (96, 5);
    let a0 = inputs(width * n_tok, 1);
    let bias = inputs(width, 2);
    let a = host(&s, &a0);
    let b = host(&s, &bias);
    s.kernels
        .record(|r| r.add_repeated(&a, &b, (width * n_tok) as u32, width as u32))
        .unwrap();
    let want: Vec<f32> = a0
        .iter()
        .enumerate()
        .map(|(i, v)| v + bias[i % width])
        .collect();
    assert_eq!(a.read_f32(width * n_tok), want);
    // An addend longer than its buffer is refused.
    assert!(s
        .kernels
        .record(|r| r.add_repeated(&a, &b, 10, width as u32 + 1))
        .is_err());
}

#[test]
fn rows_dequantized_to_f16_are_the_cpu_rows_rounded() {
    let Some(dev) = device() else { return };
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q6K,
        GgmlType::F16,
    ] {
        let (n_in, n_out) = (512, 40);
        let data = random_matrix(ty, n_in as u64, n_out as u64).unwrap();
        let s = setup(&dev, ty, n_in, n_out);
        // Rows 5..30: not the first, not the last.
        let (first, n) = (5, 25);
        let dst = host(&s, &vec![0.0; n * n_in / 2]);
        s.kernels
            .record(|r| r.dequant_f16_rows(&s.w, first, n, &dst))
            .unwrap();
        let got: Vec<u16> = dst
            .read_f32(n * n_in / 2)
            .iter()
            .flat_map(|w| {
                let b = w.to_bits();
                [b as u16, (b >> 16) as u16]
            })
            .collect();
        let rb = s.w.row_bytes as usize;
        let mut row = vec![0f32; n_in];
        for r in 0..n {
            let at = (first + r) * rb;
            spillway_daemon::quant::dequantize_row(ty, &data[at..at + rb], &mut row).unwrap();
            for (i, v) in row.iter().enumerate() {
                let want = spillway_daemon::quant::fp32_to_fp16(*v);
                assert_eq!(got[r * n_in + i], want, "{ty} row {} [{i}]", first + r);
            }
        }
    }
}

#[test]
fn staged_products_equal_one_token_products() {
    // Through f16 where the device has cooperative matrices; the direct product elsewhere.
    let Some(dev) = device() else { return };
    for ty in [GgmlType::Q4_0, GgmlType::Q4K, GgmlType::Q6K] {
        let (n_in, n_out, n_tok) = (512, 200, 70);
        let s = setup(&dev, ty, n_in, n_out);
        let xs = inputs(n_tok * n_in, 4);
        let whole = one_by_one(&s, &xs, n_tok);
        let x = host(&s, &xs);
        // A scratch of 64 rows: the 150 rows 30..180 go through it in three pieces.
        let scratch = host(&s, &vec![0.0; 64 * n_in / 2]);
        let (first, n) = (30, 150);
        let y = host(&s, &vec![f32::NAN; n_tok * n]);
        s.kernels
            .record(|r| r.matvec_batch_rows_staged(&s.w, first, n, &x, &y, n_tok, &scratch))
            .unwrap();
        let want: Vec<f32> = (0..n_tok)
            .flat_map(|t| whole[t * n_out + first..t * n_out + first + n].to_vec())
            .collect();
        assert_close(&s, &y.read_f32(n_tok * n), &want, &format!("{ty} staged"));
    }
}

#[test]
fn scattered_rows_are_added_to_their_tokens_with_their_weights() {
    let Some(dev) = device() else { return };
    let s = setup(&dev, GgmlType::Q8_0, 32, 1);
    let (width, n_tok) = (300, 6);
    let x0 = inputs(width * n_tok, 1);
    let rows = inputs(width * 3, 2);
    // Entries 1..4 of the route: tokens 4, 0, 2 with weights 0.5, -2, 0.25; weights from word 8.
    let mut words = vec![9u32, 4, 0, 2, 9, 9, 9, 9];
    words.extend([0.0f32, 0.5, -2.0, 0.25].map(f32::to_bits));
    words.extend([0u32; 4]);
    let x = host(&s, &x0);
    let y = host(&s, &rows);
    let route = host(
        &s,
        &words.iter().map(|w| f32::from_bits(*w)).collect::<Vec<_>>(),
    );
    s.kernels
        .record(|r| r.scatter_add(&x, &y, &route, (1, 3, 8), width as u32))
        .unwrap();
    let mut want = x0.clone();
    for (i, (t, w)) in [(4, 0.5f32), (0, -2.0), (2, 0.25)].into_iter().enumerate() {
        for k in 0..width {
            want[t * width + k] += w * rows[i * width + k];
        }
    }
    // A driver may fuse the multiply and the add: equal within a rounding.
    for (g, w) in x.read_f32(width * n_tok).iter().zip(&want) {
        assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "{g} vs {w}");
    }
    // Weights that would overlap the ids are refused.
    assert!(s
        .kernels
        .record(|r| r.scatter_add(&x, &y, &route, (1, 3, 3), width as u32))
        .is_err());
}

/// A host-visible buffer of words.
fn words(s: &Setup, w: &[u32]) -> Buffer {
    let mut b = Buffer::new_in(&s.allocator, (w.len() * 4) as u64, MemoryUse::Staging).unwrap();
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    b.write(&bytes);
    b
}

#[test]
fn grouped_products_equal_each_experts_rows_of_the_whole_product() {
    let Some(dev) = device() else { return };
    // Three experts of 70 rows each; runs over rows of x with a gap (rows 70..80 belong to
    // no run and must stay untouched), runs longer and shorter than a tile of tokens.
    let (n_in, rows, span) = (256, 70, 150);
    let runs = [(2u32, 0u32, 70u32), (0, 80, 5), (1, 85, 65)];
    for ty in [GgmlType::Q4_0, GgmlType::Q4K, GgmlType::Q6K] {
        let s = setup(&dev, ty, n_in, 3 * rows);
        let xs = inputs(span * n_in, 11);
        let x = host(&s, &xs);
        let whole = host(&s, &vec![0.0; span * 3 * rows]);
        s.kernels
            .record(|r| r.matvec_batch(&s.w, &x, &whole, span))
            .unwrap();
        let whole = whole.read_f32(span * 3 * rows);
        // Runs from word 5 of the buffer.
        let mut ws = vec![0u32; 5];
        for &(slot, first, count) in &runs {
            ws.extend([slot, first, count]);
        }
        let runs_buf = words(&s, &ws);
        let y = host(&s, &vec![f32::NAN; span * rows]);
        s.kernels
            .record(|r| {
                r.matvec_batch_grouped(&s.w, (0, rows), &x, &y, (&runs_buf, 5, 3), (span, 70))
            })
            .unwrap();
        let got = y.read_f32(span * rows);
        for &(slot, first, count) in &runs {
            let (slot, first, count) = (slot as usize, first as usize, count as usize);
            let want: Vec<f32> = (first..first + count)
                .flat_map(|t| {
                    let at = t * 3 * rows + slot * rows;
                    whole[at..at + rows].to_vec()
                })
                .collect();
            let part = &got[first * rows..(first + count) * rows];
            assert_close(&s, part, &want, &format!("{ty} slot {slot}"));
        }
        assert!(
            got[70 * rows..80 * rows].iter().all(|v| v.is_nan()),
            "{ty}: the gap"
        );
        // A run table past its buffer is refused.
        assert!(s
            .kernels
            .record(|r| r.matvec_batch_grouped(
                &s.w,
                (0, rows),
                &x,
                &y,
                (&runs_buf, 6, 3),
                (span, 70)
            ))
            .is_err());
    }
}

#[test]
fn gathered_sums_add_each_tokens_entries_in_order() {
    let Some(dev) = device() else { return };
    let s = setup(&dev, GgmlType::Q8_0, 32, 1);
    let n = 300; // over one workgroup of 256
    let x0 = inputs(4 * n, 1);
    let ys = inputs(5 * n, 2);
    let x = host(&s, &x0);
    let y = host(&s, &ys);
    // Entries 0..5 of the group from entry 2 of the route; weights from word 10; the list from
    // word 20: tokens 0, 2, 3 with entries [0, 3], [1], [2, 4]. Token 1 has none.
    let weights = [0.5f32, -1.0, 2.0, 0.25, 1.5];
    let mut w = vec![0u32; 20];
    for (i, v) in weights.iter().enumerate() {
        w[10 + 2 + i] = v.to_bits();
    }
    w.extend([0, 2, 3, 0, 2, 3, 5, 0, 3, 1, 2, 4]);
    let route = words(&s, &w);
    s.kernels
        .record(|r| r.gather_add(&x, &y, &route, (2, 10, 20, 3), n as u32))
        .unwrap();
    let got = x.read_f32(4 * n);
    let lists: [(usize, &[usize]); 3] = [(0, &[0, 3]), (2, &[1]), (3, &[2, 4])];
    let mut want = x0.clone();
    for (t, entries) in lists {
        for c in 0..n {
            let mut acc = want[t * n + c];
            for &e in entries {
                acc += weights[e] * ys[e * n + c];
            }
            want[t * n + c] = acc;
        }
    }
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-6 * w.abs().max(1.0), "[{i}] {g} vs {w}");
    }
}

/// Products over a few tokens (2 to 8) take the several-column matrix-vector kernel
/// (`matvec.comp` with COLS): each token's results are its one-token product's bit for bit
/// (the same sums in the same order), for every weight type, with f32 and with integer dot
/// products (quantizing the inputs in the product, or reading them quantized first), every
/// column count (rows a workgroup shrink as columns grow), added to what the
/// output held, over a row range and over rows split between bindings.
#[test]
fn a_few_tokens_products_are_each_tokens_own_bit_for_bit() {
    let Some(dev) = device() else { return };
    let (n_in, n_out) = (512, 67);
    for ty in TYPES {
        for (int_dot, q8) in DOTS {
            let mut s = setup(&dev, ty, n_in, n_out);
            // The one-token products quantize their inputs themselves: with `q8` the columns'
            // inputs quantized first must give the same bits.
            s.kernels = kernels(&s, int_dot, None);
            let batched = kernels(&s, int_dot, q8.then_some((n_in, 8)));
            assert_eq!(batched.matvec_cols(), 8);
            for n_tok in [2, 3, 5, 8] {
                let what = format!("{ty} × {n_tok} tokens, integer dots {int_dot}, q8 {q8}");
                let xs = inputs(n_tok * n_in, n_tok as u32 + 40);
                let want = one_by_one(&s, &xs, n_tok);
                let x = host(&s, &xs);
                let y = host(&s, &vec![f32::NAN; n_tok * n_out]);
                batched
                    .record(|r| r.matvec_batch(&s.w, &x, &y, n_tok))
                    .unwrap();
                assert_eq!(y.read_f32(n_tok * n_out), want, "{what}");

                let before = inputs(n_tok * n_out, 3);
                let y = host(&s, &before);
                batched
                    .record(|r| r.matvec_batch_add(&s.w, &x, &y, n_tok))
                    .unwrap();
                let added: Vec<f32> = before.iter().zip(&want).map(|(b, p)| b + p).collect();
                assert_eq!(y.read_f32(n_tok * n_out), added, "{what}, added");
            }
        }
    }
    // A row range, and rows split between bindings: 6 tokens, exactly.
    check_row_range_and_split(6, |_, got, want, what| assert_eq!(got, want, "{what}"));
}

/// Experts' runs of at most 8 rows (a batched decode step's MoE layer) take the several-column
/// matrix-vector kernel (`matvec.comp` with COLS and RUNS): each row's results are its
/// one-token product with its expert's rows bit for bit, for every weight type, with f32 and
/// integer dots (over inputs quantized in the product or first); a run of no rows and the rows between runs are left alone.
#[test]
fn a_few_rows_an_expert_are_each_rows_own_product_bit_for_bit() {
    let Some(dev) = device() else { return };
    let (n_in, rows, span) = (256, 40, 16);
    // Slot, first row, rows: one of 8 rows (the most), one of 1, one of none, rows 9..12 in
    // no run.
    let runs = [(2u32, 0u32, 8u32), (0, 8, 1), (1, 9, 0), (1, 12, 4)];
    let max_count = 8;
    for ty in TYPES {
        for (int_dot, q8) in DOTS {
            let mut s = setup(&dev, ty, n_in, 3 * rows);
            s.kernels = kernels(&s, int_dot, None);
            let xs = inputs(span * n_in, 17);
            let whole = one_by_one(&s, &xs, span);
            s.kernels = kernels(&s, int_dot, q8.then_some((n_in, span)));
            let x = host(&s, &xs);
            let mut ws = vec![0u32; 3];
            for &(slot, first, count) in &runs {
                ws.extend([slot, first, count]);
            }
            let runs_buf = words(&s, &ws);
            let y = host(&s, &vec![f32::NAN; span * rows]);
            let table = (&runs_buf, 3, runs.len() as u32);
            s.kernels
                .record(|r| {
                    r.matvec_batch_grouped(&s.w, (0, rows), &x, &y, table, (span, max_count))
                })
                .unwrap();
            let got = y.read_f32(span * rows);
            let what = format!("{ty}, integer dots {int_dot}, q8 {q8}");
            for &(slot, first, count) in &runs {
                let (slot, first, count) = (slot as usize, first as usize, count as usize);
                for t in first..first + count {
                    let at = t * 3 * rows + slot * rows;
                    let part = &got[t * rows..(t + 1) * rows];
                    assert_eq!(part, &whole[at..at + rows], "{what}: slot {slot} row {t}");
                }
            }
            assert!(
                got[9 * rows..12 * rows].iter().all(|v| v.is_nan()),
                "{what}: rows in no run"
            );
        }
    }
}
