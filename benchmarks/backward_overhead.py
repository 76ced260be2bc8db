"""CPU overhead of the engine's forward and ``engine.backward`` over plain torch, per parameter.

Model: ``--blocks`` blocks, each ``--params-per-block`` / 4 pairs of LayerNorm(16) + Linear(16, 16)
with a residual (4 parameters a pair; 4 a block by default), world 1, fp32, one thread, so the
engine's host work dominates and the arithmetic is tiny. At stage 3 each block is one unit: with
``--params-per-block 12`` the unit count stays and the parameters triple, which tells a cost per
parameter from a cost per unit. Each variant is timed with ``time.thread_time()`` (CPU time of
this thread: the VM's steal and the other processes on the 2 cores are excluded) over ``--steps``
steps, variants interleaved in a fresh random order each round. Two clocks per step: the forward
as users call it (``engine(x)``, stage 3's gathers and hooks included; plain: ``model(x)``) and
the backward (``engine.backward(loss)``; plain: ``loss.backward()``); the loss and the optimizer
step run outside both. The overhead is the median over rounds of (variant - plain) / parameters,
in microseconds, for each clock. ``--loss-backward`` adds, for each stage, the same engine driven by
``loss.backward()`` (DeepSpeed's torch-style backward: the engine's backward opened and closed by autograd's
hooks, runtime/torch_backward.py) instead of ``engine.backward(loss)``.

    python benchmarks/backward_overhead.py --rounds 15 --out benchmarks/results/backward_overhead.json
    python benchmarks/backward_overhead.py --rounds 15 --params-per-block 12
    python benchmarks/backward_overhead.py --rounds 15 --loss-backward
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
TARGET_US = {0: 2.0, 1: 2.0, 2: 8.0, 3: 8.0}  # backward
FORWARD_TARGET_US = {3: 8.0}  # forward: only stage 3 does work in forward (gathers, hooks)


class Block(nn.Module):
    """``pairs`` x (LayerNorm + Linear), one residual: 4 parameters per pair."""

    def __init__(self, d: int, pairs: int = 1):
        super().__init__()
        if pairs == 1:  # the attribute names of the 4-parameter block (kept for older results' models)
            self.norm = nn.LayerNorm(d)
            self.lin = nn.Linear(d, d)
            self.layers = [(self.norm, self.lin)]
        else:
            self.norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(pairs))
            self.lins = nn.ModuleList(nn.Linear(d, d) for _ in range(pairs))
            self.layers = list(zip(self.norms, self.lins))

    def forward(self, x):
        h = x
        for norm, lin in self.layers:
            h = lin(norm(h))
        return x + h


def make_model(blocks: int, d: int, params_per_block: int = 4) -> nn.Module:
    if params_per_block < 4 or params_per_block % 4:
        raise ValueError(f"params_per_block must be a positive multiple of 4 (LayerNorm + Linear pairs), "
                         f"got {params_per_block}")
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d, params_per_block // 4) for _ in range(blocks)])


def stage_config(stage: int) -> dict:
    z = {"stage": stage}
    if stage == 3:  # one unit per block, nothing persistent: the FSDP2 wrapping
        z.update(stage3_unit_classes=["Block"], stage3_param_persistence_threshold=0)
    return {"train_micro_batch_size_per_gpu": 8, "zero_optimization": z,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=100)
    ap.add_argument("--params-per-block", type=int, default=4,
                    help="parameters per block (= per stage-3 unit), a multiple of 4 (LayerNorm + Linear pairs)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--loss-backward", action="store_true",
                    help="also each stage with loss.backward() instead of engine.backward(loss)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.params_per_block < 4 or args.params_per_block % 4:
        ap.error(f"--params-per-block must be a positive multiple of 4, got {args.params_per_block}")
    torch.set_num_threads(1)

    def model():
        return make_model(args.blocks, args.dim, args.params_per_block)

    x = torch.randn(args.batch, args.dim)
    plain = model()
    nparams = sum(1 for _ in plain.parameters())
    engines = {f"stage{s}": zerocore.initialize(model(), stage_config(s)) for s in STAGES}
    if args.loss_backward:
        engines.update({f"stage{s}_loss_backward": zerocore.initialize(model(), stage_config(s)) for s in STAGES})

    def run_plain() -> tuple[float, float]:
        fwd = bwd = 0.0
        for _ in range(args.steps):
            plain.zero_grad(set_to_none=False)
            t0 = time.thread_time()
            out = plain(x)
            fwd += time.thread_time() - t0
            loss = out.square().mean()
            t0 = time.thread_time()
            loss.backward()
            bwd += time.thread_time() - t0
        return fwd, bwd

    def run_engine(e, torch_style: bool) -> tuple[float, float]:
        fwd = bwd = 0.0
        for _ in range(args.steps):
            t0 = time.thread_time()
            out = e(x)
            fwd += time.thread_time() - t0
            loss = out.square().mean()
            t0 = time.thread_time()
            if torch_style:
                loss.backward()
            else:
                e.backward(loss)
            bwd += time.thread_time() - t0
            e.step()
        return fwd, bwd

    variants = {"plain": run_plain, **{k: (lambda e=e, k=k: run_engine(e, k.endswith("_loss_backward")))
                                       for k, e in engines.items()}}
    for fn in variants.values():  # warm-up: first passes record unit orders, allocate buckets
        fn()
    per_round: dict[str, dict[str, list[float]]] = {k: {"forward": [], "backward": []} for k in variants}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = list(variants)
        rng.shuffle(order)
        for k in order:
            fwd, bwd = variants[k]()
            per_round[k]["forward"].append(fwd / args.steps)
            per_round[k]["backward"].append(bwd / args.steps)
    base = per_round["plain"]
    rows = []
    for k in variants:
        stage = None if k == "plain" else int(k[5])
        row = {"variant": k}
        for clock, prefix, targets in (("backward", "", TARGET_US), ("forward", "forward_", FORWARD_TARGET_US)):
            over = [(v - b) / nparams * 1e6 for v, b in zip(per_round[k][clock], base[clock])]
            if stage is None:
                over = [0.0] * len(over)
            row.update({f"{clock}_us_median": statistics.median(per_round[k][clock]) * 1e6,
                        f"{prefix}overhead_us_per_param": statistics.median(over),
                        f"{prefix}overhead_min": min(over), f"{prefix}overhead_max": max(over),
                        f"{prefix}target_us_per_param": targets.get(stage)})
        rows.append(row)
    print(f"{args.blocks} blocks x {args.params_per_block} parameters = {nparams} parameters, batch {args.batch}, "
          f"{args.rounds} rounds x {args.steps} steps, thread CPU time")
    print("| variant | backward (us, median) | backward overhead us/param (median, min..max over rounds) | target "
          "| forward (us, median) | forward overhead us/param (median, min..max) | target |")
    print("|---|---|---|---|---|---|---|")

    def tgt(v):
        return f"<= +{v:g}" if v is not None else ""

    for r in rows:
        print(f"| {r['variant']} | {r['backward_us_median']:.0f} | {r['overhead_us_per_param']:+.1f} "
              f"({r['overhead_min']:+.1f}..{r['overhead_max']:+.1f}) | {tgt(r['target_us_per_param'])} "
              f"| {r['forward_us_median']:.0f} | {r['forward_overhead_us_per_param']:+.1f} "
              f"({r['forward_overhead_min']:+.1f}..{r['forward_overhead_max']:+.1f}) "
              f"| {tgt(r['forward_target_us_per_param'])} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "params": nparams, "units": args.blocks, "machine": machine_info(),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
