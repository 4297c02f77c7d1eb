#!/usr/bin/env python3
"""CPU speed of Spillway against llama.cpp: same GGUF file, same threads, interleaved runs.

Not part of CI: needs the llama.cpp Python bindings (`pip install llama-cpp-python`) and the
release binaries (`cargo build --release -p spillway-daemon -p spillway-bench`). Measures the
two tests of `llama-bench`:

  pp512  one evaluation of 512 prompt tokens (llama.cpp: one llama_decode with n_batch =
         n_ubatch = 512, logits of the last token only; Spillway: `spillwayd run
         --prompt-tokens <512 ids> --max-tokens 1`, its `timings.prompt_tokens_per_s`, which
         excludes loading the model)
  tg128  128 single-token evaluations after a short prompt (llama.cpp: 128 llama_decode calls
         of one token; Spillway: `--max-tokens 129 --ignore-eos`, whose 128 evaluations are
         timed in `timings.tokens_per_s`; greedy sampling of each token is included there)

Token ids are the same for both engines: a fixed pseudo-random sequence below 100,000 (under
every real preset's vocabulary and clear of the special tokens; below the vocabulary for the
tiny presets). llama.cpp runs in one worker process
per model that loads the model once, warms up (one 32-token batch and one single-token decode)
and then answers "pp"/"tg" requests, so repetitions alternate Spillway, llama.cpp, Spillway,
llama.cpp... and the noise of a shared machine hits both alike. Spillway starts one process per
measurement (each loads the model from the page cache, outside the timed part); a warm-up run of
Spillway per model comes first and is not counted. Reported figures are medians.

    python3 bench/compare_llama_cpp.py                       # 3 models, 2 threads, 3 repetitions
    python3 bench/compare_llama_cpp.py --reps 1 --threads 2 --jobs llama-3.2-1b:Q4_0
    python3 bench/compare_llama_cpp.py --json > out.json
"""

import argparse
import ctypes
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JOBS = ["llama-3.2-1b:Q4_0", "llama-3.2-1b:Q4_K_M", "small-qwen3moe:Q4_K_M"]
N_PROMPT = 512
N_GEN = 128
N_SHORT = 8  # prompt before tg128
N_CTX = 1024


def token_ids(n, seed, hi=100_000):
    """Deterministic ids in [1000, hi) with variety (a 64-bit LCG)."""
    x = seed * 6364136223846793005 + 1442695040888963407
    out = []
    for _ in range(n):
        x = (x * 6364136223846793005 + 1442695040888963407) & (2**64 - 1)
        out.append(1000 + (x >> 33) % (hi - 1000))
    return out


def test_ids(n_vocab):
    """(pp512 prompt, tg128's short prompt, what llama.cpp feeds during tg128 — llama-bench
    feeds random ids): below 100,000, or below the vocabulary for the tiny presets."""
    hi = min(100_000, n_vocab)
    return token_ids(N_PROMPT, 1, hi), token_ids(N_SHORT, 2, hi), token_ids(N_GEN, 3, hi)


# ---------------------------------------------------------------- llama.cpp worker (child)

def worker(path, threads):
    """Child process: load the model once, then answer one JSON request per stdin line."""
    import llama_cpp as l

    @l.llama_log_callback
    def quiet(level, text, user_data):
        pass

    l.llama_log_set(quiet, ctypes.c_void_p())
    l.llama_backend_init()
    mp = l.llama_model_default_params()
    t0 = time.time()
    model = l.llama_model_load_from_file(path.encode(), mp)
    if not model:
        print(json.dumps({"error": "load failed"}), flush=True)
        return
    cp = l.llama_context_default_params()
    cp.n_ctx = N_CTX
    cp.n_batch = N_PROMPT
    cp.n_ubatch = N_PROMPT
    cp.n_threads = threads
    cp.n_threads_batch = threads
    ctx = l.llama_init_from_model(model, cp)
    mem = l.llama_get_memory(ctx)
    n_vocab = l.llama_vocab_n_tokens(l.llama_model_get_vocab(model))
    PP_IDS, SHORT_IDS, GEN_IDS = test_ids(n_vocab)

    def decode(ids):
        arr = (l.llama_token * len(ids))(*ids)
        rc = l.llama_decode(ctx, l.llama_batch_get_one(arr, len(ids)))
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        l.llama_synchronize(ctx)

    def pp():
        l.llama_memory_clear(mem, True)
        t = time.perf_counter()
        decode(PP_IDS)
        return N_PROMPT / (time.perf_counter() - t)

    def tg():
        l.llama_memory_clear(mem, True)
        decode(SHORT_IDS)
        t = time.perf_counter()
        for tok in GEN_IDS:
            decode([tok])
        return N_GEN / (time.perf_counter() - t)

    # Warm-up as llama-bench does (a batch and a single token), not timed.
    l.llama_memory_clear(mem, True)
    decode(PP_IDS[:32])
    decode([PP_IDS[32]])
    print(json.dumps({"ready": True, "load_s": round(time.time() - t0, 2), "n_vocab": n_vocab,
                      "flash_attn_type": int(getattr(cp, "flash_attn_type", -99))}), flush=True)
    for line in sys.stdin:
        req = line.strip()
        if req == "quit" or not req:
            break
        print(json.dumps({"tok_s": pp() if req == "pp" else tg()}), flush=True)


