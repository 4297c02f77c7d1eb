#!/usr/bin/env python3
"""Load Spillway's synthetic GGUF models with llama.cpp and check they are real models to it.

Not part of CI: needs the llama.cpp Python bindings (`pip install llama-cpp-python`) and, for
the real-size presets, a file system with sparse files. For every job (preset, weight type,
sparse or not) it generates the file with the release `spillway-bench`, reads our own view of it
with `spillwayd inspect --json`, then, in a child process with a timeout, loads it with
llama.cpp (mmap), tokenizes a sentence, evaluates a few tokens and reads the last logits. It
prints one table row per job and deletes each file afterwards unless --keep.

    python3 scripts/check_llama_cpp.py                 # tiny presets + llama-3.2-1b Q4_0 + sparse
    python3 scripts/check_llama_cpp.py --only tiny     # just the tiny presets
    python3 scripts/check_llama_cpp.py --jobs qwen3-30b-a3b:Q4_K_M --eval-timeout 900

Columns: vocab/embd "ok" when llama.cpp's n_vocab/n_embd equal ours; "ids<V" when every token id
llama.cpp produced for the test sentence is below the vocabulary size; "round" when detokenizing
gives the sentence back; "merge" is tokens per byte of the sentence (well below 1 when our merges
merge); logits shows whether the last token's logits are all finite, and their std.
"""

import argparse
import json
import os
import subprocess
import sys
import time

TEXT = "The river rose slowly through the night, and the keeper opened the spillway at 10:45."
TINY = ["tiny-llama", "tiny-mixtral", "tiny-qwen3", "tiny-qwen3moe"]
TINY_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"]
REAL_DENSE = [("llama-3.2-1b", "Q4_0"), ("qwen3-0.6b", "Q4_K_M")]
REAL_SPARSE = ["llama-3.2-1b", "llama-3-8b", "qwen3-0.6b", "qwen3-30b-a3b", "mixtral-8x7b",
               "qwen3-235b-a22b"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(path, n_eval, threads, extra_bufts):
    """Runs in a subprocess: load with llama.cpp, tokenize, eval, print one JSON line."""
    import ctypes
    import math

    import llama_cpp as l

    out = {"loaded": False}

    @l.llama_log_callback
    def quiet(level, text, user_data):  # llama.cpp logs a lot; errors come back as results
        pass

    l.llama_log_set(quiet, ctypes.c_void_p())
    l.llama_backend_init()
    mp = l.llama_model_default_params()
    mp.load_mode = l.LLAMA_LOAD_MODE_MMAP
    # Without extra buffer types the CPU uses weights in place from the map instead of
    # repacking them into RAM, which a 130 GB model would not fit in.
    mp.use_extra_bufts = extra_bufts
    t0 = time.time()
    model = l.llama_model_load_from_file(path.encode(), mp)
    out["load_s"] = round(time.time() - t0, 2)
    if not model:
        print(json.dumps(out))
        return
    out["loaded"] = True
    vocab = l.llama_model_get_vocab(model)
    n_vocab = l.llama_vocab_n_tokens(vocab)
    out["n_vocab"] = n_vocab
    out["n_embd"] = l.llama_model_n_embd(model)

    text = TEXT.encode()
    toks = (l.llama_token * 512)()
    n = l.llama_tokenize(vocab, text, len(text), toks, 512, True, False)
    ids = list(toks[: max(n, 0)])
    out["n_tokens"] = len(ids)
    out["ids_in_vocab"] = n > 0 and all(0 <= i < n_vocab for i in ids)
    buf = ctypes.create_string_buffer(4096)
    m = l.llama_detokenize(vocab, toks, n, buf, 4096, True, False)
    out["roundtrip"] = m > 0 and buf.raw[:m].decode("utf-8", "replace").strip() == TEXT
    out["merge_ratio"] = round(len(ids) / len(text), 3)

    cp = l.llama_context_default_params()
    cp.n_ctx = 256
    cp.n_batch = 256
    cp.n_threads = threads
    cp.n_threads_batch = threads
    ctx = l.llama_init_from_model(model, cp)
    if not ctx:
        out["error"] = "context"
        print(json.dumps(out))
        return
    k = min(n_eval, len(ids))
    batch_ids = (l.llama_token * k)(*ids[:k])
    t0 = time.time()
    rc = l.llama_decode(ctx, l.llama_batch_get_one(batch_ids, k))
    out["eval_s"] = round(time.time() - t0, 2)
    out["eval_tokens"] = k
    if rc != 0:
        out["error"] = f"decode returned {rc}"
        print(json.dumps(out))
        return
    logits = l.llama_get_logits_ith(ctx, -1)
    values = [logits[i] for i in range(n_vocab)]
    out["logits_finite"] = all(math.isfinite(v) for v in values)
    mean = sum(values) / n_vocab
    out["logits_std"] = round(math.sqrt(sum((v - mean) ** 2 for v in values) / n_vocab), 4)
    out["argmax"] = max(range(n_vocab), key=values.__getitem__)
    l.llama_free(ctx)
    l.llama_model_free(model)
    print(json.dumps(out))


def human(n):
    for unit in ["B", "KiB", "MiB", "GiB", "TiB"]:
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def ours(spillwayd, path):
    """Our own reading of the file: vocabulary size and width, from `spillwayd inspect`."""
    js = json.loads(subprocess.run([spillwayd, "inspect", "--json", path], check=True,
                                   capture_output=True, text=True).stdout)
    arch = js["architecture"]
    hp = {e["key"]: e["value"] for e in js["hyperparameters"]}
    return {"n_vocab": js["tokenizer"]["vocab_size"], "n_embd": hp[f"{arch}.embedding_length"],
            "params": js["total_params"]}


def run_job(args, preset, wtype, sparse):
    name = f"{preset}-{wtype}{'-sparse' if sparse else ''}.gguf"
    path = os.path.join(args.work, name)
    row = {"preset": preset, "type": wtype, "sparse": sparse}
    t0 = time.time()
    cmd = [args.bench, "synth", "--preset", preset, "--type", wtype, "--seed", "1", "-o", path]
    gen = subprocess.run(cmd + (["--sparse"] if sparse else []), capture_output=True, text=True)
    row["gen_s"] = round(time.time() - t0, 1)
    if gen.returncode != 0:
        row["error"] = "synth: " + gen.stderr.strip()[-200:]
        return row
    st = os.stat(path)
    row["size"], row["on_disk"] = st.st_size, st.st_blocks * 512
    try:
        row["ours"] = ours(args.spillwayd, path)
        big = st.st_size > 8 << 30
        cmd = [sys.executable, __file__, "--child", path, "--n-eval",
               str(2 if big else args.n_eval), "--threads", str(args.threads)]
        if not big:
            cmd.append("--extra-bufts")
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.eval_timeout)
        lines = [x for x in res.stdout.splitlines() if x.startswith("{")]
        if lines:
            row["llama"] = json.loads(lines[-1])
        else:
            row["error"] = f"llama.cpp child exit {res.returncode}: {res.stderr.strip()[-200:]}"
    except subprocess.TimeoutExpired:
        row["error"] = f"timeout after {args.eval_timeout}s"
    finally:
        if not args.keep:
            os.remove(path)
    return row


