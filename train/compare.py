#!/usr/bin/env python3
"""Holds the engine's log-probabilities on an exported model against PyTorch's.

    compare.py CHECK_JSON ENGINE_JSON [--tolerance T]

CHECK_JSON is train.py's check.json (top-5 log-probabilities after each prefix of a token
sequence); ENGINE_JSON is what `spillwayd run --prompt-tokens ... --prompt-logprobs 5 --json`
printed for the same tokens. Exits non-zero when the most likely next token differs at any
position or a log-probability differs by more than T.
"""

import argparse
import json
import sys


def main():
    p = argparse.ArgumentParser()
    p.add_argument("check")
    p.add_argument("engine")
    p.add_argument("--tolerance", type=float, default=0.02)
    a = p.parse_args()
    ref = json.load(open(a.check))
    got = json.load(open(a.engine))
    if got["prompt_tokens"] != ref["tokens"]:
        sys.exit("the engine ran other tokens than the check")
    worst, argmax_diff = 0.0, 0
    for pos, (r, g) in enumerate(zip(ref["top"], got["prompt_logprobs"])):
        gmap = {e["token"]: e["logprob"] for e in g}
        if r[0][0] != g[0]["token"]:
            argmax_diff += 1
        for tok, lp in r[:3]:
            if tok in gmap:
                worst = max(worst, abs(gmap[tok] - lp))
    n = min(len(ref["top"]), len(got["prompt_logprobs"]))
    print(f"{n} positions: most likely token differs at {argmax_diff}; "
          f"largest log-probability difference {worst:.5f}")
    if argmax_diff or worst > a.tolerance:
        sys.exit(1)


if __name__ == "__main__":
    main()
