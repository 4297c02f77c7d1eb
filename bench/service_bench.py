#!/usr/bin/env python3
"""What the gRPC service costs, and what continuous batching buys: `spillwayd serve` against
`spillwayd run` on the same request, then aggregate tokens/s of 1, 4 and 8 concurrent streams.

Not part of CI: needs the release binaries (`cargo build --release -p spillway-daemon -p
spillway-client`) and a model file. Both tests generate from the same pseudo-random token ids
(greedy, end-of-generation ignored) so every run does the same work.

  overhead    `spillwayd run --json` and `spillway generate --json` against a daemon serving
              the same file with the same threads, alternated; medians of the decode tokens/s
              and of the time to first token each reports (the daemon's includes queueing and
              the prompt; the run's is its prompt time, as nothing queues there)
  streams     N `spillway generate` processes started together; aggregate = all generated
              tokens over the wall time from the first start to the last exit; beside it the
              streams' median time to first token (prompts, and queueing behind the others')
              and median decode tokens/s after it

    python3 bench/service_bench.py --model models/small-qwen3moe-q4_k_m.gguf --threads 2

`--vocab N` keeps the prompt ids below N (default 100,000) for models with a small vocabulary.

`--device-args` go to both `spillwayd serve` and `spillwayd run` (e.g. `"--device vulkan
--vram-budget 8GiB"`); `--streams-only` skips the overhead test (each `spillwayd run` loads
the model again).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def token_ids(n, seed, hi=100_000):
    """Deterministic ids in [1000, hi) (a 64-bit LCG), as compare_llama_cpp.py makes them."""
    x = seed * 6364136223846793005 + 1442695040888963407
    out = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
        out.append(1000 + (x >> 33) % (hi - 1000))
    return out


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("--device-args", default="", help="more arguments of serve and run")
    ap.add_argument("--streams-only", action="store_true")
    ap.add_argument("--daemon-log", help="the daemon's log (at info) goes to this file")
    ap.add_argument("--vocab", type=int, default=100_000,
                    help="prompt ids are drawn below this (at most the model's vocabulary)")
    args = ap.parse_args()
    device_args = shlex.split(args.device_args)

    spillwayd = os.path.join(args.bin, "spillwayd")
    spillway = os.path.join(args.bin, "spillway")
    ids = lambda seed: token_ids(args.prompt, seed, min(args.vocab, 100_000))
    prompt = ",".join(map(str, ids(7)))
    tmp = tempfile.mkdtemp(prefix="spillway-bench-")
    sock = os.path.join(tmp, "spillway.sock")
    max_batch = max(args.streams)
    # Without --daemon-log, its warnings and errors go to the temporary directory, and are
    # shown if it does not come up.
    daemon_log = args.daemon_log or os.path.join(tmp, "daemon.log")
    daemon = subprocess.Popen(
        [spillwayd, "serve", "--model", f"bench={args.model}", "--socket", sock,
         "--threads", str(args.threads), "--max-batch", str(max_batch),
         "--queue-depth", str(2 * max_batch), "--log-level",
         "info" if args.daemon_log else "warn"] + device_args,
        stderr=open(daemon_log, "w"),
    )
    client = [spillway, "--addr", sock, "--no-autostart"]
    try:
        # Ready when a one-token request goes through (the model list answers while loading).
        probe = client + ["generate", "--model", "bench", "--prompt-tokens", "1000",
                          "--max-tokens", "1", "--json"]
        deadline = time.time() + 120
        while subprocess.run(probe, capture_output=True).returncode != 0:
            if time.time() > deadline or daemon.poll() is not None:
                with open(daemon_log, errors="replace") as f:
                    tail = [l for l in f.read().splitlines() if not l.startswith("  ")][-8:]
                sys.exit("the daemon did not come up; its log ends:\n" + "\n".join(tail))
            time.sleep(0.2)

        gen = client + ["generate", "--model", "bench", "--prompt-tokens", prompt,
                        "--max-tokens", str(args.tokens), "--ignore-eos", "--temperature", "0",
                        "--json"]
        run = [spillwayd, "run", "--model", args.model, "--prompt-tokens", prompt,
               "--max-tokens", str(args.tokens + 1), "--ignore-eos", "--threads",
               str(args.threads), "--json"] + device_args
        run_json(gen)  # warm-up: page cache, first allocations
        served, direct = [], []
        for rep in range(0 if args.streams_only else args.reps):
            r = run_json(run)["timings"]
            direct.append((r["tokens_per_s"], r["prompt_ms"]))
            g = run_json(gen)["timings"]
            served.append((g["decode_tokens_per_second"], g["time_to_first_token_ms"]))
            print(f"  rep {rep + 1}: run {direct[-1][0]:.2f} tok/s, ttft {direct[-1][1]:.1f} ms;"
                  f" serve {served[-1][0]:.2f} tok/s, ttft {served[-1][1]:.1f} ms",
                  file=sys.stderr)
        med = lambda xs, i: statistics.median(x[i] for x in xs)
        print(f"model {os.path.basename(args.model)}, {args.threads} threads, "
              f"{args.prompt}-token prompt, {args.tokens} tokens, medians of {args.reps}, "
              f"{' '.join(device_args) or 'cpu'}\n")
        if served:
            print("| path | decode tok/s | time to first token ms |")
            print("| --- | --- | --- |")
            print(f"| spillwayd run | {med(direct, 0):.2f} | {med(direct, 1):.1f} |")
            print(f"| spillwayd serve + spillway generate | {med(served, 0):.2f} | "
                  f"{med(served, 1):.1f} |")
            print(f"\ndecode overhead {100 * (1 - med(served, 0) / med(direct, 0)):.1f}%, "
                  f"first token {med(served, 1) - med(direct, 1):+.1f} ms\n")

        # Each stream's time to first token (its prompt, and waiting for the others') and its
        # decode rate after it: with short generations the prompts are much of the wall time.
        print("| streams | generated tokens | wall s | aggregate tok/s "
              "| median first token ms | median stream decode tok/s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for n in args.streams:
            walls = []
            for _ in range(args.reps):
                start = time.time()
                procs = []
                for i in range(n):
                    p = ",".join(map(str, ids(100 + i)))
                    cmd = gen[:]
                    cmd[cmd.index("--prompt-tokens") + 1] = p
                    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
                total, ttft, decode = 0, [], []
                for p in procs:
                    out, _ = p.communicate()
                    if p.returncode != 0:
                        sys.exit(f"a stream failed with exit code {p.returncode}")
                    r = json.loads(out)
                    total += len(r["tokens"])
                    ttft.append(r["timings"]["time_to_first_token_ms"])
                    decode.append(r["timings"]["decode_tokens_per_second"])
                walls.append((time.time() - start, total, statistics.median(ttft),
                              statistics.median(decode)))
            wall, total, ttft, decode = sorted(walls)[len(walls) // 2]
            print(f"| {n} | {total} | {wall:.2f} | {total / wall:.2f} | {ttft:.1f} "
                  f"| {decode:.2f} |")
        # How the steps went: shared by several requests, carrying prompts.
        print(subprocess.run(client + ["ps"], capture_output=True, text=True).stdout)
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


if __name__ == "__main__":
    main()
