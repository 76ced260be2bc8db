"""CPU overhead of ``engine.backward`` over plain ``loss.backward()``, per parameter.

Model: ``--blocks`` blocks of LayerNorm(16) + Linear(16, 16) with a residual (4 parameters a
block), world 1, fp32, one thread, so the engine's per-parameter host work dominates and the
arithmetic is tiny. Each variant is timed with ``time.thread_time()`` (CPU time of this thread:
the VM's steal and the other processes on the 2 cores are excluded) over ``--steps`` backwards,
variants interleaved in a fresh random order each round; the overhead is the median over
rounds of (variant - plain) / parameters, in microseconds. Only backward is timed (forward
and step run outside the clock).

    python benchmarks/backward_overhead.py --rounds 15 --out benchmarks/results/backward_overhead.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from torch import nn

import zerocore
from _common import machine_info

STAGES = (0, 1, 2, 3)
TARGET_US = {0: 2.0, 1: 2.0, 2: 8.0, 3: 8.0}


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + self.lin(self.norm(x))


def make_model(blocks: int, d: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d) for _ in range(blocks)])


def stage_config(stage: int) -> dict:
    z = {"stage": stage}
    if stage == 3:  # one unit per block, nothing persistent: the FSDP2 wrapping
        z.update(stage3_unit_classes=["Block"], stage3_param_persistence_threshold=0)
    return {"train_micro_batch_size_per_gpu": 8, "zero_optimization": z,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=100)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)

    x = torch.randn(args.batch, args.dim)
    plain = make_model(args.blocks, args.dim)
    nparams = sum(1 for _ in plain.parameters())
    engines = {s: zerocore.initialize(make_model(args.blocks, args.dim), stage_config(s)) for s in STAGES}

    def run_plain() -> float:
        t = 0.0
        for _ in range(args.steps):
            plain.zero_grad(set_to_none=False)
            loss = plain(x).square().mean()
            t0 = time.thread_time()
            loss.backward()
            t += time.thread_time() - t0
        return t

    def run_engine(e) -> float:
        t = 0.0
        for _ in range(args.steps):
            loss = e(x).square().mean()
            t0 = time.thread_time()
            e.backward(loss)
            t += time.thread_time() - t0
            e.step()
        return t

    variants = {"plain": run_plain, **{f"stage{s}": (lambda e=e: run_engine(e)) for s, e in engines.items()}}
    for fn in variants.values():  # warm-up: first passes record unit orders, allocate buckets
        fn()
    per_round: dict[str, list[float]] = {k: [] for k in variants}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(variants)
        rng.shuffle(order)
        for k in order:
            per_round[k].append(variants[k]() / args.steps)
    base = per_round["plain"]
    rows = []
    for k in variants:
        over = [(v - b) / nparams * 1e6 for v, b in zip(per_round[k], base)]
        stage = None if k == "plain" else int(k[5:])
        rows.append({"variant": k, "backward_us_median": statistics.median(per_round[k]) * 1e6,
                     "overhead_us_per_param": statistics.median(over) if stage is not None else 0.0,
                     "overhead_min": min(over), "overhead_max": max(over),
                     "target_us_per_param": TARGET_US.get(stage)})
    print(f"{args.blocks} blocks, {nparams} parameters, batch {args.batch}, {args.rounds} rounds x {args.steps} "
          "backwards, thread CPU time")
    print(f"| variant | backward (us, median) | overhead us/param (median, min..max over rounds) | target |")
    print("|---|---|---|---|")
    for r in rows:
        tgt = f"<= +{r['target_us_per_param']:g}" if r["target_us_per_param"] is not None else ""
        print(f"| {r['variant']} | {r['backward_us_median']:.0f} | {r['overhead_us_per_param']:+.1f} "
              f"({r['overhead_min']:+.1f}..{r['overhead_max']:+.1f}) | {tgt} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "params": nparams, "machine": machine_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
