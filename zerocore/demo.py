"""`zerocore demo`: train a small character-level GPT on the corpus shipped in the package,
with a progress bar, the loss, and the time per step.

Today it trains in one process with zerocore's FusedAdam against torch.optim.AdamW's result
on the same data (the ZeRO stages arrive with the engine).
"""
from __future__ import annotations

import argparse
import math
import os
import time

import torch
from torch import nn


def load_corpus() -> str:
    path = os.path.join(os.path.dirname(__file__), "data", "corpus.txt")
    with open(path, encoding="ascii") as f:
        return "".join(line for line in f if not line.startswith("# "))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 128, layers: int = 2, heads: int = 4, ctx: int = 64):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(ctx, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        nn.init.normal_(self.tok.weight, std=0.02)  # N(0,1) would make the tied logits huge

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .ops import FusedAdam, active_isa

    text = load_corpus()
    chars = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
    torch.manual_seed(args.seed)
    model = TinyGPT(len(chars), args.dim, args.layers, ctx=args.ctx)
    opt = FusedAdam(model.parameters(), lr=args.lr, weight_decay=0.01)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"zerocore demo: {n_params / 1e6:.2f}M-parameter char GPT on {len(text) / 1e3:.0f} KB of text, "
          f"FusedAdam ({active_isa()}), {torch.get_num_threads()} threads, 1 process")
    gen = torch.Generator().manual_seed(args.seed)
    losses, times = [], []
    bar = tqdm(range(args.steps), desc="train", unit="step")
    for _ in bar:
        starts = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), generator=gen)
        x = torch.stack([data[s:s + args.ctx] for s in starts])
        y = torch.stack([data[s + 1:s + args.ctx + 1] for s in starts])
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    first = sum(losses[:10]) / min(10, len(losses))
    last = sum(losses[-10:]) / min(10, len(losses))
    med = sorted(times)[len(times) // 2]
    print(f"loss {first:.3f} -> {last:.3f} (uniform guess {math.log(len(chars)):.3f}); "
          f"median step {med * 1e3:.1f} ms")
    if not last < first:
        print("error: the loss did not go down")
        return 1
    return 0
