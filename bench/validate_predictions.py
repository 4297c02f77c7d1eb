#!/usr/bin/env python3
"""The scheduler's predictions against measured decode steps: per-layer times and tokens/s.

For each model: a daemon serves it with the given hardware profile, `spillway profile --json`
measures decode steps (`--reps` times; per-layer means over each run's steps, then the median
over runs), and `spillwayd plan --json` predicts the same placement on the same profile at the
same context position:

  --device cpu                 the plan for the CPU alone
  --device vulkan              the placement the daemon runs (`plan --resident-experts`): every
                               tensor in VRAM but the routed experts it has no room for, which
                               run on the CPU

A layer's measured time is the sum of its rows (`blk.N`); `head` is the rows outside the blocks
(embedding, output norm and head); a GPU step's host-side totals (`cpu_experts`, `host_wait`)
overlap the layers, which wait for them, and are left out. Printed: per layer, predicted against measured; the median
relative error over the layers (the bar is 15%); predicted against measured tokens/s (20%),
measured by `spillway generate` (greedy, `--gen-tokens`), each run right before a profile so
that the profile finds the device at its working clocks.

Not part of CI: needs release binaries and a profile from `spillwayd calibrate`.

    python3 bench/validate_predictions.py --profile ~/.cache/spillway/profiles/X.toml \\
        --device cpu --threads 2 models/llama-3.2-1b-q4_0.gguf
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw).stdout


def wait_for(sock, proc, seconds=600):
    end = time.time() + seconds
    while time.time() < end:
        if proc.poll() is not None:
            sys.exit(f"spillwayd exited with {proc.returncode}")
        if os.path.exists(sock):
            return
        time.sleep(0.2)
    sys.exit("spillwayd did not start")


def wait_loaded(spillway, sock, name, proc, seconds=900):
    """Until `spillway models` lists `name` as ready."""
    end = time.time() + seconds
    while time.time() < end:
        if proc.poll() is not None:
            sys.exit(f"spillwayd exited with {proc.returncode}")
        r = subprocess.run([spillway, "models", "--addr", sock, "--no-autostart"],
                           capture_output=True, text=True)
        if r.returncode == 0 and any(l.split()[:1] == [name] for l in r.stdout.splitlines()):
            return
        time.sleep(0.5)
    sys.exit(f"{name} did not load")


# A GPU step's host-side totals: they overlap the GPU's layers (whose times include waiting
# for them), so they belong to no layer.
HOST_TOTALS = {"cpu_experts", "host_wait"}


def measured_layers(profile):
    """Per-layer mean microseconds of one profile run: `blk.N` and `head`."""
    out = {}
    for r in profile["rows"]:
        if r["op"] in HOST_TOTALS:
            continue
        name = "head" if r["layer"] is None else f"blk.{r['layer']}"
        out[name] = out.get(name, 0.0) + r["mean_us"]
    return out


def resident_experts(spillway, sock):
    """Experts per layer the daemon holds in VRAM, from `spillway ps`; None when all are."""
    text = run([spillway, "ps", "--addr", sock, "--no-autostart"])
    m = re.search(r"experts (\d+) of (\d+) per layer in VRAM", text)
    if m and int(m.group(1)) < int(m.group(2)):
        return int(m.group(1))
    return None


def validate(args, path, bins):
    spillwayd, spillway = bins
    name = "m"
    tmp = tempfile.mkdtemp(prefix="spillway-validate-")
    sock = os.path.join(tmp, "s.sock")
    cmd = [spillwayd, "serve", "--socket", sock, "--model", f"{name}={path}",
           "--threads", str(args.threads), "--device", args.device,
           "--hardware-profile", args.profile, "--log-level", "warn"]
    if args.vram_budget:
        cmd += ["--vram-budget", args.vram_budget]
    if args.ram_budget:
        cmd += ["--ram-budget", args.ram_budget]
    daemon = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    try:
        wait_for(sock, daemon)
        runs, generated = [], []
        wait_loaded(spillway, sock, name, daemon)
        # The decode speed unprofiled, from `spillway generate`; each profile runs right after
        # one, so that its steps find the device busy and at its clocks, as served steps do (a
        # device idle since the load clocks down, and a short run would time its ramp: on an
        # H100 a first generate after the load ran at 0.6 of the next ones).
        prompt = ",".join(str(1 + (7 * i) % 1000) for i in range(args.tokens))
        gen = [spillway, "generate", "--addr", sock, "--no-autostart", "--model", name,
               "--prompt-tokens", prompt, "--max-tokens", str(args.gen_tokens),
               "--ignore-eos", "--temperature", "0", "--json"]
        run(gen)  # unmeasured: the device's clocks come up from the idle of the load
        for _ in range(args.reps):
            generated.append(json.loads(run(gen))["timings"]["decode_tokens_per_second"])
            out = run([spillway, "profile", "--addr", sock, "--no-autostart", "--model", name,
                       "--tokens", str(args.tokens), "--steps", str(args.steps), "--json"])
            runs.append(json.loads(out))
        resident = resident_experts(spillway, sock) if args.device != "cpu" else None
    finally:
        daemon.terminate()
        daemon.wait()

    per_run = [measured_layers(r) for r in runs]
    measured = {k: statistics.median(p[k] for p in per_run) for k in per_run[0]}
    profiled_tps = statistics.median(r["decode_tokens_per_second"] for r in runs)
    tps = statistics.median(generated)

    # Decode steps run at positions tokens .. tokens+steps-1: predict at their middle.
    context = args.tokens + args.steps // 2
    plan_cmd = [spillwayd, "plan", "--model", path, "--profile", args.profile, "--json",
                "--context", str(context), "--device", args.device]
    if args.device == "cpu":
        pass
    else:
        plan_cmd += ["--vram-budget", args.vram_budget or args.plan_vram]
    if args.ram_budget:
        plan_cmd += ["--ram-budget", args.ram_budget]
    if args.device != "cpu":
        # The daemon's placement: everything in VRAM but the routed experts it has no room for.
        plan_cmd += ["--resident-experts", str(resident if resident is not None else 1 << 30)]
    plan_text = run(plan_cmd)
    plan = json.loads(plan_text)
    if args.keep:
        # The raw figures behind the table: each profile run and the plan, per model.
        stem = os.path.join(args.keep, os.path.splitext(os.path.basename(path))[0])
        os.makedirs(args.keep, exist_ok=True)
        with open(stem + "-plan.json", "w") as f:
            f.write(plan_text)
        with open(stem + "-profiles.json", "w") as f:
            json.dump(runs, f)
    predicted = {l["name"]: l["total_s"] * 1e6 for l in plan["layers"]}

    errors = []
    print(f"\n{os.path.basename(path)} on {args.device}"
          + (f", {resident} experts per layer in VRAM" if resident is not None else "")
          + f": {len(runs)} runs of {args.steps} decode steps after {args.tokens} prompt tokens")
    print(f"{'layer':>8} {'predicted µs':>13} {'measured µs':>12} {'error':>7}")
    for name_, m in measured.items():
        p = predicted.get(name_)
        if p is None:
            continue
        e = (p - m) / m
        errors.append(abs(e))
        print(f"{name_:>8} {p:13.1f} {m:12.1f} {100 * e:+6.1f}%")
    med = statistics.median(errors)
    tps_err = (plan["tokens_per_s"] - tps) / tps
    print(f"median relative error of {len(errors)} layers: {100 * med:.1f}% (bar 15%)")
    print(f"tokens/s: predicted {plan['tokens_per_s']:.2f}, measured {tps:.2f} "
          f"({100 * tps_err:+.1f}%, bar 20%; {profiled_tps:.2f} in the profiled steps)")
    return {"model": os.path.basename(path), "device": args.device, "resident": resident,
            "layers": len(errors), "median_error": med, "predicted_tps": plan["tokens_per_s"],
            "measured_tps": tps, "profiled_tps": profiled_tps, "tps_error": tps_err}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--profile", required=True, help="hardware profile TOML")
    ap.add_argument("--device", default="cpu", help="cpu, vulkan or vulkan:N")
    ap.add_argument("--vram-budget")
    ap.add_argument("--plan-vram", default="2GiB",
                    help="VRAM the plan may use when --vram-budget is not given")
    ap.add_argument("--ram-budget")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--gen-tokens", type=int, default=64,
                    help="tokens generated unprofiled for the measured tokens/s")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("--json", help="also write the summary rows to this file")
    ap.add_argument("--keep", help="also write each model's profiles and plan to this folder")
    args = ap.parse_args()
    bins = (os.path.join(args.bin, "spillwayd"), os.path.join(args.bin, "spillway"))
    rows = [validate(args, os.path.abspath(m), bins) for m in args.models]
    print("\n| model | device | layers | median layer error | predicted tok/s | measured tok/s | error |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        dev = r["device"] + (f", {r['resident']} experts/layer in VRAM" if r["resident"] is not None else "")
        print(f"| {r['model']} | {dev} | {r['layers']} | {100 * r['median_error']:.1f}% | "
              f"{r['predicted_tps']:.2f} | {r['measured_tps']:.2f} | {100 * r['tps_error']:+.1f}% |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