class LlamaWorker:
    def __init__(self, path, threads):
        self.p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", path, "--threads", str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self.p.stdout.readline())
        if "error" in self.info:
            raise RuntimeError(f"llama.cpp: {self.info['error']} for {path}")

    def run(self, test):
        self.p.stdin.write(test + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())["tok_s"]

    def close(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        self.p.wait()


# ---------------------------------------------------------------- Spillway

def spillway(spillwayd, path, test, threads, n_vocab):
    PP_IDS, SHORT_IDS, _ = test_ids(n_vocab)
    if test == "pp":
        ids, n = PP_IDS, 1
    else:
        ids, n = SHORT_IDS, N_GEN + 1
    cmd = [spillwayd, "run", "--model", path, "--prompt-tokens", ",".join(map(str, ids)),
           "--max-tokens", str(n), "--threads", str(threads), "--ctx", str(N_CTX),
           "--ignore-eos", "--json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    report = json.loads(out.strip().splitlines()[-1])
    t = report["timings"]
    if test == "tg" and len(report["tokens"]) != N_GEN + 1:
        raise RuntimeError(f"spillwayd generated {len(report['tokens'])} tokens, wanted {N_GEN + 1}")
    return t["prompt_tokens_per_s"] if test == "pp" else t["tokens_per_s"]


# ---------------------------------------------------------------- driver

def ensure_model(bench, preset, wtype):
    os.makedirs(os.path.join(ROOT, "models"), exist_ok=True)
    path = os.path.join(ROOT, "models", f"{preset}-{wtype.lower()}.gguf")
    if not os.path.exists(path):
        print(f"generating {path}", file=sys.stderr)
        subprocess.run([bench, "synth", "--preset", preset, "--type", wtype, "-o", path],
                       check=True)
    return path


def machine_info():
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import llama_cpp
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", nargs="+", default=DEFAULT_JOBS, help="preset:TYPE ...")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tests", nargs="+", default=["pp", "tg"], choices=["pp", "tg"])
    ap.add_argument("--spillwayd", default=os.path.join(ROOT, "target/release/spillwayd"))
    ap.add_argument("--bench", default=os.path.join(ROOT, "target/release/spillway-bench"))
    ap.add_argument("--json", action="store_true", help="print JSON instead of the table")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.threads)
        return

    info = machine_info()
    rows = []
    for job in args.jobs:
        preset, wtype = job.split(":")
        path = ensure_model(args.bench, preset, wtype)
        lw = LlamaWorker(path, args.threads)
        print(f"{job}: llama.cpp loaded in {lw.info['load_s']} s; warming up Spillway",
              file=sys.stderr)
        n_vocab = lw.info["n_vocab"]
        spillway(args.spillwayd, path, "tg", args.threads, n_vocab)  # warm-up, not counted
        samples = {t: {"spillway": [], "llama.cpp": []} for t in args.tests}
        for rep in range(args.reps):
            for test in args.tests:
                s = spillway(args.spillwayd, path, test, args.threads, n_vocab)
                c = lw.run(test)
                samples[test]["spillway"].append(s)
                samples[test]["llama.cpp"].append(c)
                print(f"  rep {rep + 1} {test}: spillway {s:.2f} tok/s, llama.cpp {c:.2f} tok/s",
                      file=sys.stderr)
        lw.close()
        for test in args.tests:
            s = statistics.median(samples[test]["spillway"])
            c = statistics.median(samples[test]["llama.cpp"])
            rows.append({
                "model": preset, "type": wtype,
                "test": f"pp{N_PROMPT}" if test == "pp" else f"tg{N_GEN}",
                "threads": args.threads, "spillway_tok_s": round(s, 2),
                "llama_cpp_tok_s": round(c, 2), "ratio": round(s / c, 3),
                "samples": {k: [round(v, 2) for v in vs] for k, vs in samples[test].items()},
                "file_mib": round(os.path.getsize(path) / 2**20, 1),
            })

    if args.json:
        print(json.dumps({"machine": info, "reps": args.reps, "rows": rows}, indent=1))
        return
    print(f"date: {info['date']}; CPU: {info['cpu']}, {info['cores']} cores; "
          f"llama-cpp-python {info['llama_cpp_python']}")
    print(f"llama.cpp system info: {info['llama_cpp_system_info']}")
    print(f"medians of {args.reps} interleaved repetitions\n")
    print("| model | type | test | threads | spillway tok/s | llama.cpp tok/s | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['type']} | {r['test']} | {r['threads']} | "
              f"{r['spillway_tok_s']:.2f} | {r['llama_cpp_tok_s']:.2f} | {r['ratio']:.2f} |")


if __name__ == "__main__":
    main()