def fmt_row(r):
    mark = lambda b: "ok" if b else "NO"  # noqa: E731
    size = human(r.get("size", 0))
    if r.get("sparse"):
        size += f" ({human(r.get('on_disk', 0))} on disk)"
    ll, us = r.get("llama", {}), r.get("ours", {})
    if not ll.get("loaded"):
        return [r["preset"], r["type"], size, "NO", "-", "-", "-", "-", "-", "-", "-",
                r.get("error", "load failed")]
    vocab = f"{mark(ll['n_vocab'] == us.get('n_vocab'))} {ll['n_vocab']}"
    embd = f"{mark(ll['n_embd'] == us.get('n_embd'))} {ll['n_embd']}"
    logits = "-"
    if "logits_finite" in ll:
        logits = f"{mark(ll['logits_finite'])} std {ll['logits_std']}"
    ev = f"{ll.get('eval_tokens', 0)} tok {ll.get('eval_s', '-')}s" if "eval_s" in ll else "-"
    return [r["preset"], r["type"], size, "ok", vocab, embd, mark(ll["ids_in_vocab"]),
            mark(ll["roundtrip"]), str(ll["merge_ratio"]), logits, ev,
            r.get("error", ll.get("error", ""))]


def print_table(rows):
    head = ["preset", "type", "file", "load", "n_vocab", "n_embd", "ids<V", "round", "merge",
            "logits", "eval", "note"]
    cells = [head] + [fmt_row(r) for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(head))]
    for i, c in enumerate(cells):
        print("| " + " | ".join(x.ljust(w[j]) for j, x in enumerate(c)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (x + 2) for x in w) + "|")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--extra-bufts", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--n-eval", type=int, default=8, help="tokens to evaluate (2 for >8 GiB)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bench", default=os.path.join(ROOT, "target/release/spillway-bench"))
    ap.add_argument("--spillwayd", default=os.path.join(ROOT, "target/release/spillwayd"))
    ap.add_argument("--work", default="/tmp/spillway-llama-check")
    ap.add_argument("--only", choices=["tiny", "dense", "sparse"], action="append",
                    help="job groups to run (default: all)")
    ap.add_argument("--jobs", nargs="*", help="explicit PRESET:TYPE[:sparse] jobs")
    ap.add_argument("--eval-timeout", type=int, default=900, help="seconds per llama.cpp child")
    ap.add_argument("--no-build", action="store_true", help="use the binaries as they are")
    ap.add_argument("--keep", action="store_true", help="keep the generated files")
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.n_eval, args.threads, args.extra_bufts)
        return

    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "-p", "spillway-bench", "-p",
                        "spillway-daemon"], cwd=ROOT, check=True)
    os.makedirs(args.work, exist_ok=True)
    jobs = []
    if args.jobs:
        for j in args.jobs:
            parts = j.split(":")
            jobs.append((parts[0], parts[1] if len(parts) > 1 else "Q4_K_M",
                         len(parts) > 2 and parts[2] == "sparse"))
    else:
        groups = args.only or ["tiny", "dense", "sparse"]
        if "tiny" in groups:
            jobs += [(p, t, False) for p in TINY for t in TINY_TYPES]
        if "dense" in groups:
            jobs += [(p, t, False) for p, t in REAL_DENSE]
        if "sparse" in groups:
            jobs += [(p, "Q4_K_M", True) for p in REAL_SPARSE]

    rows = []
    for preset, wtype, sparse in jobs:
        t0 = time.time()
        rows.append(run_job(args, preset, wtype, sparse))
        print(f"# {preset} {wtype}{' sparse' if sparse else ''}: {time.time() - t0:.0f}s",
              file=sys.stderr, flush=True)
    import llama_cpp
    print(f"llama-cpp-python {llama_cpp.__version__}, {args.threads} threads, text: {TEXT!r}")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = [r for r in rows if not r.get("llama", {}).get("logits_finite")]
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
