#!/usr/bin/env python3
"""Trains Spillway's default model: a small Qwen3-MoE on the King James Bible.

Reads the token files `spillway-train prepare` wrote (ids from the engine's own tokenizer) and
trains a model laid out exactly as the engine's `qwen3moe` forward pass computes it: RMSNorm,
grouped-query attention with per-head QK-norm and rotary embeddings over the two halves of each
head (the NeoX layout), routed SwiGLU experts (softmax router, top-k, weights renormalised to sum
to one), tied input and output embeddings. Writes, into --out:

- model.safetensors: f32 weights under their GGUF names, shapes [out, in] (row-major);
- config.json: the hyper-parameters `spillway-train export` needs;
- settings.json: every setting of this run; loss.csv: the loss curve;
- check.json: the log-probabilities this model gives a fixed token sequence, which
  `compare.py` holds against the engine's on the exported file.

The weights kept are those of the best held-out loss seen. Needs PyTorch (a CUDA GPU makes
it minutes).
"""

import argparse
import json
import math
import struct
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="prepare's output folder")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--n-embd", type=int, default=384)
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-head", type=int, default=6)
    p.add_argument("--n-head-kv", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--n-expert", type=int, default=8)
    p.add_argument("--n-expert-used", type=int, default=2)
    p.add_argument("--n-ff-expert", type=int, default=256)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rope-base", type=float, default=10000.0)
    p.add_argument("--rms-eps", type=float, default=1e-6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=1800)
    p.add_argument("--max-minutes", type=float, default=3.0, help="fit the schedule into this")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.2)
    p.add_argument("--dropout", type=float, default=0.3)
    p.add_argument("--balance", type=float, default=0.01, help="load-balancing loss weight")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args()


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope(x, cos, sin):
    """Rotates dimension i with i + d/2 of each head (the NeoX layout Qwen uses)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.h, self.hkv, self.hd = a.n_head, a.n_head_kv, a.head_dim
        self.q = nn.Linear(a.n_embd, self.h * self.hd, bias=False)
        self.k = nn.Linear(a.n_embd, self.hkv * self.hd, bias=False)
        self.v = nn.Linear(a.n_embd, self.hkv * self.hd, bias=False)
        self.o = nn.Linear(self.h * self.hd, a.n_embd, bias=False)
        self.q_norm = RMSNorm(self.hd, a.rms_eps)
        self.k_norm = RMSNorm(self.hd, a.rms_eps)
        self.dropout = a.dropout

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_norm(self.q(x).view(b, t, self.h, self.hd)).transpose(1, 2)
        k = self.k_norm(self.k(x).view(b, t, self.hkv, self.hd)).transpose(1, 2)
        v = self.v(x).view(b, t, self.hkv, self.hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        rep = self.h // self.hkv
        k = k.repeat_interleave(rep, dim=1)  # query head h reads key/value head h // rep
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.o(y.transpose(1, 2).reshape(b, t, self.h * self.hd))


class Experts(nn.Module):
    """Routed SwiGLU experts. Training computes every expert for every token and weights the
    chosen ones (the others get weight zero): the same result as running only the chosen ones,
    and simple at this size."""

    def __init__(self, a):
        super().__init__()
        e, d, f = a.n_expert, a.n_embd, a.n_ff_expert
        self.k = a.n_expert_used
        self.router = nn.Linear(d, e, bias=False)
        self.gate = nn.Parameter(torch.randn(e, f, d) * 0.02)
        self.up = nn.Parameter(torch.randn(e, f, d) * 0.02)
        self.down = nn.Parameter(torch.randn(e, d, f) * 0.02 / math.sqrt(2 * a.n_layer))

    def forward(self, x):
        b, t, d = x.shape
        x = x.reshape(b * t, d)
        probs = F.softmax(self.router(x).float(), dim=-1)
        w, idx = probs.topk(self.k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(1, idx, w)
        h = F.silu(torch.einsum("nd,efd->nef", x, self.gate)) * torch.einsum("nd,efd->nef", x, self.up)
        y = torch.einsum("nef,edf->ned", h, self.down)
        out = torch.einsum("ne,ned->nd", gates.type_as(y), y)
        # Switch-style balance: fraction routed to each expert times its mean probability.
        n_e = probs.shape[-1]
        routed = torch.zeros_like(probs).scatter(1, idx, 1.0).mean(0) / self.k
        balance = n_e * (routed * probs.mean(0)).sum()
        return out.reshape(b, t, d), balance


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attn_norm = RMSNorm(a.n_embd, a.rms_eps)
        self.attn = Attention(a)
        self.ffn_norm = RMSNorm(a.n_embd, a.rms_eps)
        self.moe = Experts(a)
        self.drop = nn.Dropout(a.dropout)

    def forward(self, x, cos, sin):
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin))
        y, balance = self.moe(self.ffn_norm(x))
        return x + self.drop(y), balance


class Model(nn.Module):
    def __init__(self, a, n_vocab):
        super().__init__()
        self.a = a
        self.embd = nn.Embedding(n_vocab, a.n_embd)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.n_layer))
        self.norm = RMSNorm(a.n_embd, a.rms_eps)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * a.n_layer) if name.endswith("o.weight") else 0.02
                nn.init.normal_(p, std=std)
        half = a.head_dim // 2
        inv = a.rope_base ** (-torch.arange(0, half, dtype=torch.float64) * 2 / a.head_dim)
        ang = torch.arange(a.context, dtype=torch.float64)[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos().float(), persistent=False)
        self.register_buffer("sin", ang.sin().float(), persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embd(ids)
        balance = 0.0
        for blk in self.blocks:
            x, bal = blk(x, cos, sin)
            balance = balance + bal
        x = self.norm(x)
        return x @ self.embd.weight.t(), balance / len(self.blocks)

    def gguf_tensors(self):
        """Every weight under its GGUF name, shaped [out, in] as PyTorch keeps them."""
        out = {"token_embd.weight": self.embd.weight}
        for i, b in enumerate(self.blocks):
            p = f"blk.{i}."
            out.update({
                p + "attn_norm.weight": b.attn_norm.weight,
                p + "attn_q.weight": b.attn.q.weight,
                p + "attn_k.weight": b.attn.k.weight,
                p + "attn_v.weight": b.attn.v.weight,
                p + "attn_output.weight": b.attn.o.weight,
                p + "attn_q_norm.weight": b.attn.q_norm.weight,
                p + "attn_k_norm.weight": b.attn.k_norm.weight,
                p + "ffn_norm.weight": b.ffn_norm.weight,
                p + "ffn_gate_inp.weight": b.moe.router.weight,
                p + "ffn_gate_exps.weight": b.moe.gate,
                p + "ffn_up_exps.weight": b.moe.up,
                p + "ffn_down_exps.weight": b.moe.down,
            })
        out["output_norm.weight"] = self.norm.weight
        return out


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.detach().float().cpu().contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    a = parse_args()
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    a.out.mkdir(parents=True, exist_ok=True)
    train = torch.from_numpy(np.fromfile(a.data / "train.u16", dtype="<u2").astype(np.int64))
    val = torch.from_numpy(np.fromfile(a.data / "val.u16", dtype="<u2").astype(np.int64))
    n_vocab = int(json.loads((a.data / "vocab.json").read_text())["n_vocab"])
    model = Model(a, n_vocab).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params / 1e6:.2f}M parameters, {len(train)} training tokens, {len(val)} held out, {dev}")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr, betas=(0.9, 0.95),
    )
    amp = torch.autocast(dev, dtype=torch.bfloat16) if dev == "cuda" else torch.autocast("cpu", enabled=False)
    T = a.context
    val_windows = val[: (len(val) // T) * T].view(-1, T + 0)

    def lr_at(step):
        if step < a.warmup:
            return a.lr * (step + 1) / a.warmup
        r = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
        return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * r))

    @torch.no_grad()
    def val_loss():
        model.eval()
        total, n = 0.0, 0
        for chunk in val_windows.split(16):
            chunk = chunk.to(dev)
            with amp:
                logits, _ = model(chunk[:, :-1])
            total += F.cross_entropy(logits.float().reshape(-1, n_vocab), chunk[:, 1:].reshape(-1), reduction="sum").item()
            n += chunk[:, 1:].numel()
        model.train()
        return total / n

    log = ["step,train_loss,val_loss,lr,seconds"]
    best, best_state, best_step = float("inf"), None, 0
    start = time.time()
    running = None
    step = 0
    while step <= a.steps:
        if step % a.eval_every == 0 or step == a.steps:
            vl = val_loss()
            elapsed = time.time() - start
            log.append(f"{step},{running if running is not None else float('nan'):.4f},{vl:.4f},{lr_at(step):.6f},{elapsed:.1f}")
            print(log[-1], flush=True)
            if vl < best:
                best, best_step = vl, step
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if step == a.steps or elapsed > a.max_minutes * 60:
                break
        starts = torch.randint(0, len(train) - T - 1, (a.batch,))
        batch = torch.stack([train[s : s + T + 1] for s in starts]).to(dev)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with amp:
            logits, balance = model(batch[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, n_vocab), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        (loss + a.balance * balance).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if step == 31:
            # Fit the schedule into --max-minutes: the cosine decay ends when the time does.
            per_step = (time.time() - start) / 31
            fits = int(a.max_minutes * 60 * 0.92 / per_step)
            if fits < a.steps:
                print(f"{per_step * 1000:.0f} ms a step: {fits} steps fit, not {a.steps}", flush=True)
                a.steps = fits

    model.load_state_dict(best_state)
    model.eval()
    print(f"best held-out loss {best:.4f} (perplexity {math.exp(best):.2f}) at step {best_step}")
    (a.out / "loss.csv").write_text("\n".join(log) + "\n")
    write_safetensors(a.out / "model.safetensors", model.gguf_tensors())
    config = {
        "n_vocab": n_vocab, "n_embd": a.n_embd, "n_layer": a.n_layer, "n_head": a.n_head,
        "n_head_kv": a.n_head_kv, "head_dim": a.head_dim, "n_expert": a.n_expert,
        "n_expert_used": a.n_expert_used, "n_ff_expert": a.n_ff_expert, "context": a.context,
        "rope_base": a.rope_base, "rms_eps": a.rms_eps,
    }
    (a.out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()}
    settings.update(parameters=n_params, best_val_loss=best, best_step=best_step, steps_run=step,
                    seconds=round(time.time() - start, 1), device=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                    torch=torch.__version__)
    (a.out / "settings.json").write_text(json.dumps(settings, indent=1) + "\n")

    # Reference log-probabilities (f32, no autocast) of the first held-out tokens.
    ids = val[:64].to(dev)
    with torch.no_grad():
        logits, _ = model.float()(ids[None])
    lp = F.log_softmax(logits[0].double(), dim=-1)
    top = lp.topk(5, dim=-1)
    check = {
        "tokens": ids.tolist(),
        "top": [[[int(t), float(v)] for t, v in zip(ti, vi)] for ti, vi in zip(top.indices.tolist(), top.values.tolist())],
    }
    (a.out / "check.json").write_text(json.dumps(check) + "\n")


if __name__ == "__main__":
    main()
