//! Chains of command buffers that the host releases one part at a time (`gpu::chain`): what
//! the host writes before releasing a part is what that part reads, whether the parts are
//! recorded for one run or kept and submitted again for every run, with either handoff. Runs
//! on whatever Vulkan device the machine has (lavapipe in CI) and skips without one, unless
//! `SPILLWAY_REQUIRE_VULKAN` is set.

#[path = "common/chain_device.rs"]
mod chain_device;
use chain_device::chain_device;

use spillway_daemon::gpu::chain::Handoff;
use spillway_daemon::gpu::{Buffer, GpuError, Kernels, Recorder};

const N: usize = 64;
const PARTS: usize = 6;

/// What the host writes before part `part` of run `run`: small integers, so every sum is exact.
fn input(run: usize, part: usize) -> Vec<f32> {
    (0..N)
        .map(|i| ((run * 7 + part * 3 + i) % 11) as f32)
        .collect()
}

/// Each part adds the input to `x` twice: `x = Σ_parts 2 · input`.
fn record_part(rec: &mut Recorder<'_>, x: &Buffer, input: &Buffer) -> Result<(), GpuError> {
    rec.scale_add(x, input, 1.0, N as u32)?;
    rec.scale_add(x, input, 1.0, N as u32)
}

fn want(run: usize) -> Vec<f32> {
    let mut x = vec![0.0f32; N];
    for part in 0..PARTS {
        for (x, v) in x.iter_mut().zip(input(run, part)) {
            *x += 2.0 * v;
        }
    }
    x
}

#[test]
fn a_kept_chain_reads_what_the_host_wrote_before_each_part_in_every_run() {
    let Some(dev) = chain_device() else { return };
    let kernels = Kernels::new(&dev);
    let mut x = Buffer::new_host_visible(&dev, (N * 4) as u64).unwrap();
    let mut inp = Buffer::new_host_visible(&dev, (N * 4) as u64).unwrap();
    for handoff in [Handoff::Semaphores, Handoff::Events] {
        let mut kept = kernels
            .record_chain(handoff, PARTS, |_, rec| record_part(rec, &x, &inp))
            .unwrap();
        assert_eq!(kept.stats().submits as usize, PARTS, "{handoff:?}");
        assert_eq!(kept.stats().dispatches as usize, 2 * PARTS, "{handoff:?}");
        for run in 0..4 {
            x.write_f32(&[0.0; N]);
            inp.write_f32(&input(run, 0));
            let mut chain = kept.start(None).unwrap();
            for part in 1..PARTS {
                chain.wait(part - 1).unwrap();
                inp.write_f32(&input(run, part));
                chain.release(part).unwrap();
            }
            chain.finish().unwrap();
            drop(chain);
            assert_eq!(x.read_f32(N), want(run), "{handoff:?}, run {run}");
        }
        // A run dropped after its second part releases the rest (which read the last input
        // written) and leaves the recording ready for the next.
        x.write_f32(&[0.0; N]);
        inp.write_f32(&input(9, 0));
        let mut chain = kept.start(None).unwrap();
        chain.wait(0).unwrap();
        inp.write_f32(&input(9, 1));
        chain.release(1).unwrap();
        drop(chain);
        let mut early = vec![0.0f32; N];
        for (i, e) in early.iter_mut().enumerate() {
            *e = 2.0 * input(9, 0)[i] + 2.0 * (PARTS - 1) as f32 * input(9, 1)[i];
        }
        assert_eq!(x.read_f32(N), early, "{handoff:?}, dropped run");
        x.write_f32(&[0.0; N]);
        inp.write_f32(&input(5, 0));
        let mut chain = kept.start(None).unwrap();
        for part in 1..PARTS {
            chain.wait(part - 1).unwrap();
            inp.write_f32(&input(5, part));
            chain.release(part).unwrap();
        }
        chain.finish().unwrap();
        drop(chain);
        assert_eq!(x.read_f32(N), want(5), "{handoff:?}, after a dropped run");
    }
}

#[test]
fn a_chain_recorded_for_one_run_reads_what_the_host_wrote() {
    let Some(dev) = chain_device() else { return };
    let kernels = Kernels::new(&dev);
    let mut x = Buffer::new_host_visible(&dev, (N * 4) as u64).unwrap();
    let mut inp = Buffer::new_host_visible(&dev, (N * 4) as u64).unwrap();
    for handoff in [Handoff::Semaphores, Handoff::Events] {
        x.write_f32(&[0.0; N]);
        inp.write_f32(&input(3, 0));
        let (mut run, stats) = kernels
            .start_chain(handoff, PARTS, |_, rec| record_part(rec, &x, &inp))
            .unwrap();
        assert_eq!(stats.submits as usize, PARTS);
        for part in 1..PARTS {
            run.chain.wait(part - 1).unwrap();
            inp.write_f32(&input(3, part));
            run.chain.release(part).unwrap();
        }
        run.chain.finish().unwrap();
        drop(run);
        assert_eq!(x.read_f32(N), want(3), "{handoff:?}");
    }
}
