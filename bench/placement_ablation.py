#!/usr/bin/env python3
"""The scheduler's placement against static policies, at the same VRAM budget: decode tokens/s
of an offloaded MoE model on the GPU, each policy run in turn (`--reps` rounds, interleaved),
medians reported.

  cpu      one expert slot per layer: every other routed expert on the CPU (llama.cpp's
           `--n-cpu-moe` at all layers, but for the one slot)
  layers   whole layers' experts in VRAM from the last layer back, the others on the CPU
           (llama.cpp's `--n-cpu-moe N` at the same budget)
  lru      the budget's slots spread evenly, a miss copied into a slot, least recently used
           evicted (caching alone)
  even     the budget's slots spread evenly, misses on the CPU (the daemon's default)
  planned  the scheduler's plan on --hardware-profile: its VRAM experts per layer, misses on
           the CPU

Not part of CI: needs a GPU, release binaries and a model file.

    python3 bench/placement_ablation.py --model q30.gguf --vram-budget 8GiB --threads 16 \\
        --hardware-profile h200.toml
"""

import argparse
import json
import os
import statistics
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

POLICIES = {
    "cpu": ["--expert-layout", "cpu"],
    "layers": ["--expert-layout", "layers"],
    "lru": ["--expert-layout", "even", "--moe-miss", "fetch", "--expert-cache", "lru"],
    "even": ["--expert-layout", "even"],
    "planned": ["--expert-layout", "planned"],
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--vram-budget", required=True)
    ap.add_argument("--hardware-profile", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated a run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES))
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release"))
    args = ap.parse_args()

    spillwayd = os.path.join(args.bin, "spillwayd")
    prompt = ",".join(str(1000 + 37 * i) for i in range(16))
    got = {p: [] for p in args.policies}
    experts = {}
    for rep in range(args.reps):
        for p in args.policies:
            cmd = [spillwayd, "run", "--model", args.model, "--device", "vulkan",
                   "--vram-budget", args.vram_budget, "--threads", str(args.threads),
                   "--prompt-tokens", prompt, "--max-tokens", str(args.tokens),
                   "--ignore-eos", "--json", *POLICIES[p]]
            if p == "planned":
                cmd += ["--hardware-profile", args.hardware_profile]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                print(f"{p}: failed: {r.stderr.strip()[-300:]}")
                continue
            out = json.loads(r.stdout)
            got[p].append(out["timings"]["tokens_per_s"])
            experts[p] = out.get("experts")
            print(f"round {rep + 1} {p}: {got[p][-1]:.2f} tok/s", flush=True)
    print(f"\n{os.path.basename(args.model)}, VRAM budget {args.vram_budget}, "
          f"{args.threads} threads, {args.tokens} tokens a run, medians of {args.reps}")
    print("| policy | decode tok/s (median) | runs | slots per layer (mean) | hits | CPU | fetched |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for p in args.policies:
        if not got[p]:
            print(f"| {p} | failed | | | | | |")
            continue
        e = experts.get(p) or {}
        runs = ", ".join(f"{x:.2f}" for x in got[p])
        print(f"| {p} | {statistics.median(got[p]):.2f} | {runs} | {e.get('slots_per_layer', '-')} | "
              f"{e.get('hits', '-')} | {e.get('cpu', '-')} | {e.get('fetched', '-')} |")


if __name__ == "__main__":
    main()
