"""``engine.compile()`` against eager at ZeRO stages 2 and 3 (issue 35): step time and what Dynamo did.

Model: zerocore.demo.TinyGPT (tied embedding head), one rank (world 1), fp32 on CPU, bf16 on CUDA; stage 3 is
configured as the demo does (one unit per ``Block`` plus the root, vectors under ``4*dim+1`` elements kept whole,
prefetch one block ahead). Variants: stage 2 and 3, eager and ``engine.compile()`` (``--stage3-compile whole``
compiles the whole module at stage 3 instead, ``engine.module.compile()``: what ``engine.compile()`` did before
stage 3 compiled each unit on its own).

Protocol: every variant is built (same seed) and warmed up (``--warmup`` steps; the first is the compile), then
the variants take turns in ``--rounds`` rounds of ``--steps`` timed steps, in a fresh random order each round
(interleaved against the VM's drift). A step = forward + cross-entropy + ``engine.backward`` + ``engine.step``.
Python's cyclic collector runs before each variant's turn and is off during it (a collection landing in one
variant's steps and not another's was a spread of its own). The compiled / eager ratio is reported two ways:
the medians over all timed steps, and paired by round (each round's compiled median over the same round's eager
median: the drift between rounds cancels), with the paired ratios' median and range; the target is read from the
paired median.

Dynamo, per variant (counted around that variant's own steps, Dynamo's counters cleared before each):
- first step: graph breaks (``counters["graph_break"]``), unique graphs (``counters["stats"]["unique_graphs"]``),
  frames compiled (``counters["frames"]["total"]``);
- the later steps (warm-up after the first, and the timed ones), per step: recompilations (frames compiled again
  after a guard failed: the reasons are kept, ``TORCH_LOGS=recompiles`` prints them too), new unique graphs, new
  graph breaks.

    python benchmarks/compile_stage3.py --out benchmarks/results/compile_stage3_cpu_2026-11-26.json
    python benchmarks/compile_stage3.py --device cuda --dim 512 --layers 8 --ctx 256 --batch 8
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine_info, paired_by_round, summary  # noqa: E402

VARIANTS = ("stage2_eager", "stage2_compiled", "stage3_eager", "stage3_compiled", "stage3_compiled_checks")
# stage3_compiled_checks: engine.compile() with Inductor's generated-code checks on (torch's defaults), which
# the units' compile turns off (zerocore/sharding/gatherer.py, unit_compile_kwargs): what that saves, measured


class DynamoCounts:
    """Recompilations (with their guard-failure reasons), graph breaks, unique graphs and frames compiled
    between ``clear()`` and ``read()``. Recompilations are seen where Dynamo computes their reasons (a frame
    compiled while it has cache entries already)."""

    def __init__(self):
        import torch._dynamo.convert_frame as cf

        self.reasons: list[str] = []
        self._cf = cf
        # a private Dynamo function: in torch 2.11-2.13; a torch without it counts no recompilation
        # reasons ("recompiles_counted": False in the results), the other counters still work
        self._orig = getattr(cf, "get_and_maybe_log_recompilation_reasons", None)
        if self._orig is None:
            return

        def counted(*args, **kwargs):
            reasons = self._orig(*args, **kwargs)
            self.reasons.append(reasons[0] if reasons else "(no reason found)")
            return reasons

        cf.get_and_maybe_log_recompilation_reasons = counted

    def close(self) -> None:
        if self._orig is not None:
            self._cf.get_and_maybe_log_recompilation_reasons = self._orig

    def clear(self) -> None:
        from torch._dynamo.utils import counters
        counters.clear()
        self.reasons = []

    def read(self) -> dict:
        from torch._dynamo.utils import counters
        return {"graph_breaks": sum(counters["graph_break"].values()),
                "unique_graphs": counters["stats"]["unique_graphs"],
                "frames_compiled": counters["frames"]["total"],
                "recompiles": len(self.reasons), "recompiles_counted": self._orig is not None,
                "recompile_reasons": list(self.reasons)}


def zero_section(stage: int, dim: int, model) -> dict:
    z = {"stage": stage, "reduce_bucket_size": int(5e8), "overlap_comm": True}
    if stage == 3:  # as zerocore.demo.zero_config: one unit per Block, vectors whole, prefetch one block ahead
        persist = 4 * dim + 1
        block = sum(p.numel() for p in model.blocks[0].parameters() if p.numel() >= persist)
        z.update(stage3_param_persistence_threshold=persist, stage3_unit_classes=["Block"],
                 stage3_prefetch_bucket_size=block)
    return z


class Variant:
    def __init__(self, name: str, args, device: torch.device):
        import zerocore
        from zerocore.demo import TinyGPT

        self.name = name
        stage = int(name[5])
        self.compiled = "compiled" in name
        torch.manual_seed(0)
        model = TinyGPT(args.vocab, dim=args.dim, layers=args.layers, heads=args.heads, ctx=args.ctx).to(device)
        cfg = {"train_micro_batch_size_per_gpu": args.batch, "zero_optimization": zero_section(stage, args.dim, model),
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
        if device.type == "cuda":
            cfg["bf16"] = {"enabled": True}
        self.engine = zerocore.initialize(model, cfg)
        if self.compiled:
            if stage == 3 and args.stage3_compile == "whole":
                self.engine.module.compile()
            elif name.endswith("_checks"):
                self.engine.compile(compile_kwargs={"options": {"size_asserts": True, "alignment_asserts": True,
                                                                "scalar_asserts": True}})
            else:
                self.engine.compile()
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self, x, y) -> float:
        e = self.engine
        logits = e(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        e.backward(loss)
        e.step()
        self.sync()
        return loss.item()


def run(args) -> dict:
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    counts = DynamoCounts()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.ctx + 1), generator=gen).to(device) for _ in range(4)]
    variants = {v: Variant(v, args, device) for v in args.variants}
    dyn = {v: {"first_step": None, "later": []} for v in variants}
    losses = {v: [] for v in variants}
    times = {v: [] for v in variants}
    first_s = {}

    def one(v: str, i: int, timed: bool) -> None:
        b = batches[i % len(batches)]
        counts.clear()
        t0 = time.perf_counter()
        loss = variants[v](b[:, :-1], b[:, 1:])
        dt = time.perf_counter() - t0
        c = counts.read()
        if dyn[v]["first_step"] is None:
            dyn[v]["first_step"] = c
            first_s[v] = dt
        else:
            dyn[v]["later"].append(c)
        if timed:
            times[v][-1].append(dt)
        losses[v].append(loss)

    for v in variants:
        for i in range(args.warmup):
            one(v, i, False)
    for r in range(args.rounds):
        order = list(variants)
        random.Random(r).shuffle(order)
        for v in order:
            times[v].append([])
            gc.collect()
            gc.disable()
            try:
                for i in range(args.steps):
                    one(v, i, True)
            finally:
                gc.enable()
    counts.close()
    out = {"machine": machine_info(), "device": args.device, "args": vars(args), "variants": {}}
    for v in variants:
        flat = [t for rnd in times[v] for t in rnd]
        later = dyn[v]["later"]
        n = max(1, len(later))
        reasons = sorted({r for c in later for r in c["recompile_reasons"]})
        out["variants"][v] = {
            **summary(flat), "round_medians_ms": [statistics.median(rnd) * 1e3 for rnd in times[v]],
            "first_step_s": first_s[v], "first_step": {k: dyn[v]["first_step"][k] for k in
                                                       ("graph_breaks", "unique_graphs", "frames_compiled",
                                                        "recompiles")},
            "later_steps": len(later),
            "per_later_step": {k: sum(c[k] for c in later) / n for k in
                               ("recompiles", "unique_graphs", "graph_breaks", "frames_compiled")},
            "recompile_reasons": reasons, "losses": losses[v]}
    for s in (2, 3):
        e, c = out["variants"].get(f"stage{s}_eager"), out["variants"].get(f"stage{s}_compiled")
        if e and c:
            out[f"stage{s}_compiled_over_eager"] = c["median_ms"] / e["median_ms"]
            out[f"stage{s}_compiled_over_eager_paired"] = paired_by_round(times[f"stage{s}_compiled"],
                                                                          times[f"stage{s}_eager"])
    c, k = out["variants"].get("stage3_compiled"), out["variants"].get("stage3_compiled_checks")
    if c and k:
        out["stage3_compiled_over_compiled_checks"] = c["median_ms"] / k["median_ms"]
    return out


def table(res: dict) -> str:
    lines = ["| variant | step median ms | spread % | first step s | 1st: breaks | 1st: unique graphs | "
             "later, per step: recompiles | unique graphs | breaks |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v, r in res["variants"].items():
        f, p = r["first_step"], r["per_later_step"]
        lines.append(f"| {v} | {r['median_ms']:.2f} | {r['spread_pct']:.0f} | {r['first_step_s']:.2f} | "
                     f"{f['graph_breaks']} | {f['unique_graphs']} | {p['recompiles']:.2f} | {p['unique_graphs']:.2f} | "
                     f"{p['graph_breaks']:.2f} |")
    for s in (2, 3):
        k = f"stage{s}_compiled_over_eager"
        if k in res:
            p = res[k + "_paired"]
            lines.append(f"\nstage {s}: compiled / eager = {res[k]:.2f}x (all steps' medians); paired by round "
                         f"{p['round_median']:.2f}x (range {p['round_min']:.2f}-{p['round_max']:.2f}, "
                         f"{len(p['per_round'])} rounds)")
    if "stage3_compiled_over_compiled_checks" in res:
        lines.append(f"stage 3 compiled: without / with Inductor's generated-code checks = "
                     f"{res['stage3_compiled_over_compiled_checks']:.3f}x")
    for v, r in res["variants"].items():
        for reason in r["recompile_reasons"]:
            lines.append(f"{v} recompiled: {reason}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant, the first compiles")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant per round")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS[:4]))
    ap.add_argument("--stage3-compile", choices=("engine", "whole"), default="engine",
                    help="stage 3 compiled by engine.compile() (default) or engine.module.compile() (the whole module)")
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args(argv)
    res = run(args)
    print(table(res))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
