#!/usr/bin/env python3
"""A MoE model larger than the memory it may use, on the CPU: Spillway's RAM tier of routed
experts (`spillwayd run --ram-budget`, reads with io_uring and O_DIRECT) beside llama.cpp reading
the same GGUF file through its memory map, each process held to the same memory by a cgroup,
with the page cache dropped before every run.

Reports decode tokens/s of both, the bytes each process read from storage per token and per
second of decode (`read_bytes` of its `/proc/PID/io`), and that rate against the raw io_uring figure of the same disk
(`spillway-stream FILE --random --tile T`, run first). Runs alternate between the two, and
medians are quoted.

Not part of CI: needs root (cgroups, drop_caches) and the llama.cpp Python bindings
(`pip install llama-cpp-python`).

    python3 bench/beyond_ram.py --model M.gguf --memory 320MiB --ram-budget 64MiB \\
        --threads 2 --tokens 32 --reps 3 [--tile 288KiB]
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = [1]


def size(text):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]i?B?)?", text.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 320MiB")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[unit])


class Cgroup:
    """A memory cgroup (v2 where mounted as the unified hierarchy, else v1) with a limit."""

    def __init__(self, name, limit):
        v2 = "/sys/fs/cgroup/cgroup.controllers"
        if os.path.exists(v2):
            self.path = f"/sys/fs/cgroup/{name}"
            os.makedirs(self.path, exist_ok=True)
            self._write("memory.max", limit)
            self._write("memory.swap.max", 0, missing_ok=True)
        else:
            self.path = f"/sys/fs/cgroup/memory/{name}"
            os.makedirs(self.path, exist_ok=True)
            self._write("memory.limit_in_bytes", limit)
        self.procs = os.path.join(self.path, "cgroup.procs")

    def _write(self, file, value, missing_ok=False):
        try:
            with open(os.path.join(self.path, file), "w") as f:
                f.write(str(value))
        except FileNotFoundError:
            if not missing_ok:
                raise

    def wrap(self, cmd):
        """`cmd` run as a member of the cgroup."""
        return ["sh", "-c", f'echo $$ > {self.procs} && exec "$@"', "sh", *cmd]


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def spillway(args, cgroup, predict, seed):
    cmd = [os.path.join(args.bin, "spillwayd"), "run", "--model", args.model, "--device", "cpu",
           "--ram-budget", str(args.ram_budget), "--predict-experts", str(predict).lower(),
           "--prompt-tokens", ",".join(map(str, PROMPT)), "--max-tokens", str(args.tokens),
           # Sampled, not greedy: a random model's greedy text repeats a few tokens, whose
           # experts the cache would then hold; llama.cpp is fed varied ids likewise.
           "--ignore-eos", "--temperature", "1", "--seed", str(seed),
           "--threads", str(args.threads), "--ctx", "256",
           "--json"]
    out = subprocess.run(cgroup.wrap(cmd), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"spillwayd exited {out.returncode}: {out.stderr[-2000:]}")
    r = json.loads(out.stdout)
    t, tier = r["timings"], r["ram_tier"]
    # Decoding alone, from the first generated token on: everything the process read from
    # storage (the RAM tier's reads, read-ahead that was cancelled, page faults).
    return {"tok_s": t["tokens_per_s"],
            "bytes": r["read_bytes_at_end"] - r["read_bytes_after_prompt"],
            "tier_bytes": tier["bytes_read"] - r["ram_tier_after_prompt"]["bytes_read"],
            "seconds": t["generate_ms"] / 1e3,
            "hits": tier["hits"] / max(1, tier["hits"] + tier["misses"]),
            "wait_ms": tier.get("wait_ms", 0.0)}


def llama_worker(path, threads, tokens):
    """Child: llama.cpp through its memory map, one prompt then `tokens` single-token steps;
    prints tokens/s and the bytes this process read from storage during them."""
    import ctypes
    import llama_cpp as l

    @l.llama_log_callback
    def quiet(level, text, user_data):
        pass

    def read_bytes():
        with open("/proc/self/io") as f:
            return int(next(x for x in f if x.startswith("read_bytes:")).split()[1])

    l.llama_log_set(quiet, ctypes.c_void_p())
    l.llama_backend_init()
    mp = l.llama_model_default_params()
    # Repacking (the CPU's extra buffer types) copies the weights into anonymous memory: the
    # model would have to fit in RAM. Without it they stay in the memory map (as `--no-repack`).
    mp.use_extra_bufts = False
    model = l.llama_model_load_from_file(path.encode(), mp)
    cp = l.llama_context_default_params()
    cp.n_ctx, cp.n_threads, cp.n_threads_batch = 256, threads, threads
    # Single tokens only: a small batch keeps the output buffers (n_batch × n_vocab) small.
    cp.n_batch = cp.n_ubatch = 8
    ctx = l.llama_init_from_model(model, cp)

    def decode(ids):
        arr = (l.llama_token * len(ids))(*ids)
        if l.llama_decode(ctx, l.llama_batch_get_one(arr, len(ids))) != 0:
            raise RuntimeError("llama_decode failed")
        l.llama_synchronize(ctx)

    decode(PROMPT)
    before, t = read_bytes(), time.perf_counter()
    for i in range(tokens):
        decode([(1000 + 37 * i) % 30000])
    seconds = time.perf_counter() - t
    # Decoding alone, as for Spillway.
    print(json.dumps({"tok_s": tokens / seconds, "bytes": read_bytes() - before,
                      "seconds": seconds}))


def llama(args, cgroup):
    cmd = [sys.executable, os.path.abspath(__file__), "--llama-worker", args.model,
           "--threads", str(args.threads), "--tokens", str(args.tokens)]
    out = subprocess.run(cgroup.wrap(cmd), capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"llama.cpp exited {out.returncode}: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def raw_uring(args):
    """The reader's own figure on this disk at the experts' tile size, shuffled: GB/s."""
    cmd = [os.path.join(args.bin, "spillway-stream"), args.model, "--random", "--tile",
           args.tile, "--runs", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("| Uring"))
    return float(line.split("|")[2])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--memory", type=size, help="the cgroup's limit for each process")
    p.add_argument("--ram-budget", type=size)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tile", default="288KiB", help="the experts' tile size, for the raw figure")
    p.add_argument("--bin", default=os.path.join(ROOT, "target", "release"))
    p.add_argument("--llama-worker")
    a = p.parse_args()
    if a.llama_worker:
        return llama_worker(a.llama_worker, a.threads, a.tokens)

    raw = raw_uring(a)
    cgroup = Cgroup("spillway-beyond-ram", a.memory)
    runs = {"spillway, next layer read ahead": [], "spillway": [], "llama.cpp (mmap)": []}
    for rep in range(a.reps):
        for name in runs:
            drop_caches()
            if name == "llama.cpp (mmap)":
                r = llama(a, cgroup)
            else:
                r = spillway(a, cgroup, predict=name != "spillway", seed=rep + 1)
            runs[name].append(r)
            print(f"rep {rep} {name}: {json.dumps(r)}", file=sys.stderr, flush=True)

    model_mib = os.path.getsize(a.model) / (1 << 20)
    print(f"{os.path.basename(a.model)} ({model_mib:.0f} MiB), cgroup limit "
          f"{a.memory / (1 << 20):.0f} MiB per process, RAM budget {a.ram_budget / (1 << 20):.0f} "
          f"MiB, {a.threads} threads, {a.tokens} tokens after a {len(PROMPT)}-token prompt, "
          f"median of {a.reps}; raw io_uring {raw:.2f} GB/s")
    print("| engine | tok/s | MB read / token | disk GB/s while decoding | of raw io_uring |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = statistics.median(r["tok_s"] for r in runs["llama.cpp (mmap)"])
    for name, rs in runs.items():
        tok_s = statistics.median(r["tok_s"] for r in rs)
        # Per token evaluated in the window (tok/s is evaluations over its seconds).
        per_token = statistics.median(r["bytes"] / (r["tok_s"] * r["seconds"]) for r in rs) / 1e6
        rate = statistics.median(r["bytes"] / r["seconds"] for r in rs) / 1e9
        print(f"| {name} | {tok_s:.2f} ({tok_s / base:.2f}×) | {per_token:.1f} | {rate:.2f} | "
              f"{rate / raw:.0%} |")


if __name__ == "__main__":
    main()
