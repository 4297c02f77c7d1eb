//! What a host turn in the middle of a step costs: a chain of `parts` command buffers
//! ([`spillway_daemon::gpu::chain`]), each of `work` small dependent dispatches, where the host
//! waits for each part, writes 8 KiB to mapped memory (a MoE layer's CPU sum) and releases the
//! next, as a decode step with experts on the CPU does once per MoE layer. The same dispatches
//! as one submission (recorded once, submitted and waited for) give the device's own time; the
//! difference over the parts is the turn's (the device's wait for the host and the host's for
//! the device). A chain's own recording is timed apart.
//!
//! Each handoff (`semaphores`, `events`) runs `reps` chains; medians are printed.
//!
//! `cargo run --release -p spillway-bench --example vulkan_handoff [-- parts=48 work=4 reps=9]`

use std::time::Instant;

use spillway_daemon::gpu::chain::Handoff;
use spillway_daemon::gpu::{Allocator, Buffer, Device, Instance, Kernels, MemoryUse, Recorder};

const N: u32 = 2048;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let (mut parts, mut work, mut reps) = (48usize, 4usize, 9usize);
    for a in std::env::args().skip(1) {
        let (k, v) = a.split_once('=').expect("parts=N, work=N or reps=N");
        let v: usize = v.parse().expect("a number");
        match k {
            "parts" => parts = v.max(2),
            "work" => work = v.max(1),
            "reps" => reps = v.max(1),
            other => panic!("{other}=: parts, work or reps"),
        }
    }
    let device = Device::open(Instance::new().unwrap(), None).unwrap();
    println!("device: {}", device.info().name);
    let alloc = Allocator::new(&device, None);
    let kernels = Kernels::new(&device);
    let x = Buffer::new_in(&alloc, u64::from(N) * 4, MemoryUse::DeviceLocal).unwrap();
    let mut sum = Buffer::new_host_visible(&device, u64::from(N) * 4).unwrap();
    let host_sum: Vec<f32> = (0..N).map(|i| i as f32 * 1e-6).collect();
    sum.write_f32(&host_sum);
    let record_part = |rec: &mut Recorder<'_>, sum: &Buffer| {
        for _ in 0..work {
            rec.scale_add(&x, sum, 1.0, N)?;
        }
        Ok(())
    };

    // The device's own time: every part's dispatches in one submission, recorded once and
    // submitted again, waited for.
    let one = kernels
        .record_replay(|rec| {
            for _ in 0..parts {
                record_part(rec, &sum)?;
            }
            Ok(())
        })
        .unwrap();
    let mut times = Vec::new();
    for _ in 0..reps + 1 {
        let t = Instant::now();
        one.run().unwrap();
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    times.remove(0);
    let one = median(times);
    println!(
        "| handoff | parts | dispatches a part | µs a chain (submitted to done) | recording µs | µs a part | turn µs beyond one submission |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    println!(
        "| one submission | {parts} | {work} | {one:.0} | | {:.1} | |",
        one / parts as f64
    );
    // A submission a part, each waited for by its fence: how a step's host turns went before
    // chains, and how a dense model's rows shared over the bus still go.
    let part = kernels.record_replay(|rec| record_part(rec, &sum)).unwrap();
    let mut times = Vec::new();
    for _ in 0..reps + 1 {
        let t = Instant::now();
        for _ in 0..parts {
            sum.write_f32(&host_sum);
            part.run().unwrap();
        }
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    times.remove(0);
    let separate = median(times);
    println!(
        "| a submission a part | {parts} | {work} | {separate:.0} | | {:.1} | {:.1} |",
        separate / parts as f64,
        (separate - one) / (parts - 1) as f64
    );
    drop(part);
    for handoff in [Handoff::Semaphores, Handoff::Events] {
        let (mut runs, mut recs) = (Vec::new(), Vec::new());
        for _ in 0..reps + 1 {
            let t = Instant::now();
            let (mut run, _) = kernels
                .start_chain(handoff, parts, |_, rec| record_part(rec, &sum))
                .unwrap();
            let submitted = Instant::now();
            for i in 1..parts {
                run.chain.wait(i - 1).unwrap();
                // What a CPU expert sum costs to hand over: written after the device's part.
                sum.write_f32(&host_sum);
                run.chain.release(i).unwrap();
            }
            run.chain.finish().unwrap();
            runs.push(submitted.elapsed().as_secs_f64() * 1e6);
            recs.push((submitted - t).as_secs_f64() * 1e6);
        }
        runs.remove(0);
        recs.remove(0);
        let (chain, rec) = (median(runs), median(recs));
        println!(
            "| {handoff:?} | {parts} | {work} | {chain:.0} | {rec:.0} | {:.1} | {:.1} |",
            chain / parts as f64,
            (chain - one) / (parts - 1) as f64
        );
    }
}
